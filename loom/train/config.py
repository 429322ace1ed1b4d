"""Configuration of a ``loom train`` run: one TOML file plus ``--section.key=value`` overrides.

A run is a :class:`Config` made of sections (``[model]``, ``[mesh]``, ``[sequence]``, ``[compress]``,
``[optim]``, ``[data]``, ``[train]``, ``[checkpoint]``, ``[zero]``, ``[multipath]``); each section is a
``kw_only`` slots dataclass that validates itself in ``__post_init__``, and :meth:`Config.validate_world` checks
the cross-section rules
(sizes that must divide, the mesh against the world size). Unknown sections or keys are errors that list the
valid names, so a typo never silently trains the default.

Example::

    cfg = load_config("configs/demo.toml", ["--train.steps=50", "--mesh.dp=2"])
"""

from __future__ import annotations

import dataclasses
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Sequence

from ..models.config import LlamaShape

__all__ = [
    "ConfigError",
    "ModelConfig",
    "MeshConfig",
    "SequenceConfig",
    "CompressConfig",
    "OptimConfig",
    "DataConfig",
    "TrainConfig",
    "CheckpointConfig",
    "ZeroConfig",
    "MultipathConfig",
    "Config",
    "load_config",
    "parse_overrides",
    "config_to_dict",
    "config_from_dict",
    "config_defaults",
]


PROGRESS_MODES = ("auto", "hooks", "thread")
"""``zero.progress`` values: loom.parallel.data.PROGRESS_MODES, restated so that parsing a config needs neither
torch nor MPI (tests/unit/test_zero.py checks that the two agree)."""


class ConfigError(ValueError):
    """A configuration the user must fix (the CLI prints it and exits with code 2)."""


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _at_least(cfg: Any, section: str, **least: float) -> None:
    """Each named field of ``cfg`` must be >= its bound; the error names ``section.field``, its value and bound."""
    for name, low in least.items():
        value = getattr(cfg, name)
        _need(value >= low, f"{section}.{name} = {value} must be >= {low}")


@dataclass(kw_only=True, slots=True)
class ModelConfig(LlamaShape):
    """The Llama-style decoder: RMSNorm, rotary positions, grouped-query attention, SwiGLU or MoE FFN. Its shape
    fields are :class:`loom.models.config.LlamaShape`'s (declared there once); this section adds where a
    transformers model comes from."""

    _PREFIX: ClassVar[str] = "model."

    kv_heads: int = 2
    """Key/value heads (grouped-query attention); ``heads`` must divide by it. A run uses GQA by default."""
    hf: str = ""
    """A local transformers checkpoint directory (config.json, safetensors, tokenizer) to train; the shape
    fields above are then taken from its config (loom.integrations.transformers)."""
    hf_config: str = ""
    """A transformers config (directory with config.json, or a JSON file) to random-initialise and train."""

    def __post_init__(self) -> None:
        if self.hf or self.hf_config:  # the transformers config is the authority on the shape
            from ..integrations.transformers import fill_model_config

            try:
                fill_model_config(self)
            except (ValueError, OSError, ImportError) as exc:
                raise ConfigError(str(exc)) from None
            return
        try:
            LlamaShape.__post_init__(self)  # zero-argument super() does not work in a slots dataclass
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


