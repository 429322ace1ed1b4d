"""The OMB-style comm benchmarks run end to end on 2 ranks, loom and raw mpi4py in one table (tiny sizes)."""


import pytest

from loom.testing import run_bench

pytestmark = pytest.mark.mpi

QUICK = ["-M", "16", "-i", "4", "-x", "1", "--rounds", "1"]


@pytest.mark.parametrize("bench,column", [
    ("latency", "Latency (us)"), ("bw", "Bandwidth (MB/s)"), ("bibw", "Bandwidth (MB/s)"),
    ("allreduce", "Latency (us)"), ("allgather", "Latency (us)"), ("alltoall", "Latency (us)"),
    ("alltoallv", "Latency (us)"),
])
def test_bench_table_against_raw(tmp_path, bench, column):
    doc, _ = run_bench(tmp_path, bench, *QUICK)
    unit = column[column.index("("):]
    assert doc["columns"] == ["Size", column, f"raw mpi4py {unit}", "loom/raw"]
    assert doc["rows"] and doc["rows"][-1]["Size"] == 16
    for row in doc["rows"]:
        loom, raw = row[column], row[f"raw mpi4py {unit}"]
        assert loom > 0 and raw > 0
        assert row["loom/raw"] == pytest.approx(loom / raw)
