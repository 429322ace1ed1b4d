"""The model the trainer drives, behind a small interface, and loom/train's reference Llama.

Interface the trainer needs (``TrainModel``): ``forward(tokens, start) -> logits`` on this rank's slice of
the sequence (``tokens`` is ``[batch, seq_len / sp]`` starting at global position ``start``), parameters with
globally unique names, and ``layer_names(i)`` so a pipeline can keep a contiguous range of blocks.

:func:`build_model` uses ``loom.models.llama`` (engineer A's Llama with Ulysses/FPDT) when that module is
importable and exposes ``build_llama``; otherwise the reference :class:`Llama` below, whose sequence
parallelism is Ulysses through :class:`UlyssesAllToAll` (a differentiable all-to-all over the ``sp`` axis).

Ulysses plan (per attention layer, ``p = sp`` ranks): q, k, v are computed on the local ``S/p`` tokens for
all heads; one all-to-all per tensor turns ``[B, S/p, H, D]`` into ``[B, S, H/p, D]`` (full sequence, a
slice of the heads); causal attention runs locally; one all-to-all turns the output back into
``[B, S/p, H, D]``. Backward runs the same all-to-alls in reverse. Grouped-query k/v travel as ``kv_heads``
heads when ``p`` divides them, else expanded to ``heads`` first.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config, ModelConfig

__all__ = ["Llama", "UlyssesAllToAll", "build_model", "COMM_TIME", "model_source"]

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


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, start: int, theta: float) -> torch.Tensor:
    """Rotary embedding of ``[B, S, H, D]`` at global positions ``start .. start+S-1``."""
    b, s, h, d = x.shape
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    pos = torch.arange(start, start + s, dtype=torch.float64)
    ang = pos[:, None] * inv[None, :]
    cos = ang.cos().to(x.dtype)[None, :, None, :]
    sin = ang.sin().to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sp_comm=None):
        super().__init__()
        self.cfg = cfg
        self.sp = sp_comm if (sp_comm is not None and sp_comm.size > 1) else None
        hd = cfg.head_dim
        self.wq = nn.Linear(cfg.hidden, cfg.heads * hd, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * hd, bias=False)
        self.wo = nn.Linear(cfg.heads * hd, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        c = self.cfg
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, c.heads, c.head_dim)
        k = self.wk(x).view(b, s, c.kv_heads, c.head_dim)
        v = self.wv(x).view(b, s, c.kv_heads, c.head_dim)
        q, k = _rope(q, start, c.rope_theta), _rope(k, start, c.rope_theta)
        group = c.heads // c.kv_heads
        if self.sp is not None:
            p = self.sp.size
            if c.kv_heads % p:  # k/v heads cannot be split over sp: expand them to one per query head first
                k, v = k.repeat_interleave(group, dim=2), v.repeat_interleave(group, dim=2)
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
        return self.wo(o.reshape(b, s, c.heads * c.head_dim))


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


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, sp_comm=None):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.attn = Attention(cfg, sp_comm)
        self.ffn_norm = RMSNorm(cfg.hidden, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor, start: int) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), start)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    """Reference Llama-style decoder (loom/train's own; used when ``loom.models.llama`` is absent).

    Args:
        cfg: model shape.
        sp_comm: the ``sp`` sub-communicator (Ulysses) or ``None``.
        layers: ``(lo, hi)``: build only blocks ``lo..hi-1``, plus the embedding when ``lo == 0`` and the final
            norm/head when ``hi == cfg.layers`` (a pipeline stage). Parameter names stay global
            (``blocks.<i>.…``) so stage checkpoints merge into one model.
    """

    def __init__(self, cfg: ModelConfig, sp_comm=None, layers: tuple[int, int] | None = None):
        super().__init__()
        if cfg.ffn == "moe":
            raise ValueError("model.ffn = 'moe' needs loom.models.llama with MoE support (loom.parallel.moe), "
                             "which is not available in this build; use ffn = 'swiglu' or 'gelu'")
        self.cfg = cfg
        lo, hi = layers or (0, cfg.layers)
        self.lo, self.hi = lo, hi
        self.first, self.last = lo == 0, hi == cfg.layers
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden) if self.first else None
        self.blocks = nn.ModuleDict({str(i): Block(cfg, sp_comm) for i in range(lo, hi)})
        if self.last:
            self.norm = RMSNorm(cfg.hidden, cfg.norm_eps)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
        else:
            self.norm = self.head = None
        self._init_weights(cfg)

    def _init_weights(self, cfg: ModelConfig) -> None:
        # Per-parameter generators seeded by the global name: every stage split initializes identically.
        for name, p in self.named_parameters():
            g = torch.Generator().manual_seed(_name_seed(name))
            if name.endswith("norm.weight"):
                continue
            std = 0.02
            if name.endswith(("wo.weight", "w2.weight")):
                std = 0.02 / math.sqrt(2 * cfg.layers)
            with torch.no_grad():
                p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * std)

    def forward(self, x: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Tokens ``[B, S_local]`` (first stage) or hidden ``[B, S_local, hidden]`` -> logits or hidden."""
        h = self.embed(x) if self.first else x
        for blk in self.blocks.values():
            h = blk(h, start)
        if self.last:
            h = self.head(self.norm(h))
        return h


def _name_seed(name: str) -> int:
    import zlib

    return zlib.crc32(name.encode())


def model_source() -> str:
    """Which implementation :func:`build_model` uses: ``loom.models.llama`` or ``loom.train.model``."""
    try:
        import loom.models.llama as ext  # noqa: F401

        if hasattr(ext, "build_llama"):
            return "loom.models.llama"
    except ImportError:
        pass
    return "loom.train.model"


def build_model(cfg: Config, *, sp_comm=None, layers: tuple[int, int] | None = None,
                dtype: torch.dtype = torch.float32, device: Any = "cpu") -> nn.Module:
    """The model for this rank (a pipeline stage when ``layers`` is given), in ``dtype`` on ``device``."""
    model = Llama(cfg.model, sp_comm, layers)
    return model.to(device=device, dtype=dtype)