@dataclass(kw_only=True, slots=True)
class MeshConfig:
    """Parallel axes; their product must equal the number of ranks."""

    dp: int = 1
    """Data parallel: replicas that each take a slice of the global batch."""
    pp: int = 1
    """Pipeline parallel: stages that each hold a contiguous range of layers."""
    sp: int = 1
    """Sequence parallel (Ulysses / FPDT): ranks that each hold a slice of every sequence."""
    sp_ring: int = 0
    """Ring degree inside sp: ``sp / sp_ring`` ranks per Ulysses group (FPDT's chunk pipeline inside each with
    ``sequence.algorithm = 'fpdt'``), ring attention across the ``sp_ring`` groups, so sp may exceed the head
    count. 0: chosen from the heads (1 when every sp rank gets a head, else the smallest ring whose Ulysses
    group gets one each)."""
    ep: int = 1
    """Expert parallel (MoE only)."""
    tp: int = 1
    """Tensor parallel (Megatron): ranks that each hold a slice of every layer (heads, FFN width, vocabulary);
    the innermost axis, so a tp group is adjacent ranks (its allreduces run every layer)."""
    tp_sequence_parallel: bool = False
    """With tp > 1: split the tokens of the residual stream over tp between the tensor-parallel regions
    (Megatron-SP): norms and residuals hold 1/tp of the activations; data.seq_len must divide by tp."""
    schedule: str = "1f1b"
    """Pipeline schedule when pp > 1: ``1f1b`` or ``gpipe``."""

    def __post_init__(self) -> None:
        for k in ("dp", "pp", "sp", "ep", "tp"):
            v = getattr(self, k)
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1,
                  f"mesh.{k} = {v!r} must be an integer >= 1")
        r = self.sp_ring
        _need(isinstance(r, int) and not isinstance(r, bool) and r >= 0,
              f"mesh.sp_ring = {r!r} must be an integer >= 0 (0: chosen from the heads)")
        _need(r == 0 or self.sp % r == 0,
              f"mesh.sp_ring = {r} does not divide mesh.sp = {self.sp}; the sp ranks form sp_ring Ulysses groups: "
              f"choose sp_ring among {[d for d in range(1, self.sp + 1) if self.sp % d == 0]}")
        _need(self.schedule in ("1f1b", "gpipe"), f"mesh.schedule = {self.schedule!r}; valid: 1f1b, gpipe")

    @property
    def size(self) -> int:
        return self.dp * self.pp * self.sp * self.ep * self.tp

    def validate_world(self, world_size: int) -> None:
        """Raise :class:`ConfigError` unless the mesh covers exactly ``world_size`` ranks."""
        if self.size != world_size:
            raise ConfigError(
                f"mesh dp={self.dp} x pp={self.pp} x sp={self.sp} x ep={self.ep}"
                f"{f' x tp={self.tp}' if self.tp > 1 else ''} = {self.size} ranks but the job "
                f"has {world_size}; launch with --ranks {self.size} (mpiexec -n {self.size}) or set "
                f"--mesh.dp/--mesh.pp/--mesh.sp/--mesh.tp so their product is {world_size}")

    def axes(self) -> dict[str, int]:
        """Mesh axes in order (``dp`` outermost, then ``sp``, ``tp`` fastest: Megatron's order, the most frequent
        traffic between neighbours)."""
        out = {"dp": self.dp, "pp": self.pp}
        if self.ep > 1:
            out["ep"] = self.ep
        out["sp"] = self.sp
        if self.tp > 1:
            out["tp"] = self.tp
        return out


@dataclass(kw_only=True, slots=True)
class SequenceConfig:
    """Sequence parallelism inside attention."""

    algorithm: str = "ulysses"
    """``ulysses`` (all-to-all heads <-> sequence) or ``fpdt`` (Ulysses plus chunked attention with offload)."""
    chunks: int = 1
    """FPDT: chunks each rank's sequence slice is processed in (1 = plain Ulysses)."""
    offload: bool = False
    """FPDT: keep inactive key/value chunks (and recomputed block inputs) in host memory (Ulysses keeps no chunk
    store: it is refused there; its block checkpoints go to the host with ``offload_checkpoints``)."""
    recompute: bool = False
    """Recompute each block in backward, keeping only its input (loom.models.llama ``checkpoint``)."""
    offload_checkpoints: bool = False
    """With ``recompute``, in any sequence mode: the block inputs go to host memory (pinned, copied on a side
    stream) and come back one block ahead in backward."""

    def __post_init__(self) -> None:
        _need(self.algorithm in ("ulysses", "fpdt"), f"sequence.algorithm = {self.algorithm!r}; valid: ulysses, fpdt")
        _need(self.recompute or not self.offload_checkpoints,
              "sequence.offload_checkpoints = true needs sequence.recompute = true (a block's input is its "
              "checkpoint only when the block is recomputed); set --sequence.recompute=true")
        _need(isinstance(self.chunks, int) and self.chunks >= 1, f"sequence.chunks = {self.chunks!r} must be >= 1")
        _need(self.chunks == 1 or self.algorithm == "fpdt",
              f"sequence.chunks = {self.chunks} needs sequence.algorithm = 'fpdt' (Ulysses does not chunk)")
        _need(not self.offload or self.algorithm == "fpdt",
              "sequence.offload = true needs sequence.algorithm = 'fpdt': what it puts in host memory is FPDT's "
              "chunk store, which Ulysses does not keep; set --sequence.algorithm=fpdt, or to keep Ulysses' block "
              "checkpoints in host memory --sequence.recompute=true --sequence.offload_checkpoints=true")


