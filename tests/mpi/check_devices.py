"""Rank-side device-consistency checks: whole ``loom train`` runs inside ``loom.testing.device_check()``.

A tensor the library makes without ``device=`` during a training step is a host tensor on a GPU, and meets the
model's CUDA tensors there (``Trainer.clip`` crashed so at step 1 on every mesh). On the CPU that meeting is legal,
so the check makes the factory call itself an error (see ``device_check``). Every mesh ``loom train`` runs (dp,
sp with Ulysses and with FPDT + offload, pp, ep with MoE with and without ``[multipath]``, the compression
policies, ZeRO stages 1-3, a transformers model when transformers is installed) trains two steps, evaluates,
checkpoints and resumes inside it; the losses are those of the same run without the check (the check changes
no value: equal bit for bit).
"""

from __future__ import annotations

import math
import os

from loom.testing import device_check, mpi_checks
from loom.train.trainer import Trainer
from tests.jobs import SharedDir, tiny_hf_llama, train_config

BASE = {
    "model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2},
    "data": {"seq_len": 32, "batch": 4, "max_bytes": 40_000},
    "train": {"steps": 2, "dtype": "float32", "eval_every": 2, "eval_batches": 1, "progress": "none",
              "plots": False},
    "optim": {"warmup": 1, "lr": 1e-2, "grad_clip": 1e-3},  # a clip that scales: the clip path runs in full
    "checkpoint": {"every": 1},
}
MOE = {"model": {"ffn": "moe", "experts": 4, "top_k": 2}}
FPDT = {"sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}}
HYBRID = {"compress": {"policy": "hybrid", "min_kb": 0, "bucket_mb": 0.05}}
NAIVE = {"compress": {"policy": "naive", "min_kb": 0, "bucket_mb": 0.05}}


def _hf(comm, root: str) -> list[dict]:
    """A tiny transformers Llama (from a config: nothing downloaded) under sp, when transformers is installed."""
    path = tiny_hf_llama(comm, os.path.join(root, "llama.json"))
    return [] if path is None else [{"model": {"hf_config": path}}]


def _meshes(comm, root: str) -> list[dict]:
    """Every mesh of ``p`` ranks that the step takes a different path through (one rank: the model variants)."""
    p = comm.size
    if p == 1:
        return [{}, MOE, FPDT, HYBRID, {"zero": {"stage": 1}}]
    return [*[{**hf, "mesh": {"sp": p}} for hf in _hf(comm, root)],{"mesh": {"dp": p}},
            {"mesh": {"sp": p}},
            {**FPDT, "mesh": {"sp": p}},
            {"mesh": {"pp": p}, "data": {"micro_batches": 2}},
            {"mesh": {"tp": p}},
            {"mesh": {"tp": p, "tp_sequence_parallel": True}},
            {**MOE, "mesh": {"ep": p}},
            {**MOE, "mesh": {"ep": p}, "multipath": {"enabled": True, "topology": "shm", "min_bytes": 0}},
            {**HYBRID, "mesh": {"dp": p}},
            {**HYBRID, "mesh": {"sp": p}},
            {**NAIVE, "mesh": {"dp": p}},
            {"mesh": {"dp": p}, "zero": {"stage": 1}},
            {"mesh": {"dp": p}, "zero": {"stage": 2}},
            {"mesh": {"dp": p}, "zero": {"stage": 3}}]


def _run(comm, extra: dict, out: str, *, checked: bool, resume: bool = False, until: int | None = None):
    tr = Trainer(train_config(BASE, extra), comm, out=out, quiet=True, resume=resume)
    if not checked:
        return tr.run(until)
    with device_check():
        return tr.run(until)


_ROOT = SharedDir("loom-devices-")


def check_train_steps_make_tensors_on_their_device(comm):
    for i, extra in enumerate(_meshes(comm, _ROOT.path(comm))):
        out = _ROOT.path(comm, f"run{i}")
        plain = _run(comm, extra, out + "-plain", checked=False)
        # Interrupted after step 1, then resumed inside the check: the load path runs under it too.
        _run(comm, extra, out, checked=True, until=1)
        recs = _run(comm, extra, out, checked=True, resume=True)
        assert [r["step"] for r in recs] == [2], (extra, recs)
        got, want = recs[-1]["loss"], plain[-1]["loss"]
        assert math.isfinite(got) and got == want, (extra, got, want)


def check_cleanup(comm):
    _ROOT.remove(comm)


if __name__ == "__main__":
    mpi_checks(globals())
