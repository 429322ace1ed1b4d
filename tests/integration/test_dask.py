"""Dask over MPI as whole jobs: the mpi:// backend across 2 and 3 ranks, and ``loom dask run`` at 3-4 ranks
(applications exact against single-process references, a failing script, a killed worker)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("distributed")

from loom.comm import launch  # noqa: E402
from loom.testing import ROOT, run_ranks  # noqa: E402

pytestmark = pytest.mark.mpi

CLIENT = str(ROOT / "tests" / "mpi" / "check_dask_client.py")
ENV = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
       "DASK_DISTRIBUTED__LOGGING__DISTRIBUTED": "warning"}


@pytest.mark.parametrize("ceiling", [2**23 - 1, 32767])
def test_backend_across_ranks_under_tag_ceiling(ceiling):
    """The checks that open connections, with the MPI's tag ceiling forced down to Open MPI over UCX's and the
    standard's minimum (the inline-spin check is left out: it is about reply timing, not tags)."""
    only = ("check_ping_pong_all_pairs,check_close_reaches_other_rank,check_refused_on_other_rank,"
            "check_doorbell_wakes_sleeping_reader,check_tags_within_the_mpi_ceiling")
    run_ranks(2, "tests/mpi/check_dask.py", timeout=120, env={"LOOM_TAG_UB": str(ceiling), "LOOM_ONLY": only})


def _loom_dask_run(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "loom.cli", "dask", "run", CLIENT, *args]
    return launch.run(n, argv, timeout=timeout, env=ENV, capture=True)


def test_run_applications_exact_and_clean_exit():
    proc = _loom_dask_run(4, "apps")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "APPS OK" in proc.stdout and "IDLE POLL" in proc.stdout, out
    assert "rank 2 worker rank-2" in proc.stderr and "rank 3 worker rank-3" in proc.stderr, out


def test_run_script_exception_is_the_exit_code():
    proc = _loom_dask_run(3, "raise")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "the client script raised" in out and "requested failure from the client script" in out, out


def test_killed_worker_is_survived():
    """5 ranks (scheduler, client, three workers): the client SIGKILLs a worker while both applications run.
    The results equal the same graphs over tcp:// and the references, the scheduler reports the worker lost,
    the job exits 0 (bounded by --timeout 300: a hang fails), naming the worker that died."""
    if not launch.survivor_flags():
        pytest.skip(f"this MPI's launcher ({launch.flavor()}) ends the job when a rank dies (README: which MPIs "
                    f"survive); the --fail-fast test covers that case")
    cmd = [sys.executable, "-m", "loom.cli", "dask", "run", "-n", "5", "--timeout", "300", CLIENT, "survive"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=330, env={**os.environ, **ENV})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "KILLED rank-4" in out and "SURVIVE OK" in out and "KILL-TO-RESULT" in out, out
    assert "loom dask: scheduler lost worker rank-4" in out, out
    assert "lost worker rank-2" not in out and "lost worker rank-3" not in out, out
    assert "loom dask: worker rank-4 (MPI rank 4" in out and "the cluster carried on without it" in out, out


def test_killed_worker_ends_job_and_is_named_with_fail_fast():
    """With --fail-fast (an MPI that cannot keep survivors running behaves so): a worker SIGKILLed mid-task
    ends the job (no hang; bounded by the timeout) naming that worker."""
    cmd = [sys.executable, "-m", "loom.cli", "dask", "run", "-n", "4", "--timeout", "170", "--fail-fast", CLIENT,
           "kill"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env={**os.environ, **ENV})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "KILLING rank-3" in out, out
    assert "loom dask: worker rank-3 (MPI rank 3" in out and "the launcher ended the whole job" in out, out


def _outside(sched, mode: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "tests/mpi/outside_dask_client.py", str(sched), mode],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **ENV})


def test_outside_client_attaches_over_tcp(tmp_path):
    """A job without a client script (4 ranks: scheduler, serving rank, 2 workers over mpi://) also listens on
    tcp:// and writes a scheduler file. A separate process runs a graph, disconnects, connects again; a client
    killed mid-graph leaves the cluster serving; a last client shuts it down and the job exits 0."""
    import signal
    import time

    sched = tmp_path / "sched.json"
    cmd = [sys.executable, "-m", "loom.cli", "dask", "run", "-n", "4", "--timeout", "400", "--tcp", "127.0.0.1:0",
           "--scheduler-file", str(sched)]
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, **ENV}, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while not sched.exists() and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert sched.exists(), job.communicate(timeout=30)[0] if job.poll() is not None else "no scheduler file"
        first = _outside(sched, "graph")
        assert first.returncode == 0 and "OUTSIDE OK" in first.stdout, first.stdout + first.stderr
        hang = subprocess.Popen([sys.executable, "tests/mpi/outside_dask_client.py", str(sched), "hang"],
                                stdout=subprocess.PIPE, text=True, env={**os.environ, **ENV})
        assert hang.stdout.readline().strip() == "SUBMITTED"
        hang.kill()
        hang.wait()
        again = _outside(sched, "graph")
        assert again.returncode == 0 and "OUTSIDE OK" in again.stdout, again.stdout + again.stderr
        last = _outside(sched, "shutdown")
        assert last.returncode == 0 and "SHUTTING DOWN" in last.stdout, last.stdout + last.stderr
        out = job.communicate(timeout=180)[0]
        assert job.returncode == 0, out
        assert "tcp://127.0.0.1:" in out and "serving outside clients" in out, out
    finally:
        if job.poll() is None:
            os.killpg(job.pid, signal.SIGKILL)
            job.wait()


def test_bench_dask_small_end_to_end(tmp_path):
    """`loom bench dask` at toy sizes: both comm tables and the applications, whose results it checks to be
    equal over mpi:// and tcp:// (it raises otherwise), in the JSON it writes."""
    out = tmp_path / "d.json"
    argv = [sys.executable, "-m", "loom.cli", "bench", "dask", "-M", "128K", "-i", "20", "-x", "5",
            "--iterations-large", "5", "--warmup-large", "2", "--rounds", "1", "--array", "400", "--chunk", "100",
            "--rows", "4000", "--partitions", "2", "--app-rounds", "1", "--tasks", "20", "--order", "tcp,mpi",
            "--cycles", "1", "--json", str(out)]
    proc = launch.run(4, argv, timeout=240, env={**ENV, "LOOM_LAUNCHED": "1"}, capture=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    assert [r["Size"] for r in doc["latency"]][:2] == [1, 2] and doc["latency"][-1]["Size"] == 131072
    assert all(r["mpi (us)"] > 0 and r["tcp (us)"] > 0 for r in doc["latency"])
    assert all(r["loom.comm (MB/s)"] > 0 and r["mpi/loom.comm"] > 0 for r in doc["bandwidth"])  # raw reference
    assert all(r["2 bufs (MB/s)"] > 0 and r["mpi/2 bufs"] > 0 for r in doc["bandwidth"])  # ... with a comm's buffers
    assert {r["Application"] for r in doc["apps"]} == {"(x + x.T).sum()", "dataframe merge", "tiny tasks"}
    assert "tcp cluster first" in proc.stdout
    assert all(r["mpi cpu (s)"] > 0 and r["tcp cpu (s)"] > 0 for r in doc["apps"])
