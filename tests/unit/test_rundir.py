"""A run directory belongs to one run: ``loom train`` refuses another run's directory (exit 2), ``--overwrite``
clears it, but only once every check has passed (a refused run leaves the previous one byte for byte, and a
failed start no directory of its own), ``--resume`` checks the config and needs a checkpoint (ZeRO 2-3 shards
of another tp size are refused), a resumed longer run keeps its learning-rate schedule and says so, a live
run's lock refuses a second run and a dead run's lock is taken over, pruning keeps the current step,
resolution takes complete steps only, and ``loom generate`` says when a file is not a loom checkpoint. (The
same as whole jobs at 2 ranks: tests/integration/test_train_jobs.py.)"""

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


# ---------------------------------------------------------------------------------------------- nothing destroyed
def _tree(root) -> dict[str, str]:
    """Every file under ``root`` by relative path, with the SHA-256 of its bytes."""
    import hashlib

    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def _previous_run(tmp_path_factory):
    """A finished run (checkpoints of steps 1 and 2, metrics) to copy into each case's directory."""
    out = tmp_path_factory.mktemp("previous") / "run"
    torch.set_num_threads(1)
    assert _train(out, "--train.steps=2") == 0
    return out


# Each setting the dry run reports; with --overwrite the run used to delete the previous run, then refuse. (A
# bad topology under MoE needs ep ranks: tests/integration/test_train_jobs.py, with the same checks on 2 ranks.)
NOT_DESTROYED = [
    (["--compress.policy=bogus"], "compress.policy = 'bogus': unknown compression preset", None),
    (["--data.path={tmp}/nonexistent"], "is neither a file nor a directory", None),
    (["--data.glob=*.nothing"], "has no readable files matching data.glob = '*.nothing'", None),
    (["--train.device=cuda"], "train.device = 'cuda' but torch sees no CUDA device", None),
    (["--multipath.topology=bogus"], "multipath.topology = 'bogus': give 'auto', a TOML file or a preset", None),
    (["--model.hf={tmp}/nonexistent"], "model.hf = '", None),
    # a run outside a launcher is one rank; a dry run there plans the mesh configured (whose batch is too small)
    (["--mesh.dp=3"], "mesh dp=3 x pp=1 x sp=1 x ep=1 = 3 ranks but the job has 1; launch with --ranks 3",
     "data.batch = 2 is not divisible by mesh.dp = 3"),
]


@pytest.mark.parametrize("flags, words, dry_words", NOT_DESTROYED,
                         ids=[" ".join(case[0]).split("=")[0] for case in NOT_DESTROYED])
def test_overwrite_destroys_nothing_when_the_run_then_refuses(tmp_path, capsys, _previous_run, flags, words,
                                                              dry_words):
    import shutil

    if "--train.device=cuda" in flags and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    out = tmp_path / "run"
    shutil.copytree(_previous_run, out)
    before = _tree(out)
    capsys.readouterr()
    flags = [f.format(tmp=tmp_path) for f in flags]
    assert _train(out, "--train.steps=2", "--overwrite", *flags) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("loom train: error: ") and words in err, err
    assert _tree(out) == before  # byte for byte: the previous run is all there
    if "--model.hf" in flags:
        assert "model.hf_config" not in err.split(":", 3)[2], err  # the setting given is the one named
    # The dry run reports the same: a wrong setting as the same error, what this machine lacks after its plan.
    rc = _train(out, "--train.steps=2", *flags, "--dry-run")
    reported = capsys.readouterr()
    assert (dry_words or words) in reported.out + reported.err, reported
    assert rc == 2 or "this machine cannot run it as configured" in reported.err, (rc, reported)
    # A new run directory is not even made.
    assert _train(tmp_path / "new" / "run", "--train.steps=2", *flags) == 2 and not (tmp_path / "new").exists()


def test_a_start_that_fails_leaves_no_directory_it_made(tmp_path, capsys, monkeypatch):
    """What only the ranks find (here a trainer that refuses to build): the lock was taken, the directory made;
    both are gone again, and an existing run directory with --overwrite keeps every file."""
    from loom.train import trainer
    from loom.train.config import ConfigError

    def refuse(self, *args, **kwargs):
        raise ConfigError("the trainer refuses")

    monkeypatch.setattr(trainer.Trainer, "__init__", refuse)
    assert _train(tmp_path / "a" / "b", "--train.steps=1") == 2
    assert "loom train: error: the trainer refuses" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "kept").mkdir()
    (tmp_path / "kept" / "metrics.jsonl").write_text('{"kind": "step", "step": 1}\n')
    before = _tree(tmp_path / "kept")
    assert _train(tmp_path / "kept", "--train.steps=1", "--overwrite") == 2
    assert _tree(tmp_path / "kept") == before and not (tmp_path / "kept" / ckpt.LOCK).exists()


