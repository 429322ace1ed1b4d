"""Safety behaviours, one scenario per launch (argv[1]); see tests/integration/test_comm_mpi.py."""

from __future__ import annotations

import asyncio
import sys
import time

import torch

from loom.comm import CollectiveMismatchError, world


def scenario_raise(comm):
    """The last rank raises while the others wait for it: the job must die, not hang."""
    if comm.rank == comm.size - 1:
        raise ValueError("boom from the last rank")
    comm.recv(torch.empty(1), comm.size - 1, tag=1)   # would wait forever


def scenario_raise_thread(comm):
    """The last rank's worker thread raises; its main thread would go on: the job must die, not hang."""
    if comm.rank == comm.size - 1:
        import threading

        def work():
            raise ValueError("boom from a thread")

        t = threading.Thread(target=work, name="worker")
        t.start()
        t.join()
    comm.recv(torch.empty(1), comm.size - 1, tag=1)   # every rank would wait forever


def scenario_raise_async(comm):
    """An asyncio callback on the last rank raises (the loop would log it and go on): the job must die."""
    if comm.rank == comm.size - 1:
        async def main():
            asyncio.get_running_loop().call_soon(lambda: 1 / 0)
            await asyncio.sleep(0.5)

        asyncio.run(main())
    comm.recv(torch.empty(1), comm.size - 1, tag=1)


def scenario_mismatch(comm):
    """Check mode: every rank gets the same clear error for mismatched collectives, then the job goes on."""
    shape = (3,) if comm.rank == 0 else (4,)
    try:
        comm.allreduce(torch.zeros(shape))
    except CollectiveMismatchError as exc:
        msg = str(exc)
        assert "allreduce" in msg and "(3,)" in msg and "(4,)" in msg, msg
        print(f"rank {comm.rank} caught: {msg}", flush=True)
    else:
        raise AssertionError("mismatched allreduce was not caught")
    bad = [1] * comm.size if comm.rank else [2] * comm.size    # rank 0's counts do not cover dim 0
    try:
        comm.alltoallv(torch.zeros(comm.size, 2), bad)
    except ValueError as exc:
        assert "rank 0" in str(exc) and "send_counts" in str(exc), str(exc)
        print(f"rank {comm.rank} caught counts: {exc}", flush=True)
    else:
        raise AssertionError("bad alltoallv counts were not caught")
    total = comm.allreduce(torch.ones(2))                       # still usable afterwards
    assert torch.equal(total, torch.full((2,), float(comm.size)))
    _out_in_check_mode(comm)


def _out_in_check_mode(comm):
    """Every collective that takes ``out=`` takes it in check mode too; a wrong ``out`` fails on every rank."""
    p = comm.size
    buf = torch.empty(3)
    assert comm.allreduce(torch.ones(3), out=buf) is buf and torch.equal(buf, torch.full((3,), float(p)))
    x = torch.ones(3)
    assert comm.allreduce(x, "max", out=x) is x                  # in place
    g = torch.empty(2 * p)
    assert comm.allgather(torch.full((2,), float(comm.rank)), out=g) is g
    assert torch.equal(g, torch.arange(p).repeat_interleave(2).float())
    a = torch.empty(p)
    assert comm.alltoall(torch.full((p,), float(comm.rank)), out=a) is a and torch.equal(a, torch.arange(p).float())
    wrong = torch.empty(4 if comm.rank == 0 else 3)
    try:
        comm.allreduce(torch.ones(3), out=wrong)
    except ValueError as exc:
        assert "rank 0" in str(exc) and "out has shape (4,)" in str(exc), str(exc)
        print(f"rank {comm.rank} caught out: {exc}", flush=True)
    else:
        raise AssertionError("a wrong out= on rank 0 was not caught")


def scenario_watchdog(comm):
    """LOOM_TIMEOUT: rank 0 waits in a barrier that rank 1 never joins; the watchdog reports and aborts."""
    if comm.rank == 1:
        time.sleep(60)
    comm.barrier()


class _Counting:
    """Counts MPI tests of loom requests and the waiter's sleeps: the back-off mechanism itself, which a busy
    machine cannot make look better or worse than it is (it can only make sleeps last longer)."""

    def __init__(self):
        from loom.comm import progress

        self.tests = self.sleeps = 0
        self._progress, self._test, self._sleep = progress, progress.Request.test, time.sleep

    def __enter__(self):
        counter, test, sleep = self, self._test, self._sleep

        def counted_test(req):
            counter.tests += 1
            return test(req)

        def counted_sleep(s):
            counter.sleeps += 1
            sleep(s)

        self._progress.Request.test = counted_test
        time.sleep = counted_sleep
        return self

    def __exit__(self, *exc):
        self._progress.Request.test = self._test
        time.sleep = self._sleep


# The back-off settles at one test per 2 ms: ~500 tests/s plus the first 100 us of spinning and the ramp. A rank
# that spins (a blocking MPI wait, a back-off that never sleeps) tests hundreds of thousands of times a second.
MAX_TESTS_PER_S = 2000


def scenario_idle(comm):
    """A rank waiting on a request must not burn a core: it sleeps between tests (wait) or between poller passes
    (await), at most MAX_TESTS_PER_S tests per second of waiting; CPU share is printed for information only."""
    if comm.rank == 1:
        comm.barrier()
        time.sleep(1.5)
        comm.send(torch.ones(4), 0, tag=3)
        comm.barrier()
        time.sleep(1.5)
        comm.send(torch.ones(4), 0, tag=4)
        return
    if comm.rank != 0:
        comm.barrier()
        comm.barrier()
        return
    out = torch.empty(4)
    req = comm.irecv(out, 1, tag=3)
    comm.barrier()
    with _Counting() as n:
        w0, c0 = time.perf_counter(), time.process_time()
        req.wait()
        wall, cpu = time.perf_counter() - w0, time.process_time() - c0
    print(f"idle wait: {wall:.2f} s, {n.tests} tests ({n.tests / wall:.0f}/s), {n.sleeps} sleeps, "
          f"{100 * cpu / wall:.2f} % of a core", flush=True)
    assert torch.equal(out, torch.ones(4))
    assert n.sleeps > 0 and n.tests / wall < MAX_TESTS_PER_S, (n.tests, n.sleeps, wall)

    async def waiter():
        return await comm.irecv(out, 1, tag=4)

    comm.barrier()
    with _Counting() as n:
        w0, c0 = time.perf_counter(), time.process_time()
        asyncio.run(waiter())
        wall2, cpu2 = time.perf_counter() - w0, time.process_time() - c0
    print(f"idle await: {wall2:.2f} s, {n.tests} tests ({n.tests / wall2:.0f}/s), "
          f"{100 * cpu2 / wall2:.2f} % of a core", flush=True)
    assert n.tests / wall2 < MAX_TESTS_PER_S and n.tests > 1, (n.tests, wall2)


if __name__ == "__main__":
    torch.set_num_threads(1)
    c = world()
    globals()[f"scenario_{sys.argv[1]}"](c)
    c.barrier()
    if c.rank == 0:
        print("scenario done", flush=True)
