"""``loom dask run SCRIPT [ARGS]``: run a Dask client script on an MPI job, every byte over ``mpi://``.

    mpiexec -n 4 loom dask run analysis.py --input data.parquet     # or: loom dask run --ranks 4 analysis.py

Rank 0 runs the scheduler, rank 1 runs ``SCRIPT`` as ``__main__`` (with ``sys.argv = [SCRIPT, *ARGS]``; a
plain ``Client()`` connects to the scheduler), ranks 2.. are workers. When the script returns, the cluster
is shut down and every rank exits 0; an exception in the script is printed and the job exits 1 (a
``sys.exit(code)`` exits with ``code``).

    loom dask run -n 6 --tcp 0.0.0.0:8786 --scheduler-file sched.json          # no script: serve outside clients

With ``--tcp`` the scheduler also listens on ``tcp://`` for a client outside the MPI job (a notebook on a
login node: ``Client("tcp://HOST:8786")`` or ``Client(scheduler_file="sched.json")``); workers keep using
``mpi://``. Without a script the job serves such clients until one calls ``client.shutdown()``.
"""

from __future__ import annotations

import argparse
import os
import re
import runpy
import sys
import traceback

from .. import cli_args
from ..comm import launch

__all__ = ["main", "parser"]

RELAUNCH = True
OWN_RANKS = True  # loom/cli.py leaves --ranks to this parser: a script's arguments are not loom's


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom dask", description="Dask over MPI (mpi:// comm backend)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run SCRIPT as the Dask client of this MPI job")
    run.add_argument("script", nargs="?", default=None,
                     help="Python file run as __main__ on rank 1; without one (needs --tcp) the cluster serves "
                          "outside clients until one of them shuts it down")
    run.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the script")
    run.add_argument("--nthreads", type=int, default=1, help="threads per worker rank")
    run.add_argument("--memory-limit", default="auto", help="per-worker memory limit (Dask syntax, or 'none')")
    run.add_argument("--local-directory", default=None, help="workers' spill directory")
    run.add_argument("--dashboard", action="store_true", help="start the scheduler dashboard (needs bokeh)")
    run.add_argument("--tcp", default=None, metavar="HOST:PORT",
                     help="the scheduler also listens on tcp://HOST:PORT (port 0: any free one) for clients outside "
                          "the MPI job; workers keep using mpi://")
    run.add_argument("--scheduler-file", default=None, metavar="PATH",
                     help="write the scheduler's address there as JSON, for Client(scheduler_file=PATH)")
    run.add_argument("-n", "--ranks", type=cli_args.parse_ranks, default=None, dest="np",
                     help="outside an MPI job: launch this many ranks with mpiexec and name a worker that dies")
    run.add_argument("--timeout", type=float, default=None, help="with --ranks: kill the job after this many seconds")
    run.add_argument("--fail-fast", action="store_true",
                     help="with --ranks: end the whole job when any rank dies, instead of carrying on without a "
                          "lost worker where the MPI allows it")
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


# A rank's parent (loom/dask/rank.py) reports its child's death itself: the launcher then sees a clean exit.
_KILLED = re.compile(r"loom dask: MPI rank \d+ \(pid (\d+)\) was killed by signal (\d+)")


def _watch_exits(roles_path: str, done, gone: dict[str, float]) -> None:
    """Record when each rank's process exits (``gone``: pid -> time), by pidfd, once rank 0 wrote the
    pid -> role map. MPICH's report names *a* pid of the torn-down job, not necessarily the one that died
    first, and it kills the others within milliseconds; pidfds make the kernel tell each exit as it happens."""
    import json
    import select
    import time

    pids: list[str] = []
    while not pids and not done.wait(0.02):
        if os.path.exists(roles_path):
            try:
                with open(roles_path) as f:
                    pids = list(json.load(f))
            except (OSError, ValueError):
                pids = []
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


def _launch(n: int, argv: list[str], timeout: float | None, fail_fast: bool = False) -> int:
    """Run this command on ``n`` ranks; forward the output; if a rank died, say which role it had.

    The launcher is asked to keep the other ranks running when one dies (:func:`loom.comm.launch.survivor_flags`):
    a lost worker is then survived (the client's exit code, which rank 1 writes next to the role map, is the
    job's). Otherwise the launcher reports a dead process (:class:`loom.comm.launch.DeathParser` reads either MPI's
    report); rank 0 saved the
    pid -> rank -> role map (``LOOM_DASK_ROLES``), so the last line can name the worker.
    """
    import json
    import subprocess
    import tempfile
    import threading

    with tempfile.TemporaryDirectory(prefix="loom-dask-") as tmp:
        roles_path = os.path.join(tmp, "roles.json")
        env = {**os.environ, "LOOM_LAUNCHED": "1", "LOOM_DASK_ROLES": roles_path, "PYTHONUNBUFFERED": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        survive = [] if fail_fast else launch.survivor_flags()
        rank_cmd = [sys.executable, "-m", "loom.cli", "dask", *argv]
        if survive:  # each rank under a small parent (by path: importing loom.dask would start MPI there)
            rank_cmd = [sys.executable, os.path.join(os.path.dirname(os.path.abspath(__file__)), "rank.py"),
                        *rank_cmd]
        cmd = launch.mpiexec_argv(n, rank_cmd, extra=survive)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        deaths = launch.DeathParser()
        gone: dict[str, float] = {}  # pid -> when it was first seen gone (or a zombie)
        done = threading.Event()
        watcher = threading.Thread(target=_watch_exits, args=(roles_path, done, gone), daemon=True)
        watcher.start()
        timer = None
        if timeout is not None:
            import signal

            timer = threading.Timer(timeout, lambda: os.killpg(proc.pid, signal.SIGKILL))
            timer.start()
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                if m := _KILLED.search(line):
                    deaths.deaths.append(launch.Death(pid=int(m.group(1)), signal=int(m.group(2))))
                else:
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
        client_rc = _read_client_rc(roles_path)
    return _report(rc, _with_pids(deaths.deaths, roles), gone, roles, client_rc, bool(survive))


def _with_pids(deaths: list, roles: dict) -> list:
    """Open MPI may name a dead rank without its pid: find the pid in the saved pid -> rank -> role map."""
    for d in deaths:
        if d.pid is None and d.rank is not None:
            d.pid = next((int(p) for p, w in roles.items() if w.get("rank") == d.rank), None)
    return deaths


def _read_client_rc(roles_path: str) -> int | None:
    try:
        with open(roles_path + ".rc") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def _report(rc: int, dead: list, gone: dict, roles: dict, client_rc: int | None, survive: bool) -> int:
    """Name each rank that died (``dead``: :class:`loom.comm.launch.Death`); the job's exit code: the client's
    when only workers died and it finished."""
    from loom.comm.launch import Death

    if dead and gone and not survive:  # a torn-down job: the launcher names *a* dead rank, the pidfds the first
        first = min(gone, key=gone.get)
        dead = [d for d in dead if str(d.pid) == first][:1] or [Death(pid=int(first))]
    only_workers = bool(dead) and all(roles.get(str(d.pid), {}).get("role", "").startswith("worker") for d in dead)
    survived = survive and only_workers and client_rc is not None
    for d in dead:
        who = roles.get(str(d.pid))
        if who:
            what = f"{who['role']} (MPI rank {who['rank']}, pid {d.pid})"
        else:
            what = f"pid {d.pid}" if d.pid is not None else f"MPI rank {d.rank}"
        if survived:
            print(f"loom dask: {what} died ({d.how()}); the cluster carried on without it", file=sys.stderr,
                  flush=True)
        else:
            print(f"loom dask: {what} died ({d.how()}); the launcher ended the whole job. Rerun the job: this "
                  f"MPI's launcher does not keep the other ranks running (see the README's Dask section)",
                  file=sys.stderr, flush=True)
    if survived:
        return client_rc
    return rc if rc else (1 if dead else 0)


def _bad_args(args) -> str | None:
    """The first problem with the arguments, as a message, or None."""
    if args.nthreads < 1:
        return f"--nthreads {args.nthreads} must be >= 1"
    if args.script is None and args.tcp is None:
        return "without a client script the cluster serves outside clients: give --tcp HOST:PORT (and " \
               "--scheduler-file PATH to publish the address)"
    if args.script is not None and not os.path.isfile(args.script):
        return f"script {args.script!r} not found"
    if args.np is not None and args.np < 3:
        return f"--ranks {args.np}: a Dask job over MPI needs >= 3 ranks (scheduler, client, worker)"
    return None


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    problem = _bad_args(args)
    if problem:
        print(f"loom dask: {problem}", file=sys.stderr)
        return 2
    if args.dry_run:
        what = args.script or "no script (serving outside clients)"
        print(f"loom dask: would run {what} {' '.join(args.args)} as the client on rank 1")
        return 0
    if args.np is not None and not launch.inside_job():
        return _launch(args.np, argv, args.timeout, args.fail_fast)
    if not args.verbose:
        _quiet_dask()
    from .launcher import initialize, set_exit_code, shutdown, wait_for_outside_clients

    memory_limit = None if str(args.memory_limit).lower() == "none" else args.memory_limit
    is_client = initialize(nthreads=args.nthreads, memory_limit=memory_limit, local_directory=args.local_directory,
                           dashboard=args.dashboard, exit=False, tcp=args.tcp, scheduler_file=args.scheduler_file)
    if not is_client:
        return 0
    if args.script is None:
        wait_for_outside_clients()
        rc = 0
    else:
        try:
            rc = _run_script(args.script, args.args)
        finally:
            shutdown()
    set_exit_code(rc)
    from .. import settings

    roles_path = settings.get("dask_roles")
    if roles_path:  # for `loom dask run -n`: the job's exit code when a lost worker makes mpiexec's non-zero
        with open(roles_path + ".rc", "w") as f:
            f.write(str(rc))
    return rc
