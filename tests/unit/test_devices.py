"""Device binding (``loom.comm.local_device``) and the CPU device-consistency check (``loom.testing.device_check``).

The CUDA side is mocked here (no GPU); ``make test-gpu`` runs it for real (tests/gpu)."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from loom.comm import devices, local_device, local_rank, resolve_device
from loom.testing import DeviceCheckError, device_check
from loom.train import checkpoint as ckpt
from loom.train.trainer import _host_floats

_LAUNCH_VARS = ("PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "MPI_LOCALNRANKS", "OMPI_COMM_WORLD_RANK",
                "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_RANK",
                "PMIX_SIZE", "SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID")


@pytest.fixture
def launcher(monkeypatch):
    for v in _LAUNCH_VARS:
        monkeypatch.delenv(v, raising=False)
    monkeypatch.setattr(devices, "_BOUND", None)
    return monkeypatch


@pytest.mark.parametrize("env, want", [
    ({}, 0),
    ({"PMI_RANK": "5", "PMI_SIZE": "8", "MPI_LOCALRANKID": "1"}, 1),               # MPICH / Hydra
    ({"OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "2"}, 2),
    ({"PMI_RANK": "3", "PMI_SIZE": "4"}, 3),                                           # no local rank: one node
])
def test_local_rank_comes_from_the_launcher(launcher, env, want):
    for k, v in env.items():
        launcher.setenv(k, v)
    assert local_rank() == want


def test_cuda_binds_local_rank_modulo_the_gpus(launcher):
    bound = []
    launcher.setattr(torch.cuda, "is_available", lambda: True)
    launcher.setattr(torch.cuda, "device_count", lambda: 2)
    launcher.setattr(torch.cuda, "set_device", bound.append)
    launcher.setenv("PMI_RANK", "3")
    launcher.setenv("PMI_SIZE", "4")
    launcher.setenv("MPI_LOCALRANKID", "3")
    assert local_device("cuda") == torch.device("cuda", 1)       # 4 local ranks share 2 GPUs
    assert local_device("cuda") == torch.device("cuda", 1) and bound == [torch.device("cuda", 1)]  # bound once
    assert resolve_device("auto") == torch.device("cuda", 1)
    assert local_device("cuda:0") == torch.device("cuda", 0) and bound[-1] == torch.device("cuda", 0)


def test_cpu_and_bad_devices(launcher):
    assert local_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
        with pytest.raises(ValueError, match="torch sees no CUDA device.*use 'cpu'"):
            local_device("cuda")
    with pytest.raises(ValueError, match="'meta'.*'cpu' or 'cuda'"):
        local_device("meta")


def _module(tmp_path, body: str):
    path = tmp_path / "lib_under_check.py"
    path.write_text("import torch\n\n\n" + body)
    spec = importlib.util.spec_from_file_location("lib_under_check", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_device_check_flags_a_factory_without_device_in_library_code(tmp_path):
    mod = _module(tmp_path, "def bad(g):\n    return g + torch.zeros(g.shape)\n\n\n"
                            "def good(g):\n"
                            "    return g + torch.zeros(g.shape, device=g.device) + g.new_zeros(g.shape)\n")
    g = torch.ones(3)
    with device_check(roots=(tmp_path,)):
        assert torch.equal(mod.good(g), g)
        torch.zeros(2)  # this test file is not under the checked roots
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))])  # torch's own factory calls are not checked
        opt.param_groups[0]["params"][0].grad = torch.ones(2)
        opt.step()
        with pytest.raises(DeviceCheckError, match=r"lib_under_check.py:5: torch.zeros\(\) without device="):
            mod.bad(g)
    assert torch.equal(mod.bad(g), g)  # outside the context nothing is checked


def test_host_floats_reads_tensors_once_and_passes_floats():
    assert _host_floats(torch.tensor(1.5), 2.0, torch.tensor([3.0], dtype=torch.float64)) == [1.5, 2.0, 3.0]
    assert _host_floats(4.0) == [4.0]


def test_rng_of_a_cpu_run_has_no_cuda_state():
    state = ckpt.capture_rng(torch.device("cpu"))
    assert "cuda" not in state
    ckpt.restore_rng({**state, "cuda": torch.zeros(8, dtype=torch.uint8)}, torch.device("cpu"))  # ignored on CPU


def test_staged_allreduce_pipelines_pieces_in_order_and_is_exact(monkeypatch):
    """The pipelined staging of a CUDA allreduce, its streams and events faked on the CPU (one rank): every piece's
    copy is queued before MPI starts, each piece's MPI call waits for its own copy, and the values come back
    exactly. The block collectives' pipelines: ``check_staged_block_collectives`` in tests/mpi/check_comm.py."""
    from loom.comm import buffers, world
    from loom.testing import staged_on_host

    monkeypatch.setattr(buffers, "STAGE_PIECE", 64)  # 16 fp32 elements per piece
    comm = world()
    x = torch.randn(10, 10, generator=torch.Generator().manual_seed(0))
    with staged_on_host(comm) as log:
        got = comm.allreduce(x, op="avg")  # avg: a CPU sum would take the host fast path, never a CUDA tensor's
    assert got.dtype == x.dtype and torch.equal(got, x)
    pieces = 7  # 100 elements in pieces of 16
    assert log[:2] == [("wait", "d2h", "cur"), ("wait", "h2d", "cur")]
    assert log[2:2 + pieces] == [("record", "d2h", k) for k in range(pieces)]  # every copy queued before MPI
    assert log[2 + pieces:2 + 3 * pieces] == [e for k in range(pieces) for e in (("host waits", k),
                                                                                  ("mpi", "Allreduce"))]
    assert log[2 + 3 * pieces:] == [("record", "h2d", pieces), ("wait_event", "cur", pieces)]  # on the device
    half = x.to(torch.bfloat16)
    with staged_on_host():
        assert torch.equal(comm.allreduce(half, op="avg"), half)  # widened, reduced, narrowed: exact on 1 rank


def test_staged_alltoall_and_allgather_move_any_dtype_as_bytes():
    """alltoall and allgather of a staged CUDA tensor move bytes, as the host path does: a dtype MPI has no
    element type for (uint16, float8) travels too, in pipelined pieces (streams faked on the CPU, one rank)."""
    from loom.comm import buffers, world
    from loom.testing import staged_on_host

    comm = world()
    for dt in (torch.uint16, torch.float8_e4m3fn):
        assert dt not in buffers._TORCH_MPI
        x = torch.arange(24, dtype=torch.float32).reshape(6, 4).to(dt)
        with staged_on_host(comm) as log:
            a2a, ag = comm.alltoall(x), comm.allgather(x)
        assert ("mpi", "Alltoall") in log and ("mpi", "Allgather") in log
        for got, want in ((a2a, comm.alltoall(x)), (ag, comm.allgather(x))):
            assert got.dtype == dt and torch.equal(got.view(torch.uint8), want.view(torch.uint8))
