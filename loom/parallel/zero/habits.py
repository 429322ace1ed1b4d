"""The wrapped module's own habits answering as its wrapper, and torch's global optimizer step hooks.

The habits: its forward, ``zero_grad``, ``state_dict`` and ``load_state_dict``. Through the step hooks an optimizer
over a wrapper's shards reduces before its step and refreshes the parameters after it. The table of habits and
their answers is ``tests/mpi/check_zero_habits.py``'s.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from .requests import _in_backward


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


def _unwatch_steps(sdp: Any) -> None:
    """The step hooks forget ``sdp``."""
    for i in (*sdp._step_ids, *sdp._inner_ids):
        if _STEP_OWNERS.get(i) is sdp:
            del _STEP_OWNERS[i]
    sdp._step_ids = set()
    sdp._inner_ids = set()


class ModuleHabits:
    """The wrapped module's own habits answer as its wrapper ``sdp`` (FSDP2 users call the inner module): its
    forward runs in ``sdp.forward_context()``, its ``zero_grad()`` clears the shards' gradients too, its
    ``load_state_dict()`` reaches the shards (stages 1-2) or is refused (stage 3, like its ``state_dict()``,
    whose parameters are placeholders there), and an optimizer over its parameters is refused at stages
    1-3 (they are not what is stepped; :func:`_step_hook`)."""

    def __init__(self, sdp: Any):
        self.sdp = sdp
        self.internal = False  # the wrapper calls the module's state_dict / load_state_dict itself
        self.hooks: list[Any] = []

    def install(self) -> None:
        m = self.sdp.module
        m.forward = self._forward(m.forward)  # an instance attribute, so a forward that raises still
        # leaves the context (forward hooks have no reliable exit then)
        self.hooks.append(m.register_state_dict_pre_hook(self._state_dict))
        self.hooks.append(m.register_load_state_dict_pre_hook(self._load))
        self.hooks.append(m.register_load_state_dict_post_hook(self._loaded))
        m.zero_grad = self._zero_grad  # an instance attribute: nn.Module has no zero_grad hook

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks = []
        m = self.sdp.module
        if m.__dict__.get("zero_grad") == self._zero_grad:
            del m.zero_grad
        if getattr(m.__dict__.get("forward"), "_loom_sdp", None) is self.sdp:
            del m.forward

    @contextlib.contextmanager
    def as_internal(self) -> Iterator[None]:
        """The wrapper calls the module's ``state_dict`` / ``load_state_dict`` itself (not refused)."""
        old, self.internal = self.internal, True
        try:
            yield
        finally:
            self.internal = old

    def _forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The wrapped module's forward, run in ``forward_context`` unless already inside one (the wrapper's own
        forward) or recomputed in backward (then gathered as its submodules are)."""
        sdp = self.sdp

        @functools.wraps(forward)
        def run(*args, **kwargs):
            if sdp._depth or _in_backward():
                return forward(*args, **kwargs)
            with sdp.forward_context():
                return forward(*args, **kwargs)

        run._loom_sdp = sdp
        return run

    def _state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.sdp.stage == 3 and not self.internal:
            raise ValueError(
                "ShardedDataParallel stage 3: the wrapped module's state_dict() would hold placeholders (each "
                "rank keeps only its shard of every parameter); call sdp.state_dict() on every rank (a collective: "
                "full values on every rank), or sdp.save_sharded(path) for one file per rank")

    def _load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if self.sdp.stage == 3 and not self.internal:
            raise ValueError(
                "ShardedDataParallel stage 3: the wrapped module's load_state_dict() would write into "
                "placeholders (each rank keeps only its shard of every parameter); call sdp.load_state_dict(sd) "
                "(each rank takes its shard of the full values), or sdp.load_sharded(path)")

    def _loaded(self, module: nn.Module, incompatible: Any) -> None:
        """Stages 1-2: the module's parameters (views of the gathered buckets) were loaded; each rank's master
        block is taken from them, so the next optimizer step starts from the loaded values."""
        sdp = self.sdp
        if sdp.stage in (1, 2) and not self.internal:
            r = sdp.comm.rank
            sdp._mirror.stale()
            with torch.no_grad():
                for b in sdp.buckets:
                    sdp._master(b).copy_(b.full[r * b.shard:(r + 1) * b.shard])

    def _zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped module's ``zero_grad()``: its parameters' gradients and the wrapper's shards'."""
        nn.Module.zero_grad(self.sdp.module, set_to_none)
        if self.sdp.stage:
            self.sdp._zero_shard_grads(set_to_none)