@dataclass(kw_only=True, slots=True)
class CompressConfig:
    """Gradient compression on the data-parallel allreduce (per mesh axis)."""

    policy: str = "none"
    """``none`` or a loom.compress policy name (``hybrid``, ...) applied through its dp hook."""
    bucket_mb: float = 4.0
    """Gradients are flattened into buckets of about this many MiB; one hook call per bucket."""
    min_kb: float = -1.0
    """Buckets below this many KiB are reduced uncompressed; -1 keeps the policy's default threshold."""

    def __post_init__(self) -> None:
        _need(isinstance(self.policy, str) and self.policy,
              "compress.policy must be a non-empty name ('none' to disable)")
        _need(self.bucket_mb > 0, f"compress.bucket_mb = {self.bucket_mb} must be > 0")
        _need(self.min_kb == -1.0 or self.min_kb >= 0,
              f"compress.min_kb = {self.min_kb} must be >= 0 (or -1 for the policy default)")


@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """AdamW with linear warm-up then cosine (or constant) schedule."""

    lr: float = 3e-3
    """Peak learning rate."""
    min_lr: float = 3e-4
    """Final learning rate of the cosine schedule."""
    warmup: int = 10
    """Linear warm-up steps."""
    schedule: str = "cosine"
    """``cosine`` or ``constant`` after warm-up."""
    decay_steps: int = 0
    """The cosine's horizon: the step at which the rate reaches ``min_lr`` (and stays). 0: ``train.steps`` of
    the run that started it; a ``--resume`` with another ``train.steps`` keeps the checkpoint's horizon, so the
    rate goes on where it was, unless this sets a new one."""
    weight_decay: float = 0.1
    """AdamW decoupled weight decay (not applied to norms)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 disables)."""

    def __post_init__(self) -> None:
        _need(self.lr > 0, f"optim.lr = {self.lr} must be > 0")
        _need(0 <= self.min_lr <= self.lr, f"optim.min_lr = {self.min_lr} must be in [0, optim.lr = {self.lr}]")
        _at_least(self, "optim", warmup=0, decay_steps=0)
        _need(self.schedule in ("cosine", "constant"), f"optim.schedule = {self.schedule!r}; valid: cosine, constant")
        _need(0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "optim.beta1/beta2 must be in [0, 1)")
        _at_least(self, "optim", grad_clip=0)


@dataclass(kw_only=True, slots=True)
class DataConfig:
    """Byte-level text: by default the Python standard library's sources, or any file/directory."""

    path: str = ""
    """A text file or a directory (all files under it, sorted); empty = the stdlib .py files via sysconfig."""
    glob: str = "*.py"
    """File pattern when ``path`` is a directory (and for the default corpus)."""
    max_bytes: int = 4_000_000
    """Read at most this many bytes of corpus (files in sorted order), 0 = all."""
    heldout: float = 0.05
    """Fraction of the corpus (its tail) kept out of training for evaluation."""
    seq_len: int = 128
    """Tokens per sequence (split over ``mesh.sp`` ranks)."""
    batch: int = 8
    """Global batch in sequences per step (split over ``mesh.dp`` ranks and pipeline micro-batches)."""
    micro_batches: int = 1
    """Pipeline micro-batches per step (``mesh.pp`` > 1)."""
    pack: bool = False
    """Packed documents: each file is a document; every sequence starts at a document and runs on through the
    next ones, positions restart at each, attention stays inside each, and the loss is the mean over the real
    targets (none predicts across a boundary) of the whole batch (loom's Llama on every mesh; a transformers model
    without ``mesh.pp``)."""

    def __post_init__(self) -> None:
        _at_least(self, "data", seq_len=2, batch=1, micro_batches=1)
        _need(0 < self.heldout < 1, f"data.heldout = {self.heldout} must be in (0, 1)")
        _at_least(self, "data", max_bytes=0)


