"""``loom plan``: plan multi-path routes for a skewed all-to-all and compare with the baselines.

    loom plan --topology testbed --skew hot-pair --size 16M --png links.png
    loom plan --topology h100 --nodes 8 --skew zipf-pairs:1.5

Prints one row per method (single path, ECMP, rail striping, the MWU planner, the LP optimum): congestion
(the busiest link's milliseconds), the flow-level simulated completion time, the gain over single path,
planning time and the share of bytes moved off the static routes; writes a PNG of link utilisation.
Runs on one process (no MPI).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from .. import cli_args
from ..cli_args import parse_size
from .baselines import ecmp, lp_optimum, single_path, stripe
from .demand import demand_matrix, parse_skew
from .planner import Plan, plan
from .simulate import simulate
from .topology import PRESETS, Topology, preset

__all__ = ["main", "build_parser", "compare"]

RELAUNCH = False  # pure planning: never re-launched under mpiexec
# Re-plans before the timed ones: pairs near min_bytes keep joining the flexible set for the first tens of
# steps (each enumerated once); fewer left the steady-state median with enumerations in it at 64 ranks.
_WARMUP = 50


def build_parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom plan", description=__doc__.split("\n\n")[0])
    cli_args.add_topology(p, nodes=None, per=None, rails=None, topology="testbed",
                          presets=f"{', '.join(PRESETS)}, a TOML file, or auto (found from the machine)")
    p.add_argument("--skew", default="hot-pair", help="balanced | hot-pair | zipf-pairs:A | zipf-dest:A")
    p.add_argument("--size", type=parse_size, default=16 << 20, help="balanced bytes per ordered pair")
    p.add_argument("--seed", type=int, default=0, help="seed of the zipf rankings")
    p.add_argument("--epsilon", type=float, default=0.05, help="MWU accuracy")
    p.add_argument("--increments", type=int, default=32, help="MWU rounds")
    p.add_argument("--min-bytes", type=parse_size, default=1 << 20, help="pairs below stay on the static route")
    p.add_argument("--repeat", type=int, default=7, help="plan this many times; the table shows the median time")
    p.add_argument("--no-lp", action="store_true", help="skip the LP optimum (large topologies)")
    p.add_argument("--no-sim", action="store_true", help="skip the flow-level simulation")
    p.add_argument("--sim-batch", type=float, default=0.01,
                   help="re-share link capacity once this fraction of the running flows finished (0 = at every "
                        "completion, exact; below 200 flows 0.01 is exact too)")
    p.add_argument("--png", metavar="PATH", default=None, help="also plot the link utilisation to PATH")
    cli_args.add_json(p, "the table")
    return p


def _detected() -> Topology:
    """``--topology auto``: the machine's topology (:func:`loom.multipath.detect.detect`), printed."""
    from ..comm import world
    from .detect import detect

    comm = world()
    topo = detect(comm)
    if comm.rank == 0:
        print(f"# detected: {topo.describe()}")
        for g in range(topo.size):
            caps = {topo.links[i].name: topo.links[i].capacity for i in range(len(topo.links))
                    if topo.links[i].name.startswith(f"r{g}>")}
            shown = ", ".join(f"{k.split('>')[1]} {'unlimited' if v == float('inf') else f'{v * 8 / 1e9:g} Gbit/s'}"
                              for k, v in sorted(caps.items()))
            print(f"#   rank {g}: node {topo.node_of[g]}, rail {topo.rail_of[g]}; links to {shown}")
    return topo


def _topology(args) -> Topology:
    if args.topology == "auto":
        return _detected()
    if args.topology.endswith(".toml"):
        return Topology.from_toml(args.topology)
    kw = {k: v for k, v in (("nodes", args.nodes), ("ranks_per_node", args.ranks_per_node),
                            ("rails", args.rails)) if v is not None}
    return preset(args.topology, **kw)


