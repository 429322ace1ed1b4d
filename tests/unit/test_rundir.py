"""A run directory belongs to one run: ``loom train`` refuses another run's directory (exit 2), ``--overwrite``
clears it, ``--resume`` checks the config, pruning keeps the current step, resolution takes complete steps
only, and ``loom generate`` says when a file is not a loom checkpoint."""

from __future__ import annotations

import pickle

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
    assert _train(tmp_path, "--train.steps=2", "--dry-run") == 2  # the dry run refuses it too
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
