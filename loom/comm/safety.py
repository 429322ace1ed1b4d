"""Job-level safety: one failing rank takes the job down, optional check mode and watchdog.

* **Abort on exception.** :func:`install` (called by :func:`loom.comm.world`) replaces ``sys.excepthook`` so
  that an uncaught exception on any rank prints its traceback (prefixed with the rank) and calls
  ``MPI_Abort`` on COMM_WORLD, like ``python -m mpi4py``: the other ranks never wait for a dead peer. The
  same holds for an exception that escapes a thread (``threading.excepthook``) or an asyncio callback (the
  default exception handler of every event loop that sets none of its own): Python would only print those
  and go on, leaving the rank alive but its peers waiting for messages it will never send.
* **Check mode** (``LOOM_CHECK=1`` or ``configure(check=True)``): before every collective, ranks exchange a
  small signature (operation, dtype, shape, counts, root) with one ``allgather`` and compare; any
  disagreement, or a locally invalid argument, raises :class:`CollectiveMismatchError` / ``ValueError``
  on *every* rank with a message naming the ranks and values. Costs one small collective per call.
* **Watchdog** (``LOOM_TIMEOUT=seconds`` or ``configure(timeout=...)``): a daemon thread watches the
  operation each thread is in; one running past the limit is reported (operation, communicator, rank,
  seconds, shape) and the job is aborted. mpi4py releases the GIL inside MPI calls, so the watchdog runs
  while the main thread is stuck in a blocking call.

Both modes are installed by wrapping the methods of the communicator class handed to :func:`attach` (loom.comm's
:class:`Communicator` hands itself over when its module loads, so this module never imports it), so when they are
off the hot path pays nothing.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import traceback
from typing import Any, Callable

from asyncio import CancelledError as _CancelledError

from mpi4py import MPI

from . import launch
from .errors import CollectiveMismatchError
from .. import settings

__all__ = ["attach", "install", "configure", "check_enabled", "watchdog_timeout"]

_INSTALLED = False
_CHECK = False
_TIMEOUT: float | None = None
_ORIGINALS: dict[str, Callable] = {}
_TARGET: type | None = None  # the communicator class whose methods the modes wrap
ABORT_GRACE_S = 0.5  # between writing the traceback and MPI_Abort (see _abort_hook)


def _abort_hook(exc_type, exc, tb, where: str = "") -> None:
    signum = launch.stopping()
    if signum is not None:  # the rank was told to stop and its peers are leaving: nothing to report or abort
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(128 + signum)
    rank = MPI.COMM_WORLD.Get_rank()
    lines = traceback.format_exception(exc_type, exc, tb)
    # The process's own stderr: a hook that wraps this one may have swapped sys.stderr for a buffer it prints
    # only after this returns (torch.distributed's excepthook does), and this never returns.
    err = sys.__stderr__ or sys.stderr
    err.write("".join(f"[rank {rank}] {ln}" for chunk in lines for ln in chunk.splitlines(True)))
    err.write(f"[rank {rank}] loom: uncaught {exc_type.__name__}{where}; aborting the job (MPI_Abort)\n")
    err.flush()
    sys.stdout.flush()
    # The launcher forwards a rank's output from a pipe; on MPI_Abort it kills the ranks and may exit before
    # reading what is still in that pipe. A moment's grace lets the traceback reach the user; it costs nothing
    # on a job that is ending anyway.
    time.sleep(ABORT_GRACE_S)
    MPI.COMM_WORLD.Abort(1)


def _thread_abort_hook(args) -> None:
    if issubclass(args.exc_type, SystemExit):  # threading's own hook ignores it too
        return
    if launch.stopping() is not None:  # the main thread is unwinding the stop; it ends the rank
        return
    name = args.thread.name if args.thread is not None else "?"
    _abort_hook(args.exc_type, args.exc_value, args.exc_traceback, f" in thread {name!r}")


_LOOP_DEFAULT: Callable | None = None


def _loop_abort_handler(loop, context: dict) -> None:
    """asyncio's default exception handler, aborting the job when a callback raised. Other reports (an
    unretrieved task exception found by the garbage collector, a transport error) are only logged, as before."""
    exc = context.get("exception")
    if exc is not None and "handle" in context and not isinstance(exc, (KeyboardInterrupt, _CancelledError)):
        _abort_hook(type(exc), exc, exc.__traceback__, f" in asyncio callback {context['handle']!r}")
    assert _LOOP_DEFAULT is not None
    _LOOP_DEFAULT(loop, context)


def _install_abort_hooks() -> None:
    global _LOOP_DEFAULT
    import asyncio.base_events

    sys.excepthook = _abort_hook
    threading.excepthook = _thread_abort_hook
    if _LOOP_DEFAULT is None:
        _LOOP_DEFAULT = asyncio.base_events.BaseEventLoop.default_exception_handler
        asyncio.base_events.BaseEventLoop.default_exception_handler = _loop_abort_handler


def install() -> None:
    """Install the abort hook (multi-rank jobs only) and the modes chosen by ``LOOM_CHECK``/``LOOM_TIMEOUT``."""
    global _INSTALLED
    if _INSTALLED:
        return
    _INSTALLED = True
    if MPI.COMM_WORLD.Get_size() > 1:
        _install_abort_hooks()
    configure(check=settings.get("check"), timeout=settings.get("timeout"))


def check_enabled() -> bool:
    return _CHECK


def watchdog_timeout() -> float | None:
    return _TIMEOUT


# ---------------------------------------------------------------------------------------------- check mode
def _desc(x: Any) -> tuple:
    return (str(getattr(x, "dtype", type(x).__name__)), tuple(int(s) for s in getattr(x, "shape", ())))


def _out_error(name: str, out: Any, want: tuple) -> str | None:
    """A locally wrong ``out=`` (shape), found before the collective so every rank raises together."""
    if out is None:
        return None
    got = tuple(int(s) for s in getattr(out, "shape", ()))
    if got != want:
        return f"{name}: out has shape {got} but the result has {want}; pass an out of that shape (or none)"
    return None


def _sig_reduce(name):
    def sig(self, tensor, op="sum", *, out=None):
        desc = _desc(tensor)
        return (name, op, *desc), _out_error(name, out, desc[1])
    return sig


def _sig_reduce_scatter(self, tensor, op="sum", *, out=None):
    dt, shape = _desc(tensor)
    want = (shape[0] // self.size, *shape[1:]) if shape else shape
    return ("reduce_scatter", op, dt, shape), _out_error("reduce_scatter", out, want)


def _sig_gather(name, trailing_only: bool, result_rows=None):
    def sig(self, tensor, *, out=None):
        dt, shape = _desc(tensor)
        if not shape:
            return (name, dt, shape), f"{name} needs at least one dim, got a scalar"
        rows = shape[0] if result_rows is None else result_rows(self, shape[0])
        return (name, dt, shape[1:] if trailing_only else shape), _out_error(name, out, (rows, *shape[1:]))
    return sig


def _sig_bcast(self, tensor, root=0):
    err = None if 0 <= root < self.size else f"root {root} is not a rank of {self.name!r} (size {self.size})"
    return ("bcast", root, *_desc(tensor)), err


def _sig_alltoallv(name):
    def sig(self, tensor, send_counts, recv_counts=None):
        dt, shape = _desc(tensor)
        sc = [int(c) for c in send_counts]
        err = None
        if not shape:
            err = f"{name} needs at least one dim, got a scalar"
        elif len(sc) != self.size:
            err = f"send_counts has {len(sc)} entries, expected {self.size} (one per rank)"
        elif any(c < 0 for c in sc) or sum(sc) != shape[0]:
            err = f"send_counts {sc} must be >= 0 and sum to dim 0 = {shape[0]}"
        rc = None if recv_counts is None else [int(c) for c in recv_counts]
        return (name, dt, shape[1:]), err, sc, rc
    return sig


def _sig_plain(name):
    def sig(self, *args, **kwargs):
        return (name,), None
    return sig


_SIGNATURES: dict[str, Callable] = {
    "barrier": _sig_plain("barrier"),
    "allreduce": _sig_reduce("allreduce"),  # out= on allreduce, allgather, alltoall (as the methods take it)
    "iallreduce": _sig_reduce("allreduce"),
    "reduce_scatter": _sig_reduce_scatter,
    "ireduce_scatter": _sig_reduce("reduce_scatter"),
    "allgather": _sig_gather("allgather", trailing_only=False, result_rows=lambda c, n: n * c.size),
    "iallgather": _sig_gather("allgather", trailing_only=False, result_rows=lambda c, n: n * c.size),
    "allgatherv": _sig_gather("allgatherv", trailing_only=True),
    "alltoall": _sig_gather("alltoall", trailing_only=False),
    "bcast": _sig_bcast,
    "alltoallv": _sig_alltoallv("alltoallv"),
    "ialltoallv": _sig_alltoallv("alltoallv"),
    "split": _sig_plain("split"),
    "dup": _sig_plain("dup"),
}


def _check_collective(self, method: str, args, kwargs) -> None:
    """Exchange signatures; raise the same error on every rank when anything disagrees."""
    res = _SIGNATURES[method](self, *args, **kwargs)
    sig, err = res[0], res[1]
    extra = res[2:] if len(res) > 2 else None
    everyone = self.mpi.allgather((sig, err, extra))
    where = f"loom check mode: {method} on communicator {self.name!r} (size {self.size})"
    errors = [(r, e) for r, (_, e, _) in enumerate(everyone) if e]
    if errors:
        detail = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise ValueError(f"{where}: invalid arguments: {detail}")
    sigs = [s for s, _, _ in everyone]
    if any(s != sigs[0] for s in sigs):
        groups: dict[tuple, list[int]] = {}
        for r, s in enumerate(sigs):
            groups.setdefault(s, []).append(r)
        detail = "; ".join(f"ranks {rs}: {s}" for s, rs in groups.items())
        raise CollectiveMismatchError(
            f"{where}: ranks disagree (operation, op/root, dtype, shape): {detail}. "
            f"Every rank must call the same collective with matching tensors"
        )
    if extra is not None:  # alltoallv: recv_counts given by a rank must match what the peers send it
        matrix = [e[0] for _, _, e in everyone]
        bad = []
        for r, (_, _, e) in enumerate(everyone):
            rc = e[1]
            expect = [matrix[s][r] for s in range(self.size)]
            if rc is not None and rc != expect:
                bad.append(f"rank {r} expects {rc} but peers send {expect}")
        if bad:
            raise CollectiveMismatchError(f"{where}: recv_counts disagree with send_counts: {'; '.join(bad)}")


# ---------------------------------------------------------------------------------------------- watchdog
_INFLIGHT: dict[int, tuple[str, float]] = {}
_WATCHDOG: threading.Thread | None = None


def _watchdog_loop() -> None:
    rank = MPI.COMM_WORLD.Get_rank()
    while _TIMEOUT is not None:
        limit = _TIMEOUT
        now = time.monotonic()
        for what, t0 in list(_INFLIGHT.values()):
            if now - t0 > limit:
                sys.stderr.write(
                    f"[rank {rank}] loom watchdog: stuck for {now - t0:.1f} s (LOOM_TIMEOUT={limit:g}) in {what}; "
                    f"a peer probably never joined this operation. Aborting the job.\n"
                )
                sys.stderr.flush()
                time.sleep(ABORT_GRACE_S)  # let the launcher read the report before it kills the ranks
                MPI.COMM_WORLD.Abort(3)
        time.sleep(min(0.25, limit / 4))


def _describe(self, method: str, args) -> str:
    shapes = ", ".join(f"{_desc(a)[0]}{list(_desc(a)[1])}" for a in args if hasattr(a, "shape"))
    return f"{method}({shapes}) on communicator {self.name!r} rank {self.rank}/{self.size}"


def _wrap(method: str, fn: Callable) -> Callable:
    collective = method in _SIGNATURES

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        if _CHECK and collective and self.size > 1:
            _check_collective(self, method, args, kwargs)
        if _TIMEOUT is None:
            return fn(self, *args, **kwargs)
        tid = threading.get_ident()
        outer = tid in _INFLIGHT
        if not outer:
            _INFLIGHT[tid] = (_describe(self, method, args), time.monotonic())
        try:
            return fn(self, *args, **kwargs)
        finally:
            if not outer:
                _INFLIGHT.pop(tid, None)

    wrapper.__loom_wrapped__ = fn  # type: ignore[attr-defined]
    return wrapper


def _wrap_wait(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def wait(self, timeout=None):
        if _TIMEOUT is None or self.done:
            return fn(self, timeout)
        tid = threading.get_ident()
        _INFLIGHT[tid] = (f"wait on {self.what}", time.monotonic())
        try:
            return fn(self, timeout)
        finally:
            _INFLIGHT.pop(tid, None)

    return wait


_WRAPPED = (
    "send", "recv", "sendrecv", "barrier", "bcast", "allreduce", "reduce_scatter", "allgather", "allgatherv",
    "alltoall", "alltoallv", "iallreduce", "iallgather", "ireduce_scatter", "ialltoallv", "split", "dup",
    "send_object", "recv_object", "bcast_object", "allgather_object", "gather_object", "allreduce_object",
)


def configure(*, check: bool | None = None, timeout: float | None | bool = False) -> None:
    """Turn check mode and the watchdog on or off at run time (every rank must make the same call).

    Args:
        check: ``True``/``False`` to switch check mode; ``None`` leaves it as is.
        timeout: seconds for the watchdog, ``None`` to switch it off; ``False`` (default) leaves it as is.
    """
    global _CHECK, _TIMEOUT, _WATCHDOG
    if check is not None:
        _CHECK = bool(check)
    if timeout is not False:
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"watchdog timeout {timeout!r} must be a positive number of seconds or None")
        _TIMEOUT = None if timeout is None else float(timeout)
    _apply()
    if _TIMEOUT is not None and (_WATCHDOG is None or not _WATCHDOG.is_alive()):
        _WATCHDOG = threading.Thread(target=_watchdog_loop, name="loom-watchdog", daemon=True)
        _WATCHDOG.start()


def attach(communicator: type) -> None:
    """Wrap ``communicator``'s methods while a mode is on (now and at every later :func:`configure`)."""
    global _TARGET
    if _TARGET is not None and _TARGET is not communicator:
        raise RuntimeError(f"safety modes already wrap {_TARGET.__qualname__}; one communicator class only")
    _TARGET = communicator
    _apply()


def _apply() -> None:
    """Wrap or unwrap the attached class's methods and ``Request.wait`` to match the modes now chosen."""
    from .progress import Request

    if _TARGET is None:  # nothing to wrap yet: attach() applies the modes when the class arrives
        return
    active = _CHECK or _TIMEOUT is not None
    if active and not _ORIGINALS:
        for name in _WRAPPED:
            _ORIGINALS[name] = getattr(_TARGET, name)
            setattr(_TARGET, name, _wrap(name, _ORIGINALS[name]))
        _ORIGINALS["Request.wait"] = Request.wait
        Request.wait = _wrap_wait(Request.wait)
    elif not active and _ORIGINALS:
        Request.wait = _ORIGINALS.pop("Request.wait")
        for name, fn in _ORIGINALS.items():
            setattr(_TARGET, name, fn)
        _ORIGINALS.clear()
