"""Which device this rank computes on: ``cuda:local_rank``, bound once.

Several ranks on one node each see every GPU, and a bare ``"cuda"`` means ``torch.cuda.current_device()``, which
is ``cuda:0`` until someone calls ``torch.cuda.set_device``: every rank would then compute on GPU 0, save GPU 0's
RNG state and allocate its staging streams there. :func:`local_device` turns a device request into this rank's
device and binds it (``set_device``) the first time, so later bare ``"cuda"`` tensors, streams and RNG calls in
torch and in libraries land on the right GPU too.

The local rank comes from the launcher (``loom.settings.launch_info()``: MPICH's ``MPI_LOCALRANKID``, Open MPI's
``OMPI_COMM_WORLD_LOCAL_RANK``, PMIx, Slurm) before MPI starts; with fewer GPUs than local ranks, ranks share
them round-robin (``local_rank % device_count``), as the two ranks sharing one GPU of ``make test-gpu`` do.
"""

from __future__ import annotations

import torch

from .. import settings

__all__ = ["local_rank", "local_device", "resolve_device"]

_BOUND: torch.device | None = None


def local_rank() -> int:
    """This process's index among the ranks on its node (0 outside a launcher; the world rank when the launcher
    does not say, which is right on one node)."""
    info = settings.launch_info()
    if info is None:
        return 0
    return info.local_rank if info.local_rank is not None else info.rank


def local_device(kind: str | torch.device = "cuda") -> torch.device:
    """This rank's device of ``kind``: ``cpu``, or ``cuda:(local_rank % device_count)``, made current with
    ``torch.cuda.set_device`` on first use. An explicit ``cuda:N`` is kept (and bound).

    Raises:
        ValueError: CUDA asked for but torch sees no CUDA device, or an unknown device kind.
    """
    global _BOUND
    dev = torch.device(kind)
    if dev.type == "cpu":
        return torch.device("cpu")
    if dev.type != "cuda":
        raise ValueError(f"device {str(kind)!r}: loom runs on 'cpu' or 'cuda' (optionally 'cuda:N')")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(kind)!r} but torch sees no CUDA device (torch {torch.__version__}); use 'cpu'")
    if dev.index is None:
        dev = torch.device("cuda", local_rank() % torch.cuda.device_count())
    if _BOUND != dev:
        torch.cuda.set_device(dev)
        _BOUND = dev
    return dev


def resolve_device(kind: str | torch.device | None = "auto") -> torch.device:
    """``auto`` (or ``None``): this rank's GPU when torch sees one, else the CPU; anything else as
    :func:`local_device`."""
    if kind is None or kind == "auto":
        return local_device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    return local_device(kind)
