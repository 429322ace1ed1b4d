"""``loom dask run SCRIPT [ARGS]``: run a Dask client script on an MPI job, every byte over ``mpi://``.

    mpiexec -n 4 loom dask run analysis.py --input data.parquet     # or: loom dask run --ranks 4 analysis.py

Rank 0 runs the scheduler, rank 1 runs ``SCRIPT`` as ``__main__`` (with ``sys.argv = [SCRIPT, *ARGS]``; a
plain ``Client()`` connects to the scheduler), ranks 2.. are workers. When the script returns, the cluster
is shut down and every rank exits 0; an exception in the script is printed and the job exits 1 (a
``sys.exit(code)`` exits with ``code``).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import traceback

__all__ = ["main", "parser"]

RELAUNCH = True


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="loom dask", description="Dask over MPI (mpi:// comm backend)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run SCRIPT as the Dask client of this MPI job",
                         formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    run.add_argument("script", help="Python file run as __main__ on rank 1")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    run.add_argument("-t", "--nthreads", type=int, default=1, help="threads per worker rank")
    run.add_argument("--memory-limit", default="auto", help="per-worker memory limit (Dask syntax, or 'none')")
    run.add_argument("--local-directory", default=None, help="workers' spill directory")
    run.add_argument("--dashboard", action="store_true", help="start the scheduler dashboard (needs bokeh)")
    run.add_argument("--dry-run", action="store_true", help="check the arguments and exit without communicating")
    return p


def _run_script(script: str, args: list[str]) -> int:
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except BaseException:  # noqa: BLE001 - the script's failure becomes the job's exit code
        sys.stderr.write("loom dask: the client script raised:\n" + traceback.format_exc())
        sys.stderr.flush()
        return 1
    return 0


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.nthreads < 1:
        print(f"loom dask: --nthreads {args.nthreads} must be >= 1", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"loom dask: script {args.script!r} not found", file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"loom dask: would run {args.script} {' '.join(args.args)} as the client on rank 1")
        return 0
    from .launcher import initialize, shutdown

    memory_limit = None if str(args.memory_limit).lower() == "none" else args.memory_limit
    is_client = initialize(nthreads=args.nthreads, memory_limit=memory_limit,
                           local_directory=args.local_directory, dashboard=args.dashboard, exit=False)
    if not is_client:
        return 0
    try:
        return _run_script(args.script, args.args)
    finally:
        shutdown()
