"""The model ``loom train`` drives: :class:`loom.models.llama.Llama`, and its pipeline-stage view.

The decoder (attention under Ulysses or FPDT from :mod:`loom.parallel.sequence`, chunked FFN and loss,
recompute with host offload, MoE experts from :mod:`loom.parallel.moe`) lives in :mod:`loom.models.llama`;
this module only says how ``loom train`` holds it, in the torchtitan manner of keeping a model apart from
how it is parallelised:

* the whole model (``TrainModel.module``) for steps without a pipeline: its ``loss`` is this rank's share
  of the sequence mean under sequence parallelism (FPDT's chunked loss, never the full logits);
* an ``nn.Sequential`` view over the same parameters (embedding, one stage per block, final norm + head)
  that ``loom.parallel.HybridParallel`` cuts into pipeline stages without tracing. Blocks read their
  global token positions from one shared :class:`Positions` holder, set once per sequence layout. With
  packed documents the view's graph (registered with :func:`loom.parallel.partition.register_graph_source`)
  takes ``(tokens, positions, doc_ids)`` and every block reads its micro-batch's positions and document ids
  as graph inputs, which every stage rank of a replica holds (nothing more crosses a stage boundary).

Parameter names are those of ``Llama`` (``embed.weight``, ``blocks.<i>.attn.wq.weight``, ...), the same on
every rank and every stage split, so per-stage checkpoints merge into one model.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..models.llama import Llama, LlamaConfig
from ..parallel.partition import Graph, Node, Ref, register_graph_source
from .config import Config, ConfigError

__all__ = ["Packed", "Positions", "StageView", "TrainModel", "build_model", "llama_config"]


@dataclass(frozen=True, slots=True)
class Packed:
    """What packed documents add to this rank's ``(inputs, targets)`` (``data.pack``; see
    :func:`loom.train.data.packed_windows`)."""

    doc_ids: torch.Tensor
    """``[rows, seq_local]`` document ids, in the layout of the inputs."""
    positions: torch.Tensor
    """``[rows, seq_local]`` positions inside each document (RoPE)."""
    count: float
    """What this rank's summed loss is divided by: the real targets of the whole global batch over the
    replicas (``dp x ep``) that average their gradients, so that the average is the gradient of the global
    mean over real targets, whatever each replica's count."""


class Positions:
    """Global token positions of this rank's slice, shared by every block stage (set once per layout)."""

    __slots__ = ("value",)

    def __init__(self, value: torch.Tensor | None = None):
        self.value = value


class EmbedStage(nn.Module):
    """Pipeline stage 0's first unit: token ids -> embeddings."""

    def __init__(self, embed: nn.Module):
        super().__init__()
        self.embed = embed

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens)


class BlockStage(nn.Module):
    """One ``Llama`` block as a one-input module, its positions read from the shared holder (packed documents:
    the micro-batch's positions and document ids given)."""

    def __init__(self, block: nn.Module, pos: Positions):
        super().__init__()
        self.block = block
        self.pos = pos

    def forward(self, h: torch.Tensor, positions: torch.Tensor | None = None,
                doc_ids: torch.Tensor | None = None) -> torch.Tensor:
        if positions is None:
            positions = self.pos.value if self.pos.value is not None else torch.arange(h.shape[1], device=h.device)
        return self.block(h, positions, doc_ids)


class HeadStage(nn.Module):
    """The last unit: final norm and LM head -> logits."""

    def __init__(self, norm: nn.Module, head: nn.Module):
        super().__init__()
        self.norm = norm
        self.head = head

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(h))


