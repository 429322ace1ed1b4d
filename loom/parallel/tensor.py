"""Tensor parallelism (Megatron-LM): layers whose weights are split over the ``tp`` axis, and the differentiable
collectives that join them.

Vocabulary: the *tp group* is ``mesh["tp"]``; a tensor is *replicated* when every tp rank holds the same value
and *split* when each holds a slice of its last dim. Megatron's pairing (Shoeybi et al. 2019, Sec. 3) keeps the
residual stream replicated and needs one allreduce per sublayer in forward and one in backward:

* :class:`ColumnParallelLinear` (weight split along its *output* dim) takes a replicated input and gives a
  split output; its input passes :func:`copy_to_tp_region` (identity forward, allreduce of the gradient in
  backward, since every rank's slice of the output depends on the whole input).
* :class:`RowParallelLinear` (weight split along its *input* dim) takes a split input and gives a replicated
  output through :func:`reduce_from_tp_region` (allreduce forward, identity backward).
* Attention: q/k/v are column-parallel with whole heads per rank (GQA: query and key/value heads both split,
  :func:`split_heads`), the output projection row-parallel; the FFN (:class:`ParallelFeedForward`, SwiGLU or
  GELU): gate/up column-parallel, down row-parallel.
* :class:`VocabParallelEmbedding`: rows of the table split by vocabulary range; ids outside the range look
  up zeros, and an allreduce sums the one non-zero row per token.
* :func:`vocab_parallel_cross_entropy`: the loss of column-parallel (vocabulary-split) logits without ever
  gathering them: a max allreduce, then one allreduce of (sum of exponentials, target logit) per token;
  backward is local (``softmax - onehot`` on the rank's slice).

Sizes that do not divide by the tp size are split unevenly (the first ``n % tp`` ranks take one more row,
:func:`shard_range`) wherever no head structure is involved: FFN width and vocabulary. Heads must divide.

Sequence parallelism (Megatron-SP, Korthikanti et al. 2022, Sec. 4.2.2; ``TPLink(...,
sequence_parallel=True)``): between the tp regions the activations are split along the token dim (dim -2)
instead of replicated, so norms, residuals and dropout hold ``1/tp`` of them. The region's entry becomes an
all-gather of tokens (:func:`gather_from_sequence_region`; its backward a reduce-scatter) and its exit a
reduce-scatter (:func:`reduce_scatter_to_sequence_region`; backward an all-gather): the same bytes as the
two allreduces, which are a reduce-scatter and an all-gather each. The column-parallel layers
(:func:`gathered_linears`) gather their input again in backward instead of saving the gathered copy: one more
all-gather per region entry, for activation memory. Parameters used on a token slice (the norms) then get
partial gradients, summed over tp by the caller (``loom.models.parallelize`` passes their weights through
:func:`copy_to_tp_region`). Token counts must divide by tp.

Compression: the activation allreduces (:func:`copy_to_tp_region` backward, :func:`reduce_from_tp_region`
forward) and gathers go through :func:`loom.compress.allreduce` / :func:`loom.compress.allgather` when the layer
is given a codec (``CompressionPolicy.codec_for("tp")``); the per-token reductions of the cross-entropy stay
exact (a max does not survive a lossy sum, and they are ``O(tokens)`` bytes): they are marked
``TPLink.allreduce(..., exact=True)``, which no codec touches. Byte counters land under the
communicator's name (``"tp"`` for ``mesh["tp"]``) in :mod:`loom.stats`.

These collectives are *not* the ``loom.comm`` ones: those are not autograd-aware; the ones here are
``torch.autograd.Function`` s whose backward issues the matching collective.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .. import stats as _stats
from ..comm import Communicator
from ..compress.codecs import Codec
from ..compress.collectives import DEFAULT_MIN_BYTES
from ..compress.collectives import allgather as _c_allgather
from ..compress.collectives import allreduce as _c_allreduce

__all__ = [
    "shard_range", "split_heads", "copy_to_tp_region", "reduce_from_tp_region", "gather_from_tp_region",
    "scatter_to_tp_region", "ColumnParallelLinear", "RowParallelLinear", "ParallelFeedForward",
    "VocabParallelEmbedding", "vocab_parallel_cross_entropy", "TPLink", "split_dims", "enter_tp_region",
    "exit_tp_region", "gather_from_sequence_region", "reduce_scatter_to_sequence_region", "gathered_linears",
]


def shard_range(n: int, size: int, rank: int) -> tuple[int, int]:
    """``[start, end)`` of rank ``rank``'s contiguous slice of ``n`` rows over ``size`` ranks; the first
    ``n % size`` ranks take one row more."""
    base, extra = divmod(n, size)
    start = rank * base + min(rank, extra)
    return start, start + base + (rank < extra)


def split_heads(heads: int, kv_heads: int, tp: int) -> tuple[int, int]:
    """Query and key/value heads per tp rank for grouped-query attention.

    Raises:
        ValueError: ``heads`` or ``kv_heads`` does not divide by ``tp`` (each rank must hold whole heads, and
            every query head's key/value head on the same rank).
    """
    for what, n in (("heads", heads), ("kv_heads", kv_heads)):
        if n % tp:
            ok = [t for t in range(1, n + 1) if heads % t == 0 and kv_heads % t == 0]
            raise ValueError(f"{what} = {n} is not divisible by the tp size {tp}: each tp rank holds whole query "
                             f"and key/value heads; choose tp from {ok} or a model whose heads and kv_heads "
                             f"divide by {tp}")
    return heads // tp, kv_heads // tp


class TPLink:
    """How a layer talks over its tp group: the communicator and the codec of its activation collectives.

    Args:
        comm: the tp group (``mesh["tp"]``).
        codec: codec for activation allreduces/allgathers (name or instance; ``None``: uncompressed).
        min_bytes: messages below this travel uncompressed (see :mod:`loom.compress.collectives`).
    """

    __slots__ = ("comm", "codec", "min_bytes", "sequence_parallel")

    def __init__(self, comm: Communicator, codec: "str | Codec | None" = None, min_bytes: int = DEFAULT_MIN_BYTES,
                 *, sequence_parallel: bool = False):
        if not isinstance(comm, Communicator):
            raise TypeError(f"tp comm must be a loom.comm.Communicator, got {type(comm).__name__}; "
                            f"pass mesh['tp']")
        self.comm, self.codec, self.min_bytes = comm, codec, min_bytes
        self.sequence_parallel = bool(sequence_parallel)

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def rank(self) -> int:
        return self.comm.rank

    def _timed(self, t0: float) -> None:
        # seconds per axis for the step-time breakdown (loom.stats kind "time", scope = the comm's name)
        d = _stats.counters("time", self.comm.name)
        d["comm"] = d.get("comm", 0.0) + time.perf_counter() - t0

    def allreduce(self, x: torch.Tensor, *, op: str = "sum", exact: bool = False) -> torch.Tensor:
        """The reduction over tp; through the link's codec unless marked ``exact`` (a reduction that no
        codec may touch: the cross-entropy's max and its per-token sums, :class:`_VocabParallelCE`).

        Raises:
            ValueError: ``op`` is not ``"sum"`` on a link with a codec and the reduction is not marked exact
                (codecs only sum).
        """
        x = x.contiguous()
        if self.comm.size == 1:
            return x
        t0 = time.perf_counter()
        if self.codec is None or exact:
            out = self.comm.allreduce(x, op=op)
        elif op != "sum":
            raise ValueError(f"tp allreduce op = {op!r} through codec {self.codec!r}: compressed allreduces "
                             f"only sum; pass exact=True for this reduction")
        else:
            out = _c_allreduce(x, self.comm, self.codec, min_bytes=self.min_bytes)
        self._timed(t0)
        return out

    def widths(self, full: int) -> list[int]:
        """Every rank's slice width of a dim of size ``full`` split by :func:`shard_range`."""
        return [hi - lo for lo, hi in (shard_range(full, self.size, r) for r in range(self.size))]

    def gather_last(self, x: torch.Tensor, full: int) -> torch.Tensor:
        """Concatenate every rank's :func:`shard_range` slice ``x`` of a last dim of size ``full``."""
        if self.comm.size == 1:
            return x
        t0 = time.perf_counter()
        t = x.movedim(-1, 0).contiguous()
        if len(set(self.widths(full))) == 1:
            out = self.comm.allgather(t) if self.codec is None else _c_allgather(t, self.comm, self.codec,
                                                                                 min_bytes=self.min_bytes)
        else:
            out, _ = self.comm.allgatherv(t)
        self._timed(t0)
        return out.movedim(0, -1)

    def gather_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's token slice (dim -2, equal sizes)."""
        if self.comm.size == 1:
            return x
        t0 = time.perf_counter()
        t = x.movedim(-2, 0).contiguous()
        out = self.comm.allgather(t) if self.codec is None else _c_allgather(t, self.comm, self.codec,
                                                                             min_bytes=self.min_bytes)
        self._timed(t0)
        return out.movedim(0, -2)

    def reduce_scatter_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over tp, this rank keeping its token slice (dim -2 must divide by tp). Uncompressed: loom.compress
        has no reduce-scatter."""
        if self.comm.size == 1:
            return x
        n = x.shape[-2]
        if n % self.comm.size:
            raise ValueError(f"{n} tokens do not divide by the tp size {self.comm.size}: sequence parallelism "
                             f"splits tokens evenly; use a sequence length (x batch) divisible by {self.comm.size}")
        t0 = time.perf_counter()
        out = self.comm.reduce_scatter(x.movedim(-2, 0).contiguous())
        self._timed(t0)
        return out.movedim(0, -2)

    def __repr__(self) -> str:
        return f"TPLink({self.comm.name!r}, size={self.comm.size}, codec={self.codec!r})"


def _link(tp: "TPLink | Communicator") -> TPLink:
    return tp if isinstance(tp, TPLink) else TPLink(tp)


def _conjugate(name: str, forward, backward) -> type[torch.autograd.Function]:
    """An autograd Function over a tp link whose backward is the conjugate collective of its forward
    (Megatron's f/g pairs: identity / allreduce, token all-gather / reduce-scatter)."""

    class Pair(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, link):
            ctx.link = link
            return forward(link, x)

        @staticmethod
        def backward(ctx, g):
            return backward(ctx.link, g), None

    Pair.__name__ = Pair.__qualname__ = name
    return Pair


_CopyToTP = _conjugate("_CopyToTP", lambda link, x: x.view_as(x), lambda link, g: link.allreduce(g))
_ReduceFromTP = _conjugate("_ReduceFromTP", lambda link, x: link.allreduce(x), lambda link, g: g)
_GatherTokens = _conjugate("_GatherTokens", lambda link, x: link.gather_tokens(x),
                           lambda link, g: link.reduce_scatter_tokens(g))
_ReduceScatterTokens = _conjugate("_ReduceScatterTokens", lambda link, x: link.reduce_scatter_tokens(x),
                                  lambda link, g: link.gather_tokens(g))


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link, full):
        ctx.link, ctx.full = link, full
        return link.gather_last(x, full)

    @staticmethod
    def backward(ctx, g):
        lo, hi = shard_range(ctx.full, ctx.link.size, ctx.link.rank)
        return g[..., lo:hi].contiguous(), None, None


class _ScatterToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, link):
        ctx.link, ctx.full = link, x.shape[-1]
        lo, hi = shard_range(x.shape[-1], link.size, link.rank)
        return x[..., lo:hi].contiguous()

    @staticmethod
    def backward(ctx, g):
        return ctx.link.gather_last(g, ctx.full), None


