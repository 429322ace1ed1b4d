"""Requests in flight (tested, waited for, accounted) and the counters :func:`zero_stats` reads.

Time blocked on a request counts as exposed communication; a posted gradient reduce-scatter keeps its posting
time, when it was first seen complete and how often it was tested.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from ... import stats as _stats
from ...comm import Request, Ticket

__all__ = ["zero_stats", "reset_zero_stats"]

# The counters live in the one stats registry (loom.stats, kind "time", scope "zero"); zero_stats() is a view.
_ZERO_COUNTERS = ("exposed_comm_s", "gathers", "gather_waits", "reduce_scatters", "overlapped_comm_s", "buckets",
                  "posted_in_backward", "tests_in_backward")


def zero_stats() -> dict[str, float]:
    """Counters of every :class:`~loom.parallel.ShardedDataParallel` in this process: seconds blocked on communication
    (``exposed_comm_s``), parameter gathers posted, gathers not complete when needed, reduce-scatters, and the
    reduce-scatters' overlap with backward as in :func:`loom.parallel.data.dp_stats` (``overlapped_comm_s``,
    ``buckets``, ``posted_in_backward``, ``tests_in_backward``)."""
    live = _stats.counters("time", "zero")
    return {k: live.get(k, 0) for k in _ZERO_COUNTERS}


def reset_zero_stats() -> None:
    """Zero the counters :func:`zero_stats` reads."""
    _stats.counters("time", "zero").clear()


def _in_backward() -> bool:
    """Whether the autograd engine is executing a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def _done(req: "Request | Ticket | _Then") -> bool:
    """Whether ``req`` completed; a request is tested (moving it), a progress thread's ticket only looked at."""
    return req.done if isinstance(req, Ticket) else req.test()


def _wait(req: "Request | Ticket | _Then") -> Any:
    """Wait for ``req``, counting the time blocked as exposed communication."""
    if _done(req):
        return req.wait()
    t0 = time.perf_counter()
    out = req.wait()
    _stats.add("time", "zero", exposed_comm_s=time.perf_counter() - t0)
    return out


class _RS:
    """One posted gradient reduce-scatter and its accounting (posting time, first seen complete, tests)."""

    __slots__ = ("index", "req", "posted", "seen", "tests", "in_backward")

    def __init__(self, index: int, req: "Request | Ticket | _Then", in_backward: bool):
        self.index, self.req, self.in_backward = index, req, in_backward
        self.posted, self.seen, self.tests = time.perf_counter(), None, 0

    def test(self) -> bool:
        """Test once (hooks mode); a ticket's tests are the progress thread's."""
        if self.seen is None:
            if not isinstance(self.req, Ticket):
                self.tests += 1
            if _done(self.req):
                self.seen = time.perf_counter()
        return self.seen is not None

    @property
    def tested(self) -> int:
        return self.req.tests if isinstance(self.req, Ticket) else self.tests

    def interval(self, end: float) -> tuple[float, float]:
        """In flight from posting until seen complete, cut at ``end``; a ticket's times are the thread's."""
        a, b = self.posted, self.seen
        if isinstance(self.req, Ticket):
            a, b = self.req.posted_at or end, self.req.done_at
        return a, min(b if b is not None else end, end)


class _Then:
    """A request whose result is ``fn(result of req)``, computed once when ``req`` completes."""

    __slots__ = ("req", "fn", "done", "result")

    def __init__(self, req: "Request | Ticket", fn: Callable[[Any], Any]):
        self.req, self.fn, self.done, self.result = req, fn, False, None

    def test(self) -> bool:
        if not self.done and _done(self.req):
            self.result, self.done = self.fn(self.req.wait()), True
        return self.done

    def wait(self) -> Any:
        if not self.done:
            self.result, self.done = self.fn(self.req.wait()), True
        return self.result
