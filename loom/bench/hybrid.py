"""``loom bench hybrid``: training step time of pure data parallel vs pipeline vs hybrid, same model and batch.

The regime where HyPar-Flow's hybrid pays: wide layers and a small global batch, so the data-parallel
gradient allreduce (every rank ships the whole model's gradients) dominates, while a pipeline ships only
``batch x width`` activations. Every mode trains the same wide residual MLP on the same global batch with
SGD; for ``W`` ranks the modes are ``dp`` (``partitions=1, replicas=W``, Horovod-style bucketed allreduce of
all gradients), ``pipeline`` (``partitions=W, replicas=1``) and ``hybrid`` (every other factorisation).

Each mode runs at its own best micro-batch count (``--micro-batches auto``: every count in 1, 2, 4, 8 that
divides its replica batch is timed briefly and the fastest kept): data parallelism wants one micro-batch (more
only re-read every weight for fewer rows), a pipeline wants enough to fill its stages. The peer, torch
``DistributedDataParallel`` on gloo over the same ranks, trains the same model and batch in the same run.

Timing (:func:`loom.bench.omb.time_op`): one thread per rank, warm-up steps excluded, ``--rounds`` rounds with
the modes interleaved, best round's mean kept. Bytes per step are counted by loom.comm, summed over ranks
(DDP's gloo traffic is not). Time on at most as many ranks as there are cores.
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
    p.add_argument("--micro-batches", default="auto",
                   help="micro-batches per replica batch: a number for every mode, or auto (each mode its best)")
    p.add_argument("--schedule", choices=("gpipe", "1f1b", "interleaved"), default="1f1b",
                   help="pipeline schedule")
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


def _mib(nbytes: int | None) -> float | str:
    return "-" if nbytes is None else nbytes / 2**20


def _candidates(arg: str, per: int) -> list[int]:
    if arg == "auto":
        return [m for m in (1, 2, 4, 8) if per % m == 0]
    return [int(arg)] if per % int(arg) == 0 else []


def _ddp_step(args, comm, x, y, loss_fn):
    """torch DDP (gloo) over the same ranks, same model and batch: the peer."""
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    path = comm.bcast_object(tempfile.mktemp(prefix="loom-bench-hybrid-") if comm.rank == 0 else None)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=comm.rank, world_size=comm.size)
    torch.manual_seed(0)
    model = DistributedDataParallel(WideResMLP(args.width, args.depth), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    b = args.batch // comm.size
    sl = slice(comm.rank * b, (comm.rank + 1) * b)

    def step():
        opt.zero_grad(set_to_none=False)
        loss_fn(model(x[sl]), y[sl]).backward()
        opt.step()

    return step, dist


def _best_micro(hp, step, comm, cands: list[int]) -> int:
    """Time each candidate count briefly (max over ranks) and keep the fastest."""
    best, best_t = cands[0], float("inf")
    for m in cands:
        hp.micro_batches = m
        t = comm.allreduce_object(omb.time_op(step, comm, 1, 3, max_seconds=10.0), op="max")
        if t < best_t:
            best, best_t = m, t
    hp.micro_batches = best
    return best


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from ..parallel import HybridParallel

    torch.set_num_threads(1)
    comm = world()
    w = comm.size
    modes = _modes(w)
    if args.micro_batches != "auto" and not args.micro_batches.isdigit():
        print(f"loom bench hybrid: --micro-batches {args.micro_batches!r} is neither a number nor auto",
              file=sys.stderr)
        return 2
    for name, p, r in modes:
        per = args.batch // r if args.batch % r == 0 else 0
        if per == 0 or not _candidates(args.micro_batches, per):
            unit = r * (1 if args.micro_batches == "auto" else int(args.micro_batches))
            print(f"loom bench hybrid: --batch {args.batch} must split into {r} replicas x {args.micro_batches} "
                  f"micro-batches (mode {name}); use a multiple of {unit}", file=sys.stderr)
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
        cands = _candidates(args.micro_batches, args.batch // r)
        hp = HybridParallel(WideResMLP(args.width, args.depth), partitions=p, replicas=r,
                            micro_batches=cands[0], schedule=args.schedule)
        opt = torch.optim.SGD(hp.parameters(), lr=1e-4)
        b = args.batch // r
        sl = slice(hp.replica_index * b, (hp.replica_index + 1) * b)

        def step(hp=hp, opt=opt, sl=sl):
            opt.zero_grad(set_to_none=False)
            hp.train_step(x[sl], y[sl], loss_fn)
            opt.step()

        step()
        micro = _best_micro(hp, step, comm, cands)
        reset_stats()
        step()
        st = stats()
        mine = [sum(st.get(ax, {}).values()) for ax in ("dp", "pp")]
        dp_b, pp_b = (comm.allreduce_object(v) for v in mine)
        runs.append([name, p, r, step, float("inf"), dp_b, pp_b, micro])
    dist = None
    if w > 1 and args.batch % w == 0:
        ddp, dist = _ddp_step(args, comm, x, y, loss_fn)
        runs.append(["torch DDP", 1, w, ddp, float("inf"), None, None, 1])
    params = sum(t.numel() for t in WideResMLP(args.width, args.depth).parameters())
    for _ in range(args.rounds):
        for run in runs:
            run[4] = min(run[4], omb.time_op(run[3], comm, args.warmup, args.iterations,
                                             max_seconds=args.max_seconds))
    # every rank timed the same steps; the slowest rank's time is the step time
    base = comm.allreduce_object(runs[0][4], op="max")
    table = omb.Table("Hybrid Parallel Training Step", ["Mode", "Stages", "Replicas", "Micro", "Step(ms)",
                                                        "dpMB/step", "ppMB/step", "Speedup-vs-dp"], rank=comm.rank)
    table.meta = {"model": f"residual MLP width {args.width} depth {args.depth} ({params / 1e6:.1f} M params, fp32)",
                  "global batch": f"{args.batch}, micro-batches {args.micro_batches} (Micro: the count used), "
                                  f"schedule {args.schedule}",
                  "ranks": f"{w}, 1 thread each, SGD"}
    table.header()
    for name, p, r, _, t, dp_b, pp_b, micro in runs:
        t = comm.allreduce_object(t, op="max")
        table.add(name, p, r, micro, t * 1e3, _mib(dp_b), _mib(pp_b), base / t)
    table.write_json(args.json, argv=argv)
    if dist is not None:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
