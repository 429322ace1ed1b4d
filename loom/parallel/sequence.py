"""Sequence parallelism for long-context attention: DeepSpeed-Ulysses and FPDT, both autograd-exact.

Vocabulary: ``P`` is the size of the sequence-parallel communicator (the ``sp`` mesh axis), ``u`` the number
of chunks per rank, ``c`` the chunk length, so a global sequence of ``n`` tokens gives ``s = n / P = u * c``
tokens per rank. Activations are ``[batch, seq, heads, head_dim]`` ("sequence layout"; the layout of
``torch.nn.functional.scaled_dot_product_attention`` after ``transpose(1, 2)``).

Token layouts (:func:`shard_sequence` / :func:`gather_sequence`):

* Ulysses (``chunks=1``): rank ``r`` holds the contiguous range ``[r s, (r+1) s)``.
* FPDT (``chunks=u``): the sequence is cut into ``u P`` pieces of ``c`` tokens and rank ``r`` holds pieces
  ``r, r+P, r+2P, ...``; local chunk ``i`` is global piece ``i P + r``, so after the all-to-all of local chunk
  ``i`` every rank holds the *contiguous* global range ``[i P c, (i+1) P c)`` for its ``H / P`` heads. This is
  what lets causal attention of chunk ``i`` start before chunk ``i+1`` has been communicated (FPDT paper,
  Sec. 4.1). ``chunks=1`` is the Ulysses layout.

Plans:

* :func:`ulysses_attention`: one packed all-to-all (q, k, v concatenated along heads) from sequence- to
  head-sharding, local attention over the whole sequence for ``H / P`` heads, one all-to-all back. The
  backward mirrors it: one all-to-all of the output gradient, local attention backward, one packed
  all-to-all of (dq, dk, dv). 2 all-to-alls per layer forward, 2 backward.
* :func:`fpdt_attention`: per chunk, one packed all-to-all of (q_i, k_i, v_i); attention of q chunk ``i``
  against kv chunks ``j`` (``j <= i`` when causal) with an online-softmax merge of per-block outputs through
  their log-sum-exp, in fp32 (fp64 for fp64 inputs); one all-to-all of the output chunk back. Head-layout
  q/k/v/out chunks and the log-sum-exp go to the chunk store (host memory with ``offload=True``) and come back
  one chunk ahead of use. Backward is a second custom pipeline, kv chunk outer and q chunk inner (as in
  FlashAttention-2): per chunk one all-to-all of the output gradient; per kv chunk ``j`` the exact block
  gradients from the saved log-sum-exp, then one packed all-to-all of (dq_j, dk_j, dv_j) back (causal: dq_j
  is complete once kv chunk ``j`` is done; non-causal: dq chunks go back at the end). 2u all-to-alls forward
  and 2u backward per layer, each 1/u the size of Ulysses'.

GQA/MQA: ``kv_heads`` must divide ``heads``; when ``kv_heads`` is not a multiple of ``P`` (it must then
divide ``P``) each kv head is replicated ``P / kv_heads`` times before the all-to-all, and autograd sums the
replicas' gradients.

Kernel (:mod:`loom.parallel.blocks`): an SDPA kernel that returns the log-sum-exp (on CPU the flash kernel;
on CUDA FlashAttention-2 for fp16/bf16, memory-efficient attention for fp32 and packed-document masks), or
with ``LOOM_ATTN_KERNEL=torch`` and wherever none applies, a tiled pure-torch kernel whose working set is a
few ``TILE x TILE`` score tiles, not ``(P c)^2``. No flash-attn dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from .. import stats as _stats
from .blocks import acc_dtype as _acc_dtype
from .blocks import attention_kernel
from .blocks import block_backward as _block_backward
from .blocks import block_forward as _block_forward
from .blocks import merge as _merge
from .offload import chunk_store

__all__ = [
    "ulysses_attention",
    "ring_attention",
    "ring_groups",
    "ring_positions",
    "fpdt_attention",
    "shard_sequence",
    "gather_sequence",
    "local_positions",
    "seq_to_heads",
    "heads_to_seq",
    "check_sizes",
    "HeadPlan",
    "alltoall_stats",
    "reset_alltoall_stats",
    "attention_kernel",
    "FPDTPipeline",
]

_A2A = _stats.counters("sequence", "sp")  # the registry's live dict (loom.stats)


def alltoall_stats() -> dict[str, int]:
    """How many all-to-alls this process's sequence-parallel code issued (P > 1 only)."""
    return {"count": _A2A.get("alltoall", 0)}


def reset_alltoall_stats() -> None:
    _stats.reset("sequence")


