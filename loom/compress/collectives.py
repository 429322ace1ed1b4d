"""Compressed collectives over a :class:`loom.comm.Communicator`.

All of them take ``codec`` as a name (``"int8"``, ``"int4:block=32"``), a :class:`~loom.compress.codecs.Codec`
instance or ``None`` (uncompressed, what ``policy.codec_for(axis)`` gives for a plain axis; stateful codecs
such as PowerSGD must be passed as the same instance every step), and send a tensor
uncompressed when it is smaller than ``min_bytes``: below a few KiB the encode cost and the extra metadata
message outweigh the bytes saved (the receiver applies the same rule, so both sides agree without talking).

Byte accounting (:func:`stats`): per communicator name, ``raw`` is what the uncompressed operation would put
on the wire under ``loom.comm``'s bandwidth-optimal accounting (allreduce ``2 n (P-1)/P``, reduce-scatter
``n (P-1)/P``, allgather ``n (P-1)``, alltoallv and send: the bytes addressed to others), ``wire`` what this
rank actually sent, measured as the growth of ``comm.bytes_sent`` during the call (so metadata messages count
too).
"""

from __future__ import annotations

import math
from typing import Hashable, Sequence

import torch

from .. import stats as _stats
from ..comm import Communicator, Request
from .codecs import Codec, NoneCodec, PowerSGDCodec, get_codec, orthonormalize
from .feedback import ErrorFeedback

__all__ = ["allreduce", "allgather", "alltoallv", "reduce_scatter", "send", "recv", "stats", "reset_stats",
           "DEFAULT_MIN_BYTES"]

DEFAULT_MIN_BYTES = 65536
"""Tensors smaller than this travel uncompressed: a compressed allreduce is two latency-bound collectives plus
codec calls, which cost more than a small tensor takes to cross even a 1 Gbit/s link, so below this compression
cannot win on any link it targets (figures: README, compression section, `loom bench allreduce --codec int8`)."""

_RAW = NoneCodec()


def stats() -> dict[str, dict[str, int]]:
    """``{comm name: {"raw": bytes, "wire": bytes, "calls": n}}`` for this rank's compressed collectives
    (a copy; the ``compress`` kind of loom.stats)."""
    return _stats.snapshot("compress")


def reset_stats() -> None:
    _stats.reset("compress")


def _resolve(codec: "str | Codec | None") -> Codec:
    """A codec from a name or instance; ``None`` (an uncompressed policy axis) means ``"none"``."""
    return _RAW if codec is None else get_codec(codec)


def _sent(comm: Communicator) -> int:
    return sum(comm.bytes_sent.values())


def _account(comm: Communicator, raw: int, before: int) -> None:
    _stats.add("compress", comm.name, raw=int(raw), wire=_sent(comm) - before, calls=1)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduce_dtype(dtype: torch.dtype) -> torch.dtype:
    """Reductions run in float32 (float64 inputs stay float64; integers stay themselves, lossless codecs only)."""
    if dtype in (torch.float16, torch.bfloat16):
        return torch.float32
    return dtype


def _check(tensor, comm) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"compressed collectives take torch tensors, got {type(tensor).__name__}; "
                        f"use torch.from_numpy(array)")
    if not isinstance(comm, Communicator):
        raise TypeError(f"comm must be a loom.comm.Communicator, got {type(comm).__name__}; use loom.comm.world()")


