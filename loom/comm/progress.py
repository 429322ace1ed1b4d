"""Non-blocking requests and the process's one progress poller.

MPI implementations busy-spin in ``MPI_Wait``: a rank waiting for a slow peer burns a whole core, which on a
node with more ranks than cores slows the peer it waits for. loom never calls a blocking wait on a request.
Instead every wait polls ``MPI_Test`` with *adaptive back-off*:

1. spin on ``Test`` for ``spin_s`` (default 100 us): small messages complete here at full speed;
2. then sleep between tests for 1/8 of the time waited so far, between 20 us and 2 ms: a wake-up is late
   by at most ~12 % of the wait, and a long wait settles at one test per 2 ms.

At the 2 ms cap a waiting rank costs a few us of CPU per 2 ms, well under 5 % of a core (measured by the
``idle`` scenario of ``tests/mpi/check_safety.py``), and a message arriving after a long wait is noticed
within 2 ms.

``await request`` from asyncio goes through :class:`Poller`, one per process (per event loop): a single
task that tests every pending pollable with the same back-off and resolves their futures. Registering a new
pollable wakes the poller and resets the back-off, so latency stays low while traffic is flowing. Anything
with a ``poll() -> (done, result)`` method can be registered (the Dask backend registers message probes).
The poller's sleeps go through a Linux ``timerfd`` watched by the loop (:class:`_FineTimer`), because
asyncio's own timers wait in ``epoll_wait`` with whole-millisecond timeouts: with them a 25 us back-off sleep
lasted 1 ms, so a rank past its spin noticed a message up to a millisecond late.

Where this process has a doorbell (:mod:`loom.comm.doorbell`) and every pending item says its sender rings it
(``item.bell`` true, e.g. the Dask backend's reads from a peer on this host), the poller skips the fine back-off:
it raises the doorbell's sleep flag, tests everything twice more, and sleeps until rung, its timer at the
back-off cap (2 ms) as the fallback. Items without ``bell`` keep the back-off above.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
import time
import weakref
from typing import Any, Callable, Protocol

from mpi4py import MPI

from .. import settings
from . import doorbell as _doorbell
from .errors import CommError, CommTimeoutError

__all__ = ["Request", "Pollable", "Poller", "poller", "wait_all", "Backoff", "ProgressThread", "Ticket"]


class Pollable(Protocol):
    def poll(self) -> tuple[bool, Any]:
        """``(True, result)`` once complete, else ``(False, None)``; must not block."""


class Backoff:
    """Spin for ``spin_s``; then sleep for a fraction (``frac``) of the time waited so far, clamped to
    ``[min_sleep_s, max_sleep_s]``, so a late wake-up costs at most ~``frac`` of the wait (plus timer slack)."""

    __slots__ = ("spin_s", "min_sleep_s", "max_sleep_s", "frac", "_t0")

    def __init__(
        self, spin_s: float = 100e-6, min_sleep_s: float = 20e-6, max_sleep_s: float = 2e-3, frac: float = 0.125
    ):
        self.spin_s = spin_s
        self.min_sleep_s = min_sleep_s
        self.max_sleep_s = max_sleep_s
        self.frac = frac
        self.reset()

    def reset(self) -> None:
        self._t0 = time.perf_counter()

    def next_delay(self) -> float:
        """Seconds to sleep before the next test (0.0 while still spinning)."""
        waited = time.perf_counter() - self._t0
        if waited < self.spin_s:
            return 0.0
        return min(self.max_sleep_s, max(self.min_sleep_s, waited * self.frac))


def _status_errors(reqs: list) -> str:
    """The per-request MPI error strings behind an MPI_ERR_IN_STATUS (e.g. a truncated receive).

    Each request is *tested*, never waited on: the others of a failed group may never complete (a peer that
    errored out will not send), and a blocking wait here would turn an error into a hang.
    """
    msgs = []
    for req in reqs:
        try:
            st = MPI.Status()
            req.Test(st)
        except MPI.Exception as exc:
            msgs.append(exc.Get_error_string())
    return "; ".join(msgs) + ("" if not msgs else " (a receive buffer smaller than the message it matched?)")


class Request:
    """A pending loom operation: ``wait()``, ``test()``, or ``await request``.

    Wraps one or more MPI requests plus the buffers they use (kept alive until completion) and a
    completion callback that produces the result (e.g. copying a staged receive back into its target).
    """

    __slots__ = ("_reqs", "_keep", "_finish", "_done", "_result", "_what", "__weakref__")

    def __init__(
        self,
        reqs: list[MPI.Request],
        *,
        keep: Any = None,
        finish: Callable[[], Any] | None = None,
        what: str | tuple = "request",
    ):
        self._reqs = reqs
        self._keep = keep
        self._finish = finish
        self._done = False
        self._result = None
        self._what = what

    @property
    def what(self) -> str:
        """What this request is, for error messages (formatted lazily: isend/irecv are on hot paths)."""
        w = self._what
        return w if isinstance(w, str) else f"{w[0]} {w[1]} on {w[2]}"

    @classmethod
    def completed(cls, result: Any = None, what: str = "request") -> "Request":
        r = cls([], what=what)
        r._done = True
        r._result = result
        return r

    def _complete(self) -> Any:
        self._done = True
        if self._finish is not None:
            self._result = self._finish()
        self._keep = None
        self._finish = None
        return self._result

    def test(self) -> bool:
        """True once complete (the result is then available from :meth:`wait` at no cost)."""
        if self._done:
            return True
        reqs = self._reqs
        try:
            # One request (most of them): Test is 3x cheaper than Testall, which builds an array per call.
            if reqs[0].Test() if len(reqs) == 1 else MPI.Request.Testall(reqs):
                self._complete()
                return True
        except MPI.Exception as exc:
            raise CommError(f"{self.what} failed: {_status_errors(self._reqs) or exc}") from exc
        return False

    def poll(self) -> tuple[bool, Any]:
        done = self.test()
        return done, (self._result if done else None)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until complete with adaptive back-off (no busy core); returns the operation's result."""
        if self._done:
            return self._result
        backoff = Backoff()
        deadline = None if timeout is None else time.perf_counter() + timeout
        test = self.test
        sleep = time.sleep
        while not test():
            d = backoff.next_delay()
            if deadline is not None and time.perf_counter() > deadline:
                raise CommTimeoutError(f"{self.what} did not complete within {timeout} s")
            if d:
                sleep(d)
        return self._result

    @property
    def done(self) -> bool:
        return self._done

    def __await__(self):
        if self._done:
            return self._result
        return (yield from poller().submit(self).__await__())

    def __repr__(self) -> str:
        return f"<loom Request {self.what} {'done' if self._done else 'pending'}>"


