"""Rank-side checks of ``loom train`` on CUDA (``make test-gpu``; 2 ranks may share one GPU).

Every mesh trains three steps on ``cuda`` and on ``cpu`` from the same seed in fp32 with TF32 off; the losses
and gradient norms must agree to ``LOSS_RTOL`` / ``NORM_RTOL`` relative (only kernels and summation order differ;
the compression policy quantizes, so its bound is wider). A CUDA run interrupted after step 1 and resumed equals
the uninterrupted one; a checkpoint written on CUDA holds only host tensors, resumes on the CPU and loads into
``loom generate`` on either device.

``scripts/gpu_session.py`` runs the meshes one by one instead, each reported on a line of its own
(``MESH <name> ok|fail|skip <seconds> <figure>``) so that one failing mesh does not hide the others::

    python tests/gpu/check_train_cuda.py --meshes dp,pp [--device cpu]     # under mpiexec, 2 ranks

(``--device cpu`` compares the CPU with itself: the session's rehearsal on a machine without a GPU.)
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import time

import torch

from loom.testing import mpi_checks
from loom.train.trainer import Trainer
from tests.jobs import SharedDir, tiny_hf_llama, train_config
from tests.mpi.check_train import BASE, MOE

torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

LOSS_RTOL = 1e-4
NORM_RTOL = 1e-3
COMPRESSED_RTOL = 2e-2

# The CPU check's job (tests/mpi/check_train.py), wider and in fp32: what the GPU kernels run with TF32 off.
GPU = {"model": {"hidden": 64}, "data": {"seq_len": 64}, "train": {"steps": 3, "dtype": "float32", "eval_every": 3},
       "optim": {"warmup": 1, "lr": 1e-3}, "checkpoint": {"every": 1}}


MESHES = ("dp", "sp-ulysses", "sp-fpdt-offload", "pp", "ep-moe", "ep-moe-multipath", "dp-hybrid", "dp-zero1",
          "dp-zero2", "dp-zero3", "hf-llama-sp")
"""The meshes in the order the GPU session runs them (``--meshes`` names)."""


def _mesh(comm, name: str) -> tuple[dict, float]:
    """Mesh ``name``'s config overrides and loss tolerance; raises ``ModuleNotFoundError`` naming a module the
    mesh needs that this python lacks (the multi-path planner compiles with numba; the hf mesh needs
    transformers), so that the caller reports a skip, not a failure."""
    p = comm.size
    if name == "ep-moe-multipath":
        import numba  # noqa: F401  (the planner's rounds; imported here so a missing one is named up front)
    meshes = {
        "dp": ({"mesh": {"dp": p}}, LOSS_RTOL),
        "sp-ulysses": ({"mesh": {"sp": p}}, LOSS_RTOL),
        "sp-fpdt-offload": ({"mesh": {"sp": p}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
                            LOSS_RTOL),
        "pp": ({"mesh": {"pp": p}, "data": {"micro_batches": 2}}, LOSS_RTOL),
        "ep-moe": ({**MOE, "mesh": {"ep": p}}, LOSS_RTOL),
        "ep-moe-multipath": ({**MOE, "mesh": {"ep": p},
                              "multipath": {"enabled": True, "topology": "shm", "min_bytes": 0}}, LOSS_RTOL),
        "dp-hybrid": ({"mesh": {"dp": p}, "compress": {"policy": "hybrid", "min_kb": 0}}, COMPRESSED_RTOL),
        "dp-zero1": ({"mesh": {"dp": p}, "zero": {"stage": 1}}, LOSS_RTOL),
        "dp-zero2": ({"mesh": {"dp": p}, "zero": {"stage": 2}}, LOSS_RTOL),
        "dp-zero3": ({"mesh": {"dp": p}, "zero": {"stage": 3}}, LOSS_RTOL),
    }
    if name == "hf-llama-sp":
        path = tiny_hf_llama(comm, _dir(comm, "llama.json"))
        if path is None:
            raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
        return {"model": {"hf_config": path}, "mesh": {"sp": p}}, LOSS_RTOL
    if name not in meshes:
        raise ValueError(f"unknown mesh {name!r}; choose from {', '.join(MESHES)}")
    return meshes[name]


def _cfg(device: str, *parts: dict):
    return train_config(BASE, GPU, *parts, {"train": {"device": device}})


_ROOT = SharedDir("loom-gpu-")
_dir = _ROOT.path


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol)


def compare_mesh(comm, name: str, device: str = "cuda") -> tuple[list[tuple], float, float]:
    """Train mesh ``name`` on the CPU and on ``device`` from the same seed: the steps whose loss or gradient norm
    differ beyond the mesh's tolerance, and the largest relative differences of loss and norm over the steps."""
    extra, rtol = _mesh(comm, name)
    cpu = Trainer(_cfg("cpu", extra), comm, out=_dir(comm, f"{name}-cpu"), quiet=True).run()
    tr = Trainer(_cfg(device, extra), comm, out=_dir(comm, f"{name}-on-{device}"), quiet=True)
    assert tr.device.type == device and all(p.device.type == device for p in tr.params), name
    gpu = tr.run()
    bad, d_loss, d_norm = [], 0.0, 0.0
    for c, g in zip(cpu, gpu):
        d_loss = max(d_loss, abs(c["loss"] - g["loss"]) / max(abs(c["loss"]), 1e-30))
        d_norm = max(d_norm, abs(c["grad_norm"] - g["grad_norm"]) / max(abs(c["grad_norm"]), 1e-30))
        if not (_close(c["loss"], g["loss"], rtol) and _close(c["grad_norm"], g["grad_norm"], 10 * rtol)):
            bad.append((name, c["step"], c["loss"], g["loss"], c["grad_norm"], g["grad_norm"]))
    return bad, d_loss, d_norm


