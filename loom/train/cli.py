"""``loom train --config X.toml [--section.key=value ...] [--dry-run] [--resume]``.

Every rank parses the same arguments and config, so a bad config fails identically on every rank: rank 0
prints ``loom train: error: ...`` once and every rank exits with code 2, without a traceback and without
communicating (nothing can hang on a peer that already left).

``--dry-run`` validates what the real run validates (the config, the compression policy, the corpus, the
device) and prints the plan (mesh, stage split, per-rank memory estimate, bytes per step per mesh axis)
without training; outside an MPI job it plans for the configured mesh. It writes nothing, so an occupied run
directory is not refused: the plan says what the run itself would refuse.

A run directory (``train.out``) belongs to one run: a new run into a directory holding another run's
checkpoints or metrics exits 2 unless given ``--resume`` (continue it) or ``--overwrite`` (delete it first); a
``--resume`` with no checkpoint to continue exits 2; and while a run lives, rank 0 holds the directory's lock
(``<train.out>/.lock``), so a second run into it exits 2 naming the holder (a lock whose process is gone is
taken over).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import cli_args, settings
from . import checkpoint as ckpt
from .config import Config, ConfigError, config_to_dict, load_config
from .memory import plan

__all__ = ["main", "parser", "plan"]

RELAUNCH = True


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(
        prog="loom train",
        description="Train a Llama-style byte-level model (dp/sp mesh, compression, checkpoints). Any config "
                    "key can be overridden with --section.key=value, e.g. --train.steps=50 --mesh.dp=2. "
                    "Without a mesh.dp, the data-parallel axis takes the ranks the other axes leave (--ranks 2 "
                    "trains dp=2).",
        epilog=_defaults_epilog(),
    )
    p.add_argument("-c", "--config", metavar="TOML", help="run configuration (see configs/demo.toml)")
    cli_args.add_dry_run(p, "validate everything the run validates and print the plan; no training")
    p.add_argument("-r", "--resume", action="store_true", help="continue from the newest checkpoint (if any)")
    p.add_argument("--overwrite", action="store_true",
                   help="delete the checkpoints, metrics and plots of a previous run in train.out first")
    return p


def _defaults_epilog() -> str:
    lines = ["config keys and defaults:"]
    for section, values in config_to_dict(Config()).items():
        lines.append(f"  [{section}] " + ", ".join(f"{k}={v!r}" for k, v in values.items()))
    return "\n".join(lines)


def _dp_given(config: str | None, overrides: list[str]) -> bool:
    """Whether ``mesh.dp`` is set by the config file or an override (else it fills the world)."""
    import tomllib

    if any(a == "--mesh.dp" or a.startswith("--mesh.dp=") for a in overrides):
        return True
    try:
        return "dp" in tomllib.loads(Path(config).read_text()).get("mesh", {}) if config else False
    except (OSError, tomllib.TOMLDecodeError, AttributeError):
        return False  # load_config has already reported a broken file


def fill_dp(cfg: Config, size: int) -> int:
    """``mesh.dp`` that makes the mesh cover ``size`` ranks (as torchtitan's ``dp_shard = -1``); the other axes
    must divide ``size``, else :class:`ConfigError` names them."""
    other = cfg.mesh.pp * cfg.mesh.sp * cfg.mesh.ep * cfg.mesh.tp
    if size % other:
        tp = f" x mesh.tp={cfg.mesh.tp}" if cfg.mesh.tp > 1 else ""
        raise ConfigError(f"the job has {size} ranks, which mesh.pp={cfg.mesh.pp} x mesh.sp={cfg.mesh.sp} x "
                          f"mesh.ep={cfg.mesh.ep}{tp} = {other} does not divide; launch a multiple of {other} "
                          f"ranks or set --mesh.dp/--mesh.pp/--mesh.sp/--mesh.tp explicitly")
    return size // other


def preflight(cfg: Config) -> list[str]:
    """What the trainer checks before its first collective, without communicating (``--dry-run`` calls this;
    the trainer runs the same checks). A wrong setting (the compression policy) raises :class:`ConfigError`;
    what this machine lacks for the run (the corpus, the device) is returned instead, for the dry-run to report
    after its plan: a GPU job is often planned where there is no GPU, and the plan is what was asked for."""
    import torch

    from .data import load_corpus
    from .trainer import compression_hook

    if cfg.compress.policy != "none":
        compression_hook(cfg.compress.policy, None if cfg.compress.min_kb < 0 else int(cfg.compress.min_kb * 1024))
    problems = []
    try:
        load_corpus(cfg.data)
    except (ConfigError, ValueError, OSError) as exc:
        problems.append(str(exc))
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        problems.append("train.device = 'cuda' but torch sees no CUDA device; use train.device = 'cpu'")
    return problems


def _dirs(cfg: Config) -> tuple[Path, Path]:
    out = Path(cfg.train.out)
    return out, Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"


def claim(cfg: Config, *, resume: bool, overwrite: bool, dry_run: bool = False) -> str | None:
    """Apply the run-directory rules to ``train.out`` (reads only). A run that may not start raises
    :class:`~loom.train.checkpoint.RunDirError`; a dry run gets the reason back instead (``None``: free)."""
    out, ckpt_dir = _dirs(cfg)
    if dry_run:
        return ckpt.occupied(out, ckpt_dir, resume=resume, overwrite=overwrite, stages=cfg.mesh.pp)
    ckpt.claim_run_dir(out, ckpt_dir, resume=resume, overwrite=overwrite, stages=cfg.mesh.pp)
    return None


def hold(cfg: Config, comm, *, resume: bool, overwrite: bool) -> Path | None:
    """Rank 0 applies the run-directory rules (:func:`claim`), takes the directory's lock (and clears it on
    ``overwrite``) before anything is written; every rank learns the outcome, so a refused job exits 2 on every
    rank. Returns the lock (rank 0) or ``None``.

    Only rank 0 looks at the directory: a rank that checked it on its own could find the lock, or the files,
    that rank 0 of its own job had written meanwhile, and leave alone while its peers wait for it."""
    lock = err = None
    if comm.rank == 0:
        try:
            claim(cfg, resume=resume, overwrite=overwrite)
            lock, stale = ckpt.lock_run_dir(cfg.train.out)
            if stale:
                print(f"loom train: took over the lock of a run that is gone (pid {stale.get('pid')} on "
                      f"{stale.get('host')})", flush=True)
            if overwrite:
                ckpt.clear_run_dir(*_dirs(cfg))
        except (ConfigError, OSError) as exc:
            err = str(exc)
    err = comm.bcast_object(err)
    if err:
        raise ConfigError(err)
    return lock


def _error(msg: str) -> int:
    if settings.launch_rank() == 0:
        # One write per message: ranks share the launcher's stderr, and print() writes the newline separately.
        sys.stderr.write(f"loom train: error: {msg}\n")
        sys.stderr.flush()
    else:
        cli_args.follower_wait()
    return 2


def main(argv: list[str] | None = None) -> int:
    args, rest = parser().parse_known_args(list(sys.argv[1:] if argv is None else argv))
    # The launcher tells each rank the job size: check the mesh before importing torch or initializing MPI,
    # so a wrong mesh fails fast and identically on every rank.
    info = settings.launch_info()
    size = None if info is None else info.size
    try:
        cfg = load_config(args.config, rest)
        if size is not None and cfg.mesh.size != size and not _dp_given(args.config, rest):
            cfg = load_config(args.config, [*rest, f"--mesh.dp={fill_dp(cfg, size)}"])
        if size is not None:
            cfg.validate_world(size)
        problems = preflight(cfg) if args.dry_run else []
        # A dry run only reports what the directory holds. A run's directory is checked and locked by rank 0
        # once MPI is up (hold), before the trainer's first collective, and nothing is written until after that.
        occupied = claim(cfg, resume=args.resume, overwrite=args.overwrite, dry_run=True) if args.dry_run else None
    except ConfigError as exc:
        return _error(str(exc))
    if args.dry_run:
        if settings.launch_rank() == 0:
            print(plan(cfg, size))
            if occupied:  # a dry run writes nothing: say what the run would refuse rather than refuse to plan
                print(f"run directory: occupied; the run itself would exit 2: {occupied}")
            for problem in problems:  # the real run stops here (exit 2); the plan above still holds
                print(f"loom train: warning: this machine cannot run it as configured: {problem}", file=sys.stderr)
        return 0

    import torch

    torch.set_num_threads(settings.get("threads"))
    from ..comm import world
    from .trainer import Trainer

    comm = world()
    try:
        lock = hold(cfg, comm, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as exc:
        return _error(str(exc))
    try:  # the lock is released however the run ends (an interrupt unwinds through here)
        try:
            trainer = Trainer(cfg, comm, resume=args.resume)
        except ConfigError as exc:
            return _error(str(exc))
        records = trainer.run()
    finally:
        if lock is not None:
            ckpt.unlock_run_dir(lock)
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
