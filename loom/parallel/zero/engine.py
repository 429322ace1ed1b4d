"""The :class:`ShardedDataParallel` wrapper: construction, the public API, and the backward's start and end.

The wrapper lays the trainable parameters out in buckets (:mod:`loom.parallel.zero.buckets`), keeps this rank's
block of each as a flat master shard, and runs one training step's collectives from hooks: parameter gathers
(:mod:`loom.parallel.zero.gather`), gradient reduce-scatters (:mod:`loom.parallel.zero.reduce`), both staged
through the host where the MPI cannot read the device (:mod:`loom.parallel.zero.staging`). This module holds
the plan that ties them together: construction, the forward context, the backward's start and end, the step.

Plan per stage (one training step: forward, ``loss.backward()`` one or more times, :meth:`~ShardedDataParallel.step`):

* stage 0: plain data parallelism (:class:`loom.parallel.data.GradReducer`: bucketed ``iallreduce``).
* stage 1: full gradients accumulate in ``.grad`` as usual; :meth:`~ShardedDataParallel.sync_grads` flattens
  each bucket and posts one ``ireduce_scatter`` per bucket (all posted, then waited), adding this rank's block
  into the block's gradient. After the optimizer, each bucket's updated block is ``allgather``-ed in place into
  the bucket's full buffer, which the module's parameters are views of.
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

Every rank of the group must run the same modules in the same order at stage 3 (as torch FSDP requires).

Training loops: :meth:`~ShardedDataParallel.step` (reduce, clip, update, gather), or the plain
``loss.backward(); [torch.nn.utils.clip_grad_norm_(sdp.parameters(), c);] opt.step()``: the gradients are
complete when ``backward()`` returns (its end callback waits for the reductions), several ``backward()`` calls
accumulate as under DDP (:meth:`~ShardedDataParallel.no_sync` defers the wait), a norm of a shard's gradient is
the bucket's over the group (:class:`loom.parallel.zero.norms._ShardGrad`), and torch's global optimizer step
hooks gather the updated blocks (stages 1-2) after an optimizer over this wrapper's shards steps. The wrapped
module's own habits (its forward, ``zero_grad``, ``state_dict``, ``load_state_dict``, an optimizer over its
parameters) answer as the wrapper or raise naming the fix (:class:`loom.parallel.zero.habits.ModuleHabits`; the
table in ``tests/mpi/check_zero_habits.py``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ...comm import Communicator, Mesh
from ..data import GradReducer, check_progress, default_progress, stages_through_host
from ..meta import Init
from .buckets import _Bucket, _flat_block, _make_buckets, _MetaSource, _parse_groups
from .gather import ParamGathers
from .habits import ModuleHabits, _unwatch_steps, _watch_steps
from .params import _refuse_compile, _ShardedParameter
from .reduce import GradReduction, compression
from .replicas import Replicas
from .staging import ParamMirror
from .state import gather_state_dict, load_shards, save_shards, scatter_state_dict

__all__ = ["ShardedDataParallel"]


def _group(group: Communicator | Mesh, axes: str | Sequence[str] | None) -> Communicator:
    """The communicator to shard over: the mesh's ``axes`` (default ``["dp"]``), or the communicator itself."""
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


