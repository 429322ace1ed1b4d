"""GPU checks of loom's CUDA hand-offs: one short script for a machine with a CUDA device (none here).

    python scripts/gpu_check.py            # prints one line per check, exits non-zero on the first failure

A check whose modules are missing (``NEEDS``; the Dask check needs distributed and msgpack) prints
``SKIP <check>: ...`` naming them and the next one runs; without a CUDA device the script prints ``SKIP: no
CUDA device`` and exits 0.

``make test-gpu`` runs it too (tests/gpu/test_cuda.py).

1. **Hand-off to a CUDA-aware MPI waits for the producing stream.** With the direct path forced on, a tensor
   whose producing kernel is still queued (``torch.cuda._sleep`` then a fill, on the current stream, also
   inside ``with torch.cuda.stream(side)``) is handed to ``loom.comm.buffers.as_bytes``/``as_send``; right
   after, that stream must be idle (``query()``), i.e. MPI would read finished data.
2. **Staged path (MPI not CUDA-aware): CUDA tensors through loom.comm** on a world of one rank: allreduce (fp32,
   bf16), allgather, alltoall, alltoallv, send/recv to self through ``isend``/``irecv`` return equal values
   on the same device.
3. **Direct path with a real MPI**, only when ``MPI.Query_cuda_support()`` says the MPI is CUDA-aware: the
   same collectives on device buffers without staging.
4. **Dask CUDA frames** (``loom.dask.frames.frame_array``): a buffer exported by another library with
   ``__cuda_array_interface__`` version 3 names the stream that produced it; with that stream still busy, the
   frame comes back as a flat uint8 device tensor only after the stream is idle, with the producer's values.
5. **FPDT's host pool:** chunks put, prefetched one ahead and popped come back bit-exact; ``free()`` returns
   while the side stream's copy is still in flight (it used to block the host with ``event.synchronize()``),
   and a reused pinned buffer is not overwritten before its last copy finished (values checked after a
   slow copy is queued ahead of the reuse).
"""

from __future__ import annotations

import importlib
import sys

import torch

SLEEP_CYCLES = 2_000_000_000  # about a second of GPU time (2 GHz): a stream stays visibly busy
_WARM: list[bool] = []


def _queued(fill: float, n: int = 1 << 20) -> torch.Tensor:
    """A tensor whose producing kernels are still queued on the current stream.

    The first launch of a kernel loads its module (CUDA's lazy loading), which can wait for the device: the
    kernels run once beforehand, so the queued ones below are still running when the caller looks.
    """
    if not _WARM:
        torch.cuda._sleep(1000)
        torch.empty(n, device="cuda").fill_(0.0)
        torch.cuda.synchronize()
        _WARM.append(True)
    t = torch.empty(n, device="cuda")
    torch.cuda._sleep(SLEEP_CYCLES)
    return t.fill_(fill)


def check_handoff_waits_for_the_stream() -> None:
    from loom.comm import buffers

    buffers._CUDA_AWARE = True  # force the direct path: only the buffer spec is built, no MPI call is made
    try:
        t = _queued(1.0)
        assert not torch.cuda.current_stream().query(), "the producing kernel finished too soon to tell"
        buffers.as_bytes(t)
        assert torch.cuda.current_stream().query(), "as_bytes handed a device pointer over with work queued"
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            u = _queued(2.0)
            buffers.as_send(u)
            assert side.query(), "as_send did not wait for the side stream that produced the tensor"
        assert float(t[0]) == 1.0 and float(u[-1]) == 2.0
    finally:
        buffers._CUDA_AWARE = None


def _collectives(comm) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1000, 3, device="cuda", generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        y = comm.allreduce(x.to(dtype))
        assert y.device == x.device and torch.equal(y, x.to(dtype)), dtype
    assert torch.equal(comm.allgather(x), x) and torch.equal(comm.alltoall(x), x)
    out, counts = comm.alltoallv(x, [x.shape[0]])
    assert counts == [x.shape[0]] and torch.equal(out, x)
    dst = torch.empty_like(x)
    req = comm.irecv(dst, 0, tag=5)
    comm.isend(_queued(3.0).reshape(-1, 1)[: x.numel()].reshape(x.shape), 0, tag=5).wait()
    assert torch.equal(req.wait(), torch.full_like(x, 3.0))


