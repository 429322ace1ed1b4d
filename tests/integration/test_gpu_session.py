"""The GPU session rehearsed on this machine (``scripts/gpu_session.sh --rehearse``): every step runs end to end
with CUDA replaced by the CPU and sizes shrunk, and numba hidden as if the GPU machine's python lacked it.

Checked: every step of the plan wrote its summary line (``train`` one per mesh); nothing failed; the step the
rehearsal stops at its limit (``seqlen-p1``) still left its JSON with the lengths found; the hidden module is
reported as a skip naming it, by the import check and by the mesh that needs it, while the others ran."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from loom.testing import ROOT

pytestmark = pytest.mark.mpi


def test_rehearsal_writes_every_summary_line(tmp_path):
    out = tmp_path / "gpu-out"
    env = {**os.environ, "OUT": str(out), "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    plan = subprocess.run(["bash", "scripts/gpu_session.sh", "--rehearse", "--dry-run"], capture_output=True,
                          text=True, timeout=60, cwd=ROOT, env=env)
    steps = re.findall(r"^(\S+)\s+\d+s\s+(?:planned|extra)", plan.stdout, flags=re.M)
    meshes = re.findall(r"^  (train:\S+)$", plan.stdout, flags=re.M)
    assert "seqlen-p1" in steps and meshes, plan.stdout
    proc = subprocess.run(["bash", "scripts/gpu_session.sh", "--rehearse", "--hide", "numba"], capture_output=True,
                          text=True, timeout=420, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    lines = [ln.split("\t") for ln in (out / "summary.tsv").read_text().splitlines()[1:]]
    rows = {r[0]: r for r in lines}
    expected = [s for s in steps if s != "train"]
    assert sorted(rows) == sorted(expected + meshes), (sorted(rows), proc.stdout[-3000:])
    assert all(len(r) == 5 for r in lines), lines
    failed = [r for r in lines if r[1] not in ("ok", "skip", "timeout")]
    assert not failed, (failed, proc.stdout[-4000:])
    # stopped at its limit, with the lengths it had found written
    assert rows["seqlen-p1"][1] == "timeout" and rows["seqlen-p1"][4].startswith("partial: "), rows["seqlen-p1"]
    doc = json.loads((out / "seqlen-p1.json").read_text())
    assert doc["meta"]["partial"] and doc["meta"]["probes"]["ulysses"]["longest_fit"] > 0, doc["meta"]
    assert rows["seqlen-p2"][1] == "ok" and "x" in rows["seqlen-p2"][4]
    meta = json.loads((out / "seqlen-p2.json").read_text())["meta"]  # the search stopped at --max-ratio 17
    assert not meta["partial"] and meta["search_cap"] <= 17 * meta["results"]["ulysses"]["max_seq"], meta
    assert meta["results"]["+ offload (FPDT)"]["max_seq"] <= meta["search_cap"], meta
    # the hidden module: named by the import check, a skip for the mesh that needs it, the other meshes ran
    assert "numba" in rows["prepare"][4].partition("missing: ")[2].split(", "), rows["prepare"]
    assert rows["train:ep-moe-multipath"][1:2] == ["skip"] and "numba" in rows["train:ep-moe-multipath"][4]
    assert all(rows[m][1] == "ok" for m in meshes if m not in ("train:ep-moe-multipath", "train:hf-llama-sp"))
    # pytest steps leave JUnit; the benchmarks their JSON
    assert (out / "test-fpdt.xml").exists() and (out / "zero-cuda.json").exists()
    assert rows["allreduce-fp32"][1] == "ok" and "ratio" in rows["allreduce-fp32"][4]
