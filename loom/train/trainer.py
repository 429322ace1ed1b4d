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

import math
import resource
import time
from pathlib import Path
from typing import Any, Callable

import torch

from ..comm import Communicator, Mesh, local_device, stats, world
from .. import stats as _stats
from ..stats import Axis, flat_axis
from ..compress import stats as compress_stats
from ..parallel import HybridParallel
from ..parallel.data import GradReducer, dp_stats
from ..parallel.offload import transfer_stats
from ..parallel.sequence import ring_positions
from ..parallel.zero import zero_stats
from . import checkpoint as ckpt
from .config import Config, ConfigError, config_to_dict
from .data import IGNORE, batch_windows, load_corpus, packed_windows
from .model import Packed, build_model

__all__ = ["Trainer", "TimedComm", "sp_layout", "lr_at", "compression_hook", "peak_memory", "COMM_TIME"]

# Seconds spent inside sequence-parallel calls (forward and backward), read by the step-time breakdown.
COMM_TIME = _stats.AxisCounter("time", "comm")

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def lr_at(step: int, cfg: Config, horizon: int | None = None) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, then cosine or constant. The cosine
    reaches ``optim.min_lr`` at step ``horizon`` (default ``optim.decay_steps``, else ``train.steps``) and stays
    there."""
    o = cfg.optim
    if o.warmup and step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    if o.schedule == "constant":
        return o.lr
    span = max(1, (horizon or o.decay_steps or cfg.train.steps) - o.warmup)
    frac = min(1.0, (step - o.warmup) / span)
    return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1 + math.cos(math.pi * frac))


def peak_memory(device: torch.device) -> int:
    """Peak memory of this rank in bytes: CUDA allocator peak, or the process's max RSS on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def compression_hook(policy: str, min_bytes: int | None = None) -> tuple[Any, Callable]:
    """``(CompressionPolicy, dp hook)`` for ``compress.policy``: a ``loom.compress`` preset and its
    ``dp_hook(policy) -> hook(flat_bucket, comm, bucket_index)`` returning the mean over ``comm``."""
    from ..compress import CompressionPolicy, dp_hook

    try:
        pol = CompressionPolicy.preset(policy, **({} if min_bytes is None else {"min_bytes": min_bytes}))
    except ValueError as exc:
        raise ConfigError(f"compress.policy = {policy!r}: {exc}") from None
    return pol, dp_hook(pol)


def _wire_bytes() -> dict[str, int]:
    return {name: sum(ops.values()) for name, ops in stats().items()}


def _offload_bytes() -> int:
    """Bytes moved between device and host memory by FPDT's chunk stores so far (loom.parallel.offload)."""
    t = transfer_stats()
    return int(t.get("to_host", 0) + t.get("to_device", 0))


def _saved_bytes() -> dict[str, int]:
    """Per communicator name: uncompressed minus on-the-wire bytes of loom.compress collectives so far."""
    return {k: v.get("raw", 0) - v.get("wire", 0) for k, v in compress_stats().items()}


