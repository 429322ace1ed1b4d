"""``loom train`` as whole jobs: bad configs exit 2 on every rank with one line and no traceback, a SIGKILLed
rank takes the job down, after which --resume continues, Ctrl-C (SIGINT) or SIGTERM stops the whole job with
one line and no process left, and a run directory is held by its run (a second run is refused, a dead run's
lock is taken over). Mesh parity and resume: tests/mpi/check_train.py, run from the table in tests/checks.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from loom.comm import launch
from loom.testing import ROOT
from loom.train import checkpoint as ckpt
from tests.jobs import TINY, train_job

pytestmark = pytest.mark.mpi

_MOE = ["--model.ffn=moe", "--model.experts=2", "--model.top_k=1", "--mesh.ep=2", "--multipath.enabled=true"]


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("override, words", [
    ("--model.hiden=64", ["unknown key model.hiden", "valid keys in [model]: layers, hidden"]),
    ("--mesh.sp_ring=3", ["mesh.sp_ring = 3 does not divide mesh.sp = 2", "choose sp_ring among [1, 2]"]),
    # the mesh, not the batch of 4 it does not divide either
    ("--mesh.dp=3", ["mesh dp=3", "= 3 ranks but the job has 2; launch with --ranks 3"]),
    ("--data.glob=*.nothing", ["has no readable files matching data.glob = '*.nothing'"]),
    ("--multipath.topology=h100", ["multipath.topology = 'h100' (it routes the experts' all-to-allv over mesh.ep = 2",
                                   "has 16 ranks but the job has 2"]),
])
def test_bad_config_exits_2_on_every_rank(tmp_path, override, words):
    """Once per job, no traceback, and with --overwrite the previous run in the directory is left as it was."""
    extra = ["--mesh.sp=2"] if "sp_ring" in override else _MOE if "topology" in override else []
    ckpt.save(ckpt.stage_path(tmp_path / "checkpoints", 2), {"format": ckpt.FORMAT, "step": 2, "stages": 1})
    (tmp_path / "metrics.jsonl").write_text('{"kind": "step", "step": 2}\n')
    before = _tree(tmp_path)
    proc = train_job(2, f"--train.out={tmp_path}", "--overwrite", *extra, override, timeout=120)
    assert _tree(tmp_path) == before
    assert proc.returncode == 2, proc.stdout + proc.stderr
    # Once per job: rank 0 prints, the other rank exits 2 in silence (the launcher's exit code is the ranks').
    assert proc.stderr.count("loom train: error: ") == 1, proc.stderr
    msg = proc.stderr.split("loom train: error: ", 1)[1]
    for w in words:
        assert w in msg, (w, msg)
    assert "Traceback" not in proc.stderr + proc.stdout


def _loom(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "loom.cli", *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.parametrize("args", [
    ["train", "--ranks", "2", "--config", TINY, "--model.nope=1", "--train.out={tmp}"],
    ["bench", "bw", "--ranks", "2", "--no-such-flag"],
])
def test_usage_error_is_printed_once_per_job(tmp_path, args):
    proc = _loom(*(a.format(tmp=tmp_path) for a in args))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [ln for ln in proc.stderr.splitlines() if ": error:" in ln]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr


# ---------------------------------------------------------------------------------------------- interrupts
LONG = ["--train.steps=100000", "--checkpoint.every=2", "--checkpoint.keep=2", "--train.eval_every=0",
        "--train.progress=lines", "--train.plots=false"]


def _job_processes(marker: str) -> list[str]:
    """Command lines of this user's processes that belong to the job of run directory ``marker``."""
    found = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and int(d.name) != os.getpid():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmd:
                found.append(f"{d.name}: {cmd[:160]}")
    return found