def _median_plan(topo: Topology, demand: np.ndarray, repeat: int, **kw) -> tuple[Plan, float, tuple[float, float]]:
    """The planner's plan, its median CPU seconds over ``repeat`` runs (wall time in ``Plan.seconds``, also
    the median) and the first run's ``(wall, CPU)`` seconds. The first run, which enumerates the topology's
    paths and loads the compiled rounds, is not in the median: a job pays it once."""
    c0 = time.thread_time()
    first = (plan(topo, demand, **kw).seconds, time.thread_time() - c0)
    runs = []
    for _ in range(max(1, repeat)):
        c0 = time.thread_time()
        pl = plan(topo, demand, **kw)
        runs.append((pl.seconds, time.thread_time() - c0, pl))
    wall = float(np.median([r[0] for r in runs]))
    pl = runs[-1][2]
    pl.seconds = wall
    return pl, float(np.median([r[1] for r in runs])), first


def _median_replan(topo: Topology, demand: np.ndarray, repeat: int, seed: int, **kw) -> dict:
    """A job's per-step re-plan: steps that each scale every entry of ``demand`` by a seeded uniform factor in
    [0.7, 1.3] (far outside the ``reuse`` band, and moving pairs across ``min_bytes``) and plan it warm from
    the previous step's plan. The first ``_WARMUP`` steps also enumerate the paths of most pairs new to the
    flexible set (once per pair in a job): their mean is reported apart, the median of the next ``repeat``
    steps is the steady state. Returns milliseconds (wall, CPU) and rounds."""
    rng = np.random.default_rng(seed + 1)
    prev = plan(topo, demand, **kw)
    runs = []
    for _ in range(_WARMUP + max(1, repeat)):
        step = demand * rng.uniform(0.7, 1.3, demand.shape)
        c0 = time.thread_time()
        prev = plan(topo, step, previous=prev, **kw)
        runs.append((prev.seconds, time.thread_time() - c0, prev.rounds))
    first, steady = np.array(runs[:_WARMUP]), np.array(runs[_WARMUP:])
    med = np.median(steady, axis=0)
    return {"replan_ms": med[0] * 1e3, "replan_cpu_ms": med[1] * 1e3, "replan_rounds": float(med[2]),
            "replan_first_ms": float(first[:, 0].mean()) * 1e3, "replan_first_cpu_ms": float(first[:, 1].mean()) * 1e3}


def compare(topo: Topology, demand: np.ndarray, *, epsilon: float = 0.05, increments: int = 32,
            min_bytes: float = 1 << 20, lp: bool = True, sim: bool = True, sim_batch: float = 0.0,
            repeat: int = 1, seed: int = 0) -> list[dict]:
    """Every method's plan and numbers for one demand (rows of the ``loom plan`` table); the planner's time
    is the median of ``repeat`` runs, from scratch and as re-plans of changed counts (:func:`_median_replan`)."""
    kw = dict(epsilon=epsilon, increments=increments, min_bytes=min_bytes)
    mwu, cpu, first = _median_plan(topo, demand, repeat, **kw)
    replan = _median_replan(topo, demand, repeat, seed, **kw)
    plans: list[Plan] = [single_path(topo, demand), ecmp(topo, demand), stripe(topo, demand), mwu]
    if lp:
        try:
            plans.append(lp_optimum(topo, demand))
        except ValueError as exc:
            print(f"# lp skipped: {exc}", file=sys.stderr)
    base = plans[0].congestion
    rows = []
    for pl in plans:
        pl.check(rtol=1e-6)
        t_sim = simulate(pl, batch=sim_batch).seconds if sim else float("nan")
        rows.append({"method": pl.method, "congestion_ms": pl.congestion * 1e3, "sim_ms": t_sim * 1e3,
                     "gain": base / pl.congestion if pl.congestion else 1.0, "plan_ms": pl.seconds * 1e3,
                     "moved_pct": 100 * pl.moved_fraction(), "plan": pl})
        if pl is mwu:
            rows[-1].update(plan_cpu_ms=cpu * 1e3, rounds=pl.rounds, repeat=max(1, repeat),
                            first_plan_ms=first[0] * 1e3, first_plan_cpu_ms=first[1] * 1e3, **replan)
    return rows


