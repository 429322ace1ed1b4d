"""Device staging: gradients and parameters moved through pinned host memory where the MPI cannot read the device.

Devices. Buckets, shards, gradients, placeholders and (through the shards) the optimizer state live on the
parameters' device. With a CUDA-aware MPI every collective is handed device tensors (loom.comm waits for the
caller's stream before MPI touches them). Otherwise (:func:`loom.parallel.data.stages_through_host`: by default
where the parameters are on CUDA and the MPI is not CUDA-aware) the engine stages through host memory itself, so
that no hook blocks the host on a device copy and a prefetched bucket crosses the bus while compute runs:

* gradients (stages 1-3): a bucket's flat gradient is copied to a pooled pinned host buffer on the device->host
  side stream, after the compute stream (:func:`loom.comm.buffers.stage_out`); the ``ireduce_scatter`` (or the
  compressed ``ialltoallv`` of the encoded bytes) of the host buffer is posted once that copy's event has
  completed, looked at from the next hooks without waiting, strictly in staging order (the same order on
  every rank), and waited for in :meth:`~loom.parallel.ShardedDataParallel.sync_grads` (:class:`GradStaging`).
  The reduced host block goes back on the host->device side stream into a buffer allocated there, and the
  compute stream waits for that copy on the device before the block is added into the shard's gradient (no
  host sync; :func:`to_device`);
* parameters: a host mirror of the shards in the compute dtype (pinned) is copied again after a shard changes
  (an optimizer step, a load): all buckets' copies queued on one stream, one host wait per step
  (:class:`ParamMirror`). Stage 3 gathers the mirror block with ``iallgather`` into a pinned host buffer; when
  the gather is seen complete (a hook's test, the prefetch of the next bucket included) its host->device copy
  is queued on the side stream into the bucket's buffer, allocated on that stream so the copy waits for nothing
  on the compute stream, and the compute stream waits for the copy's event only where the bucket is bound
  (:func:`loom.comm.buffers.use_after`), so the copy of bucket ``i+1`` overlaps bucket ``i``'s compute. Stages
  1-2 gather every bucket after the step the same way and copy each into the buffer the parameters view (that
  copy waits for the compute stream's reads of the old values) (:mod:`loom.parallel.zero.gather`);
* progress thread: a task and its request's completion run with the submitting thread's CUDA stream current
  (:class:`loom.comm.ProgressThread`); on the staged path the thread sees host buffers only, and results go
  to the device on the training thread.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from ...comm import buffers as _b
from .buckets import _Bucket


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host result on ``device``, the caller's stream ordered after the copy (no host wait)."""
    dev = _b.side_empty(tuple(host.shape), host.dtype, device)
    _b.use_after(_b.stage_in(host, dev, fresh=True), dev)
    return dev


class _Out:
    """A gradient on its way to the host (staged path): posted by :meth:`GradStaging.flush` once its copy is
    done, strictly in staging order, so every rank posts the same collectives in the same order."""

    __slots__ = ("index", "host", "ev", "post", "in_hook")

    def __init__(self, index: int, host: torch.Tensor, ev: Any, post: Callable[[torch.Tensor], Any], in_hook: bool):
        self.index, self.host, self.ev, self.post, self.in_hook = index, host, ev, post, in_hook


class GradStaging:
    """The gradients being copied to the host, not yet posted (staged path). ``posted(index, request, in_hook)``
    receives each collective as it is posted."""

    def __init__(self, posted: Callable[[int, Any, bool], None]):
        self.queue: list[_Out] = []
        self._posted = posted

    def put(self, index: int, flat: torch.Tensor, in_hook: bool, post: Callable[[torch.Tensor], Any]) -> None:
        """Queue ``flat``'s copy to the host and post ``post(host)`` once it is there (from a later hook, or
        :meth:`~loom.parallel.ShardedDataParallel.sync_grads`), so no hook blocks the host on a device copy."""
        host, ev = _b.stage_out(flat)
        self.queue.append(_Out(index, host, ev, post, in_hook))
        self.flush(block=False)

    def flush(self, block: bool, keep: int = 0) -> None:
        """Post the staged gradients whose copies are done, in staging order (``block``: wait for the copies),
        leaving the last ``keep`` queued."""
        q = self.queue
        while len(q) > keep:
            o = q[0]
            if block:
                _b.wait_copy(o.ev)
            elif not _b.copy_done(o.ev):
                return
            q.pop(0)
            self._posted(o.index, o.post(o.host), o.in_hook)


class ParamMirror:
    """The host mirror of the shards in the compute dtype (staged path): ``blocks[b]`` is bucket ``b``'s block,
    what the gathers send."""

    def __init__(self, buckets: Sequence[_Bucket], shards: Sequence[torch.nn.Parameter], dtype: torch.dtype,
                 device: torch.device):
        self.buckets, self.shards, self.dtype, self.device = buckets, shards, dtype, device
        self.blocks: list[torch.Tensor] | None = None
        self.key: tuple[int, ...] | None = None  # the shards' versions it was copied at

    def fresh(self, b: _Bucket | None = None) -> None:
        """The host mirror of the shards (compute dtype), copied again when a shard changed since (after an
        optimizer step or a load; ``b``: look at that bucket's shard only, all being stepped together). All
        buckets' copies are queued on one side stream and waited for once (copies on one stream finish in order),
        so a step costs one host wait here, not one per gathered bucket."""
        key = self.key
        if key is not None and (self.shards[b.index]._version == key[b.index] if b is not None
                                else key == tuple(sh._version for sh in self.shards)):
            return
        if self.blocks is None:
            self.blocks = [_b.host_empty((bk.shard,), self.dtype, self.device) for bk in self.buckets]
        ev = None
        for bk in self.buckets:
            _, ev = _b.stage_out(self.shards[bk.index].data.to(self.dtype), out=self.blocks[bk.index])
        _b.wait_copy(ev)
        self.key = tuple(sh._version for sh in self.shards)

    def stale(self) -> None:
        """The shards were written where their version counters do not see it (loads and optimizer steps through
        ``.data``, fused optimizers): the next gather copies the mirror again."""
        self.key = None
