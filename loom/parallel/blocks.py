"""Attention block kernels with log-sum-exp for the FPDT pipeline (:mod:`loom.parallel.sequence`).

A block kernel computes the attention of one q block against one kv block, ``(out, lse)`` in SDPA layout
(``[B, h, L, D]``), so that blocks merge exactly through their log-sum-exp (:func:`merge`); its backward
takes the *merged* ``out`` and ``lse`` and returns that block's exact share of ``(dq, dk, dv)`` (the
softmax probabilities ``exp(s - lse)`` and ``delta = rowsum(dout * out)`` are global quantities; this is how
ring and FlashAttention-2 style pipelines run the backward of a merged attention).

Kernels (``kind`` of :func:`block_kernel`):

* ``cpu-flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype,
  masks, GQA with fewer kv heads as is);
* ``cuda-flash``: ``aten._scaled_dot_product_flash_attention`` and its backward (FlashAttention-2; fp16 and
  bf16, head_dim a multiple of 8 up to 256, no mask; GQA with fewer kv heads as is);
* ``cuda-efficient``: ``aten._scaled_dot_product_efficient_attention`` (``compute_log_sumexp=True``) and its
  backward (memory-efficient attention; fp32 too, and the additive mask of packed documents). It has no
  GQA: a non-causal unmasked block folds the ``g = heads / kv_heads`` query heads of a kv head into its
  query rows (a view, ``[B, kv_heads, g Lq, D]``), so no repeated K/V is made; a causal or masked block
  repeats K/V for its duration (``g`` times one kv block, linear in the block length). Its log-sum-exp rows
  come padded to a multiple of 32 and its mask's rows must be 16-element aligned, as torch's SDPA
  dispatcher arranges them;
* ``torch``: pure torch in the accumulation dtype (fp32; fp64 for fp64), tiled: ``TILE`` query rows
  against ``TILE`` key rows at a time with an online softmax forward and a recomputing backward, so its
  working set is a few ``[B, h, TILE, TILE]`` tiles whatever the block length. The fallback for every other
  case (fp64 on CUDA, other devices) and what ``LOOM_ATTN_KERNEL=torch`` selects.

:func:`workspace` gives each kernel's transient bytes for the dry-run memory model.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from .. import settings

__all__ = ["attention_kernel", "block_kernel", "block_forward", "block_backward", "merge", "acc_dtype",
           "allowed", "workspace", "TILE", "MASK_TILE"]

TILE = 256
"""Query rows and key rows per tile of the pure-torch kernel (its working set is ``O(TILE^2)`` per head)."""

MASK_TILE = 4096
"""Query rows and key rows per piece of a packed-document block on an SDPA kernel: the kernel takes its mask
whole (1 byte per score for the mask, 2-4 for the additive bias), so a longer block runs as pieces merged
through their log-sum-exp, and the mask is bounded by a piece, not by the block."""

_aten = torch.ops.aten


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype blocks are merged and the torch kernel computes in: fp64 for fp64 inputs, else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def attention_kernel(device: torch.device) -> str:
    """``"flash"`` (an SDPA kernel that returns the log-sum-exp) or ``"torch"`` (the tiled pure-torch kernel)
    for blocks on ``device``; ``LOOM_ATTN_KERNEL=torch`` forces the latter. Which SDPA kernel a block gets
    depends on its dtype and mask too (:func:`block_kernel`)."""
    if settings.get("attn_kernel") == "torch":
        return "torch"
    device = torch.device(device)
    if device.type == "cpu" and hasattr(_aten, "_scaled_dot_product_flash_attention_for_cpu"):
        return "flash"
    if device.type == "cuda" and hasattr(_aten, "_scaled_dot_product_efficient_attention"):
        return "flash"
    return "torch"


def block_kernel(kernel: str, device: torch.device, dtype: torch.dtype, head_dim: int, masked: bool) -> str:
    """The kernel a block runs: ``cpu-flash``, ``cuda-flash``, ``cuda-efficient`` or ``torch`` (module
    docstring). ``kernel`` is :func:`attention_kernel`'s choice for the device."""
    if kernel != "flash":
        return "torch"
    if device.type == "cpu":
        return "cpu-flash"
    if device.type in ("cuda", "meta"):  # meta: the CUDA kernels' shape functions (tests without a GPU)
        if (dtype in (torch.float16, torch.bfloat16) and not masked and head_dim % 8 == 0 and head_dim <= 256
                and _sm80(device)):
            return "cuda-flash"
        align = 4 if dtype == torch.float32 else 8
        ok = dtype in (torch.float16, torch.float32) or (dtype == torch.bfloat16 and _sm80(device))
        if ok and head_dim % align == 0:
            return "cuda-efficient"
    return "torch"


