"""``loom bench memory``: the dry-run memory model (:mod:`loom.train.memory`) against the measured peak.

Each configuration is a small ``loom train`` run (a mesh, a sequence algorithm, recompute, offload, a
pipeline, MoE) that trains ``--steps`` optimizer steps (the second one holds Adam's moments while it runs
forward and backward) under :class:`loom.parallel.offload.MemoryTracker`: the peak of live torch storages
on CPU per rank (chunks offloaded to the host pool are not counted, as a device would not hold them), max
over ranks. A configuration needing more ranks than the job has is skipped; one needing fewer runs on
sub-communicators. Memory only: the time does not count, so 4 ranks on 2 cores are fine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from typing import Any

import torch

from .. import cli_args
from ..comm import world
from ..parallel.offload import MemoryTracker
from .omb import Table

__all__ = ["main", "parser", "CONFIGS", "measure"]

_MODEL = {"layers": 4, "hidden": 128, "heads": 8, "kv_heads": 2, "vocab": 512}
_FPDT = {"algorithm": "fpdt", "chunks": 4, "offload": True}

# name -> (ranks, config overrides). seq_len and batch make activations the larger share of the peak.
CONFIGS: dict[str, tuple[int, dict[str, dict[str, Any]]]] = {
    "1 rank": (1, {}),
    "1 rank, recompute": (1, {"sequence": {"recompute": True}}),
    "1 rank, ckpt on host": (1, {"sequence": {"recompute": True, "offload_checkpoints": True}}),
    "1 rank, moe": (1, {"model": {"ffn": "moe", "experts": 4, "top_k": 2}}),
    "dp=2": (2, {"mesh": {"dp": 2}}),
    "sp=2 ulysses": (2, {"mesh": {"sp": 2}}),
    "sp=2 ckpt on host": (2, {"mesh": {"sp": 2}, "sequence": {"recompute": True, "offload_checkpoints": True}}),
    "sp=2 fpdt offload": (2, {"mesh": {"sp": 2}, "sequence": _FPDT}),
    "sp=2 fpdt no offload": (2, {"mesh": {"sp": 2}, "sequence": {**_FPDT, "offload": False}}),
    "sp=2 fpdt recompute": (2, {"mesh": {"sp": 2}, "sequence": {**_FPDT, "recompute": True}}),
    "pp=2 1f1b": (2, {"mesh": {"pp": 2}, "data": {"micro_batches": 2}}),
    "pp=2 gpipe": (2, {"mesh": {"pp": 2, "schedule": "gpipe"}, "data": {"micro_batches": 2}}),
    "tp=2": (2, {"mesh": {"tp": 2}}),
    "tp=2 megatron-sp": (2, {"mesh": {"tp": 2, "tp_sequence_parallel": True}}),
    "sp=4 fpdt offload": (4, {"mesh": {"sp": 4}, "sequence": _FPDT}),
    "dp=2 x sp=2 fpdt": (4, {"mesh": {"dp": 2, "sp": 2}, "sequence": _FPDT}),
    # [zero] rows: stages 1-3 beside "dp=2" (stage 0), and ZeRO-3 over dp x sp under FPDT with offload
    "dp=2 zero=1": (2, {"mesh": {"dp": 2}, "zero": {"stage": 1}}),
    "dp=2 zero=2": (2, {"mesh": {"dp": 2}, "zero": {"stage": 2, "bucket_mb": 1}}),
    "dp=2 zero=3": (2, {"mesh": {"dp": 2}, "zero": {"stage": 3, "bucket_mb": 1}}),
    "dp=2 x sp=2 fpdt zero=3": (4, {"mesh": {"dp": 2, "sp": 2}, "sequence": _FPDT,
                                    "zero": {"stage": 3, "axes": ["dp", "sp"], "bucket_mb": 1}}),
}


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench memory", description=__doc__.splitlines()[0])
    p.add_argument("--seq-len", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=4, help="global batch in sequences")
    p.add_argument("--steps", type=int, default=2, help="optimizer steps measured (>= 2 includes Adam state)")
    p.add_argument("--only", nargs="*", metavar="NAME", help="run only these configurations (default: all)")
    p.add_argument("--list", action="store_true", help="list the configurations and exit")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    return p


def _config(overrides: dict[str, dict[str, Any]], args):
    from ..train.config import config_from_dict

    data: dict[str, dict[str, Any]] = {
        "model": dict(_MODEL), "data": {"seq_len": args.seq_len, "batch": args.batch, "max_bytes": 100_000},
        "train": {"steps": args.steps, "eval_every": 0, "progress": "none", "plots": False},
        "checkpoint": {"every": 0},
    }
    for sec, vals in overrides.items():
        data.setdefault(sec, {}).update(vals)
    return config_from_dict(data)


def measure(cfg, comm, steps: int) -> int:
    """Peak live bytes (max over the ranks of ``comm``) while training ``steps`` steps of ``cfg``."""
    from ..train.trainer import Trainer

    out = tempfile.mkdtemp(prefix="loom-bench-memory-") if comm.rank == 0 else None
    out = comm.bcast_object(out)
    tr = Trainer(cfg, comm, out=out, quiet=True)
    with MemoryTracker() as mem:
        mem.track(*[p for p in tr.model.parameters() if not p.is_meta])
        for step in range(steps):
            x, y, packed = tr.local_batch(tr.corpus.train, step)
            tr.opt.zero_grad(set_to_none=True)
            tr.forward_backward(x, y, packed)
            tr.sync_grads()
            tr.clip()
            tr.update()  # the optimizer step (ZeRO 2-3: and the gathers after it)
    peak = comm.allreduce_object(int(mem.peak), "max")
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(out, ignore_errors=True)
    return peak


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.list:
        for name, (n, over) in CONFIGS.items():
            print(f"{name:24s} {n} rank(s)  {over}")
        return 0
    from ..train.memory import peak as predict

    torch.set_num_threads(1)
    comm = world()
    names = args.only or list(CONFIGS)
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        raise SystemExit(f"loom bench memory: unknown configuration {unknown[0]!r}; valid: {', '.join(CONFIGS)}")
    table = Table("Peak Memory per Rank: dry-run prediction vs measured",
                  ["Config", "Ranks", "Predicted MiB", "Measured MiB", "Error %", "Weights+opt", "Activations"],
                  rank=comm.rank)
    table.widths = [24, 7, 15, 14, 9, 13, 13]
    m = _MODEL
    table.meta = {"model": f"Llama layers={m['layers']} hidden={m['hidden']} heads={m['heads']}/{m['kv_heads']} "
                           f"vocab={m['vocab']} float32, seq_len {args.seq_len}, batch {args.batch}, "
                           f"{args.steps} AdamW steps",
                  "measured": "CPU live-storage tracker (MemoryTracker), max over ranks"}
    table.header()
    errors = []
    for name in names:
        n, over = CONFIGS[name]
        if n > comm.size:
            if comm.rank == 0:
                print(f"# {name}: skipped (needs {n} ranks, the job has {comm.size})", flush=True)
            continue
        sub = comm if n == comm.size else comm.split(comm.rank // n, comm.rank % n, name=f"bench{n}")
        cfg = _config(over, args)
        est = predict(cfg)
        got = measure(cfg, sub, args.steps)
        got = comm.allreduce_object(got, "max")
        err = 100.0 * (est.total - got) / got
        errors.append(abs(err))
        table.add(name, n, est.total / 2**20, got / 2**20, err, (est.weights + est.optimizer) / 2**20,
                  est.activations / 2**20)
    if comm.rank == 0 and errors:
        print(f"# max |error| {max(errors):.1f} % over {len(errors)} configurations (goal <= 15 %)", flush=True)
    table.write_json(args.json, max_abs_error_pct=max(errors) if errors else None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
