"""Mixture of experts with expert parallelism over the ``ep`` axis; dispatch and combine go through
:func:`loom.multipath.alltoallv`, so skewed routing can use multiple paths.

Layer (Mixtral-style, dropless): gate ``g = softmax(x W_g^T)`` over ``E`` experts; each token goes to its
``top_k`` experts with weights ``g_topk / sum(g_topk)``; expert ``e`` is a 2-layer MLP
``gelu(x W1_e) W2_e``; the output is the weighted sum of the token's expert outputs. No capacity limit and
no token dropping, so the layer equals a single-process MoE exactly (up to summation order).

Plan of one forward (``P`` ranks on the ``ep`` communicator, ``E / P`` experts each; rank ``r`` owns experts
``[r E/P, (r+1) E/P)``):

1. Route: gate, top-k, then the ``T k`` (token, expert) assignments sorted by expert (stable), so rows for
   rank ``j`` are contiguous and, within them, grouped by local expert.
2. Counts: one ``alltoall`` of the ``(P, E/P)`` per-(rank, local expert) row counts.
3. Dispatch: one (multi-path) ``alltoallv`` of the token rows.
4. Experts: received rows regrouped by local expert (a permutation), one MLP per expert, un-permuted.
5. Combine: the reverse ``alltoallv`` (counts swapped); weight and ``index_add`` back into token order.

Backward mirrors it: the gradient of each ``alltoallv`` is the ``alltoallv`` with swapped counts (an
autograd ``Function``); 2 all-to-allv forward, 2 backward. The gate weight is replicated: its gradient is
the sum over ranks of the local gradients (all-reduce it with the data-parallel gradients, as for any
replicated parameter).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..comm import Communicator, world

__all__ = ["MoEConfig", "MoE", "moe_reference", "dispatch_alltoallv", "use_multipath"]


@dataclass(kw_only=True, slots=True)
class MoEConfig:
    """Shape of a mixture-of-experts layer."""

    dim: int
    """Model width (token row size)."""
    hidden: int
    """Expert MLP hidden width."""
    experts: int
    """Experts in total (a multiple of the ``ep`` size)."""
    top_k: int = 2
    """Experts per token."""
    seed: int = 0
    """Initialisation seed (the same on every rank: gate replicated, each rank slices its experts)."""
    dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        for k in ("dim", "hidden", "experts", "top_k"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"MoEConfig.{k}={v!r} must be an int >= 1")
        if self.top_k > self.experts:
            raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}; choose top_k <= experts")


class _AllToAllV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_counts, recv_counts, comm, kw):
        ctx.meta = (send_counts, recv_counts, comm, kw)
        return _a2av(x, send_counts, recv_counts, comm, kw)

    @staticmethod
    def backward(ctx, g):
        send_counts, recv_counts, comm, kw = ctx.meta
        if kw is not None and kw.get("counts") is not None:  # the reverse exchange: the matrix transposed
            kw = {**kw, "counts": kw["counts"].T.copy()}
        return _a2av(g.contiguous(), recv_counts, send_counts, comm, kw), None, None, None, None


def _a2av(x, send_counts, recv_counts, comm, kw):
    if kw is None:
        out, _ = comm.alltoallv(x, send_counts, recv_counts)
    else:
        from ..multipath import alltoallv

        out, _ = alltoallv(x, send_counts, comm, recv_counts, **kw)
    return out


def dispatch_alltoallv(x: torch.Tensor, send_counts: list[int], recv_counts: list[int], comm: Communicator,
                       multipath: dict[str, Any] | None = None) -> torch.Tensor:
    """Differentiable ``alltoallv`` (backward: the same with counts swapped). ``multipath`` holds the keyword
    arguments of :func:`loom.multipath.alltoallv` (``topology=...``); ``None`` means plain ``comm.alltoallv``."""
    return _AllToAllV.apply(x, list(send_counts), list(recv_counts), comm, multipath)


def _init(cfg: MoEConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(cfg.seed)  # drawn on the host: the same values whatever the device
    gate = torch.randn(cfg.experts, cfg.dim, generator=g, dtype=torch.float64, device="cpu") / math.sqrt(cfg.dim)
    w1 = torch.randn(cfg.experts, cfg.dim, cfg.hidden, generator=g, dtype=torch.float64,
                     device="cpu") / math.sqrt(cfg.dim)
    w2 = torch.randn(cfg.experts, cfg.hidden, cfg.dim, generator=g, dtype=torch.float64,
                     device="cpu") / math.sqrt(cfg.hidden)
    return gate.to(cfg.dtype), w1.to(cfg.dtype), w2.to(cfg.dtype)


def _route(x: torch.Tensor, gate: torch.Tensor, k: int):
    probs = torch.softmax(x @ gate.t(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    return top / top.sum(-1, keepdim=True), idx


class MoE(torch.nn.Module):
    """Top-k gated MoE layer with experts sharded over ``comm`` (the ``ep`` axis).

    Args:
        config: shapes and seed.
        comm: the expert-parallel communicator (e.g. ``mesh["ep"]``); default the world.
        multipath: keyword arguments for :func:`loom.multipath.alltoallv` (``topology=``, ``min_bytes=``...)
            for dispatch and combine; ``None`` uses plain ``comm.alltoallv``.

    Raises:
        ValueError: ``experts`` does not divide by the communicator size.
    """

    def __init__(self, config: MoEConfig, comm: Communicator | None = None, *,
                 multipath: dict[str, Any] | None = None):
        super().__init__()
        self.config = config
        self.comm = comm or world()
        p = self.comm.size
        if config.experts % p:
            raise ValueError(f"experts={config.experts} does not divide by the ep size {p}; use a multiple of {p}")
        self.local = config.experts // p
        self.multipath = multipath
        d, h, el = config.dim, config.hidden, self.local
        self.gate = torch.nn.Parameter(torch.empty(config.experts, d, dtype=config.dtype))
        self.w1 = torch.nn.Parameter(torch.empty(el, d, h, dtype=config.dtype))
        self.w2 = torch.nn.Parameter(torch.empty(el, h, d, dtype=config.dtype))
        if not self.gate.is_meta:  # on meta (loom.parallel.materialize): init_parameter fills them later
            for name, p in self.named_parameters():
                self.init_parameter(name, p)

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        """Fill ``tensor`` with parameter ``name``'s initial values (``gate``, or this rank's slice of ``w1``/``w2``
        drawn from the seeded full-expert tensors), in place."""
        values = dict(zip(("gate", "w1", "w2"), _init(self.config)))
        lo = self.comm.rank * self.local
        with torch.no_grad():
            tensor.copy_(values[name] if name == "gate" else values[name][lo:lo + self.local])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[tokens, dim]`` (this rank's tokens; any count, 0 included) -> ``[tokens, dim]``."""
        if x.ndim != 2 or x.shape[1] != self.config.dim:
            raise ValueError(f"MoE expects [tokens, {self.config.dim}], got {list(x.shape)}")
        cfg, comm, p, el = self.config, self.comm, self.comm.size, self.local
        weight, idx = _route(x, self.gate, cfg.top_k)
        expert = idx.reshape(-1)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(cfg.top_k)
        order = torch.argsort(expert, stable=True)
        # The counts are the routing's only host read (MPI needs them as numbers): one copy of E integers
        # per forward; the index tensors built from them are made on the host and moved to x's device once.
        per_expert = torch.bincount(expert, minlength=cfg.experts).reshape(p, el).to(torch.int64).cpu()
        mp = self.multipath
        if mp is None:
            recv_per_expert = comm.alltoall(per_expert.contiguous())                  # [P sources, E/P]
        else:
            # Multi-path planning needs every pair's volume: one allgather of the expert counts (the same
            # single collective as the alltoall it replaces) gives the whole matrix to every rank.
            every = comm.allgather(per_expert.reshape(1, -1)).reshape(p, p, el)       # [src, dst, E/P]
            recv_per_expert = every[:, comm.rank].contiguous()
            matrix = every.sum(2).numpy()
            mp = {**mp, "counts": matrix}
        send_counts = per_expert.sum(1).tolist()
        recv_counts = recv_per_expert.sum(1).tolist()
        rows = dispatch_alltoallv(x[token[order]], send_counts, recv_counts, comm, mp)
        # Received rows: by source, then by local expert. Regroup by local expert for one matmul each.
        local_id = torch.arange(el, device="cpu").repeat(p).repeat_interleave(recv_per_expert.reshape(-1))
        perm = torch.argsort(local_id, stable=True).to(x.device)
        sizes = recv_per_expert.sum(0).tolist()
        outs = [F.gelu(chunk @ self.w1[j]) @ self.w2[j]
                for j, chunk in enumerate(torch.split(rows[perm], sizes))]
        grouped = torch.cat(outs) if outs else rows[:0]
        back_mp = None if mp is None else {**mp, "counts": mp["counts"].T.copy()}
        back = dispatch_alltoallv(grouped[torch.argsort(perm)], recv_counts, send_counts, comm, back_mp)
        contrib = back * weight.reshape(-1)[order].unsqueeze(1)
        return torch.zeros_like(x).index_add(0, token[order], contrib)

    def extra_repr(self) -> str:
        c = self.config
        return f"dim={c.dim}, hidden={c.hidden}, experts={c.experts} ({self.local} here), top_k={c.top_k}"


