"""OSU-style communication benchmarks for ``loom.comm``, each with raw mpi4py as the peer in the same run.

``loom bench latency|bw|bibw|allreduce|allgather|alltoall|alltoallv [--ranks N] [--vs raw] [--buffer torch]``
``loom bench allreduce|allgather|alltoall --device cuda``: the same collective on device tensors against host
tensors, in one run.

The raw peer is what a user writes by hand: mpi4py's uppercase calls on the same buffers (numpy arrays, or
torch tensors handed over through DLPack). ``loom bench latency --buffer torch --vs raw-numpy`` times raw
mpi4py on numpy arrays instead, its fastest path: a tensor's DLPack export costs several times a small
message's latency, so against it loom's own overhead on tensors would not show. This module is the only
place outside ``loom.comm`` that calls mpi4py directly, because measuring against it is the point.

Ratios: for latency tables ``loom/raw`` (lower is better, 1.00 = no overhead); for bandwidth tables
``loom/raw`` of bandwidths (higher is better).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Callable, NamedTuple

import numpy as np
import torch

from ..comm import Communicator, local_device, wait_all, world
from . import omb

__all__ = ["latency", "bw", "bibw", "allreduce", "allgather", "alltoall", "alltoallv", "tour", "raw_collectives"]

WINDOW = 64  # messages in flight per iteration in the bandwidth tests (osu_bw's window)


def _raw():
    from mpi4py import MPI  # the peer: raw mpi4py, deliberately outside loom.comm

    return MPI


def raw_collectives(one: np.ndarray, big: np.ndarray, shard: np.ndarray,
                    one_tensor: Any = None) -> dict[str, Callable[[], None]]:
    """The raw mpi4py column of ``loom bench torch`` and ``loom bench launchers``: what a user writes by hand on
    numpy views of the same buffers (the fastest raw path: in-place ``Allreduce``, ``Reduce_scatter_block``), on a
    duplicate of COMM_WORLD. Keys: ``latency``, ``allreduce``, ``reduce_scatter``, and ``latency_tensor`` (the
    1-byte allreduce handed the torch tensor itself, through its DLPack export) when ``one_tensor`` is given."""
    MPI = _raw()
    c = MPI.COMM_WORLD.Dup()
    extra = {} if one_tensor is None else {"latency_tensor": lambda: c.Allreduce(MPI.IN_PLACE, one_tensor, MPI.SUM)}
    return {**extra, "latency": lambda: c.Allreduce(MPI.IN_PLACE, one, MPI.SUM),
            "allreduce": lambda: c.Allreduce(MPI.IN_PLACE, big, MPI.SUM),
            "reduce_scatter": lambda: c.Reduce_scatter_block(big, shard, MPI.SUM)}


def _buf(kind: str, nbytes: int, dtype=np.uint8, fill: float = 1) -> Any:
    n = nbytes // np.dtype(dtype).itemsize
    a = np.full(n, fill, dtype=dtype)
    return torch.from_numpy(a) if kind == "torch" else a


def _setup(name: str, desc: str, argv: list[str], *, extra: Callable | None = None,
           **kw) -> tuple[argparse.Namespace, Communicator]:
    p = omb.parser(name, desc, **kw)
    if extra is not None:
        extra(p)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    return args, world()


def _run_pair(size: int, args, comm: Communicator, mk_loom: Callable,
              mk_raw: Callable | None) -> tuple[float, float | None]:
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


def _table(title: str, column: str, args, comm: Communicator, mk_loom: Callable, mk_raw: Callable, sizes: list[int],
           value: Callable[[int, float], float], *, average: bool = False, peer: tuple[str, str] | None = None,
           **meta: Any) -> int:
    """Print one benchmark's table, loom against raw mpi4py (``--vs raw``) interleaved.

    ``mk_loom(size)``/``mk_raw(size)`` build the call to time; ``value(size, seconds)`` turns a mean time into
    the column's unit, and ``loom/raw`` is the ratio of the two values. ``average``: the mean over ranks, as OMB
    reports collectives (a ping-pong reports rank 0's time). ``peer``: another peer than raw mpi4py, as
    ``(name, ratio column)``; ``mk_raw`` then builds its call and it is always measured.
    """
    unit = column[column.index("("):]
    name, ratio = peer or ("raw mpi4py", "loom/raw")
    measured = peer is not None or args.vs == "raw"
    cols = ["Size", column] + ([f"{name} {unit}", ratio] if measured else [])
    table = omb.Table(title, cols, rank=comm.rank,
                      meta={"ranks": comm.size, "buffer": args.buffer, "peer": name if peer else args.vs, **meta})
    table.header()
    for size in sizes:
        times = _run_pair(size, args, comm, mk_loom, mk_raw if measured else None)
        if average:
            times = tuple(None if t is None else comm.allreduce_object(t, "sum") / comm.size for t in times)
        vl, vr = (None if t is None else value(size, t) for t in times)
        if vr is None:
            table.add(size, vl)
        else:
            table.add(size, vl, vr, vl / vr)
    table.write_json(args.json)
    return 0


# ------------------------------------------------------------------------------------------ point-to-point
class _P2P(NamedTuple):
    """The point-to-point calls of one side, ``(buffer, peer, tag)`` each: one benchmark body runs on loom's
    calls and on raw mpi4py's, so the two sides time the same pattern."""

    send: Callable
    recv: Callable
    isend: Callable
    irecv: Callable
    waitall: Callable

    @classmethod
    def of_loom(cls, comm: Communicator) -> "_P2P":
        return cls(comm.send, comm.recv, comm.isend, comm.irecv, wait_all)

    @classmethod
    def of_raw(cls) -> "_P2P":
        MPI = _raw()
        raw = MPI.COMM_WORLD
        return cls(raw.Send, raw.Recv, raw.Isend, raw.Irecv, MPI.Request.Waitall)


def _idle() -> None:
    """What a rank other than 0 and 1 times in a point-to-point benchmark."""


def latency(argv: list[str]) -> int:
    """osu_latency: ping-pong between ranks 0 and 1; half the round trip."""
    args, comm = _setup("latency", "point-to-point latency (ping-pong between ranks 0 and 1)", argv, min_size=0,
                        vs=("none", "raw", "raw-numpy"))
    if comm.size < 2:
        print("loom bench latency needs 2 ranks: loom bench latency --ranks 2", file=sys.stderr)
        return 2
    r = comm.rank

    def pingpong(ops: _P2P, kind: str) -> Callable:
        def make(size):
            if r > 1:
                return _idle
            return omb.pingpong(ops.send, ops.recv, _buf(kind, size), 1 - r, first=r == 0)
        return make

    numpy_peer = args.vs == "raw-numpy"  # raw mpi4py's fastest path, whatever loom's --buffer
    return _table("Latency Test", "Latency (us)", args, comm, pingpong(_P2P.of_loom(comm), args.buffer),
                  pingpong(_P2P.of_raw(), "numpy" if numpy_peer else args.buffer),
                  omb.sizes(args.min_size, args.max_size), lambda size, t: t / 2 * 1e6,
                  peer=("raw mpi4py numpy", "loom/raw") if numpy_peer else None)


def _bw(argv: list[str], bidirectional: bool) -> int:
    name = "bibw" if bidirectional else "bw"
    args, comm = _setup(name, f"{'bi' if bidirectional else 'uni'}directional bandwidth, window {WINDOW}", argv,
                        max_size=1 << 22)
    if comm.size < 2:
        print(f"loom bench {name} needs 2 ranks: loom bench {name} --ranks 2", file=sys.stderr)
        return 2
    r = comm.rank
    ack = np.zeros(1, np.uint8)

    def window(ops: _P2P) -> Callable:
        send, recv, isend, irecv, waitall = ops

        def make(size):
            # One send and one receive buffer reused across the window, as osu_bw does (bounded memory at 64 MiB).
            sb, rb = _buf(args.buffer, size), _buf(args.buffer, size)
            bufs, rbufs = [sb] * WINDOW, [rb] * WINDOW
            if r > 1:
                return _idle
            # Rank 0 posts its sends first and rank 1 its receives, then (bibw) the other direction; the
            # rank 1 acknowledges the window so the next one starts after it has all arrived.
            peer = 1 - r
            posts = [(isend, bufs), (irecv, rbufs)] if r == 0 else [(irecv, rbufs), (isend, bufs)]
            posts = posts if bidirectional else posts[:1]

            def f():
                waitall([post(b, peer, 1) for post, window_bufs in posts for b in window_bufs])
                if r == 0:
                    recv(ack, 1, 2)
                else:
                    send(ack, 0, 2)
            return f
        return make

    title = "Bi-Directional Bandwidth Test" if bidirectional else "Bandwidth Test"
    factor = 2 if bidirectional else 1
    return _table(title, "Bandwidth (MB/s)", args, comm, window(_P2P.of_loom(comm)), window(_P2P.of_raw()),
                  omb.sizes(max(args.min_size, 1), args.max_size), lambda size, t: size * WINDOW * factor / 1e6 / t,
                  window=WINDOW)


def bw(argv: list[str]) -> int:
    """osu_bw: rank 0 streams a window of messages to rank 1, which acknowledges each window."""
    return _bw(argv, bidirectional=False)


def bibw(argv: list[str]) -> int:
    """osu_bibw: both ranks stream a window at each other."""
    return _bw(argv, bidirectional=True)


# ------------------------------------------------------------------------------------------ collectives
def _collective_table(title: str, args, comm: Communicator, min_size: int, nbytes: Callable, loom_op: Callable,
                      raw_op: Callable, *, dtype=np.uint8) -> int:
    """The latency table of one collective, loom against raw mpi4py.

    At each size, ``nbytes(size)`` gives the send and receive buffer bytes; each side gets fresh buffers and
    ``op(x, out, size)`` returns the call to time (so per-size set-up such as counts stays out of the loop).
    """
    def maker(op: Callable) -> Callable:
        def make(size: int) -> Callable:
            send, recv = nbytes(size)
            return op(_buf(args.buffer, send, dtype), _buf(args.buffer, recv, dtype), size)
        return make

    return _table(title, "Latency (us)", args, comm, maker(loom_op), maker(raw_op),
                  omb.sizes(max(args.min_size, min_size), args.max_size), lambda size, t: t * 1e6, average=True)


def _device_table(title: str, args, comm: Communicator, min_size: int, op: Callable,
                  nbytes: Callable = lambda size: (size, size)) -> int:
    """The latency table of one loom collective on ``--device`` tensors against the same call on host tensors.

    Both sides are torch tensors of ``--dtype`` filled alike (``nbytes(size)``: the send and receive sides'
    bytes of float32, so a bf16 row moves half the bytes); the device side waits for the device at the end of
    each call (a staged collective may return with its copies still queued), so its time is the whole round trip.
    """
    try:
        device = local_device(args.device)
    except ValueError as e:
        print(f"loom bench: --device {args.device}: {e}", file=sys.stderr)
        return 2
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)

    def maker(dev: torch.device, wait: Callable) -> Callable:
        def make(size: int) -> Callable:
            send, recv = nbytes(size)
            x = _buf("torch", send, np.float32).to(dev, getattr(torch, args.dtype))
            out = x.new_empty(recv // 4)
            call = op(x, out, size)

            def f():
                call()
                wait()
            return f
        return make

    host = torch.device("cpu")
    return _table(title, f"{device.type} Latency (us)", args, comm, maker(device, sync), maker(host, lambda: None),
                  omb.sizes(max(args.min_size, min_size), args.max_size), lambda size, t: t * 1e6, average=True,
                  peer=("host Latency", f"{device.type}/host"), device=str(device), buffer="torch", dtype=args.dtype)


def _device_name(text: str) -> str:
    import re

    if not re.fullmatch(r"cpu|cuda(:\d+)?", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a device; use cpu, cuda or cuda:N")
    return text


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", type=_device_name, default=None, metavar="DEV",
                   help="time the collective on this device's tensors ('cuda', 'cuda:N', 'cpu') against host "
                        "tensors in the same run (ratio DEV/host); replaces the --vs peer")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="element type with --device (Size stays the float32 bytes)")
    p.checks.append(lambda a: f"--dtype {a.dtype} needs --device (the host buffers of the raw comparison are "
                              f"numpy float32); add --device cpu or cuda" if a.dtype != "float32" and a.device is None
                    else None)


