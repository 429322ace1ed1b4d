"""Sharded data parallelism (ZeRO stages 0-3) on ``loom.comm``: :class:`ShardedDataParallel`.

Layout. The trainable parameters are grouped, module by module in registration order, into *buckets* of at
most ``bucket_mb`` MiB (a module's direct parameters never straddle two buckets). Bucket ``b`` is one flat
vector of ``N_b`` elements padded to ``P * S_b`` (``P`` ranks in the group, ``S_b = ceil(N_b / P)``); rank
``r`` owns elements ``[r S_b, (r+1) S_b)``: this rank's block of each bucket is one flat *master* parameter
(``shards[b]``, in the parameters' dtype). The optimizer, any ``torch.optim`` class, steps on these alone,
so its state is sharded at every stage >= 1; a block's gradient is allocated when its first reduction
arrives (as a parameter's ``.grad`` in one process), so gradients grow during backward instead of sitting
allocated all step. Frozen parameters and buffers stay
replicated: broadcast from group rank 0 at construction, as DDP does (so are the trainable parameters, at every
stage), and buffers again around every forward that changed one (:meth:`ShardedDataParallel.sync_buffers`).

Plan per stage (one training step: forward, ``loss.backward()`` one or more times, :meth:`step`):

* stage 0: plain data parallelism (:class:`loom.parallel.data.GradReducer`: bucketed ``iallreduce``).
* stage 1: full gradients accumulate in ``.grad`` as usual; :meth:`sync_grads` flattens each bucket and
  posts one ``ireduce_scatter`` per bucket (all posted, then waited), adding this rank's block into the
  block's gradient. After the optimizer, each bucket's updated block is ``allgather``-ed in place into the
  bucket's full buffer, which the module's parameters are views of.
* stage 2: as stage 1, but each bucket is reduce-scattered as backward produces it: a
  ``post_accumulate_grad`` hook copies the parameter's gradient into the bucket's flat gradient and drops
  ``.grad``; a complete bucket posts its ``ireduce_scatter`` at once, buckets strictly in descending order
  (so every rank issues the same collectives in the same order). At the end of each ``backward()`` (an
  autograd engine callback) the buckets not yet posted (a parameter without a gradient counts as zeros,
  the same on every rank, so replicas never diverge) are posted too.
* stage 3: parameters are sharded as well. Between uses a parameter is a one-element placeholder expanded to
  its shape, and computing with it raises (naming the module and ``keep=``) instead of reading zeros. A
  forward pre-hook on each module owning a bucket's parameters posts the bucket's
  ``iallgather`` (and every earlier one not yet posted, so all ranks post them in bucket order), waits for
  it, binds the parameters to views of the gathered buffer and prefetches the next bucket; when the
  bucket's last owning module has run it is freed. Autograd's saved tensors that are views of a gathered
  buffer are saved as (bucket, size, stride, offset) by a saved-tensors hook and re-materialized on unpack;
  a saved parameter itself is kept as the parameter and its bucket gathered on unpack (a custom function
  may save it while freed and read it in backward). Backward re-gathers buckets in descending order just in time
  (prefetching the one below), and frees a bucket as soon as all its parameters have their gradients,
  which are reduce-scattered as in stage 2, except that they stay in ``.grad`` until the bucket's last one
  arrives and are copied into its flat gradient only after the bucket is freed (its parameters, its flat
  gradient and a fresh gradient are never alive together). A module run *during* backward (activation recomputation,
  chunked maps) gathers its buckets as backward does and leaves them to be freed with their gradients.
  Buckets of the ``keep`` modules (parameters read outside their module's own forward, such as an LM head
  weight the loss multiplies by directly, or a tied embedding) are gathered when forward starts and kept
  until their gradients are reduced.

Construction from the meta device: a model built under ``torch.device("meta")`` (same seed on every rank) is
materialised by :mod:`loom.parallel.meta`, its values those of a plain build from that seed. At stage 3 this
runs bucket by bucket: the bucket's tensors are initialised (a ``reset_parameters`` replay restarts from the
stream's state at construction for each bucket, drawing for the rest of the model on one scratch module at a
time), this rank's block is copied into its master shard and the full tensors are dropped, so the storage
live during construction is the shards, the replicated state and about one bucket. No broadcast is needed:
every rank computes the same values. Stages 0-2 keep every parameter whole and materialise it whole.

Communication: gathers and reduce-scatters run on two duplicates of the group, so each keeps its own order.
MPICH makes no asynchronous progress, so posted reduce-scatters move only when tested (``progress=``, chosen
as :class:`loom.parallel.data.GradReducer` chooses, by :func:`loom.parallel.data.default_progress`):
``"hooks"``: every hook tests the outstanding requests (:meth:`_progress`, no thread, progress at hook times
only); ``"thread"``: a :class:`loom.comm.ProgressThread` posts each reduce-scatter and tests it while backward
computes (a core while one is in flight); gathers are tested from hooks in both modes. A
reduce-scatter is consumed (added into the block's gradient, its buffers dropped) as soon as it completes.
No hook waits for a reduce-scatter: a peer that never used a parameter (a branch taken on some ranks only)
posts that bucket's reduce-scatter only at the end of its backward, and before that it may wait for a gather
this rank would post only after the wait; so the reduce-scatters of a backward are waited for at its end (an
autograd engine callback, when every rank has posted all of its own; :meth:`sync_grads`), and their buffers
are bounded by the peers' progress rather than by a count (stage 1, which posts outside backward, keeps at
most ``MAX_PENDING`` outstanding). Time spent blocked on a request is
*exposed* communication, counted in :func:`zero_stats`, which also holds, as
:func:`loom.parallel.data.dp_stats` does, the reduce-scatter time hidden behind backward (``overlapped_comm_s``:
posted in backward, not yet seen complete when the step's :meth:`sync_grads` began) and the mechanism counts
(``buckets``, ``posted_in_backward``, ``tests_in_backward``); :attr:`ShardedDataParallel.last` has the last step's.

Devices. Buckets, shards, gradients, placeholders and (through the shards) the optimizer state live on the
parameters' device. With a CUDA-aware MPI every collective is handed device tensors (loom.comm waits for the
caller's stream before MPI touches them). Otherwise (:func:`loom.parallel.data.stages_through_host`: by default
where the parameters are on CUDA and the MPI is not CUDA-aware) the engine stages through host memory itself, so
that no hook blocks the host on a device copy and a prefetched bucket crosses the bus while compute runs:

* gradients (stages 1-3): a bucket's flat gradient is copied to a pooled pinned host buffer on the device->host
  side stream, after the compute stream (:func:`loom.comm.buffers.stage_out`); the ``ireduce_scatter`` (or the
  compressed ``ialltoallv`` of the encoded bytes) of the host buffer is posted once that copy's event has
  completed, looked at from the next hooks without waiting, strictly in staging order (the same order on
  every rank), and waited for in :meth:`sync_grads`. The reduced host block goes back on the host->device side
  stream into a buffer allocated there, and the compute stream waits for that copy on the device before the
  block is added into the shard's gradient (no host sync);
* parameters: a host mirror of the shards in the compute dtype (pinned) is copied again after a shard changes
  (an optimizer step, a load): all buckets' copies queued on one stream, one host wait per step. Stage 3
  gathers the mirror block with ``iallgather`` into a pinned host buffer; when the gather is seen complete (a
  hook's test, the prefetch of the next bucket included) its host->device copy is queued on the side stream
  into the bucket's buffer, allocated on that stream so the copy waits for nothing on the compute stream, and
  the compute stream waits for the copy's event only where the bucket is bound (:func:`loom.comm.buffers.use_after`),
  so the copy of bucket ``i+1`` overlaps bucket ``i``'s compute. Stages 1-2 gather every bucket after the step
  the same way and copy each into the buffer the parameters view (that copy waits for the compute stream's
  reads of the old values);
* progress thread: a task and its request's completion run with the submitting thread's CUDA stream current
  (:class:`loom.comm.ProgressThread`); on the staged path the thread sees host buffers only, and results go
  to the device on the training thread.

Training loops: :meth:`step` (reduce, clip, update, gather), or the plain ``loss.backward();
[torch.nn.utils.clip_grad_norm_(sdp.parameters(), c);] opt.step()``: the gradients are complete when
``backward()`` returns (its end callback waits for the reductions), several ``backward()`` calls accumulate
as under DDP (:meth:`no_sync` defers the wait), a norm of a shard's gradient is the bucket's over the group
(:class:`_ShardGrad`), and torch's global optimizer step hooks gather the updated blocks (stages 1-2) after an
optimizer over this wrapper's shards steps. The wrapped module's own habits (its forward, ``zero_grad``,
``state_dict``, ``load_state_dict``, an optimizer over its parameters) answer as the wrapper or raise naming the
fix (:meth:`ShardedDataParallel._hook_module`; the table in ``tests/mpi/check_zero_habits.py``).

Compression (``compress=``, a :class:`loom.compress.CompressionPolicy` or preset name), ZeRO++ style: the
gradient reduce-scatter uses the policy's ``dp`` codec (``hybrid``: int4) with its error feedback: each
bucket's gradient plus the residual of the last step is encoded block by block for the other ranks (this
rank's own block stays exact), one non-blocking ``ialltoallv`` of the bytes (every block encodes to the
codec's fixed wire size, so no counts are exchanged), each rank decodes and sums its block; what
the encoding dropped is this rank's new residual. Stage-3 parameter gathers use ``param_codec`` (default
blockwise int8 when compressing): each rank encodes its block once, one ``allgatherv`` of the bytes, every
rank decodes every block, its own included, so the gathered weights are the same on every rank while the
fp32 master stays exact. The compressed gathers are blocking (they run at the post point, in the gathers'
common order); a gradient codec without a fixed wire size runs its reduce-scatters after backward. The residuals
live with the shard and are saved in its checkpoint file (restored when loaded at the same group size;
at another size the layout they refer to is gone and they start from zero).

Reductions are sums in the master dtype (a bf16 gradient is reduced in float32: MPI has no bf16 sum),
scaled by ``1 / P`` (``reduce="avg"``) or not (``"sum"``). A parameter without a gradient counts as a zero
gradient (as one process with ``zero_grad(set_to_none=False)``): a stateful optimizer still moves it; with
``missing_grad="skip"`` a bucket no rank produced a gradient for is skipped by the optimizer instead.
Every rank of the group must run the same modules in the same order at stage 3 (as torch FSDP requires).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ... import stats as _stats
from ...comm import Communicator, Mesh, ProgressThread, Request, Ticket
from ...comm import buffers as _b
from ..data import PROGRESS_MODES, GradReducer, _union, default_progress, stages_through_host
from ..meta import Init
from .buckets import _Bucket, _flat_block, _make_buckets, _MetaSource, _parse_groups
from .habits import _STEP_OWNERS, _watch_steps
from .norms import _shard_grad, _ShardGrad
from .params import _freed_message, _refuse_compile, _ShardedParameter
from .requests import _RS, _in_backward, _Then, _wait
from .state import MANIFEST, _atomic_save, _block, _OldShards, _optim_block, _shard_name

__all__ = ["ShardedDataParallel"]

MAX_PENDING = 1  # outstanding gradient reduce-scatters (each holds a bucket's padded gradient)


class _Out:
    """A gradient on its way to the host (staged path): posted by :meth:`ShardedDataParallel._flush_staging` once
    its copy is done, strictly in staging order, so every rank posts the same collectives in the same order."""

    __slots__ = ("index", "host", "ev", "post", "in_hook")

    def __init__(self, index: int, host: torch.Tensor, ev: Any, post: Callable[[torch.Tensor], Any], in_hook: bool):
        self.index, self.host, self.ev, self.post, self.in_hook = index, host, ev, post, in_hook


def _group(group: Communicator | Mesh, axes: str | Sequence[str] | None) -> Communicator:
    if isinstance(group, Mesh):
        names = ("dp",) if axes is None else ((axes,) if isinstance(axes, str) else tuple(axes))
        bad = [a for a in names if a not in group.shape]
        if not names or bad:
            raise ValueError(f"ShardedDataParallel: axes {list(names)} must be axes of the mesh; {bad} are not "
                             f"(the mesh has {list(group.names)}); pass e.g. axes=['dp'] or ['dp', 'sp']")
        return group[names]
    if isinstance(group, Communicator):
        if axes is not None:
            raise ValueError(f"ShardedDataParallel: axes={axes!r} needs a Mesh as the group, got a Communicator "
                             f"({group.name!r}); pass the Mesh, or drop axes to shard over the communicator")
        return group
    raise TypeError(f"ShardedDataParallel: group must be a loom.comm Communicator or Mesh, got "
                    f"{type(group).__name__}")


def _check_args(module, stage, bucket_mb, reduce, micro_batches) -> None:
    if not isinstance(module, nn.Module):
        raise TypeError(f"ShardedDataParallel wraps an nn.Module, got {type(module).__name__}")
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage!r} is not one of 0, 1, 2, 3 (0: plain data parallel, 1: shard the "
                         f"optimizer state, 2: and the gradients, 3: and the parameters)")
    if not bucket_mb > 0:
        raise ValueError(f"bucket_mb={bucket_mb!r} must be > 0 (MiB per communication bucket)")
    if reduce not in ("avg", "sum"):
        raise ValueError(f"reduce={reduce!r} must be 'avg' (mean over the group) or 'sum'")
    if not isinstance(micro_batches, int) or micro_batches < 1:
        raise ValueError(f"micro_batches={micro_batches!r} must be an integer >= 1 (backward calls per step)")


class ShardedDataParallel(nn.Module):
    """Data parallelism over ``group`` with optimizer state (stage 1), gradients (2) and parameters (3) sharded.

    Usage::

        sdp = ShardedDataParallel(model, mesh, stage=3, axes=["dp"])
        opt = torch.optim.AdamW(sdp.parameters(), lr=1e-3)   # steps on this rank's flat shard
        for x, y in batches:
            loss_fn(sdp(x), y).backward()
            sdp.step(opt, max_norm=1.0)                        # reduce, clip, update, (stages 1-2) gather

    Args:
        module: the model; every rank passes one built the same way (values are broadcast from rank 0). It may
            be built on the meta device (``torch.manual_seed(s)``, then ``with torch.device("meta"):``), with the
            same seed on every rank: it is materialised as :func:`loom.parallel.materialize` does, its values
            those of a plain build from that seed. Stages 0-2 materialise it whole; stage 3 one bucket at a
            time, keeping this rank's block and dropping the rest, so construction holds the shards plus about
            one bucket, never the model (buffers and frozen parameters are materialised whole).
        group: a :class:`~loom.comm.Communicator`, or a :class:`~loom.comm.Mesh` with ``axes`` naming the
            axes to shard over (default ``["dp"]``; ``["dp", "sp"]``: sequence-parallel ranks hold the same
            weights; ``["dp", "ep"]`` for the non-expert weights of an MoE model).
        stage: 0, 1, 2 or 3 (see the module docstring).
        bucket_mb: bucket size cap in MiB (the unit of gathering and reducing).
        compute_dtype: dtype the module computes in (e.g. ``torch.bfloat16``); the master shard keeps the
            parameters' dtype. ``None``: the parameters' dtype.
        reduce: ``"avg"`` averages gradients over the group, ``"sum"`` sums them.
        compress: a :class:`loom.compress.CompressionPolicy` or preset name (stages 2-3): its ``dp`` codec and
            error feedback on the gradient reduce-scatter; ``None``: exact.
        param_codec: codec of the stage-3 parameter gathers (default ``"int8"`` when ``compress`` is given).
        micro_batches: stage 0 only: the first ``micro_batches - 1`` ``backward()`` calls of a step accumulate
            without a reduction (as under :meth:`no_sync`); any number of calls is exact either way.
        keep: stage 3: modules whose parameters are used outside their own forward (e.g. ``model.head`` when
            the loss reads ``head.weight`` directly); their buckets stay gathered from the start of forward
            until backward has reduced their gradients.
        init: for a meta model: ``init(name, tensor)`` filling one tensor in place (default: the model's
            ``init_parameter``, else its modules' ``reset_parameters()`` replayed; a meta tensor none of these
            covers is a ValueError on every rank before anything is allocated).
        groups: parameter groups as for a torch optimizer (``[{"params": decay, "weight_decay": 0.1},
            {"params": no_decay, "weight_decay": 0.0}]``): each bucket holds one group's parameters, and
            :meth:`optim_groups` gives the optimizer the shards group by group with their options.
        device: where a meta model is materialised (default ``"cpu"``); a real model's parameters say where
            they are. Buckets, shards, gradients and optimizer state live on that device.
        missing_grad: stages 1-3: ``"zero"`` (default): a parameter without a gradient on every rank counts
            as a zero gradient, so a stateful optimizer still moves it; ``"skip"``: a bucket for which no
            rank produced any gradient this step keeps ``.grad = None`` on its shard, so the optimizer skips
            it (no moment, step-count or decay update), which is torch's rule for the parameters of a bucket
            used or unused together: under "skip" a bucket holds one module's direct parameters, and a module
            whose parameters are used in part is refused (ValueError); one small allreduce of flags per backward.
        broadcast_buffers: synchronize the buffers from rank 0 around every forward that changed one (DDP's
            default); ``False``: each rank keeps its own.

    The gradient reduction's factor is :attr:`scale` (``1 / P`` for ``"avg"``, ``1`` for ``"sum"``); a caller
    whose loss is not a plain mean over the group (a sequence-parallel share of the mean, summed over ``sp``
    but averaged over ``dp``) may set it before the first backward.
    """

    def __init__(self, module: nn.Module, group: Communicator | Mesh, *, stage: int = 3,
                 axes: str | Sequence[str] | None = None, bucket_mb: float = 25.0,
                 compute_dtype: torch.dtype | None = None, reduce: str = "avg", micro_batches: int = 1,
                 compress: Any = None, param_codec: str | None = None, keep: Sequence[nn.Module] = (),
                 init: Init | None = None, groups: Sequence[dict[str, Any]] | None = None,
                 device: Any = None, missing_grad: str = "zero", progress: str = "auto",
                 broadcast_buffers: bool = True):
        super().__init__()
        _check_args(module, stage, bucket_mb, reduce, micro_batches)
        if progress not in PROGRESS_MODES:
            raise ValueError(f"progress={progress!r} is not one of {', '.join(PROGRESS_MODES)}")
        if progress == "thread" and not ProgressThread.available():
            raise ValueError("progress='thread' needs MPI at MPI_THREAD_MULTIPLE (mpi4py's default level; was "
                             "mpi4py.rc.thread_level changed?); use progress='hooks'")
        if missing_grad not in ("zero", "skip"):
            raise ValueError(f"missing_grad={missing_grad!r} must be 'zero' (a parameter without a gradient counts "
                             f"as a zero gradient) or 'skip' (a bucket no rank produced a gradient for is skipped "
                             f"by the optimizer, as torch skips a parameter whose .grad is None)")
        self.missing_grad = missing_grad
        self._group_opts, group_of = _parse_groups(module, groups)  # by name: a meta build installs new tensors
        comm = _group(group, axes)
        self.module = module
        self.stage = stage
        self.comm = comm
        self.micro_batches = micro_batches
        self.scale = 1.0 / comm.size if reduce == "avg" else 1.0
        self.broadcast_buffers = broadcast_buffers
        self._buffer_key: tuple[tuple[int, int], ...] | None = None  # buffers' (id, version) at the last sync
        self._source = _MetaSource.open(module, init, stage, torch.device(device or "cpu"))
        self._broadcast_replicated()
        # missing_grad="skip": a bucket holds one module's direct parameters (used or unused together), so
        # that the optimizer can skip it whole, as torch skips each parameter without a gradient.
        self.buckets, self._owners = _make_buckets(module, comm.size, int(bucket_mb * (1 << 20)), group_of,
                                                   per_module=missing_grad == "skip" and stage >= 1)
        trainable = [p for b in self.buckets for p in b.params]
        self.master_dtype = trainable[0].dtype if trainable else torch.float32
        # Buckets, shards, placeholders, gradients and (through the shards) the optimizer state live where the
        # parameters live; loom.comm stages device buffers through the host unless the MPI is CUDA-aware.
        self.device = next((p.device for p in trainable if not p.is_meta), torch.device(device or "cpu"))
        self.compute_dtype = compute_dtype or self.master_dtype
        self._staged = stages_through_host(self.device)
        self._staging: list[_Out] = []  # gradients being copied to the host, not yet posted (staged path)
        self._mirror: list[torch.Tensor] | None = None  # host copy of the shards in the compute dtype (staged)
        self._mirror_key: tuple[int, ...] | None = None  # the shards' versions it was copied at
        # How posted reduce-scatters move during backward (module docstring); nothing travels on one rank.
        self.progress = default_progress() if progress == "auto" else progress
        if comm.size == 1:
            self.progress = "hooks"
        self._worker: ProgressThread | None = None
        self._pending_rs: list[_RS] = []
        self._step_rs: list[_RS] = []  # this step's reduce-scatters, for the accounting in sync_grads
        self._bwd_tests = 0  # tests of outstanding reduce-scatters from hooks during backward (hooks mode)
        self._at_bwd_end: dict[str, int] = {}  # `live` when this step's first backward ended
        self.last: dict[str, float] = {}
        self._deferred: list[tuple[_Bucket, torch.Tensor]] = []  # compressed reduce-scatters run after backward
        self._hooks: list[Any] = []
        self._bwd_open = False  # a backward() is running (its end callback is queued)
        self._no_sync = False  # inside no_sync(): backward() accumulates, the reduction waits for a later one
        self._unreduced = 0  # backward() calls whose gradients are not reduced yet (no_sync, micro_batches)
        self._depth = 0  # forward contexts entered (the root module's hooks enter one unless inside one)
        self._internal = False  # this wrapper calls the module's state_dict / load_state_dict itself
        self._index_of: dict[int, tuple[int, int]] = {}
        self._inner_ids: set[int] = set()  # stages 1-3: the wrapped module's trainable parameters (not stepped)
        if stage == 0:
            if compute_dtype not in (None, self.master_dtype):
                raise ValueError("compute_dtype needs stage >= 1 (the fp32 master copy lives in the shard)")
            self._broadcast_trainable(trainable)
            # Registered before the reducer's hooks: the first gradient of a backward arms the reducer for it.
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad0) for p in trainable]
            self.reducer = GradReducer(trainable, comm, bucket_mb=bucket_mb, progress=progress)
            for p in trainable:  # a missing gradient counts as zero, as in the flat shard of stages 1-3
                p.grad = torch.zeros_like(p)
            _watch_steps(self, trainable)
            self._hook_module()
            return
        if self.compute_dtype != self.master_dtype:
            with torch.no_grad():
                for p in module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(self.compute_dtype)
        self._setup_compression(compress, param_codec)
        self._ag = comm.dup(name=comm.name)  # parameter gathers, in their own order
        self._rs = comm.dup(name=comm.name)  # gradient reduce-scatters, in theirs
        self._init_shards()
        trainable = [p for b in self.buckets for p in b.params]  # a meta model's were replaced by real ones
        self._inner_ids = {id(p) for p in trainable}
        self._synced = False  # this step's gradients are reduced into the shards (sync_grads ran)
        self._accumulating = False  # a backward ran since the last reduction (missing_grad="skip" flags)
        self._stepped = False  # the optimizer step hook refreshed the parameters
        if stage >= 2:
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad) for p in trainable]
        else:
            self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad1) for p in trainable]
        _watch_steps(self, list(self.shards))
        if stage == 3:
            for m, bs in self._owners.items():
                self._hooks.append(m.register_forward_pre_hook(self._pre_hook(bs)))
                self._hooks.append(m.register_forward_hook(self._post_hook(bs)))
        self._index_of = {id(q): (b.index, i) for b in self.buckets for i, q in enumerate(b.params)}
        self._keep = sorted({self._index_of[id(p)][0] for m in keep for p in m.parameters()
                             if id(p) in self._index_of}) if stage == 3 else []
        self._live: dict[int, int] = {}  # storage address of a gathered bucket -> its index (stage 3)
        self._fwd_next = 0
        self._fwd_ran = [0] * len(self.buckets)
        self._bwd_next = -1
        self._rs_next = -1
        self._hook_module()

    # ------------------------------------------------------------------ construction
    def _broadcast_replicated(self) -> None:
        """Replicated state (buffers, frozen parameters) starts equal on every rank, as under DDP."""
        self._bcast_coalesced([*self.module.buffers(), *(p for p in self.module.parameters() if not p.requires_grad)])
        self._buffer_key = self._buffers_now()

    def _broadcast_trainable(self, params: Sequence[torch.Tensor]) -> None:
        """Stage 0: every rank starts from rank 0's parameters, as DDP's construction (stages 1-3 broadcast each
        bucket as they build its shards)."""
        self._bcast_coalesced(params)

    def _hook_module(self) -> None:
        """The wrapped module's own habits answer as this wrapper (FSDP2 users call the inner module): its
        forward runs in :meth:`forward_context`, its ``zero_grad()`` clears the shards' gradients too, its
        ``load_state_dict()`` reaches the shards (stages 1-2) or is refused (stage 3, like its ``state_dict()``,
        whose parameters are placeholders there), and an optimizer over its parameters is refused at stages
        1-3 (they are not what is stepped)."""
        m = self.module
        m.forward = self._inner_forward(m.forward)  # an instance attribute, so a forward that raises still
        # leaves the context (forward hooks have no reliable exit then)
        self._hooks.append(m.register_state_dict_pre_hook(self._inner_state_dict))
        self._hooks.append(m.register_load_state_dict_pre_hook(self._inner_load))
        self._hooks.append(m.register_load_state_dict_post_hook(self._inner_loaded))
        m.zero_grad = self._inner_zero_grad  # an instance attribute: nn.Module has no zero_grad hook

    def _inner_forward(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        """The wrapped module's forward, run in :meth:`forward_context` unless already inside one (this
        wrapper's own forward) or recomputed in backward (then gathered as its submodules are)."""

        @functools.wraps(forward)
        def run(*args, **kwargs):
            if self._depth or _in_backward():
                return forward(*args, **kwargs)
            with self.forward_context():
                return forward(*args, **kwargs)

        run._loom_sdp = self
        return run

    def _inner_state_dict(self, module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if self.stage == 3 and not self._internal:
            raise ValueError(
                "ShardedDataParallel stage 3: the wrapped module's state_dict() would hold placeholders (each "
                "rank keeps only its shard of every parameter); call sdp.state_dict() on every rank (a collective: "
                "full values on every rank), or sdp.save_sharded(path) for one file per rank")

    def _inner_load(self, module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors) -> None:
        if self.stage == 3 and not self._internal:
            raise ValueError(
                "ShardedDataParallel stage 3: the wrapped module's load_state_dict() would write into "
                "placeholders (each rank keeps only its shard of every parameter); call sdp.load_state_dict(sd) "
                "(each rank takes its shard of the full values), or sdp.load_sharded(path)")

    def _inner_loaded(self, module: nn.Module, incompatible: Any) -> None:
        """Stages 1-2: the module's parameters (views of the gathered buckets) were loaded; each rank's master
        block is taken from them, so the next optimizer step starts from the loaded values."""
        if self.stage in (1, 2) and not self._internal:
            r = self.comm.rank
            self._stale_mirror()
            with torch.no_grad():
                for b in self.buckets:
                    self._master(b).copy_(b.full[r * b.shard:(r + 1) * b.shard])

    def _inner_zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped module's ``zero_grad()``: its parameters' gradients and this wrapper's shards'."""
        nn.Module.zero_grad(self.module, set_to_none)
        if self.stage:
            self._zero_shard_grads(set_to_none)

    def _zero_shard_grads(self, set_to_none: bool) -> None:
        for sh in self.shards:
            if set_to_none or sh.grad is None:
                sh.grad = None
            else:
                sh.grad.zero_()

    def _bcast_coalesced(self, tensors: Sequence[torch.Tensor], fresh: bool = False) -> dict[int, torch.Tensor]:
        """Rank 0's values of ``tensors`` on every rank: one broadcast per (dtype, device), copied in place, or
        (``fresh``) into new tensors, returned by ``id`` of the old one (ranks other than 0)."""
        out: dict[int, torch.Tensor] = {}
        if self.comm.size == 1:
            return out
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel() and not t.is_meta:
                groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for ts in groups.values():
                flat = self.comm.bcast(torch.cat([t.detach().reshape(-1) for t in ts]), root=0)
                if self.comm.rank:
                    off = 0
                    for t in ts:
                        got = flat[off:off + t.numel()].view_as(t)
                        if fresh:
                            out[id(t)] = got.clone()
                        else:
                            t.copy_(got)
                        off += t.numel()
        return out

    def _buffers_now(self) -> tuple[tuple[int, int], ...]:
        return tuple((id(t), t._version) for t in self.module.buffers())

    @torch.compiler.disable  # collectives: run as they are, never traced into a graph (torch.compile at 0-2)
    def sync_buffers(self, force: bool = False) -> None:
        """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``): run at the start and the end of every
        forward, so that a buffer a forward updates (BatchNorm's running statistics) is the same on every rank
        between forwards, as is what each forward reads. A buffer is sent only when some rank's changed since
        the last sync (one small allreduce finds out; ``force``: always). Collective over the group."""
        if not self.broadcast_buffers or self.comm.size == 1:
            return
        bufs = list(self.module.buffers())
        if not bufs:
            return
        if not force:
            changed = torch.tensor([int(self._buffers_now() != self._buffer_key)], dtype=torch.int32, device="cpu")
            if not self.comm.allreduce(changed, op="max").item():
                return
        # New tensors rather than copies in place: a forward's graph saves the buffers it read (BatchNorm's
        # backward takes its running statistics), and an in-place write would fail that backward's version check.
        fresh = self._bcast_coalesced(bufs, fresh=True)
        for m in self.module.modules():
            for name, t in m._buffers.items():
                if t is not None and id(t) in fresh:
                    m._buffers[name] = fresh[id(t)]
        self._buffer_key = self._buffers_now()

    def _padded_flat(self, b: _Bucket, tensors: Sequence[torch.Tensor | None], dtype) -> torch.Tensor:
        flat = torch.zeros(b.padded, dtype=dtype, device=self.device)
        for p, off, t in zip(b.params, b.offsets, tensors):
            if t is not None:
                flat[off:off + p.numel()].copy_(t.reshape(-1))
        return flat

    def _init_shards(self) -> None:
        r = self.comm.rank
        total = 0
        for b in self.buckets:
            b.start = total
            total += b.shard
        self.shards = nn.ParameterList([nn.Parameter(torch.zeros(b.shard, dtype=self.master_dtype, device=self.device))
                                        for b in self.buckets])
        self._placeholders: dict[int, torch.Tensor] = {}
        with torch.no_grad():
            for b in self.buckets:
                if self._source is not None:  # stage 3 on meta: this bucket only, then this rank's block of it
                    self._source.take(b.names)
                    b.params = [self.module.get_parameter(n) for n in b.names]  # materialize installs new ones
                    _flat_block(b.params, b.params, r * b.shard, b.shard, self.master_dtype, out=self._master(b))
                else:
                    full = self._padded_flat(b, [p.detach() for p in b.params], self.master_dtype)
                    self.comm.bcast(full, root=0)
                    self._master(b).copy_(full[r * b.shard:(r + 1) * b.shard])
                if self.stage == 3:
                    for p, name in zip(b.params, b.names):
                        zero = torch.zeros((), dtype=self.compute_dtype, device=self.device)
                        self._placeholders[id(p)] = zero.expand(p.shape)
                        p.data = self._placeholders[id(p)]
                        p.__class__ = _ShardedParameter
                        p._loom_freed = _freed_message(name)
                else:
                    b.full = full.to(self.compute_dtype)
                    self._bind(b)
        if self._source is not None:
            self._source.finish()
            self._source = None

    def _master(self, b: _Bucket) -> torch.Tensor:
        return self.shards[b.index].data

    def _add_grad(self, i: int, g: torch.Tensor) -> None:
        if self._staged:
            g = self._on_device(g)
        sh = self.shards[i]
        if sh.grad is None:
            sh.grad = g.mul_(self.scale) if self.scale != 1.0 else g
        else:
            sh.grad.add_(g, alpha=self.scale)

    def flat_shard(self) -> torch.Tensor:
        """This rank's master blocks laid end to end (a copy)."""
        if not len(self.shards):
            return torch.zeros(0, device=self.device)
        return torch.cat([sh.detach() for sh in self.shards])

    def _bind(self, b: _Bucket) -> None:
        full = b.full
        for p, off in zip(b.params, b.offsets):
            p.data = full[off:off + p.numel()].view(p.shape)
            p._loom_freed = None
        b.bound = True

    # ------------------------------------------------------------------ host staging (module docstring, "Devices")
    def _fresh_mirror(self, b: _Bucket | None = None) -> None:
        """The host mirror of the shards (compute dtype), copied again when a shard changed since (after an
        optimizer step or a load; ``b``: look at that bucket's shard only, all being stepped together). All
        buckets' copies are queued on one side stream and waited for once (copies on one stream finish in order),
        so a step costs one host wait here, not one per gathered bucket."""
        key = self._mirror_key
        if key is not None and (self.shards[b.index]._version == key[b.index] if b is not None
                                else key == tuple(sh._version for sh in self.shards)):
            return
        if self._mirror is None:
            self._mirror = [_b.host_empty((bk.shard,), self.compute_dtype, self.device) for bk in self.buckets]
        ev = None
        for bk in self.buckets:
            _, ev = _b.stage_out(self._master(bk).to(self.compute_dtype), out=self._mirror[bk.index])
        _b.wait_copy(ev)
        self._mirror_key = tuple(sh._version for sh in self.shards)

    def _stale_mirror(self) -> None:
        """The shards were written where their version counters do not see it (loads and optimizer steps through
        ``.data``, fused optimizers): the next gather copies the mirror again."""
        self._mirror_key = None

    def _on_device(self, host: torch.Tensor) -> torch.Tensor:
        """A host result on this engine's device, the caller's stream ordered after the copy (no host wait)."""
        dev = _b.side_empty(tuple(host.shape), host.dtype, self.device)
        _b.use_after(_b.stage_in(host, dev, fresh=True), dev)
        return dev

    def _track(self, x: "_RS") -> None:
        self._pending_rs.append(x)
        self._step_rs.append(x)
        _stats.add("time", "zero", reduce_scatters=1)

    def _queue_rs(self, index: int, flat: torch.Tensor, in_hook: bool, post: Callable[[torch.Tensor], Any]) -> None:
        """Staged path: queue ``flat``'s copy to the host and post ``post(host)`` once it is there (from a later
        hook, or :meth:`sync_grads`), so no hook blocks the host on a device copy."""
        host, ev = _b.stage_out(flat)
        self._staging.append(_Out(index, host, ev, post, in_hook))
        self._flush_staging(block=False)

    def _flush_staging(self, block: bool, keep: int = 0) -> None:
        """Post the staged gradients whose copies are done, in staging order (``block``: wait for the copies),
        leaving the last ``keep`` queued."""
        q = self._staging
        while len(q) > keep:
            o = q[0]
            if block:
                _b.wait_copy(o.ev)
            elif not _b.copy_done(o.ev):
                return
            q.pop(0)
            self._track(_RS(o.index, o.post(o.host), o.in_hook and self._bwd_open))

    # ------------------------------------------------------------------ compression
    def _setup_compression(self, compress: Any, param_codec: str | None) -> None:
        self.grad_codec = self.param_codec = None
        self.error_feedback = None
        if compress is None:
            if param_codec is not None:
                raise ValueError("param_codec needs compress= (a CompressionPolicy or preset name)")
            return
        from ...compress import CompressionPolicy, ErrorFeedback, get_codec

        policy = CompressionPolicy.preset(compress) if isinstance(compress, str) else compress
        if not isinstance(policy, CompressionPolicy):
            raise TypeError(f"compress must be a loom.compress.CompressionPolicy or a preset name, got "
                            f"{type(compress).__name__}")
        if self.stage < 2:
            raise ValueError(f"compress needs stage 2 or 3 (the reduce-scatter it compresses), got stage "
                             f"{self.stage}")
        self.grad_codec = policy.codec_for("dp")
        if self.grad_codec is not None and self.grad_codec.name == "powersgd":
            raise ValueError("compress: powersgd needs whole matrices; a reduce-scatter of flat blocks cannot use "
                             "it; choose a blockwise dp codec (int4, int8) or another policy")
        self.error_feedback = ErrorFeedback() if policy.error_feedback and self.grad_codec is not None else None
        if self.stage == 3 and (param_codec or self.grad_codec is not None):
            self.param_codec = get_codec(param_codec or "int8")

    def _compressed_rs(self, b: _Bucket, grad: torch.Tensor, in_hook: bool = False) -> "Request | _Then | None":
        """This rank's block of the sum of ``grad`` over the group, other ranks' blocks sent encoded: one
        non-blocking ``ialltoallv`` of the bytes (every block encodes to the codec's fixed wire size, so the
        receive counts are known without asking), decoded and summed when it completes. A codec without a
        fixed size (zstd) needs its counts exchanged first, a blocking collective: then it runs at once,
        and :meth:`_post_rs` keeps it out of backward. On the staged path the encoded bytes are queued for the host
        (:meth:`_queue_rs`; ``None`` is returned) and the received bytes come back to the device to be decoded."""
        codec, ef, comm = self.grad_codec, self.error_feedback, self._rs
        y = ef.apply(b.index, grad) if ef is not None else grad
        r, n = comm.rank, b.shard
        residual = torch.zeros_like(y) if ef is not None else None
        wire = codec.wire_bytes(n, y.dtype)
        chunks, counts = [], []
        for j in range(comm.size):
            if j == r:
                counts.append(0)
                continue
            pkt = codec.encode(y[j * n:(j + 1) * n])
            chunks.append(pkt.data)
            counts.append(pkt.nbytes)
            if wire is not None and pkt.nbytes != wire:
                raise RuntimeError(f"codec {codec!r} encoded {n} elements into {pkt.nbytes} bytes, not the "
                                   f"{wire} its wire_bytes() states; the receive counts would disagree")
            if residual is not None:
                residual[j * n:(j + 1) * n] = y[j * n:(j + 1) * n] - codec.decode(pkt).to(y.dtype)
        if ef is not None:
            ef.set(b.index, residual)
        send = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8, device=y.device)
        own = y[r * n:(r + 1) * n].clone()

        def decode(got):
            recv, rc = got
            if recv.device != own.device:  # staged: received on the host
                recv = self._on_device(recv)
            acc, off = own, 0
            for j, c in enumerate(rc):
                if j != r:
                    acc += codec.decode(codec.from_wire(recv[off:off + c], (n,), y.dtype)).to(y.dtype)
                off += c
            return acc

        if wire is None:
            return _Then(self._post(lambda: Request.completed(comm.alltoallv(send, counts),
                                                              what="compressed reduce-scatter")), decode)
        rc = [0 if j == r else wire for j in range(comm.size)]
        if self._staged:
            self._queue_rs(b.index, send, in_hook,
                           lambda h: _Then(self._post(lambda: comm.ialltoallv(h, counts, rc)), decode))
            return None
        return _Then(self._post(lambda: comm.ialltoallv(send, counts, rc)), decode)

    def _post(self, post: Callable[[], Request]) -> "Request | Ticket":
        """Post a collective on the reduce-scatter communicator: here (``"hooks"``), or on the progress thread,
        which then tests it while backward computes (``"thread"``; every post goes there, so one thread issues
        them in order)."""
        if self.progress != "thread":
            return post()
        if self._worker is None:
            self._worker = ProgressThread(name=f"loom-zero-progress-{self.comm.name}")
        return self._worker.submit(post)

    def _ef_state(self) -> dict[int, torch.Tensor] | None:
        if self.error_feedback is None:
            return None
        return {b.index: self.error_feedback.get(b.index) for b in self.buckets
                if self.error_feedback.get(b.index) is not None}

    # ------------------------------------------------------------------ public API
    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """What the optimizer steps on: this rank's flat master blocks (stage >= 1) or the trainable params."""
        for _, p in self.named_parameters():
            yield p

    def named_parameters(self, prefix: str = "", recurse: bool = True,
                         remove_duplicate: bool = True) -> Iterator[tuple[str, nn.Parameter]]:
        if self.stage == 0:
            for b in self.buckets:
                for n, p in zip(b.names, b.params):
                    yield prefix + n, p
        else:
            for i, sh in enumerate(self.shards):
                yield f"{prefix}shards.{i}", sh

    def optim_groups(self) -> list[dict[str, Any]]:
        """Parameter groups for a torch optimizer: one per group given as ``groups=`` (each with its options,
        e.g. ``weight_decay`` or ``lr``), holding this rank's shards of that group's buckets (stage >= 1) or
        its parameters (stage 0); trainable parameters no group listed form a last group with no options.
        ``torch.optim.AdamW(sdp.optim_groups(), lr=...)``. Without ``groups=``: one group, :meth:`parameters`."""
        out = [{"params": [], **opts} for opts in self._group_opts]
        for b in self.buckets:
            if self.stage == 0:
                out[b.group]["params"].extend(b.params)
            else:
                out[b.group]["params"].append(self.shards[b.index])
        return out

    def forward(self, *args, **kwargs):
        if self.stage == 3:
            return self._forward_eager(*args, **kwargs)
        return self.call(self.module, *args, **kwargs)

    @torch.compiler.disable
    def _forward_eager(self, *args, **kwargs):
        """Stage 3's forward, which ``torch.compile(sdp)`` leaves uncompiled (dynamo skips it: its gathers,
        collectives and parameter rebinding cannot be traced), so a compiled wrapper computes what the wrapper
        does. A module compiled on its own that reads freed stage-3 parameters raises by name instead."""
        return self.call(self.module, *args, **kwargs)

    def call(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        """Run ``fn(*args, **kwargs)`` as this module's forward (e.g. ``sdp.call(model.loss, x, y)`` for a
        model whose training entry point is not ``forward``): at stage 3 its parameters are gathered just in
        time and autograd's saved tensors are tracked as in :meth:`forward`."""
        with self.forward_context():
            return fn(*args, **kwargs)

    @contextlib.contextmanager
    def forward_context(self) -> Iterator[None]:
        """The context one forward runs in (buffers synchronized from rank 0 on entry and exit; stage 3: gathers
        kept buckets, tracks saved tensors, and frees on exit); for callers that run the module's pieces
        themselves, such as a pipeline's micro-batches. A call of the wrapped module itself (``model(x)``, the
        FSDP2 habit) enters it too, through a hook on the module."""
        if self._depth:  # the module called inside this wrapper's own forward
            yield
            return
        if self.stage == 3:
            _refuse_compile()
        self._depth += 1
        try:
            self.sync_buffers()
            if self.stage < 3:
                if self.stage:
                    self._synced = False
                yield
            else:
                self._synced = False
                self._fwd_next = 0
                self._fwd_ran = [0] * len(self.buckets)
                for i in self._keep:  # read outside any hook: gathered now, in the same order on every rank
                    self._post_gather(self.buckets[i])
                    self._ensure(self.buckets[i])
                with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                    yield
                self._forward_end()
            self.sync_buffers()
        finally:
            self._depth -= 1

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation without a reduction per ``backward()`` (DDP's ``no_sync``): the gradients of
        the backward calls inside accumulate, and the first ``backward()`` outside (or :meth:`sync_grads`, which
        an optimizer step calls) reduces them all. Stages 0-1 accumulate locally and communicate nothing inside;
        stages 2-3 hold no full gradients, so their reduce-scatters still run during each backward and only the
        wait for them moves to the end of the first backward outside. Exact either way."""
        old, self._no_sync = self._no_sync, True
        try:
            yield
        finally:
            self._no_sync = old

    def sync_grads(self) -> None:
        """Finish the gradient reduction: afterwards ``shards[b].grad`` (stage 0: each parameter's ``.grad``)
        holds this rank's reduced block. Every ``backward()`` ends with this (its end callback) unless inside
        :meth:`no_sync`, so the gradients are complete when ``backward()`` returns, as under DDP and FSDP2;
        called explicitly (or by the optimizer's step hook) it reduces what :meth:`no_sync` left. Idempotent:
        a second call reduces nothing again."""
        if self.stage == 0:
            if self.reducer.armed:
                self.reducer.finish()
            elif self._unreduced:  # backward calls under no_sync: their accumulated gradients, reduced now
                self.reducer.start(1)
                self.reducer.finish()
            self._unreduced = 0
            return
        if self._synced:
            return
        if self._bwd_open:
            self._backward_end()
            if self._synced:
                return
        self._synced = True
        self._unreduced = 0
        if self.stage == 1:
            self._post_stage1()
        for b, grad in self._deferred:
            self._pending_rs.append(_RS(b.index, self._compressed_rs(b, grad), False))  # no fixed size: not staged
        self._deferred.clear()
        self._bwd_tests = self.live["tests"]  # the progress thread's tests before the wait
        t0 = time.perf_counter()
        self._flush_staging(block=True)
        self._drain(0)
        self._account(t0, time.perf_counter())
        skip = self._skipped() if self.missing_grad == "skip" else set()
        self._accumulating = False
        for i, sh in enumerate(self.shards):
            if i in skip:
                sh.grad = None
            elif sh.grad is None:  # no gradient reached it this step: zero, the same on every rank
                sh.grad = _shard_grad(torch.zeros_like(sh), self.comm)
            elif type(sh.grad) is not _ShardGrad:
                sh.grad = _shard_grad(sh.grad, self.comm)

    def _skipped(self) -> set[int]:
        """``missing_grad="skip"``: the buckets whose shard gradient stays ``None`` (no rank produced a gradient
        for any of its parameters since it was ``None``), agreed by every rank (one allreduce of a flag per
        parameter). A bucket some of whose parameters got a gradient and others none cannot be skipped in part
        (the optimizer steps a shard whole): refused by name, on every rank alike."""
        had = torch.tensor([h for b in self.buckets for h in b.had], dtype=torch.int32, device="cpu")
        had = self.comm.allreduce(had, op="max") if self.comm.size > 1 else had
        flags, skip, off = had.tolist(), set(), 0
        for b in self.buckets:
            mine, off = flags[off:off + len(b.params)], off + len(b.params)
            if b.fresh and not any(mine):
                skip.add(b.index)
            elif b.fresh and not all(mine):
                without = [n for n, h in zip(b.names, mine) if not h]
                with_ = [n for n, h in zip(b.names, mine) if h]
                raise ValueError(
                    f"missing_grad='skip': bucket {b.index} holds parameters with a gradient this step ({with_[:3]}) "
                    f"and without one on every rank ({without[:3]}); the optimizer steps a bucket's shard whole, so "
                    f"it cannot skip {without[0]!r} alone. Buckets hold one module's parameters under 'skip': "
                    f"use that module's parameters together, or pass missing_grad='zero' (a missing gradient "
                    f"counts as zeros)")
        return skip

    def _fresh_accumulation(self) -> None:
        """The first backward after a reduction begins: a bucket whose shard gradient is ``None`` may stay
        ``None`` (``fresh``); one holding a gradient (earlier backward calls, or zeros from the optimizer's
        ``zero_grad(set_to_none=False)``) keeps it, as torch keeps a ``.grad`` that nothing adds to."""
        if self._accumulating:
            return
        self._accumulating = True
        for b, sh in zip(self.buckets, self.shards):
            b.fresh = sh.grad is None
            b.had = [False] * len(b.params)

    def _account(self, t0: float, t1: float) -> None:
        """This step's reduce-scatter accounting (:attr:`last`, :func:`zero_stats`); ``t0``-``t1``: blocked in
        :meth:`sync_grads` waiting for them."""
        rs, self._step_rs = self._step_rs, []
        inb = [x for x in rs if x.in_backward]
        self.last = {"exposed_s": t1 - t0, "overlapped_s": _union([x.interval(t0) for x in inb]),
                     "buckets": len(rs), "posted_in_backward": len(inb), "tests_in_backward": self._bwd_tests,
                     "first_tests": self._at_bwd_end.get("first_tests", 0),
                     "first_done": self._at_bwd_end.get("first_done", 0)}
        _stats.add("time", "zero", overlapped_comm_s=self.last["overlapped_s"], buckets=len(rs),
                   posted_in_backward=len(inb), tests_in_backward=self._bwd_tests)
        self._bwd_tests, self._at_bwd_end = 0, {}

    @property
    def live(self) -> dict[str, int]:
        """This step's reduce-scatters so far (mechanism counts, no timing): posted from gradient hooks, tests
        of outstanding ones during backward (hooks or progress thread), and the first posted one's tests and
        whether it was seen complete."""
        rs = self._step_rs
        first = rs[0] if rs and rs[0].in_backward else None
        tickets = sum(x.tested for x in rs if isinstance(x.req, Ticket))
        done = first is not None and (first.seen is not None or isinstance(first.req, Ticket) and first.req.done)
        return {"posted": sum(x.in_backward for x in rs), "tests": self._bwd_tests + tickets,
                "first_tests": first.tested if first is not None else 0, "first_done": int(done)}

    def _drain(self, limit: int | None) -> None:
        """Consume completed reduce-scatters in posting order; wait until at most ``limit`` are outstanding
        (``None``: never wait, for hooks, which run while peers may still be in their backward)."""
        pending = self._pending_rs
        while pending and (limit is not None and len(pending) > limit or pending[0].test()):
            x = pending.pop(0)
            self._add_grad(x.index, _wait(x.req))

    def _post_stage1(self) -> None:
        for b in self.buckets:
            grads = [p.grad for p in b.params]
            b.had = [h or g is not None for h, g in zip(b.had, grads)]
            if all(g is None for g in grads):
                flat = torch.zeros(b.padded, dtype=self.master_dtype, device=self.device)
            else:
                flat = self._padded_flat(b, grads, self.master_dtype)
            if self._staged:  # the next bucket's copy is queued while this one's waits
                self._queue_rs(b.index, flat, False, lambda h: self._post(lambda: self._rs.ireduce_scatter(h)))
                self._flush_staging(block=True, keep=1)
            else:
                self._track(_RS(b.index, self._post(lambda flat=flat: self._rs.ireduce_scatter(flat)), False))
            for p in b.params:
                p.grad = None
            self._drain(MAX_PENDING)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale the gradients so that their global 2-norm is at most ``max_norm``; returns the norm before."""
        self.sync_grads()
        if self.stage == 0:
            params = [p for b in self.buckets for p in b.params if p.grad is not None]
            return torch.nn.utils.clip_grad_norm_(params, max_norm)
        grads = [sh.grad for sh in self.shards if sh.grad is not None]
        sq = sum((g.to(torch.float64).pow(2).sum() for g in grads),
                 torch.zeros((), dtype=torch.float64, device=self.device))
        total = self.comm.allreduce(sq.reshape(1)).sqrt()[0].to(self.master_dtype)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
        return total

    def step(self, optimizer: torch.optim.Optimizer, *, max_norm: float | None = None) -> torch.Tensor | None:
        """Reduce the gradients, clip (``max_norm``), ``optimizer.step()``, refresh the parameters, zero grads."""
        self.sync_grads()
        norm = self.clip_grad_norm_(max_norm) if max_norm is not None else None
        self.update(optimizer)
        self.zero_grad()
        return norm

    def update(self, optimizer: torch.optim.Optimizer) -> None:
        """``optimizer.step()`` on the shards, then (stages 1-2) the updated blocks gathered into the module's
        parameters; for loops that reduce (:meth:`sync_grads`) and clip themselves. A torch optimizer over
        :meth:`parameters` does the same from its step hooks, so a plain ``optimizer.step()`` is equivalent."""
        self._stepped = False
        optimizer.step()
        if not self._stepped:  # an optimizer without torch's step hooks
            self._after_step()

    def _before_step(self) -> None:
        """The optimizer is about to step on this rank's shards: finish the reduction it needs."""
        self.sync_grads()

    def _after_step(self) -> None:
        """The optimizer stepped: stages 1-2 gather the updated blocks into the module's parameters; stage 0
        arms the reducer for the next step's backward."""
        self._stepped = True
        # The host mirror is copied again after every step: a fused optimizer or one writing through ``.data``
        # updates the shards without moving their version counters, and the gathers would read the old weights.
        self._stale_mirror()
        if self.stage in (1, 2):
            self._gather_all()

    def _on_grad0(self, p: torch.Tensor) -> None:
        """Stage 0, the first gradient of a backward: its end is queued, and unless the gradients accumulate
        (:meth:`no_sync`, the first ``micro_batches - 1`` calls) the reducer is armed for it, so its buckets are
        reduced while backward runs (the reducer's hooks come after this one)."""
        if self._bwd_open:
            return
        self._bwd_open = True
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end0)
        if not self._no_sync and self._unreduced + 1 >= self.micro_batches:
            self.reducer.start(1)  # each .grad, with what it accumulated, becomes its bucket view

    def _backward_end0(self) -> None:
        self._bwd_open = False
        if self.reducer.armed:
            self.reducer.finish()
            self._unreduced = 0
        else:
            self._unreduced += 1

    def _on_grad1(self, p: torch.Tensor) -> None:
        self._synced = False  # stage 1: a backward ran, so this step's gradients wait for their reduce-scatter
        if not self._bwd_open:
            self._bwd_open = True
            self._fresh_accumulation()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self.stage == 0:  # the gradients stay views of the reducer's buckets
            for b in self.buckets:
                for p in b.params:
                    if p.grad is not None:
                        p.grad.zero_()
            return
        self._zero_shard_grads(set_to_none)
        for b in self.buckets:
            for p in b.params:
                p.grad = None

    def _gather_all(self) -> None:
        """Stages 1-2: every bucket's updated block, gathered in place into the buffer the parameters view."""
        if self._staged:  # from the host mirror; each result copied back on the side stream, no host wait
            self._fresh_mirror()
            reqs = [self._ag.iallgather(self._mirror[b.index],
                                        out=_b.host_empty((b.padded,), self.compute_dtype, self.device))
                    for b in self.buckets]
            for b, req in zip(self.buckets, reqs):
                _b.use_after(_b.stage_in(_wait(req), b.full), b.full)
            return
        reqs = [self._ag.iallgather(self._master(b).to(self.compute_dtype), out=b.full) for b in self.buckets]
        for req in reqs:
            _wait(req)

    def remove(self) -> None:
        """Take the hooks off the module (it keeps its current, possibly placeholder, parameters). Reductions
        still in flight (under :meth:`no_sync`, or a loop abandoned by an exception) are waited for first:
        MPI still reads and writes their buffers. Collective when any are."""
        if self.stage:
            self._flush_staging(block=True)
            self._drain(0)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        for i in (*self._step_ids, *self._inner_ids):
            if _STEP_OWNERS.get(i) is self:
                del _STEP_OWNERS[i]
        self._step_ids = set()
        self._inner_ids = set()
        if self.module.__dict__.get("zero_grad") == self._inner_zero_grad:
            del self.module.zero_grad
        if getattr(self.module.__dict__.get("forward"), "_loom_sdp", None) is self:
            del self.module.forward
        if self.stage == 0:
            self.reducer.remove()
        elif self._worker is not None:
            self._worker.close()
            self._worker = None
        for b in self.buckets:
            for p in b.params:
                if type(p) is _ShardedParameter:
                    p.__class__ = nn.Parameter

    # ------------------------------------------------------------------ progress
    def _progress(self) -> None:
        """Test every outstanding request once: MPICH moves a non-blocking collective only when tested."""
        for b in self.buckets:
            if b.req is not None and b.req.test():
                self._land(b)  # a prefetched gather: its host -> device copy starts now, beside compute
        self._flush_staging(block=False)
        for x in self._pending_rs:
            if self._bwd_open and not isinstance(x.req, Ticket):
                self._bwd_tests += 1
            x.test()
        self._drain(None)

    # ------------------------------------------------------------------ gradients (stages 2-3)
    def _open_backward(self) -> None:
        if self._bwd_open:
            return
        self._bwd_open = True
        self._fresh_accumulation()
        self._rs_next = len(self.buckets) - 1
        if self.stage == 3:
            self._bwd_next = len(self.buckets) - 1
            while self._bwd_next >= 0 and self.buckets[self._bwd_next].full is not None:
                self._bwd_next -= 1  # kept from forward
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _on_grad(self, p: torch.Tensor) -> None:
        self._synced = False
        self._open_backward()
        bi, i = self._index_of[id(p)]
        b = self.buckets[bi]
        b.had[i] = True
        b.ready += 1
        if self.stage == 3:
            # The gradients stay in ``.grad`` until the bucket's last one arrives; then the gathered bucket is
            # freed *before* its flat gradient is allocated, so a bucket's parameters, its flat gradient and a
            # parameter's fresh gradient are never alive together (the peak of a stage-3 backward otherwise).
            if b.ready == len(b.params):
                self._free(b)
                self._post_ready()
            self._progress()
            return
        if b.grad is None:
            # No wait for earlier reduce-scatters here: a peer may post them only at the end of its backward
            # (a parameter it never used), after gathers this rank would not reach while blocked (issue 26).
            # Completed ones are consumed first, so their buffers are gone before this one is allocated.
            self._progress()
            b.grad = torch.zeros(b.padded, dtype=self.master_dtype, device=self.device)
        off = b.offsets[i]
        b.grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        if b.ready == len(b.params):
            self._post_ready()
        self._progress()

    def _flat_grad(self, b: _Bucket) -> torch.Tensor:
        """The bucket's padded flat gradient: stage 2's, filled as the gradients arrived; stage 3's built now
        from the parameters' ``.grad`` (a missing one counts as zeros), which are dropped."""
        grad, b.grad = b.grad, None
        if grad is None:
            self._progress()  # consume completed reduce-scatters first: their buffers go before this one comes
            grad = torch.zeros(b.padded, dtype=self.master_dtype, device=self.device)
        if self.stage == 3:
            for p, off in zip(b.params, b.offsets):
                if p.grad is not None:
                    grad[off:off + p.numel()].copy_(p.grad.reshape(-1))
                    p.grad = None
        return grad

    def _post_rs(self, b: _Bucket, in_hook: bool = False) -> None:
        grad = self._flat_grad(b)
        if self.grad_codec is not None:
            if self.grad_codec.wire_bytes(b.shard, grad.dtype) is None:
                self._deferred.append((b, grad))  # a blocking collective: after backward (sync_grads)
                b.posted = True
                return
            req = self._compressed_rs(b, grad, in_hook)
        elif self._staged:
            self._queue_rs(b.index, grad, in_hook, lambda h: self._post(lambda: self._rs.ireduce_scatter(h)))
            req = None
        else:
            req = self._post(lambda: self._rs.ireduce_scatter(grad))
        if req is not None:
            self._track(_RS(b.index, req, in_hook))
        b.posted = True

    def _post_ready(self) -> None:
        while self._rs_next >= 0:
            b = self.buckets[self._rs_next]
            if b.ready < len(b.params):
                return
            self._post_rs(b, in_hook=True)
            self._rs_next -= 1

    def _backward_end(self) -> None:
        """End of one ``backward()`` (an autograd engine callback): post what is left (missing gradients are
        zeros), close the gathers, then wait for this backward's reductions (:meth:`sync_grads`), unless inside
        :meth:`no_sync`. Every rank has posted all its gathers and reduce-scatters of this backward by now, so
        the wait cannot hold up a peer's backward."""
        if self.stage >= 2:
            if not self._at_bwd_end:
                self._at_bwd_end = self.live
            while self._rs_next >= 0:
                self._post_rs(self.buckets[self._rs_next])
                self._rs_next -= 1
            if self.stage == 3:
                while self._bwd_next >= 0:  # same gathers on every rank, even where a bucket was not needed
                    self._post_gather(self.buckets[self._bwd_next])
                    self._bwd_next -= 1
                for b in self.buckets:
                    self._free(b)
            for b in self.buckets:
                b.ready = 0
                b.posted = False
        self._bwd_open = False
        if self._no_sync:
            self._unreduced += 1
        else:
            self.sync_grads()

    # ------------------------------------------------------------------ parameters (stage 3)
    def _post_gather(self, b: _Bucket) -> None:
        if b.full is not None:
            return
        src = self._master(b).to(self.compute_dtype) if not self._staged or self.param_codec else None
        if self.param_codec is not None:
            from ...compress import allgather

            b.full = allgather(src, self._ag, self.param_codec, min_bytes=0).to(self.compute_dtype)
            b.req = Request.completed(b.full, what="compressed gather")
        elif self._staged:  # from the host mirror into a host buffer; copied to the device when it lands
            self._fresh_mirror(b)
            b.host = _b.host_empty((b.padded,), self.compute_dtype, self.device)
            b.full = _b.side_empty((b.padded,), self.compute_dtype, self.device)
            b.req = self._ag.iallgather(self._mirror[b.index], out=b.host)
        else:
            b.full = torch.empty(b.padded, dtype=self.compute_dtype, device=self.device)
            b.req = self._ag.iallgather(src, out=b.full)
        _stats.add("time", "zero", gathers=1)

    def _land(self, b: _Bucket) -> None:
        """A gather completed: on the staged path its host -> device copy is queued on the side stream (into a
        buffer allocated there), and the compute stream waits for it only where the bucket is bound."""
        b.req = None
        if b.host is not None:
            b.ev = _b.stage_in(b.host, b.full, fresh=True)
            b.host = None

    def _ensure(self, b: _Bucket) -> None:
        if b.req is not None:
            if not b.req.test():
                _stats.add("time", "zero", gather_waits=1)
            _wait(b.req)
            self._land(b)
        if b.full is not None and not b.bound:
            _b.use_after(b.ev, b.full)
            b.ev = None
            self._bind(b)
            self._live[b.full.untyped_storage().data_ptr()] = b.index

    def _free(self, b: _Bucket) -> None:
        if b.full is None:
            return
        if b.req is not None:
            _wait(b.req)
            b.req = None
        b.host = b.ev = None
        b.bound = False
        for p, name in zip(b.params, b.names):
            p.data = self._placeholders[id(p)]
            p._loom_freed = _freed_message(name)
        self._live.pop(b.full.untyped_storage().data_ptr(), None)
        b.full = None

    def _need_forward(self, i: int) -> None:
        b = self.buckets[i]
        if b.full is None:
            if i >= self._fwd_next:
                while self._fwd_next <= i:  # every rank posts the buckets in order
                    self._post_gather(self.buckets[self._fwd_next])
                    self._fwd_next += 1
            else:
                self._post_gather(b)  # a module run again after its bucket was freed
        self._ensure(b)
        if self._fwd_next == i + 1 and self._fwd_next < len(self.buckets):
            self._post_gather(self.buckets[self._fwd_next])  # prefetch
            self._fwd_next += 1

    def _need_backward(self, i: int) -> None:
        self._open_backward()
        b = self.buckets[i]
        if b.full is None:
            if i <= self._bwd_next:
                while self._bwd_next >= i:
                    self._post_gather(self.buckets[self._bwd_next])
                    self._bwd_next -= 1
            else:
                self._post_gather(b)
        self._ensure(b)
        if self._bwd_next == i - 1 and self._bwd_next >= 0:
            self._progress()  # reduce-scatters completed by now free their buffers before the prefetch allocates
            self._post_gather(self.buckets[self._bwd_next])  # prefetch
            self._bwd_next -= 1
        self._progress()

    def _pre_hook(self, bs: list[int]):
        def hook(module, args):
            if _in_backward():  # recomputed in backward: gathered as backward gathers
                for i in bs:
                    self._need_backward(i)
                return
            for i in bs:
                self._need_forward(i)
            self._progress()
        return hook

    def _post_hook(self, bs: list[int]):
        def hook(module, args, out):
            if _in_backward():  # the recomputed graph still reads the parameters: freed with their gradients
                return
            for i in bs:
                self._fwd_ran[i] += 1
                if (self._fwd_ran[i] >= self.buckets[i].owners and i != len(self.buckets) - 1
                        and i not in self._keep):
                    self._free(self.buckets[i])
            self._progress()
        return hook

    def _forward_end(self) -> None:
        while self._fwd_next < len(self.buckets):  # buckets no module used: keep the gather order equal
            self._post_gather(self.buckets[self._fwd_next])
            self._fwd_next += 1
        # The last bucket is the first one backward needs: keep it rather than gather it again.
        keep = {len(self.buckets) - 1, *self._keep} if torch.is_grad_enabled() else ()
        for b in self.buckets:
            if b.index in keep:
                self._ensure(b)
            else:
                self._free(b)

    def _pack(self, t: torch.Tensor):
        ref = self._index_of.get(id(t))
        if ref is not None:
            # The parameter itself, its bucket gathered on unpack: backward code that reads a saved parameter
            # without calling its module (a recomputed chunk) sees its values even if it was saved freed.
            return ("param", ref[0], t)
        if self._live and t.layout == torch.strided:
            i = self._live.get(t.untyped_storage().data_ptr())
            if i is not None:
                return (i, t.size(), t.stride(), t.storage_offset())
        return t

    def _unpack(self, saved):
        if isinstance(saved, torch.Tensor):
            return saved
        if saved[0] == "param":
            self._need_backward(saved[1])  # binds the parameter to its gathered bucket
            return saved[2]
        i, size, stride, offset = saved
        self._need_backward(i)
        return self.buckets[i].full.as_strided(size, stride, offset)

    # ------------------------------------------------------------------ full state
    def _full_values(self) -> dict[int, torch.Tensor]:
        """id(parameter) -> its full value in the master dtype, gathered from the shards (collective)."""
        out: dict[int, torch.Tensor] = {}
        for b in self.buckets:
            if self.stage == 0:
                full = torch.cat([p.detach().reshape(-1) for p in b.params])
            else:
                full = self.comm.allgather(self._master(b).clone())
            for p, off in zip(b.params, b.offsets):
                out[id(p)] = full[off:off + p.numel()].view(p.shape).clone()
        return out

    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """The unsharded module's ``state_dict()`` (same keys, full values), on every rank (collective at stages
        1-3, where the buffers are also synchronized from rank 0 first; local at stage 0, as DDP's)."""
        if self.stage:
            self.sync_buffers()
        values = self._full_values()
        with self._as_internal():
            sd = self.module.state_dict()
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in values:
                sd[name] = values[id(p)]
        return sd

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load an unsharded ``state_dict`` (as :meth:`state_dict` returns): each rank keeps its blocks."""
        owned = {}
        for name, p in self.module.named_parameters(remove_duplicate=False):
            if id(p) in self._index_of or self.stage == 0 and p.requires_grad:
                owned[name] = p
        missing = [n for n in owned if n not in state_dict]
        if missing:
            raise ValueError(f"load_state_dict: the state has no entry for {missing[:5]} (it must come from "
                             f"the same model: its keys are module.state_dict()'s)")
        rest = {k: v for k, v in state_dict.items() if k not in owned}
        with self._as_internal():
            result = self.module.load_state_dict(rest, strict=False)
        if strict and result.unexpected_keys:
            raise ValueError(f"load_state_dict: unexpected keys {result.unexpected_keys[:5]}")
        with torch.no_grad():
            if self.stage == 0:
                for n, p in owned.items():
                    p.copy_(state_dict[n])
                return result
            names = {id(p): n for n, p in owned.items()}
            r = self.comm.rank
            self._stale_mirror()
            for b in self.buckets:
                full = self._padded_flat(b, [state_dict[names[id(p)]] for p in b.params], self.master_dtype)
                self._master(b).copy_(full[r * b.shard:(r + 1) * b.shard])
                if self.stage < 3:
                    b.full.copy_(full)
        return result

    @contextlib.contextmanager
    def _as_internal(self) -> Iterator[None]:
        """This wrapper calls the module's ``state_dict`` / ``load_state_dict`` itself (not refused)."""
        old, self._internal = self._internal, True
        try:
            yield
        finally:
            self._internal = old

    # ------------------------------------------------------------------ sharded checkpoints
    def save_sharded(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                     extra: dict[str, Any] | None = None) -> None:
        """Write one file per rank (its master block, optimizer state, ``extra``) plus ``manifest.json``.

        Every file is written to a temporary name and renamed; rank 0 writes the manifest last, after every
        rank's file is in place, so a directory with a manifest is complete. Collective over the group.
        """
        if self.stage == 0:
            raise ValueError("save_sharded needs stage >= 1 (stage 0 holds no shards); save state_dict() instead")
        d = Path(path)
        d.mkdir(parents=True, exist_ok=True)
        r, size = self.comm.rank, self.comm.size
        with self._as_internal():
            replicated = {k: v for k, v in self.module.state_dict().items() if k not in self._trainable_names()}
        blob = {"flat": self.flat_shard(), "optim": optimizer.state_dict() if optimizer else None,
                "optim_buckets": self._optim_order(optimizer) if optimizer else None, "extra": extra,
                "replicated": replicated if r == 0 else None, "error_feedback": self._ef_state()}
        _atomic_save(blob, d / _shard_name(r, size))
        self.comm.barrier()
        if r == 0:
            manifest = {"format": "loom-zero/1", "world": size, "stage": self.stage,
                        "dtype": str(self.master_dtype), "buckets": [b.layout() for b in self.buckets],
                        "files": [_shard_name(q, size) for q in range(size)]}
            tmp = d / (MANIFEST + ".tmp")
            tmp.write_text(json.dumps(manifest, indent=1))
            os.replace(tmp, d / MANIFEST)
        self.comm.barrier()

    def _trainable_names(self) -> set[str]:
        return {n for n, p in self.module.named_parameters(remove_duplicate=False) if id(p) in self._index_of}

    def load_sharded(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Load a :meth:`save_sharded` directory written at any group size; returns the saved ``extra``."""
        if self.stage == 0:
            raise ValueError("load_sharded needs stage >= 1; load a state_dict() instead")
        d = Path(path)
        if not (d / MANIFEST).exists():
            raise ValueError(f"{d} has no {MANIFEST}: not a complete sharded checkpoint")
        man = json.loads((d / MANIFEST).read_text())
        mine = [b.layout() for b in self.buckets]
        if man["buckets"] != mine:
            raise ValueError(f"{d}: the checkpoint's buckets differ from this model's (another model, or another "
                             f"bucket_mb): {len(man['buckets'])} buckets saved, {len(mine)} here")
        old = _OldShards(d, man)
        self._stale_mirror()
        with torch.no_grad():
            for b, lay in zip(self.buckets, old.layouts):
                self._master(b).copy_(self._reshard(old, b, lambda q, lay=lay: _block(old.get(q)["flat"], lay)))
        if old.get(0)["replicated"]:
            with self._as_internal():
                self.module.load_state_dict(old.get(0)["replicated"], strict=False)
        if self.stage < 3:
            with torch.no_grad():
                for b in self.buckets:
                    b.full.copy_(self.comm.allgather(self._master(b).to(self.compute_dtype)))
        if optimizer is not None:
            optimizer.load_state_dict(self._reshard_optim(old, optimizer))
        if self.error_feedback is not None:
            self.error_feedback.reset()
            saved = old.get(self.comm.rank)["error_feedback"] if old.world == self.comm.size else None
            for k, res in (saved or {}).items():
                self.error_feedback.set(k, res.clone())
        return old.get(self.comm.rank % old.world)["extra"]

    def _reshard(self, old: "_OldShards", b: _Bucket, block: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """This rank's block of bucket ``b``, assembled from the blocks saved at any group size
        (``block(q)``: old rank ``q``'s block of ``b``); padding stays zero."""
        lay = old.layouts[b.index]
        r = self.comm.rank
        out = torch.zeros(b.shard, dtype=self.master_dtype, device=self.device)
        lo, hi = r * b.shard, min((r + 1) * b.shard, b.numel)
        pos = lo
        while pos < hi:
            q = pos // lay["shard"]
            end = min(hi, (q + 1) * lay["shard"])
            a = pos - q * lay["shard"]
            out[pos - lo:end - lo].copy_(block(q)[a:a + end - pos])
            pos = end
        return out

    def _optim_order(self, optimizer: torch.optim.Optimizer) -> list[int]:
        """The bucket of each parameter of ``optimizer``, in its state-dict order (groups in order)."""
        where = {id(sh): i for i, sh in enumerate(self.shards)}
        order = []
        for g in optimizer.param_groups:
            for p in g["params"]:
                if id(p) not in where:
                    raise ValueError(f"the optimizer steps a tensor of shape {tuple(p.shape)} that is not one of "
                                     f"this ShardedDataParallel's shards; build it over sdp.optim_groups() or "
                                     f"sdp.parameters()")
                order.append(where[id(p)])
        return order

    def _reshard_optim(self, old: "_OldShards", optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """The optimizer state of the saved run, resharded to this group and keyed by bucket (each optimizer
        position's parameter), so groups may list the shards in another order than the buckets'."""
        saved = old.get(0)
        base = saved["optim"]
        if base is None:
            raise ValueError("load_sharded: the checkpoint has no optimizer state (saved without optimizer=)")
        old_order = saved.get("optim_buckets") or list(range(len(old.layouts)))  # older files: bucket order
        old_pos = {j: k for k, j in enumerate(old_order)}
        mine = optimizer.state_dict()["param_groups"]
        if len(mine) != len(base["param_groups"]):
            raise ValueError(f"load_sharded: the checkpoint's optimizer has {len(base['param_groups'])} parameter "
                             f"groups, this one {len(mine)}; build it over sdp.optim_groups() with the same groups")
        state = {}
        for pos, j in enumerate(self._optim_order(optimizer)):
            k = old_pos.get(j)
            st = base["state"].get(k) if k is not None else None
            if not st:
                continue
            lay = old.layouts[j]
            state[pos] = {}
            for name, v in st.items():
                if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == lay["shard"]:
                    state[pos][name] = self._reshard(old, self.buckets[j], _optim_block(old, k, name))
                else:
                    state[pos][name] = v
        groups = [{**g, "params": m["params"]} for g, m in zip(base["param_groups"], mine)]
        return {"state": state, "param_groups": groups}
