"""The training loop: mesh, model, data slices, gradient synchronization, metrics, checkpoints, resume.

Step plan (every rank, mesh ``dp x pp x sp``):

1. **Data.** Every rank draws the same global batch for this step (``batch_windows(seed, step)``) and keeps
   rows ``[dp_rank * B/dp, +B/dp)`` and columns ``[sp_rank * S/sp, +S/sp)`` (global positions for RoPE).
2. **Forward/backward.** The model's attention runs Ulysses all-to-alls over ``sp`` inside autograd; the
   loss is the mean over this rank's tokens.
3. **Gradient sync** (parameters are replicated over ``dp`` and ``sp``): gradients are flattened into
   buckets of ``compress.bucket_mb``; each bucket is averaged over ``sp`` with ``allreduce(op="avg")``
   (uncompressed: the fast intra-node axis), then over ``dp`` through the compression policy's dp hook
   (``hook(bucket, dp_comm, index) -> mean``) or ``allreduce(op="avg")`` without one. Equal shard sizes make
   the mean of local means the global mean, so any mesh matches one rank up to summation order.
4. **Update.** Global-norm clipping (grads are identical on all replicas after step 3), AdamW with the
   warm-up + cosine learning rate of this step.
5. **Book-keeping.** Loss and peak memory reduced as Python objects (not counted as training traffic);
   bytes per mesh axis are the deltas of ``loom.comm.stats()``, and the uncompressed equivalent of the
   dp traffic is computed from the bucket sizes (``2 n (P-1)/P`` per allreduce).

Checkpoints every ``checkpoint.every`` steps and at the end; ``resume=True`` reloads the newest complete one,
restores model, optimizer and RNG state, and continues at its step: because data is a function of the step,
the resumed curve equals the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

import math
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..comm import Communicator, Mesh, stats, world
from . import checkpoint as ckpt
from .config import Config, ConfigError, config_to_dict
from .data import batch_windows, load_corpus
from .model import COMM_TIME, build_model

__all__ = ["Trainer", "StepResult", "lr_at", "compression_hook", "peak_memory"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def lr_at(step: int, cfg: Config) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine or constant."""
    o = cfg.optim
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    if o.schedule == "constant":
        return o.lr
    span = max(1, cfg.train.steps - o.warmup)
    frac = min(1.0, (step - o.warmup) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * frac))


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def compression_hook(policy: str) -> Callable | None:
    """The dp gradient hook for ``compress.policy`` from ``loom.compress`` (``None`` for ``"none"``).

    Adapter over engineer C's API: ``loom.compress.dp_hook(policy) -> hook(flat_bucket, comm, bucket_index)``
    returning the mean over ``comm``; the policy is looked up by name with ``CompressionPolicy.named`` /
    ``from_name`` / ``preset``, whichever the package provides.
    """
    if policy == "none":
        return None
    try:
        import loom.compress as lc
    except ImportError as exc:
        raise ConfigError(f"compress.policy = {policy!r} needs loom.compress, which is not importable ({exc}); "
                          f"use compress.policy = 'none'") from None
    if not hasattr(lc, "dp_hook") or not hasattr(lc, "CompressionPolicy"):
        raise ConfigError(f"compress.policy = {policy!r}: this build's loom.compress has no dp_hook/"
                          f"CompressionPolicy yet; use compress.policy = 'none'")
    cls = lc.CompressionPolicy
    pol = None
    for ctor in ("named", "from_name", "preset", "get"):
        if hasattr(cls, ctor):
            try:
                pol = getattr(cls, ctor)(policy)
                break
            except (KeyError, ValueError) as exc:
                raise ConfigError(f"compress.policy = {policy!r}: {exc}") from None
    if pol is None:
        presets = getattr(lc, "POLICIES", None)
        if isinstance(presets, dict) and policy in presets:
            pol = presets[policy]
        else:
            raise ConfigError(f"compress.policy = {policy!r} is not a known loom.compress policy"
                              + (f"; valid: {', '.join(presets)}" if isinstance(presets, dict) else ""))
    return lc.dp_hook(pol)


@dataclass
class StepResult:
    """One optimizer step as logged (rank 0's view, losses averaged over ranks)."""

    step: int
    loss: float
    eval_loss: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _wire_bytes() -> dict[str, int]:
    return {name: sum(ops.values()) for name, ops in stats().items()}