def _png(path: str, topo: Topology, rows: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    finite = np.isfinite(topo.capacity)
    util = {r["method"]: r["plan"].utilization * 1e3 for r in rows}
    used = finite & np.any([u > 0 for u in util.values()], axis=0)
    idx = np.nonzero(used)[0]
    fig, ax = plt.subplots(figsize=(max(8, min(24, 0.35 * len(idx) + 4)), 4.5))
    if len(idx) <= 64:
        width = 0.8 / max(len(util), 1)
        for k, (name, u) in enumerate(util.items()):
            ax.bar(np.arange(len(idx)) + k * width, u[idx], width=width, label=name)
        ax.set_xticks(np.arange(len(idx)) + 0.4 - width / 2)
        ax.set_xticklabels([topo.links[i].name for i in idx], rotation=90, fontsize=7)
        ax.set_xlabel("directed link")
    else:
        for name, u in util.items():
            ax.plot(np.sort(u[idx])[::-1], label=name)
        ax.set_xlabel(f"links, busiest first ({len(idx)} loaded)")
        ax.set_xscale("log")
    ax.set_ylabel("busy time (ms)")
    import textwrap

    ax.set_title("\n".join(textwrap.wrap(title, 110)), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.repeat < 1:
            raise ValueError(f"--repeat {args.repeat} must be >= 1")
        if not 0.0 <= args.sim_batch < 1.0:
            raise ValueError(f"--sim-batch {args.sim_batch} must be in [0, 1) (0 = exact)")
        parse_skew(args.skew)
        topo = _topology(args)
    except ValueError as exc:
        print(f"loom plan: {exc}", file=sys.stderr)
        return 2
    if args.topology == "auto":
        from ..comm import world

        if world().rank != 0:  # the other ranks of a job only took part in the detection
            return 0
    demand = demand_matrix(topo.size, args.skew, args.size, seed=args.seed)
    t0 = time.perf_counter()
    rows = compare(topo, demand, epsilon=args.epsilon, increments=args.increments, min_bytes=args.min_bytes,
                   lp=not args.no_lp, sim=not args.no_sim, sim_batch=args.sim_batch, repeat=args.repeat,
                   seed=args.seed)
    title = f"{topo.describe()}; skew {args.skew}, {args.size} B per pair (balanced volume)"
    print(f"# loom plan: {title}")
    if not args.no_sim and args.sim_batch > 0:
        print(f"# simulated: capacity re-shared each time {args.sim_batch:.0%} of the running flows finished "
              f"(--sim-batch 0 for exact)")
    cols = ["Method", "Congestion (ms)", "Simulated (ms)", "vs single", "Plan (ms)", "Moved (%)"]
    widths = [14, 17, 16, 11, 11, 11]
    print("# " + cols[0].ljust(widths[0] - 2) + "".join(c.rjust(w) for c, w in zip(cols[1:], widths[1:])))
    for r in rows:
        cells = [r["method"].ljust(widths[0]), f"{r['congestion_ms']:.2f}".rjust(widths[1]),
                 f"{r['sim_ms']:.2f}".rjust(widths[2]), f"{r['gain']:.2f}x".rjust(widths[3]),
                 f"{r['plan_ms']:.2f}".rjust(widths[4]), f"{r['moved_pct']:.1f}".rjust(widths[5])]
        print("".join(cells))
    for r in rows:
        if "plan_cpu_ms" in r:
            print(f"# {r['method']} planning time, median of {r['repeat']}: {r['plan_ms']:.3f} ms wall, "
                  f"{r['plan_cpu_ms']:.3f} ms CPU, {r['rounds']} rounds; first plan (paths of this topology "
                  f"enumerated): {r['first_plan_ms']:.1f} ms wall, {r['first_plan_cpu_ms']:.1f} ms CPU")
            print(f"# {r['method']} re-planning time (every count x U(0.7, 1.3) each step, warm from the previous "
                  f"step's plan), median of {r['repeat']}: {r['replan_ms']:.3f} ms wall, {r['replan_cpu_ms']:.3f} ms "
                  f"CPU, {r['replan_rounds']:g} rounds; the {_WARMUP} steps before (paths of pairs new to the "
                  f"flexible set enumerated): mean {r['replan_first_ms']:.3f} ms wall, "
                  f"{r['replan_first_cpu_ms']:.3f} ms CPU")
    if args.png:
        _png(args.png, topo, rows, title)
        print(f"# link loads: {args.png}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"title": title, "rows": [{k: v for k, v in r.items() if k != "plan"} for r in rows],
                       "command": " ".join(["loom", "plan", *(argv if argv is not None else sys.argv[1:])]),
                       "seconds": time.perf_counter() - t0}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
