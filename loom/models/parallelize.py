"""Tensor parallelism applied to a built :class:`~loom.models.llama.Llama`, in place (the model is written once;
how it is split lives here, as in torchtitan's ``parallelize_llama``).

``parallelize_llama(model, mesh["tp"])`` replaces, on every tp rank, each whole layer by this rank's slice of
it (:mod:`loom.parallel.tensor`):

=====================  ============================================================================
module                 becomes
=====================  ============================================================================
``embed``              :class:`~loom.parallel.tensor.VocabParallelEmbedding` (vocabulary rows split)
``blocks.i.attn``      ``wq``/``wk``/``wv`` column-parallel with whole query and key/value heads per
                       rank (:func:`~loom.parallel.tensor.split_heads`), ``wo`` row-parallel
``blocks.i.ffn``       :class:`~loom.parallel.tensor.ParallelFeedForward` (``w1``/``w3`` column, ``w2`` row)
``head``               column-parallel over the vocabulary (tied: the embedding's slice); the loss is
                       :func:`~loom.parallel.tensor.vocab_parallel_cross_entropy`, logits never gathered
norms                  replicated (their inputs and gradients are the same on every tp rank)
=====================  ============================================================================

``sequence_parallel=True`` (Megatron-SP): between the tp regions the residual stream is split along the
sequence over tp, so the norms and residual adds hold ``1/tp`` of the tokens; the regions' allreduces become
an all-gather of tokens at each region's entry and a reduce-scatter at its exit
(:mod:`loom.parallel.tensor`), and the norm weights' gradients, now partial, are summed over tp by passing
the weights through :func:`~loom.parallel.tensor.copy_to_tp_region`. Tokens are given whole on every tp
rank, as without it (the embedding's reduce-scatter splits them); the sequence length must divide by tp.

The slices are cut from the model's own weights, so a tp run starts from exactly the one-rank model's
weights (``Llama`` initialises every parameter from its name). Parameter names do not change; a split
parameter holds this rank's rows (column-parallel, embedding) or columns (row-parallel). Gradients of split
parameters are this rank's slice of the one-rank gradient, and those of replicated parameters equal it, so
nothing is reduced over tp after backward: a trainer reduces over ``dp`` only.

Composes with: data parallelism over the other ranks (``Mesh(dp=..., tp=...)``) and Ulysses sequence
parallelism over ``sp`` (``Mesh(sp=..., tp=...)``: each tp rank's heads are split again over sp, so
``heads / tp`` must divide by sp). Refused: FPDT, Ulysses together with Megatron-SP, MoE FFNs (not
implemented for tp), models on the meta device.
"""

from __future__ import annotations

from typing import Any

import torch

from ..compress.codecs import Codec
from ..compress.collectives import DEFAULT_MIN_BYTES
from ..parallel.tensor import (
    ColumnParallelLinear,
    ParallelFeedForward,
    RowParallelLinear,
    TPLink,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_tp_region,
    gathered_linears,
    split_heads,
    vocab_parallel_cross_entropy,
)
from .llama import Attention, FeedForward, Llama, RMSNorm, chunked_map, rope

__all__ = ["parallelize_llama", "TensorParallelLlama", "validate_tensor_parallel"]


def validate_tensor_parallel(cfg: Any, tp: int) -> None:
    """Raise ``ValueError`` (value, rule, fix) when a Llama config cannot be split over ``tp`` ranks."""
    if tp == 1:
        return
    if getattr(cfg, "sequence_parallel", "none") == "fpdt":
        raise ValueError(f"tensor parallelism (tp = {tp}) with sequence_parallel = 'fpdt' is not implemented; use "
                         f"sequence_parallel = 'none' or 'ulysses', or tp = 1")
    if getattr(cfg, "ffn", "swiglu") == "moe":
        raise ValueError(f"tensor parallelism (tp = {tp}) with ffn = 'moe' is not implemented; use ffn = "
                         f"'swiglu' or 'gelu', or tp = 1 (experts shard over ep)")
    split_heads(cfg.heads, cfg.kv_heads if cfg.kv_heads is not None else cfg.heads, tp)
    if cfg.vocab < tp:
        raise ValueError(f"vocab = {cfg.vocab} is smaller than tp = {tp}; choose tp <= {cfg.vocab}")


