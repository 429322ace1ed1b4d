"""A run directory belongs to one run: ``loom train`` refuses another run's directory (exit 2), ``--overwrite``
clears it, ``--resume`` checks the config and needs a checkpoint, a live run's lock refuses a second run and a
dead run's lock is taken over, pruning keeps the current step, resolution takes complete steps only, and
``loom generate`` says when a file is not a loom checkpoint. (The same as whole jobs at 2 ranks:
tests/integration/test_train_jobs.py.)"""

from __future__ import annotations

import json
import os
import pickle
import socket
import subprocess
import sys

import pytest
import torch

from loom.train import checkpoint as ckpt
from loom.train.config import config_to_dict, load_config

TINY = ["--model.layers=1", "--model.hidden=16", "--model.heads=2", "--model.kv_heads=1", "--data.seq_len=16",
        "--data.batch=2", "--data.max_bytes=20000", "--train.eval_every=0", "--train.progress=none",
        "--train.plots=false", "--checkpoint.every=1", "--checkpoint.keep=2"]


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    torch.set_num_threads(1)
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)


def _train(out, *args: str) -> int:
    from loom.train.cli import main

    return main([*TINY, f"--train.out={out}", *args])


def _steps(out) -> list[int]:
    return sorted(int(p.name[5:11]) for p in (out / "checkpoints").glob("step_*.stage0.pt"))


def test_new_run_refuses_a_used_directory_then_overwrite_clears_it(tmp_path, capsys):
    assert _train(tmp_path, "--train.steps=4") == 0
    assert _steps(tmp_path) == [3, 4]
    capsys.readouterr()
    assert _train(tmp_path, "--train.steps=2") == 2  # the case: a shorter run after a longer one
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for word in ("already holds another run", "step 3, 4", "metrics.jsonl", "--resume", "--train.out", "--overwrite"):
        assert word in err, (word, err)
    assert _steps(tmp_path) == [3, 4]  # untouched
    assert _train(tmp_path, "--train.steps=2", "--dry-run") == 0  # a dry run writes nothing: it plans ...
    assert "run directory: occupied; the run itself would exit 2" in capsys.readouterr().out  # ... and says so
    assert _train(tmp_path, "--train.steps=2", "--overwrite") == 0
    assert _steps(tmp_path) == [1, 2]  # the stale steps 3 and 4 are gone, the new run's newest kept
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2, lines
    assert _train(tmp_path, "--resume", "--overwrite") == 2


def test_resume_checks_the_config_apart_from_resumable_keys(tmp_path, capsys):
    assert _train(tmp_path, "--train.steps=2") == 0
    capsys.readouterr()
    assert _train(tmp_path, "--train.steps=3", "--resume", "--optim.lr=0.01") == 2
    err = capsys.readouterr().err
    assert "optim.lr: checkpoint 0.003 vs config 0.01" in err and "Traceback" not in err, err
    # how long, how often and where may change
    assert _train(tmp_path, "--train.steps=3", "--resume", "--checkpoint.keep=3", "--train.log_every=2") == 0
    assert _steps(tmp_path) == [1, 2, 3]


def test_config_changes_ignores_resumable_and_missing_keys():
    a = config_to_dict(load_config(None, ["--train.steps=5"]))
    b = config_to_dict(load_config(None, ["--train.steps=9", "--mesh.dp=1", "--compress.policy=hybrid"]))
    assert ckpt.config_changes(a, b) == ["compress.policy: checkpoint 'none' vs config 'hybrid'"]
    del a["compress"]["policy"]  # written before the key existed
    assert ckpt.config_changes(a, b) == []


def _fake_step(d, step: int, stage: int, stages: int) -> None:
    ckpt.save(ckpt.stage_path(d, step, stage), {"format": ckpt.FORMAT, "step": step, "stages": stages})


def test_prune_never_deletes_the_current_step(tmp_path):
    for step in (150, 200):  # a stale, longer run
        _fake_step(tmp_path, step, 0, 1)
    for step in (10, 20, 30):
        _fake_step(tmp_path, step, 0, 1)
        ckpt.prune(tmp_path, keep=2, current=step)
    assert ckpt.latest(tmp_path) == 200  # newer steps are never touched ...
    left = sorted(int(p.name[5:11]) for p in tmp_path.glob("step_*"))
    assert left == [20, 30, 150, 200], left  # ... and the current one is always kept


