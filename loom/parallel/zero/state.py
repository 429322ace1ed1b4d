"""Sharded checkpoints: the manifest, one file per rank, and the files of a checkpoint saved at another size."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["MANIFEST"]

MANIFEST = "manifest.json"


def _optim_block(old: "_OldShards", k: int, name: str) -> Callable[[int], torch.Tensor]:
    return lambda q: old.get(q)["optim"]["state"][k][name]


def _block(flat: torch.Tensor, lay: dict[str, int]) -> torch.Tensor:
    return flat[lay["start"]:lay["start"] + lay["shard"]]


def _shard_name(rank: int, size: int) -> str:
    return f"shard-{rank:05d}-of-{size:05d}.pt"


def _atomic_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    torch.save(obj, tmp)
    os.replace(tmp, path)


class _OldShards:
    """The files of a saved checkpoint, loaded on first use (memory-mapped)."""

    def __init__(self, d: Path, manifest: dict[str, Any]):
        self.dir = d
        self.world = manifest["world"]
        self.files = manifest["files"]
        self.layouts, start = [], 0
        for lay in manifest["buckets"]:
            shard = -(-lay["numel"] // self.world)
            self.layouts.append({"shard": shard, "start": start})
            start += shard
        self._cache: dict[int, dict[str, Any]] = {}

    def get(self, q: int) -> dict[str, Any]:
        if q not in self._cache:
            self._cache[q] = torch.load(self.dir / self.files[q], mmap=True, weights_only=False)
        return self._cache[q]
