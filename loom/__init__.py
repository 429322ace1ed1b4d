"""loom: an MPI-native Python runtime for distributed deep learning and data analytics.

Subpackages: ``comm`` (the one communication layer), ``bench`` (OMB-style benchmarks), and one package per
capability (``parallel``, ``compress``, ``multipath``, ``dask``, ``torchdist``, ``testbed``, ``models``).

Importing loom registers the ``"loom"`` backend of ``torch.distributed`` (at once when torch.distributed is
imported, else right after it is; :func:`loom.torchdist.install`), without importing torch itself.
"""

from .torchdist import install as _install_torch_backend

__version__ = "0.1.0"
__all__ = ["__version__", "fit"]

_install_torch_backend()


def __getattr__(name: str):
    # Lazy, so `loom --help` does not import torch. The function shadows the submodule loom.fit of the same name.
    if name == "fit":
        from .fit import fit

        globals()["fit"] = fit
        return fit
    raise AttributeError(f"module 'loom' has no attribute {name!r}")
