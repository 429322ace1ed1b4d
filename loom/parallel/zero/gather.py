"""Parameter gathers: stage 3's just-in-time gathers, prefetch and frees; stages 1-2's gather after a step.

Stage 3's buckets are gathered just in time with the next one prefetched, freed after use, and autograd's saved
views of them tracked; stages 1-2's updated blocks are gathered after each optimizer step. The plan is stage 3's in
:mod:`loom.parallel.zero.engine`: forward gathers buckets in ascending order and backward in descending order,
every rank posting the same gathers in the same order (a bucket no module used is gathered all the same), each
bucket prefetching the next. Compressed gathers (``param_codec``, default blockwise int8 when ``compress=`` is
given): each rank encodes its block once, one ``allgatherv`` of the bytes, every rank decodes every block, its own
included, so the gathered weights are the same on every rank while the fp32 master stays exact. They are blocking
(they run at the post point, in the gathers' common order).
"""

from __future__ import annotations

from typing import Any

import torch

from ... import stats as _stats
from ...comm import Communicator, Request
from ...comm import buffers as _b
from .buckets import _Bucket
from .params import _freed_message, _ShardedParameter
from .requests import _in_backward, _wait


class ParamGathers:
    """The parameter gathers of one :class:`~loom.parallel.ShardedDataParallel` (``sdp``, whose buckets, shards,
    dtypes, host mirror and backward state it reads): posting, landing, binding and freeing buckets, the module
    hooks and saved-tensor hooks of stage 3 that drive them. ``comm``: the group's duplicate they run on, in
    their own order."""

    def __init__(self, sdp: Any, comm: Communicator):
        self.sdp = sdp
        self.comm = comm
        self.placeholders: dict[int, torch.Tensor] = {}  # stage 3: id(parameter) -> its data while freed
        self.keep: list[int] = []  # stage 3: buckets of the ``keep`` modules, gathered for all of forward
        self.live: dict[int, int] = {}  # storage address of a gathered bucket -> its index (stage 3)
        self.fwd_next = 0  # the next bucket forward posts
        self.fwd_ran = [0] * len(sdp.buckets)  # owning modules of each bucket that ran in this forward
        self.bwd_next = -1  # the next bucket backward posts (descending)

    # ------------------------------------------------------------------ one bucket
    def bind(self, b: _Bucket) -> None:
        """The bucket's parameters become views of its gathered buffer."""
        full = b.full
        for p, off in zip(b.params, b.offsets):
            p.data = full[off:off + p.numel()].view(p.shape)
            p._loom_freed = None
        b.bound = True

    def shard_params(self, b: _Bucket) -> None:
        """Stage 3: the bucket's parameters become placeholders that refuse to compute (:mod:`.params`)."""
        sdp = self.sdp
        for p, name in zip(b.params, b.names):
            zero = torch.zeros((), dtype=sdp.compute_dtype, device=sdp.device)
            self.placeholders[id(p)] = zero.expand(p.shape)
            p.data = self.placeholders[id(p)]
            p.__class__ = _ShardedParameter
            p._loom_freed = _freed_message(name)

    def post(self, b: _Bucket) -> None:
        """Post the bucket's gather (nothing if it is gathered or on its way)."""
        sdp = self.sdp
        if b.full is not None:
            return
        src = sdp._master(b).to(sdp.compute_dtype) if not sdp._staged or sdp.param_codec else None
        if sdp.param_codec is not None:
            from ...compress import allgather

            b.full = allgather(src, self.comm, sdp.param_codec, min_bytes=0).to(sdp.compute_dtype)
            b.req = Request.completed(b.full, what="compressed gather")
        elif sdp._staged:  # from the host mirror into a host buffer; copied to the device when it lands
            sdp._mirror.fresh(b)
            b.host = _b.host_empty((b.padded,), sdp.compute_dtype, sdp.device)
            b.full = _b.side_empty((b.padded,), sdp.compute_dtype, sdp.device)
            b.req = self.comm.iallgather(sdp._mirror.blocks[b.index], out=b.host)
        else:
            b.full = torch.empty(b.padded, dtype=sdp.compute_dtype, device=sdp.device)
            b.req = self.comm.iallgather(src, out=b.full)
        _stats.add("time", "zero", gathers=1)

    def land(self, b: _Bucket) -> None:
        """A gather completed: on the staged path its host -> device copy is queued on the side stream (into a
        buffer allocated there), and the compute stream waits for it only where the bucket is bound."""
        b.req = None
        if b.host is not None:
            b.ev = _b.stage_in(b.host, b.full, fresh=True)
            b.host = None

    def ensure(self, b: _Bucket) -> None:
        """Wait for the bucket's gather (counted when it was not complete yet) and bind its parameters."""
        if b.req is not None:
            if not b.req.test():
                _stats.add("time", "zero", gather_waits=1)
            _wait(b.req)
            self.land(b)
        if b.full is not None and not b.bound:
            _b.use_after(b.ev, b.full)
            b.ev = None
            self.bind(b)
            self.live[b.full.untyped_storage().data_ptr()] = b.index

    def free(self, b: _Bucket) -> None:
        """Drop the bucket's gathered buffer; its parameters are placeholders again."""
        if b.full is None:
            return
        if b.req is not None:
            _wait(b.req)
            b.req = None
        b.host = b.ev = None
        b.bound = False
        for p, name in zip(b.params, b.names):
            p.data = self.placeholders[id(p)]
            p._loom_freed = _freed_message(name)
        self.live.pop(b.full.untyped_storage().data_ptr(), None)
        b.full = None

    def test(self) -> None:
        """Test every gather in flight once; a completed one lands (a prefetched gather: its host -> device copy
        starts now, beside compute)."""
        for b in self.sdp.buckets:
            if b.req is not None and b.req.test():
                self.land(b)

    # ------------------------------------------------------------------ forward and backward (stage 3)
    def need_forward(self, i: int) -> None:
        buckets = self.sdp.buckets
        b = buckets[i]
        if b.full is None:
            if i >= self.fwd_next:
                while self.fwd_next <= i:  # every rank posts the buckets in order
                    self.post(buckets[self.fwd_next])
                    self.fwd_next += 1
            else:
                self.post(b)  # a module run again after its bucket was freed
        self.ensure(b)
        if self.fwd_next == i + 1 and self.fwd_next < len(buckets):
            self.post(buckets[self.fwd_next])  # prefetch
            self.fwd_next += 1

    def need_backward(self, i: int) -> None:
        sdp = self.sdp
        sdp._open_backward()
        b = sdp.buckets[i]
        if b.full is None:
            if i <= self.bwd_next:
                while self.bwd_next >= i:
                    self.post(sdp.buckets[self.bwd_next])
                    self.bwd_next -= 1
            else:
                self.post(b)
        self.ensure(b)
        if self.bwd_next == i - 1 and self.bwd_next >= 0:
            sdp._progress()  # reduce-scatters completed by now free their buffers before the prefetch allocates
            self.post(sdp.buckets[self.bwd_next])  # prefetch
            self.bwd_next -= 1
        sdp._progress()

    def pre_hook(self, bs: list[int]):
        """A module's forward pre-hook: its buckets gathered (as backward gathers, when recomputed in backward)."""
        def hook(module, args):
            if _in_backward():  # recomputed in backward: gathered as backward gathers
                for i in bs:
                    self.need_backward(i)
                return
            for i in bs:
                self.need_forward(i)
            self.sdp._progress()
        return hook

    def post_hook(self, bs: list[int]):
        """A module's forward hook: a bucket whose last owning module ran is freed (but the last and kept ones)."""
        def hook(module, args, out):
            if _in_backward():  # the recomputed graph still reads the parameters: freed with their gradients
                return
            buckets = self.sdp.buckets
            for i in bs:
                self.fwd_ran[i] += 1
                if (self.fwd_ran[i] >= buckets[i].owners and i != len(buckets) - 1
                        and i not in self.keep):
                    self.free(buckets[i])
            self.sdp._progress()
        return hook

    def forward_start(self) -> None:
        """A forward begins: the kept buckets are gathered now, in the same order on every rank."""
        buckets = self.sdp.buckets
        self.fwd_next = 0
        self.fwd_ran = [0] * len(buckets)
        for i in self.keep:  # read outside any hook: gathered now, in the same order on every rank
            self.post(buckets[i])
            self.ensure(buckets[i])

    def forward_end(self) -> None:
        buckets = self.sdp.buckets
        while self.fwd_next < len(buckets):  # buckets no module used: keep the gather order equal
            self.post(buckets[self.fwd_next])
            self.fwd_next += 1
        # The last bucket is the first one backward needs: keep it rather than gather it again.
        keep = {len(buckets) - 1, *self.keep} if torch.is_grad_enabled() else ()
        for b in buckets:
            if b.index in keep:
                self.ensure(b)
            else:
                self.free(b)

    def backward_start(self) -> None:
        """A backward begins: it gathers from the last bucket down, skipping those kept from forward."""
        buckets = self.sdp.buckets
        self.bwd_next = len(buckets) - 1
        while self.bwd_next >= 0 and buckets[self.bwd_next].full is not None:
            self.bwd_next -= 1  # kept from forward

    def backward_end(self) -> None:
        """A backward ended: the gathers it did not need are posted all the same, then every bucket is freed."""
        buckets = self.sdp.buckets
        while self.bwd_next >= 0:  # same gathers on every rank, even where a bucket was not needed
            self.post(buckets[self.bwd_next])
            self.bwd_next -= 1
        for b in buckets:
            self.free(b)

    def pack(self, t: torch.Tensor):
        """Saved-tensors hook: a view of a gathered bucket is saved as (bucket, size, stride, offset)."""
        ref = self.sdp._index_of.get(id(t))
        if ref is not None:
            # The parameter itself, its bucket gathered on unpack: backward code that reads a saved parameter
            # without calling its module (a recomputed chunk) sees its values even if it was saved freed.
            return ("param", ref[0], t)
        if self.live and t.layout == torch.strided:
            i = self.live.get(t.untyped_storage().data_ptr())
            if i is not None:
                return (i, t.size(), t.stride(), t.storage_offset())
        return t

    def unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved[0] == "param":
            self.need_backward(saved[1])  # binds the parameter to its gathered bucket
            return saved[2]
        i, size, stride, offset = saved
        self.need_backward(i)
        return self.sdp.buckets[i].full.as_strided(size, stride, offset)

    # ------------------------------------------------------------------ stages 1-2
    def gather_all(self) -> None:
        """Stages 1-2: every bucket's updated block, gathered in place into the buffer the parameters view."""
        sdp = self.sdp
        if sdp._staged:  # from the host mirror; each result copied back on the side stream, no host wait
            sdp._mirror.fresh()
            reqs = [self.comm.iallgather(sdp._mirror.blocks[b.index],
                                         out=_b.host_empty((b.padded,), sdp.compute_dtype, sdp.device))
                    for b in sdp.buckets]
            for b, req in zip(sdp.buckets, reqs):
                _b.use_after(_b.stage_in(_wait(req), b.full), b.full)
            return
        reqs = [self.comm.iallgather(sdp._master(b).to(sdp.compute_dtype), out=b.full) for b in sdp.buckets]
        for req in reqs:
            _wait(req)
