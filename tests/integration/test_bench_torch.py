"""``loom bench torch`` runs end to end on 2 ranks at small sizes and reports every row for both backends and raw
mpi4py (nothing is asserted about time); ``--codec`` adds DDP rows under a dp codec whose bytes on the wire fall.
``loom bench launchers`` runs each launcher's route and says how each world was made."""

import pytest

from loom.testing import run_bench

pytestmark = pytest.mark.mpi


def test_bench_torch_small(tmp_path):
    # width 128: DDP's bucket (~130 KiB) is above the codecs' 64 KiB minimum, so int8 really compresses it
    doc, text = run_bench(tmp_path, "torch", "--size", "256K", "-w", "128", "-d", "2", "-i", "20",
                          "--iterations-large", "2", "-x", "1", "--rounds", "1", "--codec", "int8", "--breakdown",
                          timeout=300)
    assert "loom vs gloo" in text and "DDP under a dp codec" in text
    tests = [r["Test"] for r in doc["rows"]]
    assert tests == ["allreduce 1 B", "allreduce 256 KiB", "reduce_scatter 256 KiB", "DDP step", "FSDP2 step"]
    for row in doc["rows"]:
        assert row["loom"] > 0 and row["gloo"] > 0 and row["loom/gloo"] == pytest.approx(row["loom"] / row["gloo"])
        if row["Test"].startswith(("allreduce", "reduce_scatter")):  # raw mpi4py on the same buffers beside them
            assert row["raw"] > 0 and row["loom/raw"] == pytest.approx(row["loom"] / row["raw"])
        else:
            assert row["raw"] == "-"
    layers = [r["Layer"] for r in doc["meta"]["breakdown"]]
    assert layers[0] == "raw mpi4py, numpy view" and layers[-1] == "dist.all_reduce, loom" and len(layers) == 5
    assert all(r["us"] > 0 for r in doc["meta"]["breakdown"])
    rows = {r["Test"]: r for r in doc["meta"]["ddp_codecs"]}
    assert list(rows) == ["DDP gloo", "DDP loom", "DDP loom int8"]
    plain, coded = rows["DDP loom"], rows["DDP loom int8"]
    assert plain["raw_bytes_per_step"] == coded["raw_bytes_per_step"] > 0
    # uncompressed, the wire carries the gradients (plus DDP's bucket-order broadcast of the first step)
    assert plain["wire_bytes_per_step"] == pytest.approx(plain["raw_bytes_per_step"], rel=1e-3)
    assert coded["wire_bytes_per_step"] < 0.35 * coded["raw_bytes_per_step"]  # int8: ~1/4 of float32, plus scales
    assert rows["DDP gloo"]["loss"] == plain["loss"]  # same sums at 2 ranks: the same training
    assert coded["loss"] != plain["loss"] and abs(coded["gap_pct"]) < 1  # compressed, and still training alike


def test_bench_launchers_small(tmp_path):
    doc, text = run_bench(tmp_path, "launchers", "--size", "256K", "-i", "20", "--iterations-large", "2", "-x", "1",
                          "--rounds", "1", timeout=300)
    rows = {r["Route"]: r for r in doc["rows"]}
    assert list(rows) == ["mpiexec", "torchrun", "mp.spawn"], text
    assert rows["mpiexec"]["world"] == "from the MPI launcher"
    assert rows["torchrun"]["world"] == rows["mp.spawn"]["world"] == "formed through the store"
    for row in rows.values():
        assert row["1 B loom (us)"] > 0 and row["bw raw (GB/s)"] > 0