def _check_args(module, stage, bucket_mb, reduce, micro_batches, missing_grad, progress) -> None:
    """The constructor's arguments, each refused by name before anything is allocated or sent."""
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
    check_progress(progress)
    if missing_grad not in ("zero", "skip"):
        raise ValueError(f"missing_grad={missing_grad!r} must be 'zero' (a parameter without a gradient counts "
                         f"as a zero gradient) or 'skip' (a bucket no rank produced a gradient for is skipped "
                         f"by the optimizer, as torch skips a parameter whose .grad is None)")


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
        _check_args(module, stage, bucket_mb, reduce, micro_batches, missing_grad, progress)
        self._group_opts, group_of = _parse_groups(module, groups)  # by name: a meta build installs new tensors
        self.module, self.stage, self.comm = module, stage, _group(group, axes)
        self.missing_grad, self.micro_batches, self.broadcast_buffers = missing_grad, micro_batches, broadcast_buffers
        self.scale = 1.0 / self.comm.size if reduce == "avg" else 1.0
        trainable = self._lay_out(bucket_mb, group_of, compute_dtype, init, device)
        self._step_state(progress)
        if stage == 0:
            self._wire_stage0(trainable, compute_dtype, bucket_mb, progress)
        else:
            self._wire_sharded(compress, param_codec, keep)
        self._habits.install()

    # ------------------------------------------------------------------ construction
    def _lay_out(self, bucket_mb: float, group_of: dict[str, int], compute_dtype: torch.dtype | None,
                 init: Init | None, device: Any) -> list[nn.Parameter]:
        """The replicated state broadcast from rank 0, the trainable parameters (materialised from meta, below
        stage 3) laid out in buckets, and where and in which dtypes they live; returns the trainable parameters."""
        module, comm = self.module, self.comm
        self._replicas = Replicas(module, comm)
        self._source = _MetaSource.open(module, init, self.stage, torch.device(device or "cpu"))
        self._replicas.broadcast()
        # missing_grad="skip": a bucket holds one module's direct parameters (used or unused together), so
        # that the optimizer can skip it whole, as torch skips each parameter without a gradient.
        self.buckets, self._owners = _make_buckets(module, comm.size, int(bucket_mb * (1 << 20)), group_of,
                                                   per_module=self.missing_grad == "skip" and self.stage >= 1)
        trainable = [p for b in self.buckets for p in b.params]
        self.master_dtype = trainable[0].dtype if trainable else torch.float32
        # Buckets, shards, placeholders, gradients and (through the shards) the optimizer state live where the
        # parameters live; loom.comm stages device buffers through the host unless the MPI is CUDA-aware.
        self.device = next((p.device for p in trainable if not p.is_meta), torch.device(device or "cpu"))
        self.compute_dtype = compute_dtype or self.master_dtype
        self._staged = stages_through_host(self.device)
        return trainable

    def _step_state(self, progress: str) -> None:
        """What one training step moves through: the backward's flags, the forward's depth, the progress mode."""
        # How posted reduce-scatters move during backward (loom.parallel.zero.reduce); nothing travels on one rank.
        self.progress = default_progress() if progress == "auto" else progress
        if self.comm.size == 1:
            self.progress = "hooks"
        self._hooks: list[Any] = []
        self._bwd_open = False  # a backward() is running (its end callback is queued)
        self._no_sync = False  # inside no_sync(): backward() accumulates, the reduction waits for a later one
        self._unreduced = 0  # backward() calls whose gradients are not reduced yet (no_sync, micro_batches)
        self._depth = 0  # forward contexts entered (the root module's hooks enter one unless inside one)
        self._index_of: dict[int, tuple[int, int]] = {}
        self._inner_ids: set[int] = set()  # stages 1-3: the wrapped module's trainable parameters (not stepped)
        self._habits = ModuleHabits(self)

    def _wire_stage0(self, trainable: list[nn.Parameter], compute_dtype: torch.dtype | None, bucket_mb: float,
                     progress: str) -> None:
        """Stage 0: rank 0's parameters on every rank, and data parallelism's reducer armed from a hook."""
        if compute_dtype not in (None, self.master_dtype):
            raise ValueError("compute_dtype needs stage >= 1 (the fp32 master copy lives in the shard)")
        self._reduce = GradReduction(self, None)  # its accounting only: the reducer reduces
        self._replicas.bcast(trainable)  # every rank starts from rank 0's parameters (stages 1-3: per bucket)
        # Registered before the reducer's hooks: the first gradient of a backward arms the reducer for it.
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_grad0) for p in trainable]
        self.reducer = GradReducer(trainable, self.comm, bucket_mb=bucket_mb, progress=progress)
        for p in trainable:  # a missing gradient counts as zero, as in the flat shard of stages 1-3
            p.grad = torch.zeros_like(p)
        _watch_steps(self, trainable)

    def _wire_sharded(self, compress: Any, param_codec: str | None, keep: Sequence[nn.Module]) -> None:
        """Stages 1-3: the shards, the helpers that gather and reduce them, and the hooks that drive those."""
        comm = self.comm
        if self.compute_dtype != self.master_dtype:
            with torch.no_grad():
                for p in self.module.parameters():
                    if not p.requires_grad and p.is_floating_point():
                        p.data = p.data.to(self.compute_dtype)
        self.grad_codec, self.param_codec, self.error_feedback = compression(compress, param_codec, self.stage)
        self._gathers = ParamGathers(self, comm.dup(name=comm.name))  # parameter gathers, in their own order
        self._reduce = GradReduction(self, comm.dup(name=comm.name))  # gradient reduce-scatters, in theirs
        self._init_shards()
        self._mirror = ParamMirror(self.buckets, self.shards, self.compute_dtype, self.device)
        trainable = [p for b in self.buckets for p in b.params]  # a meta model's were replaced by real ones
        self._inner_ids = {id(p) for p in trainable}
        self._synced = False  # this step's gradients are reduced into the shards (sync_grads ran)
        self._stepped = False  # the optimizer step hook refreshed the parameters
        on_grad = self._on_grad if self.stage >= 2 else self._on_grad1
        self._hooks += [p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
        _watch_steps(self, list(self.shards))
        self._index_of = {id(q): (b.index, i) for b in self.buckets for i, q in enumerate(b.params)}
        if self.stage == 3:
            for m, bs in self._owners.items():
                self._hooks.append(m.register_forward_pre_hook(self._gathers.pre_hook(bs)))
                self._hooks.append(m.register_forward_hook(self._gathers.post_hook(bs)))
            self._gathers.keep = sorted({self._index_of[id(p)][0] for m in keep for p in m.parameters()
                                         if id(p) in self._index_of})

    @torch.compiler.disable  # collectives: run as they are, never traced into a graph (torch.compile at 0-2)
    def sync_buffers(self, force: bool = False) -> None:
        """Rank 0's buffers on every rank (DDP's ``broadcast_buffers``): run at the start and the end of every
        forward, so that a buffer a forward updates (BatchNorm's running statistics) is the same on every rank
        between forwards, as is what each forward reads. A buffer is sent only when some rank's changed since
        the last sync (one small allreduce finds out; ``force``: always). Collective over the group."""
        if self.broadcast_buffers:
            self._replicas.sync_buffers(force)

    def _init_shards(self) -> None:
        """This rank's master block of every bucket (``shards``); stage 3 turns the parameters into placeholders,
        stages 1-2 bind them to the bucket's full buffer."""
        r = self.comm.rank
        total = 0
        for b in self.buckets:
            b.start = total
            total += b.shard
        self.shards = nn.ParameterList([nn.Parameter(torch.zeros(b.shard, dtype=self.master_dtype, device=self.device))
                                        for b in self.buckets])
        with torch.no_grad():
            for b in self.buckets:
                if self._source is not None:  # stage 3 on meta: this bucket only, then this rank's block of it
                    self._source.take(b.names)
                    b.params = [self.module.get_parameter(n) for n in b.names]  # materialize installs new ones
                    _flat_block(b.params, b.params, r * b.shard, b.shard, self.master_dtype, out=self._master(b))
                else:
                    full = b.flat([p.detach() for p in b.params], self.master_dtype, self.device)
                    self.comm.bcast(full, root=0)
                    self._master(b).copy_(full[r * b.shard:(r + 1) * b.shard])
                if self.stage == 3:
                    self._gathers.shard_params(b)
                else:
                    b.full = full.to(self.compute_dtype)
                    self._gathers.bind(b)
        if self._source is not None:
            self._source.finish()
            self._source = None

    def _master(self, b: _Bucket) -> torch.Tensor:
        return self.shards[b.index].data

    def flat_shard(self) -> torch.Tensor:
        """This rank's master blocks laid end to end (a copy)."""
        if not len(self.shards):
            return torch.zeros(0, device=self.device)
        return torch.cat([sh.detach() for sh in self.shards])

    def _zero_shard_grads(self, set_to_none: bool) -> None:
        for sh in self.shards:
            if set_to_none or sh.grad is None:
                sh.grad = None
            else:
                sh.grad.zero_()

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
                self._gathers.forward_start()
                with torch.autograd.graph.saved_tensors_hooks(self._gathers.pack, self._gathers.unpack):
                    yield
                self._gathers.forward_end()
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
            self._reduce.post_stage1()
        self._reduce.finish()

    @property
    def last(self) -> dict[str, float]:
        """The last step's reduce-scatter accounting: seconds blocked in :meth:`sync_grads` (``exposed_s``),
        seconds hidden behind backward (``overlapped_s``), and the mechanism counts."""
        return self._reduce.last

    @property
    def live(self) -> dict[str, int]:
        """This step's reduce-scatters so far (mechanism counts, no timing): posted from gradient hooks, tests
        of outstanding ones during backward (hooks or progress thread), and the first posted one's tests and
        whether it was seen complete."""
        return self._reduce.live

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

    def remove(self) -> None:
        """Take the hooks off the module (it keeps its current, possibly placeholder, parameters). Reductions
        still in flight (under :meth:`no_sync`, or a loop abandoned by an exception) are waited for first:
        MPI still reads and writes their buffers. Collective when any are."""
        if self.stage:
            self._reduce.wait_all()
        for h in self._hooks:
            h.remove()
        self._hooks = []
        _unwatch_steps(self)
        self._habits.remove()
        if self.stage == 0:
            self.reducer.remove()
        else:
            self._reduce.close()
        for b in self.buckets:
            for p in b.params:
                if type(p) is _ShardedParameter:
                    p.__class__ = nn.Parameter

    # ------------------------------------------------------------------ state
    def state_dict(self, *args, **kwargs) -> dict[str, Any]:
        """The unsharded module's ``state_dict()`` (same keys, full values), on every rank (collective at stages
        1-3, where the buffers are also synchronized from rank 0 first; local at stage 0, as DDP's)."""
        return gather_state_dict(self)

    def load_state_dict(self, state_dict: dict[str, Any], strict: bool = True, assign: bool = False):
        """Load an unsharded ``state_dict`` (as :meth:`state_dict` returns): each rank keeps its blocks."""
        return scatter_state_dict(self, state_dict, strict)

    def save_sharded(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None,
                     extra: dict[str, Any] | None = None) -> None:
        """Write one file per rank (its master block, optimizer state, ``extra``) plus ``manifest.json``.

        Every file is written to a temporary name and renamed; rank 0 writes the manifest last, after every
        rank's file is in place, so a directory with a manifest is complete. Collective over the group.
        """
        save_shards(self, path, optimizer, extra)

    def load_sharded(self, path: str | os.PathLike, optimizer: torch.optim.Optimizer | None = None) -> Any:
        """Load a :meth:`save_sharded` directory written at any group size; returns the saved ``extra``."""
        return load_shards(self, path, optimizer)

    # ------------------------------------------------------------------ one step: hooks and callbacks
    def _progress(self) -> None:
        """Test every outstanding request once: MPICH moves a non-blocking collective only when tested."""
        self._gathers.test()
        self._reduce.test()

    def _before_step(self) -> None:
        """The optimizer is about to step on this rank's shards: finish the reduction it needs."""
        self.sync_grads()

    def _after_step(self) -> None:
        """The optimizer stepped: stages 1-2 gather the updated blocks into the module's parameters; stage 0
        arms the reducer for the next step's backward."""
        self._stepped = True
        if self.stage:
            # The host mirror is copied again after every step: a fused optimizer or one writing through ``.data``
            # updates the shards without moving their version counters, and the gathers would read the old weights.
            self._mirror.stale()
        if self.stage in (1, 2):
            self._gathers.gather_all()

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
            self._reduce.fresh_accumulation()
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_end)

    def _open_backward(self) -> None:
        if self._bwd_open:
            return
        self._bwd_open = True
        self._reduce.fresh_accumulation()
        self._reduce.next = len(self.buckets) - 1
        if self.stage == 3:
            self._gathers.backward_start()
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
                self._gathers.free(b)
                self._reduce.post_ready()
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
            self._reduce.post_ready()
        self._progress()

    def _backward_end(self) -> None:
        """End of one ``backward()`` (an autograd engine callback): post what is left (missing gradients are
        zeros), close the gathers, then wait for this backward's reductions (:meth:`sync_grads`), unless inside
        :meth:`no_sync`. Every rank has posted all its gathers and reduce-scatters of this backward by now, so
        the wait cannot hold up a peer's backward."""
        if self.stage >= 2:
            self._reduce.post_rest()
            if self.stage == 3:
                self._gathers.backward_end()
            for b in self.buckets:
                b.ready = 0
                b.posted = False
        self._bwd_open = False
        if self._no_sync:
            self._unreduced += 1
        else:
            self.sync_grads()
