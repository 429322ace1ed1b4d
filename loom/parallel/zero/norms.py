"""The gradient of a shard (stage >= 1), whose norm is the whole bucket's over the group."""

from __future__ import annotations

from typing import Any

import torch

from ...comm import Communicator


_NORMS = {torch.linalg.vector_norm: ("ord", 1, 2), torch.norm: ("p", 1, "fro"), torch.Tensor.norm: ("p", 1, "fro")}


class _ShardGrad(torch.Tensor):
    """The gradient of a stage >= 1 shard (this rank's block of a bucket's gradient). A norm of it is the norm
    of the whole bucket's gradient, over every rank of the group (a collective: every rank takes it), so the
    habits that read gradient norms give one process's answer: ``torch.nn.utils.clip_grad_norm_(sdp.parameters(),
    c)``, grad-norm logging, ``GradScaler.unscale_`` (whose inf/nan flag is agreed by every rank, so all skip a
    step together). Every other operation is a plain tensor's on this rank's block. ``_loom_comm``: the group."""

    _loom_comm: Communicator

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if func is torch._foreach_norm:
            ps = args[1] if len(args) > 1 else kwargs.get("ord", 2)
            return _global_norms(list(args[0]), list(out), ps)
        if func in _NORMS:
            key, pos, default = _NORMS[func]
            ps = args[pos] if len(args) > pos else kwargs.get(key, default)
            dim = args[pos + 1] if len(args) > pos + 1 else kwargs.get("dim")
            if dim is None and type(args[0]) is cls:
                return _global_norms([args[0]], [out], ps)[0]
        elif func is torch._amp_foreach_non_finite_check_and_unscale_:
            comm = next((t._loom_comm for t in args[0] if type(t) is cls), None)
            if comm is not None and comm.size > 1:  # one rank's inf skips the step on every rank
                args[1].copy_(comm.allreduce(args[1].detach().reshape(1).clone(), op="max").reshape(args[1].shape))
        return out


def _global_norms(tensors: list[torch.Tensor], norms: list[torch.Tensor], ps: Any) -> list[torch.Tensor]:
    """``norms[i]`` (the local ``ps``-norm of ``tensors[i]``) made the norm over the group for each shard
    gradient: one allreduce per group of the shards' norms (``ps``-th powers summed, or max / min)."""
    ps = 2.0 if ps in (None, "fro") else ps
    if isinstance(ps, str):  # "nuc": a matrix norm, local
        return norms
    ps = float(ps)
    out = list(norms)
    by_comm: dict[int, list[int]] = {}
    for i, t in enumerate(tensors):
        if type(t) is _ShardGrad and t._loom_comm.size > 1:
            by_comm.setdefault(id(t._loom_comm), []).append(i)
    for idx in by_comm.values():
        comm = tensors[idx[0]]._loom_comm
        with torch._C.DisableTorchFunctionSubclass():
            v = torch.stack([norms[i].detach().to(torch.float64) for i in idx])
            if ps in (float("inf"), float("-inf")):
                v = comm.allreduce(v, op="max" if ps > 0 else "min")
            elif ps == 0:
                v = comm.allreduce(v)
            else:
                v = comm.allreduce(v.pow(ps)).pow(1.0 / ps)
            for j, i in enumerate(idx):
                out[i] = v[j].to(norms[i].dtype)
    return out


def _shard_grad(g: torch.Tensor, comm: Communicator) -> torch.Tensor:
    if type(g) is _ShardGrad:
        return g
    g = g.as_subclass(_ShardGrad)
    g._loom_comm = comm
    return g
