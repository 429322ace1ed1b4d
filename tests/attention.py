"""The attention reference the block-kernel tests check against: plain SDPA maths with autograd."""

from __future__ import annotations

import torch

__all__ = ["sdpa_reference"]


def sdpa_reference(q, k, v, causal, docs, scale):
    """SDPA with autograd: out [B,h,Lq,D] and lse [B,h,Lq] (rows with no key: out 0, lse -inf)."""
    g = q.shape[1] // k.shape[1]
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ kr.transpose(-1, -2)) * scale
    lq, lk = q.shape[2], k.shape[2]
    keep = torch.ones(q.shape[0], lq, lk, dtype=torch.bool)
    if causal:
        keep &= torch.ones(lq, lk, dtype=torch.bool).tril()
    if docs is not None:
        keep &= docs[0][:, :, None] == docs[1][:, None, :]
    s = s.masked_fill(~keep[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse.masked_fill(torch.isinf(lse), 0)[..., None])
    return p @ vr, lse
