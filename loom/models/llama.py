"""A Llama-style decoder whose attention runs without, with Ulysses, or with FPDT sequence parallelism.

Architecture: token embedding; ``layers`` pre-norm blocks of RMSNorm -> grouped-query attention with rotary
positions (RoPE at *global* token positions, interleaved pairs) -> residual, RMSNorm -> SwiGLU, GELU or
mixture-of-experts FFN (:mod:`loom.parallel.moe`, experts sharded over ``ep``) -> residual; a final RMSNorm and
an LM head (tied to the embedding or not). No biases.

Sequence parallelism (``LlamaConfig.sequence_parallel``):

* ``"none"``: every rank holds whole sequences; attention is SDPA.
* ``"ulysses"``: tokens are sharded contiguously over the ``sp`` communicator
  (``shard_sequence(x, comm, chunks=1)``); attention is :func:`~loom.parallel.sequence.ulysses_attention`.
  With ``ring = R > 1`` the ``sp`` ranks form ``R`` Ulysses groups with ring attention across them
  (:func:`~loom.parallel.sequence.ring_attention`; tokens in the zig-zag layout,
  ``shard_sequence(x, comm, ring=R)``), so ``sp`` may exceed the head count.
* ``"fpdt"``: tokens are sharded in the FPDT layout (``shard_sequence(x, comm, chunks=cfg.chunks)``);
  each block is one :class:`~loom.parallel.sequence.FPDTPipeline` (the attention of
  :func:`~loom.parallel.sequence.fpdt_attention`, with the projections, residuals and FFN fused in per chunk)
  with ``cfg.chunks`` and ``cfg.offload``.

Memory knobs, usable in every mode (``"fpdt"`` turns them on by default, FPDT paper Sec. 4.3):

* ``ffn_chunks``: the FFN (with its RMSNorm) runs chunk by chunk along the sequence under recompute: the
  ``[seq, ffn_hidden]`` intermediates exist for one chunk at a time, in forward and in backward.
* ``loss_chunks``: LM head + cross-entropy chunk by chunk, recomputed in backward; the full
  ``[seq, vocab]`` logits are never materialised (:func:`chunked_lm_loss`).
* ``checkpoint``: each block keeps only its input and recomputes in backward; with ``offload`` (FPDT) or
  ``offload_checkpoints`` (any mode) that input lives in host memory (:class:`~loom.parallel.offload.HostPool`:
  pinned buffers, copied on a side stream); with ``offload_checkpoints`` it comes back while the block after it
  recomputes (one more input on the device), under FPDT's ``offload`` alone when its block's backward starts.

Loss normalisation (what ``Llama.loss`` returns): ``sum of token cross-entropies on this rank`` divided by the
number of non-ignored targets over the *whole* sequence, i.e. summed over the ``sp`` ranks (one small
allreduce of the count, no gradient through it). So summing the returned value over ``sp`` ranks gives the
global mean loss, and summing the parameter gradients over ``sp`` ranks gives the gradient of that mean;
data-parallel replicas then average as usual. With ``"none"`` the value is the plain mean.

Example::

    cfg = LlamaConfig(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256,
                      sequence_parallel="fpdt", chunks=4, offload=True)
    model = Llama(cfg, sp_comm=mesh["sp"])
    tok = shard_sequence(tokens, mesh["sp"], chunks=cfg.layout_chunks)      # [batch, seq / sp]
    tgt = shard_sequence(targets, mesh["sp"], chunks=cfg.layout_chunks)
    loss = model.loss(tok, tgt)
    loss.backward()
    for p in model.parameters():                                           # sum over sp ranks
        p.grad = mesh["sp"].allreduce(p.grad)
"""

from __future__ import annotations

import math
import zlib
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..parallel.moe import MoE, MoEConfig
from .config import SEQUENCE_PARALLEL, LlamaConfig, LlamaShape
from ..parallel.offload import chunk_store
from ..parallel.sequence import (FPDTPipeline, FPDTRingPipeline, HeadPlan, check_sizes, local_positions,
                                 ring_attention)
from ..parallel.sequence.layout import _global_docs

__all__ = [
    "LlamaShape", "LlamaConfig", "Llama", "MoEFeedForward", "build_llama", "chunked_lm_loss", "chunked_ffn",
    "SEQUENCE_PARALLEL",
]

