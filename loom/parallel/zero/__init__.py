"""Sharded data parallelism (ZeRO stages 0-3) on ``loom.comm``: :class:`ShardedDataParallel`, :class:`ShardedOptimizer`.

One concern a module: ``engine`` (the wrapper, its plan per stage, and the backward's start and end where the
others meet), ``buckets`` (the layout), ``gather`` (parameter gathers and prefetch), ``reduce`` (gradient
reduce-scatters, their progress and compression), ``staging`` (the host path where MPI cannot read the device),
``replicas`` (buffers and frozen parameters kept equal), ``habits`` (the wrapped module's habits and torch's
optimizer step hooks), ``state`` (state dicts and sharded checkpoints), ``params`` (the stage-3 placeholder
parameter), ``norms`` (the shard gradient whose norm is the bucket's), ``requests`` (requests in flight and
:func:`zero_stats`) and ``optim`` (:class:`ShardedOptimizer`, stage 1 for loops of their own).
"""

from .engine import ShardedDataParallel
from .optim import ShardedOptimizer
from .requests import reset_zero_stats, zero_stats
from .state import MANIFEST

__all__ = ["ShardedDataParallel", "ShardedOptimizer", "zero_stats", "reset_zero_stats", "MANIFEST"]
