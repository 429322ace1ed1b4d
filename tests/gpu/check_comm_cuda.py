"""Rank-side checks of loom.comm on CUDA tensors (``make test-gpu``; 2 ranks may share one GPU).

Every rank binds ``cuda:local_rank % device_count``; collectives of CUDA tensors (staged through pooled pinned
host memory when the MPI is not CUDA-aware, which the MPICH wheel is not) must return on the tensor's device
the values a host reference computes: allreduce (sum, avg, ``out=``; several pipelined pieces for the large
size), reduce_scatter, allgather, alltoall (also in several pipelined pieces per block, behind a queued kernel),
alltoallv in fp32 and bf16, and sends right after queued kernels.
Tolerances: fp32 sums 1e-6 relative (MPI's order of adding the ranks is not ours), bf16 sums one bf16 ulp
(reduced in fp32 on the device, rounded once), everything else exact.
"""

from __future__ import annotations

import torch

from loom.comm import buffers, local_device, local_rank
from loom.testing import mpi_checks, seeded

SLEEP_CYCLES = 1_000_000_000  # about half a second of GPU time: the producer is still queued when MPI is called


def _ref_sum(parts: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    acc = torch.zeros_like(parts[0], dtype=torch.float64)
    for p in parts:
        acc += p.to(dtype).to(torch.float64)
    return acc


def _close(got: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    rtol = 1e-6 if dtype == torch.float32 else 2 ** -7
    err = (got.double().cpu() - ref).abs()
    assert bool((err <= rtol * ref.abs() + 1e-6).all()), (dtype, float(err.max()))


def check_rank_binds_its_local_gpu(comm):
    dev = local_device("cuda")
    assert dev.index == local_rank() % torch.cuda.device_count()
    assert torch.cuda.current_device() == dev.index
    assert local_device("cuda") == dev and local_device(f"cuda:{dev.index}") == dev


def check_collectives_on_cuda(comm):
    dev, p, r = local_device("cuda"), comm.size, comm.rank
    g = seeded(comm)
    big = 3 * buffers.STAGE_PIECE // 4 + 7  # fp32: three pieces of the pipelined allreduce, the last one short
    for n in (1000, big):
        for dtype in (torch.float32, torch.bfloat16):
            parts = [torch.randn(n, 2, generator=g, dtype=torch.float64) for _ in range(p)]
            mine = parts[r].to(dtype).to(dev)
            ref = _ref_sum(parts, dtype)
            got = comm.allreduce(mine)
            assert got.device == dev and got.dtype == dtype
            _close(got, ref, dtype)
            _close(comm.allreduce(mine, op="avg"), ref / p, dtype)
            out = torch.full_like(mine, float("nan"))
            assert comm.allreduce(mine, out=out) is out
            _close(out, ref, dtype)
            _close(comm.iallreduce(mine).wait(), ref, dtype)
            assert torch.equal(mine.cpu(), parts[r].to(dtype))  # the input is untouched
            if n % p == 0:
                rs = comm.reduce_scatter(mine)
                _close(rs, ref[r * n // p:(r + 1) * n // p], dtype)
            gathered = comm.allgather(mine)
            assert gathered.device == dev and torch.equal(gathered.cpu(), torch.cat([q.to(dtype) for q in parts]))
    x = torch.arange(4 * p, dtype=torch.float32, device=dev) + 100 * r
    got = comm.alltoall(x.reshape(p, 4))
    want = torch.stack([torch.arange(4 * p, dtype=torch.float32)[4 * r:4 * r + 4] + 100 * s for s in range(p)])
    assert got.device == dev and torch.equal(got.cpu(), want)
    counts = [(r + j) % 3 for j in range(p)]
    rows = torch.full((sum(counts), 3), float(r), device=dev, dtype=torch.bfloat16)
    out, rc = comm.alltoallv(rows, counts)
    assert rc == [(s + r) % 3 for s in range(p)] and out.device == dev
    assert torch.equal(out.cpu(), torch.cat([torch.full((c, 3), float(s), dtype=torch.bfloat16)
                                             for s, c in enumerate(rc)]))


def check_block_collectives_pipelined_on_cuda(comm):
    """alltoall, allgather and reduce_scatter of CUDA tensors staged in several pieces per block (a small
    ``STAGE_PIECE``: three pieces, the last one short), their input made by a kernel queued behind a sleep, equal
    the same calls on host tensors: exact for alltoall and allgather (bytes moved), reduce_scatter within
    :func:`_close` (bf16 widened and reduced in fp32 on the device); ``out=`` receives the pieces directly."""
    dev, p, r = local_device("cuda"), comm.size, comm.rank
    g = seeded(comm)
    rows, cols = 300, 77
    saved = buffers.STAGE_PIECE
    buffers.STAGE_PIECE = 64 << 10  # every rank alike: the pieces must match
    try:
        assert rows * cols * 4 * p > 2 * buffers.STAGE_PIECE  # fp32: more than two pieces per block
        for dtype in (torch.float32, torch.bfloat16):
            parts = [torch.randn(p * rows, cols, generator=g, dtype=torch.float64) for _ in range(p)]
            host = parts[r].to(dtype)
            mine = host.to(dev)
            torch.cuda._sleep(SLEEP_CYCLES // 4)
            mine = mine * 1  # queued behind the sleep: a copy that does not wait for it reads an unfinished tensor
            got = comm.alltoall(mine)
            assert got.device == dev and got.dtype == dtype and torch.equal(got.cpu(), comm.alltoall(host))
            out = torch.full_like(mine, float("nan"))
            assert comm.alltoall(mine, out=out) is out and torch.equal(out.cpu(), got.cpu())
            got = comm.allgather(mine)
            assert got.device == dev and torch.equal(got.cpu(), comm.allgather(host))
            got = comm.reduce_scatter(mine)
            assert got.device == dev and got.dtype == dtype and got.shape == (rows, cols)
            _close(got, _ref_sum(parts, dtype)[r * rows:(r + 1) * rows], dtype)
            assert torch.equal(mine.cpu(), host)  # the input is untouched
    finally:
        buffers.STAGE_PIECE = saved


def check_pinned_buffers_are_reused(comm):
    dev = local_device("cuda")
    x = torch.ones(buffers.STAGE_PIECE, device=dev)
    comm.allreduce(x)  # the pool holds a buffer of this size from here on
    torch.cuda.synchronize()
    # Counted, not compared as a set of free buffers: a returned buffer waits in the pool's queue until the next
    # take, and which free buffer a take picks depends on what the checks before this one left there.
    made = buffers._PINNED.allocated
    for _ in range(3):
        comm.allreduce(x)
    torch.cuda.synchronize()
    assert buffers._PINNED.allocated == made, "each call pinned new host memory"
    assert all(b.is_pinned() for b, _ in buffers._PINNED.free)


def check_send_right_after_queued_kernels(comm):
    dev, p, r = local_device("cuda"), comm.size, comm.rank
    t = torch.empty(1 << 20, device=dev)
    torch.cuda._sleep(SLEEP_CYCLES)
    t.fill_(float(r + 1))  # queued behind the sleep: a send that does not wait would read garbage
    got = torch.empty_like(t)
    req = comm.irecv(got, (r - 1) % p, tag=7)
    comm.send(t, (r + 1) % p, tag=7)
    assert torch.equal(req.wait().cpu(), torch.full((1 << 20,), float((r - 1) % p + 1)))


if __name__ == "__main__":
    mpi_checks(globals())
