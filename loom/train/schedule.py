"""The learning-rate schedule of ``loom train``: linear warm-up, then cosine (or constant) to a horizon."""

from __future__ import annotations

import math

from .config import Config

__all__ = ["lr_at"]


def lr_at(step: int, cfg: Config, horizon: int | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine or constant. The cosine
    reaches ``optim.min_lr`` at step ``horizon`` (default ``optim.decay_steps``, else ``train.steps``) and stays
    there."""
    o = cfg.optim
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    if o.schedule == "constant":
        return o.lr
    span = max(1, (horizon or o.decay_steps or cfg.train.steps) - o.warmup)
    frac = min(1.0, (step - o.warmup) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * frac))
