"""``loom bench torch``: the ``"loom"`` torch.distributed backend against gloo, in one job, side by side.

One table, every row timed on both backends of the same job (``init_process_group("loom")`` and
``new_group(backend="gloo")`` over the same ranks), rounds interleaved loom / gloo, the best round's mean kept,
the slowest rank's time reported:

* ``allreduce 1 B``: latency of ``dist.all_reduce`` of one uint8 (us);
* ``allreduce SIZE`` and ``reduce_scatter SIZE`` (``--size``, 64 MiB of float32): bus bandwidth in GB/s
  (``2 (P-1)/P x bytes / time`` for allreduce, ``(P-1)/P x bytes / time`` for reduce-scatter, as nccl-tests);
* ``DDP step`` and ``FSDP2 step``: one training step (forward, backward, SGD) of ``loom bench hybrid``'s
  residual MLP (``--width`` x ``--depth``, batch ``--batch`` rows per rank, float32) under
  ``DistributedDataParallel`` (its defaults) and under ``fully_shard`` per block plus the root (ms).

The last column is loom's figure over gloo's: below 1 is better for times, above 1 for bandwidths.
"""

from __future__ import annotations

import argparse
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import cli_args
from ..comm import world
from . import omb
from .hybrid import WideResMLP
from .omb import parse_size

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench torch", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=parse_size, default=parse_size("64M"), help="bytes of the bandwidth rows")
    p.add_argument("-w", "--width", type=int, default=1024, help="DDP/FSDP2 rows: residual block width")
    p.add_argument("-d", "--depth", type=int, default=8, help="DDP/FSDP2 rows: residual blocks")
    p.add_argument("-b", "--batch", type=int, default=16, help="DDP/FSDP2 rows: rows per rank")
    p.add_argument("-i", "--iterations", type=int, default=1000, help="timed calls of the latency row")
    p.add_argument("--iterations-large", type=int, default=10, help="timed calls of the other rows")
    p.add_argument("-x", "--warmup", type=int, default=3, help="untimed calls per row and round (x30 for latency)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per row (loom and gloo interleaved, best kept)")
    p.add_argument("--max-seconds", type=float, default=20.0, help="time bound per row, backend and round")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)

    def step() -> None:
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames reduce_scatter_tensor
    comm = world()
    if comm.size < 2:
        raise cli_args.UsageError("loom bench torch compares two backends' collectives; run it on 2 ranks or more "
                                  "(loom bench torch --ranks 2)")
    dist.init_process_group("loom")
    groups = {"loom": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    # distinct dim names: DTensor caches plans by mesh, and meshes equal in shape and names compare equal
    meshes = {"loom": init_device_mesh("cpu", (comm.size,), mesh_dim_names=("dp",)),
              "gloo": init_device_mesh("cpu", (comm.size,), mesh_dim_names=("dp_gloo",),
                                       backend_override={"dp_gloo": "gloo"})}
    p = comm.size
    n = args.size // 4
    gen = torch.Generator().manual_seed(comm.rank)
    x = torch.randn(args.batch, 64, generator=gen)
    y = torch.randn(args.batch, 16, generator=gen)

    def rows(backend: str) -> dict[str, tuple[Callable[[], None], int, int]]:
        g = groups[backend]
        one = torch.ones(1, dtype=torch.uint8)
        big = torch.ones(n, dtype=torch.float32)
        shard = torch.empty(n // p, dtype=torch.float32)
        torch.manual_seed(0)
        ddp = DDP(WideResMLP(args.width, args.depth), process_group=g)
        torch.manual_seed(0)
        fsdp = WideResMLP(args.width, args.depth)
        for block in fsdp.blocks:
            fully_shard(block, mesh=meshes[backend])
        fully_shard(fsdp, mesh=meshes[backend])
        warm, iters = args.warmup, args.iterations_large
        return {
            "allreduce 1 B": (lambda: dist.all_reduce(one, group=g), 30 * args.warmup, args.iterations),
            f"allreduce {_human(args.size)}": (lambda: dist.all_reduce(big, group=g), warm, iters),
            f"reduce_scatter {_human(args.size)}": (lambda: dist.reduce_scatter_tensor(shard, big, group=g), warm,
                                                    iters),
            "DDP step": (_step(ddp, x, y), warm, iters),
            "FSDP2 step": (_step(fsdp, x, y), warm, iters),
        }

    work = {b: rows(b) for b in groups}
    best: dict[tuple[str, str], float] = {}
    for name in work["loom"]:
        for _ in range(args.rounds):
            for backend in groups:
                fn, warm, iters = work[backend][name]
                t = omb.time_op(fn, comm, warm, iters, max_seconds=args.max_seconds, nbytes=args.size)
                t = comm.allreduce_object(t, "max")
                key = (name, backend)
                best[key] = min(best.get(key, float("inf")), t)

    table = omb.Table("torch.distributed backend: loom vs gloo", ["Test", "unit", "loom", "gloo", "loom/gloo"],
                      rank=comm.rank)
    table.meta = {"ranks": p, "size": args.size, "model": f"WideResMLP width {args.width} depth {args.depth}, "
                  f"batch {args.batch} per rank, float32"}
    table.widths = [22, 8, 12, 12, 12]
    table.header()
    for name in work["loom"]:
        lo, gl = best[(name, "loom")], best[(name, "gloo")]
        if name == "allreduce 1 B":
            table.add(name, "us", lo * 1e6, gl * 1e6, lo / gl)
        elif name.startswith(("allreduce", "reduce_scatter")):
            factor = (2 if name.startswith("allreduce") else 1) * (p - 1) / p
            bw_lo, bw_gl = factor * args.size / lo / 1e9, factor * args.size / gl / 1e9
            table.add(name, "GB/s", bw_lo, bw_gl, bw_lo / bw_gl)
        else:
            table.add(name, "ms", lo * 1e3, gl * 1e3, lo / gl)
    table.write_json(args.json)
    dist.destroy_process_group()
    return 0


def _human(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
