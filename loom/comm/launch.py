"""Starting MPI jobs: the one place that knows how to build an ``mpiexec`` command line.

Used by ``loom <cmd> --ranks N`` (which re-launches itself under mpiexec), the test harness and the benchmarks.
The default MPI is the ``mpich`` wheel's, whose ``mpiexec`` sits next to the venv's Python; a site MPI is
used when ``LOOM_MPIEXEC`` names its launcher. Open MPI needs ``--allow-run-as-root --oversubscribe`` as root
on one node; they are added when the launcher is Open MPI's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Mapping, Sequence

__all__ = ["mpiexec", "mpiexec_argv", "run", "is_openmpi", "pid_alive", "survivor_flags"]


def mpiexec() -> str:
    """Path of the ``mpiexec`` to use: ``$LOOM_MPIEXEC``, the venv's own, or the first on ``PATH``."""
    env = os.environ.get("LOOM_MPIEXEC")
    if env:
        return env
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError(
            "no mpiexec found: install the bundled MPI with `pip install mpich` (done by `make`), "
            "or point LOOM_MPIEXEC at your site's launcher"
        )
    return found


def is_openmpi(launcher: str) -> bool:
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "Open MPI" in out or "OpenRTE" in out


def survivor_flags(launcher: str | None = None) -> list[str]:
    """Options that make ``launcher`` keep the other ranks running when one rank dies, or ``[]`` where it
    cannot (then a dead rank ends the job, as by default).

    MPICH's hydra: ``-disable-auto-cleanup`` (it then sends the survivors ``SIGUSR1``, which they must catch;
    see :func:`loom.dask.liveness.ignore_launcher_signal`). Open MPI keeps survivors only when built with
    ULFM and run with ``--with-ft ulfm``; that is not assumed here.
    """
    launcher = launcher or mpiexec()
    try:
        out = subprocess.run([launcher, "--version"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return ["-disable-auto-cleanup"] if "HYDRA" in out else []


def mpiexec_argv(n: int, argv: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
    """``[mpiexec, -n, N, ..., *argv]`` for a local launch of ``n`` ranks."""
    if n < 1:
        raise ValueError(f"rank count {n} must be >= 1")
    launcher = mpiexec()
    cmd = [launcher, "-n", str(n)]
    if is_openmpi(launcher) and hasattr(os, "geteuid") and os.geteuid() == 0:
        cmd += ["--allow-run-as-root", "--oversubscribe"]
    return cmd + list(extra) + list(argv)


def run(
    n: int,
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` local ranks; a job still running after ``timeout`` s is killed (whole group)."""
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    # More ranks than cores: one intra-op thread per rank, or torch threads fight the busy-waiting MPI.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = mpiexec_argv(n, argv)
    proc = subprocess.Popen(
        cmd, env=full_env, start_new_session=True,
        stdout=subprocess.PIPE if capture else None, stderr=subprocess.PIPE if capture else None, text=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        import signal

        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (``kill(pid, 0)``; a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