class StageView(nn.Sequential):
    """``Llama`` as ``nn.Sequential(EmbedStage, BlockStage x layers, HeadStage)`` over the same parameters.

    ``init_parameter`` maps this view's names (``1.block.attn.wq.weight``) to the model's
    (``blocks.0.attn.wq.weight``), so a model built on the meta device can be materialised one pipeline stage
    at a time through the view (:func:`loom.parallel.materialize`).
    """

    def __init__(self, module: Llama, pos: Positions, packed: bool = False):
        super().__init__(EmbedStage(module.embed), *[BlockStage(b, pos) for b in module.blocks],
                         HeadStage(module.norm, module.head))
        names = {id(t): n for n, t in module.named_parameters()}
        self.model_names = {n: names[id(t)] for n, t in self.named_parameters()}
        self._init = module.init_parameter
        self.packed = packed
        """Packed documents: the pipeline graph is :func:`packed_graph`'s (three inputs)."""

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        self._init(self.model_names[name], tensor)


def packed_graph(view: StageView) -> Graph:
    """The pipeline graph of a packed :class:`StageView`: inputs ``(tokens, positions, doc_ids)``, one unit per
    child as ``nn.Sequential``'s, each block reading the positions and document ids of the micro-batch as graph
    inputs (held by every stage rank of a replica, never sent between stages)."""
    nodes, prev = [], "tokens"
    for i, (name, child) in enumerate(view.named_children()):
        extra = (Ref("positions"), Ref("doc_ids")) if isinstance(child, BlockStage) else ()
        nodes.append(Node(name=f"l{i}", fn=child, args=(Ref(prev), *extra),
                          params=tuple(child.parameters()) + tuple(child.buffers()),
                          label=f"{name}: {type(child).__name__}"))
        prev = f"l{i}"
    # kind "sequential": the view is an nn.Sequential; HybridParallel switches its train/eval mode as such
    return Graph(inputs=["tokens", "positions", "doc_ids"], nodes=nodes, units=[(i, i + 1) for i in range(len(nodes))],
                 output=Ref(prev), kind="sequential")


register_graph_source("loom.train packed stages", lambda m: isinstance(m, StageView) and m.packed, packed_graph)


def _ce(logits: torch.Tensor, y: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, y.reshape(-1), reduction=reduction)


def _mean_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return _ce(logits, y)


def _vocab_parallel_ce(tp, vocab_start: int, reduction: str):
    """The pipeline loss on vocabulary-split logits (a tp LM head): the mean (or the sum) over the micro-batch's
    targets."""
    from ..parallel.tensor import vocab_parallel_cross_entropy

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, tp, vocab_start, reduction=reduction)

    return loss_fn


class TrainModel:
    """What the trainer drives: the module that owns the parameters, a pipeline view, the loss.

    Attributes:
        module: the :class:`~loom.models.llama.Llama`; its ``named_parameters()`` names go into checkpoints.
        pipeline: a :class:`StageView` over the same parameters (embedding, blocks, head) for HybridParallel.
        positions: the shared holder of this rank's global token positions (read by the pipeline view).
        sp_sum: ``loss()`` returns this rank's *share* of the sequence mean (sum over ``sp`` = the mean), so
            gradients are summed over ``sp``; otherwise it is the local mean and gradients are averaged.
    """

    def __init__(self, module: Llama, pipeline: nn.Sequential, positions: Positions, sp_sum: bool):
        self.module, self.pipeline, self.positions, self.sp_sum = module, pipeline, positions, sp_sum
        self.sum_fn = lambda logits, y: _ce(logits, y, "sum")
        """The pipeline's summed cross-entropy over a micro-batch's real targets (packed documents)."""

    def loss(self, x: torch.Tensor, y: torch.Tensor, packed: "Packed | None" = None) -> torch.Tensor:
        """The whole-model loss on this rank's tokens (see ``sp_sum``); ``packed``: packed documents."""
        if packed is None:
            return self.module.loss(x, y)
        return self.module.loss(x, y, doc_ids=packed.doc_ids, positions=packed.positions, count=packed.count)

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pipeline loss on the last stage's logits: the mean over the micro-batch's local tokens."""
        return _mean_ce(logits, y)

    def packed_loss_fn(self, scale: float):
        """Pipeline loss of packed documents: each micro-batch's summed losses times ``scale`` (the pipeline
        averages its micro-batches and sp its ranks' gradients: the trainer passes ``micro_batches x sp /
        count``, so that the replica's loss is its summed losses over ``Packed.count``)."""
        return lambda logits, y: self.sum_fn(logits, y) * scale


