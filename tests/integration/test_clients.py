"""Real clients of torch.distributed over loom, against the same run over gloo: PyTorch Lightning's
``DDPStrategy(process_group_backend="loom")`` and ``ModelParallelStrategy`` (FSDP2), processes started by Lightning
itself; accelerate under torchrun. Each trains the same model on the same data on both backends; the final weights
must be bit for bit the same (2 ranks add in one order) and differ from the initial ones. The clients are the
``clients`` extra (``pip install loom[clients]``, which ``make test`` installs); missing, these tests skip."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from loom.testing import ROOT

MPI_DIR = ROOT / "tests" / "mpi"


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_LAUNCHED", "MASTER_ADDR", "MASTER_PORT", "RANK",
                                                              "WORLD_SIZE", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return env


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _same_training(runs: dict) -> None:
    import torch

    loom, gloo = (torch.load(runs[b], weights_only=True) for b in ("loom", "gloo"))
    for name, w in loom["final"].items():
        assert torch.equal(w, gloo["final"][name]), f"{name}: loom and gloo trained to different weights"
        assert not torch.equal(w, loom["start"][name]), f"{name}: did not train"


def _run(argv: list[str], tmp_path, what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=_env(), cwd=tmp_path)
    assert proc.returncode == 0, f"{what}\n{proc.stdout}\n{proc.stderr}"


@pytest.mark.parametrize("strategy", ["ddp", "fsdp2"])
def test_lightning_trains_the_same_over_loom_and_gloo(strategy, tmp_path):
    pytest.importorskip("lightning")
    runs = {}
    for backend in ("loom", "gloo"):
        runs[backend] = tmp_path / f"{backend}.pt"
        _run([sys.executable, str(MPI_DIR / "lightning_job.py"), backend, strategy, str(runs[backend])], tmp_path,
             f"lightning {strategy} over {backend}")
    _same_training(runs)


def test_accelerate_trains_the_same_over_loom_and_gloo(tmp_path):
    pytest.importorskip("accelerate")
    runs = {}
    for backend in ("loom", "gloo"):
        runs[backend] = tmp_path / f"{backend}.pt"
        _run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _port(),
              str(MPI_DIR / "accelerate_job.py"), backend, str(runs[backend])], tmp_path, f"accelerate over {backend}")
    _same_training(runs)
