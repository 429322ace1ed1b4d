"""`loom bench seqlen` end to end (the exactness checks of tests/mpi/check_sequence.py run from the table in
tests/checks.py)."""

import pytest

from loom.testing import ROOT

pytestmark = pytest.mark.mpi


def test_bench_seqlen_smoke(tmp_path):
    """`loom bench seqlen` end to end on 2 ranks with a tiny model: FPDT fits a longer sequence than Ulysses."""
    import json
    import subprocess
    import sys

    out = tmp_path / "seqlen.json"
    cmd = [sys.executable, "-m", "loom.cli", "bench", "seqlen", "--ranks", "2", "--layers", "1", "--hidden", "16",
           "--heads", "2", "--kv-heads", "1", "--vocab", "500", "--budget", "400K", "--chunk", "16",
           "--attn-chunk", "32", "--no-breakdown", "--repeats", "1", "--max-seq", "768", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    res = doc["meta"]["results"]
    uly, fpdt = res["ulysses"], res["+ offload (FPDT)"]
    assert uly["peak"] <= 400 * 1024 and fpdt["peak"] <= 400 * 1024
    assert fpdt["max_seq"] >= 4 * uly["max_seq"], res
    assert fpdt["to_host"] > 0 and fpdt["to_device"] > 0


def test_bench_seqlen_ring_smoke(tmp_path):
    """`loom bench seqlen --ring 2` on 4 ranks with 2 heads (Ulysses stops at sp = 2): the plain rows run at
    sp = 2 x dp = 2, the FPDT x ring 2 row at sp = 4, every row within the budget, times per token reported."""
    import json
    import subprocess
    import sys

    out = tmp_path / "seqlen.json"
    cmd = [sys.executable, "-m", "loom.cli", "bench", "seqlen", "--ranks", "4", "--ring", "2", "--layers", "1",
           "--hidden", "16", "--heads", "2", "--kv-heads", "1", "--vocab", "500", "--budget", "400K", "--chunk",
           "16", "--attn-chunk", "32", "--no-breakdown", "--repeats", "1", "--max-seq", "512", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    doc = json.loads(out.read_text())
    res, ring = doc["meta"]["results"], doc["meta"]["ring"]
    assert list(res) == ["ulysses", "+ offload (FPDT)", "FPDT x ring 2"], res
    assert all(r["peak"] <= 400 * 1024 for r in res.values()), res
    assert res["FPDT x ring 2"]["max_seq"] >= res["+ offload (FPDT)"]["max_seq"] > res["ulysses"]["max_seq"], res
    assert res["FPDT x ring 2"]["max_seq"] % (4 * 16) == 0
    assert (ring["sp"], ring["sp_plain"], ring["dp_plain"]) == (4, 2, 2), ring
    assert set(ring["us_per_token"]) == {"+ offload (FPDT)", "FPDT x ring 2"}, ring
    assert "sp=2 x dp=2" in doc["meta"]["ranks"] and "FPDT x ring 2 at sp=4" in proc.stdout
