"""Sizes, head plans and token layouts of sequence parallelism: which rank holds which tokens and heads."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["check_sizes", "HeadPlan", "shard_sequence", "gather_sequence", "local_positions", "ring_positions"]


# ---------------------------------------------------------------------------------------------- validation
def check_sizes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, p: int, chunks: int = 1) -> None:
    """Raise ``ValueError`` naming the size and the fix unless the shapes fit ``p`` ranks and ``chunks``."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be [batch, seq_local, heads, head_dim]; got dims {q.dim()}, {k.dim()}, "
                         f"{v.dim()}")
    b, s, h, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[1] != s or k.shape[3] != d:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must be [batch={b}, seq_local={s}, "
                         f"kv_heads, head_dim={d}] like q {tuple(q.shape)}")
    hk = k.shape[2]
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks={chunks!r}; chunks is an integer >= 1")
    if h % hk:
        raise ValueError(f"heads {h} is not divisible by kv_heads {hk}; GQA needs kv_heads to divide heads")
    if h < p:
        raise ValueError(f"heads {h} over sp size {p}: every rank of the all-to-all needs a query head, so no split "
                         f"exists; use an sp group of at most {h} ranks (ring attention takes the rest: "
                         f"ring_attention, loom train --mesh.sp_ring)")
    if s % chunks:
        n = s * p
        need = -(-n // (p * chunks)) * p * chunks
        raise ValueError(f"sequence length {n} ({s} per rank) is not divisible by sp size {p} x chunks "
                         f"{chunks}; pad to {need} or change chunks")


@dataclass(frozen=True)
class HeadPlan:
    """Which heads each of ``p`` ranks holds after the all-to-all, for ``heads`` query and ``kv_heads`` kv heads.

    Rank ``r`` gets the contiguous query heads ``[q_start[r], q_start[r] + q[r])`` (``heads / p`` each; when
    ``p`` does not divide ``heads`` the first ``heads % p`` ranks get one more) and the kv heads those query
    heads read (GQA: query head ``i`` reads kv head ``i // (heads / kv_heads)``). Before the all-to-all the
    kv heads are gathered along ``kv_index`` (a kv head that two ranks read is sent to both; autograd sums its
    gradients), so both tensors split into contiguous per-rank runs of ``q[r]`` and ``kv[r]`` heads. With
    ``heads`` a multiple of ``p`` and ``kv_heads`` a multiple or divisor of ``p`` this is Ulysses' even split
    (kv replicated ``p / kv_heads`` times). Where a rank's query heads do not read its kv heads in equal groups
    (uneven splits), :meth:`local_map` expands its kv heads to one per query head.
    """

    q: tuple[int, ...]
    kv: tuple[int, ...]
    kv_index: tuple[int, ...] | None  # None: the identity (kv heads split evenly as they are)
    maps: tuple[tuple[int, ...] | None, ...]  # per rank: its query heads' local kv head, None if uniform GQA

    @staticmethod
    def make(heads: int, kv_heads: int, p: int) -> "HeadPlan":
        base, extra = divmod(heads, p)
        q = tuple(base + (r < extra) for r in range(p))
        g = heads // kv_heads
        idx: list[int] = []
        kv, maps = [], []
        start = 0
        for r in range(p):
            lo, hi = start // g, (start + q[r] - 1) // g + 1
            idx.extend(range(lo, hi))
            kv.append(hi - lo)
            local = tuple((start + i) // g - lo for i in range(q[r]))
            uniform = q[r] % kv[-1] == 0 and local == tuple(i // (q[r] // kv[-1]) for i in range(q[r]))
            maps.append(None if uniform else local)
            start += q[r]
        return HeadPlan(q, tuple(kv), None if idx == list(range(kv_heads)) else tuple(idx), tuple(maps))

    @property
    def even(self) -> bool:
        return len(set(self.q)) == 1 and len(set(self.kv)) == 1 and not any(self.maps)

    def gather_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v ``[B, s, kv_heads, D]`` -> ``[B, s, sum(kv), D]``: each rank's kv heads in rank order."""
        if self.kv_index is None:
            return k, v
        idx = torch.tensor(self.kv_index, device=k.device)
        return k.index_select(2, idx), v.index_select(2, idx)

    def local_map(self, rank: int, device) -> torch.Tensor | None:
        """Index of the local kv head each local query head reads, or None where GQA groups are equal."""
        m = self.maps[rank]
        return None if m is None else torch.tensor(m, device=device)


def _head_plan(q: torch.Tensor, k: torch.Tensor, p: int) -> HeadPlan:
    return HeadPlan.make(q.shape[2], k.shape[2], p)


# ---------------------------------------------------------------------------------------------- layouts
def _pieces(n: int, p: int, chunks: int, what: str) -> int:
    if n % (p * chunks):
        need = -(-n // (p * chunks)) * p * chunks
        raise ValueError(f"{what} length {n} is not divisible by sp size {p} x chunks {chunks}; pad to {need} "
                         f"or change chunks")
    return n // (p * chunks)


def shard_sequence(x: torch.Tensor, comm, *, chunks: int = 1, dim: int = 1, ring: int = 1) -> torch.Tensor:
    """This rank's shard of a global tensor along ``dim`` in the FPDT layout (``chunks=1``: Ulysses).

    Args:
        x: the global tensor (the same on every rank).
        comm: the sequence-parallel communicator (only ``rank``/``size`` are read).
        chunks: chunks per rank ``u``; rank ``r`` gets pieces ``r, r+P, ...`` of ``u P`` equal pieces.
        dim: the sequence dim.
        ring: ring degree ``R`` of 2-D sequence parallelism (:func:`ring_attention`); ``R > 1`` gives the
            zig-zag layout of :func:`ring_positions` (FPDT's ``chunks`` inside each ring group).

    Returns:
        A new contiguous tensor with ``x.shape[dim] / P`` entries along ``dim``.
    """
    dim = dim % x.dim()
    p, r = comm.size, comm.rank
    if ring > 1:
        return x.index_select(dim, ring_positions(x.shape[dim], p, ring, r, chunks=chunks,
                                                  device=x.device)).contiguous()
    c = _pieces(x.shape[dim], p, chunks, "sequence")
    y = x.unflatten(dim, (chunks, p, c)).select(dim + 1, r)
    return y.flatten(dim, dim + 1).contiguous()


def gather_sequence(x_local: torch.Tensor, comm, *, chunks: int = 1, dim: int = 1, ring: int = 1) -> torch.Tensor:
    """The global tensor from every rank's shard (inverse of :func:`shard_sequence`; one allgather).

    Not differentiable: it is for checking results against single-process references and for logging.
    """
    dim = dim % x_local.dim()
    p = comm.size
    s = x_local.shape[dim]
    if s % chunks:
        raise ValueError(f"local length {s} along dim {dim} is not divisible by chunks {chunks}")
    c = s // chunks
    x0 = x_local.detach().movedim(dim, 0).contiguous()
    allx = comm.allgather(x0) if p > 1 else x0  # [P * u * c, ...] rank-major
    rest = allx.shape[1:]
    if ring > 1:
        where = torch.cat([ring_positions(p * s, p, ring, r, chunks=chunks, device=allx.device) for r in range(p)])
        y = torch.empty_like(allx)
        y[where] = allx
    else:
        y = allx.reshape(p, chunks, c, *rest).transpose(0, 1).reshape(p * s, *rest)
    return y.movedim(0, dim).contiguous()


def local_positions(seq_local: int, comm, *, chunks: int = 1, device=None, ring: int = 1) -> torch.Tensor:
    """Global token positions (int64) of this rank's ``seq_local`` tokens in the layout of ``chunks`` (RoPE)."""
    p, r = comm.size, comm.rank
    if ring > 1:
        return ring_positions(seq_local * p, p, ring, r, chunks=chunks, device=device)
    if seq_local % chunks:
        raise ValueError(f"local length {seq_local} is not divisible by chunks {chunks}")
    c = seq_local // chunks
    starts = (torch.arange(chunks, device=device) * p + r) * c
    return (starts[:, None] + torch.arange(c, device=device)[None, :]).reshape(-1)


def ring_positions(n: int, p: int, ring: int, rank: int, *, chunks: int = 1, device=None) -> torch.Tensor:
    """Global positions (int64) of the tokens that sp rank ``rank`` holds in the zig-zag layout of 2-D sequence
    parallelism: ``p = U x ring`` ranks, rank ``r = j U + i`` is Ulysses rank ``i`` of ring group ``j``.

    The sequence of ``n`` tokens is cut into ``2 ring`` pieces of ``n / (2 ring)``; ring group ``j`` holds
    pieces ``j`` (front) and ``2 ring - 1 - j`` (back), so causal work is the same in every group (its two
    query pieces see ``2 ring + 1`` key pieces between them, the two diagonal ones half). Inside a group the
    concatenation ``[front, back]`` (``n / ring`` tokens) is laid out over its ``U`` ranks as
    :func:`shard_sequence` lays out a sequence (contiguous for ``chunks=1``; FPDT's round-robin chunks
    otherwise), so the group's all-to-all gives every rank ``[front, back]`` in order.

    Raises:
        ValueError: ``n`` not divisible by ``2 ring`` and by ``p x chunks`` (the message names the length to pad
            to).
    """
    if p % ring:
        raise ValueError(f"sp size {p} is not divisible by ring {ring}; the ring degree divides the sp size")
    unit = math.lcm(2 * ring, p * chunks)
    if n % unit:
        need = -(-n // unit) * unit
        raise ValueError(f"sequence length {n} is not divisible by 2 x ring {ring} and by sp size {p} x chunks "
                         f"{chunks} (zig-zag layout); pad to {need}")
    u = p // ring
    j, i = divmod(rank, u)
    c, half = n // (p * chunks), n // (2 * ring)
    m = ((torch.arange(chunks, device=device) * u + i) * c)[:, None] + torch.arange(c, device=device)[None, :]
    m = m.reshape(-1)
    return torch.where(m < half, j * half + m, (2 * ring - 1 - j) * half + (m - half))


def _row_unique(doc: torch.Tensor) -> torch.Tensor:
    """Document ids ``[B, n]`` made unique per batch row (equal within a row exactly where ``doc`` is), so that
    one ``isin`` over flattened rows tests whether any two tokens of the same row share a document."""
    lo, hi = doc.amin(), doc.amax()
    return (doc - lo) + torch.arange(doc.shape[0], device=doc.device)[:, None] * (hi - lo + 1)


def _global_docs(doc_ids, q, comm, chunks, ring: int = 1) -> torch.Tensor | None:
    if doc_ids is None:
        return None
    if tuple(doc_ids.shape) != tuple(q.shape[:2]):
        raise ValueError(f"doc_ids {tuple(doc_ids.shape)} must be [batch, seq_local] = {tuple(q.shape[:2])}, in "
                         f"the same layout as q")
    return gather_sequence(doc_ids.to(torch.int64), comm, chunks=chunks, ring=ring).to(q.device)
