"""ZeRO stage 1 for loops that handle their gradients themselves: :class:`ShardedOptimizer`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...comm import Communicator
from .buckets import _flat_block
from .requests import _wait

__all__ = ["ShardedOptimizer"]


class ShardedOptimizer:
    """ZeRO stage 1 for training loops that keep their own gradient handling: each rank of ``comm`` keeps the
    optimizer state of its block of every parameter group, steps it, and the blocks are all-gathered back
    into the parameters.

    For ``loom train``: its sp sync, compression and pipeline stay as they are. Plan per :meth:`step`: per
    group, the parameters' gradients are flattened (padded to ``P S``); with ``reduce=True`` the flat gradient
    is reduce-scattered (mean over ``comm``) into this rank's master's gradient (:meth:`reduce_grads`, which
    a loop that clips calls first), else the gradients are already reduced and this rank's block is sliced;
    the wrapped optimizer steps the masters (elementwise optimizers such as Adam(W) and SGD give exactly what
    they give unsharded), and one ``allgather`` per group writes the updated blocks into every rank's
    parameters: a reduce-scatter plus an allgather, DDP's bytes, where an allreduce first would send half
    as much again. :meth:`state_dict` gathers the full state in the wrapped optimizer's own format, keyed by
    the parameters' order, to one rank (``to=``), so checkpoints are those of the unsharded optimizer and
    load at any group size.

    Args:
        param_groups: ``[{"params": [...], **group options}, ...]`` as for any torch optimizer.
        comm: the ranks that hold identical parameters (and, without ``reduce``, identical gradients).
        optimizer: the torch optimizer class; ``**defaults`` are its arguments.
        reduce: reduce-scatter the gradients in :meth:`reduce_grads` / :meth:`step` (mean over ``comm``).
    """

    def __init__(self, param_groups: list[dict[str, Any]], comm: Communicator,
                 optimizer: type = torch.optim.AdamW, *, reduce: bool = False, **defaults: Any):
        self.comm = comm
        self.reduce = reduce
        self._reduced = False
        self.params: list[list[torch.Tensor]] = []
        inner_groups = []
        size = comm.size
        for g in param_groups:
            ps = list(g["params"])
            n = sum(p.numel() for p in ps)
            master = nn.Parameter(self._block(ps, list(ps), -(-n // size)))
            self.params.append(ps)
            inner_groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": [master]})
        self.inner = optimizer(inner_groups, **defaults)

    @classmethod
    def wrap(cls, optimizer: torch.optim.Optimizer, comm: Communicator, *, reduce: bool = False
             ) -> "ShardedOptimizer":
        """The same optimizer (class, groups, options), its state sharded over ``comm``."""
        if optimizer.state:
            raise ValueError("ShardedOptimizer.wrap needs a fresh optimizer (its state is already built); wrap "
                             "it before the first step, or load the state afterwards with load_state_dict")
        groups = [dict(g) for g in optimizer.param_groups]
        return cls(groups, comm, type(optimizer), reduce=reduce)  # every group carries all its options

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The wrapped optimizer's groups (set ``lr`` here); their ``params`` are this rank's masters."""
        return self.inner.param_groups

    def masters(self) -> list[torch.Tensor]:
        """This rank's master block of each group (their ``.grad`` after :meth:`reduce_grads`)."""
        return [g["params"][0] for g in self.inner.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for ps in self.params:
            for p in ps:
                if set_to_none:
                    p.grad = None
                elif p.grad is not None:
                    p.grad.zero_()
        self.inner.zero_grad(set_to_none=True)  # the masters' gradients, as any optimizer clears its params'

    def _block(self, ps: list[torch.Tensor], tensors: list[torch.Tensor | None], n: int) -> torch.Tensor:
        return _flat_block(ps, tensors, self.comm.rank * n, n, ps[0].dtype if ps else torch.float32)

    @torch.no_grad()
    def reduce_grads(self) -> None:
        """``reduce=True``: every group's gradient reduce-scattered (mean over ``comm``) into its master's
        ``.grad`` (one ``ireduce_scatter`` per group, all posted, then waited). Once per step."""
        if self._reduced:
            return
        reqs = []
        for ps, master in zip(self.params, self.masters()):
            n, p = master.numel(), self.comm.size
            flat = _flat_block(ps, [q.grad for q in ps], 0, n * p, master.dtype)
            reqs.append(self.comm.ireduce_scatter(flat, op="avg"))
            for q in ps:  # the flat copy travels; the full gradients are not needed again this step
                q.grad = None
        for master, req in zip(self.masters(), reqs):
            master.grad = _wait(req)
        self._reduced = True

    @torch.no_grad()
    def step(self) -> None:
        for ps, g in zip(self.params, self.inner.param_groups):
            master = g["params"][0]
            n = master.numel()
            # The parameters are the truth (a resume or load_state_dict may have changed them since the last
            # step); copying this rank's block is exact, the values being the same on every rank.
            master.copy_(self._block(ps, list(ps), n))
            if not self.reduce:
                master.grad = self._block(ps, [p.grad for p in ps], n)
        if self.reduce:
            self.reduce_grads()
        self.inner.step()
        self._reduced = False
        for ps, g in zip(self.params, self.inner.param_groups):
            full = self.comm.allgather(g["params"][0].detach())
            off = 0
            for p in ps:
                p.copy_(full[off:off + p.numel()].view_as(p))
                off += p.numel()

    def _gather_to(self, v: torch.Tensor, to: int | None, tag: int) -> torch.Tensor | None:
        """Every rank's block ``v`` laid end to end: on every rank (``to=None``, one allgather) or on rank
        ``to`` only (point to point), so the full state never sits on the other ranks."""
        if to is None:
            return self.comm.allgather(v.contiguous())
        if self.comm.rank != to:
            self.comm.send(v.contiguous(), to, tag=tag)
            return None
        parts = []
        for q in range(self.comm.size):
            parts.append(v if q == to else self.comm.recv(torch.empty_like(v), source=q, tag=tag))
        return torch.cat(parts)

    def state_dict(self, to: int | None = None) -> dict[str, Any] | None:
        """The unsharded optimizer's state dict (collective over ``comm``): on every rank, or with ``to=`` on
        that rank of ``comm`` only (the others return ``None``; a checkpoint writer needs it on one rank)."""
        sd = self.inner.state_dict()
        state, idx, groups, tag = {}, 0, [], 0
        for k, (ps, g) in enumerate(zip(self.params, sd["param_groups"])):
            st = sd["state"].get(k, {})
            full = {}
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1:
                    full[name] = self._gather_to(v, to, tag)
                    tag += 1
                else:
                    full[name] = v
            if to is not None and self.comm.rank != to:
                continue  # sent its blocks; the state is assembled on ``to`` only
            off = 0
            ids = []
            for p in ps:
                if full:
                    state[idx] = {name: (v[off:off + p.numel()].view_as(p).clone()
                                         if isinstance(v, torch.Tensor) and v.dim() == 1 else v)
                                  for name, v in full.items()}
                off += p.numel()
                ids.append(idx)
                idx += 1
            groups.append({**g, "params": ids})
        if to is not None and self.comm.rank != to:
            return None
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load an unsharded state dict (as :meth:`state_dict` or the unsharded optimizer writes it)."""
        inner_state, groups, idx = {}, [], 0
        for k, (ps, g) in enumerate(zip(self.params, sd["param_groups"])):
            n = self.inner.param_groups[k]["params"][0].numel()
            per = [sd["state"].get(idx + j, sd["state"].get(str(idx + j))) for j in range(len(ps))]
            if per and all(st for st in per):
                inner_state[k] = {}
                for name, v in per[0].items():
                    if isinstance(v, torch.Tensor) and v.shape == ps[0].shape and v.dim() >= 1:
                        inner_state[k][name] = self._block(ps, [st[name] for st in per], n)
                    else:
                        inner_state[k][name] = v
            idx += len(ps)
            groups.append({**g, "params": [k]})
        self.inner.load_state_dict({"state": inner_state, "param_groups": groups})
