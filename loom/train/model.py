"""The model ``loom train`` drives: :class:`loom.models.llama.Llama`, and its pipeline-stage view.

The decoder (attention under Ulysses or FPDT from :mod:`loom.parallel.sequence`, chunked FFN and loss,
recompute with host offload, MoE experts from :mod:`loom.parallel.moe`) lives in :mod:`loom.models.llama`;
this module only says how ``loom train`` holds it, in the torchtitan manner of keeping a model apart from
how it is parallelised:

* the whole model (``TrainModel.module``) for steps without a pipeline: its ``loss`` is this rank's share
  of the sequence mean under sequence parallelism (FPDT's chunked loss, never the full logits);
* an ``nn.Sequential`` view over the same parameters (embedding, one stage per block, final norm + head)
  that ``loom.parallel.HybridParallel`` cuts into pipeline stages without tracing. Blocks read their
  global token positions from one shared :class:`Positions` holder, set once per sequence layout.

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
    """One ``Llama`` block as a one-input module, its positions read from the shared holder."""

    def __init__(self, block: nn.Module, pos: Positions):
        super().__init__()
        self.block = block
        self.pos = pos

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        pos = self.pos.value if self.pos.value is not None else torch.arange(h.shape[1], device=h.device)
        return self.block(h, pos)


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

    def __init__(self, module: Llama, pos: Positions):
        super().__init__(EmbedStage(module.embed), *[BlockStage(b, pos) for b in module.blocks],
                         HeadStage(module.norm, module.head))
        names = {id(t): n for n, t in module.named_parameters()}
        self.model_names = {n: names[id(t)] for n, t in self.named_parameters()}
        self._init = module.init_parameter

    def init_parameter(self, name: str, tensor: torch.Tensor) -> None:
        self._init(self.model_names[name], tensor)


def _mean_ce(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = logits.reshape(-1, logits.shape[-1])
    if logits.dtype in (torch.bfloat16, torch.float16):
        logits = logits.float()
    return F.cross_entropy(logits, y.reshape(-1))


def _vocab_parallel_mean_ce(tp, vocab_start: int):
    """The pipeline loss on vocabulary-split logits (a tp LM head): the mean over the micro-batch's tokens."""
    from ..parallel.tensor import vocab_parallel_cross_entropy

    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(logits, y, tp, vocab_start, reduction="mean")

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

    def loss(self, x: torch.Tensor, y: torch.Tensor, packed: "Packed | None" = None) -> torch.Tensor:
        """The whole-model loss on this rank's tokens (see ``sp_sum``); ``packed``: packed documents."""
        if packed is None:
            return self.module.loss(x, y)
        return self.module.loss(x, y, doc_ids=packed.doc_ids, positions=packed.positions, count=packed.count)

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pipeline loss on the last stage's logits: the mean over the micro-batch's local tokens."""
        return _mean_ce(logits, y)


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
    if tp is not None and tp.size > 1:
        tm = TrainModel(module, StageView(module, pos), pos, sp_sum=sp > 1)
        tm.loss_fn = _vocab_parallel_mean_ce(tp, module.head.out_start)  # the pipeline's last stage: split logits
        return tm
    return TrainModel(module, StageView(module, pos), pos, sp_sum=sp > 1)
