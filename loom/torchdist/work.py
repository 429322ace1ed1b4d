"""Work objects of the ``"loom"`` backend: done at once, or completed by the process's progress thread.

A blocking operation (and every small one) returns work that is already complete; a large asynchronous one is
posted non-blocking and handed to one :class:`~loom.comm.ProgressThread` per process (:func:`later`), which
tests it while the caller computes, runs the copy into the caller's tensors, and completes the work's future.

Timeouts, as torch's works have them: a work carries its group's timeout. The progress thread gives up on a
request that runs past it (the request stays referenced: MPI may still write into its buffers) and fails the
future; ``wait()`` then raises ``DistBackendError`` naming the operation, the group and the timeout, and the
group is unusable from then on (its ranks no longer agree on which operation comes next), as a gloo group
whose operation timed out. ``wait(timeout)`` with a shorter timeout raises as torch's works do but leaves the
operation posted: a later ``wait`` completes it.
"""

from __future__ import annotations

import datetime
import threading
from typing import Any, Callable

import torch.distributed as dist
from torch.futures import Future

from loom.comm import CommError, CommTimeoutError, ProgressThread, Request

__all__ = ["LoomWork", "later", "chain", "join", "engine", "seconds"]

_ENGINE: ProgressThread | None = None
_STRANDED: list[Request] = []  # posted on a communicator found broken: MPI may still write into their buffers


def engine() -> ProgressThread | None:
    """The process's progress thread, or ``None`` where MPI allows no second thread (then every op blocks)."""
    global _ENGINE
    if _ENGINE is None and ProgressThread.available():
        _ENGINE = ProgressThread(name="loom-torch-progress")  # spins while anything is in flight
    return _ENGINE


def _done_future(value: Any) -> Future:
    fut = Future()
    fut.set_result(value)
    return fut


def _failure(work: "LoomWork", exc: BaseException) -> BaseException:
    """The error ``wait()`` raises for a failed operation: a timeout or transport failure as torch's
    ``DistBackendError`` naming the operation and the group; anything else (a user error) as it is."""
    if isinstance(exc, CommError):
        peer = f" from rank {work._source}" if work._op == "recv" and work._source >= 0 else ""
        err = dist.DistBackendError(f"the loom backend's {work._op}{peer} on group {work._group!r}: {exc}")
        err.__cause__ = exc
        return err
    return exc


class LoomWork(dist.Work):
    """An operation of the loom process group: done at once, or completed by the progress thread.

    ``wait()`` blocks (without MPI calls of its own) until the future is complete and raises its error;
    ``result()`` gives the output tensors; ``_source_rank()`` the sender of a ``recv`` from any source.
    """

    _op = "operation"  # torch's name of the operation and the group's, for messages (set by the process group)
    _group = ""

    def __init__(self, outputs: list, fut: Future | None = None, source: int = -1):
        super().__init__()
        self._outputs = outputs
        self._fut = fut  # None: done (its future is made only if asked for: most blocking calls never are)
        self._source = source

    def wait(self, timeout=None) -> bool:
        """Block until done and raise the operation's error. ``timeout``: a ``datetime.timedelta`` or seconds;
        ``None`` or zero (torch's default, ``kNoTimeout``): until the operation completes or its group's timeout
        fails it. Past a ``timeout`` given here, ``RuntimeError`` naming the operation and the timeout, as torch's
        works raise; the operation stays posted (a later ``wait`` completes it). Where MPI allows no progress
        thread, every operation completed before its work was returned, so there is nothing to time out."""
        if self._fut is None:
            return True
        limit = seconds(timeout)
        if limit and not self._fut.done():
            done = threading.Event()
            self._fut.add_done_callback(lambda _f: done.set())
            if not done.wait(limit):
                peer = f" from rank {self._source}" if self._op == "recv" and self._source >= 0 else ""
                raise RuntimeError(f"the loom backend's {self._op}{peer} on group {self._group!r} did not complete "
                                   f"within the {limit:g} s timeout given to wait(); it is still posted: wait "
                                   f"again to complete it")
        try:
            self._fut.wait()
        except Exception as exc:  # noqa: BLE001 - named, then raised
            raise _failure(self, exc) from exc
        return True

    def is_completed(self) -> bool:
        return self._fut is None or self._fut.done()

    def is_success(self) -> bool:
        if self._fut is None:
            return True
        if not self._fut.done():
            return False
        try:
            self._fut.value()
        except Exception:  # noqa: BLE001 - the work failed
            return False
        return True

    def exception(self):
        if self._fut is None:
            return None
        try:
            self._fut.wait()
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            return _failure(self, exc)
        return None

    def get_future(self) -> Future:
        if self._fut is None:
            self._fut = _done_future(self._outputs)
        return self._fut

    def result(self) -> list:
        self.wait()
        return self._outputs

    def _source_rank(self) -> int:
        return self._source

    def source_rank(self) -> int:
        return self._source

    def synchronize(self) -> None:
        self.wait()