# ---------------------------------------------------------------------------------------------- pieces
class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding of ``[B, S, H, D]`` at the positions ``pos``, interleaved pairs.

    ``pos`` is ``[S]`` (the same for every row: global positions) or ``[B, S]`` (per row: packed documents,
    whose positions restart at each document)."""
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=x.device) / d))
    ang = pos.to(torch.float64)[..., None] * inv
    if ang.dim() == 2:
        ang = ang[None]
    cos = ang.cos().to(x.dtype)[:, :, None, :]
    sin = ang.sin().to(x.dtype)[:, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class _Recompute(torch.autograd.Function):
    """Run ``fn(x)`` without saving activations; recompute it in backward (gradients returned out of place).

    ``x``'s value is kept in ``store`` (host memory when offloading: the copy out starts at once, on the side
    stream). ``chain`` lists the handles of the blocks run before this one in the same store: backward takes
    this block's input back, then starts bringing the previous block's input back (``store.prefetch``) so that
    its copy overlaps this block's recompute, as FPDT's chunk loops prefetch one chunk ahead. Parameters are
    explicit inputs so their gradients are returned by this function, never accumulated behind autograd's back.
    """

    @staticmethod
    def forward(ctx, x, fn, store, chain, *params):
        ctx.fn, ctx.store, ctx.n = fn, store, len(params)
        ctx.prev = chain[-1] if chain else None
        ctx.handle = store.put(x.detach())
        chain.append(ctx.handle)
        ctx.save_for_backward(*params)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, g):
        params = ctx.saved_tensors
        x = ctx.store.pop(ctx.handle).detach().requires_grad_()
        if ctx.prev is not None:
            ctx.store.prefetch(ctx.prev)  # the previous block's input comes back while this one recomputes
        with torch.enable_grad():
            out = ctx.fn(x)
        want = [x] + [p for p in params if p.requires_grad]
        got = iter(torch.autograd.grad(out, want, g, allow_unused=True))
        gx = next(got)
        gp = [next(got) if p.requires_grad else None for p in params]
        return (gx, None, None, None, *gp)


def recompute(fn, x: torch.Tensor, params: list[nn.Parameter], store=None,
              chain: list[int] | None = None) -> torch.Tensor:
    """``fn(x)`` whose activations are recomputed in backward; ``x`` kept in ``store`` (default: in place).

    ``chain``: one list shared by consecutive calls on the same ``store`` (a model's blocks): each backward
    prefetches the input of the call before it (see :class:`_Recompute`)."""
    if not torch.is_grad_enabled():
        return fn(x)
    store = store if store is not None else chunk_store(False, x.device)
    return _Recompute.apply(x, fn, store, chain if chain is not None else [], *params)


class _ChunkedMap(torch.autograd.Function):
    """``fn(i, x_i)`` over ``chunks`` slices of ``x`` along dim 1, concatenated or summed; recomputed in backward.

    Forward runs without saving any activation; backward recomputes one chunk at a time and writes its input
    gradient into one preallocated tensor (no per-chunk full-size zeros), returning parameter gradients out of
    place.
    """

    @staticmethod
    def forward(ctx, x, fn, chunks, reduce, *params):
        c = x.shape[1] // chunks
        ctx.fn, ctx.chunks, ctx.reduce = fn, chunks, reduce
        ctx.save_for_backward(x, *params)
        with torch.no_grad():
            outs = [fn(i, x[:, i * c:(i + 1) * c]) for i in range(chunks)]
        if reduce == "sum":
            return torch.stack(outs).sum(0)
        return torch.cat(outs, dim=1)

    @staticmethod
    def backward(ctx, g):
        x, *params = ctx.saved_tensors
        chunks, fn = ctx.chunks, ctx.fn
        c = x.shape[1] // chunks
        dx = torch.empty_like(x)
        want = [p for p in params if p.requires_grad]
        dps: list[torch.Tensor | None] = [None] * len(want)
        for i in range(chunks):
            xi = x[:, i * c:(i + 1) * c].detach().requires_grad_()
            with torch.enable_grad():
                out = fn(i, xi)
            gi = g if ctx.reduce == "sum" else g[:, i * c:(i + 1) * c]
            got = torch.autograd.grad(out, [xi, *want], gi, allow_unused=True)
            dx[:, i * c:(i + 1) * c] = got[0]
            for n, gp in enumerate(got[1:]):
                if gp is not None:
                    dps[n] = gp if dps[n] is None else dps[n] + gp
            del out, got, xi
        it = iter(dps)
        return (dx, None, None, None, *[next(it) if p.requires_grad else None for p in params])


def chunked_map(fn, x: torch.Tensor, chunks: int, params: list[torch.Tensor], *, reduce: str = "cat",
                what: str = "chunks") -> torch.Tensor:
    """``fn(i, x_i)`` on ``chunks`` slices of ``x`` along dim 1, each recomputed in backward.

    Only one chunk's intermediates are alive at a time, in forward and in backward. ``reduce="cat"``
    concatenates the outputs along dim 1 (``fn`` token-wise: the result is exactly ``fn`` on all of ``x``);
    ``reduce="sum"`` adds them (a loss). ``params`` are the parameters ``fn`` uses (their gradients are
    returned out of place). ``chunks=1`` or no grad mode calls ``fn`` directly.
    """
    s = x.shape[1]
    if s % chunks:
        raise ValueError(f"local sequence {s} is not divisible by {what}={chunks}; choose {what} dividing {s}")
    if chunks <= 1 or not torch.is_grad_enabled():
        c = s // chunks
        outs = [fn(i, x[:, i * c:(i + 1) * c]) for i in range(chunks)]
        return outs[0] if chunks == 1 else (torch.stack(outs).sum(0) if reduce == "sum" else torch.cat(outs, 1))
    return _ChunkedMap.apply(x, fn, chunks, reduce, *params)


def chunked_ffn(fn, x: torch.Tensor, chunks: int, params: list[nn.Parameter]) -> torch.Tensor:
    """A token-wise ``fn`` (the FFN with its norm) on ``chunks`` slices of ``x``, recomputed in backward."""
    return chunked_map(lambda i, xc: fn(xc), x, chunks, params, what="ffn_chunks")


def chunked_lm_loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor, chunks: int,
                    ignore_index: int = -100, norm: nn.Module | None = None) -> torch.Tensor:
    """Summed cross-entropy of the logits ``norm(h) @ w.T`` without materialising them (``chunks`` > 1).

    Args:
        h: hidden states ``[B, s, hidden]`` (before the final norm when ``norm`` is given).
        w: LM head weight ``[vocab, hidden]``.
        targets: ``[B, s]`` token ids; ``ignore_index`` entries contribute nothing.
        chunks: slices along ``s``; each slice's logits exist only while it is computed (forward) and
            recomputed (backward). ``1`` computes the full logits.
        ignore_index: target id to skip.
        norm: optional final norm applied per chunk (so its activations are chunked too).

    Returns:
        A scalar: the *sum* over tokens (normalise by the token count yourself), fp32 (fp64 for fp64 input).
    """
    acc = torch.float64 if h.dtype == torch.float64 else torch.float32
    c = h.shape[1] // chunks if h.shape[1] % chunks == 0 else 0

    def fn(i, hc):
        if norm is not None:
            hc = norm(hc)
        logits = (hc @ w.t()).to(acc)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets[:, i * c:(i + 1) * c].reshape(-1),
                               reduction="sum", ignore_index=ignore_index)

    params = [w] + (list(norm.parameters()) if norm is not None else [])
    return chunked_map(fn, h, chunks, params, reduce="sum", what="loss_chunks")


# ---------------------------------------------------------------------------------------------- blocks
class Attention(nn.Module):
    """Grouped-query attention with RoPE; the core runs as SDPA, Ulysses or FPDT per the config."""

    def __init__(self, cfg: LlamaConfig, sp_comm=None):
        super().__init__()
        self.cfg, self.sp = cfg, sp_comm
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads  # on this rank: tensor parallelism splits them
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.hidden, bias=False)

    def qkv(self, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Token-wise projections with RoPE at ``pos``, packed as ``[B, s, (heads + 2 kv_heads) head_dim]``."""
        c = self.cfg
        b, s, _ = y.shape
        q = rope(self.wq(y).view(b, s, self.heads, c.head_dim), pos, c.rope_theta)
        k = rope(self.wk(y).view(b, s, self.kv_heads, c.head_dim), pos, c.rope_theta)
        return torch.cat([q.flatten(2), k.flatten(2), self.wv(y)], dim=-1)

    def core(self, packed: torch.Tensor, doc: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of packed q/k/v ``[B, s, ...]`` -> ``[B, s, heads * head_dim]`` (before ``wo``)."""
        c = self.cfg
        b, s, _ = packed.shape
        nq, nk = self.heads * c.head_dim, self.kv_heads * c.head_dim
        q = packed[..., :nq].unflatten(-1, (self.heads, c.head_dim))
        k = packed[..., nq:nq + nk].unflatten(-1, (self.kv_heads, c.head_dim))
        v = packed[..., nq + nk:].unflatten(-1, (self.kv_heads, c.head_dim))
        if c.sequence_parallel == "ulysses":
            o = ring_attention(q, k, v, self.sp, ring=c.ring, causal=c.causal, doc_ids=doc)  # ring 1: Ulysses
        else:  # "none" ("fpdt" blocks run _FPDTBlock instead)
            mask = None
            if doc is not None:
                mask = doc[:, None, :, None] == doc[:, None, None, :]
                if c.causal:
                    mask = mask & torch.ones(s, s, dtype=torch.bool, device=doc.device).tril()
            o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               attn_mask=mask, is_causal=c.causal and mask is None,
                                               enable_gqa=self.kv_heads != self.heads).transpose(1, 2)
        return o.reshape(b, s, nq)


class MoEFeedForward(nn.Module):
    """:class:`~loom.parallel.moe.MoE` (top-k, dropless, experts sharded over ``ep``) on ``[B, s, hidden]``.

    Token-wise like the dense FFN, so it chunks and recomputes the same way (every ``ep`` rank runs the same
    chunk schedule, so the dispatch/combine all-to-alls pair up). Parameters: ``moe.gate`` (replicated) and
    ``moe.w1``/``moe.w2`` (this ``ep`` rank's experts along dim 0), initialised by ``MoE`` from ``seed``.
    """

    def __init__(self, cfg: LlamaConfig, ep_comm, seed: int):
        super().__init__()
        self.moe = MoE(MoEConfig(dim=cfg.hidden, hidden=cfg.ffn_hidden, experts=cfg.experts, top_k=cfg.top_k,
                                 seed=seed, dtype=torch.float64), ep_comm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return self.moe(x.reshape(b * s, h)).reshape(b, s, h)


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.kind = cfg.ffn
        h, f = cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False) if self.kind == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class _FPDTBlock(torch.autograd.Function):
    """A whole transformer block as one FPDT chunk pipeline (paper Sec. 4): nothing sequence-sized is kept.

    Forward, per local chunk ``i``: norm, q/k/v projections and RoPE of ``x_i`` feed the
    :class:`~loom.parallel.sequence.FPDTPipeline`; as soon as its attention output ``o_i`` is ready,
    ``x1_i = x_i + wo(o_i)`` and ``x2_i = x1_i + ffn(norm(x1_i))`` (the FFN in sub-chunks) are computed and
    written to the output. Saved: ``x_i`` and ``o_i`` per chunk in the chunk store (host memory with offload)
    and the pipeline's head-layout chunks; no other activation.

    Backward: per chunk ``i``, the token-wise tail (``wo``, residuals, FFN) is recomputed from ``(x_i, o_i)``
    and back-propagated from ``g_i``, giving ``do_i`` for the pipeline and the residual part of ``dx_i``; the
    pipeline's kv-outer backward then yields ``(dq_j, dk_j, dv_j)`` in order of ``j``, each pushed through the
    recomputed projections of ``x_j`` at once. Device memory of size ``[seq, hidden]``: ``g`` and ``dx`` only.
    """

    @staticmethod
    def forward(ctx, x, block, keep, *params):
        cfg, a = block.cfg, block.attn
        b, s, d = x.shape
        u = cfg.chunks
        c = s // u
        store = chunk_store(cfg.offload, x.device)
        scale = 1.0 / math.sqrt(cfg.head_dim)
        if cfg.ring > 1:
            pipe = FPDTRingPipeline(a.sp, cfg.ring, u, cfg.causal, scale, store, x.device, block.heads_plan(),
                                    block.doc)
        else:
            pipe = FPDTPipeline(a.sp, u, cfg.causal, scale, store, x.device, block.doc, block.heads_plan())
        out = torch.empty_like(x)
        hx = [store.put(x[:, i * c:(i + 1) * c]) for i in range(u)] if keep else []
        ho: list[int] = []

        def emit(i, o):
            if keep:
                ho.append(store.put(o))
            out[:, i * c:(i + 1) * c] = block.tail(x[:, i * c:(i + 1) * c], o)

        # This call's positions, kept for backward's recompute of q/k/v: a pipeline runs other micro-batches'
        # forwards (other packed positions) through the block before this one's backward.
        pos = block.pos
        pipe.forward(lambda i: block.qkv_chunk(i, x[:, i * c:(i + 1) * c], pos), emit)
        if not keep:
            pipe.release()
            return out
        ctx.block, ctx.pipe, ctx.store, ctx.hx, ctx.ho, ctx.pos = block, pipe, store, hx, ho, pos
        ctx.save_for_backward(*params)
        return out

    @staticmethod
    def backward(ctx, g):
        block, pipe, store, hx, ho = ctx.block, ctx.pipe, ctx.store, ctx.hx, ctx.ho
        params = ctx.saved_tensors  # attn_norm, wq, wk, wv | wo, ffn_norm, ffn weights
        b, s, d = g.shape
        c = s // len(hx)
        dx = torch.empty_like(g)
        dps: list[torch.Tensor | None] = [None] * len(params)

        def add(first, ts):
            for n, t in enumerate(ts):
                if t is not None:
                    dps[first + n] = t if dps[first + n] is None else dps[first + n] + t

        def get_dout(i):
            sl = slice(i * c, (i + 1) * c)
            if i + 1 < len(hx):
                store.prefetch(hx[i + 1])
                store.prefetch(ho[i + 1])
            xi = store.get(hx[i]).detach().requires_grad_()
            o = store.pop(ho[i]).detach().requires_grad_()
            with torch.enable_grad():
                y = block.tail(xi, o)
            got = torch.autograd.grad(y, [xi, o, *params[4:]], g[:, sl], allow_unused=True)
            dx[:, sl] = got[0]  # the residual and FFN part of dx_i; the attention part comes in emit()
            add(4, got[2:])
            return got[1]

        def emit(j, gq, gk, gv):
            xj = store.pop(hx[j]).detach().requires_grad_()
            with torch.enable_grad():
                q, k, v = block.qkv_chunk(j, xj, ctx.pos)
            got = torch.autograd.grad([q, k, v], [xj, *params[:4]], [gq, gk, gv], allow_unused=True)
            dx[:, j * c:(j + 1) * c] += got[0]
            add(0, got[1:])

        pipe.backward(get_dout, emit)
        ctx.pipe = ctx.store = ctx.pos = None
        return (dx, None, None, *dps)


class Block(nn.Module):
    """Pre-norm block: ``x + wo(attn(qkv(norm(x))))`` then ``x + ffn(norm(x))``.

    With ``fpdt`` the whole block is one chunk pipeline (:class:`_FPDTBlock`, the FFN in
    ``ffn_chunks / chunks`` sub-chunks of each chunk); otherwise the FFN sublayer (with its norm and residual)
    runs in ``ffn_chunks`` recomputed chunks.
    """

    def __init__(self, cfg: LlamaConfig, sp_comm=None, ep_comm=None, index: int = 0):
        super().__init__()
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, sp_comm)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = MoEFeedForward(cfg, ep_comm, seed=1000 + index) if cfg.ffn == "moe" else FeedForward(cfg)
        self.pos: torch.Tensor | None = None
        self.doc: torch.Tensor | None = None  # global document ids (fpdt) for packed sequences

    def _ffn_residual(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ffn(self.ffn_norm(x))

    def qkv_chunk(self, i: int, xc: torch.Tensor, pos: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v ``[B, c, heads|kv_heads, D]`` of local chunk ``i`` (kv gathered to split over the sp ranks,
        :meth:`HeadPlan.gather_kv <loom.parallel.sequence.HeadPlan.gather_kv>`)."""
        cfg, a = self.cfg, self.attn
        b, c, _ = xc.shape
        pos = self.pos if pos is None else pos  # the positions of the forward this chunk belongs to
        packed = a.qkv(self.attn_norm(xc), pos[..., i * c:(i + 1) * c])
        nq, nk = cfg.heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
        q = packed[..., :nq].unflatten(-1, (cfg.heads, cfg.head_dim))
        k = packed[..., nq:nq + nk].unflatten(-1, (cfg.kv_heads, cfg.head_dim))
        v = packed[..., nq + nk:].unflatten(-1, (cfg.kv_heads, cfg.head_dim))
        return (q, *self.heads_plan().gather_kv(k, v))

    def heads_plan(self) -> HeadPlan:
        """How this block's heads split over the sp ranks (:class:`~loom.parallel.sequence.HeadPlan`)."""
        p = self.attn.sp.size if self.attn.sp is not None else 1
        return HeadPlan.make(self.cfg.heads, self.cfg.kv_heads, p // self.cfg.layout_ring)

    def tail(self, x: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
        """Token-wise rest of the block for one FPDT chunk: ``x1 = x + wo(o)``, ``x1 + ffn(norm(x1))``."""
        cfg = self.cfg
        x1 = x + self.attn.wo(o.reshape(*x.shape[:2], -1))
        c = x.shape[1]
        sub = max(1, cfg.ffn_chunks // cfg.chunks)
        while c % sub:
            sub -= 1
        return chunked_map(lambda i, xc: self._ffn_residual(xc), x1, sub,
                           [self.ffn_norm.weight, *self.ffn.parameters()], what="ffn_chunks")

    def forward(self, x: torch.Tensor, pos: torch.Tensor, doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        """``x`` ``[B, s, hidden]`` at positions ``pos`` (``[s]``, or ``[B, s]`` for packed documents);
        ``doc_ids`` ``[B, s]`` for packed sequences."""
        cfg, a = self.cfg, self.attn
        self.pos = pos
        if cfg.sequence_parallel == "fpdt":
            self.doc = _global_docs(doc_ids, x, a.sp, cfg.chunks, cfg.ring)  # x: [B, s, ...] like q
            b, s, _ = x.shape
            meta = torch.empty(b, s, cfg.heads, cfg.head_dim, device="meta")
            check_sizes(meta, meta[:, :, :cfg.kv_heads], meta[:, :, :cfg.kv_heads], a.sp.size // cfg.ring,
                        cfg.chunks)
            params = [self.attn_norm.weight, a.wq.weight, a.wk.weight, a.wv.weight, a.wo.weight,
                      self.ffn_norm.weight, *self.ffn.parameters()]
            keep = torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))
            return _FPDTBlock.apply(x, self, keep, *params)
        x = x + a.wo(a.core(a.qkv(self.attn_norm(x), pos), doc_ids))
        return chunked_map(lambda i, xc: self._ffn_residual(xc), x, cfg.ffn_chunks,
                           [self.ffn_norm.weight, *self.ffn.parameters()], what="ffn_chunks")


class Llama(nn.Module):
    """The decoder. Tokens in, final hidden states / logits / loss out, on this rank's sequence shard.

    Args:
        cfg: a :class:`LlamaConfig`.
        sp_comm: the sequence-parallel communicator (``mesh["sp"]``) for ``ulysses``/``fpdt``; default
            ``loom.comm.world()``. Ignored for ``none``.
        ep_comm: the expert-parallel communicator (``mesh["ep"]``) for ``ffn="moe"``; default
            ``loom.comm.world()`` (every expert on one rank when the world has one rank).

    Parameters have the same names on every rank (``embed.weight``, ``blocks.<i>.attn.wq.weight``, ...,
    ``norm.weight``, ``head.weight``; when tied, ``head.weight`` *is* ``embed.weight`` and is listed once) and
    are initialised from generators seeded by those names, so every rank builds identical weights without
    communicating.
    """

    def __init__(self, cfg: LlamaConfig, sp_comm=None, ep_comm=None):
        super().__init__()
        self.cfg = cfg
        if cfg.sequence_parallel != "none" and sp_comm is None:
            from ..comm import world

            sp_comm = world()
        self.sp = sp_comm if cfg.sequence_parallel != "none" else None
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.blocks = nn.ModuleList([Block(cfg, self.sp, ep_comm, i) for i in range(cfg.layers)])
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        if cfg.tie_embeddings:  # one Parameter in two places: named_parameters() lists it once, as embed.weight
            self.head.weight = self.embed.weight
        if not self.embed.weight.is_meta:  # on meta: loom.parallel.materialize calls init_parameter later
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` (shaped like parameter ``name``) with that parameter's initial values, in place.

        The values depend only on the name (a generator seeded by it; norms are ones; MoE weights come from
        their layer's ``MoE`` seed), so any subset of the parameters can be materialised alone, in any order
        (:func:`loom.parallel.materialize`), and equals the same subset of a whole build.
        """
        with torch.no_grad():
            if name.endswith("norm.weight"):
                tensor.fill_(1.0)
            elif ".ffn.moe." in name:
                block, _, local = name.partition(".ffn.moe.")
                self.get_submodule(block).ffn.moe.init_parameter(local, tensor)
            else:
                g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
                std = 0.02 / math.sqrt(2 * self.cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                tensor.copy_(torch.randn(tensor.shape, generator=g, dtype=torch.float64) * std)

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head weight ``[vocab, hidden]`` (the embedding's, when tied)."""
        return self.head.weight

    def positions(self, seq_local: int, device=None) -> torch.Tensor:
        """Global positions of this rank's ``seq_local`` tokens in the model's layout."""
        if self.sp is None:
            return torch.arange(seq_local, device=device)
        return local_positions(seq_local, self.sp, chunks=self.cfg.layout_chunks, device=device,
                               ring=self.cfg.layout_ring)

    def hidden_states(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """Last block's output ``[B, s, hidden]`` (before the final norm) for this rank's tokens ``[B, s]``.

        ``doc_ids`` (``[B, s]``, same layout as ``tokens``): packed sequences, attention stays within each
        document. ``positions`` (``[B, s]``, same layout): the RoPE position of each token, e.g. restarting at
        each packed document; default: the global positions of this rank's layout.

        With ``checkpoint`` each block keeps only its input: on the device, or with ``offload`` /
        ``offload_checkpoints`` in host memory, copied out during forward and brought back one block ahead
        in backward (:class:`_Recompute`).
        """
        cfg = self.cfg
        pos = self.positions(tokens.shape[1], tokens.device) if positions is None else positions
        h = self.embed(tokens)
        store = chunk_store(cfg.offload or cfg.offload_checkpoints, h.device) if cfg.checkpoint else None
        # Prefetching one block ahead holds a second block input on the device during backward: asked for with
        # offload_checkpoints; FPDT's own offload keeps one (its 8B / 2M-token fit depends on it).
        chain: list[int] | None = [] if cfg.offload_checkpoints else None
        for blk in self.blocks:
            if cfg.checkpoint:
                h = recompute(lambda x, blk=blk: blk(x, pos, doc_ids), h, list(blk.parameters()), store, chain)
            else:
                h = blk(h, pos, doc_ids)
        return h

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Logits ``[B, s, vocab]`` (materialised: for generation and small checks; train with :meth:`loss`)."""
        return self.norm(self.hidden_states(tokens, doc_ids, positions)) @ self.head_weight.t()

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
             doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             count: torch.Tensor | float | None = None) -> torch.Tensor:
        """This rank's share of the mean next-token cross-entropy (see the module docstring).

        Args:
            tokens: ``[B, s]`` input ids on this rank (its shard in the model's layout).
            targets: ``[B, s]`` target ids, sharded the same way; ``ignore_index`` entries are skipped.
            ignore_index: target id that contributes nothing (e.g. the last token of each packed document).
            doc_ids: ``[B, s]`` document ids for packed sequences (see :meth:`hidden_states`).
            positions: ``[B, s]`` RoPE positions (see :meth:`hidden_states`).
            count: what the summed loss is divided by; default the non-ignored targets over the ``sp`` ranks.
                A caller whose replicas see different counts (packed documents over ``dp``) passes its own.

        Returns:
            ``local loss sum / global target count`` (fp32; fp64 for an fp64 model). Summed over the ``sp``
            ranks it is the mean loss of the whole sequence; with ``none`` it is that mean.
        """
        h = self.hidden_states(tokens, doc_ids, positions)
        total = chunked_lm_loss(h, self.head_weight, targets, self.cfg.loss_chunks, ignore_index, norm=self.norm)
        if count is not None:
            return total / count
        # The count stays on the device (no host sync per loss); counts are exact in the loss's dtype.
        count = (targets != ignore_index).sum(dtype=torch.float64).reshape(1)
        if self.sp is not None and self.sp.size > 1:
            count = self.sp.allreduce(count)
        return total / count.clamp(min=1.0).to(total.dtype)[0]


def build_llama(cfg: Any, *, sp_comm=None, ep_comm=None, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                **overrides: Any) -> Llama:
    """A :class:`Llama` from a :class:`LlamaConfig` or any object/dict with the same field names.

    ``overrides`` set config fields (``sequence_parallel="fpdt", chunks=4``); the model is moved to
    ``dtype``/``device``.
    """
    c = cfg if isinstance(cfg, LlamaConfig) and not overrides else LlamaConfig.from_any(cfg, **overrides)
    return Llama(c, sp_comm, ep_comm).to(device=device, dtype=dtype)
