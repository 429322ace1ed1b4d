"""The training loop: mesh, model, data slices, gradient synchronization, metrics, checkpoints, resume.

Step plan (every rank, mesh ``dp x pp x ep x sp x tp``, ``tp`` fastest):

1. **Data.** Every rank draws the same global batch for this step (``batch_windows(seed, step)``) and keeps
   its rows (``dp`` and ``ep`` ranks take different rows: ``B / (dp ep)`` each) and its ``sp`` columns in the
   Ulysses/FPDT layout (contiguous for ``chunks = 1``; pieces ``r, r+P, ...`` of ``chunks x P`` for FPDT),
   whose global positions feed RoPE.
2. **Forward/backward.** ``pp = 1``: the model (``loom.models.llama``; with ``model.ffn = "moe"`` its
   ``loom.parallel.moe`` experts sharded over ``ep``) runs whole on this rank; its attention runs Ulysses or
   FPDT all-to-alls over ``sp`` inside autograd (compressed by the policy's ``sp`` codec). ``pp > 1``:
   ``loom.parallel.HybridParallel`` cuts an ``nn.Sequential`` view of the model into stages and runs the
   1F1B/GPipe schedule over ``data.micro_batches`` micro-batches; its reducer averages stage gradients over
   ``dp`` through the same dp hook (at ZeRO stage 1 without compression it leaves them to the reduce-scatter
   of step 3).
3. **Gradient sync** (see :meth:`Trainer.sync_grads`). Plain data parallel (``pp = ep = 1``, ZeRO stage 0;
   with ``sp`` only uncompressed): a ``loom.parallel.data.GradReducer`` averages the gradients over ``dp`` in
   buckets of ``compress.bucket_mb`` during backward (through the dp hook when compressing), and ``sp`` is
   summed or averaged afterwards. Otherwise gradients are flattened into buckets of
   ``compress.bucket_mb`` after backward; each bucket is reduced over ``sp`` with a plain allreduce (the fast intra-node
   axis), then replicated buckets are averaged over ``dp x ep`` and expert buckets over ``dp`` (divided by
   ``ep``) through the compression policy's dp hook (``hook(bucket, comm, index) -> mean``), or
   ``allreduce(op="avg")`` without one. Equal shard sizes make the mean of local means the global mean, so
   any mesh matches one rank up to summation order (and codec error).
   Tensor parallelism (``mesh.tp``, with dp, Ulysses sp or pp): the model is built whole and split in place
   (:func:`loom.models.parallelize.parallelize_llama`); the ``tp`` ranks of a replica take the same rows,
   their activation allreduces run inside autograd (the policy's ``tp`` codec), and no gradient is reduced
   over tp (split parameters hold their slice's gradient, replicated ones the same on every tp rank).
   Checkpoints hold whole tensors (slices gathered over tp) and ``--resume`` slices them again. Under a
   pipeline the stages are cut from the config (the same on every tp rank, whose slices may differ by a
   row) and the last stage's loss is the vocabulary-parallel cross-entropy. ZeRO 2-3 (dp x tp only): each
   tp rank shards its slices over dp (its own directory of shard files); the clipping norm sums the
   tp-split elements' squares over tp as well.
4. **Update.** Global-norm clipping (norm summed over pipeline stages, expert shards and tp slices), AdamW
   with the warm-up + cosine learning rate of this step.

ZeRO (``[zero]``): stage 1 wraps the optimizer in ``loom.parallel.ShardedOptimizer`` over the ``zero.axes``
ranks. Without compression its ``reduce_grads`` takes the place of the dp average: after the sp reduction each
group's flat gradient is reduce-scattered (mean) into this rank's master block, clipped there (squares summed
over the group, tp-split elements also over tp, and over the pipeline stages), stepped, and the blocks
all-gathered into the parameters: DDP's bytes on dp, under tp and pp as well (HybridParallel is built with
``reduce_dp="after"``). With a dp compression hook the buckets are averaged through it as in step 3 and each
rank slices its block, because the hook is an allreduce codec (the compressed reduce-scatter, with its error
feedback, is ZeRO 2-3's); that costs an allgather on top of the allreduce. (ZeRO with ``mesh.ep`` the config
refuses.) Stages 2-3 wrap the model (under a pipeline: this rank's stage, with HybridParallel's own dp reduction
off and each micro-batch's forward in the wrapper's context) in ``loom.parallel.ShardedDataParallel`` over
those ranks instead: it reduce-scatters the gradients during
backward (through the policy's dp codec and error feedback when compressing) with the factor ``1 / dp``
(a share-of-mean loss sums over sp; a local mean is also divided by sp), sp is summed afterwards when it is
not among the axes, and AdamW steps this rank's flat shards, the decoupled weight decay applied by a mask
to the elements of matrices (vectors take none, as in the unsharded groups); the clipping norm is summed over
the group and the pipeline stages. Checkpoints then add one file per rank plus a manifest (``step_N.zero/``,
per pipeline stage ``stageK/``, resharded by ``--resume`` at another dp size) before the usual stage file,
which holds the stage's full parameters for ``loom generate``.
5. **Book-keeping.** Loss and peak memory reduced as Python objects (not counted as training traffic);
   bytes per mesh axis are the deltas of ``loom.comm.stats()``; the uncompressed equivalent adds back what
   ``loom.compress.stats()`` says compression saved on that axis.

Checkpoints every ``checkpoint.every`` steps and at the end; ``resume=True`` reloads the newest complete one,
restores model, optimizer and RNG state, and continues at its step: because data is a function of the step,
the resumed curve equals the uninterrupted one exactly on CPU.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from ..comm import Communicator, Mesh, local_device, world
from ..parallel import HybridParallel
from ..parallel.data import GradReducer
from ..parallel.sequence import ring_positions
from .config import Config, ConfigError
from .data import IGNORE, batch_windows, load_corpus, packed_windows
from .grads import TrainerGrads
from .measure import COMM_TIME, StepMeter, TimedComm, _host_floats, peak_memory
from .model import Packed, build_model
from .schedule import lr_at
from .state import TrainerState

# TimedComm, COMM_TIME and peak_memory live in loom.train.measure and lr_at in loom.train.schedule; they stay
# importable from here, where users and the tests import them.
__all__ = ["Trainer", "TimedComm", "sp_layout", "lr_at", "compression_hook", "peak_memory", "COMM_TIME"]

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def compression_hook(policy: str, min_bytes: int | None = None) -> tuple[Any, Callable]:
    """``(CompressionPolicy, dp hook)`` for ``compress.policy``: a ``loom.compress`` preset and its
    ``dp_hook(policy) -> hook(flat_bucket, comm, bucket_index)`` returning the mean over ``comm``."""
    from ..compress import CompressionPolicy, dp_hook

    try:
        pol = CompressionPolicy.preset(policy, **({} if min_bytes is None else {"min_bytes": min_bytes}))
    except ValueError as exc:
        raise ConfigError(f"compress.policy = {policy!r}: {exc}") from None
    return pol, dp_hook(pol)


def sp_layout(n: int, p: int, r: int, chunks: int, ring: int = 1) -> torch.Tensor:
    """Global positions of sp rank ``r``'s tokens of a length-``n`` sequence (FPDT layout; contiguous for 1 chunk;
    the zig-zag layout of ``loom.parallel.sequence.ring_positions`` for ``ring > 1``).

    Same layout as ``loom.parallel.sequence.shard_sequence``: ``chunks x p`` pieces, rank ``r`` holds pieces
    ``r, r+p, r+2p, ...``.
    """
    if ring > 1:
        return ring_positions(n, p, ring, r, chunks=chunks)  # host: it indexes the host batch, then moves
    c = n // (p * chunks)
    starts = (torch.arange(chunks, device="cpu") * p + r) * c  # host: it indexes the host batch, then moves
    return (starts[:, None] + torch.arange(c, device="cpu")[None, :]).reshape(-1)


class Trainer(TrainerState, TrainerGrads):
    """One ``loom train`` run on ``comm`` (default: the world). Its checkpoints are :class:`TrainerState`'s, its
    gradient sync and clipping :class:`TrainerGrads`'.

    Args:
        cfg: the validated run configuration.
        comm: communicator to lay the mesh over (tests pass sub-communicators to run references in-process).
        resume: continue from the newest complete checkpoint in the checkpoint directory (none: start fresh).
        out: run directory override (default ``cfg.train.out``).
        quiet: no progress display or plots (tests).
        corpus: the corpus of ``cfg.data`` when the caller has loaded it already (``loom train`` checks it
            before the ranks communicate); default: loaded here.
    """

    def __init__(self, cfg: Config, comm: Communicator | None = None, *, resume: bool = False,
                 out: str | Path | None = None, quiet: bool = False, corpus: Any = None):
        self.cfg = cfg
        self.comm = comm or world()
        cfg.validate_world(self.comm.size)
        self.out = Path(out or cfg.train.out)
        self.ckpt_dir = Path(cfg.checkpoint.dir) if cfg.checkpoint.dir else self.out / "checkpoints"
        self.quiet = quiet
        # Everything that can reject the config runs before the first collective, so every rank fails alike
        # and none is left waiting for a peer that has already exited.
        self.policy = self.hook = None
        self._stage_comm: Communicator | None = None  # this stage's ranks, its checkpoint writer first
        if cfg.compress.policy != "none":
            self.policy, self.hook = compression_hook(
                cfg.compress.policy, None if cfg.compress.min_kb < 0 else int(cfg.compress.min_kb * 1024))
        self.corpus = corpus if corpus is not None else load_corpus(cfg.data)
        self._lay_mesh()
        # ZeRO-1 as a reduce-scatter plus an allgather (DDP's bytes) over the zero axes, also under tp (each tp
        # rank's slices are identical over dp) and a pipeline (HybridParallel leaves the dp reduction to it).
        # A dp compression hook keeps the allreduce and slices its block: the hook is an allreduce codec, and
        # the compressed reduce-scatter (with its error feedback) lives in ZeRO 2-3's engine. ep never gets
        # here: the config refuses ZeRO with mesh.ep > 1 (replicated and expert parameters would need two
        # groups, dp x ep and dp).
        self._zero1_rs = cfg.zero.stage == 1 and self.hook is None and self.ep is None
        self.device = self._pick_device()
        self.dtype = _DTYPES[cfg.train.dtype]
        # ZeRO 2-3 with a master dtype: the model is built (and its shards kept) in it, computing in train.dtype.
        self.master_dtype = _DTYPES[cfg.zero.master_dtype] if cfg.zero.master_dtype else self.dtype
        torch.manual_seed(cfg.train.seed)
        self._build_model()
        self._place_parameters()
        self.opt = self._make_optimizer()
        self.start_step = 0
        self.resumed_from_nothing = False
        # The step at which the cosine reaches min_lr; a resumed run keeps its checkpoint's (see _resume).
        self.lr_horizon = cfg.optim.decay_steps or cfg.train.steps
        self.schedule_note: str | None = None
        if resume:
            self._resume()
            self.resumed_from_nothing = self.start_step == 0
        self._buckets = self._make_buckets()
        self.reducer = self._make_reducer()

    def _build_model(self) -> None:
        """``self.tm`` and ``self.model`` on this rank: the experts' ep group, the attention's sp group (timed, with
        the policy's sp codec), the tp link, built on the meta device where a pipeline or ZeRO-3 materialises it,
        multi-path expert routing, the checkpoint's tokenizer, and the positions of this rank's tokens."""
        cfg = self.cfg
        ep_comm = None
        if cfg.model.ffn == "moe":
            ep_comm = self.ep if self.ep is not None else self.comm.split(self.comm.rank, 0, name="ep")
        sp_codec = self.policy.codec_for("sp") if self.policy is not None else None
        sp_min = self.policy.min_bytes if self.policy is not None else None
        # FPDT runs on a one-rank sp group too (its chunks and offload are the point there); Ulysses needs two
        model_sp = self.sp if self.sp is not None or cfg.sequence.algorithm != "fpdt" else self.mesh["sp"]
        sp_comm = TimedComm(model_sp, "sp", sp_codec, sp_min) if model_sp is not None else None
        # Under a pipeline the model is built on the meta device and HybridParallel materialises only this
        # rank's stage (the same weights as a whole build: each tensor's init depends only on its name); at
        # ZeRO stage 3 without one, ShardedDataParallel materialises it bucket by bucket, keeping this rank's shard
        # (not yet with [multipath], whose MoE wiring has not been checked on a meta model).
        tp_link = None
        if self.tp is not None:
            from ..parallel.tensor import TPLink

            tp_link = TPLink(self.tp, self.policy.codec_for("tp") if self.policy is not None else None,
                             **({"min_bytes": self.policy.min_bytes} if self.policy is not None else {}),
                             sequence_parallel=cfg.mesh.tp_sequence_parallel)
        self.tm = build_model(cfg, sp_comm=sp_comm, ep_comm=ep_comm, dtype=self.master_dtype, device=self.device,
                              meta=(self.pp is not None or cfg.zero.stage == 3 and not cfg.multipath.enabled)
                              and self.tp is None, tp=tp_link)  # tp slices a whole build
        if cfg.multipath.enabled and ep_comm is not None:  # [multipath]: expert all-to-allv over planned paths
            from ..parallel.moe import use_multipath

            try:
                use_multipath(self.tm.module, ep_comm, topology=cfg.multipath.topology,
                              min_bytes=cfg.multipath.min_bytes, learn=cfg.multipath.learn)
            except ValueError as exc:  # every rank resolves the same topology: all refuse alike
                raise ConfigError(f"multipath.topology = {cfg.multipath.topology!r}: {exc}") from None
        self.model = self.tm.module
        if hasattr(self.tm, "tokenize_corpus"):  # a transformers checkpoint's own tokenizer
            self.corpus = self.tm.tokenize_corpus(self.corpus)
        self.positions = sp_layout(cfg.padded_seq_len, cfg.mesh.sp, self.sp_rank, cfg.sequence.chunks,
                                   cfg.mesh.sp_ring).to(self.device)
        self.tm.positions.value = self.positions

    def _place_parameters(self) -> None:
        """The parameters this rank trains (its pipeline stage's under ``mesh.pp``), their names, the dims tp
        splits, and ZeRO 2-3's wrapper (whose materialising of a meta model installs new parameter objects)."""
        cfg = self.cfg
        self.hybrid = None
        if self.pp is not None:
            self.hybrid = self._make_hybrid()
            self.params = list(self.hybrid.parameters())
            self.stage, self.stages = self.hybrid.stage_index, cfg.mesh.pp
        else:
            self.params = list(self.model.parameters())
            self.stage, self.stages = 0, 1
        ids = {id(p) for p in self.params}
        self.param_names = [n for n, p in self.model.named_parameters() if id(p) in ids]
        self._tp_dims: dict[str, int] = {}  # tp-split parameters: name -> the dim they are split along
        if self.tp is not None:
            from ..parallel.tensor import split_dims

            self._tp_dims = split_dims(self.model)
        named = dict(self.model.named_parameters())
        self.params = [named[n] for n in self.param_names]
        self.sdp = self._make_sharded() if cfg.zero.stage >= 2 else None
        if self.sdp is not None:
            named = dict(self.model.named_parameters())
            self.params = [named[n] for n in self.param_names]

    def _lay_mesh(self) -> None:
        """The mesh over ``self.comm``, this rank's coordinates, and a communicator per axis longer than 1."""
        cfg = self.cfg
        self.mesh = Mesh(cfg.mesh.axes(), comm=self.comm)
        c = self.mesh.coords
        self.dp_rank, self.sp_rank, self.pp_rank = c.get("dp", 0), c.get("sp", 0), c.get("pp", 0)
        self.ep_rank = c.get("ep", 0)
        self.dp = self.mesh["dp"] if cfg.mesh.dp > 1 else None
        self.sp = self.mesh["sp"] if cfg.mesh.sp > 1 else None
        self.pp = self.mesh["pp"] if cfg.mesh.pp > 1 else None
        self.ep = self.mesh["ep"] if cfg.mesh.ep > 1 else None
        self.tp = self.mesh["tp"] if cfg.mesh.tp > 1 else None
        self.tp_rank = c.get("tp", 0)
        # Replicated parameters are averaged over every rank that sees other data: dp and ep together.
        self.rep = self.mesh[("dp", "ep")] if cfg.mesh.ep > 1 else self.dp

    def _pick_device(self) -> torch.device:
        """The CPU, or this rank's GPU (``cuda:local_rank``, made the current device by ``loom.comm.local_device``)."""
        if self.cfg.train.device != "cuda":
            return torch.device("cpu")
        try:
            return local_device("cuda")
        except ValueError as exc:
            raise ConfigError(f"train.device = 'cuda': {exc}") from None

    def _make_sharded(self):
        """ZeRO stages 2-3: the model in ``ShardedDataParallel`` over the ``zero.axes`` ranks.

        Gradients are summed over the group and scaled by ``1 / dp``: the loss is this rank's share of the
        sequence mean (summed over sp) or, without one, a local mean (then also divided by sp when sp is in
        the group). The LM head is kept gathered through forward: the loss reads its weight directly. Under a
        pipeline the wrapped module is this rank's stage (its units of the pipeline view, whose modules all
        run through their hooks), HybridParallel leaves the dp reduction to it and runs every micro-batch's
        forward in its ``forward_context``.
        """
        from ..parallel import ShardedDataParallel
        from ..parallel.meta import init_as_built, is_meta

        cfg, z = self.cfg, self.cfg.zero
        module, keep = self.model, [m for m in (getattr(self.model, "head", None),) if isinstance(m, torch.nn.Module)]
        init = None
        if self.hybrid is not None:
            module = torch.nn.ModuleList([u for u in self.tm.pipeline if any(not p.is_meta for p in u.parameters())])
            keep = []
        elif is_meta(module):  # initialised as built, then cast: the values of a real build's .to(master dtype)
            init = init_as_built(module)
            module.to(dtype=self.master_dtype)
        try:
            sdp = ShardedDataParallel(module, self.mesh[tuple(z.axes)], stage=z.stage, bucket_mb=z.bucket_mb,
                                      reduce="sum", compress=self.policy, keep=keep, compute_dtype=self.dtype,
                                      init=init, device=self.device, progress=z.progress)
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"zero.stage = {z.stage}: {exc}") from None
        sdp.scale = 1.0 / cfg.mesh.dp / (cfg.mesh.sp if "sp" in z.axes and not self._sp_share else 1)
        if self.hybrid is not None:
            self.hybrid.forward_context = sdp.forward_context
        return sdp

    def _make_reducer(self) -> GradReducer | None:
        """Plain data parallel: the dp average runs during backward (bucketed, overlapped; see
        :mod:`loom.parallel.data`). Not under a pipeline (HybridParallel has its own), ZeRO, or ep (two groups of
        buckets over two communicators), nor with sp when compressing (the dp codec would then see each sp
        rank's partial gradient instead of the sp sum the after-backward path compresses)."""
        cfg = self.cfg
        if (self.dp is None or self.hybrid is not None or self.sdp is not None or cfg.zero.stage != 0
                or self.ep is not None or (self.sp is not None and self.hook is not None)):
            return None
        try:
            return GradReducer([p for p in self.params if p.requires_grad], self.dp, grad_hook=self.hook,
                               bucket_mb=cfg.compress.bucket_mb, progress=cfg.zero.progress)
        except ValueError as exc:  # progress = "thread" without MPI_THREAD_MULTIPLE
            raise ConfigError(f"zero.progress = {cfg.zero.progress!r}: {exc}") from None

    def _decay_masks(self) -> list[torch.Tensor]:
        """Per flat shard: which of its elements belong to matrices (they take weight decay)."""
        out = []
        r = self.sdp.comm.rank
        for b in self.sdp.buckets:
            mask = torch.zeros(b.padded, dtype=torch.bool, device=self.sdp.device)
            for p, off in zip(b.params, b.offsets):
                mask[off:off + p.numel()] = p.ndim >= 2
            out.append(mask[r * b.shard:(r + 1) * b.shard])
        return out

    def _make_optimizer(self) -> torch.optim.Optimizer:
        """AdamW over this rank's parameters (no weight decay on vectors), sharded under ZeRO stage 1; under
        stages 2-3 over this rank's flat shards, the decay applied by :meth:`update`."""
        cfg, o = self.cfg, self.cfg.optim
        if self.sdp is not None:
            self._decay = self._decay_masks()
            return torch.optim.AdamW(list(self.sdp.parameters()), lr=o.lr, betas=(o.beta1, o.beta2),
                                     weight_decay=0.0, foreach=False)
        opt = torch.optim.AdamW(
            [{"params": [p for p in self.params if p.ndim >= 2], "weight_decay": o.weight_decay},
             {"params": [p for p in self.params if p.ndim < 2], "weight_decay": 0.0}],
            lr=o.lr, betas=(o.beta1, o.beta2), foreach=False)
        if cfg.zero.stage == 1:
            from loom.parallel import ShardedOptimizer

            opt = ShardedOptimizer.wrap(opt, self.mesh[cfg.zero.axes], reduce=self._zero1_rs)
        return opt

    def _make_hybrid(self) -> HybridParallel:
        cfg = self.cfg
        schedule = cfg.mesh.schedule
        balance: Any = "params"
        if self.tp is not None:  # tp ranks hold uneven slices: split by the config, the same on every tp rank
            from .memory import stage_split

            balance = [hi - lo for lo, hi in stage_split(cfg)]
        try:
            return HybridParallel(self.tm.pipeline, partitions=cfg.mesh.pp, replicas=cfg.mesh.dp,
                                  micro_batches=cfg.data.micro_batches, schedule=schedule, balance=balance,
                                  mesh=self.mesh, grad_hook=self.hook, compression=self.policy,
                                  bucket_mb=cfg.compress.bucket_mb, device=self.device, dtype=self.master_dtype,
                                  reduce_dp=False if cfg.zero.stage >= 2 else "after" if self._zero1_rs else True)
        except ValueError as exc:
            raise ConfigError(f"pipeline setup: {exc}") from None


    # ------------------------------------------------------------------ pieces of a step
    def _is_expert(self, name: str) -> bool:
        """Expert weights are sharded over ``ep`` (each rank holds its experts' slice along dim 0)."""
        return self.ep is not None and (name.endswith(".ffn.moe.w1") or name.endswith(".ffn.moe.w2"))

    def local_batch(self, stream: torch.Tensor, step: int, stream_id: int = 0):
        """This rank's ``(inputs, targets, packed)`` of the global batch of ``step`` (rows by dp, columns by sp
        layout); ``packed`` is a :class:`~loom.train.model.Packed` with ``data.pack``, else None."""
        d = self.cfg.data
        docs = self.corpus.docs(stream) if d.pack else None
        if docs is not None:
            x, y, doc, pos = packed_windows(stream, docs, seed=self.cfg.train.seed, step=step, batch=d.batch,
                                            seq_len=d.seq_len, stream_id=stream_id)
        else:
            x, y = batch_windows(stream, seed=self.cfg.train.seed, step=step, batch=d.batch, seq_len=d.seq_len,
                                 stream_id=stream_id)
        m = self.cfg.mesh
        b = d.batch // (m.dp * m.ep)
        r0 = (self.dp_rank * m.ep + self.ep_rank) * b  # ep ranks take different rows, like dp replicas
        cols = self.positions.cpu()
        pad = self.cfg.padded_seq_len - d.seq_len
        if pad:  # at the end: the loss ignores pad targets, and causal attention never shows a pad to a real token
            x = torch.nn.functional.pad(x, (0, pad), value=0)
            y = torch.nn.functional.pad(y, (0, pad), value=IGNORE)
            if docs is not None:  # the pads are a document of their own, at position 0 onwards
                doc = torch.nn.functional.pad(doc, (0, pad), value=int(doc.max()) + 1)
                pos = torch.nn.functional.pad(pos, (0, pad), value=0)

        def mine(t: torch.Tensor) -> torch.Tensor:
            return t[r0:r0 + b][:, cols].to(self.device)

        if docs is None:
            return mine(x), mine(y), None
        # The global count is known on every rank (each draws the whole batch): no collective for it.
        count = max(1, int((y != IGNORE).sum())) / (m.dp * m.ep)
        return mine(x), mine(y), Packed(doc_ids=mine(doc), positions=mine(pos), count=count)

    def update(self) -> None:
        """The optimizer step; under ZeRO 2-3 the masked decoupled weight decay first (AdamW's own
        ``p *= 1 - lr wd``, on matrix elements only) and the updated blocks gathered after (stage 2)."""
        if self.sdp is None:
            self.opt.step()
            return
        wd = self.cfg.optim.weight_decay
        if wd:
            factor = 1 - self.opt.param_groups[0]["lr"] * wd
            with torch.no_grad():
                for sh, mask in zip(self.sdp.shards, self._decay):
                    sh[mask] = sh[mask] * factor
        self.sdp.update(self.opt)
        self.sdp.zero_grad()

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, packed: Packed | None = None) -> torch.Tensor:
        """Loss (mean over this rank's tokens, or over dp x pp under a pipeline) after filling ``.grad``: a
        detached tensor on the model's device, read on the host once per step with the gradient norm.
        ``packed``: packed documents (``local_batch``'s third value)."""
        if self.hybrid is not None:
            inputs, loss_fn = self._pipeline_batch(x, packed)
            if self.sdp is None:
                return self.hybrid.train_step(inputs, y, loss_fn)
            # One backward per micro-batch and stage: their reduce-scatters still run as each one computes, but
            # the wait for them is the step's (sync_grads), not every micro-batch's end.
            with self.sdp.no_sync():
                return self.hybrid.train_step(inputs, y, loss_fn)
        if self.reducer is not None:
            self.reducer.start(1)
        loss = self._loss(x, y, packed)
        if self.reducer is not None:
            self.reducer.prepare(loss)  # a tensor this loss cannot reach does not hold back its bucket
        loss.backward()
        return self._as_mean(loss.detach())

    def _pipeline_batch(self, x: torch.Tensor, packed: Packed | None) -> tuple[Any, Callable]:
        """The pipeline's inputs and loss_fn: ``x`` and the mean over each micro-batch; with packed documents
        ``(x, positions, doc_ids)`` (graph inputs every block reads) and each micro-batch's summed losses times
        ``micro_batches x sp / count``: the pipeline averages its micro-batches and sp averages gradients
        under a pipeline, so the replica's loss is its summed losses over the packed count, as without one."""
        if packed is None:
            return x, self.tm.loss_fn
        scale = self.cfg.data.micro_batches * self.cfg.mesh.sp / packed.count
        return (x, packed.positions, packed.doc_ids), self.tm.packed_loss_fn(scale)

    def _loss(self, x: torch.Tensor, y: torch.Tensor, packed: Packed | None) -> torch.Tensor:
        """The whole model's loss (in ZeRO 2-3's context); packed documents only where there are some."""
        args = (x, y) if packed is None else (x, y, packed)
        return self.sdp.call(self.tm.loss, *args) if self.sdp is not None else self.tm.loss(*args)

    @property
    def _sp_share(self) -> bool:
        """The whole-model loss is this rank's share of the sequence mean (sum over sp), not a local mean."""
        return self.tm.sp_sum and self.hybrid is None

    def _as_mean(self, loss):
        # A share of the sequence mean times sp is this rank's local mean (equal token counts per sp rank),
        # so averaging over all ranks gives the global mean either way. (Packed documents: the shares are of
        # the global count, times dp x ep; the average over all ranks is again the global mean.)
        # A tensor is widened first: the product is then the one float(loss) * sp gives on the host.
        if isinstance(loss, torch.Tensor):
            loss = loss.to(torch.float64)
        return loss * self.cfg.mesh.sp if self._sp_share else loss

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean held-out loss over ``train.eval_batches`` fixed batches, averaged over all ranks."""
        self.model.eval()
        parts = []  # device scalars, read on the host together
        for k in range(self.cfg.train.eval_batches):
            x, y, packed = self.local_batch(self.corpus.heldout, k, stream_id=1)
            if self.hybrid is not None:
                inputs, loss_fn = self._pipeline_batch(x, packed)
                parts.append(self.hybrid.eval_step(inputs, y, loss_fn))
            else:
                parts.append(self._as_mean(self._loss(x, y, packed)))
        tot = sum(_host_floats(*parts)) if parts else 0.0
        self.model.train()
        return self.comm.allreduce_object(tot / self.cfg.train.eval_batches) / self.comm.size

    # ------------------------------------------------------------------ the loop
    def run(self, until: int | None = None) -> list[dict[str, Any]]:
        """Train to ``train.steps`` (or stop after step ``until``, as an interrupted job would).

        Returns the per-step records of this call (losses averaged over all ranks).
        """
        from .progress import MetricsLog, write_plots

        cfg, lead = self.cfg, self.comm.rank == 0
        log, display = self._open_log()
        records: list[dict[str, Any]] = []
        self.model.train()
        stop = cfg.train.steps if until is None else min(until, cfg.train.steps)
        for step in range(self.start_step, stop):
            rec = self._train_step(step)
            records.append(rec)
            done = rec["step"]
            if lead:
                log.write(rec)
                if done % cfg.train.log_every == 0 or done == cfg.train.steps:
                    display.update(rec)
            every = cfg.checkpoint.every
            if (every and done % every == 0) or done == cfg.train.steps:
                self.save(done)
        display.close()
        if lead:
            log.close()
            if cfg.train.plots and not self.quiet and stop == cfg.train.steps:
                allrecs = MetricsLog.read(self.out / "metrics.jsonl")
                self.plots = write_plots(allrecs, self.out / "plots")
        return records

    def _open_log(self):
        """Rank 0's metrics log (from the resumed step on) and the progress display, which says where a resumed
        run goes on; ``(None, a silent display)`` elsewhere and when quiet."""
        from .progress import Display, MetricsLog

        cfg, lead = self.cfg, self.comm.rank == 0
        show = lead and not self.quiet
        log = MetricsLog(self.out / "metrics.jsonl", self.start_step) if lead else None
        display = Display(cfg.train.progress if show else "none", cfg.train.steps, self.start_step)
        if show and self.start_step:
            display.message(f"resumed from {self.ckpt_dir} at step {self.start_step}")
            if self.schedule_note:
                display.message(self.schedule_note)
        elif show and self.resumed_from_nothing:
            display.message(f"--resume: no checkpoint in {self.ckpt_dir} yet; starting at step 0")
        return log, display

    def _train_step(self, step: int) -> dict[str, Any]:
        """Optimizer step ``step`` (0-based) and its record: the loss averaged over all ranks, the held-out loss on
        an evaluation step, and what :class:`~loom.train.measure.StepMeter` measured."""
        cfg, comm = self.cfg, self.comm
        meter = StepMeter()
        lr = lr_at(step, cfg, self.lr_horizon)
        for g in self.opt.param_groups:
            g["lr"] = lr
        x, y, packed = self.local_batch(self.corpus.train, step)
        self.opt.zero_grad(set_to_none=True)
        loss = self.forward_backward(x, y, packed)
        sync_s = self.sync_grads()
        gnorm = self.clip()
        self.update()
        loss, gnorm = _host_floats(loss, gnorm)  # the step's one read of device values (waits for it)
        measured = meter.stop(sync_s)  # before the reductions below, which are not the step's traffic
        done = step + 1
        # pp ranks of a replica already agree on the loss; averaging over everyone is still the global mean.
        loss_avg = comm.allreduce_object(loss) / comm.size
        peak = comm.allreduce_object(peak_memory(self.device), op="max")
        eval_loss = None
        if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
            eval_loss = self.evaluate()
        tokens = cfg.data.batch * cfg.data.seq_len
        return {"kind": "step", "step": done, "loss": loss_avg, "eval_loss": eval_loss, "lr": lr, "grad_norm": gnorm,
                "tokens": done * tokens, "tokens_per_s": tokens / measured["step_time"], **measured,
                "peak_mem": peak, "peak_mem_of": "cuda" if self.device.type == "cuda" else "rss"}  # see peak_memory
