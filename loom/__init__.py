"""loom: an MPI-native Python runtime for distributed deep learning and data analytics.

Subpackages: ``comm`` (the one communication layer), ``bench`` (OMB-style benchmarks), and one package per
capability (``parallel``, ``compress``, ``multipath``, ``dask``, ``testbed``, ``models``).
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
