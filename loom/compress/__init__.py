"""loom.compress: codecs, compressed collectives and a per-axis compression policy.

>>> from loom.compress import allreduce, CompressionPolicy, dp_hook
>>> total = allreduce(grad, comm, "int8")                    # the sum, two quantizations at any rank count
>>> hook = dp_hook(CompressionPolicy.preset("hybrid"))       # hook(flat_bucket, comm, bucket_index) -> mean
>>> stats()["dp"]                                            # {"raw": ..., "wire": ..., "calls": ...}
"""

from .codecs import CODECS, Codec, Packet, codec_names, get_codec
from .collectives import (DEFAULT_MIN_BYTES, allgather, allreduce, alltoallv, isend, recv, reduce_scatter,
                          reset_stats, send, stats)
from .feedback import ErrorFeedback
from .policy import PRESETS, CompressionPolicy, DPHook, dp_hook

__all__ = [
    "CODECS",
    "DEFAULT_MIN_BYTES",
    "PRESETS",
    "Codec",
    "CompressionPolicy",
    "DPHook",
    "ErrorFeedback",
    "Packet",
    "allgather",
    "allreduce",
    "alltoallv",
    "codec_names",
    "dp_hook",
    "get_codec",
    "isend",
    "recv",
    "reduce_scatter",
    "reset_stats",
    "send",
    "stats",
]