def allreduce(argv: list[str]) -> int:
    """osu_allreduce: float32 sum over all ranks; average latency over ranks (compressed: ``loom bench compress``)."""
    args, comm = _setup("allreduce", "allreduce latency (float32 sum)", argv, min_size=4, max_size=1 << 22,
                        extra=_add_device)
    if args.device is not None:
        return _device_table("Allreduce Latency Test", args, comm, 4,
                             lambda x, out, size: lambda: comm.allreduce(x, out=out))
    MPI = _raw()
    raw = MPI.COMM_WORLD
    return _collective_table("Allreduce Latency Test", args, comm, 4, lambda size: (size, size),
                             lambda x, out, size: lambda: comm.allreduce(x, out=out),
                             lambda x, out, size: lambda: raw.Allreduce(x, out, MPI.SUM), dtype=np.float32)


def allgather(argv: list[str]) -> int:
    """osu_allgather: each rank contributes ``size`` bytes."""
    args, comm = _setup("allgather", "allgather latency", argv, min_size=1, max_size=1 << 20, extra=_add_device)
    p = comm.size
    if args.device is not None:
        return _device_table("Allgather Latency Test", args, comm, 4,
                             lambda x, out, size: lambda: comm.allgather(x, out=out), lambda size: (size, size * p))
    raw = _raw().COMM_WORLD
    return _collective_table("Allgather Latency Test", args, comm, 1, lambda size: (size, size * p),
                             lambda x, out, size: lambda: comm.allgather(x, out=out),
                             lambda x, out, size: lambda: raw.Allgather(x, out))


