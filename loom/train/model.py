"""The model ``loom train`` drives: a Llama-style decoder as an ``nn.Sequential`` of global-named stages.

Interface the trainer relies on: ``model(tokens) -> logits`` on this rank's slice of the sequence
(``tokens`` ``[batch, seq_len / sp]``, global positions in ``model.positions.value``), an ``nn.Sequential``
(``Embed``, ``Block`` x layers, ``Head``) so ``loom.parallel.HybridParallel`` can cut pipeline stages without
tracing, and parameter names that are the same on every rank.

Sequence parallelism inside attention uses ``loom.parallel.sequence`` (``ulysses_attention`` /
``fpdt_attention``, engineer A's) when importable; otherwise the fallback below: Ulysses through
:class:`UlyssesAllToAll`. Its plan (per attention layer, ``p = sp`` ranks): q, k, v are computed on the local
``S/p`` tokens for all heads; one all-to-all per tensor turns ``[B, S/p, H, D]`` into ``[B, S, H/p, D]``
(full sequence, a slice of the heads); causal attention runs locally; one all-to-all turns the output back
into ``[B, S/p, H, D]``. Backward runs the same all-to-alls in reverse. Grouped-query k/v travel as
``kv_heads`` heads when ``p`` divides them, else expanded to ``heads`` first.

:func:`build_model` prefers ``loom.models.llama`` (engineer A's decoder: FPDT with chunked FFN/loss and
offloaded recompute) and wraps it in :class:`TrainModel`: its ``loss`` for whole-model steps, and an
``nn.Sequential`` view over the same parameters (embedding, blocks, head) for pipeline stages. The reference
:class:`Llama` here is the fallback when that module is absent.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import RMSNorm, rope
from .config import Config, ConfigError, ModelConfig, SequenceConfig

__all__ = ["Llama", "Positions", "TrainModel", "UlyssesAllToAll", "build_model", "COMM_TIME", "model_source"]

# Seconds spent inside sequence-parallel all-to-alls (forward and backward), read by the trainer's breakdown.
COMM_TIME: dict[str, float] = {"sp": 0.0}


def _a2a_seq_to_heads(x: torch.Tensor, comm) -> torch.Tensor:
    """``[B, S/p, H, D]`` -> ``[B, S, H/p, D]`` with one all-to-all over ``comm``."""
    p = comm.size
    b, s, h, d = x.shape
    send = x.reshape(b, s, p, h // p, d).permute(2, 0, 1, 3, 4).contiguous()  # [p(head grp), B, S/p, H/p, D]
    t0 = time.perf_counter()
    recv = comm.alltoall(send)  # block j = rank j's sequence slice of my head group
    COMM_TIME["sp"] += time.perf_counter() - t0
    return recv.permute(1, 0, 2, 3, 4).reshape(b, p * s, h // p, d)


def _a2a_heads_to_seq(x: torch.Tensor, comm) -> torch.Tensor:
    """``[B, S, H/p, D]`` -> ``[B, S/p, H, D]`` (the inverse, and the adjoint, of :func:`_a2a_seq_to_heads`)."""
    p = comm.size
    b, s, h, d = x.shape
    send = x.reshape(b, p, s // p, h, d).permute(1, 0, 2, 3, 4).contiguous()  # [p(seq chunk), B, S/p, H/p, D]
    t0 = time.perf_counter()
    recv = comm.alltoall(send)  # block j = my sequence slice of head group j
    COMM_TIME["sp"] += time.perf_counter() - t0
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // p, p * h, d)


class UlyssesAllToAll(torch.autograd.Function):
    """Differentiable all-to-all between sequence-sharded and head-sharded layouts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, comm, to_heads: bool) -> torch.Tensor:  # type: ignore[override]
        ctx.comm, ctx.to_heads = comm, to_heads
        return _a2a_seq_to_heads(x, comm) if to_heads else _a2a_heads_to_seq(x, comm)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        g = g.contiguous()
        out = _a2a_heads_to_seq(g, ctx.comm) if ctx.to_heads else _a2a_seq_to_heads(g, ctx.comm)
        return out, None, None