def llama_config(cfg: Config, sp: int | None = None) -> LlamaConfig:
    """The :class:`LlamaConfig` of a run whose sequences are split over an sp communicator of ``sp`` ranks
    (``None``: whole sequences and no communicator, as generation holds them). FPDT runs at any ``sp``, 1
    included (its chunks and offload on one rank); Ulysses needs two ranks."""
    algo = cfg.sequence.algorithm
    mode = "none" if sp is None or sp == 1 and algo != "fpdt" else algo
    fpdt = mode == "fpdt"
    try:
        return LlamaConfig.from_any(cfg.model, sequence_parallel=mode, chunks=cfg.sequence.chunks if fpdt else 1,
                                    offload=cfg.sequence.offload and fpdt, checkpoint=cfg.sequence.recompute,
                                    offload_checkpoints=cfg.sequence.offload_checkpoints,
                                    ring=max(1, cfg.mesh.sp_ring) if mode != "none" else 1)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None


def build_model(cfg: Config, *, sp_comm=None, ep_comm=None, dtype: torch.dtype = torch.float32,
                device: Any = "cpu", meta: bool = False, tp=None) -> TrainModel:
    """The model of this rank. ``sp_comm=None`` (or of size 1) builds the unsharded model (one rank,
    generation); ``ep_comm`` holds the experts of an MoE model (``None``: the world, for one process).

    ``meta=True`` builds it on the meta device, in the construction dtype, with no storage: the pipeline
    (``HybridParallel(..., device=, dtype=)``) then materialises only this rank's stage through
    :class:`StageView`. ``dtype`` and ``device`` apply to a real build only. ``model.hf`` /
    ``model.hf_config``: a transformers model (:mod:`loom.integrations.transformers`). ``tp``: the tp
    group (a :class:`loom.parallel.tensor.TPLink` carrying the policy's tp codec): the whole model is built,
    then split in place by :func:`loom.models.parallelize.parallelize_llama`, so it starts from the
    one-rank weights.
    """
    if cfg.model.hf or cfg.model.hf_config:
        from ..integrations.transformers import build_train_model

        try:
            return build_train_model(cfg, sp_comm=sp_comm, dtype=dtype, device=device)  # type: ignore[return-value]
        except ValueError as exc:
            raise ConfigError(f"model: {exc}") from None
    sp = sp_comm.size if sp_comm is not None else 1
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            module = Llama(llama_config(cfg, sp if sp_comm is not None else None), sp_comm, ep_comm)
    except ValueError as exc:
        raise ConfigError(f"model: {exc}") from None
    if not meta:
        module = module.to(device=device, dtype=dtype)
    if tp is not None and tp.size > 1:
        if meta:
            raise ConfigError("mesh.tp > 1 needs a real model build (tp splits the built weights); the meta "
                              "build comes with mesh.pp > 1 or zero.stage = 3, which tp does not compose with yet")
        from ..models.parallelize import parallelize_llama

        try:
            module = parallelize_llama(module, tp)
        except ValueError as exc:
            raise ConfigError(f"mesh.tp = {tp.size}: {exc}") from None
    pos = Positions()
    tm = TrainModel(module, StageView(module, pos, packed=cfg.data.pack), pos, sp_sum=sp > 1)
    if tp is not None and tp.size > 1:  # the pipeline's last stage: split logits
        tm.loss_fn = _vocab_parallel_ce(tp, module.head.out_start, "mean")
        tm.sum_fn = _vocab_parallel_ce(tp, module.head.out_start, "sum")
    return tm