def alltoall(argv: list[str]) -> int:
    """osu_alltoall: ``size`` bytes to every rank."""
    args, comm = _setup("alltoall", "alltoall latency", argv, min_size=1, max_size=1 << 20, extra=_add_device)
    p = comm.size
    if args.device is not None:
        return _device_table("All-to-All Latency Test", args, comm, 4,
                             lambda x, out, size: lambda: comm.alltoall(x, out=out), lambda size: (size * p, size * p))
    raw = _raw().COMM_WORLD
    return _collective_table("All-to-All Latency Test", args, comm, 1, lambda size: (size * p, size * p),
                             lambda x, out, size: lambda: comm.alltoall(x, out=out),
                             lambda x, out, size: lambda: raw.Alltoall(x, out))


def alltoallv(argv: list[str]) -> int:
    """osu_alltoallv: ``size`` bytes to every rank through the vector interface (counts known to both sides).

    Skewed counts, multi-path vs direct: ``loom bench multipath`` (:mod:`loom.multipath.bench`).
    """
    args, comm = _setup("alltoallv", "alltoallv latency (uniform counts)", argv, min_size=1, max_size=1 << 20)
    MPI = _raw()
    raw = MPI.COMM_WORLD
    p = comm.size

    def loom_op(x, out, size):
        counts = [size] * p
        return lambda: comm.alltoallv(x, counts, counts)

    def raw_op(x, out, size):
        counts, displs = [size] * p, [i * size for i in range(p)]
        return lambda: raw.Alltoallv([x, counts, displs, MPI.BYTE], [out, counts, displs, MPI.BYTE])

    return _collective_table("All-to-Allv Latency Test", args, comm, 1, lambda size: (size * p, size * p),
                             loom_op, raw_op)


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