def wait_all(requests: list[Request], timeout: float | None = None) -> list[Any]:
    """Wait for every request (adaptive back-off shared across them); results in order."""
    backoff = Backoff()
    deadline = None if timeout is None else time.perf_counter() + timeout
    pending = [r for r in requests if not r.done]
    while pending:
        pending = [r for r in pending if not r.test()]
        if not pending:
            break
        if deadline is not None and time.perf_counter() > deadline:
            raise CommTimeoutError(f"{len(pending)} of {len(requests)} requests did not complete in {timeout} s")
        d = backoff.next_delay()
        if d:
            time.sleep(d)
    return [r.wait() for r in requests]


class Poller:
    """The per-event-loop progress engine behind ``await request``.

    Plan: a dict of pending pollables -> futures; one task loops ``poll()`` over them, resolving futures;
    when nothing completed it sleeps for the back-off delay, interruptibly (a new submission sets
    a waiter future); the task exits when nothing is pending and is restarted by the next submission.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._pending: dict[Any, asyncio.Future] = {}
        self._waiter: asyncio.Future | None = None
        self._task: asyncio.Task | None = None
        self._timer: _FineTimer | bool | None = None  # None: not tried yet; False: unavailable
        self._bell = None  # this process's Doorbell once watched; False: this loop cannot watch it
        self.backoff = Backoff(spin_s=200e-6)
        self.passes = 0  # poll passes over the pending items (a spinning wait shows as many per second)
        self.sleeps = 0  # sleeps taken (each ends by its timer, a ring, or a new submission)

    def submit(self, item: Pollable) -> asyncio.Future:
        fut = self._pending.get(item)
        if fut is not None:
            return fut
        done, result = item.poll()
        fut = self._loop.create_future()
        if done:
            fut.set_result(result)
            return fut
        self._pending[item] = fut
        self.backoff.reset()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)
        if self._task is None or self._task.done():
            self._task = self._loop.create_task(self._run())
        return fut

    def nudge(self) -> None:
        """Reset the back-off and wake a sleeping poll loop: traffic is flowing (a reply is likely on its way),
        so pending items should be tested at spin speed again. Cheaper than submitting a pollable."""
        if not self._pending:
            return
        self.backoff.reset()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def cancel(self, item: Pollable, exc: BaseException | None = None) -> None:
        """Stop polling ``item``; its future gets ``exc`` (or is cancelled)."""
        fut = self._pending.pop(item, None)
        if fut is not None and not fut.done():
            fut.set_exception(exc) if exc is not None else fut.cancel()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def _poll_pass(self) -> bool:
        """Test every pending item once, resolving the futures of those done; True if any completed."""
        self.passes += 1
        progressed = False
        for item, fut in list(self._pending.items()):
            if fut.done():  # cancelled by its awaiter
                self._pending.pop(item, None)
                continue
            try:
                done, result = item.poll()
            except BaseException as exc:  # noqa: BLE001 - delivered to the awaiter
                self._pending.pop(item, None)
                fut.set_exception(exc)
                progressed = True
                continue
            if done:
                self._pending.pop(item, None)
                fut.set_result(result)
                progressed = True
        return progressed

    def _doorbell(self):
        """This process's doorbell once one exists (see :mod:`loom.comm.doorbell`), watched by this loop."""
        bell = self._bell
        if bell is None:
            bell = _doorbell.current()
            if bell is None:
                return None
            try:
                self._loop.add_reader(bell.fd, self._rung, bell)
            except (NotImplementedError, RuntimeError, OSError):  # a loop without add_reader
                bell = False
            self._bell = bell
        return bell or None

    def _rung(self, bell) -> None:
        bell.drain()
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _run(self) -> None:
        while self._pending:
            if self._poll_pass():
                self.backoff.reset()
                await asyncio.sleep(0)
                continue
            if not self._pending:
                break
            delay = self.backoff.next_delay()
            if delay == 0.0:
                await asyncio.sleep(0)
                continue
            # Every pending item's sender rings this process's doorbell: sleep until rung. The timer, at the
            # back-off cap, is the fallback for a ring that never comes (a peer that cannot ring us, another
            # loop of this process draining the ring first).
            bell = self._doorbell()
            if bell is not None and all(getattr(item, "bell", False) for item in self._pending):
                bell.sleeping()
                try:
                    # The last tests after raising the flag: no lost wake-up. Two passes, because MPI's
                    # non-blocking probe matches before it progresses: a message that reached this process's
                    # shared memory is seen by the second probe, not the first (measured: always the second).
                    if self._poll_pass() or self._poll_pass():
                        self.backoff.reset()
                        continue
                    if not self._pending:
                        break
                    await self._sleep(self.backoff.max_sleep_s)
                finally:
                    bell.awake()
                continue
            await self._sleep(delay)

    async def _sleep(self, delay: float) -> None:
        """Sleep interruptibly: submit(), nudge() and a doorbell ring resolve the waiter early."""
        self.sleeps += 1
        self._waiter = w = self._loop.create_future()
        timer = self._timer
        if timer is None:  # first sleep: a timerfd, or False where there is none (asked once per loop)
            timer = self._timer = _FineTimer.create(self._loop) or False
        if timer and delay <= 2e-3:
            timer.arm(delay, w)
            handle = None
        else:
            handle = self._loop.call_later(delay, _wake, w)
        try:
            await w
        finally:
            if handle is not None:
                handle.cancel()
            self._waiter = None


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class _FineTimer:
    """A Linux ``timerfd`` watched by the event loop: sleeps of tens of microseconds for the poller.

    asyncio's timers wait in ``epoll_wait``, whose timeout is whole milliseconds, so ``call_later(25e-6)``
    sleeps 1 ms: a rank that stopped spinning would notice a message up to 1 ms late. A timerfd armed for the
    back-off delay wakes the same ``epoll_wait`` within the kernel's timer slack (~50 us) instead, at the cost
    of two system calls per sleep. ``create`` returns ``None`` where timerfd is unavailable (not Linux, no
    libc, a loop without ``add_reader``); the poller then keeps ``call_later``.
    """

    _libc: Any = None
    _spec_t: Any = None
    _byref: Any = None

    def __init__(self, loop: asyncio.AbstractEventLoop, fd: int):
        self._loop = loop
        self._fd = fd
        self._waiter: asyncio.Future | None = None
        self._spec = self._spec_t()
        loop.add_reader(fd, self._fired)
        weakref.finalize(self, _close_fd, fd)  # the timer lives as long as its poller, i.e. its loop

    @classmethod
    def create(cls, loop: asyncio.AbstractEventLoop) -> "_FineTimer | None":
        if not settings.get("fine_timer") or not sys.platform.startswith("linux"):
            return None
        try:
            if cls._libc is None:
                import ctypes

                class _Timespec(ctypes.Structure):
                    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]

                class _Itimerspec(ctypes.Structure):
                    _fields_ = [("it_interval", _Timespec), ("it_value", _Timespec)]

                libc = ctypes.CDLL(None, use_errno=True)
                libc.timerfd_create.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.timerfd_settime.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p]
                cls._spec_t, cls._libc, cls._byref = _Itimerspec, libc, ctypes.byref
            fd = cls._libc.timerfd_create(1, os.O_NONBLOCK | os.O_CLOEXEC)  # CLOCK_MONOTONIC
            if fd < 0:
                return None
            return cls(loop, fd)
        except (OSError, AttributeError, NotImplementedError, RuntimeError):
            return None

    def arm(self, delay: float, waiter: asyncio.Future) -> None:
        self._waiter = waiter
        ns = max(1000, int(delay * 1e9))
        spec = self._spec
        spec.it_value.tv_sec, spec.it_value.tv_nsec = divmod(ns, 1_000_000_000)
        if self._libc.timerfd_settime(self._fd, 0, self._byref(spec), None) != 0:
            self._loop.call_later(delay, _wake, waiter)  # cannot arm: fall back to the coarse timer

    def _fired(self) -> None:
        try:
            os.read(self._fd, 8)
        except (BlockingIOError, InterruptedError):
            return
        w, self._waiter = self._waiter, None
        if w is not None and not w.done():
            w.set_result(None)


