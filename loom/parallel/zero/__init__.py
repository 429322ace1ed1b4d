"""Sharded data parallelism (ZeRO stages 0-3) on ``loom.comm``: :class:`ShardedDataParallel` and
:class:`ShardedOptimizer`.

The package, one concern a module: ``engine`` (the wrapper and its plan per stage), ``buckets`` (the layout),
``params`` (the stage-3 placeholder parameter), ``norms`` (the shard gradient whose norm is the bucket's),
``requests`` (requests in flight and :func:`zero_stats`), ``habits`` (torch's optimizer step hooks), ``state``
(sharded checkpoint files) and ``optim`` (:class:`ShardedOptimizer`, stage 1 for loops of their own).
"""

from .engine import ShardedDataParallel
from .optim import ShardedOptimizer
from .requests import reset_zero_stats, zero_stats
from .state import MANIFEST

__all__ = ["ShardedDataParallel", "ShardedOptimizer", "zero_stats", "reset_zero_stats", "MANIFEST"]
