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