def _close_fd(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


_POLLERS: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, Poller]" = weakref.WeakKeyDictionary()


def poller() -> Poller:
    """The poller of the running event loop (created on first use).

    Kept as an attribute of the loop where the loop takes one (asyncio's do): the loop and its poller then
    form a cycle the garbage collector frees with the loop, timer file descriptor included. A
    ``WeakKeyDictionary`` entry would live forever, since the poller refers to its loop.
    """
    loop = asyncio.get_running_loop()
    p = getattr(loop, "_loom_poller", None)
    if p is None:
        p = _POLLERS.get(loop)
    if p is None:
        p = Poller(loop)
        try:
            loop._loom_poller = p  # type: ignore[attr-defined]
        except AttributeError:  # a loop without a __dict__ (e.g. uvloop)
            _POLLERS[loop] = p
    return p


class Ticket:
    """A task handed to a :class:`ProgressThread`: ``wait()`` for its result; ``done`` without blocking.

    Attributes:
        posted_at: ``time.perf_counter()`` when the thread ran the task (``None`` until then).
        done_at: when the thread saw it complete (its request tested complete, or the task returned).
        tests: how many times the thread tested the task's request before it completed.
    """

    __slots__ = ("_event", "result", "error", "posted_at", "done_at", "tests", "stream", "then", "timeout")

    def __init__(self, stream: Any = None, then: Callable[["Ticket"], None] | None = None,
                 timeout: float | None = None) -> None:
        self.timeout = timeout  # seconds the posted request may take (see ProgressThread.submit)
        self.stream = stream  # the submitter's current CUDA stream (None without CUDA): the task runs on it
        self.then = then  # called with the ticket on the thread that completes it, after it is marked done
        self._event = threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None
        self.posted_at: float | None = None
        self.done_at: float | None = None
        self.tests = 0

    @property
    def done(self) -> bool:
        return self._event.is_set()

    def _set(self, result: Any = None, error: BaseException | None = None) -> None:
        self.result, self.error = result, error
        self.done_at = time.perf_counter()
        self._event.set()
        then, self.then = self.then, None
        if then is not None:
            then(self)

    def wait(self, timeout: float | None = None) -> Any:
        """Block (sleeping, no MPI call on this thread) until the task completed; its result, or its error raised."""
        if not self._event.wait(timeout):
            raise CommTimeoutError(f"a progress-thread task did not complete within {timeout} s")
        if self.error is not None:
            raise self.error
        return self.result


