"""The ``"loom"`` process group: torch.distributed's collectives over loom.comm's communicators.

Groups: torch calls :func:`create_process_group` for the default group (``global_ranks_in_group`` empty: a new
duplicate of COMM_WORLD named ``"torch"`` in torch's rank order, so torch's traffic never meets loom's own and a
timed-out group leaves nothing pending on the next; COMM_WORLD is the launcher's, or the one
:mod:`loom.torchdist.rendezvous` formed through torch's store) and for each sub-group (``new_group``,
``init_device_mesh``'s dimensions, FSDP2's and DTensor's groups), on the member ranks only: those ranks make
an MPI communicator of exactly them (:meth:`loom.comm.Communicator.group`). Every group's communicator gets the
group's timeout (:meth:`loom.comm.Communicator.set_timeout`). torch then sets the group's name and description
(``setGroupName``/``setGroupDesc``); the description (``mesh_dp``, ...) becomes the communicator's name in
``loom.stats``.

Plan of an operation (every one runs on the caller's thread, in the caller's order, which is the same on
every rank; so collectives on one communicator are posted in the same order everywhere):

* results land where torch expects them: in place for ``all_reduce``/``broadcast``, in the output tensors
  for the gathers, scatters and all-to-alls, non-contiguous tensors through a contiguous copy;
* asynchronous calls (``async_op=True``, and every call from torch's C++: DDP's reducer, the functional
  collectives of DTensor and FSDP2) of at least :data:`ASYNC_MIN_BYTES` (allreduce, allgather,
  reduce-scatter, all-to-all), and every send and recv, are posted non-blocking and handed to one progress
  thread per process (:class:`loom.comm.ProgressThread`), which tests them while the caller computes (MPICH
  moves a posted collective only inside an MPI call) and completes the work's future when they are done, the
  copy into the caller's tensors included: ``async_op=True`` overlaps, and DDP's reducer, which only chains
  on futures, gets its buckets reduced during backward. Blocking calls, small payloads and the rooted
  operations (broadcast, gather, scatter, reduce, barrier) run on the caller's thread (each MPI call as its
  non-blocking twin tested until done or the group's timeout: :mod:`loom.comm.deadline`) and return completed
  work: a 1-byte allreduce costs one MPI call and its tests;
* an allreduce that loom.comm runs as its block exchange (:meth:`~loom.comm.Communicator.pairwise`: at least
  ``LOOM_PAIRWISE_BYTES``) runs on the caller's thread even when asked asynchronously, and its work is
  complete when returned: DDP's 25 MiB buckets are reduced during backward as before, without MPICH's
  non-blocking reduction loop, which is slower at that size (`loom bench torch`'s DDP row);
* reductions: ``SUM``, ``AVG`` (floating dtypes), ``MIN``, ``MAX``, ``PRODUCT`` and ``PREMUL_SUM`` (scaled,
  then summed); bf16/fp16 are reduced in float32 and rounded once (loom.comm); ``bool`` reduces as
  logical or (``SUM``, ``MAX``) or and (``MIN``, ``PRODUCT``); a sparse COO tensor is summed as gloo sums it
  (indices and values gathered, added in rank order, coalesced); ``BAND``/``BOR``/``BXOR`` raise
  ``NotImplementedError``;
* gather, scatter and the point-to-point legs of rooted operations travel on the group's private duplicate
  (``comm.sub("rooted")``), so they never match the user's ``send``/``recv`` on the same tags.

Compression (:func:`set_compression`, ``LOOM_TORCH_COMPRESS``): a codec per group, keyed by DeviceMesh dim
name, applied by :func:`loom.compress.allreduce` to that group's floating SUM/AVG allreduces and by
:func:`loom.compress.reduce_scatter` to its floating SUM/AVG reduce-scatters (FSDP2's gradient reduction)
outside :func:`exact`; all-gathers, all-to-alls and the rooted operations stay uncompressed.

Multi-path all-to-all (:func:`set_multipath`, ``LOOM_TORCH_MULTIPATH``): a topology per group, keyed alike, in
the vocabulary of loom's own MoE routing (``auto``, a preset, a TOML file); under one of several nodes and
rails the group's ``all_to_all_single`` (MoE dispatch and combine) runs :func:`loom.multipath.alltoallv`.

Work objects (:mod:`loom.torchdist.work`): an operation past its group's timeout raises ``DistBackendError``
naming the operation, the group and the timeout, and the group refuses further work; ``wait(timeout)`` honours a
shorter ``timedelta`` or seconds as torch's works do, the operation staying posted for a later ``wait``.

Check mode (``LOOM_CHECK=1``) and the watchdog (``LOOM_TIMEOUT``, which aborts the job) are loom.comm's: every
collective here is a Communicator method, so a shape or dtype mismatch across ranks raises on every rank
instead of hanging.
"""

from __future__ import annotations

