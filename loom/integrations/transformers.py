"""loom's sequence parallelism (Ulysses, FPDT) for unmodified Hugging Face ``transformers`` decoders.

Supported families: Llama, Mistral, Qwen2 (``config.model_type`` in :data:`FAMILIES`): a ``*ForCausalLM`` whose
decoder (``model.get_decoder()``) has ``layers`` with ``self_attn`` and ``mlp`` and whose LM head is a
bias-free ``nn.Linear``.

How it plugs in, without changing the model's code:

* attention: :func:`register` adds ``"loom_ulysses"`` and ``"loom_fpdt"`` to transformers' attention-function
  registry (``AttentionInterface``) and a mask function that builds no mask (causality and packed documents
  are handled inside loom's attention); :class:`SequenceParallel` selects one with
  ``model.set_attn_implementation``. The registered function is a thin adapter: it transposes transformers'
  ``[batch, heads, seq, head_dim]`` to loom's sequence layout and calls
  :func:`loom.parallel.sequence.ulysses_attention` or :func:`~loom.parallel.sequence.fpdt_attention`, so GQA
  with ``kv_heads < sp`` is handled as there (each kv head replicated ``sp / kv_heads`` times before the
  all-to-all, gradients of the replicas summed by autograd).
* data: :meth:`SequenceParallel.shard` cuts the global batch along the sequence in loom's layout
  (:func:`~loom.parallel.sequence.shard_sequence`: contiguous for Ulysses, round-robin chunks for FPDT). Position
  ids are sharded with the tokens, so RoPE sees *global* positions; where they restart (packed documents,
  e.g. ``[0, 1, 2, 0, 1, ...]``) the attention keeps each token inside its document. Labels are shifted on
  the *global* sequence before sharding, so the target of the last token of one shard is the first token of
  the next.
* loss: :meth:`SequenceParallel.loss` returns ``sum of this rank's token cross-entropies / number of
  non-ignored targets in the global batch``; summing it (and, :meth:`SequenceParallel.reduce_gradients`, the
  parameter gradients) over ``sp`` gives the global mean and its gradient.
* FPDT memory: the attention runs as the FPDT chunk pipeline (``chunks`` per rank, saved chunks in host
  memory with ``offload=True``); each decoder layer's ``mlp`` runs chunk by chunk under recompute
  (``ffn_chunks``, :func:`loom.models.llama.chunked_ffn`), and the LM head with the cross-entropy chunk by
  chunk without materialising the ``[seq, vocab]`` logits (``loss_chunks``,
  :func:`loom.models.llama.chunked_lm_loss`). Not chunked (they live in the model's own code): the q/k/v/o
  projections, rotary embedding and norms, which hold ``[seq_local, hidden]``-sized activations per layer
  as in single-process transformers, and the final norm.

Example (every rank of ``comm`` holds the same global batch)::

    model = AutoModelForCausalLM.from_config(cfg)
    sp = SequenceParallel(model, comm, mode="fpdt", chunks=4)
    batch = sp.shard(input_ids, labels=input_ids)
    loss = sp.loss(batch)
    loss.backward()
    sp.reduce_gradients()
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..models.llama import chunked_ffn, chunked_lm_loss
from ..models.tokenizer import decode, encode
from ..parallel.meta import guard_device_constructors
from ..parallel.partition import Graph, Node, Ref, register_graph_source
from ..parallel.sequence import check_sizes, fpdt_attention, gather_sequence, ring_attention, shard_sequence

# Before any from_pretrained: it must not be the first to fill torch's device-context table (see the guard).
guard_device_constructors()

__all__ = ["FAMILIES", "MODES", "SequenceParallel", "SPBatch", "register", "attention_name", "check_model",
           "decoder_graph", "is_transformers_decoder", "shift_labels", "lm_loss", "PositionHolder",
           "fill_model_config", "read_config", "load_model", "build_train_model", "HFTrainModel", "generate_text"]

FAMILIES = ("llama", "mistral", "qwen2")
"""``config.model_type`` values this integration is tested on."""
MODES = {"ulysses": "loom_ulysses", "fpdt": "loom_fpdt"}
"""Sequence-parallel mode -> its ``attn_implementation`` name."""

# Attention module -> the SequenceParallel that owns it. Weak keys keep no model alive and put nothing into
# the module (so state_dict, deepcopy and save_pretrained see the model unchanged).
_OWNER: "weakref.WeakKeyDictionary[nn.Module, SequenceParallel]" = weakref.WeakKeyDictionary()


def attention_name(mode: str) -> str:
    """The ``attn_implementation`` name of ``mode`` (``"ulysses"`` or ``"fpdt"``)."""
    if mode not in MODES:
        raise ValueError(f"sequence-parallel mode {mode!r} is not one of {', '.join(MODES)}")
    return MODES[mode]


def register() -> None:
    """Add loom's attention functions and their (empty) mask functions to transformers' registries (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name in MODES.values():
        AttentionInterface.register(name, _attention)
        AttentionMaskInterface.register(name, _no_mask)


def _no_mask(*args: Any, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> None:
    """Causality and documents are applied inside loom's attention; a padding mask cannot be honoured."""
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise ValueError("loom sequence-parallel attention got a padding attention_mask with zeros; pack the "
                         "documents without padding and pass position_ids restarting at 0 per document instead")
    return None


def _attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
               sliding_window: int | None = None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over loom's Ulysses/FPDT (``[B, H, s, D]`` in, ``[B, s, H, D]``
    out, as transformers' own functions return)."""
    sp = _OWNER.get(module)
    if sp is None:
        raise ValueError(f"{type(module).__name__} runs loom attention but no SequenceParallel owns it; build "
                         f"SequenceParallel(model, comm) before calling the model")
    if dropout:
        raise ValueError(f"attention dropout {dropout} is not supported by loom attention; set the config's "
                         f"attention_dropout to 0")
    n = query.shape[2] * sp.comm.size
    if sliding_window is not None and sliding_window < n:
        raise ValueError(f"sliding_window={sliding_window} is shorter than the sequence ({n} tokens); loom attention "
                         f"is full causal attention: set config.sliding_window=None or use sequences <= "
                         f"{sliding_window}")
    q, k, v = (t.transpose(1, 2) for t in (query, key, value))
    doc = sp.doc_ids(kwargs.get("position_ids"))
    if sp.mode == "ulysses":  # ring 1: Ulysses
        out = ring_attention(q, k, v, sp.comm, ring=sp.ring, causal=True, scale=scaling, doc_ids=doc)
    else:
        out = fpdt_attention(q, k, v, sp.comm, chunks=sp.chunks, causal=True, offload=sp.offload, scale=scaling,
                             doc_ids=doc, ring=sp.ring)
    return out, None


def check_model(model: nn.Module) -> nn.Module:
    """Return the decoder (``model.get_decoder()``) after checking the model is a supported causal LM."""
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in FAMILIES:
        raise ValueError(f"model_type {mt!r} is not supported; loom's transformers integration covers "
                         f"{', '.join(FAMILIES)} (*ForCausalLM)")
    decoder = model.get_decoder()
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or head.bias is not None:
        raise ValueError(f"the LM head of {type(model).__name__} must be a bias-free nn.Linear; got {head!r}")
    if not all(hasattr(layer, "self_attn") and hasattr(layer, "mlp") for layer in decoder.layers):
        raise ValueError(f"{type(decoder).__name__}.layers must have self_attn and mlp submodules")
    return decoder


@dataclass(kw_only=True, slots=True)
class SPBatch:
    """This rank's share of a global batch (:meth:`SequenceParallel.shard`)."""

    input_ids: torch.Tensor
    """``[batch, seq / sp]`` token ids in the layout of the mode."""
    position_ids: torch.Tensor
    """``[batch, seq / sp]`` global positions (restarting per packed document)."""
    shift_labels: torch.Tensor | None
    """``[batch, seq / sp]`` next-token targets (shifted on the global sequence), or ``None`` without labels."""
    num_items: int
    """Non-ignored targets in the *global* batch (the loss denominator)."""

    @property
    def inputs(self) -> dict[str, Any]:
        """Keyword arguments for ``model(**batch.inputs)`` (logits of this rank's tokens)."""
        return {"input_ids": self.input_ids, "position_ids": self.position_ids, "use_cache": False}


class SequenceParallel:
    """Turn a transformers causal LM into a sequence-parallel one over ``comm`` (the ``sp`` axis), in place.

    Args:
        model: a ``*ForCausalLM`` of a family in :data:`FAMILIES`.
        comm: the sequence-parallel communicator (a :class:`loom.comm.Communicator` or proxy).
        mode: ``"ulysses"`` or ``"fpdt"``.
        chunks: FPDT chunks per rank (attention pipeline and token layout); ``1`` for Ulysses.
        offload: FPDT: keep the saved attention chunks in host memory between uses.
        ffn_chunks: chunks along the local sequence for each layer's MLP (1 = unchunked); default ``chunks``.
        loss_chunks: chunks for the LM head + loss in :meth:`loss` (1 = full logits); default ``chunks``.
        ignore_index: label value that contributes no loss.
        ring: ring degree (Ulysses x ring, FPDT x ring: :func:`~loom.parallel.sequence.ring_attention`): the
            heads split over ``comm.size / ring`` ranks, so ``comm.size`` may exceed the head count.

    Raises:
        ValueError: unsupported model, unknown mode, or head counts that do not split over ``comm.size``.
    """

    def __init__(self, model: nn.Module, comm: Any, *, mode: str = "ulysses", chunks: int = 1,
                 offload: bool = False, ffn_chunks: int | None = None, loss_chunks: int | None = None,
                 ignore_index: int = -100, ring: int = 1):
        self.decoder = check_model(model)
        name = attention_name(mode)
        if mode == "ulysses" and chunks != 1:
            raise ValueError(f"chunks={chunks} applies to mode='fpdt'; Ulysses uses chunks=1")
        for what, v in (("chunks", chunks), ("ffn_chunks", ffn_chunks), ("loss_chunks", loss_chunks)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{what}={v!r} must be an integer >= 1")
        if not isinstance(ring, int) or isinstance(ring, bool) or ring < 1 or comm.size % ring:
            raise ValueError(f"ring={ring!r} with sp size {comm.size}: the ring degree is an integer >= 1 dividing "
                             f"the sp size")
        self.model, self.comm, self.mode, self.chunks, self.offload = model, comm, mode, chunks, bool(offload)
        self.ring = ring
        self.ffn_chunks = chunks if ffn_chunks is None else ffn_chunks
        self.loss_chunks = chunks if loss_chunks is None else loss_chunks
        self.ignore_index = ignore_index
        cfg = model.config
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        probe = [torch.empty(1, chunks, h, hd) for h in (cfg.num_attention_heads, cfg.num_key_value_heads,
                                                         cfg.num_key_value_heads)]
        check_sizes(*probe, comm.size // ring, chunks)
        self._docs: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self._previous_attn = cfg._attn_implementation
        register()
        model.set_attn_implementation(name)
        for layer in self.decoder.layers:
            _OWNER[layer.self_attn] = self
            if self.ffn_chunks > 1:
                _chunk_mlp(layer.mlp, self.ffn_chunks)

    # ------------------------------------------------------------------------------------------ data
    def shard(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
              position_ids: torch.Tensor | None = None) -> SPBatch:
        """This rank's share of a global batch (the same ``[batch, seq]`` tensors on every rank of ``comm``).

        Args:
            input_ids: ``[batch, seq]``; ``seq`` divisible by ``sp x chunks``.
            labels: ``[batch, seq]`` in transformers' convention (``labels[t]`` is the token at ``t``; the
                shift to next-token targets happens here, on the global sequence); ``ignore_index`` skips one.
            position_ids: ``[batch, seq]`` or ``[1, seq]``; default ``0..seq-1``. Packed documents: restart at
                0 per document (attention then stays within each document).
        """
        b, n = input_ids.shape
        if position_ids is None:
            position_ids = torch.arange(n, device=input_ids.device)[None]
        position_ids = position_ids.expand(b, n)
        u = self.chunks
        docs = _documents(position_ids)
        shift = num = None
        if labels is not None:
            if tuple(labels.shape) != (b, n):
                raise ValueError(f"labels {tuple(labels.shape)} must have the shape of input_ids {(b, n)}")
            shift = shift_labels(labels, self.ignore_index)
            num = int((shift != self.ignore_index).sum())
        lay = dict(chunks=u, ring=self.ring)
        local_pos = shard_sequence(position_ids, self.comm, **lay)
        self._docs = (local_pos, None if docs is None else shard_sequence(docs, self.comm, **lay))
        return SPBatch(input_ids=shard_sequence(input_ids, self.comm, **lay), position_ids=local_pos,
                       shift_labels=None if shift is None else shard_sequence(shift, self.comm, **lay),
                       num_items=num or 0)

    def use_documents(self, position_ids: torch.Tensor, doc_ids: torch.Tensor | None) -> None:
        """Name the document ids of this rank's tokens whose local positions are ``position_ids`` (the very tensor
        the model will be called with), so that attention reads them instead of finding them from the gathered
        positions: ``loom train`` knows them (packed documents) and spares the allgather."""
        self._docs = (position_ids, doc_ids)

    def doc_ids(self, position_ids: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's document ids for the local ``position_ids`` (``None``: one document per row).

        The ids come from :meth:`shard` (or :meth:`use_documents`) for the tensor it returned; other position
        tensors (a micro-batch slice) are gathered over ``comm`` once and remembered until the next one.
        """
        if position_ids is None:
            raise ValueError("loom sequence-parallel attention needs the global position_ids of the local tokens; "
                             "pass batch.inputs from SequenceParallel.shard")
        if self._docs is not None and self._docs[0] is position_ids:
            return self._docs[1]
        pos = gather_sequence(position_ids, self.comm, chunks=self.chunks, ring=self.ring)
        docs = _documents(pos)
        self._docs = (position_ids, None if docs is None else shard_sequence(docs, self.comm, chunks=self.chunks,
                                                                             ring=self.ring))
        return self._docs[1]

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """The global tensor from every rank's sequence shard (not differentiable; for checks and logging)."""
        return gather_sequence(x, self.comm, chunks=self.chunks, dim=dim, ring=self.ring)

    # ------------------------------------------------------------------------------------------ loss
    def loss(self, batch: SPBatch) -> torch.Tensor:
        """``sum of this rank's token losses / global target count`` (sum over ``sp`` = the global mean).

        The LM head and cross-entropy run in ``loss_chunks`` slices (recomputed in backward), in the hidden
        states' dtype's accumulation precision (fp64 for fp64 models, else fp32).
        """
        if batch.shift_labels is None:
            raise ValueError("this batch has no labels; pass labels= to SequenceParallel.shard")
        h = self.decoder(**batch.inputs).last_hidden_state
        w = self.model.get_output_embeddings().weight
        total = chunked_lm_loss(h, w, batch.shift_labels, self.loss_chunks, self.ignore_index)
        return total / max(batch.num_items, 1)

    def loss_fn(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """A ``HybridParallel`` ``loss_fn`` for sharded micro-batches: this rank's share of the micro-batch mean
        (summed token losses over the non-ignored targets of the whole sequence; one allreduce of the count)."""
        total = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                  ignore_index=self.ignore_index, reduction="sum")
        count = (targets != self.ignore_index).sum().reshape(1).to(torch.float64)
        if self.comm.size > 1:
            count = self.comm.allreduce(count)
        return total / count.clamp(min=1).to(total.dtype)

    def reduce_gradients(self) -> None:
        """Sum every parameter gradient over ``comm`` (one allreduce per dtype): each rank saw its tokens only."""
        if self.comm.size == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self.model.parameters():
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p)
        for ps in by_dtype.values():
            flat = self.comm.allreduce(torch.cat([p.grad.reshape(-1) for p in ps]))
            for p, g in zip(ps, torch.split(flat, [p.numel() for p in ps])):
                p.grad.copy_(g.view_as(p.grad))

    def remove(self, attn_implementation: str | None = None) -> None:
        """Undo: plain MLP forwards, and the attention the model had before (or ``attn_implementation``)."""
        for layer in self.decoder.layers:
            _OWNER.pop(layer.self_attn, None)
            if "forward" in vars(layer.mlp):
                del layer.mlp.forward
        self.model.set_attn_implementation(attn_implementation or self._previous_attn or "sdpa")


def _documents(pos: torch.Tensor) -> torch.Tensor | None:
    """Document ids ``[B, n]`` from global positions (a new document wherever ``pos[t] != pos[t-1] + 1``);
    ``None`` when every row is one document."""
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not bool(starts[:, 1:].any()):
        return None
    return torch.cumsum(starts.long(), dim=1)


def _chunk_mlp(mlp: nn.Module, chunks: int) -> None:
    """Make ``mlp`` run chunk by chunk along the sequence under recompute (an instance ``forward``; parameter
    names and the state dict stay the model's own)."""
    if "forward" in vars(mlp):
        del mlp.forward
    plain = mlp.forward
    params = [p for p in mlp.parameters()]

    def forward(x: torch.Tensor) -> torch.Tensor:
        return chunked_ffn(plain, x, chunks, params)

    mlp.forward = forward


# ---------------------------------------------------------------------------------------------- losses
def shift_labels(labels: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Next-token targets ``[B, n]`` of transformers-style ``labels`` (the last position gets ``ignore_index``)."""
    out = torch.full_like(labels, ignore_index)
    out[:, :-1] = labels[:, 1:]
    return out


def lm_loss(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``logits [B, n, V]`` against next-token ``targets [B, n]``, in the logits' dtype
    (transformers' own loss upcasts to fp32 only: this keeps fp64 models exact)."""
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                             ignore_index=ignore_index)


# ---------------------------------------------------------------------------------------------- pipeline
# Models whose pipeline graph reads positions from a holder (``loom train``) instead of a graph input.
_PIPELINE_POSITIONS: "weakref.WeakKeyDictionary[nn.Module, PositionHolder]" = weakref.WeakKeyDictionary()


class PositionHolder:
    """This rank's global token positions, set once per sequence layout (``loom train``'s ``positions``).

    :meth:`ids` returns the same ``[1, s]`` tensor until ``value`` changes, so every layer of a forward pass
    (and every micro-batch) hands :class:`SequenceParallel` one tensor and its document ids are found once.
    """

    __slots__ = ("_value", "_ids")

    def __init__(self) -> None:
        self._value: torch.Tensor | None = None
        self._ids: torch.Tensor | None = None

    @property
    def value(self) -> torch.Tensor | None:
        return self._value

    @value.setter
    def value(self, v: torch.Tensor | None) -> None:
        self._value, self._ids = v, None

    def ids(self, s: int, device: Any) -> torch.Tensor:
        """``[1, s]`` positions: the set layout, or ``0..s-1`` when none is set."""
        if self._ids is None or self._ids.shape[1] != s:
            v = self._value if self._value is not None and self._value.numel() == s else torch.arange(s, device=device)
            self._ids = v.reshape(1, s).to(device)
        return self._ids


def is_transformers_decoder(model: Any) -> bool:
    """Whether ``model`` is a transformers causal LM that :func:`decoder_graph` can split."""
    return (isinstance(model, nn.Module) and type(model).__module__.startswith("transformers.")
            and callable(getattr(model, "get_decoder", None)))


def decoder_graph(model: nn.Module) -> Graph:
    """A :class:`loom.parallel.partition.Graph` of a transformers decoder for pipeline stages (decoder-aware:
    no tracing of transformers' forward, whose mask and cache logic ``torch.fx`` cannot follow).

    Inputs: ``(input_ids, position_ids)``, both ``[batch, seq]`` (every stage reads the position ids, so they
    are never sent between stages). Units: the token embedding; one per decoder layer (each computes its rotary
    embedding and its attention mask from the position ids, as the model's forward does); the final norm with
    the LM head. The output is the logits. Tied input/output embeddings put the same weight into the first
    and the last unit; :class:`~loom.parallel.hybrid.HybridParallel` keeps one copy per stage that reads it and
    sums their gradients.
    """
    decoder = check_model(model)
    holder = _PIPELINE_POSITIONS.get(model)
    pos_arg = () if holder is not None else (Ref("position_ids"),)
    rotary = decoder.rotary_emb
    rope = tuple(rotary.buffers())
    nodes = [Node(name="embed", fn=decoder.embed_tokens, args=(Ref("input_ids"),),
                  params=tuple(decoder.embed_tokens.parameters()), label="embed_tokens")]
    prev = "embed"
    for i, layer in enumerate(decoder.layers):
        name = f"layer{i}"
        params = tuple(layer.parameters()) + tuple(layer.buffers()) + rope
        call = _LayerCall(layer, rotary, model.config, i, holder)
        nodes.append(Node(name=name, fn=call, args=(Ref(prev), *pos_arg), params=params,
                          label=f"layers.{i}: {type(layer).__name__}"))
        prev = name
    nodes.append(Node(name="norm", fn=decoder.norm, args=(Ref(prev),), params=tuple(decoder.norm.parameters()),
                      label="norm"))
    head = model.get_output_embeddings()
    nodes.append(Node(name="logits", fn=head, args=(Ref("norm"),), params=tuple(head.parameters()),
                      label="lm_head"))
    n = len(nodes)
    units = [(i, i + 1) for i in range(n - 2)] + [(n - 2, n)]
    inputs = ["input_ids"] if holder is not None else ["input_ids", "position_ids"]
    return Graph(inputs=inputs, nodes=nodes, units=units, output=Ref("logits"), kind="transformers")


# HybridParallel's partitioner asks its registered sources first: importing this module is what makes it split
# a transformers decoder by layers (fx cannot trace transformers' mask and cache logic).
register_graph_source("transformers", is_transformers_decoder, decoder_graph)


class _LayerCall:
    """One decoder layer as the model's forward calls it: rotary embedding and mask from the position ids."""

    def __init__(self, layer: nn.Module, rotary: nn.Module, config: Any, index: int,
                 holder: "PositionHolder | None" = None):
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

        self.layer, self.rotary, self.config, self.holder = layer, rotary, config, holder
        types = getattr(config, "layer_types", None)
        sliding = (types[index] == "sliding_attention") if types else config.model_type == "mistral"
        if sliding and getattr(config, "sliding_window", None) is not None:
            self.mask = create_sliding_window_causal_mask
        else:
            self.mask = create_causal_mask

    def __call__(self, h: torch.Tensor, pos: torch.Tensor | None = None) -> torch.Tensor:
        if pos is None:
            pos = self.holder.ids(h.shape[1], h.device)
        mask = self.mask(config=self.config, inputs_embeds=h, attention_mask=None, past_key_values=None,
                         position_ids=pos)
        return self.layer(h, attention_mask=mask, position_ids=pos, position_embeddings=self.rotary(h, pos),
                          use_cache=False)


# ---------------------------------------------------------------------------------------------- loom train
def _read_config(model_cfg: Any):
    """The transformers config named by ``model.hf`` (a checkpoint directory) or ``model.hf_config``."""
    if model_cfg.hf:
        return read_config(model_cfg.hf, "model.hf")
    return read_config(model_cfg.hf_config)


def read_config(src: str, key: str = "model.hf_config"):
    """A transformers config from a directory with ``config.json`` or from a JSON file (local files only);
    ``key`` is the setting that named ``src`` (errors name it): ``model.hf`` takes a checkpoint directory only."""
    import json
    from pathlib import Path

    from transformers import AutoConfig

    p = Path(src)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{key} = {src!r} has no config.json; point {key} at a transformers "
                             f"{'checkpoint' if key == 'model.hf' else 'config'} directory")
        return AutoConfig.from_pretrained(str(p), local_files_only=True)
    if key == "model.hf":
        raise ValueError(f"model.hf = {src!r} is not a directory; give a local transformers checkpoint directory "
                         f"(config.json, weights, tokenizer), or a config to initialise at random with "
                         f"model.hf_config")
    if not p.is_file():
        raise ValueError(f"{key} = {src!r} is neither a directory nor a JSON file; give a transformers config "
                         f"directory (config.json) or a JSON file")
    data = json.loads(p.read_text())
    kind = data.pop("model_type", None)
    if kind not in FAMILIES:
        raise ValueError(f"{src}: model_type {kind!r} is not one of {', '.join(FAMILIES)}")
    return AutoConfig.for_model(kind, **data)


def _tokenizer(model_cfg: Any):
    """The tokenizer saved with ``model.hf`` (``None``: none there, or ``hf_config``: byte-level data)."""
    from pathlib import Path

    if not model_cfg.hf or not any((Path(model_cfg.hf) / f).is_file()
                                   for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_cfg.hf, local_files_only=True)


def fill_model_config(model_cfg: Any) -> None:
    """Copy the shape of the transformers config into loom's ``[model]`` section (layers, hidden, heads,
    kv_heads, vocab, rope_theta, norm_eps), so that the rest of the run (mesh checks, data) sees the real model.

    Raises:
        ValueError: both or neither source given, unreadable config, an unsupported family, or a vocabulary
            too small for loom's byte-level data when the checkpoint brings no tokenizer.
    """
    if bool(model_cfg.hf) == bool(model_cfg.hf_config):
        raise ValueError("give one of model.hf (a checkpoint directory) or model.hf_config (a config), not both")
    cfg = _read_config(model_cfg)
    if cfg.model_type not in FAMILIES:
        raise ValueError(f"model_type {cfg.model_type!r} is not one of {', '.join(FAMILIES)}")
    model_cfg.layers, model_cfg.hidden = cfg.num_hidden_layers, cfg.hidden_size
    model_cfg.heads, model_cfg.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    model_cfg.vocab, model_cfg.norm_eps = cfg.vocab_size, cfg.rms_norm_eps
    theta = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    if theta:
        model_cfg.rope_theta = float(theta)
    if cfg.vocab_size < 256 and _tokenizer(model_cfg) is None:
        raise ValueError(f"vocab_size {cfg.vocab_size} < 256: loom's byte-level data needs 256 token ids; use a "
                         f"config with vocab_size >= 256 or a checkpoint directory with its tokenizer")


def load_model(model_cfg: Any, *, dtype: torch.dtype = torch.float32, device: Any = "cpu") -> nn.Module:
    """``model.hf``: ``AutoModelForCausalLM.from_pretrained`` (local files); ``model.hf_config``: random
    initialisation from the config with torch's global generator (seed it identically on every rank)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # every rank would draw one on the job's stderr
    if model_cfg.hf:
        model = AutoModelForCausalLM.from_pretrained(model_cfg.hf, local_files_only=True, dtype=dtype,
                                                     attn_implementation="sdpa")
    else:
        cfg = _read_config(model_cfg)
        cfg._attn_implementation = "sdpa"
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    check_model(model)
    return model.to(device)


class HFTrainModel:
    """What ``loom train`` drives (the interface of ``loom.train.model.TrainModel``) for a transformers model.

    Attributes:
        module: the transformers model (its parameter names go into loom's checkpoints).
        pipeline: the same model; ``HybridParallel`` splits it with :func:`decoder_graph`, positions from
            ``positions``.
        positions: a :class:`PositionHolder` the trainer sets to this rank's global positions.
        sp_sum: with ``sp``, :meth:`loss` is this rank's share of the sequence mean (gradients summed over sp).
        sp: the :class:`SequenceParallel` wrapper, or ``None``.
        tokenizer: the checkpoint's tokenizer, or ``None`` (byte-level data).
    """

    impl = "transformers"

    def __init__(self, model: nn.Module, sp: SequenceParallel | None, tokenizer: Any = None):
        self.module = self.pipeline = model
        self.sp, self.tokenizer = sp, tokenizer
        self.sp_sum = sp is not None
        self.positions = PositionHolder()
        _PIPELINE_POSITIONS[model] = self.positions

    def loss(self, x: torch.Tensor, y: torch.Tensor, packed: Any = None) -> torch.Tensor:
        """Summed token losses over the target count of the whole sequence (the mean without ``sp``).

        ``packed``: packed documents (``loom.train.model.Packed``): the model gets each token's position inside
        its document (RoPE restarts), attention stays inside each document (loom's attention is handed the
        document ids; on one rank transformers' own attention finds them where the position ids restart) and
        the summed losses are divided by ``packed.count``, the batch's real targets over the replicas."""
        if packed is None:
            pos = self.positions.ids(x.shape[1], x.device)
            count = y.numel() * (self.sp.comm.size if self.sp is not None else 1)  # loom's data ignores none
        else:
            pos, count = packed.positions, packed.count
            if self.sp is not None:
                self.sp.use_documents(pos, packed.doc_ids)
        h = self.module.get_decoder()(input_ids=x, position_ids=pos, use_cache=False).last_hidden_state
        chunks = self.sp.loss_chunks if self.sp is not None else 1
        total = chunked_lm_loss(h, self.module.get_output_embeddings().weight, y, chunks)
        return total / count

    @staticmethod
    def loss_fn(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Pipeline loss on the last stage's logits: the mean over the micro-batch's local tokens."""
        return lm_loss(logits.float() if logits.dtype in (torch.bfloat16, torch.float16) else logits, y)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(input_ids=x, position_ids=self.positions.ids(x.shape[1], x.device), use_cache=False).logits

    def tokenize_corpus(self, corpus: Any) -> Any:
        """The corpus re-encoded with the checkpoint's tokenizer (unchanged without one)."""
        if self.tokenizer is None:
            return corpus
        from dataclasses import replace

        def enc(stream: torch.Tensor) -> torch.Tensor:
            text = bytes(stream.tolist()).decode("utf-8", errors="replace")
            return torch.tensor(self.tokenizer(text)["input_ids"], dtype=torch.long)

        return replace(corpus, train=enc(corpus.train), heldout=enc(corpus.heldout))

    def save_pretrained(self, directory: Any, state: dict[str, torch.Tensor] | None = None) -> None:
        """Write ``directory`` in transformers' ``save_pretrained`` layout (config, safetensors, tokenizer).

        ``state``: the whole model's tensors when this process holds only a pipeline stage (loaded into a
        fresh model first); ``None`` saves this process's model as it is.
        """
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # one line per shard on the job's stderr otherwise
        model = self.module
        if state is not None:
            model = AutoModelForCausalLM.from_config(self.module.config, dtype=self.module.dtype)
            missing, unexpected = model.load_state_dict(state, strict=False)
            if unexpected or [k for k in missing if not k.endswith("lm_head.weight")]:
                raise ValueError(f"stage files do not make up the model: missing {missing[:3]}, "
                                 f"unexpected {unexpected[:3]}")
        attn = model.config._attn_implementation
        model.config._attn_implementation = "sdpa"  # loom's attention names exist only where loom registered them
        try:
            model.save_pretrained(str(directory))
        finally:
            model.config._attn_implementation = attn
        if self.tokenizer is not None:
            self.tokenizer.save_pretrained(str(directory))


def build_train_model(cfg: Any, *, sp_comm: Any = None, dtype: torch.dtype = torch.float32,
                      device: Any = "cpu") -> HFTrainModel:
    """The :class:`HFTrainModel` of a ``loom train`` config whose ``[model]`` names ``hf`` or ``hf_config``."""
    if cfg.sequence.recompute:
        raise ValueError("sequence.recompute is not supported for transformers models; set it to false")
    model = load_model(cfg.model, dtype=dtype, device=device)
    sp = None
    s = cfg.sequence
    fpdt = s.algorithm == "fpdt"
    if sp_comm is not None and (sp_comm.size > 1 or fpdt):  # FPDT's chunks and offload run on one rank too
        sp = SequenceParallel(model, sp_comm, mode=s.algorithm, chunks=s.chunks if fpdt else 1,
                              offload=s.offload and fpdt, ring=max(1, cfg.mesh.sp_ring))
    return HFTrainModel(model, sp, _tokenizer(cfg.model))


@torch.no_grad()
def generate_text(model: nn.Module, model_cfg: Any, prompt: str, *, tokens: int, temperature: float, top_k: int,
                  seed: int) -> str:
    """Continue ``prompt`` with the model's own ``generate`` (its tokenizer, or loom's bytes without one)."""
    tok = _tokenizer(model_cfg)
    ids = tok(prompt, return_tensors="pt")["input_ids"] if tok is not None else encode(prompt or "\n")[None]
    ids = ids.to(next(model.parameters()).device)
    torch.manual_seed(seed)
    sample = temperature > 0
    extra = {"temperature": temperature, "top_k": top_k or None} if sample else {}
    vocab = int(model.config.vocab_size)
    if tok is None and vocab > 256:  # without a tokenizer the model speaks loom's bytes: no id past 255
        extra["suppress_tokens"] = list(range(256, vocab))
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, do_sample=sample,
                         pad_token_id=model.config.pad_token_id or 0, **extra)[0]
    return tok.decode(out, skip_special_tokens=True) if tok is not None else decode(out.tolist())