def check_meshes_on_cuda_match_cpu(comm):
    bad = []
    for name in MESHES:
        try:
            bad += compare_mesh(comm, name)[0]
        except ModuleNotFoundError as e:
            if comm.rank == 0:
                print(f"skipped mesh {name}: needs {e.name or e}", flush=True)
    assert not bad, bad


def check_resume_on_cuda_equals_uninterrupted(comm):
    extra = {"mesh": {"dp": comm.size}}
    full = Trainer(_cfg("cuda", extra), comm, out=_dir(comm, "full"), quiet=True).run()
    Trainer(_cfg("cuda", extra), comm, out=_dir(comm, "cut"), quiet=True).run(until=1)
    rest = Trainer(_cfg("cuda", extra), comm, out=_dir(comm, "cut"), quiet=True, resume=True).run()
    assert [r["step"] for r in rest] == [2, 3]
    for a, b in zip(full[1:], rest):
        assert _close(a["loss"], b["loss"], 1e-6), (a["loss"], b["loss"])


def check_cuda_checkpoint_loads_on_cpu(comm):
    from loom.train import checkpoint as ckpt
    from loom.train.generate import load_model

    extra = {"mesh": {"dp": comm.size}}
    gpu = Trainer(_cfg("cuda", extra), comm, out=_dir(comm, "gpu-ckpt"), quiet=True).run()
    comm.barrier()
    cpu_dir = _dir(comm, "cpu-from-gpu")
    if comm.rank == 0:
        os.makedirs(os.path.join(cpu_dir, "checkpoints"))
        src = os.path.join(_dir(comm, "gpu-ckpt"), "checkpoints")
        for f in os.listdir(src):
            if f.startswith("step_000001"):
                shutil.copy(os.path.join(src, f), os.path.join(cpu_dir, "checkpoints", f))
        path = ckpt.stage_path(os.path.join(cpu_dir, "checkpoints"), 1, 0)
        payload = torch.load(path, weights_only=True)  # no map_location: it holds host tensors only
        tensors = list(payload["model"].values()) + [v for st in payload["optim"]["state"].values()
                                                     for v in st.values() if isinstance(v, torch.Tensor)]
        assert tensors and all(t.device.type == "cpu" for t in tensors)
    comm.barrier()
    rest = Trainer(_cfg("cpu", extra), comm, out=cpu_dir, quiet=True, resume=True).run()
    assert [r["step"] for r in rest] == [2, 3]
    for a, b in zip(gpu[1:], rest):
        assert _close(a["loss"], b["loss"], LOSS_RTOL), (a["loss"], b["loss"])
    if comm.rank == 0:
        ck = os.path.join(_dir(comm, "gpu-ckpt"), "checkpoints")
        on_cpu, _, _ = load_model(ck, "cpu")
        on_gpu, _, _ = load_model(ck, "auto")
        assert next(on_cpu.parameters()).device.type == "cpu" and next(on_gpu.parameters()).is_cuda
        x = torch.randint(0, 256, (1, 32), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            a, b = on_cpu(x), on_gpu(x.cuda()).cpu()
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4), float((a - b).abs().max())


def check_cleanup(comm):
    _ROOT.remove(comm)


def run_meshes(comm, names: list[str], device: str) -> None:
    """Each mesh in turn, one line per mesh on rank 0 as it ends: ``MESH name ok|fail|skip seconds figure``.

    A mesh that raises on every rank (a device bug, a wrong value) is reported and the next one runs; a missing
    module is a skip naming it. A mesh that fails on one rank only leaves the other waiting in a collective:
    the session's time limit for the mesh ends the job, and it runs the remaining meshes in a new one."""
    for name in names:
        t0 = time.perf_counter()
        try:
            bad, d_loss, d_norm = compare_mesh(comm, name, device)
            status = "fail" if bad else "ok"
            figure = f"loss rel diff {d_loss:.1e}, grad-norm rel diff {d_norm:.1e}" + (f"; {bad}" if bad else "")
        except ModuleNotFoundError as e:
            status, figure = "skip", f"missing module {e.name or e}"
        except Exception as e:  # reported on its line; the next mesh runs
            status, figure = "fail", f"{type(e).__name__}: {e}".replace("\n", " ")[:300]
        statuses = comm.allgather_object(status)
        if "fail" in statuses and status != "fail":
            status, figure = "fail", f"failed on rank {statuses.index('fail')}"
        if comm.rank == 0:
            print(f"MESH {name} {status} {time.perf_counter() - t0:.1f} {figure}", flush=True)
    _ROOT.remove(comm)


def _args(argv: list[str]):
    p = argparse.ArgumentParser(prog="check_train_cuda.py")
    p.add_argument("--meshes", help=f"comma-separated, from: {','.join(MESHES)} (default: the checks, all meshes)")
    p.add_argument("--device", default="cuda", help="the device compared with the CPU run")
    return p.parse_args(argv)


if __name__ == "__main__":
    opts = _args(sys.argv[1:])
    if opts.meshes:
        from loom.comm import world

        torch.set_num_threads(1)
        run_meshes(world(), opts.meshes.split(","), opts.device)
    else:
        mpi_checks(globals())