import functools
import math
import sys
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from loom.comm import ANY_SOURCE, Backoff, CommError, CommTimeoutError, Communicator, wait_all, world

from . import rendezvous
from .policy import compression_for, exact, exact_depth, route_for, set_compression, set_multipath
from .rendezvous import mpi_rendezvous
from .work import LoomWork, chain, engine, join, later

__all__ = ["ASYNC_MIN_BYTES", "LoomProcessGroup", "LoomWork", "create_process_group", "exact", "mpi_rendezvous",
           "set_compression", "set_multipath"]

#: payloads at least this large are posted non-blocking and completed by the progress thread
ASYNC_MIN_BYTES = 64 * 1024

_R = dist.ReduceOp.RedOpType
_REDUCE = {_R.SUM: "sum", _R.AVG: "avg", _R.MIN: "min", _R.MAX: "max", _R.PRODUCT: "prod", _R.PREMUL_SUM: "sum"}
_BOOL = {"sum": "max", "max": "max", "min": "min", "prod": "min"}  # or / and on 0-1 bytes
_PLAIN = {_R.SUM: "sum", _R.MIN: "min", _R.MAX: "max", _R.PRODUCT: "prod"}  # no factor, no dtype rule
_STRIDED, _BOOL_T, _SUM = torch.strided, torch.bool, _R.SUM
_DONE = LoomWork([])  # the work of a completed blocking call (async_op=False: torch only waits on it)

_WORLD: Communicator | None = None  # the default group's communicator, in torch's rank order


def create_process_group(dist_opts, pg_opts=None) -> "LoomProcessGroup":
    """torch's creator for the ``"loom"`` backend (``register_backend(..., extended_api=True)``): the default
    group (``global_ranks_in_group`` empty) gets a new duplicate of MPI's world in torch's rank order (the
    world formed by :func:`loom.torchdist.rendezvous.start_mpi` where no MPI launcher made one); a sub-group, a
    communicator of its ranks of the default group's. Each gets the group's timeout
    (:meth:`loom.comm.Communicator.set_timeout`)."""
    global _WORLD
    ranks = list(dist_opts.global_ranks_in_group)
    if not ranks:
        comm = _WORLD = _default_world(dist_opts.group_rank, dist_opts.group_size)
    else:
        if _WORLD is None:
            raise RuntimeError("a loom sub-group before the default group: call init_process_group first")
        comm = _WORLD.group(ranks, name=f"torch.{dist_opts.group_id}")
        if comm.rank != dist_opts.group_rank:
            raise ValueError(f"group of ranks {ranks}: torch says this is group rank {dist_opts.group_rank}, MPI "
                             f"says {comm.rank}")
    comm.set_timeout(dist_opts.timeout.total_seconds())
    return LoomProcessGroup(comm)


def _default_world(rank: int, size: int) -> Communicator:
    """A new duplicate of MPI's world whose ranks are torch's (a timed-out group must not leave a pending
    operation on the next group's communicator). MPI's world must be the torch group's: checked on every rank."""
    w = world()
    rendezvous.check_world(rank, size, w.rank, w.size)
    order = w.allgather_object(rank)  # every rank learns every rank's choice, so all dup or all split
    if order == list(range(size)):
        return w.dup(name="torch")
    if sorted(order) != list(range(size)):
        raise ValueError(f"init_process_group: the processes claim torch ranks {order}, not each of 0..{size - 1} "
                         f"once; give every process its own rank")
    return w.split(0, key=rank, name="torch")


# ---------------------------------------------------------------------------------------------- work
def _in_reentrant_backward() -> bool:
    """Whether this call runs inside the nested backward of reentrant activation checkpointing
    (``checkpoint(..., use_reentrant=True)``): each block's backward is then its own graph task, so a call's
    place in its task repeats from block to block and cannot key an error-feedback residual."""
    from torch.utils.checkpoint import CheckpointFunction

    code = CheckpointFunction.backward.__code__
    f = sys._getframe(1)
    while f is not None:
        if f.f_code is code:
            return True
        f = f.f_back
    return False


def _big(t: torch.Tensor, opts: Any = None) -> bool:
    """Whether to post ``t``'s operation non-blocking for the progress thread: large, and asked for
    asynchronously (``async_op=True``; torch's C++ callers, DDP's reducer and the functional collectives that
    DTensor and FSDP2 use, always ask so). A blocking call runs MPI's blocking collective, whose algorithms
    are faster than its non-blocking ones for large payloads."""
    return (t.numel() * t.element_size() >= ASYNC_MIN_BYTES and getattr(opts, "asyncOp", True)
            and engine() is not None)


