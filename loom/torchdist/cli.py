"""``loom run SCRIPT [ARGS]``: run a torch.distributed script on an MPI job (torchrun's role for loom).

    loom run --ranks 4 train.py --epochs 3        # or: mpiexec -n 4 python train.py --epochs 3

Every rank runs ``SCRIPT`` as ``__main__`` with ``sys.argv = [SCRIPT, *ARGS]`` after ``import loom``, so
``dist.init_process_group("loom")`` needs nothing else (rank and size from MPI, no ``MASTER_ADDR``; torchrun's
``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are set for scripts that read them). loom's own
options (``--ranks N``) come before the script; everything after it is the script's. ``--ranks N`` launches the
job as ``loom train --ranks N`` does (:func:`loom.cli.relaunch`): Ctrl-C stops every rank with one line and exit
code 130, a rank that raises prints its traceback (prefixed with its rank) and ends the job, exit code 1, and
a rank whose script exits non-zero (``sys.exit(3)``) prints one line naming itself and ends the job with that
code (one that leaves by ``os._exit`` ends it too: the launcher stops the others when a rank leaves without
finalizing MPI).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys

from ..cli_args import ArgumentParser, follower_wait, leave_now, parse_ranks
from ..settings import launch_info, launch_rank

__all__ = ["main", "parser", "torchrun_env"]

SCRIPT_ARGS = True  # loom/cli.py reads --ranks only before the script: what follows is the script's


def parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="loom run", description="run a torch.distributed script on MPI ranks, "
                                "with the \"loom\" backend registered (torchrun's role)")
    if "--ranks" not in p._option_string_actions:  # the dispatcher offers it on every command it launches
        p.add_argument("-n", "--ranks", type=parse_ranks, default=None,
                       help="outside an MPI job: launch this many local ranks (before the script; inside a job: "
                            "ignored)")
    p.add_argument("script", help="Python file every rank runs as __main__")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    return p


def torchrun_env(env) -> None:
    """Set the variables torchrun sets that scripts read (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``) from the MPI launcher's, where the script's environment does not already have them.
    ``MASTER_ADDR``/``MASTER_PORT`` stay unset: without them ``env://`` takes its store's address over MPI."""
    from ..comm.devices import local_rank

    info = launch_info()
    rank, size = (0, 1) if info is None else (info.rank, info.size)
    local_size = info.local_size if info is not None and info.local_size is not None else size
    for key, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local_rank()),
                       ("LOCAL_WORLD_SIZE", local_size)):
        env.setdefault(key, str(value))


def main(argv: list[str]) -> int:
    ns = parser().parse_args(argv)
    if not os.path.isfile(ns.script):
        if launch_rank() == 0:
            print(f"loom run: error: script {ns.script!r} is not a file; give the path of a Python script",
                  file=sys.stderr)
        else:
            follower_wait()
        return 2
    from . import install

    install()  # the "loom" backend registered (import loom did it already; kept explicit for a direct caller)
    torchrun_env(os.environ)
    sys.argv = [ns.script, *ns.args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(ns.script)))
    try:
        runpy.run_path(ns.script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            _leave(code, exc.code)
        return code
    return 0


def _leave(code: int, what) -> None:
    """A rank's script exited non-zero: say so in one line and leave at once, without finalizing MPI. Finalizing
    would wait for ranks that are inside a collective with this one, which wait for it: the job would hang.
    Leaving unfinalized makes the launcher stop the other ranks; the job exits with ``code`` (torchrun's
    agent likewise stops the job when a rank fails)."""
    info = launch_info()
    if info is None or info.size == 1:
        return
    why = f" ({what})" if isinstance(what, str) else ""
    sys.stderr.write(f"loom run: rank {info.rank} exited with code {code}{why}; ending its {info.size}-rank job\n")
    leave_now(code)
