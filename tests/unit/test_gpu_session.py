"""The GPU session's plan (scripts/gpu_session.py --dry-run): the planned steps fit the session's total by
construction, in the order of value the GPU work needs, every mesh of the GPU tier has a line of its own, and the
rehearsal runs the same steps. (tests/integration/test_gpu_session.py runs the rehearsal.)"""

from __future__ import annotations

import os
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


FAKE_RANKS = """
import sys, time
meshes = sys.argv[sys.argv.index("--meshes") + 1].split(",")
for name in meshes:
    if name == "crash":
        sys.exit(3)
    if name == "hang":
        time.sleep(60)
    print(f"MESH {name} ok 0.1 loss rel diff 0", flush=True)
"""


def test_one_failing_or_hanging_mesh_does_not_stop_the_others(tmp_path, monkeypatch):
    """The train step's job reports each mesh; a mesh that crashes the job or goes silent past MESH_S gets its
    line (fail, timeout) and a new job runs the meshes after it."""
    from loom.testing import load_checks

    mod, _ = load_checks("scripts/gpu_session.py")
    monkeypatch.setattr(mod, "MESH_S", 2)
    monkeypatch.setattr(mod, "GRACE_S", 1)
    ctx = mod.Ctx(py=sys.executable, out=tmp_path, rehearse=True, env=dict(os.environ),
                  summary=tmp_path / "summary.tsv")
    step = mod.Step("train", 60, [sys.executable, "-c", FAKE_RANKS], lambda c, log: "",
                    meshes=["a", "crash", "b", "hang", "c"])
    mod.Session(ctx, 60, set(), set()).run(step)
    rows = [ln.split("\t")[:2] for ln in ctx.summary.read_text().splitlines()]
    assert rows == [["train:a", "ok"], ["train:crash", "fail (3)"], ["train:b", "ok"], ["train:hang", "timeout"],
                    ["train:c", "ok"]], rows
