"""HyPar-Flow-style hybrid parallelism: one API for data, pipeline (model) and hybrid parallel training.

``HybridParallel(model, partitions=P, replicas=R, micro_batches=M)`` lays a ``Mesh(pp=P, dp=R)`` over the
ranks, captures the model as a graph (:mod:`loom.parallel.partition`), keeps stage ``pp.rank`` on this rank,
and trains it with a pipeline schedule (:mod:`loom.parallel.pipeline`) whose gradients are averaged over the
replicas (:mod:`loom.parallel.data`).

Plan of :meth:`HybridParallel.train_step` on each rank:

1. split this replica's batch into ``M`` equal micro-batches along dim 0 (every stage rank of a replica holds
   the same batch, so graph inputs are read locally by any stage that needs them);
2. run the schedule (``gpipe``, ``1f1b`` or ``interleaved``): forwards receive/send live sets from/to the
   neighbouring stages,
   the last stage computes ``loss_fn(out_m, target_m) / M`` and backward sends gradients upstream;
3. the dp reducer averages each stage's gradients over replicas in buckets as soon as the last micro-batch's
   backward finishes them (``iallreduce``, overlapped with the remaining backward; or the user's hook);
   with ``reduce_dp="after"`` there is no reducer: ``train_step`` returns each replica's own gradients
   (tensors shared across stages already summed over their stages) and the caller reduces them over dp
   afterwards, e.g. ZeRO-1's reduce-scatter (:meth:`loom.parallel.ShardedOptimizer.reduce_grads`), which
   with the allgather of the updated blocks sends DDP's bytes instead of an allreduce's plus an allgather;
   with ``reduce_dp=False`` a sharded wrapper over the stage reduce-scatters them during backward (ZeRO 2-3);
4. the loss: one ``allreduce(sum)`` of a scalar over ``pp`` (only the last stage contributes) and one
   ``allreduce(avg)`` over ``dp``, so every rank returns the mean loss over the global batch.

With ``loss_fn`` a mean over the batch, gradients equal single-process training on the global batch
(``R`` replicas x ``M`` micro-batches of equal size): the tests check loss and parameters to 1e-10 in fp64.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from ..comm import Communicator, Mesh, world
from .data import GradHook, GradReducer
from .meta import check_initialisable, is_meta, materialize
from .partition import Graph, capture, split_units
from .pipeline import SCHEDULES, Stage, interleaved_schedule, schedule as make_schedule

__all__ = ["HybridConfig", "HybridParallel"]


@dataclass(kw_only=True, slots=True)
class HybridConfig:
    """How to parallelise a model."""

    partitions: int = 1
    """Pipeline stages (size of the ``pp`` axis)."""
    replicas: int | None = None
    """Model replicas (size of the ``dp`` axis); ``None``: world size // partitions."""
    micro_batches: int = 1
    """Micro-batches per replica batch; the batch must divide by it."""
    schedule: str = "1f1b"
    """Pipeline schedule: ``gpipe``, ``1f1b`` or ``interleaved`` (1F1B over ``virtual_stages`` chunks per rank)."""
    virtual_stages: int = 2
    """Model chunks per rank under ``interleaved`` (stage ``j`` on rank ``j % partitions``)."""
    balance: str | list[int] = "params"
    """``params`` (min-max parameter count), ``time`` (profiled forward time) or layer counts per stage."""
    bucket_mb: float = 25.0
    """Gradient allreduce bucket size in MiB."""

    def __post_init__(self) -> None:
        for name in ("partitions", "micro_batches", "virtual_stages"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        r = self.replicas
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or r < 1):
            raise ValueError(f"replicas={r!r} must be an integer >= 1 (or None for world size // partitions)")
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule={self.schedule!r} is not one of {', '.join(SCHEDULES)}")
        if isinstance(self.balance, str):
            if self.balance not in ("params", "time"):
                raise ValueError(f"balance={self.balance!r} is not 'params', 'time' or a list of layer counts")
        elif not isinstance(self.balance, (list, tuple)) or not all(isinstance(c, int) for c in self.balance):
            raise ValueError(f"balance={self.balance!r} must be 'params', 'time' or a list of ints")
        if self.bucket_mb <= 0:
            raise ValueError(f"bucket_mb={self.bucket_mb} must be > 0")


