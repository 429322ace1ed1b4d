"""``loom dask run SCRIPT [ARGS]``: run a Dask client script on an MPI job, every byte over ``mpi://``.

    mpiexec -n 4 loom dask run analysis.py --input data.parquet     # or: loom dask run --ranks 4 analysis.py

``--ranks N`` (before SCRIPT) is read here, not by ``loom`` itself: the script's own arguments are left
alone, and when a rank dies the launcher here names its role.

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

from .. import cli_args

__all__ = ["main", "parser"]

RELAUNCH = True
OWN_RANKS = True  # loom/cli.py leaves --ranks to this parser: a script's arguments are not loom's


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom dask", description="Dask over MPI (mpi:// comm backend)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run SCRIPT as the Dask client of this MPI job")
    run.add_argument("script", help="Python file run as __main__ on rank 1")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    run.add_argument("--nthreads", type=int, default=1, help="threads per worker rank")
    run.add_argument("--memory-limit", default="auto", help="per-worker memory limit (Dask syntax, or 'none')")
    run.add_argument("--local-directory", default=None, help="workers' spill directory")
    run.add_argument("--dashboard", action="store_true", help="start the scheduler dashboard (needs bokeh)")
    run.add_argument("-n", "--ranks", type=cli_args.parse_ranks, default=None, dest="np",
                     help="outside an MPI job: launch this many ranks with mpiexec and name a worker that dies")
    run.add_argument("--timeout", type=float, default=None, help="with --ranks: kill the job after this many seconds")
    cli_args.add_dry_run(run)
    cli_args.add_verbose(run, "also show Dask's INFO logging (scheduler and worker start-up, connections)")
    return p


def _quiet_dask() -> None:
    """Keep Dask's INFO logging out of a run's output: the client's prints and every warning stay visible."""
    import logging

    import distributed  # noqa: F401 - configures its loggers on import; lower them afterwards

    logging.getLogger("distributed").setLevel(logging.WARNING)


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


def _inside_mpi() -> bool:
    from loom.cli import _inside_mpi as inside

    return inside()




def _launch(n: int, argv: list[str], timeout: float | None) -> int:
    """Run this command on ``n`` ranks; forward the output; if a rank died, say which role it had.

    The launcher reports a dead process (:class:`loom.comm.launch.DeathParser` reads either MPI); rank 0 saved the
    pid -> rank -> role map (``LOOM_DASK_ROLES``), so the last line can name the worker.
    """
    import json
    import subprocess
    import tempfile
    import threading
    import time

    from loom.comm import launch

    with tempfile.TemporaryDirectory(prefix="loom-dask-") as tmp:
        roles_path = os.path.join(tmp, "roles.json")
        env = {**os.environ, "LOOM_LAUNCHED": "1", "LOOM_DASK_ROLES": roles_path, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        cmd = launch.mpiexec_argv(n, [sys.executable, "-m", "loom.cli", "dask", *argv])
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        deaths = launch.DeathParser()
        gone: dict[str, float] = {}  # pid -> when it was first seen gone (or a zombie)
        done = threading.Event()

        def watch() -> None:
            # MPICH's report names *a* pid of the torn-down job, not necessarily the one that died first, and
            # it kills the others within milliseconds; pidfds make the kernel tell us each exit as it happens.
            pids: list[str] = []
            while not pids and not done.wait(0.02):
                if os.path.exists(roles_path):
                    try:
                        with open(roles_path) as f:
                            pids = list(json.load(f))
                    except (OSError, ValueError):
                        pids = []
            if not pids:
                return
            import select

            poll = select.poll()
            fds: dict[int, str] = {}
            for pid in pids:
                try:
                    fd = os.pidfd_open(int(pid))
                except (OSError, AttributeError):
                    continue
                fds[fd] = pid
                poll.register(fd, select.POLLIN)
            try:
                while fds and not done.is_set():
                    for fd, _ in poll.poll(100):
                        pid = fds.pop(fd)
                        gone.setdefault(pid, time.monotonic())
                        poll.unregister(fd)
                        os.close(fd)
            finally:
                for fd in fds:
                    os.close(fd)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        timer = None
        if timeout is not None:
            import signal

            timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                deaths.feed(line)
            rc = proc.wait()
        finally:
            done.set()
            if timer is not None:
                timer.cancel()
        sys.stdout.flush()
        roles = {}
        if os.path.exists(roles_path):
            with open(roles_path) as f:
                roles = json.load(f)
    dead = _first_death(deaths.deaths, gone, roles)
    for death in dead:
        pid = str(death.pid) if death.pid is not None else None
        who = roles.get(pid) if pid else None
        if who:
            what = f"{who['role']} (MPI rank {who['rank']}, pid {pid})"
        else:
            what = f"pid {pid}" if pid else f"MPI rank {death.rank}"
        print(f"loom dask: {what} died ({death.how()}); the MPI ended the whole job. Rerun the job: a Dask "
              f"cluster over MPI cannot outlive one of its ranks", file=sys.stderr, flush=True)
    return rc if rc else (1 if dead else 0)


def _first_death(deaths: list, gone: dict[str, float], roles: dict) -> list:
    """The one death to report. The launcher names *a* dead process of the torn-down job (MPICH by pid, Open
    MPI by rank and pid), not necessarily the first; the pidfd watcher saw which vanished first."""
    from loom.comm.launch import Death

    if not deaths:
        return []
    for d in deaths:  # Open MPI may name a rank only: map it to its pid through the saved roles
        if d.pid is None and d.rank is not None:
            d.pid = next((int(p) for p, w in roles.items() if w.get("rank") == d.rank), None)
    if not gone:
        return deaths[:1]
    first = min(gone, key=gone.get)
    same = [d for d in deaths if str(d.pid) == first]
    return same[:1] or [Death(pid=int(first))]


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    if args.nthreads < 1:
        print(f"loom dask: --nthreads {args.nthreads} must be >= 1", file=sys.stderr)
        return 2
    if not os.path.isfile(args.script):
        print(f"loom dask: script {args.script!r} not found", file=sys.stderr)
        return 2
    if args.np is not None and args.np < 3:
        print(f"loom dask: --ranks {args.np}: a Dask job over MPI needs >= 3 ranks (scheduler, client, worker)",
              file=sys.stderr)
        return 2
    if args.dry_run:
        print(f"loom dask: would run {args.script} {' '.join(args.args)} as the client on rank 1")
        return 0
    if args.np is not None and not _inside_mpi():
        return _launch(args.np, argv, args.timeout)
    if not args.verbose:
        _quiet_dask()
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
