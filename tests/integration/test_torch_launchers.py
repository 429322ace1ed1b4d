"""``init_process_group("loom")`` under every launcher a torch user has, each run checked against a one-process
reference (tests/mpi/torch_launchers.py): torchrun and ``mp.spawn`` (``tcp://``, ``file://``, an explicit store),
whose processes form their MPI world through torch's store; mpiexec with MASTER_ADDR/MASTER_PORT exported (a
SLURM batch script's habit), whose rank and size come from MPI. And the bad input: a store's world size that is
not MPI's raises on every rank instead of hanging; under Open MPI (``make test-openmpi``), whose processes cannot
join a world they were not launched in, torchrun and ``mp.spawn`` are refused on every rank by name."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from loom.comm import launch
from loom.testing import ROOT

SCRIPT = str(ROOT / "tests" / "mpi" / "torch_launchers.py")
BIN = Path(sys.executable).parent


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("LOOM_LAUNCHED", "MASTER_ADDR", "MASTER_PORT", "RANK",
                                                              "WORLD_SIZE")}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", **extra)
    return env


def _port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def _ok(proc: subprocess.CompletedProcess, n: int, how: str) -> None:
    out = proc.stdout + proc.stderr
    if how == "formed through the store" and launch.library_flavor() == launch.OPENMPI:
        # Open MPI takes its world from PMIx only: the processes stay singletons, refused by name on every rank
        assert proc.returncode != 0, out
        assert "Only MPICH joins processes it did not launch" in out, out  # mp.spawn shows the first rank's error
        assert "loom run --ranks" in out and "mpiexec -n" in out, out
        return
    assert proc.returncode == 0, out
    for r in range(n):
        assert f"OK rank {r}/{n} world={how}" in proc.stdout, out


def test_torchrun_processes_form_one_mpi_world():
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", _port(),
            SCRIPT, "env"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=_env(), cwd=ROOT)
    _ok(proc, 2, "formed through the store")


@pytest.mark.parametrize("method,n", [("tcp", 3), ("file", 2), ("store", 2)])
def test_mp_spawn_with_every_init_method(method, n):
    proc = subprocess.run([sys.executable, SCRIPT, "spawn", method, str(n)], capture_output=True, text=True,
                          timeout=180, env=_env(), cwd=ROOT)
    _ok(proc, n, "formed through the store")


@pytest.mark.mpi
def test_mpiexec_with_master_exported_takes_rank_and_size_from_mpi():
    proc = launch.run(2, [sys.executable, SCRIPT, "env"], timeout=180, capture=True,
                      env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=_port()))
    _ok(proc, 2, "from the MPI launcher")


@pytest.mark.mpi
def test_a_store_world_size_that_is_not_mpis_raises_on_every_rank():
    proc = launch.run(2, [sys.executable, SCRIPT, "env"], timeout=120, capture=True,
                      env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=_port(), WORLD_SIZE="3"))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert out.count("WORLD_SIZE=3, but the MPI launcher made this rank") == 2, out
