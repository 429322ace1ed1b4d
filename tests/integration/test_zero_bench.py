"""``loom bench zero`` and ``loom bench hybrid`` run end to end on 2 ranks and report what they measured (small
sizes; nothing is asserted about time)."""


import sys

import pytest

from loom.comm import launch
from loom.testing import run_bench

pytestmark = pytest.mark.mpi


def _run(tmp_path, *argv):
    return run_bench(tmp_path, *argv, timeout=400)


def test_bench_zero(tmp_path):
    doc, text = _run(tmp_path, "zero", "--budget", "2M", "--width", "32", "--peer-width", "64", "--peer-depth", "2",
                     "-i", "1", "-x", "1", "--rounds", "1")
    assert "ZeRO Capacity" in text and "torch FSDP2" in text and "torch DDP" in text
    cap = doc["capacity"]["results"]
    assert cap["stage 3"]["blocks"] > cap["dp (stage 0)"]["blocks"]  # sharding fits a deeper model
    assert all(r["peak"] <= 2 * 2**20 for r in cap.values())
    modes = [r["Mode"] for r in doc["fsdp2"]]  # loom stage 3 in both progress modes (auto's marked), FSDP2 x 2
    assert modes[2:] == ["torch FSDP2 (gloo)", "torch FSDP2 (loom)"]
    assert [m.split(",")[0].rstrip(")") for m in modes[:2]] == ["loom stage 3 (hooks", "loom stage 3 (thread"]
    assert sum(", auto)" in m for m in modes) == 1
    for mode in ("hooks", "thread"):  # each row ran its mode; reduce-scatters posted during backward in both
        assert doc["zero_last_step"][mode]["progress"] == mode, doc["zero_last_step"]
        assert doc["zero_last_step"][mode]["posted_in_backward"] >= 1, doc["zero_last_step"]
    modes = [r["Mode"] for r in doc["ddp"]]  # loom dp in both progress modes (the one auto picks marked), DDP x 2
    assert modes[2:] == ["torch DDP (gloo)", "torch DDP (loom)"]
    assert [m.split(",")[0].rstrip(")") for m in modes[:2]] == ["loom dp (hooks", "loom dp (thread"]
    assert sum(", auto)" in m for m in modes) == 1
    for mode in ("hooks", "thread"):  # reductions launched during backward, not after it
        assert doc["dp_last_step"][mode]["posted_in_backward"] >= 1, doc["dp_last_step"]
    # The speedup columns hold the peer's step time over the row's (> 1: faster than the peer); the peer is torch's
    # engine over the loom backend (the same transport as loom's rows).
    for key, peer, col in (("fsdp2", "torch FSDP2 (loom)", "speedup-vs-FSDP2"),
                           ("ddp", "torch DDP (loom)", "speedup-vs-DDP")):
        rows = {r["Mode"]: r for r in doc[key]}
        assert rows[peer][col] == 1.0
        for r in rows.values():
            assert r[col] == pytest.approx(rows[peer]["Step(ms)"] / r["Step(ms)"], rel=1e-9), (key, r)


def test_bench_zero_refuses_more_peer_ranks_than_the_job_once():
    proc = launch.run(2, [sys.executable, "-m", "loom.cli", "bench", "zero", "--peer-ranks", "4"], timeout=120,
                      env={"LOOM_LAUNCHED": "1"}, capture=True)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("--peer-ranks 4 must be between 2 and the job's 2 ranks; run with --ranks 4") == 1, (
        proc.stderr)


def test_bench_hybrid_picks_micro_batches_and_runs_ddp(tmp_path):
    doc, text = _run(tmp_path, "hybrid", "-w", "32", "-d", "2", "-i", "1", "-x", "1", "--rounds", "1")
    modes = {r["Mode"]: r for r in doc["rows"]}
    assert set(modes) == {"dp", "pipeline", "torch DDP"}
    assert modes["dp"]["Micro"] in (1, 2, 4, 8) and modes["torch DDP"]["dpMB/step"] == "-"