# ---------------------------------------------------------------------------------------------- resume semantics
def _lrs(out) -> dict[int, float]:
    return {r["step"]: r["lr"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
            if r.get("kind") == "step"}


def test_a_longer_resumed_run_keeps_the_learning_rate_continuous(tmp_path, capsys):
    from loom.train.trainer import lr_at

    sched = ["--optim.warmup=1", "--optim.lr=0.01", "--optim.min_lr=0.001", "--train.progress=lines"]
    assert _train(tmp_path, "--train.steps=3", *sched) == 0
    first = load_config(None, [*sched, "--train.steps=3"])
    assert _train(tmp_path, "--train.steps=5", "--resume", *sched) == 0
    out = capsys.readouterr().out
    lrs = _lrs(tmp_path)
    # The cosine ended at step 3: the rate stays at min_lr instead of climbing back (lr_at with train.steps 5).
    assert lrs[4] == lrs[5] == pytest.approx(lr_at(3, first)) == pytest.approx(0.001), lrs
    lines = [ln for ln in out.splitlines() if ln.startswith("learning rate:")]
    assert lines == [f"learning rate: train.steps = 5 but the schedule keeps the checkpoint's horizon of 3 steps, so "
                     f"it continues at 1.00e-03 (min_lr 1.00e-03 from step 3); --optim.decay_steps=5 would stretch "
                     f"it: {lr_at(3, load_config(None, [*sched, '--train.steps=5'])):.2e} at step 3"], out
    # The horizon travels with the checkpoint: a third run continues the same schedule; asked for, it changes.
    assert _train(tmp_path, "--train.steps=6", "--resume", *sched, "--optim.decay_steps=8") == 0
    out = capsys.readouterr().out
    horizon8 = load_config(None, [*sched, "--train.steps=6", "--optim.decay_steps=8"])
    assert f"learning rate: optim.decay_steps = 8 replaces the checkpoint's horizon of 3 steps: 1.00e-03 -> " \
           f"{lr_at(5, horizon8):.2e} at step 5" in out, out
    assert _lrs(tmp_path)[6] == pytest.approx(lr_at(5, horizon8))
    assert ckpt.load(ckpt.stage_path(tmp_path / "checkpoints", 6))["lr_horizon"] == 8


def _zero_checkpoint(ckpt_dir, tp: int) -> None:
    """A ZeRO-2 run's stage file of step 2 at ``mesh.tp = tp`` (its shard directories are not read)."""
    cfg = load_config(None, [*TINY, "--model.kv_heads=2", f"--mesh.tp={tp}", "--mesh.dp=1", "--zero.stage=2"])
    ckpt.save(ckpt.stage_path(ckpt_dir, 2), {"format": ckpt.FORMAT, "step": 2, "stages": 1, "zero": "step_000002.zero",
                                            "config": config_to_dict(cfg)})


@pytest.mark.parametrize("then, now", [(2, 1), (1, 2)])
def test_resuming_zero_2_3_at_another_tp_is_refused_naming_it(tmp_path, capsys, monkeypatch, then, now):
    _zero_checkpoint(tmp_path / "checkpoints", then)
    before = _tree(tmp_path)
    words = f"with mesh.tp = {then} and this run has mesh.tp = {now}"
    if now == 1:  # a real start on this one process: refused before anything is held
        assert _train(tmp_path, "--train.steps=4", "--resume", "--zero.stage=2", "--model.kv_heads=2") == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and words in err and f"resume with --mesh.tp={then}" in err, err
    else:  # a 2-rank job's dry run (the launcher's variables): its plan says what the run would refuse
        monkeypatch.setenv("PMI_SIZE", "2")
        monkeypatch.setenv("PMI_RANK", "0")
        assert _train(tmp_path, "--train.steps=4", "--resume", "--zero.stage=2", "--model.kv_heads=2", "--mesh.tp=2",
                      "--dry-run") == 0
        out = capsys.readouterr().out
        assert "the run itself would exit 2: --resume: " in out and words in out, out
    assert _tree(tmp_path) == before
