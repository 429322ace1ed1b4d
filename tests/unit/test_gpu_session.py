"""The GPU session's plan (scripts/gpu_session.py --dry-run): the planned steps fit the session's total by
construction, in the order of value the GPU work needs, every mesh of the GPU tier has a line of its own, and the
rehearsal runs the same steps. (tests/integration/test_gpu_session.py runs the rehearsal.)"""

from __future__ import annotations

import re
import subprocess
import sys

from loom.testing import ROOT

FIRST = ["prepare", "versions", "allreduce-fp32", "allreduce-bf16", "test-fpdt", "train", "seqlen-p2", "seqlen-p1",
         "zero-cuda"]
"""The planned steps' order of value: the 64 MiB allreduce, FPDT's kernels, every mesh, FPDT's length at 2 then 1
rank, ZeRO's capacity (then the rest)."""


def _plan(*args: str) -> tuple[list[tuple[str, int, str, str]], list[str], str]:
    """(name, limit, planned|extra, command) per step, the train step's meshes, and the output."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_session.py"), "--dry-run", *args],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    steps = [(m[1], int(m[2]), m[3], m[4]) for m in
             re.finditer(r"^(\S+)\s+(\d+)s\s+(planned|extra)\s+(.*)$", proc.stdout, flags=re.M)]
    meshes = re.findall(r"^  train:(\S+)$", proc.stdout, flags=re.M)
    return steps, meshes, proc.stdout


def test_planned_limits_add_up_to_at_most_the_total():
    steps, _, out = _plan()
    planned = sum(limit for _, limit, kind, _ in steps if kind == "planned")
    stated = re.search(r"planned (\d+)s of TOTAL=(\d+)s", out)
    assert int(stated[1]) == planned
    from loom.testing import load_checks

    mod, _ = load_checks("scripts/gpu_session.py")  # its constants
    assert planned <= mod.TOTAL, f"the planned steps need {planned}s; the session has {mod.TOTAL}s"
    assert all(limit >= mod.MIN_S for _, limit, _, _ in steps), steps
    # the extras come after every planned step: leftover time only
    kinds = [kind for _, _, kind, _ in steps]
    assert kinds == sorted(kinds, key=lambda k: k == "extra"), kinds


def test_steps_in_order_of_value_and_one_line_per_mesh():
    steps, meshes, _ = _plan()
    names = [s[0] for s in steps]
    assert names[:len(FIRST)] == FIRST, names
    cmd = dict((s[0], s[3]) for s in steps)
    assert "-m 64M -M 64M" in cmd["allreduce-fp32"] and "--dtype bfloat16" in cmd["allreduce-bf16"]
    assert "--device cuda" in cmd["allreduce-fp32"] and "--device cuda" in cmd["zero-cuda"]
    assert "--ranks 2" in cmd["seqlen-p2"] and "--ranks" not in cmd["seqlen-p1"]
    assert all("--max-ratio 17" in cmd[s] for s in ("seqlen-p2", "seqlen-p1")), cmd
    text = (ROOT / "tests" / "gpu" / "check_train_cuda.py").read_text()
    declared = re.findall(r'"([\w-]+)"', re.search(r"^MESHES = \(([^)]*)\)", text, flags=re.M)[1])
    assert meshes == declared and len(meshes) >= 10, meshes


def test_rehearsal_runs_the_same_steps_on_the_cpu():
    steps, meshes, _ = _plan()
    rehearsed, r_meshes, _ = _plan("--rehearse")
    assert [s[0] for s in rehearsed] == [s[0] for s in steps] and r_meshes == meshes
    assert not any("--device cuda" in s[3] for s in rehearsed)
