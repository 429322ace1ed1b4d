"""What differs between MPIs, in one process: the launcher module's rank environment, process lookup, dead-rank
reports of MPICH and Open MPI, and launcher/library pairing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from loom import settings
from loom.comm import launch

MPICH_KILLED = """
===================================================================================
=   BAD TERMINATION OF ONE OF YOUR APPLICATION PROCESSES
=   PID 4242 RUNNING AT vm
=   EXIT CODE: 9
=   CLEANING UP REMAINING PROCESSES
===================================================================================
"""
OMPI_KILLED = """--------------------------------------------------------------------------
prterun noticed that process rank 3 with PID 10684 on node vm exited on
signal 9 (Killed).
--------------------------------------------------------------------------
"""
OMPI_EXITED = """--------------------------------------------------------------------------
prterun detected that one or more processes exited with non-zero status,
thus causing the job to be terminated. The first process to do so was:

   Process name: [prterun-vm-10692@1,2]
   Exit code:    7
--------------------------------------------------------------------------
"""


def test_dead_rank_reports_of_both_mpis():
    (d,) = launch.DeathParser().feed_all(MPICH_KILLED)
    assert (d.pid, d.rank, d.code, d.signal) == (4242, None, 9, None) and "signal 9" in d.how()
    (d,) = launch.DeathParser().feed_all(OMPI_KILLED)
    assert (d.pid, d.rank, d.code, d.signal) == (10684, 3, None, 9) and d.how() == "killed by signal 9"
    (d,) = launch.DeathParser().feed_all(OMPI_EXITED)
    assert (d.pid, d.rank, d.code, d.signal) == (None, 2, 7, None) and d.how() == "exit code 7"
    assert launch.DeathParser().feed_all("all ranks finished\nEXIT CODE: 3\n") == []


def test_rank_environment_of_both_mpis():
    assert settings.launch_info({"PMI_RANK": "3", "PMI_SIZE": "4"}).rank == 3
    assert settings.launch_info({"PMI_RANK": "3", "PMI_SIZE": "4"}).size == 4
    assert settings.launch_info({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).rank == 1
    assert settings.launch_info({"OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_SIZE": "2"}).size == 2
    assert settings.launch_info({}) is None and not launch.inside_job({})
    assert launch.inside_job({"OMPI_COMM_WORLD_SIZE": "2"}) and launch.inside_job({"PMI_RANK": "0"})


@pytest.mark.skipif(not os.path.exists("/proc/self/environ"), reason="Linux /proc")
@pytest.mark.parametrize("var", ["PMI_RANK", "OMPI_COMM_WORLD_RANK"])
def test_rank_pids_finds_a_rank_under_either_mpi(var):
    marker = f"loom-rank-pid-{var}-{os.getpid()}"
    env = {**os.environ, var: "7"}
    env.pop("PMI_RANK" if var != "PMI_RANK" else "OMPI_COMM_WORLD_RANK", None)
    proc = subprocess.Popen([sys.executable, "-c", "import sys, time; time.sleep(60)", marker], env=env)
    try:
        for _ in range(200):
            found = launch.rank_pids(7, cmd_contains=(marker,))
            if found:
                break
            time.sleep(0.05)
        assert found == [proc.pid], found
        assert launch.rank_pids(6, cmd_contains=(marker,)) == []
    finally:
        proc.kill()
        proc.wait()


def test_launcher_and_library_of_different_mpis_are_refused(monkeypatch):
    monkeypatch.setattr(launch, "flavor", lambda launcher=None: launch.MPICH)
    monkeypatch.setattr(launch, "library_flavor", lambda: launch.OPENMPI)
    monkeypatch.setattr(launch, "mpiexec", lambda: "/x/mpiexec")
    with pytest.raises(RuntimeError, match="mpich's but mpi4py .* is linked to openmpi"):
        launch.check_pairing()
    monkeypatch.setattr(launch, "library_flavor", lambda: launch.MPICH)
    launch.check_pairing()


def test_this_mpi_pairs_with_its_launcher():
    assert launch.library_flavor() == launch.flavor() != launch.UNKNOWN


def _sleeper() -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_signal_verified_never_signals_a_process_that_is_not_the_one_meant():
    proc = _sleeper()
    try:
        started = launch.start_time(proc.pid)
        assert started is not None
        # the recorded identity does not match (as for a pid reused since it was found): no signal
        assert not launch.signal_verified(proc.pid, signal.SIGKILL, lambda p: launch.start_time(p) == started + 1)
        assert proc.poll() is None
        assert launch.signal_verified(proc.pid, signal.SIGKILL, lambda p: launch.start_time(p) == started)
        assert proc.wait(timeout=20) == -signal.SIGKILL
        assert not launch.signal_verified(proc.pid, signal.SIGKILL, lambda p: True)  # reaped: nothing to signal
    finally:
        proc.kill()
        proc.wait()


def test_testbed_kills_only_processes_still_inside_its_namespaces(monkeypatch):
    """`ip netns pids` listed a pid that now belongs to a process outside the namespace: it is left alone."""
    from loom.testbed import netns

    proc = _sleeper()
    try:
        monkeypatch.setattr(netns, "_run", lambda args, **kw: subprocess.CompletedProcess(args, 0, f"{proc.pid}\n", ""))
        assert netns._kill_netns_pids(["loomtb-no-such-namespace"]) == []
        assert proc.poll() is None, "a process outside the namespace was killed"
    finally:
        proc.kill()
        proc.wait()
