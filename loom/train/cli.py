"""``loom train --config X.toml [--section.key=value ...] [--dry-run] [--resume]``.

Every rank parses the same arguments and config, so a bad config fails identically on every rank: each
prints ``loom train: error: ...`` and the job exits with code 2, without a traceback and without
communicating (nothing can hang on a peer that already left).

``--dry-run`` validates the config and prints the plan (mesh, stage split, per-rank memory estimate, bytes
per step per mesh axis) without training; outside an MPI job it plans for the configured mesh.
"""

from __future__ import annotations

import argparse
import os
import sys

from .config import Config, ConfigError, config_to_dict, load_config
from .memory import plan

__all__ = ["main", "parser", "plan"]

RELAUNCH = True


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults shown, and the epilog's table of config keys kept as written."""


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loom train",
        description="Train a Llama-style byte-level model (dp/sp mesh, compression, checkpoints). Any config "
                    "key can be overridden with --section.key=value, e.g. --train.steps=50 --mesh.dp=2.",
        formatter_class=_Formatter,
        epilog=_defaults_epilog(),
    )
    p.add_argument("-c", "--config", metavar="TOML", help="run configuration (see configs/demo.toml)")
    p.add_argument("-n", "--dry-run", action="store_true", help="validate the config and print the plan; no training")
    p.add_argument("-r", "--resume", action="store_true", help="continue from the newest checkpoint (if any)")
    return p


def _defaults_epilog() -> str:
    lines = ["config keys and defaults:"]
    for section, values in config_to_dict(Config()).items():
        lines.append(f"  [{section}] " + ", ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)


def _error(msg: str) -> int:
    rank = os.environ.get("PMI_RANK") or os.environ.get("OMPI_COMM_WORLD_RANK") or "0"
    # One write per message: ranks share the launcher's stderr, and print() writes the newline separately.
    sys.stderr.write(f"loom train: error (rank {rank}): {msg}\n")
    sys.stderr.flush()
    return 2


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    try:
        cfg = load_config(args.config, rest)
    except ConfigError as exc:
        return _error(str(exc))
    # The launcher tells each rank the job size: check the mesh before importing torch or initializing MPI,
    # so a wrong mesh fails fast and identically on every rank.
    size = None
    for var in ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE"):
        if os.environ.get(var, "").isdigit():
            size = int(os.environ[var])
    try:
        if size is not None:
            cfg.validate_world(size)
    except ConfigError as exc:
        return _error(str(exc))
    if args.dry_run:
        if os.environ.get("PMI_RANK", "0") == "0" and os.environ.get("OMPI_COMM_WORLD_RANK", "0") == "0":
            print(plan(cfg, size))
        return 0

    import torch

    torch.set_num_threads(int(os.environ.get("LOOM_THREADS", "1")))
    from ..comm import world
    from .trainer import Trainer

    comm = world()
    try:
        trainer = Trainer(cfg, comm, resume=args.resume)
    except ConfigError as exc:
        return _error(str(exc))
    records = trainer.run()
    if comm.rank == 0 and records:
        last = records[-1]
        tps = sum(r["tokens_per_s"] for r in records[-10:]) / len(records[-10:])
        ev = f", held-out loss {last['eval_loss']:.4f}" if last.get("eval_loss") is not None else ""
        print(f"loom train: done {last['step']} steps; final loss {last['loss']:.4f}{ev}; {tps:,.0f} tokens/s; "
              f"run dir {trainer.out}", flush=True)
        for p in getattr(trainer, "plots", []):
            print(f"  plot: {p}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