class Trainer:
    """One ``loom train`` run on ``comm`` (default: the world).

    Args:
        cfg: the validated run configuration.
        comm: communicator to lay the mesh over (tests pass sub-communicators to run references in-process).
        resume: continue from the newest complete checkpoint in the checkpoint directory (none: start fresh).
        out: run directory override (default ``cfg.train.out``).
        quiet: no progress display or plots (tests).
    """

    def __init__(self, cfg: Config, comm: Communicator | None = None, *, resume: bool = False,
                 out: str | Path | None = None, quiet: bool = False):
        self.cfg = cfg
        self.comm = comm or world()
        cfg.validate_world(self.comm.size)
        if cfg.mesh.pp > 1:
            raise ConfigError(f"mesh.pp = {cfg.mesh.pp}: pipeline parallelism is not wired into loom train in this "
                              f"build (loom.parallel.hybrid not available); use mesh.dp and mesh.sp")
        if cfg.mesh.ep > 1 or cfg.model.ffn == "moe":
            raise ConfigError("model.ffn = 'moe' / mesh.ep > 1 needs loom.parallel.moe, which is not wired into "
                              "loom train in this build; use ffn = 'swiglu' or 'gelu' and mesh.ep = 1")
        self.out = Path(out or cfg.train.out)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out / "checkpoints"
        self.quiet = quiet
        self.mesh = Mesh(cfg.mesh.axes(), comm=self.comm)
        c = self.mesh.coords
        self.dp_rank, self.sp_rank = c.get("dp", 0), c.get("sp", 0)
        self.dp = self.mesh["dp"] if cfg.mesh.dp > 1 else None
        self.sp = self.mesh["sp"] if cfg.mesh.sp > 1 else None
        if cfg.train.device == "cuda":
            if not torch.cuda.is_available():
                raise ConfigError("train.device = 'cuda' but torch sees no CUDA device; use train.device = 'cpu'")
            self.device = torch.device("cuda", self.comm.rank % torch.cuda.device_count())
        else:
            self.device = torch.device("cpu")
        self.dtype = _DTYPES[cfg.train.dtype]
        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg, sp_comm=self.sp, dtype=self.dtype, device=self.device)
        decay = [p for n, p in self.model.named_parameters() if p.ndim >= 2]
        no_decay = [p for n, p in self.model.named_parameters() if p.ndim < 2]
        o = cfg.optim
        self.opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)
        self.hook = compression_hook(cfg.compress.policy) if self.dp is not None else None
        self.corpus = load_corpus(cfg.data)
        self.start_step = 0
        if resume:
            self._resume()
        self._buckets = self._make_buckets()

    # ------------------------------------------------------------------ state
    def _resume(self) -> None:
        step = ckpt.latest(self.ckpt_dir, stages=1)
        # Every rank must agree on the step (a shared file system is assumed; check it).
        steps = self.comm.allgather_object(step)
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks see different latest checkpoints in {self.ckpt_dir}: {steps}")
        if step is None:
            return
        state = ckpt.load(ckpt.stage_path(self.ckpt_dir, step, 0))
        self.model.load_state_dict(state["model"])
        self.opt.load_state_dict(state["optim"])
        ckpt.restore_rng(state["rng"])
        self.start_step = int(state["step"])

    def save(self, step: int) -> Path | None:
        """Checkpoint after ``step`` completed optimizer steps (rank 0 writes; replicas are identical)."""
        path = None
        if self.comm.rank == 0:
            payload = {
                "format": ckpt.FORMAT, "step": step, "config": config_to_dict(self.cfg),
                "stage": 0, "stages": 1, "layers": [0, self.cfg.model.layers],
                "model": {k: v.detach().cpu() for k, v in self.model.state_dict().items()},
                "optim": self.opt.state_dict(), "rng": ckpt.capture_rng(),
            }
            path = ckpt.save(ckpt.stage_path(self.ckpt_dir, step, 0), payload)
            ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep)
        self.comm.barrier()
        return path

    # ------------------------------------------------------------------ pieces of a step
    def _make_buckets(self) -> list[list[torch.nn.Parameter]]:
        limit = int(self.cfg.compress.bucket_mb * 2**20)
        buckets: list[list[torch.nn.Parameter]] = [[]]
        size = 0
        for p in self.model.parameters():
            nb = p.numel() * p.element_size()
            if buckets[-1] and size + nb > limit:
                buckets.append([])
                size = 0
            buckets[-1].append(p)
            size += nb
        return buckets

    def local_batch(self, stream: torch.Tensor, step: int, stream_id: int = 0):
        """This rank's ``(inputs, targets, start)`` of the global batch of ``step``."""
        d = self.cfg.data
        x, y = batch_windows(stream, seed=self.cfg.train.seed, step=step, batch=d.batch, seq_len=d.seq_len,
                             stream_id=stream_id)
        b = d.batch // self.cfg.mesh.dp
        s = d.seq_len // self.cfg.mesh.sp
        r0, c0 = self.dp_rank * b, self.sp_rank * s
        x, y = x[r0:r0 + b, c0:c0 + s], y[r0:r0 + b, c0:c0 + s]
        return x.to(self.device), y.to(self.device), c0

    def _loss(self, x: torch.Tensor, y: torch.Tensor, start: int) -> torch.Tensor:
        logits = self.model(x, start)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float() if self.dtype == torch.bfloat16
                               else logits.reshape(-1, logits.shape[-1]), y.reshape(-1))

    def sync_grads(self) -> tuple[float, int]:
        """Average gradients over ``sp`` then ``dp`` (see the module plan); returns (seconds, raw dp bytes)."""
        t0 = time.perf_counter()
        raw = 0
        for i, bucket in enumerate(self._buckets):
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if self.sp is not None:
                flat = self.sp.allreduce(flat, op="avg")
            if self.dp is not None:
                raw += 2 * flat.numel() * flat.element_size() * (self.dp.size - 1) // self.dp.size
                flat = self.hook(flat, self.dp, i) if self.hook is not None else self.dp.allreduce(flat, op="avg")
            off = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                p.grad = flat[off:off + n].view_as(p).to(p.dtype)
                off += n
        return time.perf_counter() - t0, raw

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over ``train.eval_batches`` fixed batches, averaged over all ranks."""
        self.model.eval()
        tot = 0.0
        for k in range(self.cfg.train.eval_batches):
            x, y, start = self.local_batch(self.corpus.heldout, k, stream_id=1)
            tot += float(self._loss(x, y, start))
        self.model.train()
        return self.comm.allreduce_object(tot / self.cfg.train.eval_batches) / self.comm.size

    # ------------------------------------------------------------------ the loop
    def run(self) -> list[dict[str, Any]]:
        """Train to ``train.steps``; returns rank 0's per-step records (others: the same losses)."""
        from .progress import Display, MetricsLog, write_plots

        cfg, comm = self.cfg, self.comm
        lead = comm.rank == 0
        show = lead and not self.quiet
        log = MetricsLog(self.out / "metrics.jsonl", self.start_step) if lead else None
        display = Display(cfg.train.progress if show else "none", cfg.train.steps, self.start_step)
        if show and self.start_step:
            display.message(f"resumed from {self.ckpt_dir} at step {self.start_step}")
        tokens = cfg.data.batch * cfg.data.seq_len
        records: list[dict[str, Any]] = []
        self.model.train()
        for step in range(self.start_step, cfg.train.steps):
            t0 = time.perf_counter()
            before = _wire_bytes()
            sp0 = COMM_TIME["sp"]
            lr = lr_at(step, cfg)
            for g in self.opt.param_groups:
                g["lr"] = lr
            x, y, start = self.local_batch(self.corpus.train, step)
            self.opt.zero_grad(set_to_none=True)
            loss = self._loss(x, y, start)
            loss.backward()
            sync_s, raw_dp = self.sync_grads()
            gnorm = 0.0
            if cfg.optim.grad_clip > 0:
                gnorm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), cfg.optim.grad_clip))
            self.opt.step()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            step_s = time.perf_counter() - t0
            after = _wire_bytes()
            done = step + 1
            loss_avg = comm.allreduce_object(float(loss.detach())) / comm.size
            peak = comm.allreduce_object(peak_memory(self.device), op="max")
            eval_loss = None
            if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                eval_loss = self.evaluate()
            comm_s = sync_s + (COMM_TIME["sp"] - sp0)
            moved = {k: after.get(k, 0) - before.get(k, 0) for k in after}
            by_axis: dict[str, dict[str, int]] = {}
            for axis in ("dp", "sp"):
                if moved.get(axis):
                    by_axis[axis] = {"wire": moved[axis], "raw": raw_dp if axis == "dp" else moved[axis]}
            raw_all = sum(v["raw"] for v in by_axis.values())
            wire_all = sum(v["wire"] for v in by_axis.values())
            rec = {
                "kind": "step", "step": done, "loss": loss_avg, "eval_loss": eval_loss, "lr": lr, "grad_norm": gnorm,
                "tokens": done * tokens, "tokens_per_s": tokens / step_s, "step_time": step_s,
                "time": {"compute": max(0.0, step_s - comm_s), "comm": comm_s, "offload": 0.0},
                "bytes": by_axis, "compress_ratio": (raw_all / wire_all) if wire_all else 1.0, "peak_mem": peak,
            }
            records.append(rec)
            if lead:
                log.write(rec)
                if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    display.update(rec)
            every = cfg.checkpoint.every
            if (every and done % every == 0) or done == cfg.train.steps:
                self.save(done)
        display.close()
        if lead:
            log.close()
            if cfg.train.plots and not self.quiet:
                allrecs = MetricsLog.read(self.out / "metrics.jsonl")
                self.plots = write_plots(allrecs, self.out / "plots")
        return records
