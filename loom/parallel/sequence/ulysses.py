"""DeepSpeed-Ulysses attention: one all-to-all to head shards, attention over the whole sequence, one back."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .alltoall import _to_heads, _to_seq
from .layout import _global_docs, check_sizes

__all__ = ["ulysses_attention"]


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
