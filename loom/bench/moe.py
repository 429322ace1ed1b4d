"""``loom bench moe``: MoE layer step time (forward + backward) with direct vs multi-path dispatch.

One run times both: the same :class:`loom.parallel.MoE` (same weights, same tokens) with ``multipath=None``
(dispatch/combine by ``comm.alltoallv``) and with ``multipath={"topology": ...}``; rounds interleaved, best
round kept (``loom.bench.omb.time_op``). ``--hot-pair A`` shifts rank 0's tokens toward the gate direction of
the last rank's experts (its rows then go mostly to one rank: a heavy pair, the traffic multi-path can
help); ``0`` keeps the natural, near-balanced routing. The topology is the running testbed's inside
``loom testbed run``, else ``--topology``.

    loom testbed run -N 2 -R 2 -K 2 -- python -m loom.cli bench moe --hot-pair 6
"""

from __future__ import annotations

import argparse

import torch

from .. import cli_args
from ..comm import world
from . import omb

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    p = cli_args.ArgumentParser(prog="loom bench moe", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="tokens per rank (one row each)")
    p.add_argument("--dim", type=int, default=1024, help="model width")
    p.add_argument("--hidden", type=int, default=32, help="expert hidden width (small: the bench is about comm)")
    p.add_argument("--experts-per-rank", type=int, default=2, help="experts on each ep rank")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--hot-pair", type=float, default=6.0, help="bias of rank 0's tokens toward the last rank")
    p.add_argument("--topology", default="auto", help="auto (found from the machine), a TOML file or a preset")
    p.add_argument("--min-bytes", type=omb.parse_size, default=1 << 20, help="multi-path threshold per pair")
    p.add_argument("--iterations", type=int, default=5, help="timed steps per round")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (best kept), direct and multi-path interleaved")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per round")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = p.parse_args(argv)

    from ..multipath.bench import bench_topology
    from ..parallel.moe import MoE, MoEConfig, _init

    torch.set_num_threads(1)
    comm = world()
    topo = bench_topology(args.topology, comm)
    cfg = MoEConfig(dim=args.dim, hidden=args.hidden, experts=args.experts_per_rank * comm.size,
                    top_k=args.top_k, seed=1)
    direct = MoE(cfg, comm)
    multi = MoE(cfg, comm, multipath={"topology": topo, "min_bytes": args.min_bytes})
    gate = _init(cfg)[0]
    hot = gate[-args.experts_per_rank:].mean(0)
    hot = hot / hot.norm()
    table = omb.Table("MoE layer step (forward + backward) Test",
                      ["Tokens", "multipath (ms)", "direct (ms)", "speedup", "hot pair (%)"], rank=comm.rank,
                      meta={"ranks": comm.size, "topology": topo.describe(), "dim": args.dim,
                            "experts": cfg.experts, "top_k": cfg.top_k, "hot_pair_bias": args.hot_pair})
    table.header()
    for n in args.tokens:
        g = torch.Generator().manual_seed(100 + comm.rank)
        x = torch.randn(n, args.dim, generator=g)
        if comm.rank == 0 and args.hot_pair:
            x += args.hot_pair * hot
        with torch.no_grad():
            idx = torch.topk(x @ gate.t(), cfg.top_k, dim=-1).indices
        to_last = float((idx // args.experts_per_rank == comm.size - 1).float().mean())
        share = comm.allgather_object(to_last)[0]

        def step(layer):
            def run():
                xx = x.clone().requires_grad_(True)
                layer(xx).square().mean().backward()
            return run

        best = {"multi": float("inf"), "direct": float("inf")}
        for _ in range(args.rounds):
            for name, layer in (("multi", multi), ("direct", direct)):
                t = omb.time_op(step(layer), comm, args.warmup, args.iterations, max_seconds=args.max_seconds)
                best[name] = min(best[name], comm.allreduce_object(t, "max"))
        table.add(n, best["multi"] * 1e3, best["direct"] * 1e3, best["direct"] / best["multi"],
                  round(100 * share, 1))
    table.write_json(args.json)
    return 0