class TimedComm:
    """A communicator proxy for the attention code: times its calls and applies the policy's ``sp`` codec.

    The attention code (``loom.parallel.sequence``) only calls ``size``/``rank``/``alltoall`` (and the loss an
    ``allreduce`` of a token count). Seconds spent in calls are added to ``COMM_TIME[key]`` for the step-time
    breakdown; with a codec, ``alltoall`` becomes ``loom.compress.alltoallv`` with equal counts (each block
    for another rank encoded, the own block kept exact), so the bytes saved show up in
    ``loom.compress.stats()[key]``.
    """

    _TIMED = frozenset({"alltoall", "alltoallv", "allreduce", "allgather", "send", "recv", "sendrecv",
                        "reduce_scatter", "bcast", "ialltoallv", "iallreduce", "iallgather"})

    def __init__(self, comm: Communicator, key: str, codec: Any = None, min_bytes: int | None = None):
        self._comm, self._key, self._codec = comm, key, codec
        self._min = {} if min_bytes is None else {"min_bytes": min_bytes}
        COMM_TIME.setdefault(key, 0.0)

    def _compressed_alltoall(self, tensor: torch.Tensor, *, out: torch.Tensor | None = None) -> torch.Tensor:
        from ..compress import alltoallv

        p = self._comm.size
        counts = [tensor.shape[0] // p] * p
        res, _ = alltoallv(tensor, counts, self._comm, self._codec, recv_counts=counts, **self._min)
        if out is not None:
            out.copy_(res)
            return out
        return res

    def __getattr__(self, name: str) -> Any:
        if name == "alltoall" and self._codec is not None:
            attr = self._compressed_alltoall
        else:
            attr = getattr(self._comm, name)
        if name not in self._TIMED:
            return attr

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return attr(*args, **kwargs)
            finally:
                COMM_TIME[self._key] += time.perf_counter() - t0

        return timed


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


def _host_floats(*values: torch.Tensor | float) -> list[float]:
    """Python floats of scalar tensors (on any device) and floats, with one device-to-host copy in all."""
    ts = [v for v in values if isinstance(v, torch.Tensor)]
    if not ts:
        return [float(v) for v in values]
    got = iter(torch.stack([t.detach().reshape(()).to(device=ts[0].device, dtype=torch.float64) for t in ts])
               .tolist())
    return [next(got) if isinstance(v, torch.Tensor) else float(v) for v in values]


class Trainer:
    """One ``loom train`` run on ``comm`` (default: the world).

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
        self.policy = None
        self.hook = None
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
        ep_comm = None
        if cfg.model.ffn == "moe":
            ep_comm = self.ep if self.ep is not None else self.comm.split(self.comm.rank, 0, name="ep")
        self.device = self._pick_device()
        self.dtype = _DTYPES[cfg.train.dtype]
        # ZeRO 2-3 with a master dtype: the model is built (and its shards kept) in it, computing in train.dtype.
        self.master_dtype = _DTYPES[cfg.zero.master_dtype] if cfg.zero.master_dtype else self.dtype
        torch.manual_seed(cfg.train.seed)
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
        if self.sdp is not None:  # materialising a meta model installs new parameter objects
            named = dict(self.model.named_parameters())
            self.params = [named[n] for n in self.param_names]
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

    def _zero_files(self, zero_dir: Path, write: bool = False) -> Path:
        """Where this rank's ZeRO group keeps its files: ``zero_dir`` itself, or when sp ranks are separate groups
        (``zero.axes`` without sp) one subdirectory per sp rank: same blocks, but their own error feedback."""
        from ..parallel.zero import MANIFEST

        if self.stages > 1:  # one ZeRO layout per pipeline stage
            zero_dir = zero_dir / f"stage{self.stage}"
        if self.tp is not None:  # each tp rank shards its own slices over dp
            zero_dir = zero_dir / f"tp{self.tp_rank}"
        split = self.sp is not None and "sp" not in self.cfg.zero.axes
        if write:
            return zero_dir / f"sp{self.sp_rank}" if split else zero_dir
        for d in (zero_dir / f"sp{self.sp_rank}", zero_dir, zero_dir / "sp0"):  # saved by another split: replica 0
            if (d / MANIFEST).exists():
                return d
        return zero_dir  # load_sharded names what is missing

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """This rank's trained parameters (its pipeline stage's) by model name, whole: under ZeRO 2-3 gathered
        from the shards (collective over the zero axes), else copies of the live ones."""
        named = dict(self.model.named_parameters())
        if self.sdp is None:
            return {n: named[n].detach().cpu().clone() for n in self.param_names}
        full = self.sdp.state_dict()  # keys of the wrapped module (the model, or this stage's units)
        key = {id(p): n for n, p in self.sdp.module.named_parameters()}
        return {n: full[key[id(named[n])]].detach().cpu() for n in self.param_names}

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

    # ------------------------------------------------------------------ state
    def _resume(self) -> None:
        step = ckpt.latest(self.ckpt_dir, stages=self.stages)
        # Every rank must agree on the step (a shared file system is assumed; check it).
        steps = self.comm.allgather_object(step)
        if len(set(steps)) != 1:
            raise RuntimeError(f"ranks see different latest checkpoints in {self.ckpt_dir}: {steps}")
        if step is None:
            return
        state = ckpt.load(ckpt.stage_path(self.ckpt_dir, step, self.stage))
        why = ckpt.resume_refusal(state, config_to_dict(self.cfg), f"the newest checkpoint in {self.ckpt_dir} "
                                                                    f"(step {step})")
        if why:
            raise ConfigError(why)
        if state.get("stages", 1) != self.stages or list(state.get("params", self.param_names)) != self.param_names:
            raise ConfigError(f"checkpoint {self.ckpt_dir} step {step} was written with {state.get('stages')} "
                              f"pipeline stages and a different layer split; resume with the same mesh.pp")
        missing = [n for n in self.param_names if n not in state["model"]]
        if missing:
            raise ConfigError(f"checkpoint step {step} lacks parameters {missing[:3]}...; it is not from this model")
        if self.sdp is not None:
            self.sdp.load_sharded(self._zero_files(self.ckpt_dir / state["zero"]), self.opt)  # reshards
        else:
            self._load_full(state)
        self._restore_compression(state, step)
        ckpt.restore_rng(state["rng"], self.device)
        self.start_step = int(state["step"])
        self._keep_schedule(state)

    def _keep_schedule(self, state: dict[str, Any]) -> None:
        """The learning-rate schedule of a resumed run: the checkpoint's horizon (the first run's
        ``train.steps``, or its ``optim.decay_steps``) unless ``optim.decay_steps`` sets one, so a longer or
        shorter ``train.steps`` continues the rate instead of restarting the cosine. Where the two differ at the
        resume step, :attr:`schedule_note` says so in one line with both rates."""
        saved = state.get("lr_horizon") or state.get("config", {}).get("train", {}).get("steps")
        if not saved:  # written before the horizon was recorded, without a config: nothing to keep
            return
        cfg, step, wanted = self.cfg, self.start_step, self.cfg.optim.decay_steps
        kept = lr_at(step, cfg, int(saved))
        self.lr_horizon = wanted or int(saved)
        if cfg.optim.schedule == "constant" or wanted == saved or (not wanted and cfg.train.steps == saved):
            return
        if wanted:
            self.schedule_note = (f"learning rate: optim.decay_steps = {wanted} replaces the checkpoint's horizon of "
                                  f"{saved} steps: {kept:.2e} -> {lr_at(step, cfg, wanted):.2e} at step {step}")
        else:
            self.schedule_note = (f"learning rate: train.steps = {cfg.train.steps} but the schedule keeps the "
                                  f"checkpoint's horizon of {saved} steps, so it continues at {kept:.2e} (min_lr "
                                  f"{cfg.optim.min_lr:.2e} from step {saved}); --optim.decay_steps="
                                  f"{cfg.train.steps} would stretch it: {lr_at(step, cfg, cfg.train.steps):.2e} "
                                  f"at step {step}")

    def _load_full(self, state: dict[str, Any]) -> None:
        """Parameters and optimizer state from a one-file checkpoint (stages 0-1)."""
        named = dict(self.model.named_parameters())
        optim = state["optim"]
        with torch.no_grad():
            for n in self.param_names:
                named[n].copy_(self._my_shard(n, state["model"][n]))
        if self.ep is not None or self._tp_dims:  # checkpoints hold whole tensors: keep this rank's Adam moments
            order = self._opt_order()
            name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
            for idx, st in optim["state"].items():
                n = name_of[id(order[int(idx)])]
                for k in ("exp_avg", "exp_avg_sq"):
                    if k in st:
                        st[k] = self._my_shard(n, st[k])
        self.opt.load_state_dict(optim)

    def _opt_order(self) -> list[torch.nn.Parameter]:
        """The parameters in the order of the optimizer's (unsharded) state-dict indices."""
        if hasattr(self.opt, "inner"):  # ZeRO-1: ShardedOptimizer's groups hold flat masters
            return [p for ps in self.opt.params for p in ps]
        return [p for g in self.opt.param_groups for p in g["params"]]

    def _compression_states(self) -> dict[int, Any] | None:
        """Every rank's compression state by world rank, gathered to its stage's checkpoint writer (``None`` on
        the other ranks and without compression). Error-feedback residuals differ from rank to rank."""
        if self.policy is None:
            return None
        writer = self.dp_rank == 0 and self.sp_rank == 0 and self.ep_rank == 0 and self.tp_rank == 0
        if self._stage_comm is None:
            self._stage_comm = self.comm.split(self.stage, 0 if writer else self.comm.rank + 1, name="stage")
        mine = {"policy": self.policy.state_dict(), "hook": self.hook.state_dict() if self.hook else {}}
        got = self._stage_comm.gather_object((self.comm.rank, mine), 0)
        return dict(got) if writer and got is not None else None

    def _restore_compression(self, state: dict[str, Any], step: int) -> None:
        saved = state.get("compress")
        if self.policy is None or saved is None:
            return
        mine = saved.get(self.comm.rank)
        if mine is None:
            raise ConfigError(f"checkpoint {self.ckpt_dir} step {step} has no compression state for rank "
                              f"{self.comm.rank}; resume on the same mesh, or with compress.policy = 'none'")
        self.policy.load_state_dict(mine["policy"])
        if self.hook is not None and mine["hook"]:
            self.hook.load_state_dict(mine["hook"])

    def _my_shard(self, name: str, full: torch.Tensor) -> torch.Tensor:
        """This ep rank's experts of a full expert tensor (dim 0), this tp rank's slice of a tp-split one;
        other tensors unchanged."""
        if name in self._tp_dims:
            from ..parallel.tensor import shard_range

            d = self._tp_dims[name]
            lo, hi = shard_range(full.shape[d], self.tp.size, self.tp_rank)
            return full.narrow(d, lo, hi - lo).clone()
        if not self._is_expert(name):
            return full
        n = full.shape[0] // self.ep.size
        return full[self.ep_rank * n:(self.ep_rank + 1) * n]

    def _gather(self, name: str, t: torch.Tensor) -> torch.Tensor:
        """All experts of an expert-sharded tensor (one allgather over ``ep``); others unchanged."""
        t = t.detach().cpu()
        if name in self._tp_dims:  # tp slices (uneven sizes allowed) along their split dim
            d = self._tp_dims[name]
            full, _ = self.tp.allgatherv(t.movedim(d, 0).contiguous())
            return full.movedim(0, d).contiguous()
        return self.ep.allgather(t.contiguous()) if self._is_expert(name) else t.clone()

    def save(self, step: int) -> Path | None:
        """Checkpoint after ``step`` optimizer steps: one file per pipeline stage, written by its (dp 0, sp 0,
        ep 0) rank; expert shards and their Adam moments are gathered over ``ep`` first, so the file holds
        the whole stage whatever the mesh."""
        path = None
        compress = self._compression_states()
        zero_dir = None
        if self.sdp is not None:  # one file per rank + manifest; the stage file then holds the full model only
            zero_dir = ckpt.zero_path(self.ckpt_dir, step)
            self.sdp.save_sharded(self._zero_files(zero_dir, write=True), self.opt)
            model = self.full_parameters()
            if self.tp is not None:  # whole tensors in the stage file (collective over tp)
                model = {n: self._gather(n, t) for n, t in model.items()}
            optim = None
        sharded = None
        if self.cfg.zero.stage == 1:  # collective over the zero axes, assembled on the group's writer only
            writer = self.opt.comm.allgather_object(self.dp_rank == 0 and self.sp_rank == 0)
            sharded = self.opt.state_dict(to=writer.index(True) if True in writer else 0)
        if self.dp_rank == 0 and self.sp_rank == 0 and self.sdp is None:
            named = dict(self.model.named_parameters())
            model = {n: self._gather(n, named[n]) for n in self.param_names}
            optim = sharded if sharded is not None else self.opt.state_dict()
            if self.ep is not None or self._tp_dims:
                order = self._opt_order()
                name_of = {id(p): n for n, p in zip(self.param_names, self.params)}
                for idx, st in list(optim["state"].items()):
                    n = name_of[id(order[int(idx)])]
                    # state_dict() shares the live state dicts: build new ones instead of editing them
                    optim["state"][idx] = {k: (self._gather(n, v) if k in ("exp_avg", "exp_avg_sq") else v)
                                           for k, v in st.items()}
        if self.dp_rank == 0 and self.sp_rank == 0 and self.ep_rank == 0 and self.tp_rank == 0:
            if optim is not None:  # host copies: a checkpoint written on a GPU loads anywhere without map_location
                optim = {**optim, "state": {k: {n: v.cpu() if isinstance(v, torch.Tensor) else v for n, v in st.items()}
                                            for k, st in optim["state"].items()}}
            payload = {
                "format": ckpt.FORMAT, "step": step, "config": config_to_dict(self.cfg),
                "stage": self.stage, "stages": self.stages, "params": list(self.param_names),
                "model": model, "optim": optim, "rng": ckpt.capture_rng(self.device),
                "lr_horizon": self.lr_horizon,
            }
            if compress is not None:
                payload["compress"] = compress
            if zero_dir is not None:
                payload["zero"] = zero_dir.name
            # Written after the sharded files: a complete stage file means a complete step.
            path = ckpt.save(ckpt.stage_path(self.ckpt_dir, step, self.stage), payload)
        self.comm.barrier()  # every stage file exists before anyone prunes or moves on
        if self.comm.rank == 0:
            ckpt.prune(self.ckpt_dir, self.cfg.checkpoint.keep, self.stages, current=step)
            if hasattr(self.tm, "save_pretrained"):  # transformers models: also the save_pretrained layout
                merged = None
                if self.stages > 1 or self.sdp is not None:
                    merged = {}
                    for s in range(self.stages):
                        merged.update(ckpt.load(ckpt.stage_path(self.ckpt_dir, step, s))["model"])
                self.tm.save_pretrained(self.ckpt_dir / "hf", merged)
        return path

    # ------------------------------------------------------------------ pieces of a step
    def _is_expert(self, name: str) -> bool:
        """Expert weights are sharded over ``ep`` (each rank holds its experts' slice along dim 0)."""
        return self.ep is not None and (name.endswith(".ffn.moe.w1") or name.endswith(".ffn.moe.w2"))

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
        from .progress import Display, MetricsLog, write_plots

        cfg, comm = self.cfg, self.comm
        lead = comm.rank == 0
        show = lead and not self.quiet
        log = MetricsLog(self.out / "metrics.jsonl", self.start_step) if lead else None
        display = Display(cfg.train.progress if show else "none", cfg.train.steps, self.start_step)
        if show and self.start_step:
            display.message(f"resumed from {self.ckpt_dir} at step {self.start_step}")
            if self.schedule_note:
                display.message(self.schedule_note)
        elif show and self.resumed_from_nothing:
            display.message(f"--resume: no checkpoint in {self.ckpt_dir} yet; starting at step 0")
        tokens = cfg.data.batch * cfg.data.seq_len
        records: list[dict[str, Any]] = []
        self.model.train()
        stop = cfg.train.steps if until is None else min(until, cfg.train.steps)
        for step in range(self.start_step, stop):
            t0 = time.perf_counter()
            before, saved0, off0 = _wire_bytes(), _saved_bytes(), _offload_bytes()
            sp0 = COMM_TIME.get("sp", 0.0) + COMM_TIME.get("tp", 0.0)
            zero0, dp0 = zero_stats(), dp_stats()
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
            step_s = time.perf_counter() - t0
            after, saved1, off1 = _wire_bytes(), _saved_bytes(), _offload_bytes()
            zero1 = zero_stats()
            zero_s = zero1["exposed_comm_s"] - zero0["exposed_comm_s"]  # ZeRO: blocked on gathers, reduce-scatters
            dp1 = dp_stats()  # data parallel reducers (this one's, HybridParallel's): held up / hidden by backward
            dp_s = dp1["exposed_comm_s"] - dp0["exposed_comm_s"]
            overlapped_s = (dp1["overlapped_comm_s"] - dp0["overlapped_comm_s"]  # and ZeRO's reduce-scatters
                            + zero1["overlapped_comm_s"] - zero0["overlapped_comm_s"])
            tpsp_s = COMM_TIME.get("sp", 0.0) + COMM_TIME.get("tp", 0.0) - sp0
            comm_s = sync_s + zero_s + dp_s + tpsp_s  # before eval (not the step's traffic)
            done = step + 1
            # pp ranks of a replica already agree on the loss; averaging over everyone is still the global mean.
            loss_avg = comm.allreduce_object(loss) / comm.size
            peak = comm.allreduce_object(peak_memory(self.device), op="max")
            eval_loss = None
            if cfg.train.eval_every and (done % cfg.train.eval_every == 0 or done == cfg.train.steps):
                eval_loss = self.evaluate()
            by_axis: dict[str, dict[str, int]] = {}
            for axis in (Axis.DP, flat_axis(Axis.DP, Axis.EP), flat_axis(Axis.DP, Axis.SP), Axis.EP, Axis.PP, Axis.SP,
                         Axis.TP):
                wire = after.get(axis, 0) - before.get(axis, 0)
                if wire:
                    raw = wire + saved1.get(axis, 0) - saved0.get(axis, 0)
                    by_axis[axis] = {"wire": wire, "raw": raw}
            raw_all = sum(v["raw"] for v in by_axis.values())
            wire_all = sum(v["wire"] for v in by_axis.values())
            rec = {
                "kind": "step", "step": done, "loss": loss_avg, "eval_loss": eval_loss, "lr": lr, "grad_norm": gnorm,
                "tokens": done * tokens, "tokens_per_s": tokens / step_s, "step_time": step_s,
                # comm: exposed (the step waited for it); overlapped: dp reductions and ZeRO reduce-scatters in
                # flight while backward ran, hidden inside compute and not part of the sum
                "time": {"compute": max(0.0, step_s - comm_s), "comm": comm_s, "offload": 0.0, "zero": zero_s,
                         "dp": dp_s, "overlapped": overlapped_s},
                "bytes": by_axis, "offload_bytes": off1 - off0,
                "compress_ratio": (raw_all / wire_all) if wire_all else 1.0, "peak_mem": peak,
                "peak_mem_of": "cuda" if self.device.type == "cuda" else "rss",  # see peak_memory
            }
            records.append(rec)
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
