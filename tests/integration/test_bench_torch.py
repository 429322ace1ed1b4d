"""``loom bench torch`` runs end to end on 2 ranks at small sizes and reports every row for both backends
(nothing is asserted about time)."""

import pytest

from loom.testing import run_bench

pytestmark = pytest.mark.mpi


def test_bench_torch_small(tmp_path):
    doc, text = run_bench(tmp_path, "torch", "--size", "256K", "-w", "32", "-d", "2", "-i", "20",
                          "--iterations-large", "2", "-x", "1", "--rounds", "1", timeout=300)
    assert "loom vs gloo" in text
    tests = [r["Test"] for r in doc["rows"]]
    assert tests == ["allreduce 1 B", "allreduce 256 KiB", "reduce_scatter 256 KiB", "DDP step", "FSDP2 step"]
    for row in doc["rows"]:
        assert row["loom"] > 0 and row["gloo"] > 0 and row["loom/gloo"] == pytest.approx(row["loom"] / row["gloo"])
