"""``loom run --ranks N SCRIPT [ARGS]`` (the "loom" torch.distributed backend's launcher): a script's arguments are
its own, torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE are set, a rank that raises ends the job
with its traceback, a rank whose script exits non-zero ends the job with its code and one line, more ranks than
cores says so, ``LOOM_CHECK=1`` turns a shape mismatch across ranks into the same error on every rank, and a
missing script is one usage error (exit 2). Each test is one job."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom.testing import ROOT

SCRIPT = """
import os, sys, torch, torch.distributed as dist
torchrun = [int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")]  # as torchrun sets
dist.init_process_group("loom")
r = dist.get_rank()
mode = sys.argv[1]
if mode == "raise" and r == 1:
    raise RuntimeError("rank one fails on purpose")
if mode in ("exit", "hard-exit") and r == 1:  # its peer is in an all_reduce with it: torchrun's agent ends the job
    sys.exit(3) if mode == "exit" else os._exit(3)
x = torch.ones(2 + (r if mode == "mismatch" else 0), dtype=torch.float64) * (r + 1)
dist.all_reduce(x)
print(f"rank {r} of {dist.get_world_size()}: {x.tolist()} argv {sys.argv[1:]} env {torchrun}", flush=True)
dist.destroy_process_group()
"""


def _loom_run(tmp_path, *args: str, env: dict | None = None, timeout: float = 120,
              ranks: int = 2) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    argv = [sys.executable, "-m", "loom.cli", "run", "--ranks", str(ranks), str(script), *args]
    full = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    full.pop("LOOM_LAUNCHED", None)
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env=full, cwd=ROOT)


def test_script_gets_its_arguments_and_the_job_reduces(tmp_path):
    proc = _loom_run(tmp_path, "ok", "-n", "5")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    for r in (0, 1):
        assert f"rank {r} of 2: [3.0, 3.0] argv ['ok', '-n', '5'] env [{r}, 2, {r}, 2]" in proc.stdout, out


def test_a_rank_that_raises_ends_the_job(tmp_path):
    proc = _loom_run(tmp_path, "raise")
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert "[rank 1] RuntimeError: rank one fails on purpose" in proc.stderr, out
    assert "rank 0 of 2" not in proc.stdout, out


def test_loom_check_names_a_mismatch_on_every_rank(tmp_path):
    proc = _loom_run(tmp_path, "mismatch", env={"LOOM_CHECK": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    for r in (0, 1):
        assert f"[rank {r}] loom.comm.errors.CollectiveMismatchError: loom check mode: allreduce" in out, out
    assert "(2,)" in out and "(3,)" in out, out


def test_missing_script_is_one_usage_error(tmp_path):
    argv = [sys.executable, "-m", "loom.cli", "run", "--ranks", "2", str(tmp_path / "absent.py")]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("is not a file") == 1, proc.stderr


def test_a_rank_that_exits_non_zero_ends_the_job_with_its_code(tmp_path):
    proc = _loom_run(tmp_path, "exit", timeout=60)  # it hung in MPI_Finalize, waiting for its peer
    out = proc.stdout + proc.stderr
    assert proc.returncode == 3, out
    assert proc.stderr.count("loom run: rank 1 exited with code 3; ending its 2-rank job") == 1, out
    assert "rank 0 of 2" not in proc.stdout, out


def test_a_rank_that_leaves_by_os_exit_ends_the_job(tmp_path):
    proc = _loom_run(tmp_path, "hard-exit", timeout=60)
    assert proc.returncode != 0 and "rank 0 of 2" not in proc.stdout, proc.stdout + proc.stderr


@pytest.mark.skipif((os.cpu_count() or 1) > 4, reason="needs more ranks than cores without a large job")
def test_more_ranks_than_cores_says_timings_are_oversubscribed(tmp_path):
    ranks = (os.cpu_count() or 1) + 1
    proc = _loom_run(tmp_path, "ok", ranks=ranks)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr.count(f"loom run: {ranks} ranks on {os.cpu_count()} cores") == 1, proc.stderr