class _GatheredLinears(torch.autograd.Function):
    """``gather_tokens(x) @ w.T`` for several weights, keeping only the token slice ``x`` for backward.

    Megatron-SP's column-parallel input (Korthikanti et al. 2022, Sec. 4.2.2): the all-gathered tokens are
    not saved but gathered again in backward, so the activation memory the split norms save is not spent on
    the gathered copy. Backward: re-gather ``x``; ``dW = g^T x_full`` per weight; ``dx_full = sum g W``,
    reduce-scattered over tokens.
    """

    @staticmethod
    def forward(ctx, x, link, *weights):
        ctx.link = link
        ctx.save_for_backward(x, *weights)
        full = link.gather_tokens(x)
        return tuple(F.linear(full, w) for w in weights)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        full = ctx.link.gather_tokens(x)
        flat = full.reshape(-1, full.shape[-1])
        dx = None
        dws = []
        for g, w in zip(grads, weights):
            if g is None:
                dws.append(None)
                continue
            gd = g.reshape(-1, g.shape[-1])
            dws.append(gd.t() @ flat if ctx.needs_input_grad[2 + len(dws)] else None)
            part = g @ w
            dx = part if dx is None else dx + part
        if dx is None:
            dx = torch.zeros_like(full)
        return (ctx.link.reduce_scatter_tokens(dx), None, *dws)


