"""``loom bench multipath --skew ...``: direct alltoallv vs multi-path alltoallv in one run.

Each size is the *balanced* bytes per ordered pair; the skew reshapes the same total volume
(:mod:`loom.multipath.demand`). Rows are bytes (``uint8``), so counts equal the demand matrix. Both sides
move the identical buffers with identical counts; the multi-path side plans once per size (the plan is
cached, as a training loop with stable routing would) and the peer is ``comm.alltoallv`` (MPI's
``Alltoallv``: every pair on its static route). The topology is ``--topology``: ``auto`` (the default) finds it
from the machine as ``loom plan --topology auto`` does (:func:`loom.multipath.detect.detect`: the emulated
testbed's nodes, rails and ``tc`` rates inside ``loom testbed run``, one shared-memory node otherwise).
"""

from __future__ import annotations

import numpy as np
import torch

from ..comm import measure as omb
from ..comm import world
from .demand import demand_matrix, parse_skew
from .relay import alltoallv as mp_alltoallv
from .detect import resolve
from .topology import PRESETS, Topology

__all__ = ["alltoallv_skew", "bench_topology"]


def bench_topology(name: str, comm) -> Topology:
    """``--topology`` for ``comm``'s ranks (collective): ``auto`` detected from the machine, a TOML file, or a
    preset fitted to the job (:func:`loom.multipath.detect.resolve`)."""
    return resolve(name, comm)


def alltoallv_skew(argv: list[str]) -> int:
    p = omb.parser("multipath", "alltoallv with skewed counts: multi-path vs direct", min_size=1 << 20,
                   max_size=4 << 20, vs=("none", "direct"), default_vs="direct")
    p.add_argument("--skew", default="balanced", help="balanced | hot-pair | zipf-pairs:A | zipf-dest:A")
    p.add_argument("--topology", default="auto",
                   help=f"auto (found from the machine), a TOML file or a preset ({', '.join(PRESETS)})")
    p.add_argument("--seed", type=int, default=0, help="seed of the zipf rankings")
    p.add_argument("--min-bytes", type=omb.parse_size, default=1 << 20, help="multi-path threshold per pair")
    p.add_argument("--exchange", action="store_true",
                   help="multi-path side learns the counts matrix by an allgather every call")
    p.add_argument("--chunk", type=omb.parse_size, default=1 << 20, help="relay chunk bytes")
    args = p.parse_args(argv)
    try:
        parse_skew(args.skew)
    except ValueError as exc:
        p.error(str(exc))
    torch.set_num_threads(1)
    comm = world()
    topo = bench_topology(args.topology, comm)
    cols = ["Size", "Latency (us)"]
    if args.vs == "direct":
        cols += ["direct (us)", "speedup"]
    cols += ["moved (%)", "plan"]
    table = omb.Table("All-to-Allv multi-path Test", cols, rank=comm.rank,
                      meta={"ranks": comm.size, "skew": args.skew, "topology": topo.describe(), "peer": args.vs,
                            "size": "balanced bytes per ordered pair"})
    table.header()
    from .planner import plan as make_plan

    for size in omb.sizes(args.min_size, args.max_size):
        demand = np.rint(demand_matrix(comm.size, args.skew, size, seed=args.seed)).astype(np.int64)
        sc = demand[comm.rank].tolist()
        rc = demand[:, comm.rank].tolist()
        x = np.full(sum(sc), comm.rank, dtype=np.uint8)
        if args.buffer == "torch":
            x = torch.from_numpy(x)
        # Both sides know the counts up front (the direct side gets recv_counts, the multi-path side the
        # whole matrix, as an MoE gets it from an allgather of expert counts instead of an alltoall).
        kw = dict(topology=topo, min_bytes=args.min_bytes, chunk_bytes=args.chunk,
                  counts=None if args.exchange else demand)
        warm, iters = omb.iterations(size, args)
        best_m = best_d = float("inf")
        for _ in range(max(1, args.rounds)):
            best_m = min(best_m, omb.time_op(lambda: mp_alltoallv(x, sc, comm, rc, **kw), comm, warm, iters,
                                             max_seconds=args.max_seconds))
            if args.vs == "direct":
                best_d = min(best_d, omb.time_op(lambda: comm.alltoallv(x, sc, rc), comm, warm, iters,
                                                 max_seconds=args.max_seconds))
        tm = comm.allreduce_object(best_m, "max")
        pl = make_plan(topo, demand.astype(float) * (1 - np.eye(comm.size)), min_bytes=args.min_bytes)
        row = [size, tm * 1e6]
        if args.vs == "direct":
            td = comm.allreduce_object(best_d, "max")
            row += [td * 1e6, td / tm]
        row += [round(100 * pl.moved_fraction(), 1), pl.method]
        table.add(*row)
    table.write_json(args.json)
    return 0
