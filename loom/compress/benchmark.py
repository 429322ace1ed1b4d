"""``loom bench compress --codec NAME``: compressed vs uncompressed allreduce in one run (OMB format).

Columns after the OMB ``Size``/``Latency``: the uncompressed ``comm.allreduce`` of the same float32 tensor
measured interleaved with it, the latency ratio, the bytes this rank put on the wire for one call with and
without compression (``loom.comm`` accounting, metadata included), their ratio, and the largest error
relative to ``max|sum|``. Latencies are averaged over ranks; the best of ``--rounds`` rounds is kept.
"""

from __future__ import annotations

import argparse

import torch

from ..comm import measure as omb
from ..comm import world
from .codecs import get_codec
from .collectives import DEFAULT_MIN_BYTES
from .collectives import allreduce as c_allreduce
from .collectives import reset_stats, stats

__all__ = ["allreduce_main", "codec_arg", "parser"]


def codec_arg(text: str) -> str:
    """argparse ``type=`` for a codec spec (``int8``, ``int4:block=32``): the text, once :func:`get_codec` takes it."""
    try:
        get_codec(text)
    except (ValueError, TypeError, ImportError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def parser() -> argparse.ArgumentParser:
    p = omb.parser("compress", "compressed allreduce (float32 sum) vs uncompressed, same run",
                   min_size=1024, max_size=1 << 22, vs=("none",), default_vs="none")
    p.add_argument("--codec", required=True, type=codec_arg,
                   help="codec name with options, e.g. int8, int4:block=32, zfp:rate=8")
    p.add_argument("--min-bytes", type=omb.parse_size, default=DEFAULT_MIN_BYTES,
                   help="messages below this go uncompressed")
    return p


def allreduce_main(argv: list[str]) -> int:
    """``loom bench compress``: the table."""
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    comm = world()
    codec = get_codec(args.codec)
    table = omb.Table(
        "Compressed Allreduce Latency Test",
        ["Size", "Latency (us)", "none (us)", "codec/none", "wire B", "raw B", "bytes ratio", "max rel err"],
        rank=comm.rank,
        meta={"ranks": comm.size, "codec": repr(codec), "min_bytes": args.min_bytes,
              "plan": "alltoallv of encoded shards, fp32 reduce, encode once, allgather of encoded shards"},
    )
    table.header()
    g = torch.Generator().manual_seed(1000 + comm.rank)
    for size in omb.sizes(max(args.min_size, 4), args.max_size):
        n = size // 4
        x = torch.randn(n, generator=g)
        exact = comm.allreduce(x.double())
        got = c_allreduce(x, comm, codec, min_bytes=args.min_bytes)
        err = float((got.double() - exact).abs().max() / exact.abs().max().clamp(min=1e-30))
        reset_stats()
        c_allreduce(x, comm, codec, min_bytes=args.min_bytes)
        s = stats().get(comm.name, {"raw": 0, "wire": 0})
        warm, iters = omb.iterations(size, args)
        best_c = best_n = float("inf")
        for _ in range(max(1, args.rounds)):
            best_c = min(best_c, omb.time_op(lambda: c_allreduce(x, comm, codec, min_bytes=args.min_bytes),
                                             comm, warm, iters, max_seconds=args.max_seconds))
            best_n = min(best_n, omb.time_op(lambda: comm.allreduce(x), comm, warm, iters,
                                             max_seconds=args.max_seconds))
        tc = comm.allreduce_object(best_c, "sum") / comm.size
        tn = comm.allreduce_object(best_n, "sum") / comm.size
        wire, raw = s["wire"], s["raw"]
        table.add(size, tc * 1e6, tn * 1e6, tc / tn, wire, raw, (raw / wire) if wire else 1.0, f"{err:.1e}")
    table.write_json(args.json)
    return 0