@dataclass(kw_only=True, slots=True)
class TrainConfig:
    """The run itself."""

    steps: int = 100
    """Optimizer steps to train for (in total, counting resumed ones)."""
    seed: int = 0
    """Seeds the initialization and the data order."""
    dtype: str = "float32"
    """Parameter/compute dtype on CPU: ``float32`` or ``float64`` (tests), ``bfloat16`` on CUDA."""
    eval_every: int = 25
    """Evaluate on held-out batches every N steps (and at the end); 0 disables."""
    eval_batches: int = 2
    """Held-out batches (each ``data.batch`` sequences) per evaluation."""
    log_every: int = 1
    """Progress/metrics granularity in steps."""
    out: str = "runs/train"
    """Run directory: metrics.jsonl, plots/, checkpoints/."""
    progress: str = "auto"
    """Rank 0 display: ``bar`` (rich), ``lines`` (one line per log step), ``none``, ``auto`` (bar on a terminal)."""
    plots: bool = True
    """Write PNG plots at the end."""
    device: str = "cpu"
    """``cpu`` or ``cuda`` (each rank uses ``cuda:local_rank``)."""
    device_memory: float = 0.0
    """GiB of memory per rank; ``--dry-run`` then says whether the run fits and the longest sequence that does."""

    def __post_init__(self) -> None:
        _at_least(self, "train", steps=1)
        _need(self.dtype in ("float32", "float64", "bfloat16"),
              f"train.dtype = {self.dtype!r}; valid: float32, float64, bfloat16")
        _need(self.eval_every >= 0 and self.eval_batches >= 1, "train.eval_every must be >= 0, eval_batches >= 1")
        _at_least(self, "train", log_every=1)
        _need(self.progress in ("auto", "bar", "lines", "none"),
              f"train.progress = {self.progress!r}; valid: auto, bar, lines, none")
        _need(self.device in ("cpu", "cuda"), f"train.device = {self.device!r}; valid: cpu, cuda")
        _need(self.device_memory >= 0, f"train.device_memory = {self.device_memory} must be >= 0 (GiB; 0 = unknown)")


@dataclass(kw_only=True, slots=True)
class CheckpointConfig:
    """Checkpoints (atomic, ``torch.load(weights_only=True)``-loadable)."""

    every: int = 50
    """Write a checkpoint every N steps (and at the end); 0 = only at the end."""
    keep: int = 2
    """Keep the newest N checkpoints."""
    dir: str = ""
    """Directory; empty = ``<train.out>/checkpoints``."""

    def __post_init__(self) -> None:
        _at_least(self, "checkpoint", every=0, keep=1)


@dataclass(kw_only=True, slots=True)
class ZeroConfig:
    """Sharded data parallelism (ZeRO): which state is split over which mesh axes."""

    stage: int = 0
    """0: every rank keeps everything; 1: the optimizer state is split over ``axes`` (loom.parallel
    .ShardedOptimizer: the gradients reduce-scattered after backward, the updated blocks all-gathered, DDP's
    bytes under tp and pp too; with ``compress.policy`` the codec's allreduce first, then the allgather); 2: the
    gradients too, reduce-scattered during backward; 3: the parameters too, gathered bucket by bucket just in
    time (2-3: loom.parallel.ShardedDataParallel, checkpoints one file per rank plus a manifest that
    ``--resume`` reshards to another dp size; under a pipeline each stage shards its own layers)."""
    axes: list = field(default_factory=lambda: ["dp"])
    """Mesh axes whose ranks share the split: ``["dp"]`` or ``["dp", "sp"]`` (sp ranks hold the same weights)."""
    bucket_mb: float = 25.0
    """Stages 2-3: MiB per bucket, the unit of a parameter gather and a gradient reduce-scatter."""
    master_dtype: str = ""
    """Stages 2-3: dtype of the flat shards AdamW steps, e.g. ``float32`` under ``train.dtype = bfloat16``
    (the model computes in ``train.dtype`` on gathered copies; gradients are reduced in this dtype). Empty:
    ``train.dtype``."""

    progress: str = "auto"
    """How gradient reductions posted during backward move while it runs, where they are posted there (plain
    data parallel and stages 2-3; loom.parallel.data's ``progress=``): ``hooks`` (tested from the backward hooks,
    no extra core), ``thread`` (a progress thread posts and tests them: a core while one is in flight) or
    ``auto`` (the thread where each rank on the node has a spare core, else hooks). Not ``train.progress``, the
    display."""

    def __post_init__(self) -> None:
        _need(isinstance(self.stage, int) and not isinstance(self.stage, bool) and 0 <= self.stage <= 3,
              f"zero.stage = {self.stage!r} must be 0, 1, 2 or 3")
        _need(self.progress in PROGRESS_MODES,
              f"zero.progress = {self.progress!r} must be one of {', '.join(PROGRESS_MODES)} (how gradient "
              f"reductions progress during backward); e.g. --zero.progress=thread")
        _need(self.progress == "auto" or self.stage != 1,
              f"zero.progress = {self.progress!r} with zero.stage = 1: stage 1 reduces after backward, so there "
              f"is nothing to progress during it; drop zero.progress, or use zero.stage = 0, 2 or 3")
        if isinstance(self.axes, str):
            self.axes = [a.strip() for a in self.axes.split(",") if a.strip()]
        _need(isinstance(self.axes, list) and self.axes and all(a in ("dp", "sp") for a in self.axes),
              f"zero.axes = {self.axes!r} must be a list of mesh axes among 'dp', 'sp' (e.g. [\"dp\"] or "
              f"[\"dp\", \"sp\"]): the ranks that hold the same weights")
        _need(self.bucket_mb > 0, f"zero.bucket_mb = {self.bucket_mb} must be > 0 (MiB per bucket)")
        _need(self.master_dtype in ("", "float32", "float64"),
              f"zero.master_dtype = {self.master_dtype!r}; valid: '' (train.dtype), float32, float64")
        _need(not self.master_dtype or self.stage >= 2,
              f"zero.master_dtype = {self.master_dtype!r} needs zero.stage = 2 or 3 (the master copy lives in the "
              f"flat shards); set zero.stage, or drop zero.master_dtype")


