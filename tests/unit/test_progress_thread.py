"""loom.comm.ProgressThread on one process: tasks run in submission order, a posted request is tested until it
completes, a task's error reaches the waiter, and close() drains before stopping."""

from __future__ import annotations

import pytest
import torch

from loom.comm import CommTimeoutError, ProgressThread, world


def test_tasks_run_in_order_and_requests_complete():
    comm = world()
    worker = ProgressThread(name="test-progress")
    order: list[int] = []
    x = torch.arange(6, dtype=torch.float64)
    tickets = [worker.submit(lambda i=i: order.append(i)) for i in range(5)]
    req = worker.submit(lambda: comm.iallreduce(x, op="avg", out=x))
    for t in tickets:
        t.wait(timeout=60)
    assert order == list(range(5))
    assert req.wait(timeout=60) is x and torch.equal(x, torch.arange(6, dtype=torch.float64))
    assert req.done and req.tests >= 1 and req.posted_at <= req.done_at
    worker.close()
    with pytest.raises(RuntimeError, match="closed"):
        worker.submit(lambda: None)


def test_error_reaches_the_waiter_and_later_tasks_still_run():
    worker = ProgressThread()

    def boom():
        raise ValueError("bucket 3 failed")

    bad, good = worker.submit(boom), worker.submit(lambda: 7)
    with pytest.raises(ValueError, match="bucket 3"):
        bad.wait(timeout=60)
    assert good.wait(timeout=60) == 7
    worker.close()


def test_wait_times_out_with_a_comm_error():
    worker = ProgressThread()
    import threading

    gate = threading.Event()
    t = worker.submit(gate.wait)
    with pytest.raises(CommTimeoutError):
        t.wait(timeout=0.01)
    gate.set()
    t.wait(timeout=60)
    worker.close()


def test_task_and_completion_run_on_the_submitters_cuda_stream(monkeypatch):
    """CUDA stand-ins: the stream current on each thread is thread-local, as torch's is. A task (and the
    completion of the request it posts, where loom.comm copies a staged result back) must see the submitter's
    stream, not the thread's default one: loom.comm orders its staging copies after "the current stream"."""
    import contextlib
    import threading

    local = threading.local()
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: getattr(local, "s", "default"))

    @contextlib.contextmanager
    def stream(s):
        was = getattr(local, "s", "default")
        local.s = s
        try:
            yield
        finally:
            local.s = was

    monkeypatch.setattr(torch.cuda, "stream", stream)
    seen: list[str] = []

    class _Req:  # a posted request that completes on its second test, its completion reading the stream
        def __init__(self):
            self.n = 0

        def test(self):
            self.n += 1
            if self.n >= 2:
                seen.append(("finish", torch.cuda.current_stream()))
                return True
            return False

        def wait(self):
            return "result"

    from loom.comm import progress

    monkeypatch.setattr(progress, "Request", _Req)  # the thread's isinstance() check: this is a request
    worker = ProgressThread(name="test-streams")
    with stream("compute"):
        t = worker.submit(lambda: seen.append(("post", torch.cuda.current_stream())) or _Req())
    assert t.wait(timeout=60) == "result"
    worker.close()
    assert seen == [("post", "compute"), ("finish", "compute")], seen
