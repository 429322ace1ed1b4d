"""loom.comm in one process (a world of size 1, no launcher): buffers, errors, mesh arithmetic, CLI."""

import time

import numpy as np
import pytest
import torch

from loom.bench import omb
from loom.cli import main as loom_main, pop_ranks
from loom.comm import Mesh, buffers, world


def test_host_view_makes_contiguous_copies_of_transposed_and_strided():
    a = torch.arange(12.0).reshape(3, 4)
    for v in (a.t(), a[:, ::2], a.t()[::2]):
        h = buffers.host_view(v)
        assert h.is_contiguous() and torch.equal(h, v)
    g = torch.ones(3, requires_grad=True)
    assert not buffers.host_view(g).requires_grad


def test_unsupported_dtype_is_a_clear_error():
    with pytest.raises(TypeError, match="cannot be sent by loom.comm"):
        buffers.mpi_dtype(np.zeros(2, dtype="U3"))


def test_recv_into_grad_leaf_is_refused():
    with pytest.raises(ValueError, match="requires grad"):
        buffers.recv_target(torch.zeros(2, requires_grad=True))


def test_single_rank_collectives_are_identities():
    c = world()
    x = torch.randn(4, 3, dtype=torch.float64)
    assert torch.equal(c.allreduce(x), x)
    assert torch.equal(c.allgather(x), x)
    assert torch.equal(c.alltoall(x), x)
    y, counts = c.alltoallv(x, [4])
    assert counts == [4] and torch.equal(y, x)
    assert torch.equal(c.reduce_scatter(x), x)


@pytest.mark.parametrize("op", ["mean", "SUM", ""])
def test_unknown_reduce_op_lists_valid_ones(op):
    with pytest.raises(ValueError, match="valid: sum, max, min, prod, avg"):
        world().allreduce(torch.ones(1), op)


def test_scalar_collective_explains_the_fix():
    with pytest.raises(ValueError, match="reshape"):
        world().allgather(torch.tensor(1.0))


def test_mesh_errors_and_layout():
    with pytest.raises(ValueError, match="product"):
        Mesh(dp=2)
    with pytest.raises(ValueError, match="sizes are integers"):
        Mesh(dp=0)
    m = Mesh(dp=1, sp=1)
    assert m.coords == {"dp": 0, "sp": 0} and m.rank_of() == 0
    with pytest.raises(KeyError, match="its axes are dp, sp"):
        m["tp"]


def test_omb_sizes_and_parse():
    assert omb.sizes(1, 8) == [1, 2, 4, 8]
    assert omb.sizes(0, 2) == [0, 1, 2]
    assert omb.sizes(3, 16) == [4, 8, 16]
    assert omb.parse_size("64M") == 64 << 20 and omb.parse_size("1K") == 1024 and omb.parse_size("7") == 7
    with pytest.raises(Exception, match="byte count"):
        omb.parse_size("lots")


def test_parse_device_names_the_value_and_the_choices():
    from loom.cli_args import UsageError, parse_device

    assert [parse_device(d) for d in ("cpu", "auto", "cuda", "cuda:1")] == ["cpu", "auto", "cuda", "cuda:1"]
    for bad in ("gpu", "cuda:x", "cpu:0"):
        with pytest.raises(UsageError, match=f"device '{bad}' is not one loom runs on; give cpu, cuda, cuda:N or auto"):
            parse_device(bad)


def test_cli_unknown_command_and_ranks_flag(capsys):
    assert loom_main(["frobnicate"]) == 2
    assert "unknown command 'frobnicate'" in capsys.readouterr().err
    assert pop_ranks(["--ranks", "4", "-x", "1"]) == (4, ["-x", "1"])
    assert pop_ranks(["--ranks=2"]) == (2, [])
    assert pop_ranks(["a"]) == (None, ["a"])
    assert loom_main(["bench", "nope"]) == 2


def test_poller_sleeps_on_a_timerfd_and_still_delivers():
    """Past its spin phase the poller sleeps on a timerfd (sub-millisecond sleeps; asyncio's own timers round
    up to 1 ms) where Linux has one; a message arriving during those sleeps is still delivered, and the
    timer's file descriptor is released with the loop."""
    import asyncio
    import os
    import sys

    from loom.comm import progress

    comm = world()
    out = np.zeros(4)

    async def main():
        p = progress.poller()
        req = comm.irecv(out, 0, tag=91)
        waiting = asyncio.ensure_future(req)
        await asyncio.sleep(0.02)  # the poller is past its 200 us spin, sleeping
        assert not waiting.done()
        comm.isend(np.arange(4.0), 0, tag=91).wait()
        await asyncio.wait_for(waiting, 60)  # a hang bound, not a latency check: CI machines can be busy
        return p._timer

    timer = asyncio.run(main())
    assert np.array_equal(out, np.arange(4.0))
    if sys.platform.startswith("linux"):
        assert timer, "no timerfd on Linux: the poller fell back to 1 ms asyncio timers"
        fd = timer._fd
        del timer
        import gc

        gc.collect()
        with pytest.raises(OSError):
            os.fstat(fd)


def test_isend_eager_and_try_recv_to_self():
    """The Dask backend's cheapest pair: an eager send (None once complete, else a Request) and a
    non-blocking matched receive (None, a received array up to ``limit``, or a Message above it), optionally
    spinning for a while first."""
    comm = world()
    me = comm.rank
    assert comm.try_recv(me, 4242, 64) is None
    t0 = time.perf_counter()
    assert comm.try_recv(me, 4242, 64, spin_s=1e-3) is None  # spins, then gives up
    assert time.perf_counter() - t0 >= 1e-3
    pending = [comm.isend_eager(b"hello", me, 4242), comm.isend_eager(np.arange(100, dtype=np.uint8), me, 4242),
               comm.isend_eager(np.arange(200, dtype=np.uint8), me, 4242)]
    got = comm.try_recv(me, 4242, 64, spin_s=60.0)  # returns as soon as the message is matched
    assert isinstance(got, bytearray) and got == b"hello"
    m = None
    while m is None:
        m = comm.try_recv(me, 4242, 64)
    assert not isinstance(m, bytearray) and m.nbytes == 100
    out = np.empty(100, np.uint8)
    m.irecv(out).wait()
    assert np.array_equal(out, np.arange(100, dtype=np.uint8))
    m = comm.try_recv(me, 4242, 64, spin_s=60.0)
    out = np.empty(200, np.uint8)
    req = m.irecv_eager(out)  # None when complete at once (no request object), else a Request to wait on
    if req is not None:
        req.wait(timeout=10)
    assert np.array_equal(out, np.arange(200, dtype=np.uint8))
    for r in pending:
        if r is not None:  # a send to self completes once received
            r.wait(timeout=10)
            assert r.done