class Positions:
    """Global token positions of this rank's slice, shared by every block (set once per sequence layout)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor | None = None):
        self.value = value


def _sequence_ops():
    try:
        from loom.parallel import sequence
    except ImportError:
        return None
    return sequence if hasattr(sequence, "fpdt_attention") and hasattr(sequence, "ulysses_attention") else None


class Attention(nn.Module):
    """Grouped-query attention; over ``sp`` ranks with Ulysses or FPDT (``loom.parallel.sequence``)."""

    def __init__(self, cfg: ModelConfig, pos: Positions, sp_comm=None, seq: SequenceConfig | None = None):
        super().__init__()
        self.cfg = cfg
        self.pos = pos
        self.sp = sp_comm if (sp_comm is not None and sp_comm.size > 1) else None
        self.seq = seq or SequenceConfig()
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, c.heads, c.head_dim)
        k = self.wk(x).view(b, s, c.kv_heads, c.head_dim)
        v = self.wv(x).view(b, s, c.kv_heads, c.head_dim)
        pos = self.pos.value if self.pos.value is not None else torch.arange(s, device=x.device)
        q, k = rope(q, pos, c.rope_theta), rope(k, pos, c.rope_theta)
        ops = _sequence_ops() if self.sp is not None else None
        if ops is not None and self.seq.algorithm == "fpdt":
            o = ops.fpdt_attention(q, k, v, self.sp, chunks=self.seq.chunks, causal=True, offload=self.seq.offload)
        elif ops is not None:
            o = ops.ulysses_attention(q, k, v, self.sp, causal=True)
        else:
            o = self._local_or_own_ulysses(q, k, v)
        return self.wo(o.reshape(b, s, c.heads * c.head_dim))

    def _local_or_own_ulysses(self, q, k, v) -> torch.Tensor:
        c = self.cfg
        if self.sp is not None:
            p = self.sp.size
            if c.kv_heads % p:  # k/v heads cannot be split over sp: expand them to one per query head first
                g = c.heads // c.kv_heads
                k, v = k.repeat_interleave(g, dim=2), v.repeat_interleave(g, dim=2)
            q = UlyssesAllToAll.apply(q, self.sp, True)
            k = UlyssesAllToAll.apply(k, self.sp, True)
            v = UlyssesAllToAll.apply(v, self.sp, True)
        group = q.shape[2] // k.shape[2]
        if group > 1:
            k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        o = o.transpose(1, 2)
        if self.sp is not None:
            o = UlyssesAllToAll.apply(o.contiguous(), self.sp, False)
        return o


class FeedForward(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.kind = cfg.ffn
        h, f = cfg.hidden, cfg.ffn_hidden
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        if self.kind == "swiglu":
            self.w3 = nn.Linear(h, f, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class MoEFeedForward(nn.Module):
    """``loom.parallel.moe.MoE`` (top-k, dropless, experts sharded over ``ep``) on ``[B, S, hidden]`` tokens.

    Parameters: ``moe.gate`` (replicated) and ``moe.w1``/``moe.w2`` (this ``ep`` rank's experts along dim 0).
    """

    def __init__(self, cfg: ModelConfig, ep_comm, seed: int):
        super().__init__()
        try:
            from loom.parallel.moe import MoE, MoEConfig
        except ImportError as exc:
            raise ConfigError(f"model.ffn = 'moe' needs loom.parallel.moe, which is not importable ({exc})") from None
        try:
            self.moe = MoE(MoEConfig(dim=cfg.hidden, hidden=cfg.ffn_hidden, experts=cfg.experts, top_k=cfg.top_k,
                                     seed=seed, dtype=torch.float64), ep_comm)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        return self.moe(x.reshape(b * s, h)).reshape(b, s, h)


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, pos: Positions, sp_comm=None, seq: SequenceConfig | None = None,
                 ep_comm=None, index: int = 0):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, pos, sp_comm, seq)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = MoEFeedForward(cfg, ep_comm, seed=1000 + index) if cfg.ffn == "moe" else FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Embed(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class Head(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


class Llama(nn.Sequential):
    """Reference Llama-style decoder as ``nn.Sequential(Embed, Block x layers, Head)``.

    A ``Sequential`` so that ``loom.parallel.HybridParallel`` can cut it into pipeline stages without
    tracing; parameter names (``0.embed.weight``, ``3.attn.wq.weight``, ...) are global, so per-stage
    checkpoints merge into one model. ``positions`` (shared by all blocks) holds the global positions of this
    rank's tokens: the sequence-parallel layout, or ``arange`` when ``None``.

    Args:
        cfg: model shape.
        sp_comm: the ``sp`` sub-communicator (Ulysses/FPDT) or ``None``.
        seq: sequence-parallel settings (algorithm, chunks, offload).
    """

    def __init__(self, cfg: ModelConfig, sp_comm=None, seq: SequenceConfig | None = None, ep_comm=None):
        pos = Positions()
        super().__init__(Embed(cfg), *[Block(cfg, pos, sp_comm, seq, ep_comm, i) for i in range(cfg.layers)],
                         Head(cfg))
        self.cfg = cfg
        self.positions = pos
        self._init_weights(cfg)

    def _init_weights(self, cfg: ModelConfig) -> None:
        # One generator per parameter seeded by its global name: identical on every rank and every stage split.
        for name, p in self.named_parameters():
            if name.endswith("norm.weight") or ".ffn.moe." in name:  # MoE initializes its own (seeded per layer)
                continue
            g = torch.Generator().manual_seed(_name_seed(name))
            std = 0.02 / math.sqrt(2 * cfg.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)


def _name_seed(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


class _EmbedStage(nn.Module):
    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class _BlockStage(nn.Module):
    """One ``loom.models.llama`` block as a one-input module, its positions read from the shared holder."""

    def __init__(self, block: nn.Module, pos: Positions):
        super().__init__()
        self.block = block
        self.pos = pos

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = self.pos.value if self.pos.value is not None else torch.arange(h.shape[1], device=h.device)
        return self.block(h, pos)


class _HeadStage(nn.Module):
    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


def _mean_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, y.reshape(-1))


class TrainModel:
    """What the trainer drives: the module that owns the parameters, a pipeline view, the loss.

    Attributes:
        module: owns the parameters; its ``named_parameters()`` names go into checkpoints.
        pipeline: an ``nn.Sequential`` over the same parameters (embedding, blocks, head) for HybridParallel.
        positions: the shared holder of this rank's global token positions (pipeline view / fallback model).
        sp_sum: ``loss()`` returns this rank's *share* of the sequence mean (sum over ``sp`` = the mean), so
            gradients are summed over ``sp``; otherwise it is the local mean and gradients are averaged.
        impl: ``"loom.models.llama"`` or ``"loom.train.model"`` (recorded in checkpoints).
    """

    def __init__(self, module: nn.Module, pipeline: nn.Sequential, positions: Positions, sp_sum: bool, impl: str):
        self.module, self.pipeline, self.positions, self.sp_sum, self.impl = module, pipeline, positions, sp_sum, impl

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The whole-model loss on this rank's tokens (see ``sp_sum``)."""
        if self.impl == "loom.models.llama":
            return self.module.loss(x, y)
        return _mean_ce(self.module(x), y)

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pipeline loss on the last stage's logits: the mean over the micro-batch's local tokens."""
        return _mean_ce(logits, y)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def _external_llama():
    try:
        from loom.models import llama
    except ImportError:
        return None
    return llama if hasattr(llama, "build_llama") else None


def model_source() -> str:
    """Which implementation :func:`build_model` uses."""
    if _external_llama() is not None:
        return "loom.models.llama (Ulysses/FPDT from loom.parallel.sequence)"
    if _sequence_ops() is not None:
        return "loom.train.model.Llama + loom.parallel.sequence (Ulysses/FPDT)"
    return "loom.train.model.Llama + its own Ulysses all-to-all"


def build_model(cfg: Config, *, sp_comm=None, ep_comm=None, dtype: torch.dtype = torch.float32, device: Any = "cpu",
                impl: str | None = None) -> TrainModel:
    """The model for this rank: ``loom.models.llama`` when available (or when ``impl`` names it), else the
    reference :class:`Llama`. ``sp_comm=None`` builds the unsharded model (one rank, generation).
    ``model.hf`` / ``model.hf_config``: a transformers model (loom.integrations.transformers)."""
    if cfg.model.hf or cfg.model.hf_config or impl == "transformers":
        from ..integrations.transformers import build_train_model

        try:
            return build_train_model(cfg, sp_comm=sp_comm, dtype=dtype, device=device)  # type: ignore[return-value]
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
    ext = _external_llama()
    # loom.models.llama has no MoE FFN: MoE models use the reference Llama with loom.parallel.moe.
    want = impl or ("loom.models.llama" if ext is not None and cfg.model.ffn != "moe" else "loom.train.model")
    sharded = sp_comm is not None and sp_comm.size > 1
    if want == "loom.models.llama":
        if ext is None:
            raise ConfigError("this checkpoint/config needs loom.models.llama, which is not importable here")
        if cfg.model.ffn == "moe":
            raise ConfigError("model.ffn = 'moe' is not supported by loom.models.llama; use swiglu or gelu")
        mode = cfg.sequence.algorithm if sharded else "none"
        kw: dict[str, Any] = dict(sequence_parallel=mode, chunks=cfg.sequence.chunks if mode == "fpdt" else 1,
                                  offload=cfg.sequence.offload and mode == "fpdt",
                                  checkpoint=cfg.sequence.recompute)
        try:
            module = ext.build_llama(cfg.model, sp_comm=sp_comm if sharded else None, dtype=dtype, device=device,
                                     **kw)
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
        pos = Positions()
        pipeline = nn.Sequential(_EmbedStage(module.embed), *[_BlockStage(b, pos) for b in module.blocks],
                                 _HeadStage(module.norm, module.head))
        return TrainModel(module, pipeline, pos, sp_sum=sharded, impl=want)
    if cfg.sequence.algorithm == "fpdt" and sharded and _sequence_ops() is None:
        raise ConfigError("sequence.algorithm = 'fpdt' needs loom.parallel.sequence, which is not available in this "
                          "build; use sequence.algorithm = 'ulysses'")
    if cfg.model.ffn == "moe" and ep_comm is None:
        from ..comm import world

        ep_comm = world().split(world().rank, 0, name="ep")  # unsharded experts (one rank, generation)
    module = Llama(cfg.model, sp_comm if sharded else None, cfg.sequence, ep_comm).to(device=device, dtype=dtype)
    return TrainModel(module, module, module.positions, sp_sum=False, impl="loom.train.model")
