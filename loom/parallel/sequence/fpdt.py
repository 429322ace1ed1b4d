"""fpdt_attention: FPDT (and FPDT x ring) attention on given q/k/v, an autograd function over the chunk pipelines."""

from __future__ import annotations

import math

import torch

from ..offload import chunk_store
from .fpdt_pipeline import FPDTPipeline
from .fpdt_ring import FPDTRingPipeline
from .layout import _global_docs, _head_plan, check_sizes, ring_positions
from .ring import ring_groups

__all__ = ["fpdt_attention"]


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