def moe_reference(x: torch.Tensor, gate: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, top_k: int) -> torch.Tensor:
    """The same layer on one process with every expert (token by token per expert; the exactness oracle)."""
    weight, idx = _route(x, gate, top_k)
    y = torch.zeros_like(x)
    for e in range(gate.shape[0]):
        tok, slot = torch.nonzero(idx == e, as_tuple=True)
        if len(tok):
            y = y.index_add(0, tok, weight[tok, slot].unsqueeze(1) * (F.gelu(x[tok] @ w1[e]) @ w2[e]))
    return y


def use_multipath(module: torch.nn.Module, comm: Communicator, *, topology: str = "auto",
                  min_bytes: int = 1 << 20, learn: bool = False) -> int:
    """Route every :class:`MoE` layer inside ``module`` over ``comm`` through the multi-path planner: each
    forward plans from that step's counts matrix (warm-started from the previous plan) and the dispatch and
    combine go through :func:`loom.multipath.alltoallv`. ``topology`` is ``auto``, a preset or a TOML file
    (:func:`loom.multipath.detect.resolve`). Collective over ``comm`` for ``auto``. ``learn``: the layers
    share one :class:`loom.multipath.links.LinkMonitor`, so every dispatch and combine measures the links and
    the plans follow a slow or congested rail. Returns the layers switched (none on one rank, where there is
    nothing to route)."""
    if comm.size == 1:
        return 0
    from ..multipath.detect import resolve

    topo = resolve(topology, comm)
    layers = [m for m in module.modules() if isinstance(m, MoE)]
    extra = {}
    if learn:
        from ..multipath.links import LinkMonitor

        extra["monitor"] = LinkMonitor(topology=topo)
    for m in layers:
        m.multipath = {"topology": topo, "min_bytes": int(min_bytes), **extra}
    return len(layers)
