"""FPDT x ring: FPDT's chunk pipeline inside each Ulysses group, ring attention across the groups."""

from __future__ import annotations

import torch

from ..blocks import acc_dtype as _acc_dtype
from ..blocks import block_backward as _block_backward
from ..blocks import block_forward as _block_forward
from ..blocks import merge as _merge
from .alltoall import _h2s
from .fpdt_pipeline import FPDTPipeline
from .layout import HeadPlan, _row_unique
from .ring import _ring_docs, _ring_hand_over, _ring_pass, _ring_take, ring_groups

__all__ = ["FPDTRingPipeline"]


class FPDTRingPipeline(FPDTPipeline):
    """FPDT's chunk pipeline inside each Ulysses group, ring attention across the groups (2-D sequence
    parallelism with FPDT's memory: no sequence-sized tensor beyond one group's K/V chunks in the store).

    Forward: every local chunk's (q, k, v) goes through the group's all-to-all into the chunk store (FPDT).
    Then ``R`` ring steps, q chunk outer and K/V chunk inner (as FPDT's forward): step ``t`` attends q chunk
    ``a`` to every K/V chunk of ring group ``j - t`` (from the store) while K/V chunk ``a`` goes on to group
    ``j + 1`` and the next group's arrives (isend/irecv posted before q chunk ``a``'s blocks and waited after the
    next one's, into the store: two passes in flight at most), merging into q chunk ``a``'s (out,
    log-sum-exp) accumulator, which waits in the store between steps: one q chunk's on the device at a time,
    as FPDT's (holding every chunk's, one fp32 copy of the rank's attention output, set the peak where the
    attention does; ``check_fpdt_ring_memory_linear`` bounds the ring's peak by FPDT's on one rank at 1/R of
    the length); the outputs are complete after the last step, and go back through the all-to-all.
    Backward mirrors it (K/V passes waited one chunk later alike), each K/V chunk's (dk, dv) accumulator going
    on with it once this rank's blocks are added (sent after the chunk's blocks, waited after the next chunk's,
    kept in the store till the next step: two in flight at most, never one per chunk). Zig-zag blocks: ring
    group ``j``'s chunk sequence is its ``[front, back]``, so an earlier group's K/V chunks are seen up to its
    front half, a later group's by this group's back half.
    Packed documents: every group's ``[front, back]`` document ids are known to every rank (one allgather, as
    :func:`ring_attention`), so a visiting K/V chunk's ids are looked up by its group and chunk index beside it;
    blocks that no query can see are skipped.

    Args:
        comm: the sequence-parallel communicator (``U x R`` ranks, :func:`ring_groups`).
        ring: ``R``.
        doc: packed documents: global document ids ``[B, n]`` in sequence order, or None.
        Others as :class:`FPDTPipeline` (``plan`` over the Ulysses group).
    """

    def __init__(self, comm, ring: int, chunks: int, causal: bool, scale: float, store, device: torch.device,
                 plan: HeadPlan | None = None, doc: torch.Tensor | None = None):
        uly, rng = ring_groups(comm, ring)
        super().__init__(uly, chunks, causal, scale, store, device, None, plan)
        self.ring = rng
        # each ring group's [front, back] ids, unique per batch row (so that one isin tests a whole block)
        self.rdocs = None if doc is None else _ring_docs(_row_unique(doc), comm.size, ring)
        self._ring_seen: dict[tuple[int, int, int], bool] | None = None

    def _blk(self, src: int, a: int, b: int, rows: int):
        """:meth:`_block` with the block's ``(doc_q, doc_k)`` (packed documents; else None) appended, or None
        where the block is empty or no query of it shares a document with a key of it."""
        blk = self._block(src, a, b, rows)
        if blk is None or self.rdocs is None:
            return None if blk is None else (*blk, None)
        if self._ring_seen is None:  # one host sync per pipeline
            keys = [(s, i, k) for s in range(self.ring.size) for i in range(self.u) for k in range(self.u)
                    if self._block(s, i, k, rows) is not None]
            seen = [torch.isin(*(d.reshape(-1) for d in self._block_docs(*key, rows))).any() for key in keys]
            self._ring_seen = dict(zip(keys, torch.stack(seen).tolist()))
        # a q chunk's diagonal block is never skipped, so its first block in forward covers all its rows
        return (*blk, self._block_docs(src, a, b, rows)) if self._ring_seen[(src, a, b)] else None

    def _block_docs(self, src: int, a: int, b: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Document ids of the rows of q chunk ``a`` (this group) and the columns of K/V chunk ``b`` of ring group
        ``src`` that the block pairs (:meth:`_block`)."""
        ra, cb, _ = self._block(src, a, b, rows)
        mine, theirs = self.rdocs[self.ring.rank], self.rdocs[src]
        return mine[:, a * rows:(a + 1) * rows][:, ra], theirs[:, b * rows:(b + 1) * rows][:, cb]

    def _block(self, src: int, a: int, b: int, rows: int):
        """``(rows, cols, causal)`` of q chunk ``a`` against K/V chunk ``b`` of ring group ``src``, or None."""
        j, every = self.ring.rank, slice(None)
        if not self.causal:
            return every, every, False
        half = self.u * rows // 2
        if src == j:
            return None if b > a else (every, every, a == b)
        if src < j:  # its front half only
            n = max(0, min(rows, half - b * rows))
            return None if n == 0 else (every, slice(0, n), False)
        r0 = max(0, min(rows, half - a * rows))  # a later group: seen by this group's back half
        return None if r0 == rows else (slice(r0, None), every, False)

    def forward(self, get_qkv, emit_out) -> None:
        u, store, rc = self.u, self.store, self.ring
        r, j = rc.size, rc.rank
        for i in range(u):
            qi, _, _ = self._scatter(get_qkv(i))
        rows, dtype = qi.shape[2], qi.dtype
        del qi
        # Each q chunk's (out, log-sum-exp) accumulator waits in the store between ring steps: one q chunk's on
        # the device at a time, as FPDT's. Every chunk's, an fp32 copy of the rank's attention output, would set
        # the peak wherever the attention does (check_fpdt_ring_memory_linear).
        hacc: list[tuple[int, int] | None] = [None] * u
        kvs = list(zip(self.hk, self.hv))
        for t in range(r):
            src, nxt, pending, last = (j - t) % r, [], None, t + 1 == r
            for a in range(u):
                # K/V chunk a goes on to the next group while q chunk a meets this step's chunks, waited after
                # the next q chunk's blocks: two passes in flight at most
                reqs = None if last else _ring_pass(rc, torch.stack([store.get(h) for h in kvs[a]]), 0)
                acc = self._ring_attend(a, src, rows, kvs, None if hacc[a] is None else hacc[a])
                if last:
                    self._emit_ring_out(a, acc, dtype, emit_out)
                else:
                    hacc[a] = (store.put(acc[0]), store.put(acc[1]))
                del acc
                if pending is not None:
                    _ring_hand_over(store, (), False, pending, nxt)
                pending = reqs
            _ring_hand_over(store, (), False, pending, nxt)
            if t > 0:  # the visiting group's chunks are done with (this rank's own stay for backward)
                for h in (h for kv in kvs for h in kv):
                    store.free(h)
            kvs = nxt

    def _ring_attend(self, a: int, src: int, rows: int, kvs, hacc) -> tuple[torch.Tensor, torch.Tensor]:
        """q chunk ``a`` against every K/V chunk ``kvs`` of ring group ``src``, merged into its accumulator (from
        the store at ``hacc``, popped; a new one at the first step, whose first block covers all its rows)."""
        store = self.store
        o_acc, l_acc = (None, None) if hacc is None else (store.pop(hacc[0]), store.pop(hacc[1]))
        qa = store.get(self.hq[a])
        for b in range(len(kvs)):
            blk = self._blk(src, a, b, rows)
            if blk is None:
                continue
            ra, cb, diag, bd = blk
            kb, vb = store.get(kvs[b][0]), store.get(kvs[b][1])
            o, lse = _block_forward(qa[:, :, ra], kb[:, :, cb], vb[:, :, cb], diag, self.scale, self.kernel, bd)
            del kb, vb
            if o_acc is None:
                o_acc, l_acc = _merge(None, None, o, lse)
            else:
                o_acc[:, :, ra], l_acc[:, :, ra] = _merge(o_acc[:, :, ra], l_acc[:, :, ra], o, lse)
            del o, lse
        return o_acc, l_acc

    def _emit_ring_out(self, a: int, acc, dtype, emit_out) -> None:
        """Q chunk ``a``'s output, complete after the last ring step: saved for backward with its log-sum-exp,
        and back through the group's all-to-all."""
        oa = acc[0].to(dtype)
        self.ho.append(self.store.put(oa))
        self.hl.append(self.store.put(acc[1]))
        (o_seq,) = _h2s([oa.transpose(1, 2)], self.comm, self.qc)
        emit_out(a, o_seq)

    def backward(self, get_dout, emit_grads) -> None:
        u, store, rc = self.u, self.store, self.ring
        r, j = rc.size, rc.rank
        hdo = self._emit_dout(get_dout)
        k0 = store.get(self.hk[0])
        rows, dtype, acc, shape = k0.shape[2], k0.dtype, _acc_dtype(k0.dtype), (2, *k0.shape)
        del k0
        hdq: list[int | None] = [None] * u
        kvs = list(zip(self.hk, self.hv))
        hacc: list[int | None] = [None] * u  # the (dk, dv) accumulator of each K/V chunk held, in the store
        for t in range(r):
            src, nxt, nacc, pending, kv_pending = (j - t) % r, [], [], None, None
            for b in range(u):
                kb, vb = store.get(kvs[b][0]), store.get(kvs[b][1])
                reqs = _ring_pass(rc, torch.stack([kb, vb]), 0) if t + 1 < r else None
                dkv = torch.zeros(shape, dtype=acc, device=kb.device) if hacc[b] is None else store.pop(hacc[b])
                for a in range(u):
                    blk = self._blk(src, a, b, rows)
                    if blk is None:
                        continue
                    ra, cb, diag, bd = blk
                    qa, oa, la, doa = (store.get(h[a]) for h in (self.hq, self.ho, self.hl, hdo))
                    g_q, g_k, g_v = _block_backward(doa[:, :, ra], qa[:, :, ra], kb[:, :, cb], vb[:, :, cb],
                                                    oa[:, :, ra], la[:, :, ra], diag, self.scale, self.kernel, bd)
                    dq = torch.zeros(qa.shape, dtype=acc, device=qa.device) if hdq[a] is None else store.get(hdq[a])
                    dq[:, :, ra] += g_q
                    if hdq[a] is None:
                        hdq[a] = store.put(dq)
                    else:
                        store.replace(hdq[a], dq)
                    dkv[0][:, :, cb] += g_k
                    dkv[1][:, :, cb] += g_v
                    del qa, oa, la, doa, g_q, g_k, g_v, dq
                del kb, vb
                # The accumulator goes on with its K/V chunk and the previous rank's comes in with the next one;
                # waited one chunk later (overlapping the next chunk's blocks), kept in the store till the next
                # step: at most two in flight, not one per chunk.
                sent = _ring_pass(rc, dkv, 1)
                del dkv
                _ring_hand_over(store, kvs[b], t > 0, kv_pending, nxt)
                kv_pending = reqs
                if pending is not None:
                    nacc.append(store.put(_ring_take(pending)))
                pending = sent
            _ring_hand_over(store, (), False, kv_pending, nxt)
            nacc.append(store.put(_ring_take(pending)))
            hacc, kvs = nacc, nxt
        for b in range(u):  # after R passes each accumulator is back at its owner
            mine = store.pop(hacc[b])
            sends = [store.pop(hdq[b]).to(dtype).transpose(1, 2), *(self._fold_kv(g).to(dtype).transpose(1, 2)
                                                                   for g in (mine[0], mine[1]))]
            del mine
            dq_b, dk_b, dv_b = _h2s(sends, self.comm, self.qkvc)
            del sends
            emit_grads(b, dq_b, dk_b, dv_b)
        self.release()
        for h in hdo:
            store.free(h)
