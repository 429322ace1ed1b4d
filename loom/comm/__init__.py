"""loom.comm: the one communication layer every part of loom sends through.

>>> from loom.comm import world, Mesh
>>> comm = world()
>>> total = comm.allreduce(torch.ones(3))          # tensors in, tensors out
>>> mesh = Mesh(dp=2, sp=comm.size // 2)
>>> mesh["sp"].alltoall(x)                         # per-axis sub-communicators
"""

import importlib
from typing import Any

# Lazy exports: `loom.comm.launch` (stdlib only) must stay importable without loading torch and MPI, which
# cost seconds per process (the testbed's host side builds mpiexec lines but never communicates).
_EXPORTS = {
    "cuda_aware": "buffers",
    "local_device": "devices", "local_rank": "devices", "resolve_device": "devices",
    "ANY_SOURCE": "communicator", "ANY_TAG": "communicator", "REDUCE_OPS": "communicator",
    "Communicator": "communicator", "reset_stats": "communicator", "stats": "communicator", "world": "communicator",
    "tag_ub": "communicator", "MIN_TAG_UB": "communicator",
    "CollectiveMismatchError": "errors", "CommError": "errors", "CommTimeoutError": "errors",
    "AXES": "mesh", "Mesh": "mesh",
    "Backoff": "progress", "Poller": "progress", "Request": "progress", "poller": "progress", "wait_all": "progress",
    "ProgressThread": "progress", "Ticket": "progress",
    "configure": "safety",
    "doorbell": None,
}


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'loom.comm' has no attribute {name!r}")
    module = _EXPORTS[name]
    value = importlib.import_module(f".{name}", __name__) if module is None else \
        getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


__all__ = [
    "ANY_SOURCE",
    "ANY_TAG",
    "AXES",
    "MIN_TAG_UB",
    "REDUCE_OPS",
    "Backoff",
    "CollectiveMismatchError",
    "CommError",
    "CommTimeoutError",
    "Communicator",
    "Mesh",
    "Poller",
    "ProgressThread",
    "Request",
    "Ticket",
    "configure",
    "cuda_aware",
    "local_device",
    "local_rank",
    "poller",
    "reset_stats",
    "resolve_device",
    "stats",
    "tag_ub",
    "wait_all",
    "world",
]
