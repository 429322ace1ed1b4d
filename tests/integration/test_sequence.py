"""`loom bench seqlen` end to end (the exactness checks of tests/mpi/check_sequence.py run from the table in
tests/checks.py)."""

import pytest

from loom.testing import ROOT

pytestmark = pytest.mark.mpi


def _seqlen(tmp_path, *args: str, timeout: float):
    """``loom bench seqlen ARGS --json PATH`` on its own ranks: the JSON document and the finished process (which
    must have exited 0)."""
    import json
    import subprocess
    import sys

    out = tmp_path / "seqlen.json"
    cmd = [sys.executable, "-m", "loom.cli", "bench", "seqlen", *args, "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(out.read_text()), proc


def test_bench_seqlen_smoke(tmp_path):
    """`loom bench seqlen` end to end on 2 ranks with a tiny model: FPDT fits a longer sequence than Ulysses.
    ``--offload-checkpoints`` adds the Ulysses row with its block inputs on the host: every input goes out and
    comes back once (bytes exact), and the memory model's longest lengths and factor stand beside the measured."""
    doc, proc = _seqlen(tmp_path, "--ranks", "2", "--layers", "2", "--hidden", "16", "--heads", "2", "--kv-heads",
                        "1", "--vocab", "500", "--budget", "400K", "--chunk", "16", "--attn-chunk", "32",
                        "--no-breakdown", "--repeats", "1", "--max-seq", "768", "--offload-checkpoints", timeout=180)
    res = doc["meta"]["results"]
    assert list(res) == ["ulysses", "ulysses, ckpt on host", "+ offload (FPDT)"], res
    uly, host, fpdt = res["ulysses"], res["ulysses, ckpt on host"], res["+ offload (FPDT)"]
    assert all(r["peak"] <= 400 * 1024 for r in res.values()), res
    assert fpdt["max_seq"] >= 4 * uly["max_seq"], res
    assert fpdt["to_host"] > 0 and fpdt["to_device"] > 0
    inputs = 2 * (host["max_seq"] // 2) * 16 * 4  # 2 blocks' fp32 inputs of seq / 2 tokens x hidden 16
    assert host["to_host"] == host["to_device"] == inputs and uly["to_host"] == 0, res
    ck = doc["meta"]["offload_checkpoints"]
    assert uly["model_seq"] > 0 and host["model_seq"] > 0, res
    assert ck["measured_factor"] == host["max_seq"] / uly["max_seq"], ck
    assert ck["model_factor"] == host["model_seq"] / uly["model_seq"], ck
    assert doc["columns"][-2:] == ["Model seq", "Model gain"] and "# checkpoint offload: longest Ulysses" in proc.stdout


def test_bench_seqlen_ring_smoke(tmp_path):
    """`loom bench seqlen --ring 2` on 4 ranks with 2 heads (Ulysses stops at sp = 2): the plain rows run at
    sp = 2 x dp = 2, the FPDT x ring 2 row at sp = 4, every row within the budget, times per token reported."""
    doc, proc = _seqlen(tmp_path, "--ranks", "4", "--ring", "2", "--layers", "1", "--hidden", "16", "--heads", "2",
                        "--kv-heads", "1", "--vocab", "500", "--budget", "400K", "--chunk", "16", "--attn-chunk",
                        "32", "--no-breakdown", "--repeats", "1", "--max-seq", "512", timeout=300)
    res, ring = doc["meta"]["results"], doc["meta"]["ring"]
    assert list(res) == ["ulysses", "+ offload (FPDT)", "FPDT x ring 2"], res
    assert all(r["peak"] <= 400 * 1024 for r in res.values()), res
    assert res["FPDT x ring 2"]["max_seq"] >= res["+ offload (FPDT)"]["max_seq"] > res["ulysses"]["max_seq"], res
    assert res["FPDT x ring 2"]["max_seq"] % (4 * 16) == 0
    assert (ring["sp"], ring["sp_plain"], ring["dp_plain"]) == (4, 2, 2), ring
    assert set(ring["us_per_token"]) == {"+ offload (FPDT)", "FPDT x ring 2"}, ring
    assert "sp=2 x dp=2" in doc["meta"]["ranks"] and "FPDT x ring 2 at sp=4" in proc.stdout
    assert ring["model"] == {} and "memory model: not compared" in proc.stdout  # --chunk differs from --attn-chunk


def test_bench_seqlen_ring_scales_at_one_head_as_the_memory_model_says(tmp_path):
    """`loom bench seqlen --ranks 2 --ring 2 --heads 1`: FPDT x ring 2 at sp = 2 reaches >= 1.8x (0.9 x ring) the
    longest sequence of FPDT on one rank at the same per-rank budget, and the memory model's peak of each row at
    its longest length (the loom train config of the same model: --chunk = --attn-chunk) is within 10 % of the
    measured one. Memory only: the times of ranks sharing cores are not asserted."""
    doc, _ = _seqlen(tmp_path, "--ranks", "2", "--ring", "2", "--layers", "1", "--hidden", "16", "--heads", "1",
                     "--kv-heads", "1", "--vocab", "500", "--budget", "400K", "--chunk", "32", "--attn-chunk", "32",
                     "--no-breakdown", "--repeats", "1", "--max-seq", "2048", timeout=300)
    ring = doc["meta"]["ring"]
    assert (ring["sp"], ring["sp_plain"], ring["dp_plain"]) == (2, 1, 2), ring
    assert ring["longest_ratio"] >= 1.8, ring
    assert set(ring["model"]) == {"+ offload (FPDT)", "FPDT x ring 2"}, ring
    assert all(abs(m["error"]) <= 0.10 for m in ring["model"].values()), ring["model"]
