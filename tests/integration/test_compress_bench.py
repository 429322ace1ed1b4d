"""The compression benchmarks run end to end on 2 ranks and report what they measured (small sizes)."""


import pytest

from loom.testing import run_bench

pytestmark = pytest.mark.mpi


def test_bench_allreduce_codec(tmp_path):
    doc, text = run_bench(tmp_path, "compress", "--codec", "int8", "-m", "1K", "-M", "64K", "-i", "5",
                     "--iterations-large", "3", "-x", "1", "--warmup-large", "1", "--rounds", "1")
    assert "# Size" in text and "Compressed Allreduce" in text
    rows = {r["Size"]: r for r in doc["rows"]}
    assert rows[1024]["bytes ratio"] == 1.0  # below min_bytes: uncompressed
    assert rows[65536]["bytes ratio"] == pytest.approx(4 * 64 / 68, rel=0.01)
    assert float(rows[65536]["max rel err"]) < 0.02


def test_bench_compress_train(tmp_path):
    doc, text = run_bench(tmp_path, "compress-train", "--steps", "4", "--tail", "2", "--model", "mlp",
                     "--policies", "none,hybrid,dp=powersgd:rank=2")
    res = {r["policy"]: r for r in doc["meta"]["results"]}
    assert res["none"]["wire_bytes_per_step"] == res["none"]["raw_bytes_per_step"] > 0
    assert res["hybrid"]["wire_bytes_per_step"] * 5 < res["hybrid"]["raw_bytes_per_step"]
    assert res["dp=powersgd:rank=2"]["wire_bytes_per_step"] < res["none"]["wire_bytes_per_step"]
    for r in res.values():
        assert r["heldout_loss"] == r["heldout_loss"] and r["tail_loss"] > 0  # finite