# ---------------------------------------------------------------------------------------------- process group
def _reduce_op(rop, what: str) -> tuple[str, Any]:
    """``(loom op, premul factor or None)`` for a torch ReduceOp; NotImplementedError for the bitwise ones."""
    kind = getattr(rop, "op", rop)
    name = _REDUCE.get(kind)
    if name is None:
        raise NotImplementedError(
            f"the loom backend does not implement {what} with ReduceOp.{kind.name}; supported: SUM, AVG, MIN, MAX, "
            f"PRODUCT, PREMUL_SUM (bitwise ops: reduce 0/1 bytes with MIN/MAX, or use a gloo group for them)")
    factor = getattr(rop, "factor", None) if kind == _R.PREMUL_SUM else None
    return name, factor


def _reducible(t: torch.Tensor, op: str, what: str) -> tuple[torch.Tensor, str]:
    """The tensor to reduce (bool as its 0/1 bytes) and the op on it."""
    if t.dtype == torch.bool:
        if op == "avg":
            raise TypeError(f"{what}: ReduceOp.AVG of a bool tensor has no meaning; use SUM (logical or) or MIN "
                            f"(logical and), or cast to a float dtype")
        return t.view(torch.uint8), _BOOL[op]
    if op == "avg" and not (t.dtype.is_floating_point or t.dtype.is_complex):
        raise TypeError(f"{what}: ReduceOp.AVG needs a floating dtype, got {t.dtype}; use SUM and divide, or cast "
                        f"to a float dtype")
    return t, op


def _scale(t: torch.Tensor, factor: Any) -> torch.Tensor:
    """``t`` times a PREMUL_SUM factor (a number or a one-element tensor), as a new tensor."""
    f = factor.item() if isinstance(factor, torch.Tensor) else factor
    return t * f


def _flat_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    """``t`` as ``rows`` rows (a view when contiguous, else a contiguous copy)."""
    return t.reshape(rows, -1) if t.numel() else t.reshape(rows, 0)


