"""``loom train --config X.toml [--section.key=value ...] [--dry-run] [--resume]``.

Every rank parses the same arguments and config, so a bad config fails identically on every rank: rank 0
prints ``loom train: error: ...`` once and every rank exits with code 2, without a traceback and without
communicating (nothing can hang on a peer that already left).

``--dry-run`` and the real start run the same checks (:func:`load`, :func:`preflight`, :func:`claim`): the
config, the mesh against the job's size, the compression policy, the multipath topology, the model's source,
the corpus and the device. The dry run then prints the plan (mesh, stage split, per-rank memory estimate,
bytes per step per mesh axis) without training; outside an MPI job it plans for the configured mesh. It writes
nothing, so an occupied run directory is not refused: the plan says what the run itself would refuse.

A run directory (``train.out``) belongs to one run: a new run into a directory holding another run's
checkpoints or metrics exits 2 unless given ``--resume`` (continue it) or ``--overwrite`` (delete it); a
``--resume`` with no checkpoint to continue, or one it cannot continue (another model, ZeRO 2-3 shards of
another ``mesh.tp``), exits 2; and while a run lives, rank 0 holds the directory's lock (``<train.out>/.lock``),
so a second run into it exits 2 naming the holder (a lock whose process is gone is taken over).

Nothing is destroyed for a run that does not start: every check above runs before MPI starts, the lock is
taken after them, and ``--overwrite`` deletes the previous run only once the trainer is built. A start that
fails removes the directory it created.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from .. import cli_args, settings
from . import checkpoint as ckpt
from .config import Config, ConfigError, config_defaults, config_to_dict, load_config
from .memory import plan

__all__ = ["main", "parser", "plan", "load", "preflight", "claim"]

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
                   help="delete the checkpoints, metrics and plots of a previous run in train.out (once every "
                        "check has passed)")
    return p


def _defaults_epilog() -> str:
    """The keys and the defaults they declare (not a resolved ``Config()``, whose ``mesh.sp_ring`` would read 1
    for the default model's heads and hide the automatic choice)."""
    lines = ["config keys and defaults:"]
    for section, values in config_defaults().items():
        lines.append(f"  [{section}] " + ", ".join(f"{k}={v!r}" for k, v in values.items()))
    lines.append("  (chosen when the run is laid out: mesh.sp_ring=0 from the heads, optim.decay_steps=0 is "
                 "train.steps, checkpoint.dir='' is <train.out>/checkpoints)")
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


def load(config: str | None, overrides: list[str], size: int | None) -> Config:
    """The run's config for a job of ``size`` ranks (``None``: not launched): the file and overrides, ``mesh.dp``
    filling the ranks the other axes leave unless it is given, and the mesh checked against the job before the
    rules across sections (a mesh of the wrong size is named as such, not as a batch it fails to divide)."""
    given = _dp_given(config, overrides)
    cfg = load_config(config, overrides, world_size=size if given else None)
    if size is not None and cfg.mesh.size != size and not given:
        cfg = load_config(config, [*overrides, f"--mesh.dp={fill_dp(cfg, size)}"], world_size=size)
    if size is not None:
        cfg.validate_world(size)
    return cfg


def preflight(cfg: Config) -> tuple[list[str], Any]:
    """Every check of a run that needs neither communication nor the run directory, the same for ``--dry-run``
    and the real start (which runs it before MPI starts, before the lock and before ``--overwrite`` deletes
    anything). A wrong setting (the compression policy, the multipath topology) raises :class:`ConfigError`;
    what this machine lacks for the run (the corpus, the device) is returned instead: the dry run reports it
    after its plan (a GPU job is often planned where there is no GPU), the real start exits 2 on it.

    Returns ``(problems, corpus)``: the corpus loaded (``None`` when it is one of the problems), which the
    trainer then takes instead of reading it again."""
    import torch

    from .data import load_corpus
    from .trainer import compression_hook

    if cfg.compress.policy != "none":
        compression_hook(cfg.compress.policy, None if cfg.compress.min_kb < 0 else int(cfg.compress.min_kb * 1024))
    _check_topology(cfg)
    problems, corpus = [], None
    try:
        corpus = load_corpus(cfg.data)
    except (ConfigError, ValueError, OSError) as exc:
        problems.append(str(exc))
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        problems.append("train.device = 'cuda' but torch sees no CUDA device; use train.device = 'cpu'")
    return problems, corpus


def _check_topology(cfg: Config) -> None:
    """``multipath.topology`` names a valid topology (a preset or a readable TOML file), with or without MoE;
    where it routes the experts' all-to-allv (``model.ffn = 'moe'``, ``multipath.enabled``, ``mesh.ep`` > 1), one
    of ``mesh.ep`` ranks. ``auto`` is found from the machine once the ranks run."""
    from ..multipath.detect import resolve_fixed

    mp, spec = cfg.multipath, cfg.multipath.topology
    if spec == "auto":
        return
    routed = mp.enabled and cfg.model.ffn == "moe" and cfg.mesh.ep > 1
    try:
        resolve_fixed(spec, cfg.mesh.ep if routed else None)
    except ValueError as exc:
        where = f" (it routes the experts' all-to-allv over mesh.ep = {cfg.mesh.ep} ranks)" if routed else ""
        why = str(exc).removeprefix(f"multipath topology {spec!r}: ")  # named once, as the setting
        raise ConfigError(f"multipath.topology = {spec!r}{where}: {why}") from None


def _dirs(cfg: Config) -> tuple[Path, Path]:
    out = Path(cfg.train.out)
    return out, Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"


def claim(cfg: Config, *, resume: bool, overwrite: bool, dry_run: bool = False) -> str | None:
    """Apply the run-directory rules to ``train.out`` (reads only), and for ``resume`` check that the newest
    checkpoint can be continued with this config (:func:`~loom.train.checkpoint.check_resume`). A run that may
    not start raises :class:`~loom.train.checkpoint.RunDirError` (``--resume`` with ``--overwrite``: a
    :class:`ConfigError`); a dry run gets the directory's reason back instead (``None``: free)."""
    out, ckpt_dir = _dirs(cfg)
    try:
        ckpt.claim_run_dir(out, ckpt_dir, resume=resume, overwrite=overwrite, stages=cfg.mesh.pp)
        if resume:
            ckpt.check_resume(ckpt_dir, config_to_dict(cfg), stages=cfg.mesh.pp)
    except ckpt.RunDirError as exc:
        if dry_run:
            return str(exc)
        raise
    return None


def _first_missing(path: Path) -> Path | None:
    """The outermost directory of ``path`` (itself or an ancestor) that does not exist yet, or ``None``."""
    missing = None
    for p in (path, *path.parents):
        if p.exists():
            break
        missing = p
    return missing


def _remove_if_unused(created: Path | None) -> None:
    """Remove ``created``, a directory tree this start made, when no file was written into it."""
    import shutil

    if created is not None and created.is_dir() and not any(p.is_file() for p in created.rglob("*")):
        shutil.rmtree(created, ignore_errors=True)


def hold(cfg: Config, comm, *, resume: bool, overwrite: bool) -> tuple[Path | None, Path | None]:
    """Rank 0 applies the run-directory rules (:func:`claim`) and takes the directory's lock before anything is
    written; every rank learns the outcome, so a refused job exits 2 on every rank. Returns ``(lock, created)``
    on rank 0 (the lock, and the outermost directory the lock created, to remove if the start fails), ``(None,
    None)`` elsewhere. ``--overwrite`` clears the directory later (:func:`clear`), once the trainer is built.

    Only rank 0 looks at the directory: a rank that checked it on its own could find the lock, or the files,
    that rank 0 of its own job had written meanwhile, and leave alone while its peers wait for it."""
    lock = err = created = None
    if comm.rank == 0:
        try:
            claim(cfg, resume=resume, overwrite=overwrite)
            created = _first_missing(Path(cfg.train.out))
            lock, stale = ckpt.lock_run_dir(cfg.train.out)
            if stale:
                print(f"loom train: took over the lock of a run that is gone (pid {stale.get('pid')} on "
                      f"{stale.get('host')})", flush=True)
        except (ConfigError, OSError) as exc:
            err = str(exc)
            _remove_if_unused(created)
    err = comm.bcast_object(err)
    if err:
        raise ConfigError(err)
    return lock, created


def clear(cfg: Config, comm) -> None:
    """``--overwrite``: rank 0 deletes the previous run's files, once every check has passed and the trainer
    is built (nothing is destroyed for a run that then refuses to start); the others wait for it."""
    if comm.rank == 0:
        ckpt.clear_run_dir(*_dirs(cfg))
    comm.barrier()


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
    # The launcher tells each rank the job size: every check runs before MPI starts (and before the run
    # directory is touched), so a wrong setting fails fast and identically on every rank, deleting nothing.
    info = settings.launch_info()
    # Outside a launcher a dry run plans the configured mesh; a run is then a job of one rank.
    size = info.size if info is not None else None if args.dry_run else 1
    try:
        cfg = load(args.config, rest, size)
        problems, corpus = preflight(cfg)
        # A dry run only reports what the directory holds. A run's directory is checked and locked by rank 0
        # once MPI is up (hold), before the trainer's first collective, and nothing is written until after that.
        refused = claim(cfg, resume=args.resume, overwrite=args.overwrite, dry_run=True) if args.dry_run else None
    except ConfigError as exc:
        return _error(str(exc))
    if args.dry_run:
        if settings.launch_rank() == 0:
            print(plan(cfg, size))
            if refused:  # a dry run writes nothing: say what the run would refuse rather than refuse to plan
                print(f"run directory: occupied; the run itself would exit 2: {refused}")
            for problem in problems:  # the real run stops here (exit 2); the plan above still holds
                print(f"loom train: warning: this machine cannot run it as configured: {problem}", file=sys.stderr)
        return 0
    if problems:
        return _error(problems[0])

    import torch

    torch.set_num_threads(settings.get("threads"))
    from ..comm import world
    from .trainer import Trainer

    comm = world()
    try:
        lock, created = hold(cfg, comm, resume=args.resume, overwrite=args.overwrite)
    except ConfigError as exc:
        return _error(str(exc))
    started = False
    try:  # the lock is released however the run ends (an interrupt unwinds through here)
        try:
            trainer = Trainer(cfg, comm, resume=args.resume, corpus=corpus)
        except ConfigError as exc:
            return _error(str(exc))
        if args.overwrite:
            clear(cfg, comm)
        started = True
        records = trainer.run()
    finally:
        if lock is not None:
            ckpt.unlock_run_dir(lock)
            if not started:  # a start that fails leaves no directory it made
                _remove_if_unused(created)
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
