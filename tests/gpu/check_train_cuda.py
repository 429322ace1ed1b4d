"""Rank-side checks of ``loom train`` on CUDA (``make test-gpu``; 2 ranks may share one GPU).

Every mesh trains three steps on ``cuda`` and on ``cpu`` from the same seed in fp32 with TF32 off; the losses
and gradient norms must agree to ``LOSS_RTOL`` / ``NORM_RTOL`` relative (only kernels and summation order differ;
the compression policy quantizes, so its bound is wider). A CUDA run interrupted after step 1 and resumed equals
the uninterrupted one; a checkpoint written on CUDA holds only host tensors, resumes on the CPU and loads into
``loom generate`` on either device.
"""

from __future__ import annotations

import math
import os
import shutil

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


def _meshes(comm) -> list[tuple[str, dict, float]]:
    p = comm.size
    out = [("dp", {"mesh": {"dp": p}}, LOSS_RTOL),
           ("sp ulysses", {"mesh": {"sp": p}}, LOSS_RTOL),
           ("sp fpdt offload", {"mesh": {"sp": p}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
            LOSS_RTOL),
           ("pp", {"mesh": {"pp": p}, "data": {"micro_batches": 2}}, LOSS_RTOL),
           ("ep moe", {**MOE, "mesh": {"ep": p}}, LOSS_RTOL),
           ("ep moe multipath", {**MOE, "mesh": {"ep": p},
                                 "multipath": {"enabled": True, "topology": "shm", "min_bytes": 0}}, LOSS_RTOL),
           ("dp hybrid compression", {"mesh": {"dp": p}, "compress": {"policy": "hybrid", "min_kb": 0}},
            COMPRESSED_RTOL),
           ("dp zero 1", {"mesh": {"dp": p}, "zero": {"stage": 1}}, LOSS_RTOL),
           ("dp zero 2", {"mesh": {"dp": p}, "zero": {"stage": 2}}, LOSS_RTOL),
           ("dp zero 3", {"mesh": {"dp": p}, "zero": {"stage": 3}}, LOSS_RTOL)]
    path = tiny_hf_llama(comm, _dir(comm, "llama.json"))
    if path is None:
        return out
    out.append(("hf llama sp", {"model": {"hf_config": path}, "mesh": {"sp": p}}, LOSS_RTOL))
    return out


def _cfg(device: str, *parts: dict):
    return train_config(BASE, GPU, *parts, {"train": {"device": device}})


_ROOT = SharedDir("loom-gpu-")
_dir = _ROOT.path


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol)


def check_meshes_on_cuda_match_cpu(comm):
    bad = []
    for name, extra, rtol in _meshes(comm):
        cpu = Trainer(_cfg("cpu", extra), comm, out=_dir(comm, f"{name}-cpu"), quiet=True).run()
        tr = Trainer(_cfg("cuda", extra), comm, out=_dir(comm, f"{name}-cuda"), quiet=True)
        assert tr.device.type == "cuda" and all(p.is_cuda for p in tr.params), name
        gpu = tr.run()
        for c, g in zip(cpu, gpu):
            if not (_close(c["loss"], g["loss"], rtol) and _close(c["grad_norm"], g["grad_norm"], 10 * rtol)):
                bad.append((name, c["step"], c["loss"], g["loss"], c["grad_norm"], g["grad_norm"]))
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


if __name__ == "__main__":
    mpi_checks(globals())