# ---------------------------------------------------------------------------------------------- validation
def check_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` naming the size and the fix unless the shapes fit ``p`` ranks and ``chunks``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [batch, seq_local, heads, head_dim]; got dims {q.dim()}, {k.dim()}, "
                         f"{v.dim()}")
    b, s, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch={b}, seq_local={s}, "
                         f"kv_heads, head_dim={d}] like q {tuple(q.shape)}")
    hk = k.shape[2]
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}; chunks is an integer >= 1")
    if h % hk:
        raise ValueError(f"heads {h} is not divisible by kv_heads {hk}; GQA needs kv_heads to divide heads")
    if h < p:
        raise ValueError(f"heads {h} over sp size {p}: every rank of the all-to-all needs a query head, so no split "
                         f"exists; use an sp group of at most {h} ranks (ring attention takes the rest: "
                         f"ring_attention, loom train --mesh.sp_ring)")
    if s % chunks:
        n = s * p
        need = -(-n // (p * chunks)) * p * chunks
        raise ValueError(f"sequence length {n} ({s} per rank) is not divisible by sp size {p} x chunks "
                         f"{chunks}; pad to {need} or change chunks")


@dataclass(frozen=True)
class HeadPlan:
    """Which heads each of ``p`` ranks holds after the all-to-all, for ``heads`` query and ``kv_heads`` kv heads.

    Rank ``r`` gets the contiguous query heads ``[q_start[r], q_start[r] + q[r])`` (``heads / p`` each; when
    ``p`` does not divide ``heads`` the first ``heads % p`` ranks get one more) and the kv heads those query
    heads read (GQA: query head ``i`` reads kv head ``i // (heads / kv_heads)``). Before the all-to-all the
    kv heads are gathered along ``kv_index`` (a kv head that two ranks read is sent to both; autograd sums its
    gradients), so both tensors split into contiguous per-rank runs of ``q[r]`` and ``kv[r]`` heads. With
    ``heads`` a multiple of ``p`` and ``kv_heads`` a multiple or divisor of ``p`` this is Ulysses' even split
    (kv replicated ``p / kv_heads`` times). Where a rank's query heads do not read its kv heads in equal groups
    (uneven splits), :meth:`local_map` expands its kv heads to one per query head.
    """

    q: tuple[int, ...]
    kv: tuple[int, ...]
    kv_index: tuple[int, ...] | None  # None: the identity (kv heads split evenly as they are)
    maps: tuple[tuple[int, ...] | None, ...]  # per rank: its query heads' local kv head, None if uniform GQA

    @staticmethod
    def make(heads: int, kv_heads: int, p: int) -> "HeadPlan":
        base, extra = divmod(heads, p)
        q = tuple(base + (r < extra) for r in range(p))
        g = heads // kv_heads
        idx: list[int] = []
        kv, maps = [], []
        start = 0
        for r in range(p):
            lo, hi = start // g, (start + q[r] - 1) // g + 1
            idx.extend(range(lo, hi))
            kv.append(hi - lo)
            local = tuple((start + i) // g - lo for i in range(q[r]))
            uniform = q[r] % kv[-1] == 0 and local == tuple(i // (q[r] // kv[-1]) for i in range(q[r]))
            maps.append(None if uniform else local)
            start += q[r]
        return HeadPlan(q, tuple(kv), None if idx == list(range(kv_heads)) else tuple(idx), tuple(maps))

    @property
    def even(self) -> bool:
        return len(set(self.q)) == 1 and len(set(self.kv)) == 1 and not any(self.maps)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[B, s, kv_heads, D]`` -> ``[B, s, sum(kv), D]``: each rank's kv heads in rank order."""
        if self.kv_index is None:
            return k, v
        idx = torch.tensor(self.kv_index, device=k.device)
        return k.index_select(2, idx), v.index_select(2, idx)

    def local_map(self, rank: int, device) -> torch.Tensor | None:
        """Index of the local kv head each local query head reads, or None where GQA groups are equal."""
        m = self.maps[rank]
        return None if m is None else torch.tensor(m, device=device)


def _head_plan(q: torch.Tensor, k: torch.Tensor, p: int) -> HeadPlan:
    return HeadPlan.make(q.shape[2], k.shape[2], p)


# ---------------------------------------------------------------------------------------------- layouts
def _pieces(n: int, p: int, chunks: int, what: str) -> int:
    if n % (p * chunks):
        need = -(-n // (p * chunks)) * p * chunks
        raise ValueError(f"{what} length {n} is not divisible by sp size {p} x chunks {chunks}; pad to {need} "
                         f"or change chunks")
    return n // (p * chunks)


def shard_sequence(x: torch.Tensor, comm, *, chunks: int = 1, dim: int = 1, ring: int = 1) -> torch.Tensor:
    """This rank's shard of a global tensor along ``dim`` in the FPDT layout (``chunks=1``: Ulysses).

    Args:
        x: the global tensor (the same on every rank).
        comm: the sequence-parallel communicator (only ``rank``/``size`` are read).
        chunks: chunks per rank ``u``; rank ``r`` gets pieces ``r, r+P, ...`` of ``u P`` equal pieces.
        dim: the sequence dim.
        ring: ring degree ``R`` of 2-D sequence parallelism (:func:`ring_attention`); ``R > 1`` gives the
            zig-zag layout of :func:`ring_positions` (FPDT's ``chunks`` inside each ring group).

    Returns:
        A new contiguous tensor with ``x.shape[dim] / P`` entries along ``dim``.
    """
    dim = dim % x.dim()
    p, r = comm.size, comm.rank
    if ring > 1:
        return x.index_select(dim, ring_positions(x.shape[dim], p, ring, r, chunks=chunks,
                                                  device=x.device)).contiguous()
    c = _pieces(x.shape[dim], p, chunks, "sequence")
    y = x.unflatten(dim, (chunks, p, c)).select(dim + 1, r)
    return y.flatten(dim, dim + 1).contiguous()


def gather_sequence(x_local: torch.Tensor, comm, *, chunks: int = 1, dim: int = 1, ring: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (inverse of :func:`shard_sequence`; one allgather).

    Not differentiable: it is for checking results against single-process references and for logging.
    """
    dim = dim % x_local.dim()
    p = comm.size
    s = x_local.shape[dim]
    if s % chunks:
        raise ValueError(f"local length {s} along dim {dim} is not divisible by chunks {chunks}")
    c = s // chunks
    x0 = x_local.detach().movedim(dim, 0).contiguous()
    allx = comm.allgather(x0) if p > 1 else x0  # [P * u * c, ...] rank-major
    rest = allx.shape[1:]
    if ring > 1:
        where = torch.cat([ring_positions(p * s, p, ring, r, chunks=chunks, device=allx.device) for r in range(p)])
        y = torch.empty_like(allx)
        y[where] = allx
    else:
        y = allx.reshape(p, chunks, c, *rest).transpose(0, 1).reshape(p * s, *rest)
    return y.movedim(0, dim).contiguous()


def local_positions(seq_local: int, comm, *, chunks: int = 1, device=None, ring: int = 1) -> torch.Tensor:
    """Global token positions (int64) of this rank's ``seq_local`` tokens in the layout of ``chunks`` (RoPE)."""
    p, r = comm.size, comm.rank
    if ring > 1:
        return ring_positions(seq_local * p, p, ring, r, chunks=chunks, device=device)
    if seq_local % chunks:
        raise ValueError(f"local length {seq_local} is not divisible by chunks {chunks}")
    c = seq_local // chunks
    starts = (torch.arange(chunks, device=device) * p + r) * c
    return (starts[:, None] + torch.arange(c, device=device)[None, :]).reshape(-1)


def ring_positions(n: int, p: int, ring: int, rank: int, *, chunks: int = 1, device=None) -> torch.Tensor:
    """Global positions (int64) of the tokens that sp rank ``rank`` holds in the zig-zag layout of 2-D sequence
    parallelism: ``p = U x ring`` ranks, rank ``r = j U + i`` is Ulysses rank ``i`` of ring group ``j``.

    The sequence of ``n`` tokens is cut into ``2 ring`` pieces of ``n / (2 ring)``; ring group ``j`` holds
    pieces ``j`` (front) and ``2 ring - 1 - j`` (back), so causal work is the same in every group (its two
    query pieces see ``2 ring + 1`` key pieces between them, the two diagonal ones half). Inside a group the
    concatenation ``[front, back]`` (``n / ring`` tokens) is laid out over its ``U`` ranks as
    :func:`shard_sequence` lays out a sequence (contiguous for ``chunks=1``; FPDT's round-robin chunks
    otherwise), so the group's all-to-all gives every rank ``[front, back]`` in order.

    Raises:
        ValueError: ``n`` not divisible by ``2 ring`` and by ``p x chunks`` (the message names the length to pad
            to).
    """
    if p % ring:
        raise ValueError(f"sp size {p} is not divisible by ring {ring}; the ring degree divides the sp size")
    unit = math.lcm(2 * ring, p * chunks)
    if n % unit:
        need = -(-n // unit) * unit
        raise ValueError(f"sequence length {n} is not divisible by 2 x ring {ring} and by sp size {p} x chunks "
                         f"{chunks} (zig-zag layout); pad to {need}")
    u = p // ring
    j, i = divmod(rank, u)
    c, half = n // (p * chunks), n // (2 * ring)
    m = ((torch.arange(chunks, device=device) * u + i) * c)[:, None] + torch.arange(c, device=device)[None, :]
    m = m.reshape(-1)
    return torch.where(m < half, j * half + m, (2 * ring - 1 - j) * half + (m - half))


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


# ---------------------------------------------------------------------------------------------- Ulysses
def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm,
    *,
    causal: bool = True,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """DeepSpeed-Ulysses attention over the sequence shards of ``comm``.

    Plan: one packed all-to-all (q, k, v) from sequence- to head-sharding, SDPA over the full sequence for
    ``H / P`` heads, one all-to-all of the output back (backward: the mirror image, 2 all-to-alls).

    Args:
        q: ``[batch, seq_local, heads, head_dim]``, this rank's contiguous sequence shard.
        k: ``[batch, seq_local, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
        v: like ``k``.
        comm: the sequence-parallel communicator (``P = comm.size``).
        causal: causal mask over global positions.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        doc_ids: packed sequences: ``[batch, seq_local]`` document ids; attention stays within a document
            (an explicit ``[seq, seq]`` mask, so memory grows with the square of the sequence).

    Returns:
        ``[batch, seq_local, heads, head_dim]``, equal to single-process SDPA on the gathered tensors.

    Raises:
        ValueError: heads not divisible by ``P``, kv_heads neither a multiple nor a divisor of ``P``.
    """
    p = comm.size
    check_sizes(q, k, v, p, 1)
    qh, kh, vh, plan = _to_heads(q, k, v, comm)
    doc = _global_docs(doc_ids, q, comm, 1)
    mask = None
    if doc is not None:
        mask = doc[:, None, :, None] == doc[:, None, None, :]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    o = F.scaled_dot_product_attention(qh.transpose(1, 2), kh.transpose(1, 2), vh.transpose(1, 2),
                                       attn_mask=mask, is_causal=causal and mask is None, scale=scale,
                                       enable_gqa=qh.shape[2] != kh.shape[2]).transpose(1, 2)
    return _to_seq(o, comm, plan)


# ---------------------------------------------------------------------------------------------- ring
_GROUPS: dict[tuple[int, int], tuple] = {}


def ring_groups(comm, ring: int):
    """``(ulysses, ring)`` communicators of 2-D sequence parallelism over ``comm`` (made once, then cached).

    sp rank ``r = j U + i`` (``U = comm.size / ring``) is rank ``i`` of Ulysses group ``j`` (consecutive ranks:
    the all-to-all is the heavier traffic) and rank ``j`` of ring ``i``. Collective on first use. Both record
    the bytes they send (all-to-alls, ring ``isend``) under ``comm``'s name, the sp axis of ``loom.comm.stats()``.
    """
    p = comm.size
    if not isinstance(ring, int) or isinstance(ring, bool) or ring < 1 or p % ring:
        raise ValueError(f"ring={ring!r} with sp size {p}: the ring degree is an integer >= 1 dividing the sp size")
    key = (id(comm), ring)
    got = _GROUPS.get(key)
    if got is None or got[0] is not comm:
        u = p // ring
        j, i = divmod(comm.rank, u)
        uly = comm.split(j, i, name=f"{comm.name}.ulysses")
        rng = comm.split(i, j, name=f"{comm.name}.ring")
        uly.bytes_sent = rng.bytes_sent = comm.bytes_sent  # their bytes count under the sp axis (loom.stats)
        got = _GROUPS[key] = (comm, uly, rng)  # comm kept alive, so its id is not reused
    return got[1], got[2]


def _ring_block(j: int, src: int, c: int, causal: bool):
    """Which rows of ring rank ``j``'s queries meet which columns of ring rank ``src``'s keys, zig-zag layout
    (local ``[front, back]`` of ``2c`` tokens): ``(rows, cols, causal)``. The diagonal block is causal as
    is (front before back); an earlier group's front is seen whole, its back not at all; a later group's
    front and back are seen whole by this group's back only."""
    every = slice(None)
    if not causal:
        return every, every, False
    if src == j:
        return every, every, True
    if src < j:
        return every, slice(0, c), False
    return slice(c, None), every, False


class _RingAttention(torch.autograd.Function):
    """Ring attention over ``comm`` (the ring axis) on head-layout ``[B, 2c, h, D]`` q/k/v (zig-zag layout).

    Forward, ``R`` steps: step ``t`` attends to the K/V block of ring rank ``j - t`` while that block goes on
    to rank ``j + 1`` and the next one comes from ``j - 1`` (one packed (k, v) isend/irecv pair, posted before
    the block's attention and waited after it); blocks merge through their log-sum-exp (:func:`merge`).
    Backward (as FlashAttention-2 over a ring): K/V go round again; each step adds this rank's exact block
    gradients (from the merged out and log-sum-exp) to dq and to the (dk, dv) accumulator that travels with
    that K/V block one step behind it; after ``R`` steps every accumulator is back at its owner.
    """

    @staticmethod
    def forward(ctx, q, k, v, comm, causal, scale, docs):
        r, j = comm.size, comm.rank
        kernel = attention_kernel(q.device)
        qt, kt, vt = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        c = qt.shape[2] // 2
        kv = torch.stack([kt, vt])
        o_acc = l_acc = None
        for t in range(r):
            src = (j - t) % r
            reqs = _ring_pass(comm, kv, 0) if t + 1 < r else None
            rows, cols, diag = _ring_block(j, src, c, causal)
            bd = None if docs is None else (docs[j][:, rows], docs[src][:, cols])
            o, lse = _block_forward(qt[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], diag, scale, kernel, bd)
            if o_acc is None:  # step 0 is the diagonal block: every row
                o_acc, l_acc = _merge(None, None, o, lse)
            else:
                o_acc[:, :, rows], l_acc[:, :, rows] = _merge(o_acc[:, :, rows], l_acc[:, :, rows], o, lse)
            del o, lse
            if reqs is not None:
                kv = _ring_wait(reqs)
        out = o_acc.to(q.dtype)
        ctx.save_for_backward(qt, kt, vt, out, l_acc)
        ctx.comm, ctx.causal, ctx.scale, ctx.docs, ctx.kernel = comm, causal, scale, docs, kernel
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, gout):
        qt, kt, vt, out, lse = ctx.saved_tensors
        comm, causal, scale, docs, kernel = ctx.comm, ctx.causal, ctx.scale, ctx.docs, ctx.kernel
        r, j = comm.size, comm.rank
        c = qt.shape[2] // 2
        do = gout.transpose(1, 2).to(qt.dtype).contiguous()
        acc = _acc_dtype(qt.dtype)
        dq = torch.zeros(qt.shape, dtype=acc, device=qt.device)
        kv = torch.stack([kt, vt])
        sent = []
        dkv = None
        for t in range(r):
            src = (j - t) % r
            reqs = _ring_pass(comm, kv, 0) if t + 1 < r else None
            incoming = None
            if t > 0:  # the accumulator of block src, from the rank that held it at step t - 1
                incoming = comm.irecv(torch.empty((2, *kt.shape), dtype=acc, device=kt.device), (j - 1) % r, 1)
            rows, cols, diag = _ring_block(j, src, c, causal)
            bd = None if docs is None else (docs[j][:, rows], docs[src][:, cols])
            g_q, g_k, g_v = _block_backward(do[:, :, rows], qt[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols],
                                            out[:, :, rows], lse[:, :, rows], diag, scale, kernel, bd)
            dq[:, :, rows] += g_q
            dkv = incoming.wait() if incoming is not None else torch.zeros((2, *kt.shape), dtype=acc,
                                                                           device=kt.device)
            dkv[0][:, :, cols] += g_k
            dkv[1][:, :, cols] += g_v
            del g_q, g_k, g_v
            _wait_all(sent)
            sent = [comm.isend(dkv, (j + 1) % r, 1)]
            if reqs is not None:
                kv = _ring_wait(reqs)
        mine = comm.irecv(torch.empty_like(dkv), (j - 1) % r, 1).wait()  # after R passes: this rank's own
        _wait_all(sent)
        ctx.comm = ctx.docs = None
        dq, dk, dv = (g.to(qt.dtype).transpose(1, 2) for g in (dq, mine[0], mine[1]))
        return dq, dk, dv, None, None, None, None


def _ring_docs(full: torch.Tensor, p: int, ring: int) -> list[torch.Tensor]:
    """Every ring group's ``[front, back]`` document ids ``[B, n / ring]`` (:func:`ring_positions`) from the global
    ids ``full`` ``[B, n]``: what the group's all-to-all puts in order on each of its ranks."""
    n, u = full.shape[1], p // ring
    return [full[:, torch.cat([ring_positions(n, p, ring, g * u + i, device=full.device) for i in range(u)])]
            for g in range(ring)]


def _row_unique(doc: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, n]`` made unique per batch row (equal within a row exactly where ``doc`` is), so that
    one ``isin`` over flattened rows tests whether any two tokens of the same row share a document."""
    lo, hi = doc.amin(), doc.amax()
    return (doc - lo) + torch.arange(doc.shape[0], device=doc.device)[:, None] * (hi - lo + 1)


def _ring_pass(comm, x: torch.Tensor, tag: int):
    """Send ``x`` to the next ring rank and receive the previous one's into a new buffer (non-blocking)."""
    r, j = comm.size, comm.rank
    nxt = torch.empty_like(x)
    return [comm.isend(x, (j + 1) % r, tag), comm.irecv(nxt, (j - 1) % r, tag)], nxt


def _ring_hand_over(store, held: tuple[int, int], visiting: bool, reqs, nxt: list) -> None:
    """One chunk's ring step done: free the K/V chunk ``held`` if it was a visiting group's (this rank's own stay
    for backward), and keep the chunk the ring brought in (``reqs``) in ``store`` for the next step (``nxt``)."""
    if visiting:
        store.free(held[0])
        store.free(held[1])
    if reqs is not None:
        kv = _ring_wait(reqs)
        nxt.append((store.put(kv[0]), store.put(kv[1])))


def _ring_wait(reqs) -> torch.Tensor:
    pending, nxt = reqs
    _wait_all(pending)
    _stats.add("sequence", "sp", ring=1)
    return nxt


def _ring_take(reqs) -> torch.Tensor:
    """What a :func:`_ring_pass` received, its send and receive done (not counted as a K/V pass)."""
    pending, nxt = reqs
    _wait_all(pending)
    return nxt


def _wait_all(reqs) -> None:
    for q in reqs:
        q.wait()


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm,
    *,
    ring: int,
    causal: bool = True,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """2-D sequence parallelism (Ulysses x ring, as USP): sp degree past the head count.

    Plan: ``comm`` (``P`` ranks) is ``ring`` groups of ``U = P / ring`` consecutive ranks (:func:`ring_groups`).
    One packed all-to-all (q, k, v) inside each group from sequence- to head-sharding gives each rank its
    group's ``[front, back]`` tokens (:func:`ring_positions`) for ``H / U`` heads; ring attention
    (:class:`_RingAttention`) across the ``ring`` groups among the ranks holding the same heads, ``ring`` K/V
    steps each overlapped with one block's attention; one all-to-all of the output back. Backward mirrors it
    (the all-to-alls swap, the ring passes K/V and the (dk, dv) accumulators). ``ring=1`` is
    :func:`ulysses_attention`.

    Args:
        q: ``[batch, seq_local, heads, head_dim]`` in the layout of ``shard_sequence(x, comm, ring=ring)``.
        k: ``[batch, seq_local, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
        v: like ``k``.
        comm: the sequence-parallel communicator.
        ring: the ring degree ``R`` (divides ``P``; ``heads`` must split over ``U = P / R``).
        causal: causal mask over global positions (the zig-zag layout balances it over the ring).
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        doc_ids: packed sequences: ``[batch, seq_local]`` document ids in the same layout.

    Returns:
        ``[batch, seq_local, heads, head_dim]``, equal to single-process SDPA on the gathered tensors.
    """
    if ring == 1:
        return ulysses_attention(q, k, v, comm, causal=causal, scale=scale, doc_ids=doc_ids)
    p = comm.size
    uly, rng = ring_groups(comm, ring)
    u = uly.size
    check_sizes(q, k, v, u, 1)
    ring_positions(q.shape[1] * p, p, ring, comm.rank)  # validates the length
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    qh, kh, vh, plan = _to_heads(q, k, v, uly)
    docs = None
    if doc_ids is not None:  # every ring group's [front, back] document ids
        if tuple(doc_ids.shape) != tuple(q.shape[:2]):
            raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [batch, seq_local] = {tuple(q.shape[:2])}")
        docs = _ring_docs(gather_sequence(doc_ids.to(torch.int64), comm, ring=ring).to(q.device), p, ring)
    o = _RingAttention.apply(qh, kh, vh, rng, bool(causal), float(scale), docs)
    return _to_seq(o, uly, plan)


# ---------------------------------------------------------------------------------------------- FPDT
class FPDTPipeline:
    """The FPDT chunk pipeline over local chunks, driven by callbacks (see the module docstring for the plan).

    :func:`fpdt_attention` feeds it slices of given q/k/v; ``loom.models.llama`` feeds it chunk-wise q/k/v
    projections so that a whole attention sublayer runs chunk by chunk. Only chunk-store handles are kept
    between forward and backward: head-layout q/k/v/out chunks and the log-sum-exp.

    Args:
        comm: the sequence-parallel communicator.
        chunks: ``u``, local chunks per rank.
        causal: causal mask over global positions.
        scale: softmax scale.
        store: a chunk store (:func:`loom.parallel.offload.chunk_store`).
        device: where the chunks are computed (selects the block kernel).
    """

    def __init__(self, comm, chunks: int, causal: bool, scale: float, store, device: torch.device,
                 doc: torch.Tensor | None = None, plan: HeadPlan | None = None):
        self.comm, self.u, self.causal, self.scale, self.store = comm, chunks, causal, scale, store
        # uneven head splits (HeadPlan): the all-to-alls' per-rank head counts and this rank's kv expansion
        even = plan is None or plan.even
        self.qc = None if even else (plan.q,)
        self.qkvc = None if even else (plan.q, plan.kv, plan.kv)
        self.kvc = None if even else (plan.kv, plan.kv)
        self.map = None if even else plan.local_map(comm.rank, device)
        self.kv_local = None if even else plan.kv[comm.rank]
        self.kernel = attention_kernel(device)
        self.doc = doc  # global document ids [B, n] (packed sequences) or None
        self._seen: list[list[bool]] | None = None
        self.hq: list[int] = []
        self.hk: list[int] = []
        self.hv: list[int] = []
        self.ho: list[int] = []
        self.hl: list[int] = []

    def docs(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(doc_q, doc_k)``: the document ids of global chunks ``i`` (queries) and ``j`` (keys), or None."""
        if self.doc is None:
            return None
        n = self.doc.shape[1] // self.u
        return self.doc[:, i * n:(i + 1) * n], self.doc[:, j * n:(j + 1) * n]

    def sees(self, i: int, j: int) -> bool:
        """Whether any query of chunk ``i`` may attend to a key of chunk ``j`` (packed documents; always True
        without). The table is made once per pipeline: one host sync, not one per block."""
        if self.doc is None:
            return True
        if self._seen is None:
            b, u = self.doc.shape[0], self.u
            # ids made unique per batch row, so one isin per pair of chunks tests every row at once
            d = _row_unique(self.doc).reshape(b, u, -1).transpose(0, 1).reshape(u, -1)
            seen = torch.stack([torch.stack([torch.isin(d[i], d[j]).any() for j in range(u)]) for i in range(u)])
            self._seen = seen.tolist()
        return self._seen[i][j]

    def forward(self, get_qkv, emit_out) -> None:
        """``get_qkv(i)`` -> local chunk ``(q_i, k_i, v_i)`` ``[B, c, heads|kv_heads, D]`` (kv already split-able
        over ``P``); ``emit_out(i, o_i)`` receives output chunk ``i`` in the local layout ``[B, c, heads, D]``."""
        u, store, comm, causal = self.u, self.store, self.comm, self.causal
        hq, hk, hv, ho, hl = self.hq, self.hk, self.hv, self.ho, self.hl

        def scatter(i):
            return self._scatter(get_qkv(i))

        def attend(i, qi, own_kv):
            js = list(range(i + 1)) if causal else list(range(u))
            o_acc = l_acc = None
            for n, j in enumerate(js):
                if own_kv is not None and j == i:
                    kj, vj = own_kv
                else:
                    kj, vj = store.get(hk[j]), store.get(hv[j])
                if n + 1 < len(js) and not (own_kv is not None and js[n + 1] == i):
                    store.prefetch(hk[js[n + 1]])  # double buffering: the next kv chunk is on its way
                    store.prefetch(hv[js[n + 1]])
                if not self.sees(i, j):
                    continue  # no query of chunk i sees a key of chunk j (other documents)
                o, l = _block_forward(qi, kj, vj, causal and j == i, self.scale, self.kernel, self.docs(i, j))
                o_acc, l_acc = _merge(o_acc, l_acc, o, l)
                del kj, vj, o, l
            oi = o_acc.to(qi.dtype)
            ho.append(store.put(oi))
            hl.append(store.put(l_acc))
            (o_seq,) = _h2s([oi.transpose(1, 2)], comm, self.qc)
            emit_out(i, o_seq)

        if causal:
            for i in range(u):
                qi, ki, vi = scatter(i)
                attend(i, qi, (ki, vi))
                del qi, ki, vi
        else:
            for i in range(u):
                scatter(i)
            for i in range(u):
                if i + 1 < u:
                    store.prefetch(hq[i + 1])
                attend(i, store.get(hq[i]), None)

    def backward(self, get_dout, emit_grads) -> None:
        """``get_dout(i)`` -> the output gradient of local chunk ``i``; ``emit_grads(j, dq_j, dk_j, dv_j)``
        receives the input gradients of local chunk ``j`` (local layout), in increasing ``j``."""
        u, store, comm, causal = self.u, self.store, self.comm, self.causal
        hq, hk, hv, ho, hl = self.hq, self.hk, self.hv, self.ho, self.hl
        hdo = self._emit_dout(get_dout)
        hdq: list[int | None] = [None] * u
        parked: list[tuple[int, int]] = []
        for j in range(u):
            kj, vj = store.get(hk[j]), store.get(hv[j])
            acc = _acc_dtype(kj.dtype)
            dtype = kj.dtype
            dk_j = dv_j = None
            irange = list(range(j, u)) if causal else list(range(u))
            for n, i in enumerate(irange):
                if n + 1 < len(irange):
                    nxt = irange[n + 1]
                    for hs in (hq, ho, hl, hdo):
                        store.prefetch(hs[nxt])
                    if hdq[nxt] is not None:
                        store.prefetch(hdq[nxt])
                qi, oi, li, doi = store.get(hq[i]), store.get(ho[i]), store.get(hl[i]), store.get(hdo[i])
                if not self.sees(i, j):
                    g_q = torch.zeros_like(qi, dtype=acc)
                    g_k = g_v = torch.zeros_like(kj, dtype=acc)
                else:
                    g_q, g_k, g_v = _block_backward(doi, qi, kj, vj, oi, li, causal and i == j, self.scale,
                                                    self.kernel, self.docs(i, j))
                del qi, oi, li, doi
                dk_j = g_k.to(acc) if dk_j is None else dk_j + g_k
                dv_j = g_v.to(acc) if dv_j is None else dv_j + g_v
                if hdq[i] is None:
                    hdq[i] = store.put(g_q.to(acc))
                else:
                    store.replace(hdq[i], store.get(hdq[i]) + g_q)
                del g_q, g_k, g_v
            sends = [self._fold_kv(dk_j).to(dtype).transpose(1, 2), self._fold_kv(dv_j).to(dtype).transpose(1, 2)]
            del kj, vj, dk_j, dv_j
            if causal:  # dq_j got its last contribution from kv chunk j: send it with dk_j, dv_j
                sends.insert(0, store.pop(hdq[j]).to(dtype).transpose(1, 2))
                hdq[j] = None
                dq_j, dk_j, dv_j = _h2s(sends, comm, self.qkvc)
                del sends
                emit_grads(j, dq_j, dk_j, dv_j)
            else:  # dq_j is complete only after the last kv chunk: park dk_j, dv_j
                dk_j, dv_j = _h2s(sends, comm, self.kvc)
                del sends
                parked.append((store.put(dk_j), store.put(dv_j)))
            del dk_j, dv_j
        if not causal:
            for i in range(u):
                (dq_i,) = _h2s([store.pop(hdq[i]).to(dtype).transpose(1, 2)], comm, self.qc)
                emit_grads(i, dq_i, store.pop(parked[i][0]), store.pop(parked[i][1]))
        self.release()
        for h in hdo:
            store.free(h)

    def _scatter(self, qkv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One packed all-to-all of a local chunk's (q, k, v); the head-layout chunks go to the store."""
        qi, ki, vi = _s2h(qkv, self.comm, self.qkvc)
        if self.map is not None:  # unequal GQA groups on this rank: one kv head per query head
            ki, vi = ki.index_select(2, self.map), vi.index_select(2, self.map)
        # SDPA layout [B, heads, P c, D], contiguous so that the chunk store moves one block.
        qi, ki, vi = (t.transpose(1, 2).contiguous() for t in (qi, ki, vi))
        self.hq.append(self.store.put(qi))
        self.hk.append(self.store.put(ki))
        self.hv.append(self.store.put(vi))
        return qi, ki, vi

    def _emit_dout(self, get_dout) -> list[int]:
        """Store handles of every chunk's output gradient in head layout (one all-to-all each)."""
        hdo = []
        for i in range(self.u):
            (doi,) = _s2h([get_dout(i)], self.comm, self.qc)
            hdo.append(self.store.put(doi.transpose(1, 2).contiguous()))
            del doi
        return hdo

    def _fold_kv(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient of this rank's expanded kv heads ``[B, h, L, D]`` summed back to its own kv heads."""
        if self.map is None:
            return g
        out = g.new_zeros(g.shape[0], self.kv_local, *g.shape[2:])
        return out.index_add_(1, self.map, g)

    def release(self) -> None:
        """Free every saved chunk (after backward, or when the graph is dropped)."""
        for hs in (self.hq, self.hk, self.hv, self.ho, self.hl):
            for h in hs:
                self.store.free(h)
            hs.clear()


class FPDTRingPipeline(FPDTPipeline):
    """FPDT's chunk pipeline inside each Ulysses group, ring attention across the groups (2-D sequence
    parallelism with FPDT's memory: no sequence-sized tensor beyond one group's K/V chunks in the store).

    Forward: every local chunk's (q, k, v) goes through the group's all-to-all into the chunk store (FPDT).
    Then ``R`` ring steps, q chunk outer and K/V chunk inner (as FPDT's forward): step ``t`` attends q chunk
    ``a`` to every K/V chunk of ring group ``j - t`` (from the store) while K/V chunk ``a`` goes on to group
    ``j + 1`` and the next group's arrives (isend/irecv posted before q chunk ``a``'s blocks and waited after the
    next one's, into the store: two passes in flight at most), merging into q chunk ``a``'s (out,
    log-sum-exp) accumulator, which waits in the store between steps: one q chunk's on the device at a time,
    as FPDT's (holding every chunk's, one fp32 copy of the rank's attention output, set the peak where the
    attention does; ``check_fpdt_ring_memory_linear`` bounds the ring's peak by FPDT's on one rank at 1/R of
    the length); the outputs are complete after the last step, and go back through the all-to-all.
    Backward mirrors it (K/V passes waited one chunk later alike), each K/V chunk's (dk, dv) accumulator going
    on with it once this rank's blocks are added (sent after the chunk's blocks, waited after the next chunk's,
    kept in the store till the next step: two in flight at most, never one per chunk). Zig-zag blocks: ring
    group ``j``'s chunk sequence is its ``[front, back]``, so an earlier group's K/V chunks are seen up to its
    front half, a later group's by this group's back half.
    Packed documents: every group's ``[front, back]`` document ids are known to every rank (one allgather, as
    :func:`ring_attention`), so a visiting K/V chunk's ids are looked up by its group and chunk index beside it;
    blocks that no query can see are skipped.

    Args:
        comm: the sequence-parallel communicator (``U x R`` ranks, :func:`ring_groups`).
        ring: ``R``.
        doc: packed documents: global document ids ``[B, n]`` in sequence order, or None.
        Others as :class:`FPDTPipeline` (``plan`` over the Ulysses group).
    """

    def __init__(self, comm, ring: int, chunks: int, causal: bool, scale: float, store, device: torch.device,
                 plan: HeadPlan | None = None, doc: torch.Tensor | None = None):
        uly, rng = ring_groups(comm, ring)
        super().__init__(uly, chunks, causal, scale, store, device, None, plan)
        self.ring = rng
        # each ring group's [front, back] ids, unique per batch row (so that one isin tests a whole block)
        self.rdocs = None if doc is None else _ring_docs(_row_unique(doc), comm.size, ring)
        self._ring_seen: dict[tuple[int, int, int], bool] | None = None

    def _blk(self, src: int, a: int, b: int, rows: int):
        """:meth:`_block` with the block's ``(doc_q, doc_k)`` (packed documents; else None) appended, or None
        where the block is empty or no query of it shares a document with a key of it."""
        blk = self._block(src, a, b, rows)
        if blk is None or self.rdocs is None:
            return None if blk is None else (*blk, None)
        if self._ring_seen is None:  # one host sync per pipeline
            keys = [(s, i, k) for s in range(self.ring.size) for i in range(self.u) for k in range(self.u)
                    if self._block(s, i, k, rows) is not None]
            seen = [torch.isin(*(d.reshape(-1) for d in self._block_docs(*key, rows))).any() for key in keys]
            self._ring_seen = dict(zip(keys, torch.stack(seen).tolist()))
        # a q chunk's diagonal block is never skipped, so its first block in forward covers all its rows
        return (*blk, self._block_docs(src, a, b, rows)) if self._ring_seen[(src, a, b)] else None

    def _block_docs(self, src: int, a: int, b: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Document ids of the rows of q chunk ``a`` (this group) and the columns of K/V chunk ``b`` of ring group
        ``src`` that the block pairs (:meth:`_block`)."""
        ra, cb, _ = self._block(src, a, b, rows)
        mine, theirs = self.rdocs[self.ring.rank], self.rdocs[src]
        return mine[:, a * rows:(a + 1) * rows][:, ra], theirs[:, b * rows:(b + 1) * rows][:, cb]

    def _block(self, src: int, a: int, b: int, rows: int):
        """``(rows, cols, causal)`` of q chunk ``a`` against K/V chunk ``b`` of ring group ``src``, or None."""
        j, every = self.ring.rank, slice(None)
        if not self.causal:
            return every, every, False
        half = self.u * rows // 2
        if src == j:
            return None if b > a else (every, every, a == b)
        if src < j:  # its front half only
            n = max(0, min(rows, half - b * rows))
            return None if n == 0 else (every, slice(0, n), False)
        r0 = max(0, min(rows, half - a * rows))  # a later group: seen by this group's back half
        return None if r0 == rows else (slice(r0, None), every, False)

    def forward(self, get_qkv, emit_out) -> None:
        u, store, rc = self.u, self.store, self.ring
        r, j = rc.size, rc.rank
        for i in range(u):
            qi, _, _ = self._scatter(get_qkv(i))
        rows, dtype = qi.shape[2], qi.dtype
        del qi
        # Each q chunk's (out, log-sum-exp) accumulator waits in the store between ring steps: one q chunk's on
        # the device at a time, as FPDT's, not every chunk's (that fp32 copy of the rank's attention output set
        # the peak where the attention, not the LM head, does: 1.54x FPDT's longest at ring 2).
        hacc: list[tuple[int, int] | None] = [None] * u
        kvs = list(zip(self.hk, self.hv))
        for t in range(r):
            src, nxt, pending, last = (j - t) % r, [], None, t + 1 == r
            for a in range(u):
                # K/V chunk a goes on to the next group while q chunk a meets this step's chunks, waited after
                # the next q chunk's blocks: two passes in flight at most
                reqs = None if last else _ring_pass(rc, torch.stack([store.get(h) for h in kvs[a]]), 0)
                acc = self._ring_attend(a, src, rows, kvs, None if hacc[a] is None else hacc[a])
                if last:
                    self._emit_ring_out(a, acc, dtype, emit_out)
                else:
                    hacc[a] = (store.put(acc[0]), store.put(acc[1]))
                del acc
                if pending is not None:
                    _ring_hand_over(store, (), False, pending, nxt)
                pending = reqs
            _ring_hand_over(store, (), False, pending, nxt)
            if t > 0:  # the visiting group's chunks are done with (this rank's own stay for backward)
                for h in (h for kv in kvs for h in kv):
                    store.free(h)
            kvs = nxt

    def _ring_attend(self, a: int, src: int, rows: int, kvs, hacc) -> tuple[torch.Tensor, torch.Tensor]:
        """q chunk ``a`` against every K/V chunk ``kvs`` of ring group ``src``, merged into its accumulator (from
        the store at ``hacc``, popped; a new one at the first step, whose first block covers all its rows)."""
        store = self.store
        o_acc, l_acc = (None, None) if hacc is None else (store.pop(hacc[0]), store.pop(hacc[1]))
        qa = store.get(self.hq[a])
        for b in range(len(kvs)):
            blk = self._blk(src, a, b, rows)
            if blk is None:
                continue
            ra, cb, diag, bd = blk
            kb, vb = store.get(kvs[b][0]), store.get(kvs[b][1])
            o, lse = _block_forward(qa[:, :, ra], kb[:, :, cb], vb[:, :, cb], diag, self.scale, self.kernel, bd)
            del kb, vb
            if o_acc is None:
                o_acc, l_acc = _merge(None, None, o, lse)
            else:
                o_acc[:, :, ra], l_acc[:, :, ra] = _merge(o_acc[:, :, ra], l_acc[:, :, ra], o, lse)
            del o, lse
        return o_acc, l_acc

    def _emit_ring_out(self, a: int, acc, dtype, emit_out) -> None:
        """Q chunk ``a``'s output, complete after the last ring step: saved for backward with its log-sum-exp,
        and back through the group's all-to-all."""
        oa = acc[0].to(dtype)
        self.ho.append(self.store.put(oa))
        self.hl.append(self.store.put(acc[1]))
        (o_seq,) = _h2s([oa.transpose(1, 2)], self.comm, self.qc)
        emit_out(a, o_seq)

    def backward(self, get_dout, emit_grads) -> None:
        u, store, rc = self.u, self.store, self.ring
        r, j = rc.size, rc.rank
        hdo = self._emit_dout(get_dout)
        k0 = store.get(self.hk[0])
        rows, dtype, acc, shape = k0.shape[2], k0.dtype, _acc_dtype(k0.dtype), (2, *k0.shape)
        del k0
        hdq: list[int | None] = [None] * u
        kvs = list(zip(self.hk, self.hv))
        hacc: list[int | None] = [None] * u  # the (dk, dv) accumulator of each K/V chunk held, in the store
        for t in range(r):
            src, nxt, nacc, pending, kv_pending = (j - t) % r, [], [], None, None
            for b in range(u):
                kb, vb = store.get(kvs[b][0]), store.get(kvs[b][1])
                reqs = _ring_pass(rc, torch.stack([kb, vb]), 0) if t + 1 < r else None
                dkv = torch.zeros(shape, dtype=acc, device=kb.device) if hacc[b] is None else store.pop(hacc[b])
                for a in range(u):
                    blk = self._blk(src, a, b, rows)
                    if blk is None:
                        continue
                    ra, cb, diag, bd = blk
                    qa, oa, la, doa = (store.get(h[a]) for h in (self.hq, self.ho, self.hl, hdo))
                    g_q, g_k, g_v = _block_backward(doa[:, :, ra], qa[:, :, ra], kb[:, :, cb], vb[:, :, cb],
                                                    oa[:, :, ra], la[:, :, ra], diag, self.scale, self.kernel, bd)
                    dq = torch.zeros(qa.shape, dtype=acc, device=qa.device) if hdq[a] is None else store.get(hdq[a])
                    dq[:, :, ra] += g_q
                    if hdq[a] is None:
                        hdq[a] = store.put(dq)
                    else:
                        store.replace(hdq[a], dq)
                    dkv[0][:, :, cb] += g_k
                    dkv[1][:, :, cb] += g_v
                    del qa, oa, la, doa, g_q, g_k, g_v, dq
                del kb, vb
                # The accumulator goes on with its K/V chunk and the previous rank's comes in with the next one;
                # waited one chunk later (overlapping the next chunk's blocks), kept in the store till the next
                # step: at most two in flight, not one per chunk.
                sent = _ring_pass(rc, dkv, 1)
                del dkv
                _ring_hand_over(store, kvs[b], t > 0, kv_pending, nxt)
                kv_pending = reqs
                if pending is not None:
                    nacc.append(store.put(_ring_take(pending)))
                pending = sent
            _ring_hand_over(store, (), False, kv_pending, nxt)
            nacc.append(store.put(_ring_take(pending)))
            hacc, kvs = nacc, nxt
        for b in range(u):  # after R passes each accumulator is back at its owner
            mine = store.pop(hacc[b])
            sends = [store.pop(hdq[b]).to(dtype).transpose(1, 2), *(self._fold_kv(g).to(dtype).transpose(1, 2)
                                                                   for g in (mine[0], mine[1]))]
            del mine
            dq_b, dk_b, dv_b = _h2s(sends, self.comm, self.qkvc)
            del sends
            emit_grads(b, dq_b, dk_b, dv_b)
        self.release()
        for h in hdo:
            store.free(h)


class _FPDTAttention(torch.autograd.Function):
    """:class:`FPDTPipeline` on slices of given q/k/v (the standalone :func:`fpdt_attention`)."""

    @staticmethod
    def forward(ctx, q, k, v, comm, chunks, causal, scale, offload, doc, plan, ring):
        c = q.shape[1] // chunks
        store = chunk_store(offload, q.device)
        if ring > 1:
            pipe = FPDTRingPipeline(comm, ring, chunks, causal, scale, store, q.device, plan, doc)
        else:
            pipe = FPDTPipeline(comm, chunks, causal, scale, store, q.device, doc, plan)
        out = torch.empty_like(q)

        def emit(i, o):
            out[:, i * c:(i + 1) * c] = o

        pipe.forward(lambda i: [t[:, i * c:(i + 1) * c] for t in (q, k, v)], emit)
        ctx.pipe, ctx.c = pipe, c
        ctx.shapes = (q.shape, k.shape, q.dtype)
        return out

    @staticmethod
    def backward(ctx, gout):
        qshape, kshape, dtype = ctx.shapes
        c = ctx.c
        gout = gout.to(dtype)
        dq = torch.empty(qshape, dtype=dtype, device=gout.device)
        dk = torch.empty(kshape, dtype=dtype, device=gout.device)
        dv = torch.empty(kshape, dtype=dtype, device=gout.device)

        def emit(j, gq, gk, gv):
            sl = slice(j * c, (j + 1) * c)
            dq[:, sl], dk[:, sl], dv[:, sl] = gq, gk, gv

        ctx.pipe.backward(lambda i: gout[:, i * c:(i + 1) * c], emit)
        ctx.pipe = None
        return dq, dk, dv, None, None, None, None, None, None, None, None


def fpdt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    comm,
    *,
    chunks: int,
    causal: bool = True,
    offload: bool = True,
    scale: float | None = None,
    doc_ids: torch.Tensor | None = None,
    ring: int = 1,
) -> torch.Tensor:
    """Fully pipelined distributed attention (FPDT) over the sequence shards of ``comm``.

    Args:
        q: ``[batch, seq_local, heads, head_dim]`` in the FPDT layout of ``chunks`` (see
            :func:`shard_sequence`); ``seq_local`` divisible by ``chunks``.
        k: ``[batch, seq_local, kv_heads, head_dim]``; ``kv_heads`` divides ``heads``.
        v: like ``k``.
        comm: the sequence-parallel communicator (``P = comm.size``; ``P = 1`` is chunked local attention).
        chunks: chunks per rank ``u`` (``chunks=1`` computes exactly what Ulysses computes).
        causal: causal mask over global positions.
        offload: keep saved chunks in host memory (:class:`loom.parallel.offload.HostPool`) between uses.
        scale: softmax scale, default ``1 / sqrt(head_dim)``.
        doc_ids: packed sequences: ``[batch, seq_local]`` integer document ids in the same layout; a token
            attends only to tokens of its own document (one allgather of the ids; blocks that no query can
            see are skipped).
        ring: ring degree ``R``: FPDT inside each Ulysses group of ``P / R`` ranks, ring attention across the
            groups (:class:`FPDTRingPipeline`); ``q`` etc. in ``shard_sequence(x, comm, chunks=chunks,
            ring=R)``'s layout.

    Returns:
        ``[batch, seq_local, heads, head_dim]`` in the same layout, equal to single-process SDPA on the
        gathered tensors (forward and backward).

    Raises:
        ValueError: heads or kv_heads do not split over ``P``, or the sequence is not divisible by
            ``P x chunks`` (the message names the length to pad to).
    """
    p = comm.size
    u = p
    if ring > 1:
        u = ring_groups(comm, ring)[0].size
        ring_positions(q.shape[1] * p, p, ring, comm.rank, chunks=chunks)  # validates the length
    check_sizes(q, k, v, u, chunks)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    plan = _head_plan(q, k, u)
    k, v = plan.gather_kv(k, v)
    doc = _global_docs(doc_ids, q, comm, chunks, ring)
    return _FPDTAttention.apply(q, k, v, comm, chunks, bool(causal), float(scale), bool(offload), doc, plan,
                                int(ring))


def _global_docs(doc_ids, q, comm, chunks, ring: int = 1) -> torch.Tensor | None:
    if doc_ids is None:
        return None
    if tuple(doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [batch, seq_local] = {tuple(q.shape[:2])}, in "
                         f"the same layout as q")
    return gather_sequence(doc_ids.to(torch.int64), comm, chunks=chunks, ring=ring).to(q.device)
