"""Rank-side checks of ZeRO on CUDA (``make test-gpu``; 2 ranks may share one GPU).

``ShardedDataParallel`` at stages 0-3 (0: plain data parallel's ``GradReducer``), in both progress modes, trains
the deep model of ``tests/mpi/check_zero_deep.py`` (rank-dependent branches, a bucket per module) on the rank's
GPU and on the CPU from the same seed, fp64, 3 Adam steps with clipping; the results agree to ``RTOL`` (only
kernels and summation order differ). Buckets, shards, their gradients and the optimizer state live on the GPU.
Without a CUDA-aware MPI (the MPICH wheel) the engine (or the reducer) stages through host memory itself
(``sdp._staged``): the run computes on a stream of its own, not the default one, and a long kernel is queued
before every backward and step, so a copy that is not ordered after the compute stream (or a result read before
its copy landed) shows as wrong values.
Stage 2 under hybrid compression (int4, error feedback) agrees with its CPU run within ``COMPRESSED_RTOL``.
"""

from __future__ import annotations

import contextlib

import torch

from loom.comm import buffers, local_device
from loom.parallel.zero import ShardedDataParallel
from loom.testing import mpi_checks, seeded
from tests.mpi.check_zero_deep import SMALL, _data, _loss, _model, _rows, _uses

torch.backends.cuda.matmul.allow_tf32 = False

RTOL = 1e-9
COMPRESSED_RTOL = 1e-2
SLEEP_CYCLES = 200_000_000  # about a tenth of a second of GPU time queued ahead of the work that follows


def _train(comm, seed, data, device, stage, mode, stream=None, **kw):
    model = _model(seed).to(device)
    sdp = ShardedDataParallel(model, comm, stage=stage, bucket_mb=SMALL, progress=mode, **kw)
    opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
    losses = []
    if stream is not None:  # construction (shards, broadcasts, bucket copies) ran on the default stream
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        for step, (x, y) in enumerate(data):
            x, y = _rows(x, comm.rank, comm.size).to(device), _rows(y, comm.rank, comm.size).to(device)
            loss = _loss(sdp(x, _uses(comm.rank, step)), y)
            if stream is not None:
                torch.cuda._sleep(SLEEP_CYCLES)  # backward's kernels queue behind this
            loss.backward()
            if stream is not None:
                torch.cuda._sleep(SLEEP_CYCLES)
            sdp.step(opt, max_norm=0.5)
            losses.append(comm.allreduce(loss.detach().reshape(1), op="avg").item())
    if stream is not None:
        stream.synchronize()
    return sdp, opt, losses


def _placed(sdp, opt, device, what) -> None:
    """Parameters, gathered buffers (stage 0: the reducer's buckets, stages 1-2: the full buckets) and the
    optimizer state live on ``device`` after a step; stages 1-3 dropped the shards' gradients."""
    dev = torch.device(device)
    assert all(p.device == dev for p in sdp.parameters()), what
    assert sdp.stage == 0 or all(sh.grad is None for sh in sdp.shards), what
    assert all(v.device == dev for st in opt.state.values() for v in st.values() if v.dim()), what
    if sdp.stage == 0:  # no _Bucket.full at stage 0: the reducer's flat buffers hold the gradients
        assert all(buf.device == dev for buf in sdp.reducer.buffers), what
    elif sdp.stage < 3:
        assert all(b.full.device == dev for b in sdp.buckets), what


def _state(sdp) -> dict[str, torch.Tensor]:
    return {k: v.detach().double().cpu() for k, v in sdp.state_dict().items()}


def _agree(got, want, rtol, what):
    for k, v in want.items():
        err = float((got[k] - v).abs().max())
        assert err <= rtol * (1 + float(v.abs().max())), f"{what}: {k} differs from the CPU run by {err:.3g}"


def check_zero_stages_on_cuda_match_cpu(comm):
    dev = local_device("cuda")
    g = seeded(comm, 70)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = _data(g, 3)
    for stage in (0, 1, 2, 3):
        for mode in ("hooks", "thread"):
            what = f"stage {stage} progress={mode}"
            cpu, _, cpu_losses = _train(comm, seed, data, "cpu", stage, mode)
            side = torch.cuda.Stream(device=dev)
            sdp, opt, losses = _train(comm, seed, data, dev, stage, mode, stream=side)
            staged = sdp.reducer._staged if stage == 0 else sdp._staged
            assert staged == (not buffers.cuda_aware()), what
            _placed(sdp, opt, dev, what)
            for a, b in zip(cpu_losses, losses):
                assert abs(a - b) <= RTOL * (1 + abs(a)), (what, cpu_losses, losses)
            _agree(_state(sdp), _state(cpu), RTOL, what)
            sdp.remove()
            cpu.remove()


def check_zero_compressed_on_cuda_close_to_cpu(comm):
    dev = local_device("cuda")
    g = seeded(comm, 71)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = _data(g, 3)
    cpu, _, cpu_losses = _train(comm, seed, data, "cpu", 2, "hooks", compress="hybrid")
    sdp, _, losses = _train(comm, seed, data, dev, 2, "hooks", stream=torch.cuda.Stream(device=dev),
                            compress="hybrid")
    for a, b in zip(cpu_losses, losses):
        assert abs(a - b) <= COMPRESSED_RTOL * (1 + abs(a)), (cpu_losses, losses)
    _agree(_state(sdp), _state(cpu), COMPRESSED_RTOL, "stage 2 hybrid compression")


if __name__ == "__main__":
    mpi_checks(globals())
