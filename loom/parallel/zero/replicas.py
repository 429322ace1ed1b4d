"""The replicated state (buffers, frozen parameters): equal on every rank of the group, as under DDP."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from ...comm import Communicator


class Replicas:
    """What every rank of ``comm`` holds whole: broadcast from rank 0 at construction (the buffers and frozen
    parameters of ``module``, and at stage 0 the trainable parameters too), and the buffers again around every
    forward that changed one (DDP's ``broadcast_buffers``)."""

    def __init__(self, module: nn.Module, comm: Communicator):
        self.module, self.comm = module, comm
        self.key: tuple[tuple[int, int], ...] | None = None  # buffers' (id, version) at the last sync

    def broadcast(self) -> None:
        """Replicated state (buffers, frozen parameters) starts equal on every rank, as under DDP."""
        self.bcast([*self.module.buffers(), *(p for p in self.module.parameters() if not p.requires_grad)])
        self.key = self._now()

    def bcast(self, tensors: Sequence[torch.Tensor], fresh: bool = False) -> dict[int, torch.Tensor]:
        """Rank 0's values of ``tensors`` on every rank: one broadcast per (dtype, device), copied in place, or
        (``fresh``) into new tensors, returned by ``id`` of the old one (ranks other than 0)."""
        out: dict[int, torch.Tensor] = {}
        if self.comm.size == 1:
            return out
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel() and not t.is_meta:
                groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for ts in groups.values():
                flat = self.comm.bcast(torch.cat([t.detach().reshape(-1) for t in ts]), root=0)
                if self.comm.rank:
                    off = 0
                    for t in ts:
                        got = flat[off:off + t.numel()].view_as(t)
                        if fresh:
                            out[id(t)] = got.clone()
                        else:
                            t.copy_(got)
                        off += t.numel()
        return out

    def _now(self) -> tuple[tuple[int, int], ...]:
        return tuple((id(t), t._version) for t in self.module.buffers())

    def sync_buffers(self, force: bool = False) -> None:
        """Rank 0's buffers on every rank, sent only when some rank's changed since the last sync (one small
        allreduce finds out; ``force``: always). Collective over the group."""
        if self.comm.size == 1:
            return
        bufs = list(self.module.buffers())
        if not bufs:
            return
        if not force:
            changed = torch.tensor([int(self._now() != self.key)], dtype=torch.int32, device="cpu")
            if not self.comm.allreduce(changed, op="max").item():
                return
        # New tensors rather than copies in place: a forward's graph saves the buffers it read (BatchNorm's
        # backward takes its running statistics), and an in-place write would fail that backward's version check.
        fresh = self.bcast(bufs, fresh=True)
        for m in self.module.modules():
            for name, t in m._buffers.items():
                if t is not None and id(t) in fresh:
                    m._buffers[name] = fresh[id(t)]
        self.key = self._now()
