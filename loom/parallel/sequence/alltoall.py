"""The sequence <-> head all-to-all of Ulysses and FPDT (packed, differentiable) and its counter."""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F

from ... import stats as _stats
from .layout import HeadPlan, _head_plan

__all__ = ["seq_to_heads", "heads_to_seq", "alltoall_stats", "reset_alltoall_stats"]

_A2A = _stats.counters("sequence", "sp")  # the registry's live dict (loom.stats)


def alltoall_stats() -> dict[str, int]:
    """How many all-to-alls this process's sequence-parallel code issued (P > 1 only)."""
    return {"count": _A2A.get("alltoall", 0)}


def reset_alltoall_stats() -> None:
    _stats.reset("sequence")


# ---------------------------------------------------------------------------------------------- all-to-all
def _s2h(xs: Sequence[torch.Tensor], comm, counts: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Sequence- to head-sharding: each ``[B, s, H_x, D]`` becomes ``[B, P s, H_x / P, D]``; one packed alltoall.

    ``counts[x][r]``: heads of tensor ``x`` that rank ``r`` gets (contiguous runs in rank order; default
    ``H_x / P`` each). Uneven runs travel padded to the largest rank's total (at most one head per tensor)."""
    p = comm.size
    if p == 1:
        return list(xs)
    b, s, _, d = xs[0].shape
    if counts is None or all(len(set(c)) == 1 for c in counts):
        heads = [x.shape[2] // p for x in xs]
        parts = [x.reshape(b, s, p, h, d) for x, h in zip(xs, heads)]
        packed = parts[0] if len(parts) == 1 else torch.cat(parts, dim=3)
        send = packed.permute(2, 0, 1, 3, 4).contiguous()  # [P(dest head group), B, s, hsum, D]
    else:
        heads = [c[comm.rank] for c in counts]
        send = _uneven_blocks([list(torch.split(x, list(c), dim=2)) for x, c in zip(xs, counts)], p, dim=2)
    recv = comm.alltoall(send)  # [P(src = sequence piece), B, s, hsum (padded), D]
    _stats.add("sequence", "sp", alltoall=1)
    y = recv[..., :sum(heads), :].permute(1, 0, 2, 3, 4).reshape(b, p * s, sum(heads), d)
    return list(torch.split(y, heads, dim=2)) if len(xs) > 1 else [y]


def _uneven_blocks(parts: list[list[torch.Tensor]], p: int, dim: int) -> torch.Tensor:
    """``[P, ...]``: block ``r`` is ``cat(parts[x][r] for x)`` along ``dim`` (of each block), zero-padded to the
    largest block (so an uneven split still travels as one plain alltoall)."""
    blocks = [torch.cat([px[r] for px in parts], dim=dim) for r in range(p)]
    top = max(t.shape[dim] for t in blocks)
    pad = [0, 0] * (blocks[0].dim() - 1 - dim)
    return torch.stack([F.pad(t, pad + [0, top - t.shape[dim]]) for t in blocks])


def _h2s(xs: Sequence[torch.Tensor], comm, counts: Sequence[Sequence[int]] | None = None) -> list[torch.Tensor]:
    """Head- to sequence-sharding: each ``[B, P s, h_x, D]`` becomes ``[B, s, P h_x, D]``; one packed alltoall.

    ``counts[x][r]``: heads of tensor ``x`` that rank ``r`` holds (the inverse of :func:`_s2h`'s)."""
    p = comm.size
    if p == 1:
        return list(xs)
    b, n, _, d = xs[0].shape
    s = n // p
    heads = [x.shape[2] for x in xs]
    packed = xs[0] if len(xs) == 1 else torch.cat(list(xs), dim=2)
    send = packed.reshape(b, p, s, sum(heads), d).permute(1, 0, 2, 3, 4)
    if counts is not None and not all(len(set(c)) == 1 for c in counts):
        top = max(sum(c[r] for c in counts) for r in range(p))
        send = F.pad(send, [0, 0, 0, top - sum(heads)])
    recv = comm.alltoall(send.contiguous())  # [P(src head group), B, s, hsum (padded), D]
    _stats.add("sequence", "sp", alltoall=1)
    if counts is not None and not all(len(set(c)) == 1 for c in counts):
        outs = []
        for x, c in enumerate(counts):
            off = [sum(cc[r] for cc in counts[:x]) for r in range(p)]
            outs.append(torch.cat([recv[r, :, :, off[r]:off[r] + c[r]] for r in range(p)], dim=2))
        return outs
    y = recv.permute(1, 2, 0, 3, 4)  # [B, s, P, hsum, D]
    outs = torch.split(y, heads, dim=3) if len(xs) > 1 else [y]
    return [o.reshape(b, s, p * h, d) for o, h in zip(outs, heads)]


class _AllToAll(torch.autograd.Function):
    """A packed all-to-all ``there`` (:func:`_s2h` or :func:`_h2s`); its backward is the other one, ``back``."""

    @staticmethod
    def forward(ctx, comm, there, back, counts, *xs):
        ctx.comm, ctx.back, ctx.counts = comm, back, counts
        return tuple(there(xs, comm, counts))

    @staticmethod
    def backward(ctx, *gs):
        # undefined grads arrive as zeros (materialize_grads)
        return (None, None, None, None, *ctx.back(gs, ctx.comm, ctx.counts))


def seq_to_heads(*xs: torch.Tensor, comm, counts=None) -> tuple[torch.Tensor, ...]:
    """Differentiable packed all-to-all ``[B, s, H, D] -> [B, P s, H / P, D]`` (backward: :func:`heads_to_seq`);
    ``counts[x][r]``: heads of tensor ``x`` for rank ``r`` (uneven splits, :class:`HeadPlan`)."""
    return _AllToAll.apply(comm, _s2h, _h2s, counts, *xs)


def heads_to_seq(*xs: torch.Tensor, comm, counts=None) -> tuple[torch.Tensor, ...]:
    """Differentiable packed all-to-all ``[B, P s, h, D] -> [B, s, P h, D]`` (backward: :func:`seq_to_heads`)."""
    return _AllToAll.apply(comm, _h2s, _s2h, counts, *xs)


def _to_heads(q, k, v, comm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, HeadPlan]:
    """Ulysses' first all-to-all under a :class:`HeadPlan` (any head count): this rank's query heads and the
    kv heads they read (one per query head where its GQA groups are unequal), over the whole sequence."""
    plan = _head_plan(q, k, comm.size)
    k, v = plan.gather_kv(k, v)
    if comm.size == 1:
        return q, k, v, plan
    counts = None if plan.even else (plan.q, plan.kv, plan.kv)
    qh, kh, vh = seq_to_heads(q, k, v, comm=comm, counts=counts)
    m = plan.local_map(comm.rank, q.device)
    if m is not None:
        kh, vh = kh.index_select(2, m), vh.index_select(2, m)
    return qh, kh, vh, plan


def _to_seq(o, comm, plan: HeadPlan) -> torch.Tensor:
    if comm.size == 1:
        return o
    return heads_to_seq(o, comm=comm, counts=None if plan.even else (plan.q,))[0]
