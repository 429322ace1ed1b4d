"""loom.parallel: data, pipeline, sequence and hybrid parallelism built on loom.comm."""

from .hybrid import HybridConfig, HybridParallel
from .partition import TraceError, balance

__all__ = ["HybridConfig", "HybridParallel", "TraceError", "balance"]