class _TPAttention(Attention):
    """:class:`~loom.models.llama.Attention` with this rank's heads: the normed input is copied to the tp
    region once for q, k and v (one allreduce of its gradient), ``wo`` sums the heads' partial outputs. Under
    Megatron-SP the input's tokens are gathered once for q, k and v and gathered again in backward
    (:func:`~loom.parallel.tensor.gathered_linears`) rather than saved."""

    tp: TPLink

    def qkv(self, y: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        if not self.tp.sequence_parallel:  # the projections as modules (ZeRO-3 gathers weights in their hooks)
            return super().qkv(copy_to_tp_region(y, self.tp), pos)
        c = self.cfg
        q, k, v = gathered_linears(y, self.tp, self.wq.weight, self.wk.weight, self.wv.weight)
        b, s, _ = q.shape  # the whole sequence under Megatron-SP (y holds this rank's tokens)
        q = rope(q.view(b, s, self.heads, c.head_dim), pos, c.rope_theta)
        k = rope(k.view(b, s, self.kv_heads, c.head_dim), pos, c.rope_theta)
        return torch.cat([q.flatten(2), k.flatten(2), v], dim=-1)


class _SequenceParallelNorm(RMSNorm):
    """RMSNorm on a token slice: its weight's gradient is partial, summed over tp in backward."""

    tp: TPLink

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float() if x.dtype in (torch.float16, torch.bfloat16) else x
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return y.to(x.dtype) * copy_to_tp_region(self.weight, self.tp)


class TensorParallelLlama(Llama):
    """A :class:`~loom.models.llama.Llama` after :func:`parallelize_llama` (same API: ``forward`` gives the
    full logits, gathered over tp; ``loss`` never gathers them)."""

    tp: TPLink

    def hidden_states(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                      positions: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Llama.hidden_states``; with sequence parallelism this rank's contiguous token slice of them.
        ``doc_ids`` and ``positions`` are of the whole sequence on every tp rank, as the tokens are: attention
        runs on the gathered sequence, and RoPE is applied after the gather."""
        p = self.tp.size
        if self.tp.sequence_parallel and tokens.shape[1] % p:
            raise ValueError(f"sequence length {tokens.shape[1]} is not divisible by the tp size {p}: sequence "
                             f"parallelism splits every sequence evenly over tp; pad it to "
                             f"{-(-tokens.shape[1] // p) * p} tokens or parallelize without sequence_parallel")
        return super().hidden_states(tokens, doc_ids, positions)

    def forward(self, tokens: torch.Tensor, doc_ids: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        h = self.norm(self.hidden_states(tokens, doc_ids, positions))
        return gather_from_tp_region(self.head(h), self.tp, self.cfg.vocab)

    def loss(self, tokens: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = -100,
             doc_ids: torch.Tensor | None = None, positions: torch.Tensor | None = None,
             count: torch.Tensor | float | None = None) -> torch.Tensor:
        """The mean next-token cross-entropy, the same value on every tp rank (see ``Llama.loss``, whose
        ``doc_ids``, ``positions`` and ``count`` these are)."""
        h = self.hidden_states(tokens, doc_ids, positions)
        s = h.shape[1]  # local tokens (all of them without sequence parallelism)
        c = s // self.cfg.loss_chunks if s % self.cfg.loss_chunks == 0 else 0
        ranks = self.tp.size if self.tp.sequence_parallel else 1

        def fn(i, hc):
            # the head gathers chunk i of every rank's slice (sequence parallel): their targets, in rank order
            cols = torch.cat([torch.arange(r * s + i * c, r * s + (i + 1) * c, device=targets.device)
                              for r in range(ranks)])
            return vocab_parallel_cross_entropy(self.head(self.norm(hc)), targets[:, cols], self.tp,
                                                self.head.out_start, ignore_index=ignore_index)

        total = chunked_map(fn, h, self.cfg.loss_chunks, [self.head.weight, self.norm.weight], reduce="sum",
                            what="loss_chunks")
        if count is not None:
            return total / count
        count = (targets != ignore_index).sum(dtype=torch.float64).reshape(1)  # on the device: no host sync
        if self.sp is not None and self.sp.size > 1:  # Ulysses: a share of the whole sequence's mean
            count = self.sp.allreduce(count)
        return total / count.clamp(min=1.0).to(total.dtype)[0]

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        raise RuntimeError("a tensor-parallel Llama cannot re-initialise a parameter slice by name; build and "
                           "materialize the whole model, then call parallelize_llama")


def parallelize_llama(model: Llama, tp: Any, *, codec: "str | Codec | None" = None,
                      min_bytes: int = DEFAULT_MIN_BYTES, sequence_parallel: bool = False) -> TensorParallelLlama:
    """Split ``model`` over the tp group ``tp`` in place and return it (now a :class:`TensorParallelLlama`).

    Args:
        model: a whole :class:`~loom.models.llama.Llama` with real (not meta) weights, the same on every tp rank.
        tp: the tp group (``mesh["tp"]``) or a :class:`~loom.parallel.tensor.TPLink`.
        codec: codec of the activation allreduces/allgathers (``CompressionPolicy.codec_for("tp")``).
        min_bytes: activations below this travel uncompressed.
        sequence_parallel: split the residual stream's tokens over tp between the regions (Megatron-SP; see
            the module docstring). Ignored when ``tp`` is a ``TPLink`` (its own flag counts).

    Raises:
        ValueError: heads or kv_heads do not divide by the tp size, or the config uses sequence parallelism
            or MoE (see :func:`validate_tensor_parallel`).
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama takes a loom.models.Llama, got {type(model).__name__}")
    if isinstance(model, TensorParallelLlama):
        raise ValueError("this model is already tensor-parallel; parallelize a fresh Llama")
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("parallelize_llama needs real weights (it slices them); call "
                         "loom.parallel.materialize(model) first")
    link = tp if isinstance(tp, TPLink) else TPLink(tp, codec, min_bytes, sequence_parallel=sequence_parallel)
    cfg = model.cfg
    validate_tensor_parallel(cfg, link.size)
    heads, kv_heads = split_heads(cfg.heads, cfg.kv_heads, link.size)
    if model.sp is not None:
        if link.sequence_parallel:
            raise ValueError("sequence_parallel=True (Megatron-SP) with Ulysses sequence parallelism is not "
                             "implemented; use one of them")
        if heads % model.sp.size:
            raise ValueError(f"heads / tp = {cfg.heads} / {link.size} = {heads} is not divisible by the sp size "
                             f"{model.sp.size}: Ulysses splits each tp rank's heads over sp; choose tp x sp "
                             f"dividing heads = {cfg.heads}")
    tied = model.head.weight is model.embed.weight
    model.embed = VocabParallelEmbedding.from_embedding(model.embed, link)
    for blk in model.blocks:
        a = blk.attn
        a.wq = ColumnParallelLinear.from_linear(a.wq, link, copy_input=False)
        a.wk = ColumnParallelLinear.from_linear(a.wk, link, copy_input=False)
        a.wv = ColumnParallelLinear.from_linear(a.wv, link, copy_input=False)
        a.wo = RowParallelLinear.from_linear(a.wo, link)
        a.heads, a.kv_heads = heads, kv_heads
        a.__class__ = _TPAttention  # as FSDP2's fully_shard does: same module, parallel behaviour
        a.tp = link
        f = blk.ffn
        if not isinstance(f, FeedForward):
            raise ValueError(f"block FFN {type(f).__name__} cannot be split over tp; use ffn = 'swiglu' or 'gelu'")
        blk.ffn = ParallelFeedForward.from_dense(f.w1, f.w2, f.w3, link)
    head = ColumnParallelLinear.from_linear(model.head, link)
    model.head = head
    if tied:
        head.weight = model.embed.weight  # same vocabulary rows (shard_range of the same sizes)
    if link.sequence_parallel:
        for norm in [m for m in model.modules() if type(m) is RMSNorm]:
            norm.__class__ = _SequenceParallelNorm
            norm.tp = link
    model.__class__ = TensorParallelLlama
    model.tp = link
    return model
