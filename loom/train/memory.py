"""Peak memory per rank of a ``loom train`` run, predicted from its config (``loom train --dry-run``).

The prediction follows what the code keeps alive, term by term, for the most loaded pipeline stage:

* **model state**: weights ``W``, gradients ``G`` (same dtype) and AdamW's two moments ``O = 2 W`` (torch keeps
  them in the parameter dtype), for this rank's stage as ``HybridParallel`` splits it (min-max parameter
  count, :func:`loom.parallel.partition.balance`) and this rank's experts (``experts / ep``). ZeRO (a
  ``[zero]`` section with ``stage`` 0-3 and ``axes``) divides ``O`` (stage >= 1), ``G`` (>= 2) and ``W`` (3) by
  the product ``Z`` of those axes' sizes (stage 1 keeps ``W / Z`` master blocks beside the weights, and
  reduce-scatters a flat copy of the gradients, which are then freed), and adds its buffers: one gradient
  bucket of ``zero.bucket_mb``
  before its reduce-scatter (stage >= 2); at stage 3 two gathered buckets (the one computing and the one
  prefetched; a bucket holds whole modules up to ``zero.bucket_mb``, at least a layer), one bucket's full
  gradient and, on the last stage, the LM head, which ``loom train`` keeps
  gathered from the start of forward until its gradient is reduced when there is no pipeline (the loss reads
  its weight directly; a pipeline's last stage calls the head as a module, gathered like any other).
* **activations** of one micro-batch of ``t = rows x seq_len / sp`` tokens on this rank, per block, from
  the tensors autograd saves (``e`` = bytes per element, ``h`` hidden, ``F`` FFN width, ``kv`` = key/value
  width after Ulysses replicates k/v heads up to ``sp``):

  - plain (Ulysses or one rank): ``e t (9 h + 2 kv + 4 F)`` (SwiGLU; GELU ``2 F``; MoE ``k (4 h + 2 F)``
    routed rows instead of ``4 F``): the two norms' inputs and outputs, the packed q/k/v and attention
    output kept by the flash kernel (no ``S x S`` matrix: SDPA's CPU and CUDA kernels keep the
    log-sum-exp), ``wo``'s input and the FFN's intermediates;
  - recompute (``sequence.recompute``): ``e t h`` per block (its input) and one block's plain activations
    while it is recomputed; with ``sequence.offload_checkpoints`` (or FPDT's ``sequence.offload``) the inputs
    live in host memory instead; with ``offload_checkpoints`` backward holds two of them on the device: the
    block's it recomputes and the previous block's, prefetched meanwhile (the device bytes saved:
    ``(blocks - 2) e t h``, where the peak is at the start of backward; none where it is at the first block's
    backward, beside every gradient: that block holds its input and its recomputed output either way), FPDT's
    offload alone one;
  - FPDT: each block is one chunk pipeline that keeps its input and output chunks and the head-layout
    q/k/v/out chunks, ``e t (4 h + 2 kv)``, in the chunk store: on the device, or in host memory with
    ``sequence.offload`` (then nothing sequence-sized stays on the device between forward and backward);
    its backward holds the incoming gradient and ``dx`` (``2 e t h``) plus one chunk's working set, in which
    the block kernel's own (:func:`loom.parallel.blocks.workspace`: two ``TILE x TILE`` score tiles per
    head for the pure-torch kernel, nothing sequence-squared for the flash kernels).
  - the loss: ``loss_chunks`` slices (FPDT: ``chunks``) of the LM head and cross-entropy, so
    ``3 t V / chunks`` fp32 logits, log-probabilities and their gradient at the worst moment. Under a
    pipeline the last stage computes full logits.
  - a pipeline stage keeps the activations of its in-flight micro-batches: ``M`` under GPipe,
    ``min(pp - stage, M)`` under 1F1B.
  - tensor parallelism (``mesh.tp = T``; not FPDT): what lives inside the tp regions (q/k/v, attention
    output, ``wo``'s input, the FFN intermediates, their backward working set and the vocabulary-split
    logits) divides by ``T``; the two norms' inputs and outputs (``4 h``) stay whole, or under Megatron-SP
    (``mesh.tp_sequence_parallel``, whose column-parallel layers gather their input again in backward
    instead of saving it) divide by ``T`` too (``loom bench memory`` has ``tp=2`` configurations).

Peak = ``W + O + ids + max(activations at the start of backward + the head's gradient, G + gradient-sync
buckets, G + the optimizer's per-parameter temporaries)``, ``ids`` the batch's int64 token ids, targets and
positions (and packed documents' ids): gradients grow while saved activations shrink, so the two never peak
together. ``loom bench memory`` compares this with the measured peak (the CPU
live-storage tracker of ``loom bench seqlen``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .config import Config
from .progress import fmt_bytes as _fmt

__all__ = ["Estimate", "estimate", "peak", "plan", "stage_split", "unit_params", "zero_settings", "longest_sequence",
           "forward_backward_peak", "attention_kernel"]

_ELEM = {"float32": 4, "float64": 8, "bfloat16": 2}


def zero_settings(cfg: Config) -> tuple[int, tuple[str, ...]]:
    """``(stage, axes)`` of the config's ``[zero]`` section; ``(0, ())`` when it has none."""
    z = getattr(cfg, "zero", None)
    stage = int(getattr(z, "stage", 0) or 0)
    axes = tuple(getattr(z, "axes", ("dp",)) or ("dp",))
    return stage, axes