def gathered_linears(x: torch.Tensor, tp: "TPLink | Communicator", *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Column-parallel projections of one input entering a tp region: ``enter_tp_region(x) @ w.T`` for each
    weight. With sequence parallelism the gathered tokens are re-gathered in backward instead of saved
    (:class:`_GatheredLinears`); otherwise the input is copied once (:func:`copy_to_tp_region`)."""
    link = _link(tp)
    if link.sequence_parallel and link.size > 1:
        return _GatheredLinears.apply(x, link, *weights)
    x = copy_to_tp_region(x, link)
    return tuple(F.linear(x, w) for w in weights)


def gather_from_sequence_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """All-gather of the token slices (dim -2) forward; reduce-scatter of the gradient backward."""
    return _GatherTokens.apply(x, _link(tp))


def reduce_scatter_to_sequence_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """Reduce-scatter over tokens (dim -2) forward; all-gather of the gradient backward."""
    return _ReduceScatterTokens.apply(x, _link(tp))


def enter_tp_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """The input of a tensor-parallel region: :func:`copy_to_tp_region`, or with sequence parallelism
    :func:`gather_from_sequence_region`."""
    link = _link(tp)
    return gather_from_sequence_region(x, link) if link.sequence_parallel else copy_to_tp_region(x, link)


def exit_tp_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """The output of a tensor-parallel region: :func:`reduce_from_tp_region`, or with sequence parallelism
    :func:`reduce_scatter_to_sequence_region`."""
    link = _link(tp)
    return reduce_scatter_to_sequence_region(x, link) if link.sequence_parallel else reduce_from_tp_region(x, link)


def copy_to_tp_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """Identity forward; allreduce of the gradient over tp in backward (the input of column-parallel layers)."""
    return _CopyToTP.apply(x, _link(tp))


def reduce_from_tp_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """Allreduce (sum) over tp forward; identity backward (the output of row-parallel layers)."""
    return _ReduceFromTP.apply(x, _link(tp))


def gather_from_tp_region(x: torch.Tensor, tp: "TPLink | Communicator", full: int | None = None) -> torch.Tensor:
    """Concatenate the ranks' slices along the last dim forward; keep this rank's slice of the gradient.

    ``full``: the gathered size, when the slices are the uneven ones of :func:`shard_range` (default: every
    rank's slice is as wide as this one's)."""
    link = _link(tp)
    return _GatherFromTP.apply(x, link, x.shape[-1] * link.size if full is None else int(full))


def scatter_to_tp_region(x: torch.Tensor, tp: "TPLink | Communicator") -> torch.Tensor:
    """Keep this rank's slice (:func:`shard_range`) of the last dim forward; gather the gradient backward."""
    return _ScatterToTP.apply(x, _link(tp))


# ------------------------------------------------------------------------------------------------ layers
class ColumnParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` split along its output dim: this rank holds rows
    ``[out_start, out_end)`` (:func:`shard_range`) and computes that slice of ``y``.

    Args:
        in_features, out_features: the full layer's sizes.
        tp: the tp group (a :class:`TPLink` or communicator).
        bias: add a bias (split like the output).
        copy_input: pass the input through :func:`enter_tp_region` (off when several column-parallel layers
            read one input that was copied once, e.g. q/k/v or gate/up, so backward allreduces once).
        gather_output: gather the split output to every rank (for a replicated result).
    """

    def __init__(self, in_features: int, out_features: int, tp: "TPLink | Communicator", *, bias: bool = False,
                 copy_input: bool = True, gather_output: bool = False, dtype: torch.dtype | None = None,
                 device: Any = None):
        super().__init__()
        self.tp = _link(tp)
        self.in_features, self.out_features = in_features, out_features
        self.out_start, self.out_end = shard_range(out_features, self.tp.size, self.tp.rank)
        self.copy_input, self.gather_output = copy_input, gather_output
        n = self.out_end - self.out_start
        self.weight = nn.Parameter(torch.empty(n, in_features, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.zeros(n, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, tp: "TPLink | Communicator", **kw: Any) -> "ColumnParallelLinear":
        """This rank's slice of a whole ``nn.Linear`` (so a tp run starts from the one-rank weights)."""
        m = cls(lin.in_features, lin.out_features, tp, bias=lin.bias is not None, dtype=lin.weight.dtype,
                device=lin.weight.device, **kw)
        with torch.no_grad():
            m.weight.copy_(lin.weight[m.out_start:m.out_end])
            if m.bias is not None:
                m.bias.copy_(lin.bias[m.out_start:m.out_end])
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.copy_input and self.bias is None:
            (y,) = gathered_linears(x, self.tp, self.weight)
            return gather_from_tp_region(y, self.tp, self.out_features) if self.gather_output else y
        if self.copy_input:
            x = enter_tp_region(x, self.tp)
        y = F.linear(x, self.weight, self.bias)
        return gather_from_tp_region(y, self.tp, self.out_features) if self.gather_output else y

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.out_features} [{self.out_start}:{self.out_end}] of tp "
                f"{self.tp.size}")


class RowParallelLinear(nn.Module):
    """``y = x W^T (+ b)`` with ``W`` split along its input dim: this rank holds columns
    ``[in_start, in_end)``, multiplies its slice of ``x`` and the partial products are summed over tp
    (:func:`reduce_from_tp_region`); the bias is added once, after the sum.

    Args:
        input_is_parallel: ``x`` is already this rank's slice (the output of a column-parallel layer);
            otherwise it is replicated and scattered first.
        reduce_output: sum the partial outputs (:func:`exit_tp_region`; off only for a caller that reduces
            itself).
    """

    def __init__(self, in_features: int, out_features: int, tp: "TPLink | Communicator", *, bias: bool = False,
                 input_is_parallel: bool = True, reduce_output: bool = True, dtype: torch.dtype | None = None,
                 device: Any = None):
        super().__init__()
        self.tp = _link(tp)
        self.in_features, self.out_features = in_features, out_features
        self.in_start, self.in_end = shard_range(in_features, self.tp.size, self.tp.rank)
        self.input_is_parallel, self.reduce_output = input_is_parallel, reduce_output
        self.weight = nn.Parameter(torch.empty(out_features, self.in_end - self.in_start, dtype=dtype,
                                               device=device))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None

    @classmethod
    def from_linear(cls, lin: nn.Linear, tp: "TPLink | Communicator", **kw: Any) -> "RowParallelLinear":
        m = cls(lin.in_features, lin.out_features, tp, bias=lin.bias is not None, dtype=lin.weight.dtype,
                device=lin.weight.device, **kw)
        with torch.no_grad():
            m.weight.copy_(lin.weight[:, m.in_start:m.in_end])
            if m.bias is not None:
                m.bias.copy_(lin.bias)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp)
        y = F.linear(x, self.weight)
        if self.reduce_output:
            y = exit_tp_region(y, self.tp)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in={self.in_features} [{self.in_start}:{self.in_end}], out={self.out_features} of tp "
                f"{self.tp.size}")


class ParallelFeedForward(nn.Module):
    """The FFN with its inner width split over tp: ``w2(silu(w1 x) * w3 x)`` (SwiGLU) or ``w2(gelu(w1 x))``.

    ``w1`` (gate) and ``w3`` (up) are column-parallel, ``w2`` (down) row-parallel; the input is copied to the
    tp region once, so forward and backward each cost one allreduce of ``[tokens, hidden]``. The inner
    width may be uneven over tp (the elementwise product pairs the same rows of ``w1`` and ``w3``).
    Parameter names (``w1``, ``w2``, ``w3``) are those of the dense FFN it replaces.
    """

    def __init__(self, hidden: int, inner: int, tp: "TPLink | Communicator", *, kind: str = "swiglu",
                 dtype: torch.dtype | None = None, device: Any = None):
        super().__init__()
        if kind not in ("swiglu", "gelu"):
            raise ValueError(f"ParallelFeedForward kind = {kind!r}; valid: swiglu, gelu")
        self.tp, self.kind = _link(tp), kind
        kw = dict(dtype=dtype, device=device)
        self.w1 = ColumnParallelLinear(hidden, inner, self.tp, copy_input=False, **kw)
        self.w2 = RowParallelLinear(inner, hidden, self.tp, **kw)
        self.w3 = ColumnParallelLinear(hidden, inner, self.tp, copy_input=False, **kw) if kind == "swiglu" else None

    @classmethod
    def from_dense(cls, w1: nn.Linear, w2: nn.Linear, w3: nn.Linear | None, tp: "TPLink | Communicator"
                   ) -> "ParallelFeedForward":
        """This rank's slices of a dense FFN's ``w1`` (gate), ``w2`` (down) and ``w3`` (up, ``None``: GELU)."""
        for lin in (w1, w2, w3):
            if lin is not None and lin.bias is not None:
                raise ValueError("ParallelFeedForward.from_dense takes bias-free linears (Llama's FFN); "
                                 "build ColumnParallelLinear/RowParallelLinear directly for biased ones")
        m = cls(w1.in_features, w1.out_features, tp, kind="swiglu" if w3 is not None else "gelu",
                dtype=w1.weight.dtype, device=w1.weight.device)
        m.w1 = ColumnParallelLinear.from_linear(w1, m.tp, copy_input=False)
        m.w2 = RowParallelLinear.from_linear(w2, m.tp)
        if w3 is not None:
            m.w3 = ColumnParallelLinear.from_linear(w3, m.tp, copy_input=False)
        return m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Megatron-SP: one gather for gate and up, re-gathered in backward. Otherwise the submodules are called
        # (ZeRO-3 gathers a module's weights in its forward hooks).
        if self.tp.sequence_parallel and self.w1.bias is None and (self.w3 is None or self.w3.bias is None):
            if self.w3 is not None:
                gate, up = gathered_linears(x, self.tp, self.w1.weight, self.w3.weight)
                return self.w2(F.silu(gate) * up)
            (h,) = gathered_linears(x, self.tp, self.w1.weight)
            return self.w2(F.gelu(h))
        x = enter_tp_region(x, self.tp)
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class VocabParallelEmbedding(nn.Module):
    """An embedding table split by vocabulary range over tp: rank ``r`` holds rows
    ``[vocab_start, vocab_end)`` (:func:`shard_range`, uneven allowed).

    Forward: ids outside this rank's range look up row 0 and are zeroed (a masked lookup), then one allreduce
    over tp (a reduce-scatter of tokens with sequence parallelism) sums the single non-zero contribution per
    token; the lookup's gradient lands only on this rank's rows.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, tp: "TPLink | Communicator", *,
                 dtype: torch.dtype | None = None, device: Any = None):
        super().__init__()
        self.tp = _link(tp)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.vocab_start, self.vocab_end = shard_range(num_embeddings, self.tp.size, self.tp.rank)
        if self.vocab_end == self.vocab_start:
            raise ValueError(f"vocabulary of {num_embeddings} is smaller than the tp size {self.tp.size}; "
                             f"use tp <= {num_embeddings}")
        self.weight = nn.Parameter(torch.empty(self.vocab_end - self.vocab_start, embedding_dim, dtype=dtype,
                                               device=device))

    @classmethod
    def from_embedding(cls, emb: nn.Embedding, tp: "TPLink | Communicator") -> "VocabParallelEmbedding":
        m = cls(emb.num_embeddings, emb.embedding_dim, tp, dtype=emb.weight.dtype, device=emb.weight.device)
        with torch.no_grad():
            m.weight.copy_(emb.weight[m.vocab_start:m.vocab_end])
        return m

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return exit_tp_region(out, self.tp)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} [{self.vocab_start}:{self.vocab_end}] of tp "
                f"{self.tp.size}")


class _VocabParallelCE(torch.autograd.Function):
    """Per-token cross-entropy of vocabulary-split logits ``[N, V_local]`` (Megatron's
    ``_VocabParallelCrossEntropy``).

    Plan: (1) ``m = allreduce_max(max_j logits)``; (2) ``z = logits - m``; one allreduce (sum) of the pair
    ``(sum_j exp z_j, z_target if the target is in this rank's range else 0)``; (3) ``loss = log S - z_t``.
    Backward, per rank and without communication: ``(softmax - onehot_local) * g`` on the local slice.
    """

    @staticmethod
    def forward(ctx, logits, targets, link, vocab_start, ignore_index):
        n, v = logits.shape
        # both reductions are marked exact: a max does not survive a lossy sum, and a codec's error on the
        # per-token sums goes straight into every token's loss (tests/mpi/check_tensor.py checks both)
        m = link.allreduce(logits.max(dim=-1).values, op="max", exact=True)
        z = logits - m.unsqueeze(-1)
        ignored = targets == ignore_index
        inside = (targets >= vocab_start) & (targets < vocab_start + v) & ~ignored
        local_t = (targets - vocab_start).masked_fill(~inside, 0)
        rows = torch.arange(n, device=logits.device)
        zt = z[rows, local_t].masked_fill(~inside, 0.0)
        e = z.exp()
        pair = link.allreduce(torch.stack([e.sum(dim=-1), zt]), exact=True)
        s, zt = pair[0], pair[1]
        loss = (s.log() - zt).masked_fill(ignored, 0.0)
        e.div_(s.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(e, local_t, inside, ignored)
        return loss

    @staticmethod
    def backward(ctx, g):
        p, local_t, inside, ignored = ctx.saved_tensors
        grad = p.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_t] -= inside.to(grad.dtype)
        grad.mul_(g.masked_fill(ignored, 0.0).unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, tp: "TPLink | Communicator",
                                 vocab_start: int, *, ignore_index: int = -100,
                                 reduction: str = "sum") -> torch.Tensor:
    """Cross-entropy of logits split by vocabulary over tp, without gathering them.

    Args:
        logits: ``[..., V_local]``, this rank's vocabulary slice ``[vocab_start, vocab_start + V_local)``
            (a column-parallel LM head's output; reduced in fp32, fp64 stays fp64).
        targets: ``[...]`` global token ids, the same on every tp rank; ``ignore_index`` entries give 0.
        tp: the tp group.
        vocab_start: the first vocabulary id of this rank's slice.
        reduction: ``"sum"``, ``"mean"`` (over non-ignored targets) or ``"none"`` (per token).

    Returns:
        The loss, the same on every tp rank; its gradient flows to this rank's logits only.
    """
    if reduction not in ("sum", "mean", "none"):
        raise ValueError(f"reduction = {reduction!r}; valid: sum, mean, none")
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: targets "
                         f"must be logits' shape without the last (vocabulary) dim")
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    flat = logits.reshape(-1, logits.shape[-1]).to(acc)
    per = _VocabParallelCE.apply(flat, targets.reshape(-1), _link(tp), int(vocab_start), ignore_index)
    if reduction == "none":
        return per.view(targets.shape)
    total = per.sum()
    if reduction == "mean":
        return total / (targets != ignore_index).sum().clamp(min=1)
    return total


def split_dims(module: nn.Module) -> dict[str, int]:
    """``{parameter name: dim}`` of every parameter of ``module`` split over tp, and along which dim (0: rows
    of column-parallel weights and biases and of the embedding; 1: columns of row-parallel weights).
    Parameters not listed are replicated over tp. A tied parameter is listed once, under its first name (as
    ``named_parameters()`` lists it)."""
    dims: dict[int, int] = {}
    for mod in module.modules():
        if isinstance(mod, (ColumnParallelLinear, VocabParallelEmbedding)):
            dims[id(mod.weight)] = 0
            if getattr(mod, "bias", None) is not None:
                dims[id(mod.bias)] = 0
        elif isinstance(mod, RowParallelLinear):
            dims[id(mod.weight)] = 1
    return {n: dims[id(p)] for n, p in module.named_parameters() if id(p) in dims}
