"""loom.dask: Dask distributed over MPI.

* :mod:`loom.dask.backend`: the ``mpi://`` comm backend (registered for Dask through the entry-point group
  ``distributed.comm.backends``, so ``protocol="mpi"`` works in stock Dask), its plan, and the names it is
  built from: :mod:`~loom.dask.address`, :mod:`~loom.dask.wire`, :mod:`~loom.dask.process`,
  :mod:`~loom.dask.handshake`, :mod:`~loom.dask.connection` (with :mod:`~loom.dask.frames` and
  :mod:`~loom.dask.liveness`).
* :mod:`loom.dask.launcher`: :func:`initialize` turns an MPI job into a Dask cluster (rank 0 scheduler,
  rank 1 client, the rest workers); ``mpiexec -n N loom dask run SCRIPT`` runs a script that way.
"""

from .backend import SCHEME, MPIBackend, MPIComm, MPIConnector, MPIListener, parse_mpi_address
from .launcher import initialize

__all__ = ["SCHEME", "MPIBackend", "MPIComm", "MPIConnector", "MPIListener", "initialize", "parse_mpi_address"]
