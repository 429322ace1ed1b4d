"""Gradients of a ``loom train`` step: their reduction over sp, dp and ep, and global-norm clipping on any layout."""

from __future__ import annotations

import time

import torch

from ..comm import Communicator

__all__ = ["TrainerGrads"]


class TrainerGrads:
    """:class:`loom.train.trainer.Trainer`'s gradient sync (:meth:`sync_grads`) and clipping (:meth:`clip`).

    A mixin of the trainer, reading what it lays out: ``cfg``, the mesh's groups (``sp``, ``dp``, ``ep``, ``tp``,
    ``pp``, ``rep``), the parameters (``param_names``, ``params``), the dp hook, the plain-dp reducer, ZeRO's
    wrappers (``sdp``, ZeRO-1's optimizer) and the pipeline (``hybrid``).
    """

    def _make_buckets(self) -> list[tuple[bool, list[torch.nn.Parameter]]]:
        """``(expert, params)`` buckets of about ``compress.bucket_mb``; expert and replicated kept apart."""
        limit = int(self.cfg.compress.bucket_mb * 2**20)
        out: list[tuple[bool, list[torch.nn.Parameter]]] = []
        for expert in (False, True):
            group = [p for n, p in zip(self.param_names, self.params) if self._is_expert(n) == expert]
            size = limit + 1
            for p in group:
                nb = p.numel() * p.element_size()
                if size + nb > limit and (not out or out[-1][1]):
                    out.append((expert, []))
                    size = 0
                out[-1][1].append(p)
                size += nb
        return [b for b in out if b[1]]

    def _flat_sync(self, comm: Communicator | None, *, use_hook: bool, op: str = "avg", expert: bool | None = None,
                   scale: float = 1.0) -> None:
        for i, (is_expert, bucket) in enumerate(self._buckets):
            if expert is not None and is_expert != expert:
                continue
            grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket]
            flat = torch.cat([g.reshape(-1) for g in grads])
            if comm is not None and comm.size > 1:
                if use_hook and self.hook is not None:
                    flat = self.hook(flat, comm, i)
                else:
                    flat = comm.allreduce(flat, op=op)
            if scale != 1.0:
                flat = flat * scale
            off = 0
            for p, g in zip(bucket, grads):
                n = g.numel()
                p.grad = flat[off:off + n].view_as(p).to(p.dtype)
                off += n

    def sync_grads(self) -> float:
        """Reduce gradients to the gradient of the global mean loss; returns seconds.

        Plan: every bucket over ``sp`` (sum for a share-of-mean loss, else average; plain allreduce); then
        replicated buckets averaged over ``dp x ep`` and expert buckets over ``dp`` (the compression hook,
        one call per bucket), expert ones divided by ``ep`` (their local gradient already sums the ``ep``
        peers' tokens, routed to this rank's experts). Under a pipeline the dp average already happened inside
        ``HybridParallel.train_step``; with ``ep`` the replicated buckets are then averaged over ``ep`` and the
        expert ones divided by it, which comes to the same. ZeRO-1 without compression (any mesh the config
        allows: dp, sp, tp, pp): after the sp reduction :meth:`ShardedOptimizer.reduce_grads` reduce-scatters
        (mean over the zero axes) each group's flat gradient into this rank's master block instead; a pipeline
        then did no dp average of its own.
        """
        if self.sdp is not None:
            return self._sharded_sync()
        if self.reducer is not None:
            self.reducer.finish()  # its blocked time is counted in dp_stats()
            t0 = time.perf_counter()
            if self.sp is not None:
                self._flat_sync(self.sp, use_hook=False, op="sum" if self._sp_share else "avg")
            for p in self.params:  # none on any replica: zeros, as on the after-backward path and on one rank
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
            return time.perf_counter() - t0
        t0 = time.perf_counter()
        if self.sp is not None:
            self._flat_sync(self.sp, use_hook=False, op="sum" if self._sp_share else "avg")
        if self._zero1_rs:
            self.opt.reduce_grads()  # mean over the zero axes into this rank's blocks (sp sums come first)
        elif self.hybrid is None:
            self._flat_sync(self.rep, use_hook=True, expert=False)
            if self.ep is not None:
                self._flat_sync(self.dp, use_hook=True, expert=True, scale=1.0 / self.ep.size)
        elif self.ep is not None:
            # HybridParallel averaged every gradient over dp; replicated ones still need the ep average (dp x ep
            # in all), expert ones the 1/ep of the unpipelined path.
            self._flat_sync(self.ep, use_hook=False, expert=False)
            self._flat_sync(None, use_hook=False, expert=True, scale=1.0 / self.ep.size)
        return time.perf_counter() - t0

    def _sharded_sync(self) -> float:
        """ZeRO 2-3: finish the reduce-scatters (their blocked time is counted in ``zero_stats()``), then sum
        (share of the mean) or average the shards' gradients over sp when sp is not in the group; returns
        the seconds of that sp reduction."""
        self.sdp.sync_grads()
        if self.sp is None or "sp" in self.cfg.zero.axes:
            return 0.0
        t0 = time.perf_counter()
        op = "sum" if self._sp_share else "avg"
        for sh in self.sdp.shards:  # every sp rank holds the same layout of blocks
            sh.grad = self.sp.allreduce(sh.grad, op=op)
        return time.perf_counter() - t0

    def _masks(self, blocks: list[tuple[list[torch.Tensor], list[int], int, int]], ids: set[int] | frozenset[int]
               ) -> list[torch.Tensor]:
        """Per flat block: which of its elements belong to the parameters in ``ids`` (tp-split ones, whose squares
        add up over tp; or a pipeline's tied copies counted on another stage).

        Args:
            blocks: per flat block ``(params, offsets, shard, rank)``: the parameters laid end to end at those
                offsets in a flat buffer (padding after them), of which this rank holds elements
                ``[rank * shard, (rank + 1) * shard)``.
            ids: ``id()`` of the parameters to mark.
        """
        out = []
        for ps, offs, shard, r in blocks:
            base = r * shard
            mask = torch.zeros(shard, dtype=torch.bool, device=self.device)
            for p, off in zip(ps, offs):
                lo, hi = max(off, base), min(off + p.numel(), base + shard)
                if lo < hi and id(p) in ids:
                    mask[lo - base:hi - base] = True
            out.append(mask)
        return out

    def _block_layout(self) -> list[tuple[list[torch.Tensor], list[int], int, int]]:
        """``(params, offsets, shard, rank)`` of every flat block this rank's clip sees: ZeRO 2-3's buckets, or
        ZeRO-1's groups (``ShardedOptimizer.params``, laid end to end, each rank a master block)."""
        if self.sdp is not None:
            r = self.sdp.comm.rank
            return [(b.params, list(b.offsets), b.shard, r) for b in self.sdp.buckets]
        out = []
        for ps, master in zip(self.opt.params, self.opt.masters()):
            offs, off = [], 0
            for p in ps:
                offs.append(off)
                off += p.numel()
            out.append((ps, offs, master.numel(), self.opt.comm.rank))
        return out

    def _clip_blocks(self, grads: list[torch.Tensor], group: Communicator) -> torch.Tensor:
        """Clip gradients held as blocks over ``group`` (each element on one rank of it) to the global norm.

        Under tp the blocks hold this tp rank's slices: the squares of tp-split elements add up over tp as well,
        replicated ones (the same on every tp rank) count once, as in :meth:`clip`. Under a pipeline a weight
        tied across stages (summed over them, so equal on each) counts on its first stage only. The masks are
        built once.
        """
        zero = torch.zeros((), dtype=torch.float64, device=self.device)
        dup = self._counted_elsewhere()
        if self.tp is None and not dup:
            sq = sum((g.double().pow(2).sum() for g in grads), zero)
            return self._clip_norm(group.allreduce(sq.reshape(1), op="sum"), grads)
        if not hasattr(self, "_clip_masks"):
            named, layout = dict(self.model.named_parameters()), self._block_layout()
            split = {id(named[n]) for n in self._tp_dims} if self.tp is not None else set()
            self._clip_masks = [(m & ~d, ~m & ~d) for m, d in zip(self._masks(layout, split), self._masks(layout, dup))]
        # torch.where, not g[mask]: boolean indexing sizes its result on the host, a device sync per block on CUDA
        sq_tp, sq_rep = zero, zero
        for g, (tp_el, rep_el) in zip(grads, self._clip_masks):
            sq = g.double().pow(2)
            sq_tp = sq_tp + torch.where(tp_el, sq, 0.0).sum()
            sq_rep = sq_rep + torch.where(rep_el, sq, 0.0).sum()
        sq = group.allreduce(torch.stack([sq_rep, sq_tp]), op="sum")
        sq_tp = self.tp.allreduce(sq[1:], op="sum")[0] if self.tp is not None else sq[1]
        return self._clip_norm((sq[0] + sq_tp).reshape(1), grads)

    def _counted_elsewhere(self) -> frozenset[int]:
        """``id()`` of this rank's parameters whose squares another pipeline stage counts (tied copies)."""
        return self.hybrid.counted_elsewhere if self.hybrid is not None else frozenset()

    def _clip_norm(self, sq: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
        """Scale ``grads`` to ``optim.grad_clip`` given their group's summed squares ``sq`` (one element); the
        norm stays on the device and the scale is applied without a host read, as in :meth:`clip`."""
        if self.pp is not None:  # every stage's shards
            sq = self.pp.allreduce(sq, op="sum")
        norm = sq[0].sqrt()
        limit = self.cfg.optim.grad_clip
        if limit > 0:
            scale = (limit / (norm + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(scale)
        return norm

    def clip(self) -> torch.Tensor:
        """Clip the global gradient norm (summed over pipeline stages) to ``optim.grad_clip``; returns the norm.

        The norm stays a tensor on the model's device and the scale is applied without reading it on the host
        (``min(1, limit / (norm + eps))``: a factor of exactly 1 below the limit), so clipping costs no host sync;
        the caller reads the norm once per step with the loss.
        """
        if self.sdp is not None:
            return self._clip_blocks([sh.grad for sh in self.sdp.shards], self.sdp.comm)
        if self._zero1_rs:
            return self._clip_blocks([m.grad for m in self.opt.masters()], self.opt.comm)
        sq = torch.zeros((), dtype=torch.float64, device=self.device)
        sq_ex = torch.zeros((), dtype=torch.float64, device=self.device)
        sq_tp = torch.zeros((), dtype=torch.float64, device=self.device)
        dup = self._counted_elsewhere()  # a weight tied across pipeline stages counts on its first stage only
        for n, p in zip(self.param_names, self.params):
            if p.grad is not None and id(p) not in dup:
                if self._is_expert(n):
                    sq_ex += p.grad.detach().double().pow(2).sum()
                elif n in self._tp_dims:
                    sq_tp += p.grad.detach().double().pow(2).sum()
                else:
                    sq += p.grad.detach().double().pow(2).sum()
        if self.ep is not None:  # each ep rank holds different experts: their squares add up
            sq = sq + self.ep.allreduce(sq_ex.reshape(1), op="sum")[0]
        if self.tp is not None:  # tp slices add up; replicated parameters count once
            sq = sq + self.tp.allreduce(sq_tp.reshape(1), op="sum")[0]
        if self.pp is not None:
            sq = self.pp.allreduce(sq.reshape(1), op="sum")[0]
        norm = sq.sqrt()
        limit = self.cfg.optim.grad_clip
        if limit > 0:
            scale = (limit / (norm + 1e-6)).clamp(max=1.0)
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(scale)
        return norm