def _as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _pp_codec(policy: Any) -> Any:
    """The pipeline codec of a ``loom.compress.CompressionPolicy`` (``None`` if it has none)."""
    codec_for = getattr(policy, "codec_for", None)
    if not callable(codec_for):
        raise TypeError(f"compression={policy!r} is not a loom.compress.CompressionPolicy (no codec_for(axis))")
    return codec_for("pp")


class HybridParallel:
    """Train ``model`` with ``partitions`` pipeline stages x ``replicas`` data-parallel replicas.

    Args:
        model: ``nn.Sequential``, any ``torch.fx``-traceable ``nn.Module``, or a built Keras 3 model on the
            torch backend (Sequential or Functional). Every rank passes the same model (replicas' stage
            weights are broadcast from replica 0 at construction).
        partitions: pipeline stages.
        replicas: data-parallel replicas (default world size // partitions).
        micro_batches: micro-batches per replica batch.
        schedule: ``"gpipe"``, ``"1f1b"`` or ``"interleaved"`` (Megatron's interleaved 1F1B: each rank holds
            ``virtual_stages`` non-contiguous chunks, a smaller bubble for more messages).
        virtual_stages: chunks per rank under ``"interleaved"``.
        balance: ``"params"``, ``"time"`` (needs ``sample_inputs``) or a list of layer counts per stage.
        comm: communicator to lay the ``Mesh(pp=partitions, dp=replicas)`` over (default: the world).
        mesh: an existing mesh with ``pp`` and ``dp`` axes (e.g. also an ``sp`` axis) instead of ``comm``.
        pp: explicit pipeline communicator (rank = stage); with ``dp`` instead of ``comm``/``mesh``.
        dp: explicit data-parallel communicator.
        grad_hook: ``hook(flat_bucket, dp_comm, bucket_index) -> mean over dp`` (e.g.
            ``loom.compress.dp_hook(policy)``); default ``dp.allreduce(t, op="avg")`` (non-blocking).
        compression: a ``loom.compress.CompressionPolicy``; its ``pp`` codec compresses pipeline traffic.
        sample_inputs: one micro-batch of inputs, for ``balance="time"``, and to capture with ``torch.export``
            a model ``torch.fx`` cannot trace (the graph is then specialised to this micro-batch's shapes).
        bucket_mb: gradient bucket size in MiB.
        leaf_modules: module classes ``torch.fx`` calls as one layer instead of tracing into (for bodies
            with shape-dependent Python control flow, e.g. ``leaf_modules=(Block,)`` for loom's Llama).
        init: for a model built on the meta device: ``init(name, tensor)`` filling one tensor in place
            (default: the model's ``init_parameter``, else its modules' ``reset_parameters`` replayed in
            order; see :func:`loom.parallel.materialize`). Only this rank's stage is materialised, so the
            whole model never exists on one rank; its weights equal a plain build from the same seed.
        device: where a meta model's stage is materialised.
        dtype: the dtype a meta model's stage is cast to after initialisation (``None``: as built).
        reduce_dp: ``True``: average the stage's gradients over ``dp`` during backward. ``"after"``: leave
            them unreduced for the caller to reduce over ``dp`` after :meth:`train_step` (a
            ``ShardedOptimizer(reduce=True)``'s reduce-scatter); the full gradients are still there when the
            copies of a tensor shared across stages are summed. ``False``: leave them to a
            :class:`~loom.parallel.ShardedDataParallel` over this stage, which reduce-scatters them during
            backward (so tensors shared across stages are refused: their stage sum needs the full gradients).

    Attributes:
        forward_context: ``None``, or a callable returning the context manager every micro-batch forward
            runs in (a ``ShardedDataParallel``'s ``forward_context`` at ZeRO stage 3).
        counted_elsewhere: ``id()`` of this stage's tensors tied to an earlier stage's (their gradients are
            summed over the stages that read them, so each holds the same one): a global gradient norm counts
            them on the first stage only.

    Raises:
        ValueError: ``partitions x replicas`` differs from the ranks available, more partitions than layers,
            a bad ``balance``/``schedule``, compression of a 1F1B pipeline, a ``reduce_dp`` other than
            ``True``, ``False`` or ``"after"`` (or ``"after"`` with a ``grad_hook``), or a meta-device model
            whose stage holds a tensor nothing can initialise.
        TraceError: the model cannot be captured (the message says which construct and what to do).
    """

    def __init__(self, model: Any, *, partitions: int = 1, replicas: int | None = None, micro_batches: int = 1,
                 schedule: str = "1f1b", balance: str | list[int] = "params", comm: Communicator | None = None,
                 mesh: Mesh | None = None, pp: Communicator | None = None, dp: Communicator | None = None,
                 grad_hook: GradHook | None = None, compression: Any = None,
                 sample_inputs: Any = None, bucket_mb: float = 25.0, leaf_modules: Sequence[type] = (),
                 virtual_stages: int = 2, init: Callable[[str, torch.Tensor], None] | None = None,
                 device: Any = "cpu", dtype: torch.dtype | None = None, reduce_dp: bool | str = True):
        if reduce_dp not in (True, False, "after"):
            raise ValueError(f"reduce_dp={reduce_dp!r} is not True (average over dp during backward), \"after\" "
                             f"(the caller reduces after train_step) or False (a sharded wrapper reduces during "
                             f"backward)")
        if reduce_dp == "after" and grad_hook is not None:
            raise ValueError("reduce_dp=\"after\" leaves the dp reduction to the caller, so a grad_hook would never "
                             "run; pass reduce_dp=True to reduce through the hook, or reduce (and compress) after "
                             "train_step yourself")
        self.config = HybridConfig(partitions=partitions, replicas=replicas, micro_batches=micro_batches,
                                   schedule=schedule, balance=balance, bucket_mb=bucket_mb,
                                   virtual_stages=virtual_stages)
        self.model = model
        self.pp, self.dp = self._comms(comm, mesh, pp, dp)
        self.partitions, self.replicas = self.pp.size, self.dp.size
        self.micro_batches = micro_batches
        self.schedule = schedule
        codec = None
        if compression is not None:
            try:
                import loom.compress  # noqa: F401
            except ImportError as exc:
                raise ValueError("compression= needs loom.compress, which is not available in this build; "
                                 "drop compression= or install loom with the compress extra") from exc
            codec = _pp_codec(compression) if self.partitions > 1 else None
        sample = _as_tuple(sample_inputs) if sample_inputs is not None else None
        meta = isinstance(model, nn.Module) and is_meta(model)
        if meta and balance == "time":
            raise ValueError("balance='time' profiles real layers, but the model is on the meta device; use "
                             "balance='params' or layer counts, or materialise the model first")
        if meta:
            check_initialisable(model, init)  # the whole model, so that every rank refuses alike
        self.graph: Graph = capture(model, leaf_modules=leaf_modules, sample=sample)
        costs = None
        if balance == "time":
            if sample is None:
                raise ValueError("balance='time' profiles the layers on a sample micro-batch: pass sample_inputs=")
            # Every rank must cut at the same place: replica 0's stage-0 timings win.
            costs = self.graph.time_costs(sample)
            costs = self.dp.bcast_object(costs, 0)
            costs = self.pp.bcast_object(costs, 0)
        # Interleaving needs a pipeline; on one stage it would only add self-messages.
        self.chunks = virtual_stages if (schedule == "interleaved" and self.partitions > 1) else 1
        self.counts = split_units(self.graph, self.partitions * self.chunks, balance, sample, costs)
        if meta:
            self._materialize_stage(leaf_modules, sample, init, device, dtype)
        pp_comm = self.pp.dup(name="pp") if self.partitions > 1 else None
        r, p = self.pp.rank, self.partitions
        self.local_stages = [Stage(self.graph, self.counts, pp_comm, codec=codec, index=k * p + r)
                             for k in range(self.chunks)]
        self.stage = self.local_stages[0]
        self._params = [t for t in self._tensors() if t.requires_grad]
        self._reduce_dp = reduce_dp
        self._tie_shared()
        self.reducer: GradReducer | None = None
        self.forward_context: Callable[[], Any] | None = None
        if self.replicas > 1:
            with torch.no_grad():
                for t in self._tensors():
                    t.copy_(self.dp.bcast(t.detach().clone(), 0))
            if reduce_dp is True:
                self.reducer = GradReducer(self._params, self.dp, grad_hook=grad_hook, bucket_mb=bucket_mb)

    # ------------------------------------------------------------------ setup
    def _comms(self, comm, mesh, pp, dp) -> tuple[Communicator, Communicator]:
        cfg = self.config
        if pp is not None or dp is not None:
            if pp is None or dp is None or comm is not None or mesh is not None:
                raise ValueError("give both pp= and dp= communicators (and neither comm= nor mesh=), or neither")
        elif mesh is not None:
            if comm is not None:
                raise ValueError("give comm= or mesh=, not both")
            for ax in ("pp", "dp"):
                if ax not in mesh:
                    raise ValueError(f"mesh {mesh!r} has no {ax!r} axis; build it as Mesh(pp=..., dp=..., ...)")
            pp, dp = mesh["pp"], mesh["dp"]
        else:
            comm = comm or world()
            r = cfg.replicas if cfg.replicas is not None else max(comm.size // cfg.partitions, 1)
            if cfg.partitions * r != comm.size:
                raise ValueError(f"partitions={cfg.partitions} x replicas={r} = {cfg.partitions * r} ranks but the "
                                 f"communicator {comm.name!r} has {comm.size}; choose partitions x replicas = "
                                 f"{comm.size} (or launch with -n {cfg.partitions * r})")
            m = Mesh(pp=cfg.partitions, dp=r, comm=comm)
            pp, dp = m["pp"], m["dp"]
        if pp.size != cfg.partitions:
            raise ValueError(f"partitions={cfg.partitions} but the pp communicator has {pp.size} ranks")
        if cfg.replicas is not None and dp.size != cfg.replicas:
            raise ValueError(f"replicas={cfg.replicas} but the dp communicator has {dp.size} ranks")
        return pp, dp

    def _materialize_stage(self, leaf_modules, sample, init, device, dtype) -> None:
        """Give this rank's stage(s) of a meta-device model real, initialised tensors; recapture the graph
        (its nodes hold the tensors, which materialisation replaces), keeping the split already chosen."""
        r, p = self.pp.rank, self.partitions
        ids = {id(t) for k in range(self.chunks) for n in self.graph.stage_nodes(self.counts, k * p + r)
               for t in n.params}
        named = dict(self.model.named_parameters())
        named.update(dict(self.model.named_buffers()))
        materialize(self.model, [name for name, t in named.items() if id(t) in ids], init=init, device=device,
                    dtype=dtype)
        counts = list(self.counts)
        self.graph = capture(self.model, leaf_modules=leaf_modules, sample=sample)
        if len(self.graph.units) != sum(counts):
            raise RuntimeError(f"the recaptured graph has {len(self.graph.units)} layers, the split {sum(counts)}")

    def _tie_shared(self) -> None:
        """Tensors read by several stages (tied embeddings): each stage trains its own copy, and after every
        step the copies' gradients are summed over the stages that read them (one allreduce per group of
        stages, as Megatron-LM does for its embedding group), so the copies stay equal."""
        self._shared: list[tuple[Communicator, list[torch.Tensor]]] = []
        self.counted_elsewhere: frozenset[int] = frozenset()
        if self.partitions == 1:
            return
        mine = {id(t) for t in self._tensors()}
        owners = self.pp.allgather_object(sorted(self._keys(mine)))
        stages: dict[str, list[int]] = {}
        for s, keys in enumerate(owners):
            for k in keys:
                stages.setdefault(k, []).append(s)
        groups: dict[tuple[int, ...], list[str]] = {}
        for k, ss in sorted(stages.items()):
            if len(ss) > 1:
                groups.setdefault(tuple(ss), []).append(k)
        if groups and self._reduce_dp is False:  # every rank saw the same owners: all refuse alike
            keys = sorted(k for ks in groups.values() for k in ks)
            raise ValueError(
                f"tensors read by several pipeline stages ({', '.join(keys[:3])}: tied weights) need the pipeline's "
                f"sum of their gradients over those stages, and reduce_dp=False hands every gradient to a sharded "
                f"wrapper (ZeRO stages 2-3) before it; untie them (e.g. tie_word_embeddings=False) or use ZeRO "
                f"stage 0 or 1 with a pipeline")
        named = self._named()
        for ss, keys in sorted(groups.items()):  # the same order on every rank: split is collective
            sub = self.pp.split(1 if self.pp.rank in ss else 0, name="pp-shared")
            if self.pp.rank in ss:
                ts = {id(named[k]): named[k] for k in keys if named[k].requires_grad}  # one tensor, many names
                self._shared.append((sub, list(ts.values())))
                if self.pp.rank != ss[0]:  # equal on every stage of the group after the sum: the first counts it
                    self.counted_elsewhere |= frozenset(ts)

    def _sync_shared(self, before: list[torch.Tensor | None]) -> None:
        """Sum this step's gradient of every cross-stage shared tensor over the stages that read it."""
        i = 0
        for sub, ts in self._shared:
            for t in ts:
                g0 = before[i]
                i += 1
                if t.grad is None:
                    t.grad = torch.zeros_like(t)
                step = t.grad if g0 is None else t.grad - g0
                total = sub.allreduce(step.contiguous())
                t.grad.copy_(total if g0 is None else g0 + total)

    def _keys(self, ids: set[int]) -> set[str]:
        out = set()
        for k, v in self._named().items():
            if id(v) in ids:
                out.add(k)
        return out

    def _named(self) -> dict[str, torch.Tensor]:
        if isinstance(self.model, nn.Module):
            return dict(self.model.state_dict(keep_vars=True))
        return {f"t{i}": t for i, t in enumerate(self._tensors())}

    def _tensors(self) -> list[torch.Tensor]:
        """Model tensors read by this rank's stage(s), de-duplicated."""
        seen: dict[int, torch.Tensor] = {}
        for st in self.local_stages:
            for t in st.tensors():
                seen.setdefault(id(t), t)
        return list(seen.values())

    @property
    def _last(self) -> bool:
        return self.local_stages[-1].last

    def _ops(self) -> list[tuple[str, int, int]]:
        """This rank's ``(F|B, chunk, micro_batch)`` actions for one step."""
        m = self.micro_batches
        if self.chunks > 1:
            return interleaved_schedule(self.partitions, self.chunks, m)[self.pp.rank]
        return [(op, 0, i) for op, i in make_schedule(self.schedule if self.schedule != "interleaved" else "1f1b",
                                                      self.pp.rank, self.partitions, m)]

    # ------------------------------------------------------------------ public API
    @property
    def stage_index(self) -> int:
        """This rank's pipeline stage."""
        return self.pp.rank

    @property
    def replica_index(self) -> int:
        """This rank's data-parallel replica."""
        return self.dp.rank

    def parameters(self) -> Iterator[torch.Tensor]:
        """This rank's stage parameters (hand them to any torch optimizer)."""
        return iter(self._params)

    def named_layers(self) -> list[str]:
        """Labels of this stage's graph nodes (for inspection)."""
        return [n.label for st in self.local_stages for n in st.nodes]

    def _split(self, x: Any, what: str) -> list[tuple]:
        xs = _as_tuple(x)
        m = self.micro_batches
        chunks = []
        for t in xs:
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what} must be tensors (or a tuple of tensors), got {type(t).__name__}")
            if t.ndim == 0 or t.shape[0] % m:
                n = t.shape[0] if t.ndim else 0
                raise ValueError(f"{what} batch of {n} rows is not divisible by micro_batches={m}; use a batch "
                                 f"that is a multiple of {m} per replica or change micro_batches")
            chunks.append(t.chunk(m) if m > 1 else (t,))
        return [tuple(c[i] for c in chunks) for i in range(m)]

    def _mode(self, training: bool) -> None:
        """torch modules: ``train()``/``eval()`` (Dropout, BatchNorm); Keras layers get ``training=`` per call."""
        if self.graph.kind in ("fx", "sequential", "export", "transformers") and self.model.training != training:
            self.model.train(training)

    def _context(self) -> Any:
        return self.forward_context() if self.forward_context is not None else contextlib.nullcontext()

    def _key(self, mb: tuple) -> tuple:
        return tuple((tuple(t.shape), t.dtype) for t in mb)

    def train_step(self, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor]) -> torch.Tensor:
        """One forward/backward of this replica's batch; returns the mean loss over the global batch, a float64
        scalar tensor on this rank's device (``float(loss)`` reads it): no host read here, so a training loop
        reads it once per step together with its other device values (``loom train`` with the gradient norm).

        Gradients are accumulated into ``.grad`` of :meth:`parameters` (averaged over replicas unless
        ``reduce_dp`` is ``"after"`` or ``False``), as ``loss.backward()`` would; call ``optimizer.step()`` /
        ``zero_grad()`` around it as usual.
        ``loss_fn(output, target)`` must return the *mean* over its micro-batch.
        """
        mbs = self._split(inputs, "inputs")
        tgts = self._split(targets, "targets") if self._last else [None] * self.micro_batches
        m = self.micro_batches
        self._mode(True)
        if self.reducer is not None:
            self.reducer.start(m)
        slots: dict[tuple[int, int], Any] = {}
        before = [None if t.grad is None else t.grad.clone() for _, ts in self._shared for t in ts]
        total = None  # on the loss's device: no host sync per micro-batch
        for op, k, i in self._ops():
            st = self.local_stages[k]
            if op == "F":
                tgt = None
                if st.last:
                    tgt = tgts[i][0] if len(tgts[i]) == 1 else tgts[i]
                with self._context():
                    slot, _ = st.forward(self._key(mbs[i]), mbs[i], tgt, loss_fn)
                if slot.loss is not None:
                    part = slot.loss.detach().to(torch.float64).reshape(1)
                    total = part if total is None else total + part
                slots[(k, i)] = slot
            else:
                st.backward(slots.pop((k, i)), 1.0 / m)
        if self.reducer is not None:
            self.reducer.finish()
        for st in self.local_stages:
            st.wait()
        if self._shared:
            self._sync_shared(before)
        if total is None:  # no last stage here: the pp sum below brings its loss
            total = torch.zeros(1, dtype=torch.float64, device=self._device())
        return self._mean_loss(total / m)

    def _device(self) -> torch.device:
        """Where this rank's stage computes (its parameters' device)."""
        return self._params[0].device if self._params else torch.device("cpu")

    def _mean_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The global-batch mean from this rank's share (shape ``(1,)``), as a scalar tensor on its device."""
        if self.partitions > 1:
            local = self.pp.allreduce(local, op="sum")
        if self.replicas > 1:
            local = self.dp.allreduce(local, op="avg")
        return local.reshape(())

    @torch.no_grad()
    def eval_step(self, inputs: Any, targets: Any = None, loss_fn: Callable | None = None) -> Any:
        """Forward only. With ``loss_fn`` returns the mean loss over the global batch (every rank); otherwise
        this replica's output (micro-batches concatenated), on every stage rank of the replica."""
        mbs = self._split(inputs, "inputs")
        self._mode(False)
        want_loss = loss_fn is not None
        tgts = self._split(targets, "targets") if (want_loss and self._last) else [None] * self.micro_batches
        total = torch.zeros(1, dtype=torch.float64, device=self._device())
        outs = []
        for op, k, i in self._ops():  # the forwards of the training order (valid on their own)
            if op != "F":
                continue
            st = self.local_stages[k]
            tgt = None
            if st.last and tgts[i] is not None:
                tgt = tgts[i][0] if len(tgts[i]) == 1 else tgts[i]
            with self._context():
                slot, out = st.forward(self._key(mbs[i]), mbs[i], tgt, loss_fn, grad=False)
            if slot.loss is not None:
                total += slot.loss.to(device=total.device, dtype=torch.float64).reshape(1)
            if st.last:
                outs.append((i, out))
        for st in self.local_stages:
            st.wait()
        if want_loss:
            return float(self._mean_loss(total / self.micro_batches))
        res = None
        if self._last:
            outs = [o for _, o in sorted(outs, key=lambda io: io[0])]
            res = torch.cat(outs) if isinstance(outs[0], torch.Tensor) else outs
        if self.partitions > 1:
            res = self.pp.bcast_object(res, self.partitions - 1)
        return res

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The full model state on every rank: each stage contributes the tensors it trains (one
        ``allgather_object`` over ``pp``); tensors no stage reads keep their initial values."""
        named = self._named()
        mine = {id(t) for t in self._tensors()}
        own = {k: v.detach().clone() for k, v in named.items() if id(v) in mine}
        full = {k: v.detach().clone() for k, v in named.items()}
        if self.partitions > 1:
            for part in self.pp.allgather_object(own):
                full.update(part)
        else:
            full.update(own)
        return full
