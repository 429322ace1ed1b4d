"""What the test files that run whole ``loom train`` jobs share: the config built from sections and the job's
temporary folder (rank-side check scripts in tests/mpi and tests/gpu), and the command launched on ranks
(integration tests)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

from loom.comm import launch
from loom.testing import ROOT

__all__ = ["train_config", "SharedDir", "tiny_hf_llama", "TINY", "train_job", "uneven_documents"]

TINY = str(ROOT / "configs" / "train-tiny.toml")
"""The small ``loom train`` config the integration tests start from."""


def train_config(*parts: dict):
    """A ``loom train`` config from sections merged in order: a later part updates the keys of the earlier parts'
    sections; ``{"mesh_schedule": name}`` sets ``mesh.schedule`` and keeps the rest of ``[mesh]``."""
    from loom.train.config import config_from_dict

    data: dict = {}
    for part in parts:
        for sec, vals in part.items():
            if sec == "mesh_schedule":
                data.setdefault("mesh", {})["schedule"] = vals
                continue
            data.setdefault(sec, {}).update(vals)
    return config_from_dict(data)


class SharedDir:
    """One temporary folder for a check script's jobs: rank 0 makes it on first use and every rank gets its
    path; ``remove`` (a script's last check) deletes it once all ranks are past their runs."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.root: str | None = None

    def path(self, comm, *names: str) -> str:
        """``names`` joined under the folder (the folder itself without names)."""
        if self.root is None:
            self.root = comm.bcast_object(tempfile.mkdtemp(prefix=self.prefix) if comm.rank == 0 else None)
        return os.path.join(self.root, *names)

    def remove(self, comm) -> None:
        comm.barrier()
        if comm.rank == 0 and self.root:
            shutil.rmtree(self.root, ignore_errors=True)


def train_job(n: int, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """``loom train --config TINY ARGS`` on ``n`` ranks, output captured; the caller checks the exit code."""
    env = {"PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return launch.run(n, [sys.executable, "-m", "loom.cli", "train", "--config", TINY, *args], timeout=timeout,
                      env=env, capture=True)


def tiny_hf_llama(comm, path: str, *, tie: bool = False, heads: int = 4, kv_heads: int = 2) -> str | None:
    """A tiny transformers Llama config (nothing downloaded; embedding and head tied with ``tie``; ``heads``
    query heads of 8 dimensions) written to ``path`` by rank 0 (every rank when ``comm`` is None) and seen by
    every rank; ``None`` where transformers is not installed."""
    try:
        from transformers import LlamaConfig
    except ImportError:
        return None
    if comm is None or comm.rank == 0:
        LlamaConfig(vocab_size=256, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=128,
                    tie_word_embeddings=tie).to_json_file(path)
    if comm is not None:
        comm.barrier()
    return path


def uneven_documents(path: str, *, files: int = 60, longest: int = 40, seed: int = 0) -> dict:
    """A folder of ``files`` documents of 1 to ``longest`` random bytes (uneven lengths, so that packed rows hold
    several documents whose boundaries fall anywhere in the sp layout); returns the ``[data]`` section that
    packs them. Call it on one rank and share the folder."""
    import random

    rng = random.Random(seed)
    os.makedirs(path, exist_ok=True)
    for i in range(files):
        with open(os.path.join(path, f"doc{i:03d}.txt"), "wb") as f:
            f.write(bytes(rng.randrange(256) for _ in range(rng.randrange(1, longest + 1))))
    return {"path": path, "glob": "*.txt", "pack": True, "max_bytes": 0, "heldout": 0.25}
