"""Starting MPI jobs: the one place that knows which MPI runs and how its launcher behaves.

Used by ``loom <cmd> --ranks N`` (which re-launches itself under mpiexec), the test harness and the benchmarks.
The default MPI is the ``mpich`` wheel's, whose ``mpiexec`` sits next to the venv's Python; a site MPI is
used when ``LOOM_MPIEXEC`` names its launcher. Everything that differs between MPICH and Open MPI is here:

* the command line: Open MPI needs ``--allow-run-as-root --oversubscribe`` as root on one node;
* the environment a rank sees: its rank and size (``PMI_RANK``/``PMI_SIZE`` under MPICH's Hydra,
  ``OMPI_COMM_WORLD_RANK``/``OMPI_COMM_WORLD_SIZE`` under Open MPI; read by :func:`loom.settings.launch_info`),
  :func:`inside_job`, and :func:`rank_pids`, which finds a rank's process through ``/proc``;
* the launcher's report when a rank dies (MPICH: ``BAD TERMINATION ... PID 1234 RUNNING AT`` then
  ``EXIT CODE: 9``; Open MPI: ``... noticed that process rank 3 with PID 1234 on node h exited on signal 9``,
  or ``Process name: [...,3]`` then ``Exit code: 7``): :class:`DeathParser`;
* which MPI mpi4py is linked to (:func:`library_flavor`, from ``MPI_Get_library_version``) against which the
  launcher is (:func:`flavor`): a launcher of one MPI starting ranks of the other starts ``n`` singletons
  that never meet, so :func:`run` refuses that pairing up front;
* how a job is stopped when the process that launched it gets SIGINT (a terminal's Ctrl-C) or SIGTERM: the
  launcher runs in its own session, so the signal reaches only this process; :func:`run` passes SIGINT to the
  job's ranks (each stops without a traceback, see ``loom/cli.py``), kills whatever is left after
  :data:`GRACE_S` seconds, and raises :class:`Interrupted`. The ranks are signalled rather than the launcher:
  MPICH's hydra answers SIGINT with two lines of its own and SIGTERM with its bad-termination banner.

This module stays stdlib-only at import (the testbed's host side builds mpiexec lines but never communicates).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping, Sequence

from .. import settings

__all__ = [
    "mpiexec", "mpiexec_argv", "run", "flavor", "library_flavor", "is_openmpi", "check_pairing",
    "inside_job", "rank_pids", "Death", "DeathParser", "pid_alive", "start_time",
    "signal_verified", "survivor_flags", "descendants", "Interrupted", "GRACE_S", "note_stop", "stopping",
]

MPICH, OPENMPI, UNKNOWN = "mpich", "openmpi", "unknown"

# A rank's own index and the job's size, per MPI (first match wins; PMIX_RANK covers other PMIx launchers).
RANK_ENV = ("PMI_RANK", "OMPI_COMM_WORLD_RANK", "PMIX_RANK")
SIZE_ENV = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE")
# Any of these says "this process is already a rank of a job" (as does LOOM_LAUNCHED, set by a loom launch).
_JOB_ENV = (*RANK_ENV, *SIZE_ENV, "MPI_LOCALRANKID")


def mpiexec() -> str:
    """Path of the ``mpiexec`` to use: ``$LOOM_MPIEXEC``, the venv's own, or the first on ``PATH``."""
    env = settings.get("mpiexec")
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


def _flavor_of(text: str) -> str:
    if "Open MPI" in text or "OpenRTE" in text or "PRRTE" in text:
        return OPENMPI
    if "MPICH" in text or "HYDRA" in text.upper():
        return MPICH
    return UNKNOWN