@dataclass(kw_only=True, slots=True)
class MultipathConfig:
    """Multi-path routing of the MoE dispatch and combine (:mod:`loom.multipath`): each step plans from that
    step's expert counts and relays the heavy pairs' rows over the idle paths."""

    enabled: bool = False
    """Route the ``ep`` all-to-allv through the planner (off: one direct all-to-allv)."""
    topology: str = "auto"
    """``auto`` (found from the machine), a preset (``testbed``, ``h100``, ``mesh``, ``shm``) or a TOML file."""
    min_bytes: int = 1 << 20
    """Pairs sending fewer bytes stay on their direct route (splitting small messages costs more than it saves)."""
    learn: bool = False
    """Measure the links during the dispatches and re-plan when one slows (:mod:`loom.multipath.links`)."""

    def __post_init__(self) -> None:
        _need(isinstance(self.learn, bool), f"multipath.learn = {self.learn!r}; give true or false")
        _need(isinstance(self.topology, str) and bool(self.topology),
              f"multipath.topology = {self.topology!r}; give 'auto', a preset name or a TOML file")
        _at_least(self, "multipath", min_bytes=0)


_SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "mesh": MeshConfig,
    "sequence": SequenceConfig,
    "compress": CompressConfig,
    "optim": OptimConfig,
    "data": DataConfig,
    "train": TrainConfig,
    "checkpoint": CheckpointConfig,
    "zero": ZeroConfig,
    "multipath": MultipathConfig,
}


