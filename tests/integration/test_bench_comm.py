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


def test_latency_of_tensors_against_raw_numpy(tmp_path):
    """``--buffer torch --vs raw-numpy``: loom's tensors against raw mpi4py's fastest path (numpy arrays) in one
    table, the peer named in the column and the metadata."""
    doc, _ = run_bench(tmp_path, "latency", "--buffer", "torch", "--vs", "raw-numpy", *QUICK)
    assert doc["columns"] == ["Size", "Latency (us)", "raw mpi4py numpy (us)", "loom/raw"]
    assert doc["meta"]["buffer"] == "torch" and doc["meta"]["peer"] == "raw mpi4py numpy"
    for row in doc["rows"]:
        assert row["loom/raw"] == pytest.approx(row["Latency (us)"] / row["raw mpi4py numpy (us)"])


@pytest.mark.parametrize("bench,dtype", [("allreduce", "float32"), ("allreduce", "bfloat16"),
                                         ("alltoall", "bfloat16"), ("allgather", "float32")])
def test_device_against_host(tmp_path, bench, dtype):
    """``--device cpu`` runs the device-vs-host table end to end (on a GPU machine: ``--device cuda``)."""
    doc, _ = run_bench(tmp_path, bench, "--device", "cpu", "--dtype", dtype, "--vs", "none", *QUICK)
    assert doc["columns"] == ["Size", "cpu Latency (us)", "host Latency (us)", "cpu/host"]
    assert doc["meta"]["device"] == "cpu" and doc["meta"]["peer"] == "host Latency"
    assert doc["meta"]["dtype"] == dtype
    assert doc["rows"] and doc["rows"][-1]["Size"] == 16
    for row in doc["rows"]:
        dev, host = row["cpu Latency (us)"], row["host Latency (us)"]
        assert dev > 0 and host > 0
        assert row["cpu/host"] == pytest.approx(dev / host)


def test_allreduce_device_rejects_an_unknown_device(capsys):
    from loom.bench import comm

    with pytest.raises(SystemExit) as e:
        comm.allreduce(["--device", "gpu"])
    assert e.value.code == 2
    assert "'gpu' is not a device; use cpu, cuda or cuda:N" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        comm.allreduce(["--dtype", "bfloat16"])
    assert e.value.code == 2
    assert "--dtype bfloat16 needs --device" in capsys.readouterr().err