def _shard_bounds(n: int, p: int, align: int) -> list[tuple[int, int]]:
    """Split ``n`` elements into ``p`` contiguous shards, boundaries on multiples of ``align`` (codec blocks)."""
    units = -(-n // align)
    base, extra = divmod(units, p)
    out, lo = [], 0
    for r in range(p):
        hi = min(n, lo + (base + (r < extra)) * align)
        out.append((lo, hi))
        lo = hi
    return out


def allreduce(
    tensor: torch.Tensor,
    comm: Communicator,
    codec: "str | Codec",
    *,
    error_feedback: ErrorFeedback | None = None,
    key: Hashable = 0,
    min_bytes: int = DEFAULT_MIN_BYTES,
    shapes: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The element-wise sum over ``comm`` (like ``MPI_SUM``), compressed; the same result on every rank.

    Plan (quantizing codecs: bf16, fp16, int8, int4, topk, zfp, zstd, none), two quantizations in all, whatever
    the rank count (a ring would re-quantize at each of its ``P - 1`` hops, as MVAPICH2-GDR's does):

    1. *Reduce-scatter by all-to-all*: the flattened tensor (plus the error-feedback residual) is cut into
       ``P`` shards aligned to the codec's block; shard ``j`` is encoded and sent to rank ``j`` in one
       ``alltoallv`` of bytes (own shard kept exact, not sent). Fixed-size codecs (bf16, fp16, int8, int4,
       topk) know every byte count in advance; variable-size ones (zstd, zfp) let the alltoallv exchange them.
    2. *Reduce*: rank ``j`` decodes the ``P - 1`` shards it received and sums them with its own in float32
       (float64 for float64 input).
    3. *Encode once, allgather*: the reduced shard is encoded once and the encoded bytes are allgathered
       (one ``allgather`` padded to the largest shard for fixed-size codecs, else ``allgatherv``); every rank,
       the owner included, decodes the same bytes, so results agree bit for bit.

    Error bound (per element): ``sum_i e(y_i) + e(s)`` with ``e`` the codec's round-trip bound on the
    respective block (inputs ``y_i``, reduced shard ``s``). With ``error_feedback`` each rank keeps what its
    phase-1 encodes dropped, and the owner of a shard also keeps the phase-3 error of it, so the residuals sum
    to exactly ``sum(inputs) - result`` (see :mod:`loom.compress.feedback`).

    PowerSGD (linear, no quantization): the tensor -- or each of ``shapes`` when the flat tensor packs several
    layers -- is viewed as a matrix ``M``; layers where rank-``r`` factors are not smaller go raw. Phase A:
    ``P = M Q`` (warm-started ``Q``), one ``allreduce`` of all ``P`` factors and raw layers together; ``P_hat =
    orth(P)``. Phase B: ``Q = M^T P_hat``, one ``allreduce`` of all ``Q``; result ``P_hat Q^T``; ``Q`` kept
    as the next warm start (identical on all ranks). Exact when ``sum_i M_i`` has rank ``<= r``.

    Tensors below ``min_bytes``, ``codec="none"``, and single-rank communicators take ``comm.allreduce``.

    Args:
        tensor: floating tensor (integer tensors with lossless codecs only); not modified.
        comm: the ranks to reduce over.
        codec: codec name or instance.
        error_feedback: residual store; the residual for ``key`` is added before encoding and updated.
        key: which residual (a bucket index) and, for PowerSGD, which warm-start ``Q``.
        min_bytes: below this size the plain allreduce runs.
        shapes: PowerSGD only: the shapes of the layers packed, in order, in the flat ``tensor``.

    Returns:
        A new tensor, the sum, with ``tensor``'s shape and dtype.
    """
    _check(tensor, comm)
    codec = _resolve(codec)
    x = tensor.detach()
    before = _sent(comm)
    raw = 2 * _nbytes(x) * (comm.size - 1) // max(comm.size, 1)
    if comm.size == 1 or isinstance(codec, NoneCodec) or _nbytes(x) < min_bytes or x.numel() == 0:
        if error_feedback is not None and key in error_feedback and comm.size > 1:
            x = error_feedback.apply(key, x)  # flush a residual left from compressed steps
            error_feedback.reset(key)
        out = comm.allreduce(x) if comm.size > 1 else x.clone()
    elif isinstance(codec, PowerSGDCodec):
        out = _allreduce_powersgd(x, comm, codec, error_feedback, key, shapes)
    else:
        out = _allreduce_sharded(x, comm, codec, error_feedback, key)
    _account(comm, raw, before)
    return out


def _reduce_own_shard(y: torch.Tensor, comm: Communicator, codec: Codec, bounds: list[tuple[int, int]],
                      residual: torch.Tensor | None) -> tuple[torch.Tensor, list[int | None]]:
    """Phases 1-2 of the sharded allreduce and the whole compressed reduce-scatter: every rank's flat ``y`` (in
    the reduction dtype) is cut at ``bounds`` (one element range per rank, the same on every rank); shard ``j``
    is encoded and sent to rank ``j`` in one ``alltoallv`` of bytes (the own shard is kept exact, not sent);
    this rank decodes the ``P - 1`` shards it received and sums them with its own in ``y``'s dtype.

    ``residual`` (``y``'s shape, zeros), when given, receives what each sent shard's encode dropped.
    Returns ``(this rank's reduced shard, encoded bytes per shard: None for a variable-size codec)``.
    """
    p, me = comm.size, comm.rank
    rdt = y.dtype
    chunks, counts = [], []
    for j, (lo, hi) in enumerate(bounds):
        if j == me:
            counts.append(0)
            continue
        pkt = codec.encode(y[lo:hi])
        chunks.append(pkt.data)
        counts.append(pkt.nbytes)
        if residual is not None:
            residual[lo:hi] = y[lo:hi] - codec.decode(pkt).to(rdt)
    # Fixed-size codecs: every rank can compute every byte count, so no count exchanges are needed.
    sizes = [codec.wire_bytes(hi - lo, rdt) for lo, hi in bounds]
    send_buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=y.device)
    known = [0 if i == me else sizes[me] for i in range(p)] if all(sz is not None for sz in sizes) else None
    recv_buf, recv_counts = comm.alltoallv(send_buf, counts, known)

    lo, hi = bounds[me]
    acc = y[lo:hi].clone()
    off = 0
    for i, c in enumerate(recv_counts):
        if i != me:
            acc += codec.decode(codec.from_wire(recv_buf[off:off + c], (hi - lo,), rdt)).to(rdt)
        off += c
    return acc, sizes


def _allreduce_sharded(x, comm, codec: Codec, ef: ErrorFeedback | None, key) -> torch.Tensor:
    p, me = comm.size, comm.rank
    rdt = _reduce_dtype(x.dtype)
    y = (ef.apply(key, x) if ef is not None else x).reshape(-1).to(rdt)
    bounds = _shard_bounds(y.numel(), p, getattr(codec, "block", 1))
    residual = torch.zeros_like(y) if ef is not None else None
    # Phases 1-2: reduce-scatter by all-to-all.
    acc, sizes = _reduce_own_shard(y, comm, codec, bounds, residual)
    fixed = all(sz is not None for sz in sizes)
    lo, hi = bounds[me]

    # Phase 3: encode the reduced shard once; allgather the encoded bytes; everyone decodes the same bytes.
    pkt = codec.encode(acc)
    if fixed:  # pad to the largest shard's size: one plain allgather, no count exchange
        width = max(sizes)
        data = pkt.data if pkt.nbytes == width else torch.cat([pkt.data, pkt.data.new_zeros(width - pkt.nbytes)])
        gathered = comm.allgather(data)
        offsets = [(i * width, sizes[i]) for i in range(p)]
    else:
        gathered, gcounts = comm.allgatherv(pkt.data)
        starts = [sum(gcounts[:i]) for i in range(p)]
        offsets = list(zip(starts, gcounts))
    out = torch.empty_like(y)
    for i, (off, c) in enumerate(offsets):
        a, b = bounds[i]
        out[a:b] = codec.decode(codec.from_wire(gathered[off:off + c], (b - a,), rdt))
    if residual is not None:
        residual[lo:hi] = acc - out[lo:hi]
        ef.set(key, residual.view(x.shape))
    return out.view(x.shape).to(x.dtype)


def reduce_scatter(
    tensor: torch.Tensor,
    comm: Communicator,
    codec: "str | Codec",
    *,
    error_feedback: ErrorFeedback | None = None,
    key: Hashable = 0,
    min_bytes: int = DEFAULT_MIN_BYTES,
    counts: Sequence[int] | None = None,
) -> torch.Tensor:
    """Rank ``r`` gets block ``r`` of dim 0 of the element-wise sum over ``comm`` (like ``MPI_Reduce_scatter``),
    compressed: phases 1-2 of :func:`allreduce`, one quantization in all.

    Plan (quantizing codecs: bf16, fp16, int8, int4, topk, zfp, zstd, none):

    1. *All-to-all of encoded shards*: the tensor (plus the error-feedback residual) is cut along dim 0 into
       ``P`` shards -- ``dim 0 / P`` rows each, or ``counts[r]`` rows for rank ``r`` -- shard ``j`` is encoded
       and sent to rank ``j`` in one ``alltoallv`` of bytes (own shard kept exact, not sent; fixed-size codecs
       know every byte count in advance, variable-size ones let the alltoallv exchange them). Buffers: one send
       buffer of the ``P - 1`` encoded shards, one receive buffer of the ``P - 1`` encoded shards for this rank.
    2. *Reduce*: this rank decodes the ``P - 1`` shards it received and sums them with its own in float32
       (float64 for float64 input) into its block, returned in ``tensor``'s dtype.

    Error bound (per element of rank ``j``'s block): ``sum_{i != j} e(y_i)``, with ``e`` the codec's round-trip
    bound and ``y_i`` rank ``i``'s input (plus residual) on that block: each input is quantized once, the own
    shard not at all (and then the rounding to a 16-bit output dtype). With ``error_feedback`` each rank keeps
    what its phase-1 encodes dropped (zero on its own shard), so the residuals summed over ranks are exactly
    ``sum(inputs) - result`` on every block.

    PowerSGD has no reduce-scatter (its low-rank factors are of the whole matrix, not of a block): it raises
    ``ValueError``; give the group a quantizing codec (``int8``, ``bf16``) or reduce with :func:`allreduce`.
    Tensors below ``min_bytes``, ``codec="none"``, and single-rank communicators take ``comm.reduce_scatter``
    (uneven ``counts``: the same alltoallv with raw shards); a residual left from compressed steps is added
    first and dropped.

    Byte accounting: ``raw`` is the bytes addressed to other ranks, ``n (P-1)/P`` for equal blocks.

    Args:
        tensor: floating tensor with at least one dim (integer tensors with lossless codecs only); not modified.
        comm: the ranks to reduce over.
        codec: codec name or instance.
        error_feedback: residual store; the residual for ``key`` is added before encoding and updated.
        key: which residual.
        min_bytes: below this size (of the whole ``tensor``) the plain reduce-scatter runs.
        counts: rows of dim 0 per rank (``P`` non-negative entries summing to dim 0), the same on every rank;
            default equal blocks (dim 0 must divide by ``P``).

    Returns:
        A new tensor, this rank's block of the sum: ``(counts[rank], *tensor.shape[1:])``, ``tensor``'s dtype.
    """
    _check(tensor, comm)
    codec = _resolve(codec)
    if isinstance(codec, PowerSGDCodec):
        raise ValueError(f"reduce_scatter: codec {codec.name!r} has no reduce-scatter (its low-rank factors are "
                         f"of the whole matrix, not of one rank's block); use a quantizing codec (int8, bf16) for "
                         f"reduce-scatters, or loom.compress.allreduce with powersgd")
    x = tensor.detach()
    p, me = comm.size, comm.rank
    rows = _block_rows(x, p, counts)
    row = math.prod(x.shape[1:])
    starts = [sum(rows[:j]) * row for j in range(p)]
    bounds = [(a, a + c * row) for a, c in zip(starts, rows)]
    shape = (rows[me], *x.shape[1:])
    before = _sent(comm)
    raw = (_nbytes(x) - rows[me] * row * x.element_size()) if p > 1 else 0
    ef = error_feedback
    if p == 1 or isinstance(codec, NoneCodec) or _nbytes(x) < min_bytes or x.numel() == 0:
        out = _reduce_scatter_plain(x, comm, rows, bounds, ef, key)
    else:
        y = (ef.apply(key, x) if ef is not None else x).reshape(-1).to(_reduce_dtype(x.dtype))
        residual = torch.zeros_like(y) if ef is not None else None
        out = _reduce_own_shard(y, comm, codec, bounds, residual)[0]
        if residual is not None:
            ef.set(key, residual.view(x.shape))
    _account(comm, raw, before)
    return out.reshape(shape).to(tensor.dtype)


def _block_rows(x: torch.Tensor, p: int, counts: Sequence[int] | None) -> list[int]:
    """:func:`reduce_scatter`'s rows of dim 0 per rank: ``counts``, checked, or equal blocks."""
    if x.ndim == 0:
        raise ValueError("reduce_scatter needs a tensor with at least one dim (rank r keeps block r of dim 0); "
                         "use x.reshape(1)")
    n0 = x.shape[0]
    if counts is None:
        if n0 % p:
            raise ValueError(f"reduce_scatter: dim 0 ({n0}) does not divide by {p} ranks; pad it or pass counts "
                             f"(rows per rank)")
        return [n0 // p] * p
    rows = [int(c) for c in counts]
    if len(rows) != p or any(c < 0 for c in rows) or sum(rows) != n0:
        raise ValueError(f"reduce_scatter: counts {rows} must have {p} non-negative entries summing to dim 0 "
                         f"({n0} rows)")
    return rows


def _reduce_scatter_plain(x: torch.Tensor, comm: Communicator, rows: list[int], bounds: list[tuple[int, int]],
                          ef: ErrorFeedback | None, key: Hashable) -> torch.Tensor:
    """:func:`reduce_scatter` uncompressed (a small tensor, ``codec="none"``, one rank): a residual left from
    compressed steps is added first and dropped; uneven ``rows`` take the alltoallv of raw shards."""
    p = comm.size
    if ef is not None and key in ef and p > 1:
        x = ef.apply(key, x)  # flush a residual left from compressed steps
        ef.reset(key)
    if p == 1:
        return x.clone()
    if len(set(rows)) == 1:
        return comm.reduce_scatter(x)
    y = x.reshape(-1).to(_reduce_dtype(x.dtype))
    return _reduce_own_shard(y, comm, _RAW, bounds, None)[0]


def _allreduce_powersgd(x, comm, codec: PowerSGDCodec, ef: ErrorFeedback | None, key, shapes) -> torch.Tensor:
    n_total = x.numel()
    layer_shapes = [tuple(int(d) for d in s) for s in (shapes if shapes is not None else [tuple(x.shape)])]
    if sum(math.prod(s) for s in layer_shapes) != n_total:
        raise ValueError(
            f"powersgd allreduce: shapes {layer_shapes} hold {sum(math.prod(s) for s in layer_shapes)} elements "
            f"but the tensor has {n_total}; pass the shapes of the layers packed in the flat tensor, in order"
        )
    wdt = codec.work_dtype(x.dtype)
    y = (ef.apply(key, x) if ef is not None else x).reshape(-1).to(wdt)
    segs, off = [], 0
    for s in layer_shapes:
        k = math.prod(s)
        segs.append((off, off + k, s))
        off += k

    # Phase A: P = M Q for selected layers; one allreduce of [P factors | raw layers].
    mats, ps, raws = {}, [], []
    for idx, (a, b, s) in enumerate(segs):
        if codec.selected(s):
            m = codec.matrix(y[a:b], s)
            r = min(codec.rank, *m.shape)
            mats[idx] = m
            ps.append((m @ codec.warm_q((key, idx), m.shape[1], r, m.device, wdt)).reshape(-1))
        else:
            raws.append(y[a:b])
    buf_a = comm.allreduce(torch.cat(ps + raws)) if ps or raws else y.new_empty(0)

    # Phase B: P_hat = orth(sum P); Q = M^T P_hat; one allreduce of all Q factors.
    p_hats, qs, o = {}, [], 0
    for idx, m in mats.items():
        r = min(codec.rank, *m.shape)
        p_hats[idx] = orthonormalize(buf_a[o:o + m.shape[0] * r].view(m.shape[0], r))
        o += m.shape[0] * r
        qs.append((m.T @ p_hats[idx]).reshape(-1))
    raw_sum = buf_a[o:]
    buf_b = comm.allreduce(torch.cat(qs)) if qs else y.new_empty(0)

    out = torch.empty_like(y)
    residual = torch.zeros_like(y) if ef is not None else None
    oq = oraw = 0
    for idx, (a, b, _s) in enumerate(segs):
        if idx in mats:
            m = mats[idx]
            r = min(codec.rank, *m.shape)
            q = buf_b[oq:oq + m.shape[1] * r].view(m.shape[1], r)
            oq += m.shape[1] * r
            codec.store_q((key, idx), q)
            out[a:b] = (p_hats[idx] @ q.T).reshape(-1)[: b - a]
            if residual is not None:  # what this rank's own projection onto P_hat dropped
                ph = p_hats[idx]
                residual[a:b] = (m - ph @ (ph.T @ m)).reshape(-1)[: b - a]
        else:
            out[a:b] = raw_sum[oraw:oraw + (b - a)]
            oraw += b - a
    if residual is not None:
        ef.set(key, residual.view(x.shape))
    return out.view(x.shape).to(x.dtype)


def allgather(tensor: torch.Tensor, comm: Communicator, codec: "str | Codec", *,
              min_bytes: int = DEFAULT_MIN_BYTES) -> torch.Tensor:
    """Concatenate every rank's tensor along dim 0 (same shape on every rank), compressed.

    Plan: encode the local tensor once; one ``allgatherv`` of the encoded bytes (counts exchanged by it);
    every rank decodes every piece, its own included, so the result is the same on every rank. Below
    ``min_bytes`` (or on one rank) it is ``comm.allgather``.
    """
    _check(tensor, comm)
    codec = _resolve(codec)
    x = tensor.detach()
    if x.ndim == 0:
        raise ValueError("allgather needs a tensor with at least one dim (it concatenates along dim 0); "
                         "use x.reshape(1)")
    before = _sent(comm)
    raw = _nbytes(x) * (comm.size - 1)
    if isinstance(codec, NoneCodec) or _nbytes(x) < min_bytes:
        out = comm.allgather(x)
    else:
        pkt = codec.encode(x)
        gathered, counts = comm.allgatherv(pkt.data)
        pieces, off = [], 0
        for c in counts:
            pieces.append(codec.decode(codec.from_wire(gathered[off:off + c], x.shape, x.dtype)))
            off += c
        out = torch.cat(pieces)
    _account(comm, raw, before)
    return out


def alltoallv(
    tensor: torch.Tensor,
    send_counts: Sequence[int],
    comm: Communicator,
    codec: "str | Codec",
    *,
    recv_counts: Sequence[int] | None = None,
    min_bytes: int = DEFAULT_MIN_BYTES,
) -> tuple[torch.Tensor, list[int]]:
    """Rows ``[sum(send_counts[:j]), +send_counts[j])`` of dim 0 go to rank ``j``, each block compressed.

    Plan: (1) unless given, ``recv_counts`` (rows) are learned with one small ``alltoall`` of counts;
    (2) each block for another rank is encoded separately (raw when the block is below ``min_bytes``: both
    sides decide from the row count), the own block is kept exact; (3) one ``alltoallv`` of the bytes
    (whose byte counts it exchanges itself); (4) decode each received block with its known shape.

    Returns:
        ``(received rows concatenated in source-rank order, recv_counts)``.
    """
    _check(tensor, comm)
    codec = _resolve(codec)
    x = tensor.detach()
    if x.ndim == 0:
        raise ValueError("alltoallv needs a tensor with at least one dim (rows of dim 0 are routed)")
    p, me = comm.size, comm.rank
    sc = [int(c) for c in send_counts]
    if len(sc) != p or any(c < 0 for c in sc) or sum(sc) != x.shape[0]:
        raise ValueError(f"alltoallv: send_counts {sc} must have {p} non-negative entries summing to dim 0 "
                         f"({x.shape[0]} rows)")
    before = _sent(comm)
    row_shape = tuple(x.shape[1:])
    row_bytes = math.prod(row_shape) * x.element_size()
    if recv_counts is None:
        rc = comm.alltoall(torch.tensor(sc, dtype=torch.int64, device="cpu")).tolist()
    else:
        rc = [int(c) for c in recv_counts]
        if len(rc) != p:
            raise ValueError(f"alltoallv: recv_counts has {len(rc)} entries, expected {p} (one per rank)")

    def block_codec(rows: int) -> Codec:
        return codec if rows * row_bytes >= min_bytes else _RAW

    starts = [sum(sc[:j]) for j in range(p)]
    chunks, counts = [], []
    for j in range(p):
        if j == me:
            counts.append(0)
            continue
        blk = x[starts[j]:starts[j] + sc[j]]
        pkt = block_codec(sc[j]).encode(blk)
        chunks.append(pkt.data)
        counts.append(pkt.nbytes)
    send_buf = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=x.device)
    recv_buf, rbytes = comm.alltoallv(send_buf, counts)
    pieces, off = [], 0
    for i in range(p):
        if i == me:
            pieces.append(x[starts[me]:starts[me] + sc[me]].clone())
        else:
            c = block_codec(rc[i])
            pieces.append(c.decode(c.from_wire(recv_buf[off:off + rbytes[i]], (rc[i], *row_shape), x.dtype)))
        off += rbytes[i]
    out = torch.cat(pieces) if pieces else x.new_empty((0, *row_shape))
    _account(comm, (sum(sc) - sc[me]) * row_bytes, before)
    return out, rc


def isend(tensor: torch.Tensor, dest: int, comm: Communicator, codec: "str | Codec", *, tag: int = 0,
          min_bytes: int = DEFAULT_MIN_BYTES) -> list[Request]:
    """Send ``tensor`` to ``dest`` compressed without blocking: encodes now and returns the requests of its
    messages (wait on all of them before the next send on this tag); the receiver calls :func:`recv`.

    Plan: below ``min_bytes`` one plain ``comm.isend``. Otherwise encode; when the codec's encoded size is fixed
    by the element count (none, bf16, fp16, int8, int4, topk) one message of bytes, else (zstd, zfp, powersgd)
    an int64 byte count first, then the bytes (same tag: MPI keeps their order). A pipeline whose neighbours
    send to each other at once (1F1B's steady state) needs the non-blocking form: two blocking sends of large
    messages would wait for each other's receive forever.
    """
    _check(tensor, comm)
    codec = _resolve(codec)
    x = tensor.detach()
    before = _sent(comm)
    if _nbytes(x) < min_bytes:
        reqs = [comm.isend(x, dest, tag)]
    else:
        pkt = codec.encode(x)
        reqs = []
        if codec.wire_bytes(x.numel(), x.dtype) is None:
            reqs.append(comm.isend(torch.tensor([pkt.nbytes], dtype=torch.int64, device="cpu"), dest, tag))
        reqs.append(comm.isend(pkt.data, dest, tag))
    _account(comm, _nbytes(x), before)
    return reqs


def send(tensor: torch.Tensor, dest: int, comm: Communicator, codec: "str | Codec", *, tag: int = 0,
         min_bytes: int = DEFAULT_MIN_BYTES) -> None:
    """Blocking :func:`isend` (returns once ``tensor`` may be reused); the receiver calls :func:`recv`."""
    for req in isend(tensor, dest, comm, codec, tag=tag, min_bytes=min_bytes):
        req.wait()


def recv(out: torch.Tensor, source: int, comm: Communicator, codec: "str | Codec", *, tag: int = 0,
         min_bytes: int = DEFAULT_MIN_BYTES) -> torch.Tensor:
    """Receive what :func:`send` sent into ``out`` (its shape and dtype say what to expect); returns ``out``.

    ``source`` must be a rank (not ``ANY_SOURCE``): a size message and the bytes come in two receives.
    """
    _check(out, comm)
    if not isinstance(source, int) or source < 0:
        raise ValueError(f"compressed recv needs an explicit source rank, got {source!r}")
    codec = _resolve(codec)
    if _nbytes(out) < min_bytes:
        return comm.recv(out, source, tag)
    n = codec.wire_bytes(out.numel(), out.dtype)
    if n is None:
        size = torch.empty(1, dtype=torch.int64, device="cpu")
        comm.recv(size, source, tag)
        n = int(size.item())
    buf = torch.empty(n, dtype=torch.uint8, device=out.device if out.device.type == "cpu" else "cpu")
    comm.recv(buf, source, tag)
    res = codec.decode(codec.from_wire(buf, out.shape, out.dtype))
    with torch.no_grad():
        out.copy_(res)
    return out