@dataclass(kw_only=True, slots=True)
class Config:
    """A whole run: one instance of each section."""

    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    sequence: SequenceConfig = field(default_factory=SequenceConfig)
    compress: CompressConfig = field(default_factory=CompressConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    multipath: MultipathConfig = field(default_factory=MultipathConfig)

    def __post_init__(self) -> None:
        m, d, s, mesh = self.model, self.data, self.sequence, self.mesh
        rows = mesh.dp * mesh.ep  # ep ranks take different rows of the batch, like dp replicas
        _need(d.batch % rows == 0,
              f"data.batch = {d.batch} is not divisible by mesh.dp = {mesh.dp} x mesh.ep = {mesh.ep}; "
              f"use a multiple of {rows} (e.g. {rows * max(1, d.batch // rows)})")
        per_dp = d.batch // rows
        _need(per_dp % d.micro_batches == 0,
              f"per-replica batch {per_dp} (data.batch / mesh.dp) is not divisible by data.micro_batches = "
              f"{d.micro_batches}; change one of them")
        self._check_ring()
        self._check_padding()
        _need(not d.pack or mesh.pp == 1 or not (m.hf or m.hf_config),
              f"data.pack = true with a transformers model (model.hf) and mesh.pp = {mesh.pp}: its pipeline layers "
              f"read one position layout for every micro-batch (loom.integrations.transformers.PositionHolder), "
              f"not each micro-batch's documents; set mesh.pp = 1 (packing runs under sp, Ulysses, FPDT and the "
              f"ring, and dp)")
        _need(not s.offload_checkpoints or mesh.pp == 1,
              f"sequence.offload_checkpoints with mesh.pp = {mesh.pp}: pipeline stages do not recompute their "
              f"blocks, so there is no checkpoint to offload; set mesh.pp = 1 or offload_checkpoints = false")
        _need(mesh.pp <= m.layers,
              f"mesh.pp = {mesh.pp} exceeds model.layers = {m.layers}; every pipeline stage needs a layer")
        _need(self.zero.stage == 0 or mesh.ep == 1,
              f"zero.stage = {self.zero.stage} with mesh.ep = {mesh.ep}: expert weights differ across ep ranks and "
              f"sharding the optimizer state over dp x ep is not wired yet; use zero.stage = 0 or mesh.ep = 1")
        if mesh.tp > 1:
            self._check_tp()
        if mesh.ep > 1:
            _need(m.ffn == "moe", f"mesh.ep = {mesh.ep} needs model.ffn = 'moe' (got {m.ffn!r})")
            _need(m.experts % mesh.ep == 0,
                  f"model.experts = {m.experts} is not divisible by mesh.ep = {mesh.ep}")

    def _check_padding(self) -> None:
        """A length the layout does not split is padded only for loom's own Llama outside a pipeline and tp;
        elsewhere it is refused, saying why: a transformers model is not padded (its loss divides by every
        position of the sequence, so a pad would count as a target), a pipeline's loss is the mean over each
        micro-batch's positions, and tp's vocabulary-parallel loss likewise."""
        m, d, s, mesh = self.model, self.data, self.sequence, self.mesh
        if self.padded_seq_len == d.seq_len or not (mesh.pp > 1 or mesh.tp > 1 or m.hf or m.hf_config):
            return
        ring, need = mesh.sp_ring, self.padded_seq_len
        rule = (f"mesh.sp = {mesh.sp} x sequence.chunks = {s.chunks}" if ring == 1 else
                f"mesh.sp = {mesh.sp} x sequence.chunks = {s.chunks} and by 2 x mesh.sp_ring = {2 * ring} (the "
                f"ring's zig-zag layout)")
        why = ("transformers models are not padded (their loss divides by every position of the sequence, so "
               "pads would count as targets)" if m.hf or m.hf_config else
               f"loom pads sequences only without a pipeline or tp (under mesh.pp = {mesh.pp}, mesh.tp = {mesh.tp} "
               f"the loss is the mean over every position, pads included)")
        raise ConfigError(f"data.seq_len = {d.seq_len} is not divisible by {rule}: {why}; use data.seq_len = "
                          f"{need} or change mesh.sp / sequence.chunks")

    @property
    def padded_seq_len(self) -> int:
        """``data.seq_len`` rounded up to what the sequence layout splits evenly (``sp x chunks``; under the
        ring, ``sp x chunks`` and ``2 x sp_ring``). The trainer pads each sequence at its end: pad targets are ignored
        (the loss is the mean over real targets) and, attention being causal, no real token sees a pad."""
        mesh, n = self.mesh, self.data.seq_len
        unit = mesh.sp * self.sequence.chunks
        if mesh.sp_ring > 1:
            unit = math.lcm(unit, 2 * mesh.sp_ring)
        return -(-n // unit) * unit

    def _check_ring(self) -> None:
        """Resolve ``mesh.sp_ring = 0`` from the heads, then check that the heads split over each Ulysses group
        of ``sp / sp_ring`` ranks: unevenly where they must (``loom.parallel.sequence.HeadPlan``), so only a
        group larger than the head count has no split; under tp evenly (each tp rank's heads over sp)."""
        m, mesh = self.model, self.mesh
        tp = mesh.tp
        kv = (m.kv_heads or m.heads) // tp

        def fits(u: int) -> bool:
            if tp > 1:
                return (m.heads // tp) % u == 0 and (kv % u == 0 or u % kv == 0)
            return m.heads >= u

        rings = [r for r in range(1, mesh.sp + 1) if mesh.sp % r == 0 and fits(mesh.sp // r)]
        if mesh.sp_ring == 0:
            mesh.sp_ring = 1 if fits(mesh.sp) or not rings else rings[0]
        ring, u = mesh.sp_ring, mesh.sp // mesh.sp_ring
        if ring > 1:
            _need(mesh.pp == 1 and tp == 1,
                  f"mesh.sp_ring = {ring} with mesh.pp = {mesh.pp}, mesh.tp = {tp}: the ring composes with dp "
                  f"and ZeRO only so far; use mesh.pp = mesh.tp = 1, or mesh.sp_ring = 1")
        if tp > 1:  # _check_tp words the even rule under tp
            return
        group = "mesh.sp" if ring == 1 else "sp / sp_ring"
        fix = (f"use --mesh.sp_ring={rings[0]} (Ulysses {mesh.sp // rings[0]} x ring {rings[0]})" if rings
               else "use a smaller mesh.sp")
        _need(fits(u), f"model.heads = {m.heads} over {group} = {u} ranks: every rank of the Ulysses all-to-all "
                       f"needs a query head, so no split exists; {fix}")

    def _check_tp(self) -> None:
        """Tensor parallelism composes with dp (ZeRO stage 0-1 over dp) and Ulysses sp today; other axes are
        refused."""
        m, mesh, tp = self.model, self.mesh, self.mesh.tp
        _need(mesh.ep == 1, f"mesh.tp = {tp} with mesh.ep = {mesh.ep}: tensor parallelism composes with mesh.dp, "
                            f"mesh.pp and mesh.sp (Ulysses) only so far; use mesh.ep = 1 (or mesh.tp = 1)")
        _need(mesh.pp == 1 or mesh.sp == 1, f"mesh.tp = {tp} with mesh.pp = {mesh.pp} and mesh.sp = {mesh.sp}: "
                                            f"tp composes with pp or with sp, not yet both; set one of them to 1")
        _need(self.zero.stage == 0 or self.zero.axes == ["dp"] and (self.zero.stage == 1 or mesh.pp == mesh.sp == 1),
              f"mesh.tp = {tp} with zero.stage = {self.zero.stage} over {self.zero.axes}: with tp, ZeRO shards over "
              f"dp only (zero.axes = [\"dp\"]), and stages 2-3 not yet with mesh.pp or mesh.sp; use zero.stage = 0 "
              f"or 1, or set mesh.pp = mesh.sp = 1 (or mesh.tp = 1)")
        _need(not (m.hf or m.hf_config), f"mesh.tp = {tp} with a transformers model (model.hf): tensor "
                                         f"parallelism splits loom's Llama only; use mesh.tp = 1")
        _need(m.ffn != "moe", f"mesh.tp = {tp} with model.ffn = 'moe' is not implemented; use 'swiglu' or 'gelu'")
        _need(self.sequence.algorithm == "ulysses",
              f"mesh.tp = {tp} with sequence.algorithm = 'fpdt': FPDT under tensor parallelism is not implemented; "
              f"use sequence.algorithm = 'ulysses' (or mesh.tp = 1)")
        kv = m.kv_heads or m.heads
        for what, n in (("model.heads", m.heads), ("model.kv_heads", kv)):
            _need(n % tp == 0, f"{what} = {n} is not divisible by mesh.tp = {tp}: each tp rank holds whole query "
                               f"and key/value heads; choose mesh.tp dividing both {m.heads} and {kv}")
        _need(not mesh.tp_sequence_parallel or self.zero.stage < 3,
              "mesh.tp_sequence_parallel with zero.stage = 3: Megatron-SP projects with the gathered weights "
              "outside their modules' hooks, where ZeRO-3 gathers them; use zero.stage <= 2 or plain tp")
        _need(not mesh.tp_sequence_parallel or self.data.seq_len % tp == 0,
              f"data.seq_len = {self.data.seq_len} is not divisible by mesh.tp = {tp} with "
              f"mesh.tp_sequence_parallel: the tokens are split evenly over tp; use data.seq_len = "
              f"{-(-self.data.seq_len // tp) * tp}")
        if mesh.sp > 1:
            _need(not mesh.tp_sequence_parallel,
                  f"mesh.tp = {tp} with mesh.sp = {mesh.sp} works without mesh.tp_sequence_parallel (Megatron-SP "
                  f"under Ulysses is not implemented); set it to false")
            _need((m.heads // tp) % mesh.sp == 0,
                  f"model.heads / mesh.tp = {m.heads} / {tp} is not divisible by mesh.sp = {mesh.sp}: Ulysses splits "
                  f"each tp rank's heads over sp; choose mesh.tp x mesh.sp dividing {m.heads}")

    def validate_world(self, world_size: int) -> None:
        """Raise :class:`ConfigError` unless the mesh covers exactly ``world_size`` ranks."""
        self.mesh.validate_world(world_size)


def _field_names(cls: type) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def _coerce(section: str, key: str, value: Any, default: Any) -> Any:
    """Check a TOML value against the field's default type (ints are accepted for floats)."""
    want = type(default)
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is bool and not isinstance(value, bool):
        raise ConfigError(f"{section}.{key} = {value!r} must be true or false")
    if want is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{section}.{key} = {value!r} must be an integer")
    if want is str and not isinstance(value, str):
        raise ConfigError(f"{section}.{key} = {value!r} must be a string")
    if want is float and not isinstance(value, (int, float)):
        raise ConfigError(f"{section}.{key} = {value!r} must be a number")
    return value


def config_from_dict(data: dict[str, Any], world_size: int | None = None) -> Config:
    """Build a :class:`Config` from ``{"section": {"key": value}}``; unknown names raise listing valid ones.

    With ``world_size`` (the job's ranks) the mesh is checked against it before the rules across sections, so
    a mesh that is not the job's size is reported as such, not as the batch or sequence it fails to divide."""
    sections: dict[str, Any] = {}
    for name, values in data.items():
        if name not in _SECTIONS:
            raise ConfigError(f"unknown config section [{name}]; valid sections: {', '.join(_SECTIONS)}")
        if not isinstance(values, dict):
            raise ConfigError(f"[{name}] must be a table of key = value, got {values!r}")
        cls = _SECTIONS[name]
        valid = _field_names(cls)
        defaults = cls()
        kwargs = {}
        for key, value in values.items():
            if key not in valid:
                raise ConfigError(f"unknown key {name}.{key}; valid keys in [{name}]: {', '.join(valid)}")
            kwargs[key] = _coerce(name, key, value, getattr(defaults, key))
        sections[name] = cls(**kwargs)
    if world_size is not None:
        sections.get("mesh", MeshConfig()).validate_world(world_size)
    return Config(**sections)


def config_defaults() -> dict[str, dict[str, Any]]:
    """Every key of every section with the default it declares: what a key left out takes, before the rules
    across sections resolve it (``mesh.sp_ring = 0`` stays 0, chosen from the heads when a run is laid out;
    ``Config()`` would show the value it resolves to for the default model)."""
    out: dict[str, dict[str, Any]] = {}
    for name, cls in _SECTIONS.items():
        out[name] = {f.name: f.default if f.default is not dataclasses.MISSING else f.default_factory()
                     for f in dataclasses.fields(cls)}
    return out


def config_to_dict(cfg: Config) -> dict[str, dict[str, Any]]:
    """Plain nested dict (TOML/JSON/checkpoint friendly)."""
    return {name: {k: getattr(getattr(cfg, name), k) for k in _field_names(cls)} for name, cls in _SECTIONS.items()}


def _parse_value(text: str) -> Any:
    """A TOML scalar (``3``, ``1e-3``, ``true``, ``"x"``); anything else is taken as a bare string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def parse_overrides(args: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``["--train.steps=5", "--mesh.dp", "2"]`` -> ``{"train": {"steps": 5}, "mesh": {"dp": 2}}``."""
    out: dict[str, dict[str, Any]] = {}
    i = 0
    args = list(args)
    while i < len(args):
        a = args[i]
        if not a.startswith("--") or "." not in a.split("=", 1)[0]:
            raise ConfigError(f"unexpected argument {a!r}; overrides look like --section.key=value "
                              f"(sections: {', '.join(_SECTIONS)})")
        if "=" in a:
            name, text = a[2:].split("=", 1)
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {a} needs a value: {a}=VALUE")
            name, text = a[2:], args[i + 1]
            i += 1
        section, _, key = name.partition(".")
        if section not in _SECTIONS:
            raise ConfigError(f"unknown config section in {a!r}; valid sections: {', '.join(_SECTIONS)}")
        if key not in _field_names(_SECTIONS[section]):
            raise ConfigError(f"unknown key {section}.{key} in {a!r}; valid keys in [{section}]: "
                              f"{', '.join(_field_names(_SECTIONS[section]))}")
        out.setdefault(section, {})[key] = _parse_value(text)
        i += 1
    return out


def load_config(path: str | Path | None, overrides: Sequence[str] = (), world_size: int | None = None) -> Config:
    """Read ``path`` (TOML; ``None`` = all defaults) and apply ``--section.key=value`` overrides; with
    ``world_size``, the mesh must cover that many ranks (:func:`config_from_dict`)."""
    data: dict[str, dict[str, Any]] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist; pass --config PATH to a TOML file "
                              f"(see configs/demo.toml)")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {exc}") from None
    for section, values in parse_overrides(overrides).items():
        if section in data and not isinstance(data[section], dict):
            raise ConfigError(f"[{section}] in {path} is not a table")
        data.setdefault(section, {}).update(values)
    return config_from_dict(data, world_size)