@functools.lru_cache(maxsize=16)
def _sm80(device: torch.device) -> bool:
    """FlashAttention-2 needs compute capability 8.0 (Ampere) or newer (assumed where no device can be asked:
    the dry-run's plan for a CUDA run made on a machine without one)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) >= (8, 0)


# ---------------------------------------------------------------------------------------------- merge
def merge(o_acc, lse_acc, o, lse):
    """Online-softmax merge of two partial results through their log-sum-exp (in the accumulation dtype)."""
    o = o.to(o_acc.dtype if o_acc is not None else acc_dtype(o.dtype))
    lse = lse.to(o.dtype)
    if o_acc is None:
        return o, lse
    lse_new = torch.logaddexp(lse_acc, lse)
    safe = lse_new.masked_fill(torch.isinf(lse_new), 0.0)  # rows no key reached yet (packed documents) stay 0
    return o_acc * torch.exp(lse_acc - safe)[..., None] + o * torch.exp(lse - safe)[..., None], lse_new


# ---------------------------------------------------------------------------------------------- SDPA kernels
@dataclass(frozen=True)
class _Ops:
    """One SDPA kernel pair behind a common signature (SDPA layout; ``bias`` additive or None)."""

    fwd: Callable  # (q, k, v, causal, bias, scale) -> (out, lse with rows padded to lse_align)
    bwd: Callable  # (do, q, k, v, out, lse padded, causal, bias, scale) -> (dq, dk, dv)
    gqa: bool  # takes fewer kv heads than q heads as is
    lse_align: int  # the kernel's log-sum-exp rows are padded to a multiple of this
    bias_align: int  # 0: no mask; else the mask's rows are padded to a multiple of this
    bias_heads: bool  # the mask is expanded (a view) to every head


def _cpu_fwd(q, k, v, causal, bias, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias, scale=scale)


def _cpu_bwd(do, q, k, v, out, lse, causal, bias, scale):
    return _aten._scaled_dot_product_flash_attention_for_cpu_backward(do, q, k, v, out, lse, 0.0, causal,
                                                                     attn_mask=bias, scale=scale)


@functools.lru_cache(maxsize=8)
def _philox(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Placeholders for the dropout RNG state the CUDA backward kernels take (never read: dropout is 0), in the
    forms their forwards return: flash's ``rng_state`` (uint64 [2]) and ``unused`` (uint64 []), the
    memory-efficient kernel's seed and offset (int64 [])."""
    return (torch.zeros(2, dtype=torch.uint64, device=device), torch.zeros((), dtype=torch.uint64, device=device),
            torch.zeros((), dtype=torch.int64, device=device))


def _flash_fwd(q, k, v, causal, bias, scale):
    out, lse, *_ = _aten._scaled_dot_product_flash_attention(q, k, v, 0.0, causal, False, scale=scale)
    return out, lse


def _flash_bwd(do, q, k, v, out, lse, causal, bias, scale):
    seed, offset, _ = _philox(q.device)
    dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
        do, q, k, v, out, lse, None, None, q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq, dk, dv


def _eff_fwd(q, k, v, causal, bias, scale):
    out, lse, *_ = _aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, causal, scale=scale)
    return out, lse