def _unaliased(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``x``, copied when it shares memory with ``out`` (MPI forbids aliased send and receive buffers)."""
    if x.numel() and out.numel() and x.untyped_storage().data_ptr() == out.untyped_storage().data_ptr():
        return x.clone()
    return x


def _into(dst: torch.Tensor) -> Callable[[torch.Tensor], None]:
    def copy(res: torch.Tensor) -> None:
        dst.copy_(res.reshape(dst.shape))
    return copy


class LoomProcessGroup(dist.ProcessGroup):
    """A torch process group whose every operation runs on one loom :class:`~loom.comm.Communicator`.

    Args:
        comm: the group's communicator (its rank and size are the group's).
    """

    def __init__(self, comm: Communicator):
        super().__init__(comm.rank, comm.size)
        self.comm = comm
        self._name = ""
        self._desc = ""
        self._coalesced: list[LoomWork] | None = None
        self._codec = None  # this group's codec under the compression policy (set_compression), from its name
        self._feedback = None
        self._ef_task, self._ef_seen = -1, {}  # the backward pass of the last compressed reduction; calls per shape
        self._route: tuple[str, int] | None = None  # (topology spec, min_bytes) under set_multipath, until resolved
        self._relay: dict[str, Any] | None = None  # loom.multipath.alltoallv's keywords once resolved

    # -------------------------------------------------------------------- identity (torch reads these)
    def getBackendName(self) -> str:
        return "loom"

    @property
    def _device_types(self) -> list:
        """The devices the group serves, as torch asks a process group made of backends: the host (CUDA tensors
        go through the same methods). ``dcp.async_save`` requires a CPU backend by this property."""
        return [torch.device("cpu")]

    def shutdown(self) -> None:
        """torch's ``destroy_process_group``: free the group's communicators (MPI frees a communicator with an
        operation still pending, a timed-out one, once that completes)."""
        for sub in self.comm._subs.values():
            sub.free()
        self.comm._subs.clear()
        if self.comm.name != "world":
            self.comm.free()

    def getGroupName(self) -> str:
        return self._name

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupDesc(self) -> str:
        return self._desc

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc
        if self.comm.name.startswith("torch.") and desc and desc != "undefined":
            self.comm.rename(f"torch.{desc}")
        key = "world" if desc == "default_pg" else desc.removeprefix("mesh_")
        spec = compression_for(key)
        if spec is not None and self.comm.size > 1:
            from loom.compress import ErrorFeedback, get_codec

            self._codec, self._feedback = get_codec(spec), ErrorFeedback()
        if self.comm.size > 1:
            self._route = route_for(key)

    def _multipath(self) -> dict[str, Any] | None:
        """The relay all-to-allv's keywords for this group (its topology resolved at the first call, on every
        rank alike), or None: no topology for the group, or one of a single node or a single rail."""
        if self._route is not None:
            spec, min_bytes = self._route
            from loom.multipath.detect import resolve

            try:
                topo = resolve(spec, self.comm)
            except ValueError as exc:  # kept: every later call raises too, never MPI's alltoallv in its place
                raise ValueError(f"multipath topology {spec!r} of group {self.comm.name!r} (set_multipath, "
                                 f"LOOM_TORCH_MULTIPATH): {exc}") from None
            self._route = None
            if topo.nodes > 1 and topo.rails > 1:
                self._relay = {"topology": topo, "min_bytes": min_bytes}
        return self._relay

    def __repr__(self) -> str:
        return f"LoomProcessGroup({self.comm!r}, name={self._name!r}, desc={self._desc!r})"

    def _record(self, work: LoomWork) -> LoomWork:
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def start_coalescing(self, device=None) -> None:
        self._coalesced = []

    def end_coalescing(self, device=None) -> LoomWork:
        works, self._coalesced = self._coalesced or [], None
        return join(works)

    # -------------------------------------------------------------------- reductions
    def _allreduce_one(self, t: torch.Tensor, op: str, factor: Any, opts: Any = None) -> LoomWork | None:
        if t.numel() == 0:
            return None
        if self._compresses(t, op):
            self._compressed(t, op, factor)
            return None
        x, xop = _reducible(t, op, "all_reduce")
        if factor is not None:
            x.mul_(factor.item() if isinstance(factor, torch.Tensor) else factor)
        if _big(x, opts) and not self.comm.pairwise(x):  # blocking: see the module's plan
            return later(self.comm.iallreduce(x, xop, out=x), [t], self.comm)
        self.comm.allreduce(x, xop, out=x)
        return None

    def _compresses(self, t: torch.Tensor, op: str) -> bool:
        """Whether this reduction of ``t`` goes through the group's codec (floating SUM/AVG outside exact())."""
        return (self._codec is not None and op in ("sum", "avg") and t.is_floating_point()
                and not exact_depth())

    def _feedback_key(self, kind: str, x: torch.Tensor) -> tuple | None:
        """The error-feedback key of a compressed reduction, the same for the same call every step: its kind,
        shape, dtype and how many of that kind and shape this backward pass (autograd's graph task) made before
        it (DDP's buckets and FSDP2's groups are reduced in the same order every step, FSDP2's from new buffers).
        ``None`` outside a backward pass: nothing there says which call of the last step a call repeats (a
        tensor-parallel forward's same-shape reductions, a metric), and a residual added to another tensor's
        reduction is a wrong answer, so those reductions are compressed without feedback (within the codec's
        bound each); likewise inside a reentrant checkpointed block's backward (:func:`_in_reentrant_backward`)."""
        task = torch._C._current_graph_task_id()
        if task == -1 or _in_reentrant_backward():
            return None
        if task != self._ef_task:
            self._ef_task, self._ef_seen = task, {}
        sig = (kind, tuple(x.shape), x.dtype)
        i = self._ef_seen.get(sig, 0)
        self._ef_seen[sig] = i + 1
        return (*sig, i)

    def _compressed_rs(self, output: torch.Tensor, x: torch.Tensor, op: str) -> None:
        """``output`` = this rank's row of ``x`` (``P`` rows) summed over the group by
        :func:`loom.compress.reduce_scatter` with this group's codec (blocking)."""
        from loom.compress import reduce_scatter
        from loom.compress.codecs import PowerSGDCodec

        if isinstance(self._codec, PowerSGDCodec):
            raise ValueError(f"reduce_scatter on group {self._desc or self.comm.name!r}: its compression codec "
                             f"{self._codec.name!r} has no reduce-scatter (FSDP2's gradient reduction); give the "
                             f"group a quantizing codec (LOOM_TORCH_COMPRESS='dp=int8'), or train it with DDP")
        key = self._feedback_key("reduce_scatter", x)
        out = reduce_scatter(x, self.comm, self._codec, error_feedback=self._feedback if key is not None else None,
                             key=key)
        if op == "avg":
            out /= self.comm.size
        output.copy_(out.view(output.shape))

    def _compressed(self, t: torch.Tensor, op: str, factor: Any) -> None:
        """``t`` reduced in place by :func:`loom.compress.allreduce` with this group's codec (blocking), its
        error feedback keyed by :meth:`_feedback_key` (by position in the backward pass, not by memory: a
        coalesced call's flat copy is new every call, and a freed buffer's address comes back for another)."""
        from loom.compress import allreduce

        x = t if factor is None else _scale(t, factor)
        key = self._feedback_key("allreduce", t)
        out = allreduce(x, self.comm, self._codec, error_feedback=self._feedback if key is not None else None,
                        key=key)
        if op == "avg":
            out /= self.comm.size
        t.copy_(out)

    def allreduce(self, tensors, opts=None) -> LoomWork:
        # Fast path: one small dense tensor under SUM/MIN/MAX/PRODUCT, no codec, not coalescing. A 1-byte
        # all_reduce's cost is mostly this Python (loom bench torch --only latency), so it is not wrapped by
        # _naming: its work is complete, and only a timeout needs the operation's name.
        if len(tensors) == 1 and self._codec is None and self._coalesced is None:
            t = tensors[0]
            if opts is None:
                name = "sum"
            else:  # pybind's enums hash and compare slowly: SUM, the common case, by one comparison
                rop = opts.reduceOp
                name = "sum" if rop == _SUM else _PLAIN.get(rop.op)
            if name is not None and t.layout is _STRIDED and t.dtype is not _BOOL_T and 0 < t.numel() \
                    and t.numel() * t.element_size() < ASYNC_MIN_BYTES:
                try:
                    self.comm.allreduce(t, name, out=t)
                except CommError as exc:
                    raise dist.DistBackendError(f"the loom backend's all_reduce on group {self.comm.name!r}: "
                                                f"{exc}") from exc
                # a blocking call's work is only waited on (torch's all_reduce(async_op=False)): one for all
                return LoomWork(tensors) if opts is None or opts.asyncOp else _DONE
        return self._allreduce(tensors, opts)

    def _allreduce(self, tensors, opts=None) -> LoomWork:
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce")
        if tensors and tensors[0].is_sparse:
            return self._record(self._sparse_allreduce(tensors, op, factor))
        works = [w for t in tensors if (w := self._allreduce_one(t, op, factor, opts)) is not None]
        return self._record(join(works, list(tensors)))

    def _sparse_allreduce(self, tensors, op: str, factor: Any) -> LoomWork:
        """A sparse COO tensor summed as gloo sums it: each rank's coalesced indices and values gathered from
        every rank (two ``allgatherv``, rank order), added in rank order and coalesced; the input becomes the
        result (blocking)."""
        if op != "sum" or factor is not None or len(tensors) != 1:
            raise ValueError(f"all_reduce of a sparse tensor: the loom backend sums one sparse tensor per call "
                             f"(ReduceOp.SUM), as gloo does; got op {op!r} on {len(tensors)} tensors")
        t = tensors[0]
        x = t.coalesce()
        idx, _ = self.comm.allgatherv(x.indices().t().contiguous())
        vals, counts = self.comm.allgatherv(x.values().contiguous())
        out = None
        start = 0
        for n in counts:  # rank by rank, as gloo adds them
            part = torch.sparse_coo_tensor(idx[start:start + n].t(), vals[start:start + n], x.shape)
            out = part if out is None else out + part
            start += n
        out = out.coalesce()
        t.copy_(out)
        return LoomWork([out])

    def allreduce_coalesced(self, tensors, opts=None) -> LoomWork:
        """One allreduce per dtype over the tensors packed into one flat buffer, unpacked when done."""
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "all_reduce_coalesced")
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            if t.numel():
                by_dtype.setdefault(t.dtype, []).append(t)
        works = []
        for group in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in group])

            def unpack(_res, flat=flat, group=group) -> None:
                for t, piece in zip(group, flat.split([t.numel() for t in group])):
                    t.copy_(piece.view(t.shape))

            w = self._allreduce_one(flat, op, factor, opts)
            if w is None:
                unpack(None)
            else:
                works.append(chain(w, unpack))
        return self._record(join(works, list(tensors)))

    def reduce(self, tensors, opts=None) -> LoomWork:
        """The reduction on every rank, kept on the root (the other ranks' tensors are left as they were)."""
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce")
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if t.numel() == 0:
                continue
            x, xop = _reducible(t if self.comm.rank == root else t.clone(), op, "reduce")
            if factor is not None:
                x.mul_(factor.item() if isinstance(factor, torch.Tensor) else factor)
            self.comm.allreduce(x, xop, out=x)
        return self._record(LoomWork(list(tensors)))

    def _reduce_scatter_into(self, output: torch.Tensor, inp: torch.Tensor, op: str, factor: Any,
                             what: str, opts: Any = None) -> LoomWork | None:
        p = self.comm.size
        if inp.numel() != output.numel() * p:
            raise ValueError(f"{what}: the input has {inp.numel()} elements, not {p} x the output's {output.numel()}; "
                             f"give an input of the world size times the output")
        if output.numel() == 0:
            return None
        x, xop = _reducible(_unaliased(_flat_rows(inp, p), output), op, what)
        if factor is not None:
            x = _scale(x, factor)
        if self._compresses(x, op):
            self._compressed_rs(output, x, op)
            return None
        back = _into(output.view(torch.uint8) if output.dtype == torch.bool else output)
        if _big(x, opts):
            return later(self.comm.ireduce_scatter(x, xop), [output], self.comm, back)
        if output.is_contiguous() and output.dtype == x.dtype:  # reduced straight into the output
            self.comm.reduce_scatter(x, xop, out=output.view(1, -1))
        else:
            back(self.comm.reduce_scatter(x, xop))
        return None

    def reduce_scatter_single(self, output, inp, opts=None) -> LoomWork:
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        return self._record(join([w for w in [self._reduce_scatter_into(output, inp, op, factor,
                                                                       "reduce_scatter_tensor", opts)] if w], [output]))

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None) -> LoomWork:
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter_tensor")
        works = [self._reduce_scatter_into(o, i, op, factor, "reduce_scatter_tensor", opts)
                 for o, i in zip(outputs, inputs)]
        return self._record(join([w for w in works if w], list(outputs)))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def reduce_scatter(self, outputs, input_lists, opts=None) -> LoomWork:
        op, factor = _reduce_op(opts.reduceOp if opts is not None else dist.ReduceOp.SUM, "reduce_scatter")
        works = []
        for out, pieces in zip(outputs, input_lists):
            if len(pieces) != self.comm.size:
                raise ValueError(f"reduce_scatter: {len(pieces)} input tensors for {self.comm.size} ranks; give one "
                                 f"per rank")
            if any(p.shape != out.shape for p in pieces):
                raise ValueError(f"reduce_scatter: the inputs' shapes {[tuple(p.shape) for p in pieces]} differ from "
                                 f"the output's {tuple(out.shape)}; the loom backend needs them equal")
            stacked = torch.stack([p.reshape(out.shape) for p in pieces]) if out.numel() else pieces[0]
            works.append(self._reduce_scatter_into(out, stacked, op, factor, "reduce_scatter", opts))
        return self._record(join([w for w in works if w], list(outputs)))

    # -------------------------------------------------------------------- gathers and all-to-alls
    def _allgather_into(self, output: torch.Tensor, inp: torch.Tensor, what: str, opts: Any = None) -> LoomWork | None:
        p = self.comm.size
        if output.numel() != inp.numel() * p:
            raise ValueError(f"{what}: the output has {output.numel()} elements, not {p} x the input's {inp.numel()}; "
                             f"give an output of the world size times the input")
        if inp.numel() == 0:
            return None
        if output.dtype != inp.dtype:
            raise TypeError(f"{what}: output dtype {output.dtype} differs from the input's {inp.dtype}")
        x = _unaliased(inp.reshape(1, -1), output)  # FSDP2 gathers in place: its input is its block of the output
        out = output.view(p, -1) if output.is_contiguous() else None
        back = None if out is not None else _into(output)
        if _big(x, opts):
            return later(self.comm.iallgather(x, out=out), [output], self.comm, back)
        res = self.comm.allgather(x, out=out)
        if back is not None:
            back(res)
        return None

    def all_gather_single(self, output, inp, opts=None) -> LoomWork:
        w = self._allgather_into(output, inp, "all_gather_into_tensor", opts)
        return self._record(join([w] if w else [], [output]))

    _allgather_base = all_gather_single

    def all_gather_single_coalesced(self, outputs, inputs, opts=None) -> LoomWork:
        works = [self._allgather_into(o, i, "all_gather_into_tensor", opts) for o, i in zip(outputs, inputs)]
        return self._record(join([w for w in works if w], list(outputs)))

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather(self, output_lists, inputs, opts=None) -> LoomWork:
        works = []
        for outs, inp in zip(output_lists, inputs):
            if len(outs) != self.comm.size:
                raise ValueError(f"all_gather: {len(outs)} output tensors for {self.comm.size} ranks; one per rank")
            if any(o.numel() != inp.numel() for o in outs):
                raise ValueError(f"all_gather: output sizes {[o.numel() for o in outs]} differ from the input's "
                                 f"{inp.numel()}; the loom backend gathers equal sizes")
            if inp.numel() == 0:
                continue
            flat = torch.empty((self.comm.size, inp.numel()), dtype=inp.dtype, device=inp.device)

            def unpack(_res, outs=outs, flat=flat) -> None:
                for o, row in zip(outs, flat):
                    o.copy_(row.view(o.shape))

            w = self._allgather_into(flat, inp, "all_gather", opts)
            if w is None:
                unpack(None)
            else:
                works.append(chain(w, unpack))
        return self._record(join(works, [o for outs in output_lists for o in outs]))

    def allgather_coalesced(self, output_lists, inputs, opts=None) -> LoomWork:
        """``output_lists[r][i]`` = rank r's ``inputs[i]`` (torch's layout): every input's bytes packed into one
        row, one allgather of the rows, each row unpacked into its rank's outputs (blocking)."""
        p = self.comm.size
        if len(output_lists) != p:
            raise ValueError(f"all_gather_coalesced: {len(output_lists)} output lists for {p} ranks; give one list "
                             f"per rank, each with one tensor per input")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(inputs) or any(o.numel() != i.numel() or o.dtype != i.dtype
                                               for o, i in zip(outs, inputs)):
                raise ValueError(
                    f"all_gather_coalesced: output list {r} holds {[(tuple(o.shape), o.dtype) for o in outs]} for "
                    f"inputs {[(tuple(i.shape), i.dtype) for i in inputs]}; output_tensor_lists[rank][i] must match "
                    f"input_tensor_list[i] in size and dtype")
        if not inputs or not sum(i.numel() for i in inputs):
            return self._record(LoomWork([o for outs in output_lists for o in outs]))
        row = torch.cat([i.detach().contiguous().reshape(-1).view(torch.uint8) for i in inputs])
        rows = self.comm.allgather(row.view(1, -1)).view(p, -1)
        sizes = [i.numel() * i.element_size() for i in inputs]
        for outs, got in zip(output_lists, rows):
            for o, piece in zip(outs, got.split(sizes)):
                o.copy_(piece.view(o.dtype).view(o.shape))
        return self._record(LoomWork([o for outs in output_lists for o in outs]))

    def all_to_all_single(self, output, inp, output_splits, input_splits, opts=None) -> LoomWork:
        """Even or uneven: the splits count rows of dim 0 (empty: equal parts). Under a multi-rail topology
        (:func:`set_multipath`) through :func:`loom.multipath.alltoallv`, which runs on the caller's thread
        (its relays forward in Python) and returns completed work even when asked asynchronously."""
        p = self.comm.size
        if output.dtype != inp.dtype:
            raise TypeError(f"all_to_all_single: output dtype {output.dtype} differs from the input's {inp.dtype}")
        n_in = inp.shape[0] if inp.dim() else 1
        n_out = output.shape[0] if output.dim() else 1
        sc = [int(c) for c in input_splits] if len(input_splits) else _even(n_in, p, "input")
        rc = [int(c) for c in output_splits] if len(output_splits) else _even(n_out, p, "output")
        if sum(sc) != n_in or sum(rc) != n_out or len(sc) != p or len(rc) != p:
            raise ValueError(f"all_to_all_single: input splits {sc} / output splits {rc} must have {p} entries "
                             f"summing to dim 0 of the input ({n_in}) / output ({n_out})")
        # rows of the trailing dims' width, the same on every rank (a rank with no rows to send still joins)
        x = _unaliased(inp.reshape(n_in, math.prod(inp.shape[1:])), output)
        if x.shape[1] == 0:
            return self._record(LoomWork([output]))
        back = _into(output)
        relay = self._multipath()
        if relay is not None:  # several nodes and rails: planned paths, relays forwarding (on this thread)
            from loom.multipath import alltoallv

            back(alltoallv(x, sc, self.comm, rc, **relay)[0])
            return self._record(LoomWork([output]))
        # Posted or blocking alike on every rank (MPI matches no blocking collective with a non-blocking one):
        # uneven splits send different sizes from each rank, so they choose by the caller's asyncOp alone.
        uneven = bool(len(input_splits) or len(output_splits))
        if _big(x, opts) if not uneven else getattr(opts, "asyncOp", True) and engine() is not None:
            return self._record(later(self.comm.ialltoallv(x, sc, rc), [output], self.comm, lambda r: back(r[0])))
        back(self.comm.alltoallv(x, sc, rc)[0])
        return self._record(LoomWork([output]))

    alltoall_base = all_to_all_single

    def alltoall(self, outputs, inputs, opts=None) -> LoomWork:
        p = self.comm.size
        if len(outputs) != p or len(inputs) != p:
            raise ValueError(f"all_to_all: {len(inputs)} inputs and {len(outputs)} outputs for {p} ranks; give one "
                             f"per rank")
        dtypes = {t.dtype for t in (*outputs, *inputs)}
        if len(dtypes) != 1:
            raise TypeError(f"all_to_all: tensors of dtypes {sorted(map(str, dtypes))}; the loom backend needs one")
        flat = torch.cat([t.reshape(-1) for t in inputs])
        res, _ = self.comm.alltoallv(flat, [t.numel() for t in inputs], [t.numel() for t in outputs])
        for o, piece in zip(outputs, res.split([t.numel() for t in outputs])):
            o.copy_(piece.view(o.shape))
        return self._record(LoomWork(list(outputs)))

    # -------------------------------------------------------------------- rooted
    def broadcast(self, tensors, opts=None) -> LoomWork:
        root = opts.rootRank if opts is not None else 0
        for t in tensors:
            if t.numel():
                self.comm.bcast(t, root)
        return self._record(LoomWork(list(tensors)))

    def gather(self, output_lists, inputs, opts=None) -> LoomWork:
        root = opts.rootRank if opts is not None else 0
        rooted = self.comm.sub("rooted")
        inp = inputs[0]
        if self.comm.rank != root:
            rooted.send(inp, root, tag=1)
            return self._record(LoomWork([]))
        outs = output_lists[0]
        if len(outs) != self.comm.size:
            raise ValueError(f"gather: {len(outs)} output tensors on the root for {self.comm.size} ranks")
        reqs = [rooted.irecv(o, r, tag=1) for r, o in enumerate(outs) if r != root]
        outs[root].copy_(inp)
        wait_all(reqs, self.comm.timeout)
        return self._record(LoomWork(list(outs)))

    def scatter(self, outputs, input_lists, opts=None) -> LoomWork:
        root = opts.rootRank if opts is not None else 0
        rooted = self.comm.sub("rooted")
        out = outputs[0]
        if self.comm.rank != root:
            rooted.recv(out, root, tag=2)
            return self._record(LoomWork([out]))
        pieces = input_lists[0]
        if len(pieces) != self.comm.size:
            raise ValueError(f"scatter: {len(pieces)} input tensors on the root for {self.comm.size} ranks")
        reqs = [rooted.isend(x, r, tag=2) for r, x in enumerate(pieces) if r != root]
        out.copy_(pieces[root])
        wait_all(reqs, self.comm.timeout)
        return self._record(LoomWork([out]))

    def barrier(self, opts=None) -> LoomWork:
        self.comm.barrier()
        return self._record(LoomWork([]))

    # -------------------------------------------------------------------- point to point
    def send(self, tensors, dst: int, tag: int = 0) -> LoomWork:
        t = tensors[0]
        return self._record(later(self.comm.isend(t, dst, tag), [t], self.comm))

    def recv(self, tensors, src: int, tag: int = 0) -> LoomWork:
        t = tensors[0]
        work = later(self.comm.irecv(t, src, tag), [t], self.comm)
        work._source = src
        return self._record(work)

    def recv_anysource(self, tensors, tag: int = 0) -> LoomWork:
        """Probe for the first message on ``tag`` from any rank (backing off while none is there), receive it."""
        t = tensors[0]
        backoff = Backoff()
        limit = self.comm.timeout
        end = None if limit is None else time.monotonic() + limit
        while (msg := self.comm.improbe(ANY_SOURCE, tag)) is None:
            d = backoff.next_delay()
            if d:
                time.sleep(d)
                if end is not None and time.monotonic() > end:
                    raise CommTimeoutError(f"recv from any source on tag {tag}: Timed out after {limit:g} s (the "
                                           f"group's timeout); no rank sent to this one")
        msg.recv(t)
        return self._record(LoomWork([t], source=msg.source))

    recvAnysource = recv_anysource

    # -------------------------------------------------------------------- not implemented
    def monitored_barrier(self, *args, **kwargs):
        raise NotImplementedError("the loom backend does not implement monitored_barrier; use barrier (LOOM_TIMEOUT "
                                  "names a rank that never arrives)")

    def split_group(self, *args, **kwargs):
        raise NotImplementedError("the loom backend does not implement split_group; use new_group(ranks)")

    def merge_remote_group(self, *args, **kwargs):
        raise NotImplementedError("the loom backend does not implement merge_remote_group")


