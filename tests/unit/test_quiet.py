"""Quiet by default: ``loom.fit`` shows a bar on a terminal or one line per epoch elsewhere, never both;
``loom plan`` writes a file only when asked; the demo's sample is reproduced by the command it prints."""

from __future__ import annotations

import functools
import shlex

import pytest
import torch
from torch import nn

import loom
from loom import tour


def _fit(progress):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(32, 4), torch.randn(32, 1)
    return loom.fit(model, (x, y), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1), epochs=2,
                    batch_size=8, progress=progress)


def test_fit_without_a_terminal_prints_lines_not_a_bar(capsys):
    torch.set_num_threads(1)
    _fit(True)  # pytest's captured stderr is no terminal
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert [ln.split(":")[0] for ln in lines] == ["epoch 1/2", "epoch 2/2"], err
    assert "━" not in err and "\r" not in err and out == ""
    _fit(False)
    assert capsys.readouterr() == ("", "")
    with pytest.raises(ValueError, match="progress='fancy'"):
        _fit("fancy")


def test_plan_writes_a_png_only_when_asked(tmp_path, monkeypatch, capsys):
    from loom.multipath.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["--topology", "testbed", "--no-lp", "--no-sim", "--size", "2M"]) == 0
    assert list(tmp_path.iterdir()) == []
    assert main(["--topology", "testbed", "--no-lp", "--no-sim", "--size", "2M", "--png", "links.png"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["links.png"]


def test_the_demo_sample_is_what_its_printed_command_prints(tmp_path, monkeypatch, capsys):
    from loom.cli import main as loom_main
    from loom.train import cli as train_cli

    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    torch.set_num_threads(1)
    small = ["--model.layers=1", "--model.hidden=16", "--model.heads=2", "--model.kv_heads=1", "--data.seq_len=16",
             "--data.batch=2", "--data.max_bytes=20000", "--train.steps=2", "--train.eval_every=0",
             "--train.progress=none", "--train.plots=false", "--mesh.dp=1", "--mesh.sp=1",
             "--sequence.algorithm=ulysses", "--sequence.chunks=1", "--sequence.offload=false",
             "--compress.policy=none", f"--train.out={tmp_path}"]
    assert train_cli.main(["--config", str(tour.demo_config()), *small]) == 0
    capsys.readouterr()
    tour._sample(small)
    out = capsys.readouterr().out
    head, sample = out.split("):\n", 1)
    command = head.split("reproduce it with: ", 1)[1]
    assert command.startswith("loom generate ")
    assert loom_main(shlex.split(command)[1:]) == 0
    assert capsys.readouterr().out == sample
    assert "--temperature 0.6 --top-k 20" in command  # the demo's sampling, not generate's defaults