@functools.cache
def flavor(launcher: str | None = None) -> str:
    """``"mpich"``, ``"openmpi"`` or ``"unknown"``: the MPI of ``launcher`` (default :func:`mpiexec`), from its
    ``--version``."""
    try:
        out = subprocess.run([launcher or mpiexec(), "--version"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return _flavor_of(out.stdout + out.stderr)


def is_openmpi(launcher: str) -> bool:
    return flavor(launcher) == OPENMPI


_LIBRARY_PROBE = "import mpi4py; mpi4py.rc.initialize = False; from mpi4py import MPI; print(MPI.Get_library_version())"


@functools.cache
def library_flavor() -> str:
    """The MPI that mpi4py is linked to in this Python (``MPI_Get_library_version``).

    Read in-process when ``mpi4py.MPI`` is already loaded; else in a child Python (loading it here would
    initialize MPI in a process that may only launch jobs).
    """
    mod = sys.modules.get("mpi4py.MPI")
    if mod is not None:
        return _flavor_of(mod.Get_library_version())
    try:
        out = subprocess.run([sys.executable, "-c", _LIBRARY_PROBE], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return UNKNOWN
    return _flavor_of(out.stdout) if out.returncode == 0 else UNKNOWN


def check_pairing(launcher: str | None = None) -> None:
    """Refuse a launcher of one MPI with an mpi4py linked to the other (the ranks would be singletons)."""
    lf, pf = flavor(launcher), library_flavor()
    if UNKNOWN not in (lf, pf) and lf != pf:
        raise RuntimeError(
            f"the launcher {launcher or mpiexec()} is {lf}'s but mpi4py in {sys.executable} is linked to {pf}: "
            f"its ranks would each start alone. Use the mpiexec of the MPI mpi4py loads (set LOOM_MPIEXEC), "
            f"or make mpi4py load the launcher's MPI (MPI4PY_LIBMPI or LD_LIBRARY_PATH)"
        )


def survivor_flags(launcher: str | None = None) -> list[str]:
    """Options that make ``launcher`` keep the other ranks running when one rank dies, or ``[]`` where it
    cannot (then a dead rank ends the job, as by default).

    MPICH's hydra: ``-disable-auto-cleanup`` (it then sends the survivors ``SIGUSR1``, which they must catch;
    see :func:`loom.dask.liveness.ignore_launcher_signal`). Open MPI keeps survivors only when built with
    ULFM and run with ``--with-ft ulfm``; that is not assumed here.
    """
    return ["-disable-auto-cleanup"] if flavor(launcher) == MPICH else []


def mpiexec_argv(n: int, argv: Sequence[str], *, extra: Sequence[str] = ()) -> list[str]:
    """``[mpiexec, -n, N, ..., *argv]`` for a local launch of ``n`` ranks."""
    if n < 1:
        raise ValueError(f"rank count {n} must be >= 1")
    launcher = mpiexec()
    cmd = [launcher, "-n", str(n)]
    if is_openmpi(launcher):
        # --oversubscribe: more ranks than cores is how every local test runs; root needs its own consent.
        cmd += ["--oversubscribe"]
        if hasattr(os, "geteuid") and os.geteuid() == 0:
            cmd += ["--allow-run-as-root"]
        if n > (os.cpu_count() or 1):  # a rank blocked in MPI yields its core to the peer it waits for
            cmd += ["--mca", "mpi_yield_when_idle", "1"]
    return cmd + list(extra) + list(argv)


GRACE_S = 5.0
"""Seconds a job has to stop after its ranks were passed the signal, before every process left is killed."""


class Interrupted(KeyboardInterrupt):
    """The launching process got SIGINT or SIGTERM (``signum``) and the job has been stopped: no process of it
    is left. A ``KeyboardInterrupt``, so a caller that does not catch it stops as on any Ctrl-C."""

    def __init__(self, signum: int, result: subprocess.CompletedProcess):
        super().__init__(signum)
        self.signum = signum
        self.result = result


class _Stop(Exception):
    pass


_stopping: list[int] = []


def note_stop(signum: int | None) -> None:
    """Record that this rank has been told to stop (SIGINT or SIGTERM, by the command that handles it): what
    fails after it, such as a collective whose peer has already left, is the stop's doing, so the abort hooks of
    :mod:`loom.comm.safety` end the rank with ``128 + signum`` and no traceback. None forgets it (a command
    that starts)."""
    if signum is None:
        _stopping.clear()
    else:
        _stopping.append(signum)


def stopping() -> int | None:
    """The signal this rank was told to stop by (:func:`note_stop`), or None."""
    return _stopping[0] if _stopping else None


def run(
    n: int,
    argv: Sequence[str],
    *,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    capture: bool = False,
) -> subprocess.CompletedProcess:
    """Run ``argv`` on ``n`` local ranks; a job still running after ``timeout`` s is killed (whole group).

    Raises:
        subprocess.TimeoutExpired: the job ran past ``timeout`` (it has been killed).
        Interrupted: this process got SIGINT or SIGTERM (the job has been stopped; see the module docstring).
    """
    full_env = dict(os.environ)
    if env:
        full_env.update(env)
    check_pairing()
    # More ranks than cores: one intra-op thread per rank, or torch threads fight the busy-waiting MPI.
    full_env.setdefault("OMP_NUM_THREADS", "1")
    cmd = mpiexec_argv(n, argv)
    caught: list[int] = []
    armed = [True]

    def on_signal(signum, frame):
        caught.append(signum)
        if armed[0]:
            armed[0] = False
            raise _Stop

    previous = _install(on_signal)
    relay = None if capture else _Relay()
    try:
        proc = subprocess.Popen(
            cmd, env=full_env, start_new_session=True, stdout=subprocess.PIPE if capture else None,
            stderr=subprocess.PIPE if capture else relay.write_end, text=True,
        )
        if relay is not None:
            relay.start()
        try:
            out, err = proc.communicate(timeout=timeout)
        except _Stop:
            if relay is not None:
                relay.mute()
            out, err = _stop(proc, caught, armed)
            raise Interrupted(caught[0], subprocess.CompletedProcess(cmd, proc.returncode, out, err)) from None
        except subprocess.TimeoutExpired:
            armed[0] = False
            _kill_job(proc, descendants(proc.pid))
            out, err = proc.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    finally:
        _restore(previous)
        if relay is not None:
            relay.close()
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


class _Relay:
    """The job's stderr, copied to ours as it comes, until :meth:`mute`: once this process was signalled, what
    the job writes is the launcher's account of ranks that left with 128 + signal (Open MPI's prterun prints a
    banner for it), which the one interrupt line already says. A pipe of our own, not ``stderr=PIPE``, so that
    ``communicate`` keeps only waiting."""

    def __init__(self):
        self._read, self.write_end = os.pipe()
        self._muted = threading.Event()
        self._thread = threading.Thread(target=self._copy, daemon=True, name="loom-stderr")

    def start(self) -> None:
        os.close(self.write_end)  # the job holds the only write end: end of file when it is gone
        self.write_end = -1
        self._thread.start()

    def mute(self) -> None:
        self._muted.set()

    def _copy(self) -> None:
        target = getattr(sys.stderr, "buffer", None)
        while chunk := os.read(self._read, 65536):
            if self._muted.is_set():
                continue
            try:
                if target is not None:
                    target.write(chunk)
                else:
                    sys.stderr.write(chunk.decode(errors="replace"))
                sys.stderr.flush()
            except (OSError, ValueError):
                pass

    def close(self) -> None:
        if self.write_end >= 0:  # the launcher never started
            os.close(self.write_end)
            self.write_end = -1
        if self._thread.ident is not None:
            self._thread.join(timeout=GRACE_S)  # all the job wrote reaches the terminal before run() returns
        if not self._thread.is_alive():  # else a leftover holds the pipe: the daemon thread keeps its end
            os.close(self._read)


_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _install(handler) -> dict[int, object]:
    """Install ``handler`` for SIGINT and SIGTERM; returns the previous handlers. Off the main thread, where
    Python allows no handler, nothing is installed and the caller keeps the old behaviour."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {}
    for sig in _STOP_SIGNALS:
        old = signal.getsignal(sig)
        previous[sig] = signal.SIG_DFL if old is None else old  # None: installed outside Python
        signal.signal(sig, handler)
    return previous


def _restore(previous: Mapping[int, object]) -> None:
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def _job_ranks(family: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """The processes of ``family`` that a launcher started as ranks (their environment names a rank)."""
    want = tuple(f"{var}=".encode() for var in RANK_ENV)
    out = []
    for pid, started in family:
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if any(e.startswith(want) for e in env):
            out.append((pid, started))
    return out


def _stop(proc: subprocess.Popen, caught: list[int], armed: list[bool]) -> tuple[str | None, str | None]:
    """Stop the job of ``proc`` after this process was signalled: SIGINT to its ranks, then, after
    :data:`GRACE_S` or at a second signal, SIGKILL to everything of the job that is left."""
    family = descendants(proc.pid)
    ranks = _job_ranks(family)
    for pid, started in ranks:
        signal_verified(pid, signal.SIGINT, lambda p, t=started: start_time(p) == t)
    out = err = None
    if ranks:  # none yet: the launcher is still starting them, and there is nothing to stop gently
        armed[0] = True
        try:
            out, err = proc.communicate(timeout=GRACE_S)
        except (_Stop, subprocess.TimeoutExpired):
            pass
        armed[0] = False
    _kill_job(proc, family + descendants(proc.pid))
    if proc.returncode is None or (out is None and proc.stdout is not None):
        out, err = proc.communicate()
    return out, err


def _kill_job(proc: subprocess.Popen, family: Iterable[tuple[int, int]]) -> None:
    """SIGKILL the launcher's process group and every process of ``family`` that is still the one found."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid, started in family:  # ranks in other process groups (Open MPI) survive the launcher's death
        signal_verified(pid, signal.SIGKILL, lambda p, t=started: start_time(p) == t)


def start_time(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat`` field 22): with the pid, a
    process identity that a reused pid does not share. ``None`` when there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def signal_verified(pid: int, sig: int, is_it: Callable[[int], bool]) -> bool:
    """Send ``sig`` to ``pid`` only if it is still the process meant, never to a process that reused its pid.

    Opens a pidfd first (it pins whichever process holds the pid now), then asks ``is_it(pid)`` (e.g. its
    :func:`start_time` is the one recorded when it was found, or it is inside the expected namespace), then
    signals through the pidfd: a process that died and whose pid went to another between finding and
    signalling fails the check, or the pidfd refers to the dead one. Returns whether the signal was sent.
    """
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return False
    try:
        if not is_it(pid):
            return False
        signal.pidfd_send_signal(fd, sig)
        return True
    except ProcessLookupError:
        return False
    finally:
        os.close(fd)


def descendants(pid: int) -> list[tuple[int, int]]:
    """Every live descendant of ``pid`` as ``(pid, start time)``: launchers put ranks in other process groups
    (hydra's proxies start their own sessions; Open MPI's ranks outlive a killed prterun), so killpg misses
    them. The start time tells each from a later process that reuses its pid (:func:`signal_verified`)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ppid, started = int(fields[1]), int(fields[19])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append((int(entry), started))
    out: list[tuple[int, int]] = []
    todo = [pid]
    while todo and len(out) < 10_000:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c[0])
    return out


def pid_alive(pid: int) -> bool:
    """True while process ``pid`` exists (``kill(pid, 0)``; a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------------------------------------- rank side
def inside_job(environ: Mapping[str, str] | None = None) -> bool:
    """True when this process is already a rank of an MPI job (or of a loom launch)."""
    if environ is None:
        return any(v in os.environ for v in _JOB_ENV) or settings.get("launched")
    return any(v in environ for v in _JOB_ENV)


def rank_pids(rank: int, *, cmd_contains: Iterable[str] = ()) -> list[int]:
    """Pids of this user's processes whose launcher environment says they are ``rank`` and whose command line
    holds every string in ``cmd_contains`` (Linux ``/proc``; the environment is the one the process started
    with). Under either MPI."""
    want = {f"{var}={rank}".encode() for var in RANK_ENV}
    needles = list(cmd_contains)
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            if not all(n in cmd for n in needles):
                continue
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        # A rank's first rank variable decides (a child of a rank inherits it and is found too: filter by cmd).
        if any(e in want for e in env):
            found.append(int(d.name))
    return found


# ---------------------------------------------------------------------------------------------- launcher side
@dataclass(slots=True)
class Death:
    """A rank the launcher reported dead: its pid and/or rank, and exit code or signal when given."""

    pid: int | None = None
    rank: int | None = None
    code: int | None = None
    signal: int | None = None

    def how(self) -> str:
        if self.signal is not None:
            return f"killed by signal {self.signal}"
        if self.code is not None:
            return f"exit code {self.code}" + (" = killed by signal 9" if self.code == 9 else "")
        return "it vanished first"


# MPICH (Hydra): "=   PID 1234 RUNNING AT host" ... "=   EXIT CODE: 9"
_MPICH_PID = re.compile(r"PID (\d+) RUNNING AT")
_MPICH_CODE = re.compile(r"EXIT CODE: (\d+)")
# Open MPI 5 (PRRTE), over wrapped lines. A signal: "prterun noticed that process rank 3 with PID 1234 on node h
# exited on signal 9 (Killed)."; an exit: "Process name: [prterun-h-1234@1,3]" then "Exit code:    7" (rank 3).
_OMPI_SIGNAL = re.compile(r"noticed\s+that\s+process\s+rank\s+(\d+)\s+with\s+PID\s+(\d+)\s+on\s+node\s+\S+\s+"
                          r"exited\s+on\s+signal\s+(\d+)")
_OMPI_EXIT = re.compile(r"Process\s+name:\s+\[[^\]]*?,(\d+)\]\s+Exit\s+code:\s+(\d+)")


class DeathParser:
    """Reads a launcher's output line by line and collects the ranks it reports dead, under either MPI."""

    def __init__(self) -> None:
        self.deaths: list[Death] = []
        self._tail = ""  # Open MPI wraps its report over several lines

    def feed(self, line: str) -> None:
        if m := _MPICH_PID.search(line):
            self.deaths.append(Death(pid=int(m.group(1))))
        elif (m := _MPICH_CODE.search(line)) and self.deaths and self.deaths[-1].code is None:
            self.deaths[-1].code = int(m.group(1))
        self._tail = (self._tail + " " + line.strip())[-600:]
        if m := _OMPI_SIGNAL.search(self._tail):
            self.deaths.append(Death(pid=int(m.group(2)) or None, rank=int(m.group(1)), signal=int(m.group(3))))
            self._tail = ""
        elif m := _OMPI_EXIT.search(self._tail):
            self.deaths.append(Death(rank=int(m.group(1)), code=int(m.group(2))))
            self._tail = ""

    def feed_all(self, text: str) -> list[Death]:
        for line in text.splitlines():
            self.feed(line)
        return self.deaths
