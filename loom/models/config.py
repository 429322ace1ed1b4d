"""The Llama decoder's configuration, apart from its torch code so that reading a config imports no torch
(``loom train --help`` and a bad ``--model.x`` stay fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any, ClassVar

__all__ = ["LlamaShape", "LlamaConfig", "SEQUENCE_PARALLEL"]

SEQUENCE_PARALLEL = ("none", "ulysses", "fpdt")
_FFN = ("swiglu", "gelu", "moe")


@dataclass(kw_only=True, slots=True)
class LlamaShape:
    """What the decoder is made of, declared once: :class:`LlamaConfig` adds how a run lays it out, and
    ``loom train``'s ``[model]`` section (``loom.train.config.ModelConfig``) is this shape plus where to load it
    from. Errors name a field as ``{prefix}field`` (``_PREFIX``: ``model.`` in a ``loom train`` config)."""

    _PREFIX: ClassVar[str] = ""

    layers: int = 2
    """Number of transformer blocks."""
    hidden: int = 64
    """Model width (embedding size)."""
    heads: int = 4
    """Attention (query) heads; ``hidden`` divides by it and ``hidden / heads`` is even (rotary embeddings)."""
    kv_heads: int | None = None
    """Key/value heads (grouped-query attention); divides ``heads``. Default: ``heads``."""
    vocab: int = 256
    """Vocabulary size; 256 for loom's byte-level tokenizer (:mod:`loom.models.tokenizer`)."""
    ffn: str = "swiglu"
    """FFN kind: ``swiglu``, ``gelu`` or ``moe`` (:class:`~loom.parallel.moe.MoE`, experts over ``ep``)."""
    ffn_mult: float = 2.6667
    """FFN inner width as a multiple of ``hidden``, rounded up to a multiple of 8."""
    experts: int = 4
    """MoE only: number of experts (a multiple of the ``ep`` size)."""
    top_k: int = 2
    """MoE only: experts per token."""
    rope_theta: float = 10000.0
    """Rotary embedding base."""
    norm_eps: float = 1e-5
    """RMSNorm epsilon."""

    def __post_init__(self) -> None:
        p = self._PREFIX
        if self.kv_heads is None:
            self.kv_heads = self.heads
        for k in ("layers", "hidden", "heads", "kv_heads", "vocab", "experts", "top_k"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{p}{k} = {v!r} must be an integer >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"{p}hidden = {self.hidden} is not divisible by {p}heads = {self.heads}; choose hidden "
                             f"as a multiple of heads (e.g. {self.heads * max(1, self.hidden // self.heads)})")
        if (self.hidden // self.heads) % 2:
            raise ValueError(f"head size hidden/heads = {self.hidden // self.heads} must be even for rotary "
                             f"embeddings")
        if self.heads % self.kv_heads:
            raise ValueError(f"{p}heads = {self.heads} is not divisible by {p}kv_heads = {self.kv_heads}; "
                             f"grouped-query attention needs kv_heads to divide heads")
        if self.ffn not in _FFN:
            raise ValueError(f"{p}ffn = {self.ffn!r}; valid: {', '.join(_FFN)}")
        if self.top_k > self.experts:
            raise ValueError(f"{p}top_k = {self.top_k} exceeds {p}experts = {self.experts}; choose top_k <= "
                             f"experts")
        if not self.ffn_mult > 0:
            raise ValueError(f"{p}ffn_mult = {self.ffn_mult} must be > 0")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def ffn_hidden(self) -> int:
        return int(-(-int(math.ceil(self.hidden * self.ffn_mult)) // 8) * 8)


@dataclass(kw_only=True, slots=True)
class LlamaConfig(LlamaShape):
    """The decoder's shape and how its sequence dimension is parallelised and chunked."""

    tie_embeddings: bool = False
    """Share the input embedding with the LM head."""
    causal: bool = True
    """Causal attention (a decoder); ``False`` for encoder-style experiments."""
    sequence_parallel: str = "none"
    """``none``, ``ulysses`` or ``fpdt``."""
    chunks: int = 1
    """FPDT chunks per rank (attention pipeline and token layout). Ignored unless ``fpdt``."""
    ring: int = 1
    """Ring degree of 2-D sequence parallelism: the sp ranks form ``ring`` Ulysses groups (FPDT's chunk pipeline
    inside each with ``fpdt``) with ring attention across them (:func:`~loom.parallel.sequence.ring_attention`,
    :class:`~loom.parallel.sequence.FPDTRingPipeline`), so sp may exceed the head count; tokens lie in the
    zig-zag layout (``shard_sequence(x, sp, chunks=layout_chunks, ring=ring)``)."""
    offload: bool = False
    """Keep FPDT chunks and (with ``checkpoint``) block inputs in host memory between uses."""
    ffn_chunks: int | None = None
    """FFN chunks along the local sequence (1 = unchunked). Default: ``chunks`` for fpdt, else 1."""
    loss_chunks: int | None = None
    """LM-head + loss chunks along the local sequence (1 = full logits). Default: ``chunks`` for fpdt, else 1."""
    checkpoint: bool = False
    """Recompute each block in backward, keeping only its input."""
    offload_checkpoints: bool = False
    """With ``checkpoint``: keep the block inputs in host memory (in every sequence mode), each brought back
    while the block after it recomputes."""

    def __post_init__(self) -> None:
        LlamaShape.__post_init__(self)  # zero-argument super() does not work in a slots dataclass
        if self.sequence_parallel not in SEQUENCE_PARALLEL:
            raise ValueError(f"sequence_parallel = {self.sequence_parallel!r}; valid: {', '.join(SEQUENCE_PARALLEL)}")
        fp = self.sequence_parallel == "fpdt"
        if self.ffn_chunks is None:
            self.ffn_chunks = self.chunks if fp else 1
        if self.loss_chunks is None:
            self.loss_chunks = self.chunks if fp else 1
        for k in ("chunks", "ffn_chunks", "loss_chunks", "ring"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"LlamaConfig.{k} = {v!r} must be an integer >= 1")
        if self.ring > 1 and self.sequence_parallel == "none":
            raise ValueError(f"ring = {self.ring} with sequence_parallel = 'none': the ring runs across Ulysses "
                             f"groups; use sequence_parallel = 'ulysses' or 'fpdt', or ring = 1")

    @property
    def layout_chunks(self) -> int:
        """The ``chunks`` to pass to ``shard_sequence`` for this model's token layout."""
        return self.chunks if self.sequence_parallel == "fpdt" else 1

    @property
    def layout_ring(self) -> int:
        """The ``ring`` to pass to ``shard_sequence`` for this model's token layout."""
        return self.ring if self.sequence_parallel != "none" else 1

    @classmethod
    def from_any(cls, obj: Any, **overrides: Any) -> "LlamaConfig":
        """A config from any object or dict with (some of) the same field names, e.g. loom.train's ModelConfig."""
        names = [f.name for f in fields(cls)]
        src = obj if isinstance(obj, dict) else {n: getattr(obj, n) for n in names if hasattr(obj, n)}
        return cls(**{**{k: v for k, v in src.items() if k in names}, **overrides})