def check_staged_collectives() -> None:
    from loom.comm import buffers, world

    buffers._CUDA_AWARE = False
    try:
        _collectives(world())
    finally:
        buffers._CUDA_AWARE = None


def check_direct_collectives_if_cuda_aware() -> str:
    from mpi4py import MPI

    from loom.comm import buffers, world

    query = getattr(MPI, "Query_cuda_support", None)
    if query is None or not query():
        return "skipped: this MPI is not CUDA-aware"
    buffers._CUDA_AWARE = True
    try:
        _collectives(world())
    finally:
        buffers._CUDA_AWARE = None
    return "ok"


class _Exported:
    """A CUDA buffer as another library exports it: ``__cuda_array_interface__`` version 3 with its stream."""

    def __init__(self, t: torch.Tensor, stream: torch.cuda.Stream):
        self._t = t  # keeps the memory alive
        self.__cuda_array_interface__ = {**t.__cuda_array_interface__, "version": 3, "stream": stream.cuda_stream}


def check_dask_cuda_frames() -> None:
    from loom.dask import frames

    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        t = _queued(4.0)
    assert not side.query(), "the producing kernel finished too soon to tell"
    arr, flag = frames.frame_array(_Exported(t, side))
    assert side.query(), "frame_array handed a CUDA frame over while its producer stream was busy"
    assert flag == frames.CUDA and arr.dtype == torch.uint8 and arr.numel() == t.numel() * 4
    assert arr.data_ptr() == t.data_ptr() and float(arr.view(torch.float32)[-1]) == 4.0


def check_host_pool() -> None:
    from loom.parallel.offload import HostPool

    pool = HostPool("cuda")
    chunks = [torch.randn(1 << 18, device="cuda") for _ in range(6)]
    handles = [pool.put(c) for c in chunks]
    with torch.cuda.stream(pool._stream):
        # Chunk 0's copy back, and the event free() gets for it, queue behind this: still in flight at free(),
        # whose return then shows that it did not wait. (Queued after the event, a sleep shows nothing: a 1 MiB
        # copy ends within microseconds, before the check looks.)
        torch.cuda._sleep(SLEEP_CYCLES)
    pool.prefetch(handles[0])
    for i, h in enumerate(handles):
        if i + 1 < len(handles):
            pool.prefetch(handles[i + 1])
        got = pool.get(h)
        with torch.cuda.stream(pool._stream):
            torch.cuda._sleep(SLEEP_CYCLES)  # the side stream now lags: an in-flight copy outlives free()
        ev = pool._events[h]
        pool.free(h)
        if i == 0:
            assert not ev.query(), "free() waited on the host for the side stream"
        assert torch.equal(got, chunks[i]), f"chunk {i} changed on its way through host memory"
    # pinned buffers are reused now: fresh data must not be overwritten by a copy still pending
    again = [torch.full((1 << 18,), float(k), device="cuda") for k in range(3)]
    hs = [pool.put(c) for c in again]
    for k, h in enumerate(hs):
        assert torch.equal(pool.pop(h), again[k]), f"reused pinned buffer {k} held stale data"
    torch.cuda.synchronize()


NEEDS = {"check_staged_collectives": ("mpi4py",), "check_direct_collectives_if_cuda_aware": ("mpi4py",),
         "check_dask_cuda_frames": ("distributed", "msgpack")}
"""The modules each check imports beyond torch and loom's own."""


def _missing(check) -> list[str]:
    out = []
    for m in NEEDS.get(check.__name__, ()):
        try:
            importlib.import_module(m)
        except ImportError:
            out.append(m)
    return out


def main() -> int:
    if not torch.cuda.is_available():
        print("SKIP: no CUDA device (torch.cuda.is_available() is False); nothing to check", flush=True)
        return 0
    checks = [check_handoff_waits_for_the_stream, check_staged_collectives, check_direct_collectives_if_cuda_aware,
              check_dask_cuda_frames, check_host_pool]
    for check in checks:
        missing = _missing(check)
        if missing:
            print(f"SKIP {check.__name__}: needs {', '.join(NEEDS[check.__name__])}; missing {', '.join(missing)}",
                  flush=True)
            continue
        note = check()
        print(f"PASS {check.__name__}{': ' + note if isinstance(note, str) else ''}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
