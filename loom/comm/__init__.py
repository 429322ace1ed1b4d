"""loom.comm: the one communication layer every part of loom sends through.

>>> from loom.comm import world, Mesh
>>> comm = world()
>>> total = comm.allreduce(torch.ones(3))          # tensors in, tensors out
>>> mesh = Mesh(dp=2, sp=comm.size // 2)
>>> mesh["sp"].alltoall(x)                         # per-axis sub-communicators
"""

from .buffers import cuda_aware
from .communicator import ANY_SOURCE, ANY_TAG, REDUCE_OPS, Communicator, reset_stats, stats, world
from .errors import CollectiveMismatchError, CommError, CommTimeoutError
from .mesh import AXES, Mesh
from .progress import Backoff, Poller, Request, poller, wait_all
from .safety import configure

__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "AXES",
    "REDUCE_OPS",
    "Backoff",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "Mesh",
    "Poller",
    "Request",
    "configure",
    "cuda_aware",
    "poller",
    "reset_stats",
    "stats",
    "wait_all",
    "world",
]