def _eff_bwd(do, q, k, v, out, lse, causal, bias, scale):
    seed = _philox(q.device)[2]
    # The kernel reads ``out`` with a row stride of heads * head_dim (``o_strideM()`` in pytorch's
    # mem_eff_attention/kernel_backward.h; only its batch and head strides are taken from the tensor): the
    # [B, L, H, D] memory layout its forward returns. The pipeline's merged out is [B, H, L, D]-contiguous, and
    # in fp16/bf16 the kernel computes rowsum(dout * out) from it, so it must be laid out again.
    out = out.transpose(1, 2).contiguous().transpose(1, 2)
    dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
        do, q, k, v, bias, out, lse, seed, seed, 0.0, [True, True, True, False], causal, scale=scale)
    return dq, dk, dv


_OPS = {
    "cpu-flash": _Ops(_cpu_fwd, _cpu_bwd, gqa=True, lse_align=1, bias_align=1, bias_heads=False),
    "cuda-flash": _Ops(_flash_fwd, _flash_bwd, gqa=True, lse_align=1, bias_align=0, bias_heads=False),
    "cuda-efficient": _Ops(_eff_fwd, _eff_bwd, gqa=False, lse_align=32, bias_align=16, bias_heads=True),
}


def _bias(allowed: torch.Tensor, q: torch.Tensor, heads: int, ops: _Ops) -> torch.Tensor:
    """``[B, Lq, Lk]`` bool -> additive mask (0 / -inf) in q's dtype, ``[B, 1|heads, Lq, Lk]``; rows padded in
    memory to ``ops.bias_align`` elements (the slice and the head expansion are views)."""
    b, lq, lk = allowed.shape
    lkp = -(-lk // ops.bias_align) * ops.bias_align
    full = torch.zeros(b, 1, lq, lkp, dtype=q.dtype, device=q.device)
    bias = full[..., :lk].masked_fill_(~allowed[:, None], float("-inf"))
    return bias.expand(b, heads, lq, lk) if ops.bias_heads else bias


def _layout(ops: _Ops, q, k, v, causal: bool, bias) -> str:
    """How GQA meets the kernel: ``same`` (as is), ``fold`` (query heads of a kv head as extra rows) or
    ``repeat`` (K/V repeated for this block: the causal and masked blocks of a kernel without GQA)."""
    if q.shape[1] == k.shape[1] or ops.gqa:
        return "same"
    return "fold" if not causal and bias is None else "repeat"


def _sdpa_forward(kind: str, q, k, v, causal: bool, scale: float, allowed):
    ops = _OPS[kind]
    b, h, lq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    how = _layout(ops, q, k, v, causal, allowed)
    if how == "fold":
        out, lse = ops.fwd(q.reshape(b, hk, g * lq, d), k, v, False, None, scale)
        return out.reshape(b, h, lq, d), lse[..., :g * lq].reshape(b, h, lq)
    if how == "repeat":
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    bias = None if allowed is None else _bias(allowed, q, h, ops)
    out, lse = ops.fwd(q, k, v, causal and bias is None, bias, scale)
    return out, lse[..., :lq]


def _pad_rows(lse: torch.Tensor, align: int) -> torch.Tensor:
    n = lse.shape[-1]
    pad = -(-n // align) * align - n
    return torch.nn.functional.pad(lse, (0, pad)) if pad else lse.contiguous()


def _sdpa_backward(kind: str, do, q, k, v, out, lse, causal: bool, scale: float, allowed):
    ops = _OPS[kind]
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = h // hk
    lse = lse.to(torch.float64 if q.dtype == torch.float64 else torch.float32)
    if allowed is not None:  # a row no key of any block reached: its scores are all -inf, so p = exp(-inf) = 0
        lse = lse.masked_fill(torch.isinf(lse), 0.0)
    how = _layout(ops, q, k, v, causal, allowed)
    if how == "fold":
        rows = (b, hk, g * lq, d)
        dq, dk, dv = ops.bwd(do.reshape(rows), q.reshape(rows), k, v, out.reshape(rows),
                             _pad_rows(lse.reshape(b, hk, g * lq), ops.lse_align), False, None, scale)
        return dq.reshape(b, h, lq, d), dk, dv
    if how == "repeat":
        k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    bias = None if allowed is None else _bias(allowed, q, h, ops)
    dq, dk, dv = ops.bwd(do, q, k, v, out, _pad_rows(lse, ops.lse_align), causal and bias is None, bias, scale)
    if how == "repeat":
        dk, dv = dk.reshape(b, hk, g, lk, d).sum(2), dv.reshape(b, hk, g, lk, d).sum(2)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------- torch kernel
def allowed(docs, causal: bool, q0: int, q1: int, k0: int, k1: int) -> torch.Tensor:
    """``[B, q1 - q0, k1 - k0]`` bool: which keys ``[k0, k1)`` the queries ``[q0, q1)`` of a block may attend
    to, given the block's document ids ``docs = (doc_q [B, Lq], doc_k [B, Lk])`` (causality folded in)."""
    dq, dk = docs
    a = dq[:, q0:q1, None] == dk[:, None, k0:k1]
    if causal and k1 - 1 > q0:
        a &= torch.arange(k0, k1, device=a.device)[None, :] <= torch.arange(q0, q1, device=a.device)[:, None]
    return a


def _tile_mask(causal: bool, docs, q0: int, q1: int, k0: int, k1: int, device) -> torch.Tensor | None:
    """``True`` where a score of the tile is masked out, broadcastable to ``[B, hk, g, tq, tk]``; None: none."""
    if docs is not None:
        return ~allowed(docs, causal, q0, q1, k0, k1)[:, None, None]
    if causal and k1 - 1 > q0:  # the tile reaches above the diagonal (causal blocks are square: Lq == Lk)
        qi = torch.arange(q0, q1, device=device)[:, None]
        ki = torch.arange(k0, k1, device=device)[None, :]
        return ki > qi
    return None


def _tile_scores(qt, k, v, causal: bool, scale: float, docs, q0: int, q1: int, k0: int, k1: int):
    """One key tile of the tiled kernel: ``(k tile, v tile, masked scores)`` in ``qt``'s accumulation dtype, the
    scores ``[B, hk, g, q1-q0, k1-k0]`` with the causal/document mask already at ``-inf``."""
    kt = k[:, :, None, k0:k1].to(qt.dtype)
    vt = v[:, :, None, k0:k1].to(qt.dtype)
    s = torch.matmul(qt, kt.transpose(-1, -2)).mul_(scale)
    mask = _tile_mask(causal, docs, q0, q1, k0, k1, qt.device)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    return kt, vt, s


def _torch_forward(q, k, v, causal: bool, scale: float, docs):
    acc = acc_dtype(q.dtype)
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = h // hk
    out = torch.empty(b, hk, g, lq, d, dtype=acc, device=q.device)
    lse = torch.empty(b, hk, g, lq, dtype=acc, device=q.device)
    qg = q.reshape(b, hk, g, lq, d)
    for q0 in range(0, lq, TILE):
        q1 = min(lq, q0 + TILE)
        qt = qg[:, :, :, q0:q1].to(acc)
        m = torch.full((b, hk, g, q1 - q0), float("-inf"), dtype=acc, device=q.device)
        s_sum = torch.zeros_like(m)
        o = torch.zeros(b, hk, g, q1 - q0, d, dtype=acc, device=q.device)
        for k0 in range(0, min(lk, q1) if causal else lk, TILE):
            k1 = min(lk, k0 + TILE)
            kt, vt, s = _tile_scores(qt, k, v, causal, scale, docs, q0, q1, k0, k1)
            m_new = torch.maximum(m, s.amax(-1))
            safe = m_new.masked_fill(torch.isinf(m_new), 0.0)
            p = s.sub_(safe[..., None]).exp_()
            corr = torch.exp(m - safe)
            s_sum = s_sum * corr + p.sum(-1)
            o = o * corr[..., None] + torch.matmul(p, vt)
            m = m_new
            del s, p, kt, vt
        empty = s_sum == 0  # rows no key of this block may reach (packed documents)
        lse[:, :, :, q0:q1] = (torch.log(s_sum.masked_fill(empty, 1.0)) + m).masked_fill(empty, float("-inf"))
        out[:, :, :, q0:q1] = o / s_sum.masked_fill(empty, 1.0)[..., None]
    return out.reshape(b, h, lq, d), lse.reshape(b, h, lq)


def _torch_backward(do, q, k, v, out, lse, causal: bool, scale: float, docs):
    acc = acc_dtype(q.dtype)
    b, h, lq, d = q.shape
    hk, lk = k.shape[1], k.shape[2]
    g = h // hk
    qg = q.reshape(b, hk, g, lq, d)
    dog = do.reshape(b, hk, g, lq, d)
    lg = lse.to(acc).reshape(b, hk, g, lq)
    lg = lg.masked_fill(torch.isinf(lg), 0.0)  # a row with no key anywhere has all scores masked: p = 0
    dq = torch.zeros(b, hk, g, lq, d, dtype=acc, device=q.device)
    dk = torch.zeros(b, hk, lk, d, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for q0 in range(0, lq, TILE):
        q1 = min(lq, q0 + TILE)
        qt = qg[:, :, :, q0:q1].to(acc)
        dot = dog[:, :, :, q0:q1].to(acc)
        delta = (dot * out.reshape(b, hk, g, lq, d)[:, :, :, q0:q1].to(acc)).sum(-1, keepdim=True)
        lt = lg[:, :, :, q0:q1, None]
        for k0 in range(0, min(lk, q1) if causal else lk, TILE):
            k1 = min(lk, k0 + TILE)
            kt, vt, s = _tile_scores(qt, k, v, causal, scale, docs, q0, q1, k0, k1)
            p = s.sub_(lt).exp_()
            dv[:, :, k0:k1] += torch.matmul(p.transpose(-1, -2), dot).sum(2)
            ds = torch.matmul(dot, vt.transpose(-1, -2)).sub_(delta).mul_(p)
            del p
            dq[:, :, :, q0:q1] += torch.matmul(ds, kt) * scale
            dk[:, :, k0:k1] += torch.matmul(ds.transpose(-1, -2), qt).sum(2) * scale
            del ds, s, kt, vt
    return dq.reshape(b, h, lq, d), dk, dv


# ---------------------------------------------------------------------------------------------- dispatch
def block_forward(q, k, v, causal: bool, scale: float, kernel: str, docs=None):
    """Attention of one q block against one kv block: ``(out [B,h,Lq,D], lse [B,h,Lq])`` (SDPA layout).

    Args:
        q: ``[B, h, Lq, D]``; k, v: ``[B, hk, Lk, D]`` with ``hk`` dividing ``h`` (GQA).
        causal: mask keys after each query (top-left aligned; FPDT's causal blocks are square).
        scale: softmax scale.
        kernel: :func:`attention_kernel`'s choice for the device.
        docs: packed documents: ``(doc_q [B, Lq], doc_k [B, Lk])`` int64 ids; a query attends only to keys of
            its document. Rows with no allowed key get ``out = 0`` and ``lse = -inf`` so that :func:`merge`
            ignores them. The SDPA kernels take the mask of a :data:`MASK_TILE` piece at a time, the torch
            kernel of one tile.
    """
    kind = block_kernel(kernel, q.device, q.dtype, q.shape[-1], docs is not None)
    if kind == "torch":
        return _torch_forward(q, k, v, causal, scale, docs)
    if docs is None:
        return _sdpa_forward(kind, q, k, v, causal, scale, None)
    o = lse = None
    outs, lses = [], []
    for q0, q1, k0, k1 in _pieces(q.shape[2], k.shape[2], causal):
        mask = allowed(docs, causal, q0, q1, k0, k1)
        ob, lb = _sdpa_forward(kind, q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1], causal, scale, mask)
        rows = mask.any(-1)[:, None, :]  # [B, 1, Lq]: rows with no allowed key must not count in the merge
        lb = lb.masked_fill(~rows, float("-inf"))
        ob = ob.masked_fill(~rows[..., None], 0.0)
        if k0 == 0:
            if o is not None:
                outs.append(o)
                lses.append(lse)
            o, lse = ob, lb
        else:
            o, lse = merge(o, lse, ob, lb)
    if not outs:
        return o, lse
    return torch.cat([t.to(o.dtype) for t in (*outs, o)], 2), torch.cat([*lses, lse], 2)


def _pieces(lq: int, lk: int, causal: bool):
    """``(q0, q1, k0, k1)`` of the :data:`MASK_TILE` pieces of a block, key pieces inner, in order."""
    for q0 in range(0, lq, MASK_TILE):
        q1 = min(lq, q0 + MASK_TILE)
        for k0 in range(0, min(lk, q1) if causal else lk, MASK_TILE):
            yield q0, q1, k0, min(lk, k0 + MASK_TILE)


def block_backward(do, q, k, v, out, lse, causal: bool, scale: float, kernel: str, docs=None):
    """Exact gradient contributions ``(dq, dk, dv)`` of one (q block, kv block) pair given the *merged*
    ``out`` (in q's dtype) and ``lse``; arguments as in :func:`block_forward`."""
    kind = block_kernel(kernel, q.device, q.dtype, q.shape[-1], docs is not None)
    if kind == "torch":
        return _torch_backward(do, q, k, v, out, lse, causal, scale, docs)
    lq, lk = q.shape[2], k.shape[2]
    if docs is None:
        return _sdpa_backward(kind, do, q, k, v, out, lse, causal, scale, None)
    if lq <= MASK_TILE and lk <= MASK_TILE:
        return _sdpa_backward(kind, do, q, k, v, out, lse, causal, scale, allowed(docs, causal, 0, lq, 0, lk))
    acc = acc_dtype(q.dtype)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc, device=q.device)
    dv = torch.zeros_like(dk)
    for q0, q1, k0, k1 in _pieces(lq, lk, causal):
        gq, gk, gv = _sdpa_backward(kind, do[:, :, q0:q1], q[:, :, q0:q1], k[:, :, k0:k1], v[:, :, k0:k1],
                                    out[:, :, q0:q1], lse[..., q0:q1], causal, scale,
                                    allowed(docs, causal, q0, q1, k0, k1))
        dq[:, :, q0:q1] += gq
        dk[:, :, k0:k1] += gk
        dv[:, :, k0:k1] += gv
    return dq, dk, dv


def workspace(kind: str, batch: int, heads: int, kv_heads: int, lq: int, lk: int, head_dim: int,
              elem: int) -> int:
    """Bytes one block's backward (the larger direction) holds inside the kernel, beyond the q/k/v/out/lse
    blocks it reads and the gradients it returns (the pipeline's chunk tensors, counted by its caller).

    ``torch``: two ``[B, h, t, t]`` tiles in the accumulation dtype (the scores, turned into probabilities in
    place, and their gradient; ``t = min(TILE, L)``). ``cuda-efficient``: the block's out laid out again for
    the backward kernel, and under GQA K/V repeated to every query head for a causal or masked block, and
    their gradients. ``cuda-flash``: FlashAttention-2's backward keeps an fp32 dq accumulator (rows rounded to
    128, head_dim to 32 or 64) and, under GQA, dk/dv for every query head before it sums them to the kv heads
    (``mha_bwd`` in pytorch's flash_api.cpp). ``cpu-flash`` keeps no score matrix: 0.
    """
    acc = 8 if elem == 8 else 4
    if kind == "torch":
        return 2 * acc * batch * heads * min(TILE, lq) * min(TILE, lk)
    if kind == "cuda-flash":
        rows = -(-lq // 128) * 128
        dr = -(-head_dim // 32) * 32 if head_dim <= 128 else -(-head_dim // 64) * 64
        return 4 * batch * heads * rows * dr + (2 * elem * batch * heads * lk * head_dim if heads != kv_heads else 0)
    if kind == "cuda-efficient":
        return elem * batch * heads * head_dim * (lq + (4 * lk if heads != kv_heads else 0))
    return 0