def unit_params(cfg: Config, tp: int | None = None) -> list[int]:
    """Parameters this rank holds per pipeline unit: embedding, each block, final norm + head.

    ``tp`` (default ``mesh.tp``): attention heads, FFN width and vocabulary rows are split over it (the
    largest slice, as ``loom.parallel.tensor.shard_range`` gives the first ranks one row more); norms are
    replicated."""
    m, ep = cfg.model, cfg.mesh.ep
    tp = getattr(cfg.mesh, "tp", 1) if tp is None else tp
    hd = m.head_dim
    attn = (m.hidden * m.heads * hd * 2 + m.hidden * m.kv_heads * hd * 2) // tp
    if m.ffn == "moe":  # replicated gate, this ep rank's experts (gelu MLPs of two matrices)
        ffn = m.experts * m.hidden + (m.experts // ep) * 2 * m.hidden * m.ffn_hidden
    else:
        ffn = m.hidden * -(-m.ffn_hidden // tp) * (3 if m.ffn == "swiglu" else 2)
    vocab = -(-m.vocab // tp)
    block = attn + ffn + 2 * m.hidden
    return [vocab * m.hidden] + [block] * m.layers + [m.hidden + vocab * m.hidden]


def stage_split(cfg: Config) -> list[tuple[int, int]]:
    """Pipeline units ``[lo, hi)`` per stage (unit 0 = embedding, 1..layers = blocks, last = head), as
    ``HybridParallel(balance="params")`` cuts the model: one node per unit, so each costs its parameters + 1."""
    from ..parallel.partition import balance

    costs = [float(n + 1) for n in unit_params(cfg)]
    counts = balance(costs, cfg.mesh.pp) if cfg.mesh.pp > 1 else [len(costs)]
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


@dataclass(slots=True)
class Estimate:
    """Predicted bytes on one rank (the stage ``stage`` of the pipeline)."""

    stage: int
    units: tuple[int, int]
    weights: int
    grads: int
    optimizer: int
    zero_buffers: int
    activations: int
    host: int
    """Bytes held in host memory (FPDT chunks with offload), not counted in ``total``."""
    total: int
    detail: dict[str, Any] = field(default_factory=dict)


def _dims(cfg: Config) -> dict[str, int]:
    m, mesh, d = cfg.model, cfg.mesh, cfg.data
    p = mesh.sp
    u = p // max(1, mesh.sp_ring)  # ranks per Ulysses group
    kv_heads = m.kv_heads if m.kv_heads % u == 0 else u  # Ulysses replicates k/v heads up to its group
    rows = d.batch // (mesh.dp * mesh.ep)
    if mesh.pp > 1:
        rows //= d.micro_batches
    return {"e": _ELEM[cfg.train.dtype], "t": rows * (d.seq_len // p), "h": m.hidden, "kv": kv_heads * m.head_dim,
            "F": m.ffn_hidden, "V": m.vocab, "k": m.top_k}


def _ffn_saved(cfg: Config, d: dict[str, int]) -> int:
    """Elements per token the FFN keeps for backward (intermediates only; norms counted with the block)."""
    if cfg.model.ffn == "moe":
        return d["k"] * (4 * d["h"] + 2 * d["F"])
    return (4 if cfg.model.ffn == "swiglu" else 2) * d["F"]


def attention_kernel(cfg: Config) -> str:
    """The block kernel FPDT's attention would run for ``cfg`` (:func:`loom.parallel.blocks.block_kernel`:
    ``cpu-flash``, ``cuda-flash``, ``cuda-efficient`` or ``torch``), ``LOOM_ATTN_KERNEL`` included."""
    import torch

    from ..parallel.blocks import attention_kernel as device_kernel
    from ..parallel.blocks import block_kernel

    dev = torch.device(cfg.train.device)
    return block_kernel(device_kernel(dev), dev, getattr(torch, cfg.train.dtype), cfg.model.head_dim, False)


def _kernel_work(cfg: Config, d: dict[str, int]) -> int:
    """The block kernel's own working set in one FPDT block's backward (q block ``[rows, heads/U, seq/(R c), D]``
    against one kv block, ``U = sp / R`` ranks per Ulysses group, ``R`` the ring, ``c`` the chunks): a few score
    tiles for the tiled torch kernel, linear buffers for the CUDA SDPA kernels."""
    from ..parallel.blocks import workspace

    m, p = cfg.model, cfg.mesh.sp
    ring = max(1, cfg.mesh.sp_ring)
    u = p // ring  # FPDT's pipeline runs inside each Ulysses group, on its seq / ring tokens
    rows = d["t"] // (cfg.data.seq_len // p)
    block = cfg.data.seq_len // (ring * cfg.sequence.chunks)
    return workspace(attention_kernel(cfg), rows, m.heads // u, max(1, d["kv"] // m.head_dim // u), block, block,
                     m.head_dim, d["e"])


def _block(cfg: Config, d: dict[str, int]) -> tuple[int, int, int, int]:
    """``(saved on device, saved on host, backward working set, the first block's backward working set)`` bytes
    of one block for one micro-batch (the first block's backward is where every later gradient exists)."""
    e, t, h, kv = d["e"], d["t"], d["h"], d["kv"]
    plain = e * t * (9 * h + 2 * kv + _ffn_saved(cfg, d))
    work = e * t * (3 * h + 2 * d["F"])  # gradients of the widest intermediates while backpropagating
    tp = getattr(cfg.mesh, "tp", 1)
    if tp > 1:  # inside the tp regions: 1/tp; the norms' 4h whole, or 1/tp under Megatron-SP
        whole = 4 * h // tp if cfg.mesh.tp_sequence_parallel else 4 * h
        plain = e * t * (whole + (5 * h + 2 * kv + _ffn_saved(cfg, d)) // tp)
        work = e * t * (3 * h + 2 * d["F"] // tp)
    s = cfg.sequence
    fpdt = s.algorithm == "fpdt"  # at any sp: loom train runs FPDT on one rank too
    if fpdt:
        u = s.chunks
        chunk = e * (t // u) * (12 * h + 4 * kv + 4 * d["F"] // max(1, u)) + _kernel_work(cfg, d)
        kept = e * t * (4 * h + 2 * kv)
        plain, work = (0 if s.offload else kept), 2 * e * t * h + chunk
        host = kept if s.offload else 0
    else:
        host = 0
    if s.recompute:  # only the block input stays (in host memory with checkpoint offload or FPDT offload)
        inp = e * t * h
        on_host = getattr(s, "offload_checkpoints", False) or fpdt and s.offload
        # backward brings the input back and recomputes the block: its activations and its output (FPDT: and
        # the input back from the host); from the host, the previous block's input is prefetched meanwhile
        # and, outside FPDT, the block's own comes back as a new tensor
        back = (inp + (0 if fpdt else inp)) if getattr(s, "offload_checkpoints", False) else 0
        busy = work + plain + (2 if fpdt else 1) * inp + back
        # Outside FPDT the first block's backward (every later gradient made) holds its input (kept, or back
        # from the host) and its recomputed output and prefetches nothing: the same bytes wherever it was kept.
        first = busy if fpdt else work + plain + 2 * inp
        return (0 if on_host else inp), (inp if on_host else 0), busy, first
    return plain, host, work, work


def _loss(cfg: Config, d: dict[str, int], last: bool) -> tuple[int, int]:
    """``(saved, transient)`` bytes of the final norm + LM head + cross-entropy (last stage only)."""
    if not last:
        return 0, 0
    e, t, h, V = d["e"], d["t"], d["h"], d["V"]
    V = -(-V // getattr(cfg.mesh, "tp", 1))  # vocabulary-split logits under tp
    f = 8 if e == 8 else 4  # the loss accumulates in fp32 (fp64 for fp64 models)
    fpdt = cfg.sequence.algorithm == "fpdt"
    chunks = 1 if cfg.mesh.pp > 1 else (cfg.sequence.chunks if fpdt else 1)
    if chunks == 1:
        return e * t * 3 * h + f * t * V, 2 * f * t * V
    return e * t * h, (3 * f * t * V + 3 * e * t * h) // chunks + e * t * h


def _batch_ids(cfg: Config) -> int:
    """Bytes of this rank's integer inputs, held through the step: token ids and targets (int64) of its rows,
    the positions of its tokens (one row; per row with packed documents, with their document ids): 24 bytes a
    token on one row, a tenth of FPDT's device bytes per token at hidden 16 (``loom bench seqlen --ring``)."""
    mesh, d = cfg.mesh, cfg.data
    rows, s = d.batch // (mesh.dp * mesh.ep), cfg.padded_seq_len // mesh.sp
    packed = getattr(d, "pack", False)
    return 8 * (rows * s * (4 if packed else 2) + (0 if packed else s))


def _in_flight(cfg: Config, stage: int) -> int:
    mesh, m = cfg.mesh, cfg.data.micro_batches
    if mesh.pp == 1:
        return 1
    return m if mesh.schedule == "gpipe" else min(mesh.pp - stage, m)


def estimate(cfg: Config, zero: tuple[int, tuple[str, ...]] | None = None) -> list[Estimate]:
    """One :class:`Estimate` per pipeline stage (every rank of a stage holds the same).

    ``zero``: ``(stage, axes)`` instead of the config's ``[zero]`` section (a what-if).
    """
    units = unit_params(cfg)
    d = _dims(cfg)
    e = d["e"]
    zstage, zaxes = zero if zero is not None else zero_settings(cfg)
    axes = cfg.mesh.axes()
    z = 1
    for a in zaxes:
        z *= axes.get(a, 1)
    out = []
    for s, (lo, hi) in enumerate(stage_split(cfg)):
        n = sum(units[lo:hi])
        blocks = max(0, min(hi, cfg.model.layers + 1) - max(lo, 1))
        last = hi == len(units)
        w, g, o = e * n, e * n, 2 * e * n
        layer = e * max(units[lo:hi])
        zbuf = 0
        if z == 1:  # sharding over one rank changes nothing
            zstage = 0
        # Stages 2-3 may keep the master shard (and so its gradient and Adam state) in zero.master_dtype.
        m = _ELEM[master] if zstage >= 2 and (master := getattr(getattr(cfg, "zero", None), "master_dtype", "")) else e
        if zstage >= 1:
            o = 2 * m * n // z
        if zstage == 1:  # ShardedOptimizer's master blocks beside the full weights
            w += e * n // z
        if zstage >= 2:
            g = m * n // z
            zbuf += min(int(getattr(getattr(cfg, "zero", None), "bucket_mb", cfg.compress.bucket_mb) * 2**20), m * n)
            if zstage == 2 and m != e:  # the full compute-dtype weights plus the master shard beside them
                w += m * n // z
        if zstage >= 3:
            w = m * n // z
            # gathered in buckets: one holds whole modules up to zero.bucket_mb (of master bytes), maybe several layers
            cap = int(getattr(getattr(cfg, "zero", None), "bucket_mb", cfg.compress.bucket_mb) * 2**20)
            gathered = min(max(layer, cap * e // m), e * n)
            zbuf += min(3, -(-e * n // gathered)) * gathered + (e * units[-1] if last and cfg.mesh.pp == 1 else 0)
        saved, host, work, first = _block(cfg, d)
        loss_saved, loss_work = _loss(cfg, d, last)
        flight = _in_flight(cfg, s)
        acts = flight * blocks * saved
        head_grad = e * units[-1] if last else 0
        # Backward of the loss (every block's activations still saved), of the last block (the loss's freed),
        # of the first block (every later gradient made): saved activations shrink as gradients grow.
        ids = _batch_ids(cfg)  # alive through the whole step
        start_bwd = ids + max(acts + head_grad + max(flight * loss_saved + loss_work,
                                                     (flight - 1) * loss_saved + work), g + first)
        bucket = min(int(cfg.compress.bucket_mb * 2**20), g)
        sync = g + 2 * bucket
        if zstage == 1 and cfg.compress.policy == "none":  # also under tp and pp (Trainer._zero1_rs)
            sync = g + e * n + e * n // z  # the flat gradient reduce-scattered, and this rank's block of it
        step = g + 3 * e * max(units[lo:hi])
        total = w + o + zbuf + max(start_bwd, ids + sync, ids + step)
        out.append(Estimate(stage=s, units=(lo, hi), weights=w, grads=g, optimizer=o, zero_buffers=zbuf,
                            activations=start_bwd, host=flight * blocks * host, total=total,
                            detail={"blocks": blocks, "in_flight": flight, "tokens": d["t"], "zero": (zstage, z)}))
    return out


def peak(cfg: Config, zero: tuple[int, tuple[str, ...]] | None = None) -> Estimate:
    """The most loaded stage's :class:`Estimate`."""
    return max(estimate(cfg, zero), key=lambda x: x.total)


def forward_backward_peak(e: Estimate) -> int:
    """The part of ``e`` that one forward + backward holds with no optimizer: the weights and the activations
    at the start of backward (gradients included), without Adam's moments, ZeRO's buffers or the gradient
    sync (what ``loom bench seqlen`` measures)."""
    return e.weights + e.activations


def longest_sequence(cfg: Config, budget: int, zero: tuple[int, tuple[str, ...]] | None = None, *,
                     forward_backward: bool = False, **sequence: Any) -> int:
    """The longest ``data.seq_len`` whose predicted peak fits ``budget`` bytes per rank (0 if none does).

    ``zero`` as in :func:`estimate`; ``sequence`` overrides ``[sequence]`` keys (``algorithm="ulysses",
    chunks=1``) for a what-if. Lengths are multiples of ``sp x chunks``, as the layout needs.
    ``forward_backward``: count only :func:`forward_backward_peak` (a step with no optimizer).
    """
    s = dataclasses.replace(cfg.sequence, **sequence)
    unit = cfg.mesh.sp * s.chunks

    def fits(n: int) -> bool:
        c = dataclasses.replace(cfg, sequence=s, data=dataclasses.replace(cfg.data, seq_len=n * unit))
        e = peak(c, zero)
        return (forward_backward_peak(e) if forward_backward else e.total) <= budget

    first = -(-2 // unit)  # data.seq_len >= 2: at sp = 1 the first length is 2, not 1
    if not fits(first):
        return 0
    lo, hi = first, 2 * first
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * unit


def _tokens(n: int) -> str:
    return f"{n / 2**20:.2f}M" if n >= 2**20 else f"{n / 2**10:.0f}K" if n >= 2**10 else str(n)


def memory_lines(cfg: Config) -> list[str]:
    """The dry-run's memory section: the configured run per stage, ZeRO stages 0-3, and with
    ``train.device_memory`` set, whether it fits and the longest sequence under each attention scheme."""
    ests = estimate(cfg)
    zstage, zaxes = zero_settings(cfg)
    lines = []
    for e in ests:
        lines.append(f"  memory     stage {e.stage} (units {e.units[0]}..{e.units[1] - 1}, {e.detail['in_flight']} "
                     f"micro-batch(es) in flight): ~{_fmt(e.total)} of tensors per rank = weights {_fmt(e.weights)} "
                     f"+ grads {_fmt(e.grads)} + Adam {_fmt(e.optimizer)} + ZeRO buffers {_fmt(e.zero_buffers)} + "
                     f"activations/work {_fmt(e.activations)}" + (f"; host {_fmt(e.host)}" if e.host else ""))
    axes = zaxes if zstage else tuple(a for a in ("dp", "sp") if cfg.mesh.axes().get(a, 1) > 1) or ("dp",)
    row = [f"{st}: {_fmt(peak(cfg, zero=(st, axes)).total)}" for st in range(4)]
    lines.append(f"  zero       peak tensors per rank by ZeRO stage over {' x '.join(axes)} (configured: {zstage}): "
                 + ", ".join(row))
    lines.append("             (tensors only: the progress shows them as 'peak CUDA' on a GPU; on the CPU its "
                 "'peak RSS' is the whole process, Python, torch and MPI included)")
    budget = int(getattr(cfg.train, "device_memory", 0) * 2**30)
    if budget:
        lines += _fit_lines(cfg, budget, (zstage, zaxes), (3, axes))
    return lines


_WHAT_IF = (("as configured", {}),
            ("plain Ulysses", {"algorithm": "ulysses", "chunks": 1, "offload": False, "recompute": False,
                               "offload_checkpoints": False}),
            ("Ulysses + recompute", {"algorithm": "ulysses", "chunks": 1, "offload": False, "recompute": True,
                                     "offload_checkpoints": False}),
            ("Ulysses + recompute, checkpoints on host", {"algorithm": "ulysses", "chunks": 1, "offload": False,
                                                          "recompute": True, "offload_checkpoints": True}))


def _fit_lines(cfg: Config, budget: int, zero: tuple[int, tuple[str, ...]], zero3: tuple[int, tuple[str, ...]]):
    """Whether the run fits ``budget`` bytes per rank, and the longest sequence per attention scheme, under
    the configured ZeRO stage and under ZeRO-3."""
    both = [zero] if zero[0] == 3 else [zero, zero3]
    tag = [f"ZeRO-{z[0]}" + (f" over {' x '.join(z[1])}" if z[0] else "") for z in both]
    fits = [peak(cfg, z).total for z in both]
    out = ["  fits       " + "; ".join(f"{t}: {'yes' if f <= budget else 'NO'} ({_fmt(f)} of {_fmt(budget)})"
                                        for t, f in zip(tag, fits))]
    for label, kw in _WHAT_IF:
        ns = [longest_sequence(cfg, budget, z, **kw) for z in both]
        out.append(f"  longest    {label}: " + "; ".join(f"{t}: seq_len {n:,} ({_tokens(n)})" for t, n in zip(tag, ns)))
    return out


def _traffic_lines(cfg: Config, stage_params: int) -> list[str]:
    """Bytes per step per rank on each mesh axis (uncompressed, bandwidth-optimal accounting)."""
    m, mesh, d = cfg.model, cfg.mesh, cfg.data
    elem = _ELEM[cfg.train.dtype]
    b_loc = d.batch // (mesh.dp * mesh.ep)
    s_loc = d.seq_len // mesh.sp
    lines = ["  bytes per step per rank (uncompressed, bandwidth-optimal accounting):"]
    if mesh.dp > 1:
        n = stage_params * elem
        zstage, zaxes = zero_settings(cfg)
        if zstage == 1 and cfg.compress.policy == "none":
            # ShardedOptimizer(reduce=True) over the zero axes, on any mesh (tp and pp included): DDP's bytes
            g = mesh.dp * (mesh.sp if "sp" in zaxes else 1)
            lines.append(f"    {' x '.join(zaxes):<3} ZeRO-1 reduce-scatter of gradients + allgather of the updated "
                         f"blocks, n(P-1)/P each (P = {g}): {_fmt(2 * n * (g - 1) / g)}")
        elif zstage == 1 and tuple(zaxes) == ("dp",):  # the hook is an allreduce codec; then each rank's block
            lines.append(f"    dp  allreduce of gradients 2n(P-1)/P: {_fmt(2 * n * (mesh.dp - 1) / mesh.dp)} "
                         f"before compression ({cfg.compress.policy}) + ZeRO-1 allgather of the updated blocks "
                         f"n(P-1)/P: {_fmt(n * (mesh.dp - 1) / mesh.dp)}")
        else:
            lines.append(f"    dp  allreduce of gradients 2n(P-1)/P: {_fmt(2 * n * (mesh.dp - 1) / mesh.dp)}"
                         + ("" if cfg.compress.policy == "none" else f" before compression ({cfg.compress.policy})"))
    if mesh.sp > 1:
        p, ring = mesh.sp, max(1, mesh.sp_ring)
        u = p // ring
        kv = m.kv_heads if m.kv_heads % u == 0 else u
        per_layer = b_loc * s_loc * m.head_dim * (2 * m.heads + 2 * kv) * elem * (u - 1) / u
        grads = stage_params * elem * 2 * (p - 1) / p
        lines.append(f"    sp  Ulysses all-to-all (q,k,v,o fwd+bwd) {_fmt(2 * per_layer * m.layers / mesh.pp)} "
                     f"+ gradient allreduce {_fmt(grads)}")
        if ring > 1:  # K/V blocks R-1 times forward and backward, (dk, dv) R times backward; acc dtype 4 or 8
            kv_block = b_loc * s_loc * u * (kv // u) * m.head_dim * 2
            ring_bytes = kv_block * (2 * (ring - 1) * elem + ring * (8 if elem == 8 else 4)) * m.layers / mesh.pp
            lines.append(f"    sp  ring K/V and (dk, dv) passes over {ring} groups: {_fmt(ring_bytes)}")
    if mesh.ep > 1:
        lines.append(f"    ep  MoE dispatch + combine all-to-allv (fwd+bwd) ~"
                     f"{_fmt(4 * b_loc * s_loc * m.top_k * m.hidden * elem * (mesh.ep - 1) / mesh.ep * m.layers)} "
                     f"(uniform routing)")
    if mesh.pp > 1:
        lines.append(f"    pp  activations + their grads between stages: {_fmt(2 * b_loc * s_loc * m.hidden * elem)}")
    if mesh.tp > 1:  # per block 2 allreduces forward (attention, FFN) and 2 backward; embedding fwd, head bwd
        n = b_loc * s_loc * m.hidden * elem
        regather = ""
        if mesh.tp_sequence_parallel:  # Megatron-SP: each region entry (2 per block, the head) gathers again
            regather = f" + re-gathers ({2 * m.layers + 1}) {_fmt((2 * m.layers + 1) * n * (mesh.tp - 1) / mesh.tp)}"
        lines.append(f"    tp  activation allreduces ({4 * m.layers + 2} of [tokens, hidden]) 2n(P-1)/P: "
                     f"{_fmt((4 * m.layers + 2) * 2 * n * (mesh.tp - 1) / mesh.tp)}{regather}"
                     + ("" if cfg.compress.policy == "none" else f" before compression ({cfg.compress.policy})"))
    if mesh.size == 1:
        lines.append("    (one rank: no communication)")
    return lines


def plan(cfg: Config, world_size: int | None = None) -> str:
    """Human-readable plan of a run: model, mesh, the real stage split, memory per rank, bytes per step."""
    m, mesh, d = cfg.model, cfg.mesh, cfg.data
    units = unit_params(cfg)
    whole = unit_params(cfg, tp=1)
    total = whole[0] + whole[-1] + (whole[1] if m.layers else 0) * m.layers
    if m.ffn == "moe":  # count every expert once, not this ep rank's share
        total += m.layers * (m.experts - m.experts // mesh.ep) * 2 * m.hidden * m.ffn_hidden
    split = stage_split(cfg)
    names = ["embed"] + [f"block {i}" for i in range(m.layers)] + ["head"]
    stages = ", ".join(f"stage {i}: {names[lo]}..{names[hi - 1]}" for i, (lo, hi) in enumerate(split))
    seq = cfg.sequence
    lines = [
        f"loom train plan ({'world ' + str(world_size) + ' ranks' if world_size else 'not launched'})",
        f"  model      {m.layers} layers, hidden {m.hidden}, heads {m.heads}/{m.kv_heads} kv, ffn {m.ffn} "
        f"{m.ffn_hidden}, vocab {m.vocab}: {total:,} parameters ({_fmt(total * _ELEM[cfg.train.dtype])} in "
        f"{cfg.train.dtype})",
        f"  mesh       dp={mesh.dp} pp={mesh.pp} sp={mesh.sp} ep={mesh.ep}"
        f"{f' tp={mesh.tp}' if mesh.tp > 1 else ''} = {mesh.size} ranks"
        + (f" (sp = Ulysses {mesh.sp // mesh.sp_ring} x ring {mesh.sp_ring})" if mesh.sp_ring > 1 else ""),
        f"  stages     {stages}" + (" (HybridParallel's split: min-max parameters)" if mesh.pp > 1 else ""),
        f"  sequence   {seq.algorithm}, seq_len {d.seq_len:,}"
        + (f" (padded to {cfg.padded_seq_len:,})" if cfg.padded_seq_len != d.seq_len else "")
        + f" -> {cfg.padded_seq_len // mesh.sp:,} tokens per sp rank, "
        f"chunks {seq.chunks}, offload {seq.offload}, recompute {seq.recompute}"
        + (", checkpoints on host" if getattr(seq, "offload_checkpoints", False) else "")
        + (f", attention kernel {attention_kernel(cfg)}" if seq.algorithm == "fpdt" else ""),
        f"  batch      {d.batch} sequences/step global, {d.batch // (mesh.dp * mesh.ep)} per dp replica, "
        f"{d.batch * d.seq_len:,} tokens/step",
        *memory_lines(cfg),
        f"  data       {'Python stdlib sources' if not d.path else d.path}, max {d.max_bytes:,} bytes, "
        f"held-out {d.heldout:.0%}" + (", packed documents (one per file)" if getattr(d, "pack", False) else ""),
        f"  compress   policy {cfg.compress.policy!r} on dp, buckets of {cfg.compress.bucket_mb} MiB",
    ]
    return "\n".join(lines + _traffic_lines(cfg, max(sum(units[lo:hi]) for lo, hi in split)))
