"""loom.parallel: data (plain and sharded), pipeline, sequence, tensor and hybrid parallelism built on loom.comm."""

from .hybrid import HybridConfig, HybridParallel
from .partition import TraceError, balance
from .meta import is_meta, materialize, meta_names
from .offload import HostPool, MemoryTracker
from .moe import MoE, MoEConfig, dispatch_alltoallv, moe_reference
from .zero import ShardedDataParallel, ShardedOptimizer, reset_zero_stats, zero_stats
from .sequence import fpdt_attention, gather_sequence, local_positions, shard_sequence, ulysses_attention
from .tensor import (ColumnParallelLinear, ParallelFeedForward, RowParallelLinear, TPLink, VocabParallelEmbedding,
                     vocab_parallel_cross_entropy)

__all__ = ["HybridConfig", "HybridParallel", "TraceError", "balance", "is_meta", "materialize", "meta_names"]
__all__ += ["HostPool", "MemoryTracker", "fpdt_attention", "gather_sequence", "local_positions", "shard_sequence",
            "ulysses_attention"]
__all__ += ["MoE", "MoEConfig", "dispatch_alltoallv", "moe_reference"]
__all__ += ["ShardedDataParallel", "ShardedOptimizer", "reset_zero_stats", "zero_stats"]
__all__ += ["ColumnParallelLinear", "ParallelFeedForward", "RowParallelLinear", "TPLink", "VocabParallelEmbedding",
            "vocab_parallel_cross_entropy"]
