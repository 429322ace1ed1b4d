"""State dicts and sharded checkpoints: full values gathered or scattered, one file per rank plus a manifest.

Full values are gathered from the shards or scattered into them; a sharded checkpoint loads at any group size.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from .buckets import _Bucket

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


def _ef_state(sdp: Any) -> dict[int, torch.Tensor] | None:
    """The error-feedback residuals by bucket (saved with the shard), or ``None`` without error feedback."""
    if sdp.error_feedback is None:
        return None
    return {b.index: sdp.error_feedback.get(b.index) for b in sdp.buckets
            if sdp.error_feedback.get(b.index) is not None}


def _full_values(sdp: Any) -> dict[int, torch.Tensor]:
    """id(parameter) -> its full value in the master dtype, gathered from the shards (collective)."""
    out: dict[int, torch.Tensor] = {}
    for b in sdp.buckets:
        if sdp.stage == 0:
            full = torch.cat([p.detach().reshape(-1) for p in b.params])
        else:
            full = sdp.comm.allgather(sdp._master(b).clone())
        for p, off in zip(b.params, b.offsets):
            out[id(p)] = full[off:off + p.numel()].view(p.shape).clone()
    return out


def gather_state_dict(sdp: Any) -> dict[str, Any]:
    """:meth:`ShardedDataParallel.state_dict <loom.parallel.ShardedDataParallel.state_dict>`: the module's own
    state dict, its trainable parameters replaced by their full values gathered from the shards."""
    if sdp.stage:
        sdp.sync_buffers()
    values = _full_values(sdp)
    with sdp._habits.as_internal():
        sd = sdp.module.state_dict()
    for name, p in sdp.module.named_parameters(remove_duplicate=False):
        if id(p) in values:
            sd[name] = values[id(p)]
    return sd


def scatter_state_dict(sdp: Any, state_dict: dict[str, Any], strict: bool) -> Any:
    """:meth:`ShardedDataParallel.load_state_dict <loom.parallel.ShardedDataParallel.load_state_dict>`: the
    replicated entries loaded into the module, each bucket's full values flattened and this rank's block kept
    (stages 1-2 also write the full buffer the parameters view)."""
    owned = {}
    for name, p in sdp.module.named_parameters(remove_duplicate=False):
        if id(p) in sdp._index_of or sdp.stage == 0 and p.requires_grad:
            owned[name] = p
    missing = [n for n in owned if n not in state_dict]
    if missing:
        raise ValueError(f"load_state_dict: the state has no entry for {missing[:5]} (it must come from "
                         f"the same model: its keys are module.state_dict()'s)")
    rest = {k: v for k, v in state_dict.items() if k not in owned}
    with sdp._habits.as_internal():
        result = sdp.module.load_state_dict(rest, strict=False)
    if strict and result.unexpected_keys:
        raise ValueError(f"load_state_dict: unexpected keys {result.unexpected_keys[:5]}")
    with torch.no_grad():
        if sdp.stage == 0:
            for n, p in owned.items():
                p.copy_(state_dict[n])
            return result
        names = {id(p): n for n, p in owned.items()}
        r = sdp.comm.rank
        sdp._mirror.stale()
        for b in sdp.buckets:
            full = b.flat([state_dict[names[id(p)]] for p in b.params], sdp.master_dtype, sdp.device)
            sdp._master(b).copy_(full[r * b.shard:(r + 1) * b.shard])
            if sdp.stage < 3:
                b.full.copy_(full)
    return result


def save_shards(sdp: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None,
                extra: dict[str, Any] | None) -> None:
    """:meth:`ShardedDataParallel.save_sharded <loom.parallel.ShardedDataParallel.save_sharded>`: each rank's
    file written under a temporary name and renamed, a barrier, rank 0's manifest written last the same way
    (so a directory with a manifest is complete), a barrier."""
    if sdp.stage == 0:
        raise ValueError("save_sharded needs stage >= 1 (stage 0 holds no shards); save state_dict() instead")
    d = Path(path)
    d.mkdir(parents=True, exist_ok=True)
    r, size = sdp.comm.rank, sdp.comm.size
    with sdp._habits.as_internal():
        replicated = {k: v for k, v in sdp.module.state_dict().items() if k not in _trainable_names(sdp)}
    blob = {"flat": sdp.flat_shard(), "optim": optimizer.state_dict() if optimizer else None,
            "optim_buckets": _optim_order(sdp, optimizer) if optimizer else None, "extra": extra,
            "replicated": replicated if r == 0 else None, "error_feedback": _ef_state(sdp)}
    _atomic_save(blob, d / _shard_name(r, size))
    sdp.comm.barrier()
    if r == 0:
        manifest = {"format": "loom-zero/1", "world": size, "stage": sdp.stage,
                    "dtype": str(sdp.master_dtype), "buckets": [b.layout() for b in sdp.buckets],
                    "files": [_shard_name(q, size) for q in range(size)]}
        tmp = d / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(manifest, indent=1))
        os.replace(tmp, d / MANIFEST)
    sdp.comm.barrier()


def _trainable_names(sdp: Any) -> set[str]:
    return {n for n, p in sdp.module.named_parameters(remove_duplicate=False) if id(p) in sdp._index_of}


def load_shards(sdp: Any, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None) -> Any:
    """:meth:`ShardedDataParallel.load_sharded <loom.parallel.ShardedDataParallel.load_sharded>`: the manifest
    checked against this layout, each bucket's block resharded from the old ranks' files (read on first use,
    memory-mapped), the optimizer state resharded the same way, the residuals kept at the same group size."""
    if sdp.stage == 0:
        raise ValueError("load_sharded needs stage >= 1; load a state_dict() instead")
    d = Path(path)
    if not (d / MANIFEST).exists():
        raise ValueError(f"{d} has no {MANIFEST}: not a complete sharded checkpoint")
    man = json.loads((d / MANIFEST).read_text())
    mine = [b.layout() for b in sdp.buckets]
    if man["buckets"] != mine:
        raise ValueError(f"{d}: the checkpoint's buckets differ from this model's (another model, or another "
                         f"bucket_mb): {len(man['buckets'])} buckets saved, {len(mine)} here")
    old = _OldShards(d, man)
    sdp._mirror.stale()
    with torch.no_grad():
        for b, lay in zip(sdp.buckets, old.layouts):
            sdp._master(b).copy_(_reshard(sdp, old, b, lambda q, lay=lay: _block(old.get(q)["flat"], lay)))
    if old.get(0)["replicated"]:
        with sdp._habits.as_internal():
            sdp.module.load_state_dict(old.get(0)["replicated"], strict=False)
    if sdp.stage < 3:
        with torch.no_grad():
            for b in sdp.buckets:
                b.full.copy_(sdp.comm.allgather(sdp._master(b).to(sdp.compute_dtype)))
    if optimizer is not None:
        optimizer.load_state_dict(_reshard_optim(sdp, old, optimizer))
    if sdp.error_feedback is not None:
        sdp.error_feedback.reset()
        saved = old.get(sdp.comm.rank)["error_feedback"] if old.world == sdp.comm.size else None
        for k, res in (saved or {}).items():
            sdp.error_feedback.set(k, res.clone())
    return old.get(sdp.comm.rank % old.world)["extra"]


def _reshard(sdp: Any, old: "_OldShards", b: _Bucket, block: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """This rank's block of bucket ``b``, assembled from the blocks saved at any group size
    (``block(q)``: old rank ``q``'s block of ``b``); padding stays zero."""
    lay = old.layouts[b.index]
    r = sdp.comm.rank
    out = torch.zeros(b.shard, dtype=sdp.master_dtype, device=sdp.device)
    lo, hi = r * b.shard, min((r + 1) * b.shard, b.numel)
    pos = lo
    while pos < hi:
        q = pos // lay["shard"]
        end = min(hi, (q + 1) * lay["shard"])
        a = pos - q * lay["shard"]
        out[pos - lo:end - lo].copy_(block(q)[a:a + end - pos])
        pos = end
    return out


def _optim_order(sdp: Any, optimizer: torch.optim.Optimizer) -> list[int]:
    """The bucket of each parameter of ``optimizer``, in its state-dict order (groups in order)."""
    where = {id(sh): i for i, sh in enumerate(sdp.shards)}
    order = []
    for g in optimizer.param_groups:
        for p in g["params"]:
            if id(p) not in where:
                raise ValueError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not one of "
                                 f"this ShardedDataParallel's shards; build it over sdp.optim_groups() or "
                                 f"sdp.parameters()")
            order.append(where[id(p)])
    return order


