"""``python -m loom.dask.rank CMD ARGS``: run one rank of a Dask job so that a dead worker does not end the job.

MPICH's hydra, even with ``-disable-auto-cleanup``, often kills every rank when one of its direct children is
killed by a signal (it races its own notice-only path against its clean-up path), while a child that exits
with status 0 before ``MPI_Finalize`` only earns the others a ``SIGUSR1`` notice, which they ignore
(:func:`loom.dask.liveness.ignore_launcher_signal`). So ``loom dask run -n N`` starts each rank under this
small parent: it runs ``CMD`` with the same environment and descriptors, forwards ``SIGINT``/``SIGTERM``, and
when a *worker* rank (MPI rank >= 2) dies of a signal it prints one line naming it and exits 0, leaving the
cluster to carry on; any other end (a normal exit, the scheduler or client dying) passes through unchanged,
so the launcher ends the job as before.
"""

from __future__ import annotations

import signal
import subprocess
import sys

from loom import settings  # stdlib-only: importing loom.dask here would start MPI in this parent

__all__ = ["main"]

FIRST_WORKER = 2


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: python -m loom.dask.rank CMD [ARGS...]", file=sys.stderr)
        return 2
    info = settings.launch_info()
    rank = -1 if info is None else info.rank
    # The launcher's notice that another rank died: ignored here and, inherited across exec, by the rank from
    # its first instruction to its last (a Python-level handler is reset to the default during interpreter
    # shutdown, when a notice would end the rank with 128 + SIGUSR1).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.Popen(argv, close_fds=False)
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    if code < 0 and rank >= FIRST_WORKER:
        print(f"loom dask: MPI rank {rank} (pid {child.pid}) was killed by signal {-code}", file=sys.stderr,
              flush=True)
        return 0
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
