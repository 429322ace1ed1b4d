"""``loom bench parallel``: one Llama and one global batch trained under dp, tp, pp and their mixes in one run.

Every mesh of the job's ``W`` ranks that the model admits (``dp x pp x tp = W``; tp must divide the heads
and kv heads, pp at most the layers) runs the same ``loom train`` configuration (float32, AdamW, the same
data), so the losses agree across meshes up to summation order and each row differs only in how the work
and the bytes are split: dp ships every gradient once per step, tp ships ``4 layers + 2`` activation
allreduces of ``[tokens, hidden]`` per step, pp ships one activation and its gradient per stage boundary
and micro-batch. Where tp wins is a model whose layers are wide against the batch (its bytes scale with
tokens, dp's with parameters) on ranks joined by a fast link; on a shared or oversubscribed CPU it mostly
pays its per-layer latency.

Timing: ``--warmup`` steps excluded, the mean step time of the following ``--iterations``; bytes per step per
rank from ``loom.comm``'s counters (rank 0). The ratio column is each mesh's step time against the first
row's (pure dp unless ``--meshes`` says otherwise).
Time on at most as many ranks as there are free cores; numbers from a loaded machine are not figures.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from typing import Any

import torch

from .. import cli_args
from ..comm import world
from .omb import Table

__all__ = ["main", "parser", "meshes"]


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench parallel", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--layers", type=int, default=4, help="transformer blocks")
    p.add_argument("--hidden", type=int, default=256, help="model width")
    p.add_argument("--heads", type=int, default=8, help="query heads")
    p.add_argument("--kv-heads", type=int, default=4, help="key/value heads")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=8, help="global batch in sequences")
    p.add_argument("--micro-batches", type=int, default=2, help="pipeline micro-batches (meshes with pp > 1)")
    p.add_argument("-i", "--iterations", type=int, default=5, help="timed training steps per mesh")
    p.add_argument("-x", "--warmup", type=int, default=2, help="untimed steps per mesh")
    p.add_argument("--meshes", nargs="*", metavar="MESH",
                   help="meshes as dp=2,tp=2 (default: every dp x pp x tp factorisation the model admits)")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def meshes(world_size: int, args: argparse.Namespace) -> list[dict[str, int]]:
    """Every ``{dp, pp, tp}`` with product ``world_size`` that the model admits, pure dp first."""
    out = []
    for tp in range(1, world_size + 1):
        if world_size % tp or args.heads % tp or args.kv_heads % tp:
            continue
        for pp in range(1, world_size // tp + 1):
            if (world_size // tp) % pp or pp > args.layers:
                continue
            dp = world_size // (tp * pp)
            if args.batch % dp or (pp > 1 and (args.batch // dp) % args.micro_batches):
                continue
            out.append({"dp": dp, "pp": pp, "tp": tp})
    return sorted(out, key=lambda m: (m["dp"] != world_size, m["tp"], m["pp"]))


def _parse_mesh(text: str) -> dict[str, int]:
    mesh = {"dp": 1, "pp": 1, "tp": 1}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in mesh or not value.isdigit():
            raise SystemExit(f"loom bench parallel: mesh {text!r}: give axis=size pairs among dp, pp, tp, "
                             f"e.g. dp=2,tp=2")
        mesh[key] = int(value)
    return mesh


def _name(mesh: dict[str, int]) -> str:
    on = [f"{k}={v}" for k, v in mesh.items() if v > 1]
    return " x ".join(on) or "1 rank"


def _run(args, mesh: dict[str, int], comm) -> dict[str, Any]:
    """Train ``warmup + steps`` steps on ``mesh``; rank 0's step times, bytes per axis and final loss."""
    from ..train.config import config_from_dict
    from ..train.trainer import Trainer

    out = comm.bcast_object(tempfile.mkdtemp(prefix="loom-bench-parallel-") if comm.rank == 0 else None)
    cfg = config_from_dict({
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads},
        "mesh": mesh,
        "data": {"seq_len": args.seq_len, "batch": args.batch, "max_bytes": 400_000,
                 "micro_batches": args.micro_batches if mesh["pp"] > 1 else 1},
        "train": {"steps": args.warmup + args.iterations, "eval_every": 0, "progress": "none", "plots": False},
        "optim": {"warmup": 1},
        "checkpoint": {"every": 0},
    })
    recs = Trainer(cfg, comm, out=out, quiet=True).run()
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    timed = recs[args.warmup:]
    step_s = statistics.mean(r["step_time"] for r in timed)
    by_axis = {a: statistics.mean(r["bytes"].get(a, {}).get("wire", 0) for r in timed) for a in ("dp", "pp", "tp")}
    return {"step_s": step_s, "bytes": by_axis, "loss": recs[-1]["loss"]}


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    comm = world()
    todo = [_parse_mesh(m) for m in args.meshes] if args.meshes else meshes(comm.size, args)
    bad = [m for m in todo if m["dp"] * m["pp"] * m["tp"] != comm.size]
    if bad:
        raise SystemExit(f"loom bench parallel: mesh {_name(bad[0])} does not cover the job's {comm.size} ranks; "
                         f"give meshes whose sizes multiply to {comm.size}")
    table = Table("Parallelism Benchmark: dp vs tp vs pp, same model and batch",
                  ["Mesh", "ms/step", "tokens/s", "vs first", "dp KiB", "tp KiB", "pp KiB", "loss"], rank=comm.rank)
    table.widths = [20, 10, 11, 10, 10, 10, 10, 9]
    table.meta = {"model": f"Llama layers={args.layers} hidden={args.hidden} heads={args.heads}/{args.kv_heads} "
                           f"vocab=256 float32, seq_len {args.seq_len}, batch {args.batch}, AdamW",
                  "timing": f"mean of {args.iterations} steps after {args.warmup} warm-up; bytes per step per rank "
                            f"(rank 0)"}
    table.header()
    first = None
    for mesh in todo:
        res = _run(args, mesh, comm)
        first = first or res["step_s"]
        b = res["bytes"]
        table.add(_name(mesh), 1e3 * res["step_s"], args.batch * args.seq_len / res["step_s"],
                  res["step_s"] / first, b["dp"] / 1024, b["tp"] / 1024, b["pp"] / 1024, res["loss"])
    table.write_json(args.json, ranks=comm.size)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
