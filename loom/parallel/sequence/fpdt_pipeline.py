"""FPDT's chunk pipeline: chunk-wise all-to-alls, online-softmax blocks, saved chunks in a chunk store."""

from __future__ import annotations

import torch

from ..blocks import acc_dtype as _acc_dtype
from ..blocks import attention_kernel
from ..blocks import block_backward as _block_backward
from ..blocks import block_forward as _block_forward
from ..blocks import merge as _merge
from .alltoall import _h2s, _s2h
from .layout import HeadPlan, _row_unique

__all__ = ["FPDTPipeline"]


class FPDTPipeline:
    """The FPDT chunk pipeline over local chunks, driven by callbacks (see the module docstring for the plan).

    :func:`fpdt_attention` feeds it slices of given q/k/v; ``loom.models.llama`` feeds it chunk-wise q/k/v
    projections so that a whole attention sublayer runs chunk by chunk. Only chunk-store handles are kept
    between forward and backward: head-layout q/k/v/out chunks and the log-sum-exp.

    Args:
        comm: the sequence-parallel communicator.
        chunks: ``u``, local chunks per rank.
        causal: causal mask over global positions.
        scale: softmax scale.
        store: a chunk store (:func:`loom.parallel.offload.chunk_store`).
        device: where the chunks are computed (selects the block kernel).
    """

    def __init__(self, comm, chunks: int, causal: bool, scale: float, store, device: torch.device,
                 doc: torch.Tensor | None = None, plan: HeadPlan | None = None):
        self.comm, self.u, self.causal, self.scale, self.store = comm, chunks, causal, scale, store
        # uneven head splits (HeadPlan): the all-to-alls' per-rank head counts and this rank's kv expansion
        even = plan is None or plan.even
        self.qc = None if even else (plan.q,)
        self.qkvc = None if even else (plan.q, plan.kv, plan.kv)
        self.kvc = None if even else (plan.kv, plan.kv)
        self.map = None if even else plan.local_map(comm.rank, device)
        self.kv_local = None if even else plan.kv[comm.rank]
        self.kernel = attention_kernel(device)
        self.doc = doc  # global document ids [B, n] (packed sequences) or None
        self._seen: list[list[bool]] | None = None
        self.hq: list[int] = []
        self.hk: list[int] = []
        self.hv: list[int] = []
        self.ho: list[int] = []
        self.hl: list[int] = []

    def docs(self, i: int, j: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(doc_q, doc_k)``: the document ids of global chunks ``i`` (queries) and ``j`` (keys), or None."""
        if self.doc is None:
            return None
        n = self.doc.shape[1] // self.u
        return self.doc[:, i * n:(i + 1) * n], self.doc[:, j * n:(j + 1) * n]

    def sees(self, i: int, j: int) -> bool:
        """Whether any query of chunk ``i`` may attend to a key of chunk ``j`` (packed documents; always True
        without). The table is made once per pipeline: one host sync, not one per block."""
        if self.doc is None:
            return True
        if self._seen is None:
            b, u = self.doc.shape[0], self.u
            # ids made unique per batch row, so one isin per pair of chunks tests every row at once
            d = _row_unique(self.doc).reshape(b, u, -1).transpose(0, 1).reshape(u, -1)
            seen = torch.stack([torch.stack([torch.isin(d[i], d[j]).any() for j in range(u)]) for i in range(u)])
            self._seen = seen.tolist()
        return self._seen[i][j]

    def forward(self, get_qkv, emit_out) -> None:
        """``get_qkv(i)`` -> local chunk ``(q_i, k_i, v_i)`` ``[B, c, heads|kv_heads, D]`` (kv already split-able
        over ``P``); ``emit_out(i, o_i)`` receives output chunk ``i`` in the local layout ``[B, c, heads, D]``."""
        u, store, comm, causal = self.u, self.store, self.comm, self.causal
        hq, hk, hv, ho, hl = self.hq, self.hk, self.hv, self.ho, self.hl

        def scatter(i):
            return self._scatter(get_qkv(i))

        def attend(i, qi, own_kv):
            js = list(range(i + 1)) if causal else list(range(u))
            o_acc = l_acc = None
            for n, j in enumerate(js):
                if own_kv is not None and j == i:
                    kj, vj = own_kv
                else:
                    kj, vj = store.get(hk[j]), store.get(hv[j])
                if n + 1 < len(js) and not (own_kv is not None and js[n + 1] == i):
                    store.prefetch(hk[js[n + 1]])  # double buffering: the next kv chunk is on its way
                    store.prefetch(hv[js[n + 1]])
                if not self.sees(i, j):
                    continue  # no query of chunk i sees a key of chunk j (other documents)
                o, l = _block_forward(qi, kj, vj, causal and j == i, self.scale, self.kernel, self.docs(i, j))
                o_acc, l_acc = _merge(o_acc, l_acc, o, l)
                del kj, vj, o, l
            oi = o_acc.to(qi.dtype)
            ho.append(store.put(oi))
            hl.append(store.put(l_acc))
            (o_seq,) = _h2s([oi.transpose(1, 2)], comm, self.qc)
            emit_out(i, o_seq)

        if causal:
            for i in range(u):
                qi, ki, vi = scatter(i)
                attend(i, qi, (ki, vi))
                del qi, ki, vi
        else:
            for i in range(u):
                scatter(i)
            for i in range(u):
                if i + 1 < u:
                    store.prefetch(hq[i + 1])
                attend(i, store.get(hq[i]), None)

    def backward(self, get_dout, emit_grads) -> None:
        """``get_dout(i)`` -> the output gradient of local chunk ``i``; ``emit_grads(j, dq_j, dk_j, dv_j)``
        receives the input gradients of local chunk ``j`` (local layout), in increasing ``j``."""
        u, store, comm, causal = self.u, self.store, self.comm, self.causal
        hq, hk, hv, ho, hl = self.hq, self.hk, self.hv, self.ho, self.hl
        hdo = self._emit_dout(get_dout)
        hdq: list[int | None] = [None] * u
        parked: list[tuple[int, int]] = []
        for j in range(u):
            kj, vj = store.get(hk[j]), store.get(hv[j])
            acc = _acc_dtype(kj.dtype)
            dtype = kj.dtype
            dk_j = dv_j = None
            irange = list(range(j, u)) if causal else list(range(u))
            for n, i in enumerate(irange):
                if n + 1 < len(irange):
                    nxt = irange[n + 1]
                    for hs in (hq, ho, hl, hdo):
                        store.prefetch(hs[nxt])
                    if hdq[nxt] is not None:
                        store.prefetch(hdq[nxt])
                qi, oi, li, doi = store.get(hq[i]), store.get(ho[i]), store.get(hl[i]), store.get(hdo[i])
                if not self.sees(i, j):
                    g_q = torch.zeros_like(qi, dtype=acc)
                    g_k = g_v = torch.zeros_like(kj, dtype=acc)
                else:
                    g_q, g_k, g_v = _block_backward(doi, qi, kj, vj, oi, li, causal and i == j, self.scale,
                                                    self.kernel, self.docs(i, j))
                del qi, oi, li, doi
                dk_j = g_k.to(acc) if dk_j is None else dk_j + g_k
                dv_j = g_v.to(acc) if dv_j is None else dv_j + g_v
                if hdq[i] is None:
                    hdq[i] = store.put(g_q.to(acc))
                else:
                    store.replace(hdq[i], store.get(hdq[i]) + g_q)
                del g_q, g_k, g_v
            sends = [self._fold_kv(dk_j).to(dtype).transpose(1, 2), self._fold_kv(dv_j).to(dtype).transpose(1, 2)]
            del kj, vj, dk_j, dv_j
            if causal:  # dq_j got its last contribution from kv chunk j: send it with dk_j, dv_j
                sends.insert(0, store.pop(hdq[j]).to(dtype).transpose(1, 2))
                hdq[j] = None
                dq_j, dk_j, dv_j = _h2s(sends, comm, self.qkvc)
                del sends
                emit_grads(j, dq_j, dk_j, dv_j)
            else:  # dq_j is complete only after the last kv chunk: park dk_j, dv_j
                dk_j, dv_j = _h2s(sends, comm, self.kvc)
                del sends
                parked.append((store.put(dk_j), store.put(dv_j)))
            del dk_j, dv_j
        if not causal:
            for i in range(u):
                (dq_i,) = _h2s([store.pop(hdq[i]).to(dtype).transpose(1, 2)], comm, self.qc)
                emit_grads(i, dq_i, store.pop(parked[i][0]), store.pop(parked[i][1]))
        self.release()
        for h in hdo:
            store.free(h)

    def _scatter(self, qkv) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One packed all-to-all of a local chunk's (q, k, v); the head-layout chunks go to the store."""
        qi, ki, vi = _s2h(qkv, self.comm, self.qkvc)
        if self.map is not None:  # unequal GQA groups on this rank: one kv head per query head
            ki, vi = ki.index_select(2, self.map), vi.index_select(2, self.map)
        # SDPA layout [B, heads, P c, D], contiguous so that the chunk store moves one block.
        qi, ki, vi = (t.transpose(1, 2).contiguous() for t in (qi, ki, vi))
        self.hq.append(self.store.put(qi))
        self.hk.append(self.store.put(ki))
        self.hv.append(self.store.put(vi))
        return qi, ki, vi

    def _emit_dout(self, get_dout) -> list[int]:
        """Store handles of every chunk's output gradient in head layout (one all-to-all each)."""
        hdo = []
        for i in range(self.u):
            (doi,) = _s2h([get_dout(i)], self.comm, self.qc)
            hdo.append(self.store.put(doi.transpose(1, 2).contiguous()))
            del doi
        return hdo

    def _fold_kv(self, g: torch.Tensor) -> torch.Tensor:
        """The gradient of this rank's expanded kv heads ``[B, h, L, D]`` summed back to its own kv heads."""
        if self.map is None:
            return g
        out = g.new_zeros(g.shape[0], self.kv_local, *g.shape[2:])
        return out.index_add_(1, self.map, g)

    def release(self) -> None:
        """Free every saved chunk (after backward, or when the graph is dropped)."""
        for hs in (self.hq, self.hk, self.hv, self.ho, self.hl):
            for h in hs:
                self.store.free(h)
            hs.clear()