class ProgressThread:
    """A background thread that runs communication tasks in submission order and tests the requests they post
    until they complete, so non-blocking collectives move while the submitting thread computes.

    MPICH moves a non-blocking collective only inside an MPI call of the process (it has no asynchronous
    progress unless ``MPICH_ASYNC_PROGRESS=1``, whose thread spins for the whole job): a large allreduce posted
    from a backward hook otherwise advances only at the next hook, and mostly after backward.

    Plan: :meth:`submit` appends ``task`` to a FIFO and returns a :class:`Ticket`. The thread pops tasks in
    order and calls each: a task that returns a :class:`Request` (it posted a non-blocking operation) joins the
    in-flight list; any other return value completes its ticket at once (a blocking task, e.g. a compressed
    allreduce, has done its communication inside the call). Between tasks the thread tests every in-flight
    request once per pass and yields the GIL (``time.sleep(0)``; mpi4py releases it inside ``MPI_Test``), so
    while anything is in flight it keeps one core busy, and when nothing is it sleeps on a condition.

    Streams: a task and its request's completion run with the *submitting* thread's current CUDA stream made
    current on the thread (captured at :meth:`submit`). loom.comm orders its staging copies after "the caller's
    stream" and makes "the caller's stream" wait for the copies that bring results back; on the thread that is
    otherwise the thread's own default stream, so a submitter computing on another stream would have its tensor
    read before its kernels wrote it, and would read a result before the copy that brings it back.

    Ordering: one thread issues every task, so the collectives submitted by one caller on one communicator are
    posted in submission order, which is the same on every rank when the caller's order is. Needs
    ``MPI_THREAD_MULTIPLE`` (mpi4py's default; :meth:`available` says): the submitting thread keeps calling
    MPI on other communicators meanwhile. Requests handed to the thread belong to it: nobody else tests them.
    """

    def __init__(self, name: str = "loom-progress"):
        self.name = name
        self._cv = threading.Condition()
        self._queue: list[tuple[Callable[[], Any], Ticket]] = []
        self._thread: threading.Thread | None = None
        self._closed = False
        self.passes = 0  # test passes over in-flight requests (a mechanism count for tests, not a timing)
        self.stranded: list[Request] = []  # requests given up on at their ticket's timeout

    @staticmethod
    def available() -> bool:
        """True when MPI runs at ``MPI_THREAD_MULTIPLE`` (a second thread may call MPI at any time)."""
        return bool(MPI.Is_initialized()) and MPI.Query_thread() == MPI.THREAD_MULTIPLE

    def submit(self, task: Callable[[], Any], then: Callable[[Ticket], None] | None = None,
               timeout: float | None = None) -> Ticket:
        """Run ``task`` on the thread after every task submitted before it; its ticket. ``then(ticket)`` runs on
        the thread once the ticket is done (its result or error set), e.g. to complete a future. ``timeout``:
        seconds the request the task posts may take from then on; past them the thread stops testing it (it
        stays referenced in :attr:`stranded`, buffers and all: MPI may still write into them) and the ticket
        fails with :class:`~loom.comm.CommTimeoutError`."""
        ticket = Ticket(_caller_stream(), then, timeout)
        with self._cv:
            if self._closed:
                raise RuntimeError(f"progress thread {self.name!r} is closed; make a new one")
            self._queue.append((task, ticket))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._cv.notify()
        return ticket

    def close(self) -> None:
        """Let the thread finish what was submitted, then stop it."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join()

    def _run(self) -> None:
        inflight: list[tuple[Request, Ticket]] = []
        while True:
            with self._cv:
                while not self._queue and not inflight and not self._closed:
                    self._cv.wait()
                if not self._queue and not inflight:
                    return  # closed and drained
                task = self._queue.pop(0) if self._queue else None
            if task is not None:
                self._start(*task, inflight)
                task = None
                continue  # post everything queued first: MPI progresses all posted operations together
            self.passes += 1
            inflight = self._pass(inflight, self.stranded)
            time.sleep(0)  # yield the GIL to the computing thread

    # Posting and testing live in their own frames: a loop variable left bound in _run would keep the last
    # task's closure and request, and with them its buffers (a reduce-scatter's padded input), alive after
    # completion until the next task arrives (the peak of `loom bench zero`'s stage 3 in thread mode).
    @staticmethod
    def _start(fn: Callable[[], Any], ticket: Ticket, inflight: list[tuple[Request, Ticket]]) -> None:
        ticket.posted_at = time.perf_counter()
        try:
            with _on_stream(ticket.stream):
                res = fn()
        except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
            ticket._set(error=exc)
            return
        if isinstance(res, Request):
            inflight.append((res, ticket))
        else:
            ticket._set(res)

    @staticmethod
    def _pass(inflight: list[tuple[Request, Ticket]], stranded: list[Request]) -> list[tuple[Request, Ticket]]:
        """Test every in-flight request once; the ones still in flight (those past their ticket's timeout go to
        ``stranded``, their tickets failed)."""
        still = []
        now = time.perf_counter()
        for req, ticket in inflight:
            if ticket.timeout is not None and now - ticket.posted_at > ticket.timeout:
                stranded.append(req)
                ticket._set(error=CommTimeoutError(f"{req.what}: Timed out after {ticket.timeout:g} s waiting for "
                                                   f"the other ranks; a peer never joined it, or is stuck"))
                continue
            ticket.tests += 1
            try:
                with _on_stream(ticket.stream):  # the completion copies results back for the submitter
                    done = req.test()
            except BaseException as exc:  # noqa: BLE001 - delivered to the waiter
                ticket._set(error=exc)
                continue
            if done:
                ticket._set(req.wait())
            else:
                still.append((req, ticket))
        return still


def _caller_stream() -> Any:
    """The calling thread's current CUDA stream, or ``None`` where CUDA is not in use (torch not imported, or
    CUDA not initialised: no tensor of this process is on a GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    return torch.cuda.current_stream()


def _on_stream(stream: Any):
    """A context making ``stream`` current on this thread (and its device), or nothing for ``None``."""
    if stream is None:
        return contextlib.nullcontext()
    return sys.modules["torch"].cuda.stream(stream)