def _even(n: int, p: int, what: str) -> list[int]:
    if n % p:
        raise ValueError(f"all_to_all_single: dim 0 of the {what} ({n}) does not divide by {p} ranks; pad it or pass "
                         f"split sizes")
    return [n // p] * p


#: torch's names of the process group's operations: a work names its operation when its wait times out
_OP_NAMES = {
    "_allreduce": "all_reduce", "allreduce_coalesced": "all_reduce_coalesced", "reduce": "reduce",
    "reduce_scatter_single": "reduce_scatter_tensor", "_reduce_scatter_base": "reduce_scatter_tensor",
    "reduce_scatter_single_coalesced": "reduce_scatter_tensor_coalesced",
    "reduce_scatter_tensor_coalesced": "reduce_scatter_tensor_coalesced", "reduce_scatter": "reduce_scatter",
    "all_gather_single": "all_gather_into_tensor", "_allgather_base": "all_gather_into_tensor",
    "all_gather_single_coalesced": "all_gather_into_tensor_coalesced",
    "allgather_into_tensor_coalesced": "all_gather_into_tensor_coalesced", "allgather": "all_gather",
    "allgather_coalesced": "all_gather_coalesced", "all_to_all_single": "all_to_all_single",
    "alltoall_base": "all_to_all_single", "alltoall": "all_to_all", "broadcast": "broadcast", "gather": "gather",
    "scatter": "scatter", "barrier": "barrier", "send": "send", "recv": "recv", "recv_anysource": "recv",
    "recvAnysource": "recv", "end_coalescing": "coalesced operations",
}


def _naming(method: Callable, op: str) -> Callable:
    """``method`` whose work carries the operation's and the group's names, and whose transport failures (a
    timeout: loom.comm's ``CommTimeoutError``) raise as torch's ``DistBackendError`` naming them."""
    @functools.wraps(method)
    def named(self, *args, **kwargs):
        try:
            work = method(self, *args, **kwargs)
        except CommError as exc:
            raise dist.DistBackendError(f"the loom backend's {op} on group {self.comm.name!r}: {exc}") from exc
        work._op, work._group = op, self.comm.name
        return work
    return named


for _method, _name in _OP_NAMES.items():
    if _method in LoomProcessGroup.__dict__:
        setattr(LoomProcessGroup, _method, _naming(LoomProcessGroup.__dict__[_method], _name))
del _method, _name
