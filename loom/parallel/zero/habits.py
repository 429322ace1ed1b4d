"""torch's global optimizer step hooks, through which an optimizer over a wrapper's shards reduces before its
step and refreshes the parameters after it."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

import torch
from torch import nn


# torch optimizers call these around every step (global hooks, installed once): an optimizer over the shards
# of a live ShardedDataParallel finishes its reduction before the step and refreshes its parameters after,
# so the plain ``loss.backward(); opt.step()`` loop of DDP and FSDP2 trains as ``sdp.step(opt)`` does.
_STEP_OWNERS: "weakref.WeakValueDictionary[int, nn.Module]" = weakref.WeakValueDictionary()  # ShardedDataParallel
_STEP_HOOKS: list[Any] = []


def _watch_steps(sdp: Any, params: Sequence[torch.Tensor]) -> None:
    if not _STEP_HOOKS:
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        _STEP_HOOKS.append(register_optimizer_step_pre_hook(lambda opt, a, k: _step_hook(opt, "_before_step")))
        _STEP_HOOKS.append(register_optimizer_step_post_hook(lambda opt, a, k: _step_hook(opt, "_after_step")))
    for p in params:
        _STEP_OWNERS[id(p)] = sdp
    for i in sdp._inner_ids:
        _STEP_OWNERS[i] = sdp
    sdp._step_ids = {id(p) for p in params}


def _step_hook(opt: torch.optim.Optimizer, what: str) -> None:
    if not _STEP_OWNERS:
        return
    seen = set()
    for g in opt.param_groups:
        for p in g["params"]:
            sdp = _STEP_OWNERS.get(id(p))
            if sdp is not None and id(p) in sdp._inner_ids and what == "_before_step":
                raise ValueError(
                    f"ShardedDataParallel stage {sdp.stage}: this optimizer steps the wrapped module's own "
                    f"parameters (one of shape {tuple(p.shape)}), which hold no reduced gradient and are "
                    f"overwritten from the shards; build it over the wrapper's: torch.optim.AdamW(sdp.parameters(), "
                    f"...) or sdp.optim_groups()")
            if sdp is not None and id(sdp) not in seen and id(p) in sdp._step_ids:
                seen.add(id(sdp))
                getattr(sdp, what)()
