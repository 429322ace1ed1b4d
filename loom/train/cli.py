"""``loom train --config X.toml [--section.key=value ...] [--dry-run] [--resume]``.

Every rank parses the same arguments and config, so a bad config fails identically on every rank: each
prints ``loom train: error: ...`` and the job exits with code 2, without a traceback and without
communicating (nothing can hang on a peer that already left).

``--dry-run`` validates what the real run validates (the config, the compression policy, the corpus, the
device, the run directory) and prints the plan (mesh, stage split, per-rank memory estimate, bytes per step
per mesh axis) without training; outside an MPI job it plans for the configured mesh.

A run directory (``train.out``) belongs to one run: a new run into a directory holding another run's
checkpoints or metrics exits 2 unless given ``--resume`` (continue it) or ``--overwrite`` (delete it first).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .. import settings
from .. import cli_args
from .config import Config, ConfigError, config_to_dict, load_config

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


def _fmt(n: float) -> str:
    from .progress import fmt_bytes

    return fmt_bytes(n)


def param_count(cfg: Config) -> tuple[int, int, int]:
    """(embedding+head params, params per block, total)."""
    m = cfg.model
    hd = m.head_dim
    attn = m.hidden * m.heads * hd * 2 + m.hidden * m.kv_heads * hd * 2
    ffn = m.hidden * m.ffn_hidden * (3 if m.ffn == "swiglu" else 2)
    if m.ffn == "moe":
        ffn = m.experts * m.hidden * m.ffn_hidden * 3 + m.hidden * m.experts
    block = attn + ffn + 2 * m.hidden
    outer = m.vocab * m.hidden * 2 + m.hidden
    return outer, block, outer + block * m.layers


def plan(cfg: Config, world_size: int | None = None) -> str:
    """Human-readable plan: mesh, stage split, per-rank memory and bytes per step per axis."""
    m, mesh, d = cfg.model, cfg.mesh, cfg.data
    elem = {"float32": 4, "float64": 8, "bfloat16": 2}[cfg.train.dtype]
    outer, block, total = param_count(cfg)
    per = m.layers // mesh.pp
    extra = m.layers % mesh.pp
    stages = []
    lo = 0
    for i in range(mesh.pp):
        n = per + (1 if i < extra else 0)
        stages.append((lo, lo + n))
        lo += n
    stage_params = max(block * (hi - lo) + (outer if mesh.pp == 1 else outer // 2) for lo, hi in stages)
    b_loc = d.batch // (mesh.dp * mesh.ep)
    s_loc = d.seq_len // mesh.sp
    # Activations kept for backward per block: ~ (34 elements per token x hidden) (Korthikanti et al. 2022,
    # without recomputation), plus the attention matrix of the local heads over the full sequence.
    act = (per + (1 if extra else 0)) * b_loc * (s_loc * m.hidden * 34 * elem
                                                 + (m.heads // mesh.sp) * d.seq_len * d.seq_len * elem)
    act += b_loc * s_loc * m.vocab * 4 * 2  # logits + their grad
    state = stage_params * (elem * 2 + 8)  # params + grads (dtype) + Adam moments (fp32)
    lines = [
        f"loom train plan ({'world ' + str(world_size) + ' ranks' if world_size else 'not launched'})",
        f"  model      {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads} kv, ffn {m.ffn} "
        f"{m.ffn_hidden}, vocab {m.vocab}: {total:,} parameters ({_fmt(total * elem)} in {cfg.train.dtype})",
        f"  mesh       dp={mesh.dp} pp={mesh.pp} sp={mesh.sp} ep={mesh.ep} = {mesh.size} ranks",
        "  stages     " + ", ".join(f"stage {i}: layers {a}..{b - 1}" for i, (a, b) in enumerate(stages))
        + (" (even split; HybridParallel balances by parameters at start)" if mesh.pp > 1 else ""),
        f"  sequence   {cfg.sequence.algorithm}, seq_len {d.seq_len} -> {s_loc} tokens per sp rank, "
        f"chunks {cfg.sequence.chunks}, offload {cfg.sequence.offload}",
        f"  batch      {d.batch} sequences/step global, {b_loc} per dp replica, "
        f"{d.batch * d.seq_len:,} tokens/step",
        f"  memory     ~{_fmt(state + act)} per rank (weights+grads+Adam {_fmt(state)}, activations ~{_fmt(act)})",
        f"  data       {'Python stdlib sources' if not d.path else d.path}, max {d.max_bytes:,} bytes, "
        f"held-out {d.heldout:.0%}",
        f"  compress   policy {cfg.compress.policy!r} on dp, buckets of {cfg.compress.bucket_mb} MiB",
        "  bytes per step per rank (uncompressed, bandwidth-optimal accounting):",
    ]
    if mesh.dp > 1:
        n = stage_params * elem
        lines.append(f"    dp  allreduce of gradients 2n(P-1)/P: {_fmt(2 * n * (mesh.dp - 1) / mesh.dp)}"
                     + ("" if cfg.compress.policy == "none" else f" before compression ({cfg.compress.policy})"))
    if mesh.sp > 1:
        p = mesh.sp
        kv = m.kv_heads if m.kv_heads % p == 0 else m.heads
        per_layer = b_loc * s_loc * m.head_dim * (2 * m.heads + 2 * kv) * elem * (p - 1) / p
        grads = stage_params * elem * 2 * (p - 1) / p
        lines.append(f"    sp  Ulysses all-to-all (q,k,v,o fwd+bwd) {_fmt(2 * per_layer * per)} "
                     f"+ gradient allreduce {_fmt(grads)}")
    if mesh.ep > 1:
        k = m.top_k
        lines.append(f"    ep  MoE dispatch + combine all-to-allv (fwd+bwd) ~"
                     f"{_fmt(4 * b_loc * s_loc * k * m.hidden * elem * (mesh.ep - 1) / mesh.ep * m.layers)} "
                     f"(uniform routing)")
    if mesh.pp > 1:
        lines.append(f"    pp  activations + their grads between stages: "
                     f"{_fmt(2 * b_loc * s_loc * m.hidden * elem)}")
    if mesh.size == 1:
        lines.append("    (one rank: no communication)")
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
    other = cfg.mesh.pp * cfg.mesh.sp * cfg.mesh.ep
    if size % other:
        raise ConfigError(f"the job has {size} ranks, which mesh.pp={cfg.mesh.pp} x mesh.sp={cfg.mesh.sp} x "
                          f"mesh.ep={cfg.mesh.ep} = {other} does not divide; launch a multiple of {other} ranks "
                          f"or set --mesh.dp/--mesh.pp/--mesh.sp explicitly")
    return size // other


def preflight(cfg: Config) -> None:
    """What the trainer checks before its first collective, without communicating: the compression policy,
    the corpus and the device. Raises :class:`ConfigError` (``--dry-run`` calls this; the trainer itself
    runs the same checks)."""
    import torch

    from .data import load_corpus
    from .trainer import compression_hook

    if cfg.compress.policy != "none":
        compression_hook(cfg.compress.policy, None if cfg.compress.min_kb < 0 else int(cfg.compress.min_kb * 1024))
    load_corpus(cfg.data)
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda' but torch sees no CUDA device; use train.device = 'cpu'")


def claim(cfg: Config, *, resume: bool, overwrite: bool, dry_run: bool = False) -> None:
    """Apply the run-directory rules to ``train.out`` (rank 0 clears it on ``overwrite``)."""
    from . import checkpoint as ckpt

    out = Path(cfg.train.out)
    ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else out / "checkpoints"
    ckpt.claim_run_dir(out, ckpt_dir, resume=resume, overwrite=overwrite)
    if overwrite and not dry_run and settings.launch_rank() == 0:
        ckpt.clear_run_dir(out, ckpt_dir)


def _error(msg: str) -> int:
    rank = settings.launch_rank()
    # One write per message: ranks share the launcher's stderr, and print() writes the newline separately.
    sys.stderr.write(f"loom train: error (rank {rank}): {msg}\n")
    sys.stderr.flush()
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
        if args.dry_run:
            preflight(cfg)
        # Every rank checks the directory; rank 0 clears it on --overwrite before the trainer's first
        # collective, and nothing is written until after that collective.
        claim(cfg, resume=args.resume, overwrite=args.overwrite, dry_run=args.dry_run)
    except ConfigError as exc:
        return _error(str(exc))
    if args.dry_run:
        if settings.launch_rank() == 0:
            print(plan(cfg, size))
        return 0

    import torch

    torch.set_num_threads(settings.get("threads"))
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