def _reshard_optim(sdp: Any, old: "_OldShards", optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer state of the saved run, resharded to this group and keyed by bucket (each optimizer
    position's parameter), so groups may list the shards in another order than the buckets'."""
    saved = old.get(0)
    base = saved["optim"]
    if base is None:
        raise ValueError("load_sharded: the checkpoint has no optimizer state (saved without optimizer=)")
    old_order = saved.get("optim_buckets") or list(range(len(old.layouts)))  # older files: bucket order
    old_pos = {j: k for k, j in enumerate(old_order)}
    mine = optimizer.state_dict()["param_groups"]
    if len(mine) != len(base["param_groups"]):
        raise ValueError(f"load_sharded: the checkpoint's optimizer has {len(base['param_groups'])} parameter "
                         f"groups, this one {len(mine)}; build it over sdp.optim_groups() with the same groups")
    state = {}
    for pos, j in enumerate(_optim_order(sdp, optimizer)):
        k = old_pos.get(j)
        st = base["state"].get(k) if k is not None else None
        if not st:
            continue
        lay = old.layouts[j]
        state[pos] = {}
        for name, v in st.items():
            if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == lay["shard"]:
                state[pos][name] = _reshard(sdp, old, sdp.buckets[j], _optim_block(old, k, name))
            else:
                state[pos][name] = v
    groups = [{**g, "params": m["params"]} for g, m in zip(base["param_groups"], mine)]
    return {"state": state, "param_groups": groups}
