"""loom.torchdist: a ``torch.distributed`` backend named ``"loom"`` over loom.comm.

Existing DDP, FSDP2, DTensor and pipelining code runs on MPI by changing its backend name::

    import loom                                   # registers the backend (see below)
    import torch.distributed as dist
    dist.init_process_group("loom")               # rank and size from MPI; no MASTER_ADDR needed

and launching the script with ``loom run --ranks N script.py``, ``mpiexec -n N python script.py``, torchrun, or
``torch.multiprocessing.spawn`` (any ``init_method``, or a ``store``): processes no MPI launcher started form
one MPI world of exactly the torch ranks through torch's store (:mod:`loom.torchdist.rendezvous`).

* :mod:`loom.torchdist.backend`: the process group (:class:`~loom.torchdist.backend.LoomProcessGroup`) and the
  creator torch calls for every group (the default one and each sub-group); :mod:`loom.torchdist.work` its work
  objects; :mod:`loom.torchdist.rendezvous` how the ranks find each other and the MPI world;
  :mod:`loom.torchdist.policy`: :func:`set_compression` / ``LOOM_TORCH_COMPRESS`` choose a codec per group,
  :func:`exact` keeps reductions uncompressed, :func:`set_multipath` / ``LOOM_TORCH_MULTIPATH`` route a group's
  ``all_to_all_single`` over loom.multipath's planned paths under a multi-rail topology.
* :mod:`loom.torchdist.cli`: ``loom run --ranks N script.py``.

Registration without weight: ``import loom`` must not import torch, and torch has no entry-point group for
process-group backends (its ``torch.backends`` entry points load device extensions on every ``import torch``).
So ``import loom`` calls :func:`install`: where ``torch.distributed`` is already imported it registers at once;
otherwise an import hook registers right after ``torch.distributed`` finishes importing. Registering imports
neither loom.comm nor MPI: MPI starts when a ``"loom"`` group is first created.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

__all__ = ["BACKEND", "exact", "install", "register", "set_compression", "set_multipath"]

BACKEND = "loom"
_REGISTERED = False


def register() -> None:
    """Register the ``"loom"`` backend with ``torch.distributed`` (idempotent; imports torch.distributed).

    Also wraps torch's rendezvous handlers (:mod:`loom.torchdist.rendezvous`): inside an MPI job ``env://`` takes
    rank and size from MPI (the store at ``MASTER_ADDR:MASTER_PORT`` when exported, else hosted by rank 0 with
    its address sent over MPI), and ``env://``, ``tcp://`` and ``file://`` refuse a rank or world size that is
    not the launcher's; outside one they are torch's own.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    import torch.distributed as dist

    if not dist.is_available():
        return
    rdzv = importlib.import_module("torch.distributed.rendezvous")  # the module (the package re-exports a function)
    _REGISTERED = True
    dist.Backend.register_backend(BACKEND, _create, extended_api=True, devices=["cpu", "cuda"])
    from .rendezvous import checked_handler, env_handler

    for scheme, wrap in (("env", env_handler), ("tcp", checked_handler), ("file", checked_handler)):
        handler = rdzv._rendezvous_handlers.get(scheme)
        if handler is not None and not getattr(handler, "_loom", False):
            rdzv._rendezvous_handlers[scheme] = wrap(handler)


def __getattr__(name: str):
    # neither torch nor MPI loads for these: exact(), set_compression() and set_multipath() are the policies'
    if name in ("exact", "set_compression", "set_multipath"):
        from . import policy

        return getattr(policy, name)
    raise AttributeError(f"module 'loom.torchdist' has no attribute {name!r}")


def _create(dist_opts, pg_opts):
    if not list(dist_opts.global_ranks_in_group):  # the default group: MPI's world first (before MPI starts)
        from .rendezvous import start_mpi

        start_mpi(dist_opts.store, dist_opts.group_rank, dist_opts.group_size, dist_opts.timeout)
    from .backend import create_process_group

    return create_process_group(dist_opts, pg_opts)


def _quiet_lightning(module) -> None:
    """Lightning's ``MPIEnvironment.detect()`` imports mpi4py, which starts MPI, to read the world's size: every
    process Lightning starts itself would then be an MPI singleton before ``init_process_group`` could form their
    world. Before MPI has started, answer from the MPI launcher's variables instead (the same answer inside an
    MPI job, without starting MPI outside one)."""
    env = getattr(module, "MPIEnvironment", None)
    if env is None or getattr(env.detect, "_loom", False):
        return
    original = env.detect

    def detect() -> bool:
        from loom.settings import launch_info
        from loom.comm import pmi

        from .rendezvous import launched_by_mpi

        if pmi.mpi_started():
            return original()
        info = launch_info() if launched_by_mpi() else None
        return info is not None and info.size > 1

    detect._loom = True  # type: ignore[attr-defined]
    env.detect = staticmethod(detect)


#: modules whose import loom completes (module name -> what runs once it has executed)
_HOOKS = {"torch.distributed": lambda _module: register(),
          "lightning.fabric.plugins.environments.mpi": _quiet_lightning,
          "lightning_fabric.plugins.environments.mpi": _quiet_lightning}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs each of :data:`_HOOKS` once its module has finished importing (a post-import hook)."""

    def __init__(self, pending: dict):
        self.pending = pending

    def find_spec(self, fullname, path, target=None):
        hook = self.pending.pop(fullname, None)
        if hook is None:
            return None
        if not self.pending:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)  # the real spec (this finder no longer answers for the name)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_then_hook(module):
            exec_module(module)
            hook(module)

        spec.loader.exec_module = exec_then_hook  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Run each of :data:`_HOOKS` now where its module is imported, else when it is (called by ``import loom``):
    the ``"loom"`` backend is registered with torch.distributed, and Lightning's MPI detection is kept from
    starting MPI."""
    if any(isinstance(f, _AfterImport) for f in sys.meta_path):
        return
    pending = {}
    for name, hook in _HOOKS.items():
        if name in sys.modules:
            hook(sys.modules[name])
        else:
            pending[name] = hook
    if pending:
        sys.meta_path.insert(0, _AfterImport(pending))
