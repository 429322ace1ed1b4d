"""Ulysses x ring (2-D sequence parallelism, as USP): ring attention across Ulysses groups, and its K/V passes.

FPDT x ring (:mod:`.fpdt_ring`) passes its K/V chunks with the same helpers."""

from __future__ import annotations

import math

import torch

from ... import stats as _stats
from ..blocks import acc_dtype as _acc_dtype
from ..blocks import attention_kernel
from ..blocks import block_backward as _block_backward
from ..blocks import block_forward as _block_forward
from ..blocks import merge as _merge
from .alltoall import _to_heads, _to_seq
from .layout import check_sizes, gather_sequence, ring_positions
from .ulysses import ulysses_attention

__all__ = ["ring_attention", "ring_groups"]

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