def test_resolve_takes_the_newest_complete_step(tmp_path):
    for stage in (0, 1):
        _fake_step(tmp_path, 4, stage, 2)
    _fake_step(tmp_path, 6, 0, 2)  # stage 1 of step 6 never written
    assert [p.name for p in ckpt.resolve(tmp_path)] == ["step_000004.stage0.pt", "step_000004.stage1.pt"]
    (tmp_path / "step_000004.stage1.pt").unlink()
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        ckpt.resolve(tmp_path)


@pytest.mark.parametrize("content", [b"hello\n", pickle.dumps({"a": 1}), b""])
def test_generate_on_a_foreign_file_says_so(tmp_path, capsys, content):
    from loom.train.generate import main

    bad = tmp_path / "model.pt"
    bad.write_bytes(content)
    assert main(["--checkpoint", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"loom generate: error: {bad} is not a loom train checkpoint"), err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    with pytest.raises(ValueError, match="is not a loom train checkpoint"):
        ckpt.load(bad)


def test_resume_without_a_checkpoint_exits_2_naming_the_fix(tmp_path, capsys):
    assert _train(tmp_path / "empty", "--train.steps=2", "--resume") == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"no checkpoint in {tmp_path / 'empty' / 'checkpoints'}" in err, err
    assert "drop --resume to start a new run" in err and not (tmp_path / "empty").exists(), err


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _write_lock(out, pid: int, host: str | None = None) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / ckpt.LOCK).write_text(json.dumps({"host": host or socket.gethostname(), "pid": pid, "started": None}))


def test_a_live_runs_lock_refuses_a_second_run_and_a_dead_runs_lock_is_taken_over(tmp_path, capsys):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _write_lock(tmp_path, holder.pid)
        for flags in ((), ("--overwrite",), ("--dry-run",)):
            rc = _train(tmp_path, "--train.steps=1", *flags)
            out, err = capsys.readouterr()
            if flags == ("--dry-run",):  # a dry run takes no lock: it plans and names the holder
                assert rc == 0 and f"in use by another run (pid {holder.pid} on host" in out, out
                continue
            assert rc == 2 and err.count("\n") == 1, err
            for word in (f"is in use by another run (pid {holder.pid} on host {socket.gethostname()}",
                         str(tmp_path / ckpt.LOCK), "--train.out"):
                assert word in err, (word, err)
        assert not (tmp_path / "checkpoints").exists()  # --overwrite deleted nothing of the live run
    finally:
        holder.kill()
        holder.wait()
    _write_lock(tmp_path, holder.pid)  # its process is gone now: the lock is stale
    assert _train(tmp_path, "--train.steps=1") == 0
    assert f"took over the lock of a run that is gone (pid {holder.pid}" in capsys.readouterr().out
    assert not (tmp_path / ckpt.LOCK).exists()  # released at the end of the run
    _write_lock(tmp_path, os.getpid(), host="another-host.invalid")  # another host: cannot tell, so refused
    assert _train(tmp_path, "--train.steps=2", "--resume") == 2
    err = capsys.readouterr().err
    assert "this host cannot see whether it still runs" in err and f"delete {tmp_path / ckpt.LOCK}" in err, err


def test_lock_is_exclusive_and_released_only_by_its_holder(tmp_path):
    lock, stale = ckpt.lock_run_dir(tmp_path)
    assert stale is None and json.loads(lock.read_text())["pid"] == os.getpid()
    with pytest.raises(ckpt.RunDirError, match="in use by another run"):
        _write_lock(tmp_path, os.getppid())  # a live process of this host holds it (this test's parent)
        ckpt.lock_run_dir(tmp_path)
    ckpt.unlock_run_dir(lock)  # not ours any more: left alone
    assert (tmp_path / ckpt.LOCK).exists()
    _write_lock(tmp_path, _dead_pid())
    lock, stale = ckpt.lock_run_dir(tmp_path)
    assert stale is not None and json.loads(lock.read_text())["pid"] == os.getpid()
    ckpt.unlock_run_dir(lock)
    assert not lock.exists()
