"""``loom bench hybrid``: training step time of pure data parallel vs pipeline vs hybrid, same model and batch.

The regime where HyPar-Flow's hybrid pays: wide layers and a small global batch, so the data-parallel
gradient allreduce (every rank ships the whole model's gradients) dominates, while a pipeline ships only
``batch x width`` activations. Every mode trains the same wide residual MLP on the same global batch with
SGD; for ``W`` ranks the modes are ``dp`` (``partitions=1, replicas=W``, Horovod-style bucketed allreduce of
all gradients), ``pipeline`` (``partitions=W, replicas=1``) and ``hybrid`` (every other factorisation).

Timing (:func:`loom.bench.omb.time_op`): one thread per rank, warm-up steps excluded, ``--rounds`` rounds with
the modes interleaved, best round's mean kept. Bytes per step are counted by loom.comm, summed over ranks.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

from .. import cli_args
from ..comm import reset_stats, stats, world
from . import omb

__all__ = ["main", "WideResMLP"]


class WideResMLP(nn.Module):
    """``depth`` residual blocks ``h = h + relu(W h)`` of ``width`` features between an input and an output."""

    def __init__(self, width: int, depth: int, d_in: int = 64, d_out: int = 16):
        super().__init__()
        self.inp = nn.Linear(d_in, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(depth)])
        self.out = nn.Linear(width, d_out)

    def forward(self, x):
        h = self.inp(x)
        for b in self.blocks:
            h = h + torch.relu(b(h))
        return self.out(h)


def _parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench hybrid", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("-w", "--width", type=int, default=1024, help="hidden width of the residual blocks")
    p.add_argument("-d", "--depth", type=int, default=16, help="residual blocks (each width x width)")
    p.add_argument("-b", "--batch", type=int, default=16, help="global batch size (rows)")
    p.add_argument("--micro-batches", type=int, default=4, help="micro-batches per replica batch")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b", help="pipeline schedule")
    p.add_argument("-i", "--iterations", type=int, default=10, help="timed steps per round")
    p.add_argument("-x", "--warmup", type=int, default=2, help="untimed steps per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds (modes interleaved, best kept)")
    p.add_argument("--max-seconds", type=float, default=30.0, help="time bound per mode and round")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _modes(world_size: int) -> list[tuple[str, int, int]]:
    out = [("dp", 1, world_size)]
    for p in range(2, world_size):
        if world_size % p == 0:
            out.append(("hybrid", p, world_size // p))
    if world_size > 1:
        out.append(("pipeline", world_size, 1))
    return out


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..parallel import HybridParallel

    torch.set_num_threads(1)
    comm = world()
    w = comm.size
    modes = _modes(w)
    for name, p, r in modes:
        per = args.batch // r if args.batch % r == 0 else 0
        if per == 0 or per % args.micro_batches:
            print(f"loom bench hybrid: --batch {args.batch} must split into {r} replicas x {args.micro_batches} "
                  f"micro-batches (mode {name}); use a multiple of {r * args.micro_batches}", file=sys.stderr)
            return 2
        if p > args.depth + 2:
            print(f"loom bench hybrid: {p} stages exceed the model's {args.depth + 2} layers; raise --depth",
                  file=sys.stderr)
            return 2
    g = torch.Generator().manual_seed(0)
    x = torch.randn(args.batch, 64, generator=g)
    y = torch.randn(args.batch, 16, generator=g)
    loss_fn = nn.MSELoss()
    runs = []
    for name, p, r in modes:
        torch.manual_seed(0)
        hp = HybridParallel(WideResMLP(args.width, args.depth), partitions=p, replicas=r,
                            micro_batches=args.micro_batches, schedule=args.schedule)
        opt = torch.optim.SGD(hp.parameters(), lr=1e-4)
        b = args.batch // r
        sl = slice(hp.replica_index * b, (hp.replica_index + 1) * b)

        def step(hp=hp, opt=opt, sl=sl):
            opt.zero_grad(set_to_none=False)
            hp.train_step(x[sl], y[sl], loss_fn)
            opt.step()

        step()
        reset_stats()
        step()
        st = stats()
        mine = [sum(st.get(ax, {}).values()) for ax in ("dp", "pp")]
        dp_b, pp_b = (comm.allreduce_object(v) for v in mine)
        runs.append([name, p, r, step, float("inf"), dp_b, pp_b])
    params = sum(t.numel() for t in WideResMLP(args.width, args.depth).parameters())
    for _ in range(args.rounds):
        for run in runs:
            run[4] = min(run[4], omb.time_op(run[3], comm, args.warmup, args.iterations,
                                             max_seconds=args.max_seconds))
    # every rank timed the same steps; the slowest rank's time is the step time
    base = comm.allreduce_object(runs[0][4], op="max")
    table = omb.Table("Hybrid Parallel Training Step", ["Mode", "Stages", "Replicas", "Step(ms)", "dpMB/step",
                                                        "ppMB/step", "Speedup-vs-dp"], rank=comm.rank)
    table.meta = {"model": f"residual MLP width {args.width} depth {args.depth} ({params / 1e6:.1f} M params, fp32)",
                  "global batch": f"{args.batch}, micro-batches {args.micro_batches}, schedule {args.schedule}",
                  "ranks": f"{w}, 1 thread each, SGD"}
    table.header()
    for name, p, r, _, t, dp_b, pp_b in runs:
        t = comm.allreduce_object(t, op="max")
        table.add(name, p, r, t * 1e3, dp_b / 2**20, pp_b / 2**20, base / t)
    table.write_json(args.json, argv=argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