def seconds(timeout: Any) -> float:
    """``Work.wait``'s timeout in seconds (0: none, torch's ``kNoTimeout``)."""
    if timeout is None:
        return 0.0
    secs = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else timeout
    if not isinstance(secs, (int, float)) or isinstance(secs, bool) or secs < 0:
        raise ValueError(f"wait(timeout={timeout!r}): give a datetime.timedelta or seconds >= 0 (0 or None: no "
                         f"timeout)")
    return float(secs)


def later(req: Request, outputs: list, comm: Any, after: Callable[[Any], None] | None = None) -> LoomWork:
    """Work for a request posted on ``comm``: the progress thread tests it (for at most ``comm``'s timeout), runs
    ``after(result)`` (copies into the caller's tensors) and completes the future; or, without a thread, the
    request completes here."""
    if comm.broken is not None:  # what was posted may match another rank's next operation: kept, never waited on
        _STRANDED.append(req)
        raise CommError(f"an earlier {comm.broken} on communicator {comm.name!r} timed out, so its ranks no longer "
                        f"agree on which operation comes next; make a new process group")
    eng = engine()
    if eng is None or req.test():
        res = req.wait(comm.timeout)
        if after is not None:
            after(res)
        return LoomWork(outputs)
    fut = Future()

    def then(ticket) -> None:
        try:
            if ticket.error is not None:
                if isinstance(ticket.error, CommTimeoutError):
                    comm.mark_broken(req.what)
                raise ticket.error
            if after is not None:
                after(ticket.result)
            fut.set_result(outputs)
        except BaseException as exc:  # noqa: BLE001 - delivered to whoever waits on the work
            fut.set_exception(exc)

    eng.submit(lambda: req, then, comm.timeout)
    return LoomWork(outputs, fut)


def chain(work: LoomWork, after: Callable[[Any], None]) -> LoomWork:
    """Work done when ``work`` is and ``after`` ran (on the thread that completes ``work``)."""
    fut = Future()

    def then(f) -> None:
        try:
            f.wait()
            after(None)
            fut.set_result(work._outputs)
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            fut.set_exception(exc)

    work.get_future().add_done_callback(then)
    return LoomWork(work._outputs, fut)


def join(works: list[LoomWork], outputs: list | None = None) -> LoomWork:
    """One work for several: done when all are (the first error wins, as it was raised: torch's
    ``Future.then`` would turn it into a RuntimeError of its text)."""
    outputs = [] if outputs is None else outputs
    pending = [w for w in works if not w.is_completed()]
    if not pending:
        for w in works:
            w.get_future().value()  # raise a failed one's error
        return LoomWork(outputs)
    fut = Future()
    left = [len(works)]
    lock = threading.Lock()

    def one(f) -> None:
        try:
            f.wait()
            err = None
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            err = exc
        with lock:
            left[0] -= 1
            last = left[0] == 0
            if fut.done():
                return
            if err is not None:
                fut.set_exception(err)
            elif last:
                fut.set_result(outputs)

    for w in works:
        w.get_future().add_done_callback(one)
    return LoomWork(outputs, fut)