def _start(cmd: list[str], out: Path, logs: Path, ready=None) -> subprocess.Popen:
    """Start a long run in its own session (as a shell starts a foreground job) with output to files; return
    once ``ready()`` (default: a checkpoint is written and the run directory is locked)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen(cmd, env=env, stdout=open(logs / "out", "w"), stderr=open(logs / "err", "w"), text=True,
                            start_new_session=True)
    ready = ready or (lambda: ckpt.latest(out / "checkpoints") is not None and (out / ckpt.LOCK).exists())
    deadline = time.monotonic() + 600  # a hang bound: start-up alone can take minutes on a busy machine
    while not ready():
        assert proc.poll() is None, f"job ended before it was under way:\n{(logs / 'err').read_text()}"
        assert time.monotonic() < deadline, "not under way within 600 s"
        time.sleep(0.2)
    return proc


def _stop(proc: subprocess.Popen, sig: int, out: Path | str, logs: Path, code: int | None = None) -> str:
    """Send ``sig`` to the job's foreground process group (what a terminal's Ctrl-C does); returns its stderr
    once it has ended with exit code ``code`` (default 128 + ``sig``), with nothing of the job left."""
    os.killpg(proc.pid, sig)
    try:
        proc.wait(timeout=120)  # a hang bound, not a speed check (the grace period is launch.GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    left = _job_processes(str(out))
    for _ in range(50):  # processes killed by the launcher may take a moment to be reaped
        if not left:
            break
        time.sleep(0.1)
        left = _job_processes(str(out))
    for pid in [int(line.split(":")[0]) for line in left]:
        os.kill(pid, signal.SIGKILL)  # after recording them: the assertions below report them
    assert proc.returncode is not None, f"the job still runs 120 s after {signal.Signals(sig).name}"
    assert not left, f"left running after {signal.Signals(sig).name}: {left}"
    assert proc.returncode == (128 + sig if code is None else code), (proc.returncode, (logs / "err").read_text())
    return (logs / "err").read_text()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the job's processes through /proc")
def test_ctrl_c_stops_a_ranks_job_a_busy_directory_is_refused_and_a_dead_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "run"
    job = _start([sys.executable, "-m", "loom.cli", "train", "--ranks", "2", "--config", TINY, f"--train.out={out}",
                  *LONG], out, tmp_path)
    holder = json.loads((out / ckpt.LOCK).read_text())
    # A second run into the busy directory, even one that would delete it, is refused on every rank.
    second = _loom("train", "--ranks", "2", "--config", TINY, f"--train.out={out}", "--overwrite", "--train.steps=2")
    assert second.returncode == 2, second.stdout + second.stderr
    assert second.stderr.count("loom train: error: ") == 1, second.stderr
    assert f"{out} is in use by another run (pid {holder['pid']} on host {holder['host']}" in second.stderr
    assert "--train.out" in second.stderr and "Traceback" not in second.stderr, second.stderr
    err = _stop(job, signal.SIGINT, out, tmp_path)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines == ["loom train: interrupted by SIGINT; stopped its 2-rank job"], err
    # The newest complete checkpoint loads; a lock left by a rank killed mid-collective would be a dead run's,
    # so plant one explicitly: --resume takes it over and continues from that checkpoint.
    step = ckpt.latest(out / "checkpoints")
    assert ckpt.load(ckpt.stage_path(out / "checkpoints", step))["step"] == step
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / ckpt.LOCK).write_text(json.dumps({"host": holder["host"], "pid": dead.pid, "started": None}))
    res = train_job(2, f"--train.out={out}", *LONG, "--resume", f"--train.steps={step + 2}", timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"took over the lock of a run that is gone (pid {dead.pid}" in res.stdout, res.stdout
    assert f"resumed from {out / 'checkpoints'} at step {step}" in res.stdout, res.stdout
    assert ckpt.latest(out / "checkpoints") == step + 2 and not (out / ckpt.LOCK).exists()


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the job's processes through /proc")
@pytest.mark.parametrize("how, sig", [("ranks", signal.SIGTERM), ("mpiexec", signal.SIGINT)])
def test_signal_stops_the_job_with_one_line_and_no_traceback(tmp_path, how, sig):
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "loom.cli", "train", "--config", TINY, f"--train.out={out}", *LONG]
    cmd = [*argv[:4], "--ranks", "2", *argv[4:]] if how == "ranks" else launch.mpiexec_argv(2, argv)
    # Open MPI's prterun takes a plain mpiexec's Ctrl-C itself: it kills the ranks, drops what they were still
    # writing and exits 1. Nothing is left and nothing is a traceback; the line and the code are its own.
    prterun = how == "mpiexec" and launch.is_openmpi(launch.mpiexec())
    err = _stop(_start(cmd, out, tmp_path), sig, out, tmp_path, code=1 if prterun else None)
    name = signal.Signals(sig).name
    ours = [ln for ln in err.splitlines() if ln.startswith("loom ")]
    tail = "stopped its 2-rank job" if how == "ranks" else "stopped"
    line = f"loom train: interrupted by {name}; {tail}"
    assert ours in ([], [line]) if prterun else ours == [line], err
    assert "Traceback" not in err + (tmp_path / "out").read_text(), err
    step = ckpt.latest(out / "checkpoints")
    assert ckpt.load(ckpt.stage_path(out / "checkpoints", step))["step"] == step


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the job's processes through /proc")
def test_ctrl_c_stops_any_ranks_command(tmp_path):
    """Not only `loom train`: a benchmark under --ranks stops alike (its ranks were left running before)."""
    marker = tmp_path / "bench.json"  # names the job's processes on their command lines
    cmd = [sys.executable, "-m", "loom.cli", "bench", "latency", "--ranks", "2", "-m", "1", "-M", "1M",
           "--rounds", "100000", "--max-seconds", "1000", "--json", str(marker)]
    job = _start(cmd, marker, tmp_path, ready=lambda: "# Size" in (tmp_path / "out").read_text())
    err = _stop(job, signal.SIGINT, marker, tmp_path)
    assert [ln for ln in err.splitlines() if ln.strip()] == [
        "loom bench: interrupted by SIGINT; stopped its 2-rank job"], err


_DEAF_RANK = "import signal, sys, time; signal.signal(signal.SIGINT, signal.SIG_IGN); print('up', flush=True); " \
             "time.sleep(600)  # {marker}"
_DRIVER = """
import sys
from loom.comm import launch
try:
    launch.run(2, [sys.executable, "-c", {rank!r}])
except launch.Interrupted as exc:
    print("interrupted", exc.signum, flush=True)
    sys.exit(7)
"""


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds the job's processes through /proc")
def test_ranks_that_ignore_the_signal_are_killed_after_the_grace_period(tmp_path):
    """launch.run itself: ranks that ignore SIGINT (a rank stuck in C code cannot take it either) are killed
    after launch.GRACE_S, and the caller gets Interrupted with nothing of the job left."""
    marker = str(tmp_path / "deaf")
    driver = _DRIVER.format(rank=_DEAF_RANK.format(marker=marker))
    job = _start([sys.executable, "-c", driver], tmp_path, tmp_path,
                 ready=lambda: (tmp_path / "out").read_text().count("up") == 2)
    err = _stop(job, signal.SIGINT, marker, tmp_path, code=7)
    assert "interrupted 2" in (tmp_path / "out").read_text() and "Traceback" not in err, err
