"""OSU-style communication benchmarks for ``loom.comm``, each with raw mpi4py as the peer in the same run.

``loom bench latency|bw|bibw|allreduce|allgather|alltoall|alltoallv [--ranks N] [--vs raw] [--buffer torch]``

The raw peer is what a user writes by hand: mpi4py's uppercase calls on the same buffers (numpy arrays, or
torch tensors handed over through DLPack). This module is the only place outside ``loom.comm`` that calls
mpi4py directly, because measuring against it is the point.

Ratios: for latency tables ``loom/raw`` (lower is better, 1.00 = no overhead); for bandwidth tables
``loom/raw`` of bandwidths (higher is better).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable

import numpy as np
import torch

from ..comm import Communicator, wait_all, world
from . import omb

__all__ = ["latency", "bw", "bibw", "allreduce", "allgather", "alltoall", "alltoallv", "tour"]

WINDOW = 64  # messages in flight per iteration in the bandwidth tests (osu_bw's window)


def _raw():
    from mpi4py import MPI  # the peer: raw mpi4py, deliberately outside loom.comm

    return MPI


def _buf(kind: str, nbytes: int, dtype=np.uint8, fill: float = 1) -> Any:
    n = nbytes // np.dtype(dtype).itemsize
    a = np.full(n, fill, dtype=dtype)
    return torch.from_numpy(a) if kind == "torch" else a


def _setup(name: str, desc: str, argv: list[str], **kw) -> tuple[argparse.Namespace, Communicator]:
    p = omb.parser(name, desc, **kw)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return args, world()


def _run_pair(size: int, args, comm: Communicator, mk_loom: Callable, mk_raw: Callable | None) -> tuple[float, float | None]:
    """Best-of-rounds mean seconds per iteration for loom and (interleaved) the raw peer."""
    warm, iters = omb.iterations(size, args)
    best_l = best_r = float("inf")
    fl = mk_loom(size)
    fr = mk_raw(size) if mk_raw is not None else None
    for _ in range(max(1, args.rounds)):
        best_l = min(best_l, omb.time_op(fl, comm, warm, iters, max_seconds=args.max_seconds, nbytes=size))
        if fr is not None:
            best_r = min(best_r, omb.time_op(fr, comm, warm, iters, max_seconds=args.max_seconds, nbytes=size))
    return best_l, (best_r if fr is not None else None)


def _latency_table(title: str, args, comm: Communicator, sizes: list[int], mk_loom, mk_raw, *, reduce: str) -> int:
    cols = ["Size", "Latency (us)"]
    if args.vs == "raw":
        cols += ["raw mpi4py (us)", "loom/raw"]
    table = omb.Table(title, cols, rank=comm.rank,
                      meta={"ranks": comm.size, "buffer": args.buffer, "peer": args.vs})
    table.header()
    for size in sizes:
        tl, tr = _run_pair(size, args, comm, mk_loom, mk_raw if args.vs == "raw" else None)
        # OMB reports the average over ranks for collectives, rank 0's half round trip for ping-pong.
        tl = comm.allreduce_object(tl, "sum") / comm.size if reduce == "avg" else tl
        if tr is not None:
            tr = comm.allreduce_object(tr, "sum") / comm.size if reduce == "avg" else tr
            table.add(size, tl * 1e6, tr * 1e6, tl / tr)
        else:
            table.add(size, tl * 1e6)
    table.write_json(args.json)
    return 0


# ------------------------------------------------------------------------------------------ point-to-point
def latency(argv: list[str]) -> int:
    """osu_latency: ping-pong between ranks 0 and 1; half the round trip."""
    args, comm = _setup("latency", "point-to-point latency (ping-pong between ranks 0 and 1)", argv, min_size=0)
    if comm.size < 2:
        print("loom bench latency needs 2 ranks: loom bench latency --ranks 2", file=sys.stderr)
        return 2
    r = comm.rank
    MPI = _raw()
    raw = MPI.COMM_WORLD

    def mk_loom(size):
        b = _buf(args.buffer, size)
        if r == 0:
            def f():
                comm.send(b, 1)
                comm.recv(b, 1)
        elif r == 1:
            def f():
                comm.recv(b, 0)
                comm.send(b, 0)
        else:
            def f():
                pass
        return f

    def mk_raw(size):
        b = _buf(args.buffer, size)
        if r == 0:
            def f():
                raw.Send(b, 1, 0)
                raw.Recv(b, 1, 0)
        elif r == 1:
            def f():
                raw.Recv(b, 0, 0)
                raw.Send(b, 0, 0)
        else:
            def f():
                pass
        return f

    cols = ["Size", "Latency (us)"] + (["raw mpi4py (us)", "loom/raw"] if args.vs == "raw" else [])
    table = omb.Table("Latency Test", cols, rank=r, meta={"ranks": comm.size, "buffer": args.buffer, "peer": args.vs})
    table.header()
    for size in omb.sizes(args.min_size, args.max_size):
        tl, tr = _run_pair(size, args, comm, mk_loom, mk_raw if args.vs == "raw" else None)
        if tr is not None:
            table.add(size, tl / 2 * 1e6, tr / 2 * 1e6, tl / tr)
        else:
            table.add(size, tl / 2 * 1e6)
    table.write_json(args.json)
    return 0


def _bw(argv: list[str], bidirectional: bool) -> int:
    name = "bibw" if bidirectional else "bw"
    args, comm = _setup(name, f"{'bi' if bidirectional else 'uni'}directional bandwidth, window {WINDOW}", argv,
                        max_size=1 << 22)
    if comm.size < 2:
        print(f"loom bench {name} needs 2 ranks: loom bench {name} --ranks 2", file=sys.stderr)
        return 2
    r = comm.rank
    MPI = _raw()
    raw = MPI.COMM_WORLD
    ack = np.zeros(1, np.uint8)

    def mk_loom(size):
        # One send and one receive buffer reused across the window, as osu_bw does (bounded memory at 64 MiB).
        sb, rb = _buf(args.buffer, size), _buf(args.buffer, size)
        bufs, rbufs = [sb] * WINDOW, [rb] * WINDOW
        if r == 0:
            def f():
                reqs = [comm.isend(b, 1, 1) for b in bufs]
                if bidirectional:
                    reqs += [comm.irecv(b, 1, 1) for b in rbufs]
                wait_all(reqs)
                comm.recv(ack, 1, 2)
        elif r == 1:
            def f():
                reqs = [comm.irecv(b, 0, 1) for b in rbufs]
                if bidirectional:
                    reqs += [comm.isend(b, 0, 1) for b in bufs]
                wait_all(reqs)
                comm.send(ack, 0, 2)
        else:
            def f():
                pass
        return f

    def mk_raw(size):
        sb, rb = _buf(args.buffer, size), _buf(args.buffer, size)
        bufs, rbufs = [sb] * WINDOW, [rb] * WINDOW
        if r == 0:
            def f():
                reqs = [raw.Isend(b, 1, 1) for b in bufs]
                if bidirectional:
                    reqs += [raw.Irecv(b, 1, 1) for b in rbufs]
                MPI.Request.Waitall(reqs)
                raw.Recv(ack, 1, 2)
        elif r == 1:
            def f():
                reqs = [raw.Irecv(b, 0, 1) for b in rbufs]
                if bidirectional:
                    reqs += [raw.Isend(b, 0, 1) for b in bufs]
                MPI.Request.Waitall(reqs)
                raw.Send(ack, 0, 2)
        else:
            def f():
                pass
        return f

    cols = ["Size", "Bandwidth (MB/s)"] + (["raw mpi4py (MB/s)", "loom/raw"] if args.vs == "raw" else [])
    title = "Bi-Directional Bandwidth Test" if bidirectional else "Bandwidth Test"
    table = omb.Table(title, cols, rank=r, meta={"ranks": comm.size, "buffer": args.buffer, "peer": args.vs,
                                                  "window": WINDOW})
    table.header()
    factor = 2 if bidirectional else 1
    for size in omb.sizes(max(args.min_size, 1), args.max_size):
        tl, tr = _run_pair(size, args, comm, mk_loom, mk_raw if args.vs == "raw" else None)
        mb = size * WINDOW * factor / 1e6
        if tr is not None:
            table.add(size, mb / tl, mb / tr, tr / tl)
        else:
            table.add(size, mb / tl)
    table.write_json(args.json)
    return 0


def bw(argv: list[str]) -> int:
    """osu_bw: rank 0 streams a window of messages to rank 1, which acknowledges each window."""
    return _bw(argv, bidirectional=False)


def bibw(argv: list[str]) -> int:
    """osu_bibw: both ranks stream a window at each other."""
    return _bw(argv, bidirectional=True)


# ------------------------------------------------------------------------------------------ collectives
def allreduce(argv: list[str]) -> int:
    """osu_allreduce: float32 sum over all ranks; average latency over ranks (compressed: ``loom bench compress``)."""
    args, comm = _setup("allreduce", "allreduce latency (float32 sum)", argv, min_size=4, max_size=1 << 22)
    MPI = _raw()
    raw = MPI.COMM_WORLD

    def mk_loom(size):
        x = _buf(args.buffer, size, np.float32)
        out = _buf(args.buffer, size, np.float32)
        return lambda: comm.allreduce(x, out=out)

    def mk_raw(size):
        x = _buf(args.buffer, size, np.float32)
        out = _buf(args.buffer, size, np.float32)
        return lambda: raw.Allreduce(x, out, MPI.SUM)

    return _latency_table("Allreduce Latency Test", args, comm, omb.sizes(max(args.min_size, 4), args.max_size),
                          mk_loom, mk_raw, reduce="avg")


def allgather(argv: list[str]) -> int:
    """osu_allgather: each rank contributes ``size`` bytes."""
    args, comm = _setup("allgather", "allgather latency", argv, min_size=1, max_size=1 << 20)
    MPI = _raw()
    raw = MPI.COMM_WORLD
    p = comm.size

    def mk_loom(size):
        x = _buf(args.buffer, size)
        out = _buf(args.buffer, size * p)
        return lambda: comm.allgather(x, out=out)

    def mk_raw(size):
        x = _buf(args.buffer, size)
        out = _buf(args.buffer, size * p)
        return lambda: raw.Allgather(x, out)

    return _latency_table("Allgather Latency Test", args, comm, omb.sizes(max(args.min_size, 1), args.max_size),
                          mk_loom, mk_raw, reduce="avg")


def alltoall(argv: list[str]) -> int:
    """osu_alltoall: ``size`` bytes to every rank."""
    args, comm = _setup("alltoall", "alltoall latency", argv, min_size=1, max_size=1 << 20)
    MPI = _raw()
    raw = MPI.COMM_WORLD
    p = comm.size

    def mk_loom(size):
        x = _buf(args.buffer, size * p)
        out = _buf(args.buffer, size * p)
        return lambda: comm.alltoall(x, out=out)

    def mk_raw(size):
        x = _buf(args.buffer, size * p)
        out = _buf(args.buffer, size * p)
        return lambda: raw.Alltoall(x, out)

    return _latency_table("All-to-All Latency Test", args, comm, omb.sizes(max(args.min_size, 1), args.max_size),
                          mk_loom, mk_raw, reduce="avg")


def alltoallv(argv: list[str]) -> int:
    """osu_alltoallv: ``size`` bytes to every rank through the vector interface (counts known to both sides).

    Skewed counts, multi-path vs direct: ``loom bench multipath`` (:mod:`loom.multipath.bench`).
    """
    args, comm = _setup("alltoallv", "alltoallv latency (uniform counts)", argv, min_size=1, max_size=1 << 20)
    MPI = _raw()
    raw = MPI.COMM_WORLD
    p = comm.size

    def mk_loom(size):
        x = _buf(args.buffer, size * p)
        counts = [size] * p
        return lambda: comm.alltoallv(x, counts, counts)

    def mk_raw(size):
        x = _buf(args.buffer, size * p)
        out = _buf(args.buffer, size * p)
        counts = [size] * p
        displs = [i * size for i in range(p)]
        return lambda: raw.Alltoallv([x, counts, displs, MPI.BYTE], [out, counts, displs, MPI.BYTE])

    return _latency_table("All-to-Allv Latency Test", args, comm, omb.sizes(max(args.min_size, 1), args.max_size),
                          mk_loom, mk_raw, reduce="avg")


def tour(argv: list[str] | None = None) -> int:
    """A short tour: latency, bandwidth, allreduce and alltoallv tables on the ranks of this job."""
    quick = ["--rounds", "1", "-i", "200", "-x", "20", "--iterations-large", "20", "--warmup-large", "2"]
    comm = world()
    if comm.size >= 2:
        latency(["-M", "4K", *quick])
        bw(["-M", "1M", *quick])
    allreduce(["-M", "1M", *quick])
    alltoallv(["-M", "64K", *quick])
    return 0
