"""``loom bench multipath --skew ...``: direct alltoallv vs multi-path alltoallv in one run.

Each size is the *balanced* bytes per ordered pair; the skew reshapes the same total volume
(:mod:`loom.multipath.demand`). Rows are bytes (``uint8``), so counts equal the demand matrix. Both sides
move the identical buffers with identical counts; the multi-path side plans once per size (the plan is
cached, as a training loop with stable routing would) and the peer is ``comm.alltoallv`` (MPI's
``Alltoallv``: every pair on its static route). The topology is ``--topology``: ``auto`` (the default) finds it
from the machine as ``loom plan --topology auto`` does (:func:`loom.multipath.detect.detect`: the emulated
testbed's nodes, rails and ``tc`` rates inside ``loom testbed run``, one shared-memory node otherwise).

``--degrade RAIL:FACTOR`` (inside ``loom testbed run``) measures learned capacities instead: ``--steps`` calls
at full rate, ``--steps`` with rail ``RAIL``'s ``tc`` rate times ``FACTOR``, ``--steps`` restored, at the size
``-m``. Each step times a monitored multi-path call (:class:`loom.multipath.links.LinkMonitor`: measured,
re-planned when a link's estimate moved) and a call on the *static plan* (planned once for the nominal
capacities, as without measurement), interleaved. One row per phase: median times, the rail's share of the
rail bytes in each plan at the phase's end, and the steps until the monitored plan moved; ``--json`` adds
every step.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from ..comm import measure as omb
from ..comm import world
from .demand import demand_matrix, parse_skew
from .detect import resolve
from .links import LinkMonitor, rail_shares
from .planner import plan as make_plan
from .relay import alltoallv as mp_alltoallv
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
    p.add_argument("--degrade", metavar="RAIL:FACTOR", type=_parse_degrade, default=None,
                   help="inside `loom testbed run`: scale rail RAIL's tc rate by FACTOR for the middle phase and "
                        "compare learned capacities with the static plan (size -m)")
    p.add_argument("--steps", type=int, default=12, help="steps per phase with --degrade")
    p.add_argument("--measure-every", type=int, default=1,
                   help="with --degrade: measure one monitored call in this many (LinkMonitor.every)")
    args = p.parse_args(argv)
    try:
        parse_skew(args.skew)
    except ValueError as exc:
        p.error(str(exc))
    if args.steps < 2:
        p.error(f"--steps {args.steps} must be >= 2")
    torch.set_num_threads(1)
    comm = world()
    topo = bench_topology(args.topology, comm)
    if args.degrade is not None:
        return _degrade(args, comm, topo)
    cols = ["Size", "Latency (us)"]
    if args.vs == "direct":
        cols += ["direct (us)", "speedup"]
    cols += ["moved (%)", "plan"]
    table = omb.Table("All-to-Allv multi-path Test", cols, rank=comm.rank,
                      meta={"ranks": comm.size, "skew": args.skew, "topology": topo.describe(), "peer": args.vs,
                            "size": "balanced bytes per ordered pair"})
    table.header()
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


def _parse_degrade(text: str) -> tuple[int, float]:
    rail, _, factor = text.partition(":")
    try:
        out = int(rail), float(factor or 0.5)
    except ValueError:
        out = (-1, 0.0)
    if out[0] < 0 or not 0 < out[1]:
        raise argparse.ArgumentTypeError(f"--degrade {text!r}: give RAIL:FACTOR, a rail index >= 0 and a rate "
                                         f"factor > 0 (e.g. 0:0.5 halves rail 0)")
    return out


def _timed(fn, comm) -> float:
    """Seconds of one collective call, the slowest rank's (ranks start together)."""
    comm.barrier()
    t0 = time.perf_counter()
    fn()
    return comm.allreduce_object(time.perf_counter() - t0, "max")


def _degrade(args, comm, topo: Topology) -> int:
    """``--degrade``: the before / during / after table of learned capacities vs the static plan."""
    from loom.testbed import current_topology, set_rail_rate

    tb = current_topology()
    rail, factor = args.degrade
    if tb is None or rail >= int(tb["rails"]):
        raise SystemExit(f"--degrade changes a rail's tc rate: run it inside `loom testbed run` with more than "
                         f"{rail} rail(s)")
    p, n = comm.size, args.steps
    demand = np.rint(demand_matrix(p, args.skew, args.min_size, seed=args.seed)).astype(np.int64)
    sc, rc = demand[comm.rank].tolist(), demand[:, comm.rank].tolist()
    x = np.full(sum(sc), comm.rank, dtype=np.uint8)
    bytes_ = demand.astype(float) * (1 - np.eye(p))
    static = make_plan(topo, bytes_, min_bytes=args.min_bytes)
    mon = LinkMonitor(topology=topo, every=args.measure_every)
    kw = dict(topology=topo, min_bytes=args.min_bytes, chunk_bytes=args.chunk, counts=demand)
    for _ in range(2):  # warm-up: connections, compilation (not in the monitor: a fresh one follows)
        mp_alltoallv(x, sc, comm, rc, plan=static, **kw)
    trace = []
    for step in range(3 * n):
        if step in (n, 2 * n):
            comm.barrier()
            if comm.rank == 0:
                set_rail_rate(rail, float(tb["rail_gbit"]) * (factor if step == n else 1.0))
            comm.barrier()
        ta = _timed(lambda: mp_alltoallv(x, sc, comm, rc, monitor=mon, **kw), comm)
        ts = _timed(lambda: mp_alltoallv(x, sc, comm, rc, plan=static, **kw), comm)
        trace.append({"step": step, "phase": ("before", "during", "after")[step // n], "adaptive_s": ta,
                      "static_s": ts, "share": float(rail_shares(mon.plan)[rail]), "version": mon.version})
    table = omb.Table(f"All-to-Allv learned capacities Test (rail {rail} at {factor:g}x)",
                      ["Phase", "adaptive (us)", "static (us)", "speedup", f"rail{rail} adaptive (%)",
                       f"rail{rail} static (%)", "moved after (steps)"], rank=comm.rank,
                      meta={"ranks": p, "skew": args.skew, "topology": topo.describe(), "size": args.min_size,
                            "steps per phase": n, "measured": f"one call in {args.measure_every}",
                            "static": "planned once for the nominal capacities"})
    table.header()
    s_static = float(rail_shares(static)[rail])
    for k, phase in enumerate(("before", "during", "after")):
        rows = trace[k * n:(k + 1) * n]
        start = trace[k * n - 1]["share"] if k else rows[0]["share"]
        moved = next((i for i, r in enumerate(rows) if abs(r["share"] - start) > 0.02), None)
        ta = float(np.median([r["adaptive_s"] for r in rows]))
        ts = float(np.median([r["static_s"] for r in rows]))
        table.add(phase, ta * 1e6, ts * 1e6, ts / ta, round(100 * rows[-1]["share"], 1), round(100 * s_static, 1),
                  "-" if moved is None else moved)
    table.write_json(args.json, trace=trace)
    return 0
