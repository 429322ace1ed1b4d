"""``loom bench torch``: the ``"loom"`` torch.distributed backend against gloo, in one job, side by side.

One table, every row timed on both backends of the same job (``init_process_group("loom")`` and
``new_group(backend="gloo")`` over the same ranks) and, for the collectives, on raw mpi4py (in-place
``Allreduce`` / ``Reduce_scatter_block`` on numpy views of the same buffers: the limit under the backend),
rounds interleaved loom / gloo / raw, the best round's mean kept, the slowest rank's time reported:

* ``allreduce 1 B``: latency of ``dist.all_reduce`` of one uint8 (us);
* ``allreduce SIZE`` and ``reduce_scatter SIZE`` (``--size``, 64 MiB of float32): bus bandwidth in GB/s
  (``2 (P-1)/P x bytes / time`` for allreduce, ``(P-1)/P x bytes / time`` for reduce-scatter, as nccl-tests);
* ``DDP step`` and ``FSDP2 step``: one training step (forward, backward, SGD) of ``loom bench hybrid``'s
  residual MLP (``--width`` x ``--depth``, batch ``--batch`` rows per rank, float32) under
  ``DistributedDataParallel`` (its defaults) and under ``fully_shard`` per block plus the root (ms).

The ratio columns are loom's figure over gloo's and over raw mpi4py's: below 1 is better for times, above 1
for bandwidths. ``--only`` keeps some of these rows.

``--codec CODEC`` (repeatable) adds a second table, DDP under a dp codec: the same DDP training (model, initial
weights, per-rank batches, step count) on gloo, on loom uncompressed, and on loom with each codec as the
group's compression policy (:func:`loom.torchdist.set_compression`, error feedback per bucket), rounds
interleaved. Per row: the median step time (the slowest rank's), the speed-up over uncompressed loom, this
rank's gradient bytes per step raw and on the wire (``loom.compress.stats()`` for a compressed group, the
group's ``bytes_sent`` uncompressed, both counted as :mod:`loom.comm` counts an allreduce), and the loss of
the last step (mean over ranks) with its gap to uncompressed loom. The batches regress a fixed random linear
teacher, so the loss falls and a codec that hurts training shows.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from .. import cli_args
from ..comm import world
from ..compress.benchmark import codec_arg
from . import omb
from .hybrid import WideResMLP
from .omb import parse_size

__all__ = ["main"]

#: ``--only`` names of the first table's rows
ROWS = ("latency", "allreduce", "reduce_scatter", "ddp", "fsdp2")


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
    p.add_argument("--only", nargs="+", choices=ROWS, metavar="ROW",
                   help=f"run only these rows of the loom vs gloo table ({', '.join(ROWS)}; default: all)")
    p.add_argument("--codec", action="append", type=codec_arg, default=[], metavar="CODEC",
                   help="add a DDP row under this dp codec (repeatable; e.g. int8, int4, powersgd:rank=4): a "
                        "second table, DDP on gloo, loom and loom + each codec, same model, seeds and steps")
    p.add_argument("--breakdown", action="store_true",
                   help="add a table of where a 1-byte allreduce's time goes: raw mpi4py on a numpy view and on the "
                        "tensor, torch's dispatch into a Python group that does nothing, loom.comm, dist.all_reduce")
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


def _setup(args, comm):
    """The default group on loom, a gloo group of the same ranks, a 1-D mesh on each: ``(groups, meshes)``."""
    dist.init_process_group("loom")
    groups = {"loom": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    from torch.distributed.device_mesh import init_device_mesh

    # distinct dim names: DTensor caches plans by mesh, and meshes equal in shape and names compare equal
    meshes = {"loom": init_device_mesh("cpu", (comm.size,), mesh_dim_names=("dp",)),
              "gloo": init_device_mesh("cpu", (comm.size,), mesh_dim_names=("dp_gloo",),
                                       backend_override={"dp_gloo": "gloo"})}
    return groups, meshes


def _rows(args, comm, groups, meshes) -> dict[str, dict[str, tuple[Callable[[], None], int, int]]]:
    """``{row: {backend: (call, warm-up calls, timed calls)}}``; backends ``loom``, ``gloo`` and, for the
    collectives, ``raw`` (mpi4py on the same buffers)."""
    from torch.distributed.fsdp import fully_shard
    from torch.nn.parallel import DistributedDataParallel as DDP

    from .comm import raw_collectives

    only, p = set(args.only or ROWS), comm.size
    one = torch.ones(1, dtype=torch.uint8)
    big = torch.ones(args.size // 4 if only & {"allreduce", "reduce_scatter"} else 0, dtype=torch.float32)
    shard = torch.empty(big.numel() // p, dtype=torch.float32)
    raw = raw_collectives(one.numpy(), big.numpy(), shard.numpy())
    gen = torch.Generator().manual_seed(comm.rank)
    x, y = torch.randn(args.batch, 64, generator=gen), torch.randn(args.batch, 16, generator=gen)
    warm, iters = args.warmup, args.iterations_large
    out: dict[str, dict] = {}
    for backend, g in groups.items():
        if "latency" in only:
            out.setdefault("allreduce 1 B", {})[backend] = (
                lambda g=g: dist.all_reduce(one, group=g), 30 * warm, args.iterations)
        if "allreduce" in only:
            out.setdefault(f"allreduce {_human(args.size)}", {})[backend] = (
                lambda g=g: dist.all_reduce(big, group=g), warm, iters)
        if "reduce_scatter" in only:
            out.setdefault(f"reduce_scatter {_human(args.size)}", {})[backend] = (
                lambda g=g: dist.reduce_scatter_tensor(shard, big, group=g), warm, iters)
        if "ddp" in only:
            torch.manual_seed(0)
            out.setdefault("DDP step", {})[backend] = (
                _step(DDP(WideResMLP(args.width, args.depth), process_group=g), x, y), warm, iters)
        if "fsdp2" in only:
            torch.manual_seed(0)
            fsdp = WideResMLP(args.width, args.depth)
            for block in fsdp.blocks:
                fully_shard(block, mesh=meshes[backend])
            fully_shard(fsdp, mesh=meshes[backend])
            out.setdefault("FSDP2 step", {})[backend] = (_step(fsdp, x, y), warm, iters)
    for name, key in (("allreduce 1 B", "latency"), (f"allreduce {_human(args.size)}", "allreduce"),
                      (f"reduce_scatter {_human(args.size)}", "reduce_scatter")):
        if name in out:
            out[name]["raw"] = (raw[key], out[name]["loom"][1], out[name]["loom"][2])
    return out


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch 2.13 renames reduce_scatter_tensor
    comm = world()
    if comm.size < 2:
        raise cli_args.UsageError("loom bench torch compares two backends' collectives; run it on 2 ranks or more "
                                  "(loom bench torch --ranks 2)")
    groups, meshes = _setup(args, comm)
    work = _rows(args, comm, groups, meshes)
    best: dict[tuple[str, str], float] = {}
    for name, per in work.items():
        for _ in range(args.rounds):
            for backend, (fn, warm, iters) in per.items():
                t = omb.time_op(fn, comm, warm, iters, max_seconds=args.max_seconds, nbytes=args.size)
                t = comm.allreduce_object(t, "max")
                best[(name, backend)] = min(best.get((name, backend), float("inf")), t)
    p = comm.size
    table = omb.Table("torch.distributed backend: loom vs gloo (and raw mpi4py under them)",
                      ["Test", "unit", "loom", "gloo", "raw", "loom/gloo", "loom/raw"], rank=comm.rank)
    table.meta = {"ranks": p, "size": args.size, "model": f"WideResMLP width {args.width} depth {args.depth}, "
                  f"batch {args.batch} per rank, float32", "raw": "mpi4py in place on numpy views of the buffers"}
    table.widths = [22, 8, 12, 12, 12, 12, 12]
    table.header()
    for name in work:
        times = {b: best.get((name, b)) for b in ("loom", "gloo", "raw")}
        unit, value = _unit(name, p, args.size)
        v = {b: (value(t) if t is not None else None) for b, t in times.items()}
        table.add(name, unit, v["loom"], v["gloo"], "-" if v["raw"] is None else v["raw"], v["loom"] / v["gloo"],
                  "-" if v["raw"] is None else v["loom"] / v["raw"])
    from torch.nn.parallel import DistributedDataParallel as DDP

    codec_rows = _ddp_codecs(args, comm, groups["gloo"], DDP) if args.codec else []
    breakdown = _breakdown(args, comm) if args.breakdown else []
    table.write_json(args.json, ddp_codecs=codec_rows, breakdown=breakdown)
    dist.destroy_process_group()
    return 0


def _breakdown(args, comm) -> list[dict]:
    """The 1-byte allreduce, layer by layer (``--breakdown``): each row adds a layer to the one above."""
    from ..torchdist.work import LoomWork
    from .comm import raw_collectives

    one = torch.ones(1, dtype=torch.uint8)
    raw = raw_collectives(one.numpy(), one.numpy(), one.numpy(), one_tensor=one)
    done = LoomWork([])

    class Nothing(dist.ProcessGroup):  # torch's dispatch alone: the floor of any Python process group
        def allreduce(self, tensors, opts=None):
            return done

    nothing = Nothing(comm.rank, comm.size)
    pg = dist.group.WORLD
    rows = [("raw mpi4py, numpy view", raw["latency"]), ("raw mpi4py, the tensor", raw["latency_tensor"]),
            ("dist.all_reduce, a do-nothing group", lambda: dist.all_reduce(one, group=nothing)),
            ("loom.comm allreduce (timed)", lambda: pg.comm.allreduce(one, "sum", out=one)),
            ("dist.all_reduce, loom", lambda: dist.all_reduce(one))]
    best = {name: float("inf") for name, _ in rows}
    for _ in range(args.rounds):
        for name, fn in rows:
            t = omb.time_op(fn, comm, 30 * args.warmup, args.iterations, max_seconds=args.max_seconds, nbytes=1)
            best[name] = min(best[name], comm.allreduce_object(t, "max"))
    table = omb.Table("where a 1-byte allreduce's time goes", ["Layer", "us", "x raw"], rank=comm.rank)
    table.widths = [38, 10, 10]
    table.header()
    base = best[rows[0][0]]
    for name, _ in rows:
        table.add(name, best[name] * 1e6, best[name] / base)
    return table.rows


def _unit(name: str, p: int, size: int) -> tuple[str, Callable[[float], float]]:
    """A row's unit and seconds -> value: us for the latency, bus GB/s for the bandwidths (nccl-tests' factors),
    ms for the training steps."""
    if name == "allreduce 1 B":
        return "us", lambda t: t * 1e6
    if name.startswith(("allreduce", "reduce_scatter")):
        factor = (2 if name.startswith("allreduce") else 1) * (p - 1) / p
        return "GB/s", lambda t: factor * size / t / 1e9
    return "ms", lambda t: t * 1e3


def _ddp_codecs(args, comm, gloo, DDP) -> list[dict]:
    """The second table (``--codec``): DDP on gloo, on loom, and on loom under each codec; its rows."""
    from .. import compress, torchdist

    torchdist.set_compression({f"ddp{i}": spec for i, spec in enumerate(args.codec)})
    try:  # one group per codec, each its own communicator (torch.mesh_ddp0, ...) with its own error feedback
        coded = [dist.new_group(list(range(comm.size)), group_desc=f"mesh_ddp{i}") for i in range(len(args.codec))]
    finally:
        torchdist.set_compression(None)
    variants = [("DDP gloo", gloo, None), ("DDP loom", dist.group.WORLD, None)]
    variants += [(f"DDP loom {spec}", g, spec) for spec, g in zip(args.codec, coded)]
    steps = args.rounds * (args.warmup + args.iterations_large)
    gen = torch.Generator().manual_seed(1000 + comm.rank)  # per-rank data, the same for every variant
    teacher = torch.randn(64, 16, generator=torch.Generator().manual_seed(1)) / 8
    xs = [torch.randn(args.batch, 64, generator=gen) for _ in range(steps)]
    batches = [(x, x @ teacher + 0.01 * torch.randn(args.batch, 16, generator=gen)) for x in xs]
    runs = {}
    for name, g, _spec in variants:
        torch.manual_seed(0)
        model = DDP(WideResMLP(args.width, args.depth), process_group=g)
        runs[name] = {"model": model, "opt": torch.optim.SGD(model.parameters(), lr=1e-3), "times": [],
                      "comm": getattr(g, "comm", None), "sent": 0, "step": 0, "loss": 0.0}
    raw_bytes = 2 * sum(q.numel() * q.element_size() for q in runs["DDP loom"]["model"].parameters()) \
        * (comm.size - 1) // comm.size  # an allreduce's bytes per rank, as loom.comm counts them
    compress.reset_stats()
    for _ in range(args.rounds):
        for name, _g, _spec in variants:
            run = runs[name]
            c = run["comm"]
            before = sum(c.bytes_sent.values()) if c is not None else 0
            for k in range(args.warmup + args.iterations_large):
                bx, by = batches[run["step"]]
                t0 = time.perf_counter()
                loss = ((run["model"](bx) - by) ** 2).mean()
                loss.backward()
                run["opt"].step()
                run["opt"].zero_grad()
                if k >= args.warmup:
                    run["times"].append(time.perf_counter() - t0)
                run["step"] += 1
                run["loss"] = loss.item()
            if c is not None:
                run["sent"] += sum(c.bytes_sent.values()) - before
    st = compress.stats()
    table = omb.Table("DDP under a dp codec: loom backend, uncompressed and compressed",
                      ["Test", "step (ms)", "speed-up", "raw MB/step", "wire MB/step", "loss", "gap %"],
                      rank=comm.rank)
    table.meta = {"ranks": comm.size, "steps": f"{steps} per row ({args.rounds} rounds of {args.warmup} untimed + "
                  f"{args.iterations_large} timed), SGD lr 1e-3, same init and batches",
                  "step": "median of the timed steps, slowest rank", "speed-up": "DDP loom's step / this row's",
                  "bytes": "this rank's per step (allreduce counted as 2 n (P-1)/P)",
                  "gap": "loss of the last step vs DDP loom's"}
    table.widths = [max(22, 10 + max(map(len, args.codec))), 11, 10, 13, 14, 12, 9]
    table.header()
    med = {name: comm.allreduce_object(statistics.median(runs[name]["times"]), "max") for name, *_ in variants}
    loss = {name: comm.allreduce_object(runs[name]["loss"], "sum") / comm.size for name, *_ in variants}
    out = []
    for name, _g, spec in variants:
        run = runs[name]
        if spec is not None:
            s = st.get(run["comm"].name, {"raw": 0, "wire": 0})
            raw, wire = s["raw"] / steps, s["wire"] / steps
        else:
            raw, wire = raw_bytes, (run["sent"] / steps if run["comm"] is not None else None)
        gap = 100 * (loss[name] - loss["DDP loom"]) / loss["DDP loom"]
        row = {"Test": name, "codec": spec or "none", "step_s": med[name], "speedup": med["DDP loom"] / med[name],
               "raw_bytes_per_step": raw, "wire_bytes_per_step": wire, "loss": loss[name], "gap_pct": gap}
        out.append(row)
        table.add(name, med[name] * 1e3, row["speedup"], raw / 1e6, "-" if wire is None else wire / 1e6,
                  f"{loss[name]:.6f}", f"{gap:+.3f}")
    return out


def _human(nbytes: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift and nbytes % (1 << shift) == 0:
            return f"{nbytes >> shift} {unit}"
    return f"{nbytes} B"
