"""The GPU tier (``make test-gpu``): loom on a real CUDA device, skipped where torch sees none.

Two ranks share the machine's GPU(s) (each binds ``cuda:local_rank % device_count``). The rank-side checks are
``check_comm_cuda.py``, ``check_train_cuda.py`` and ``check_zero_cuda.py`` in this folder; ``scripts/gpu_check.py``
runs as one process.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from loom.testing import ROOT, assert_all_checks_passed, run_bench, run_ranks

pytestmark = [pytest.mark.cuda, pytest.mark.mpi]


def test_comm_on_cuda_tensors():
    script = "tests/gpu/check_comm_cuda.py"
    assert_all_checks_passed(run_ranks(2, script, timeout=180), script)


def _train_checks(*names: str, timeout: float) -> None:
    """The named checks of ``check_train_cuda.py`` (and its cleanup) on 2 ranks, each reporting PASS."""
    names = (*names, "check_cleanup")
    proc = run_ranks(2, "tests/gpu/check_train_cuda.py", timeout=timeout, env={"LOOM_ONLY": ",".join(names)})
    missing = [n for n in names if f"PASS {n} " not in proc.stdout]
    assert not missing, f"checks that did not report PASS: {missing}\n{proc.stdout}"


def test_train_meshes_on_cuda_match_cpu():
    _train_checks("check_meshes_on_cuda_match_cpu", timeout=360)


def test_train_checkpoints_move_between_devices():
    _train_checks("check_resume_on_cuda_equals_uninterrupted", "check_cuda_checkpoint_loads_on_cpu", timeout=180)


def test_zero_stages_on_cuda_match_cpu():
    script = "tests/gpu/check_zero_cuda.py"
    assert_all_checks_passed(run_ranks(2, script, timeout=300), script)


def test_gpu_check_script():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_check.py")], capture_output=True, text=True,
                          timeout=180, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("PASS ") + proc.stdout.count("SKIP ") == 5, proc.stdout


def test_zero_capacity_on_the_cuda_allocator(tmp_path):
    """``loom bench zero --device cuda`` at 4 ranks sharing the GPU: every stage measured on the CUDA allocator
    within the budget, and sharding fits more (the issue's goal, stage 3 >= 3.5x dp, is the benchmark's, not
    asserted here; `bash scripts/gpu_session.sh` measures it). Last in the tier: the least urgent."""
    doc, text = run_bench(tmp_path, "zero", "--device", "cuda", "--skip", "peers", "--budget", "64M", "--width",
                          "256", ranks=4, timeout=150)
    assert "CUDA allocator peak on cuda:" in text, text
    cap = doc["capacity"]["results"]
    assert all(0 < r["peak"] <= 64 * 2**20 for r in cap.values()), cap
    assert cap["stage 3"]["params"] > 2 * cap["dp (stage 0)"]["params"], cap
