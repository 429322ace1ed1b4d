"""``loom bench seqlen``: the longest trainable sequence at a fixed per-rank memory budget, Ulysses vs FPDT.

For one Llama-style model (:mod:`loom.models.llama`, vocab/hidden ~ 31 as in Llama-3-8B) on ``P`` ranks, each
configuration runs forward + backward of the LM loss at growing sequence lengths and keeps the longest
whose per-rank peak memory (max over ranks) stays within ``--budget``. Memory is measured by
:class:`loom.parallel.offload.MemoryTracker`: on CPU the peak of live torch storages on the compute device
(chunks offloaded to the host pool are not counted), on CUDA the allocator's ``max_memory_allocated``.

Search plan per configuration: two cheap probes at small lengths give the slope of peak memory in the
sequence length; the secant through the two longest fitting lengths predicts the crossing with the budget
(at most 4x further) until a length does not fit, then linear interpolation inside the bracket until it is
within ``max(step, 1/32)`` of the length. The attention-pipeline rows (FPDT's and FPDT x ring's) step by
whole ``--attn-chunk`` chunks per rank (``ranks x --attn-chunk`` tokens, and whole ``--chunk`` chunks), so that
every length they run lays out full-size attention chunks (:func:`_search_step`). The peak grows with the
length only at a fixed number of attention chunks (each holds at most ``--attn-chunk`` tokens per rank, so one
more chunk shrinks every block): before the attention-pipeline rows stop, the first lengths of the next two
chunk counts are run too, and the search goes on above any that fits. Every reported length was actually run
and fit; the next step up was run and did not (or hit ``--max-seq``, or ``--max-ratio`` times the first row's
length).

With ``--json`` the document is rewritten after every probe (``meta.partial`` true, the finished rows'
``results`` and every probe so far under ``meta.probes``), so a run stopped by a time limit still leaves the
longest lengths found; the last write is the full result.

Configurations, cumulative (each row adds one FPDT ingredient to the previous one): ``ulysses`` (with
per-block activation checkpointing, the usual long-context setting); ``+ loss chunking`` (LM head +
cross-entropy chunked and recomputed); ``+ FFN chunking``; ``+ attention pipeline`` (each block one FPDT chunk
pipeline, still checkpointed); ``+ offload`` (no checkpointing: each block keeps its input and
attention-output chunks and its pipeline's q/k/v/out/lse chunks in host memory: full FPDT).
Then, at the Ulysses limit: time per token of both, the all-to-alls per layer and the host<->device bytes.

With ``--ring R`` (2-D sequence parallelism, for heads too few for Ulysses over all ``P`` ranks) the rows
above run at ``sp = P / R`` with ``R`` data-parallel replicas on the same ranks (each replica its own
sequence, the per-rank budget unchanged), and one more row, ``FPDT x ring R``, runs full FPDT at ``sp = P``:
``R`` Ulysses groups of ``P / R`` ranks with ring attention across them
(:class:`loom.parallel.sequence.FPDTRingPipeline`). Then, at FPDT's longest length (rounded down to a multiple
of ``P x --attn-chunk``, so that both lay out whole attention chunks): time per token of FPDT (``sp = P / R`` x
``dp = R``: ``R`` sequences per step) and of FPDT x ring (one sequence over ``P`` ranks).
Times are forward + backward only (no gradient reduction over sp or dp, as in every row).

With ``--offload-checkpoints`` one more row, ``ulysses, ckpt on host``, follows ``ulysses``: the same
checkpointed blocks with their saved inputs in host memory (``loom train --sequence.offload_checkpoints``,
:class:`loom.parallel.offload.HostPool` behind :func:`loom.models.llama.recompute`), and two columns give
the memory model's view of both rows (:func:`loom.train.memory.longest_sequence` with
``forward_backward=True``: weights + activations at the start of backward, no optimizer state, as these
rows run no optimizer): its longest sequence under the same budget and, on the host row, its factor over
the Ulysses row, beside the measured factor ("Step gain"). The two rows' searches then narrow to one
search step (not ``1/32`` of the length). On CPU the host is the same memory: as for FPDT's offloaded
chunks, the tracker counts what a device would hold: a block input copied out (``put``) is cloned outside
its view and not counted, the device tensor it came from is freed once its block's forward has run, and the copy
brought back in backward (``prefetch``/``get``, a new tensor) is counted from that moment until the block's
recompute drops it; the bytes moved are the ``to_host`` / ``to_device`` counters.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any, Callable

import torch

from .. import cli_args, settings
from ..comm import world
from ..models.llama import Llama, LlamaConfig
from ..parallel.offload import MemoryTracker, reset_transfer_stats, transfer_stats
from ..parallel.sequence import alltoall_stats, reset_alltoall_stats, shard_sequence
from .omb import Table, parse_size

__all__ = ["main", "parser"]

STEPS = ("ulysses", "+ loss chunking", "+ FFN chunking", "+ attention pipeline", "+ offload (FPDT)")
CKPT_STEP = "ulysses, ckpt on host"
"""``--offload-checkpoints``: the Ulysses row with its block inputs (checkpoints) in host memory."""


def ring_step(ring: int) -> str:
    """The row name of full FPDT with ring attention across ``ring`` Ulysses groups (``--ring``)."""
    return f"FPDT x ring {ring}"


def parser() -> argparse.ArgumentParser:
    p = cli_args.ArgumentParser(prog="loom bench seqlen", description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--budget", type=parse_size, default=parse_size("2560K"), help="per-rank device memory budget")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1000, help="vocab/hidden ~ 31 as in Llama-3-8B")
    p.add_argument("--ffn", choices=("swiglu", "gelu"), default="swiglu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--chunk", type=int, default=64, help="tokens per rank in one FFN / loss chunk")
    p.add_argument("--attn-chunk", type=int, default=128, help="tokens per rank in one attention chunk")
    p.add_argument("--max-seq", type=int, default=1 << 20, help="stop searching beyond this global length")
    p.add_argument("--max-ratio", type=float, default=0.0,
                   help="stop searching the later rows beyond this multiple of the first row's longest length "
                        "(17: enough to show FPDT's 16x goal without climbing further; 0: no cap)")
    p.add_argument("--ring", type=int, default=1,
                   help="ring degree R: the rows run at sp = ranks / R (x dp = R replicas), and a last row runs "
                        "FPDT x ring R at sp = ranks (for heads that stop Ulysses at ranks / R)")
    p.add_argument("--offload-checkpoints", action="store_true",
                   help=f"add the row '{CKPT_STEP}' (the Ulysses row's checkpointed block inputs in host memory, "
                        f"loom train's --sequence.offload_checkpoints) and the memory model's longest sequence and "
                        f"factor beside the measured ones")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--no-breakdown", action="store_true", help="only Ulysses and full FPDT")
    p.add_argument("--repeats", type=int, default=3, help="timed steps at the equal length (best kept)")
    p.add_argument("-v", "--verbose", action="store_true", help="print every probe")
    p.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    p.add_argument("--hf-config", metavar="PATH", help="a transformers config (directory or JSON; Llama, Qwen2, "
                   "Mistral): compare transformers' own sdpa attention (whole sequence per rank), loom Ulysses and "
                   "loom FPDT on it instead of loom's model (the shape flags are then ignored)")
    return p


def chunk_counts(s_local: int, args) -> tuple[int, int]:
    """``(u_small, u_attn)``: FFN/loss chunks and attention chunks for ``s_local`` tokens per rank.

    ``u_small`` cuts the local length into ``--chunk``-token chunks (a length is a multiple of the search
    granule, so they are whole); ``u_attn`` is the fewest of them, a divisor of ``u_small`` so that attention
    chunks are whole FFN chunks, whose chunks hold at most ``--attn-chunk`` tokens (ceiling, not floor: a
    floor let a block reach twice ``--attn-chunk``); when no divisor does, every FFN chunk is one.
    """
    u_small = max(1, s_local // args.chunk)
    want = max(1, -(-s_local // args.attn_chunk))
    u_attn = min((d for d in range(want, u_small + 1) if u_small % d == 0), default=u_small)
    return u_small, u_attn


def _config(step: str, args, seq: int, p: int) -> LlamaConfig:
    """The model of row ``step`` at global length ``seq`` on ``p`` sp ranks."""
    u_small, u_attn = chunk_counts(seq // p, args)
    base: dict[str, Any] = dict(layers=args.layers, hidden=args.hidden, heads=args.heads, kv_heads=args.kv_heads,
                                vocab=args.vocab, ffn=args.ffn, checkpoint=True)
    if step == CKPT_STEP:
        return LlamaConfig(**base, sequence_parallel="ulysses", offload_checkpoints=True)
    if step == ring_step(args.ring):  # full FPDT, its attention pipeline a ring across the Ulysses groups
        return LlamaConfig(**base | {"checkpoint": False}, sequence_parallel="fpdt", chunks=u_attn,
                           loss_chunks=u_small, ffn_chunks=u_small, offload=True, ring=args.ring)
    i = STEPS.index(step)
    if i < 3:  # Ulysses, then Ulysses with the loss and then also the FFN chunked
        return LlamaConfig(**base, sequence_parallel="ulysses", loss_chunks=u_small if i >= 1 else 1,
                           ffn_chunks=u_small if i >= 2 else 1)
    # With offload the FPDT block keeps x_i and o_i chunks (and its pipeline's chunks) on the host, which
    # replaces block checkpointing; without offload the blocks stay checkpointed (only their input is kept).
    base["checkpoint"] = i < 4
    return LlamaConfig(**base, sequence_parallel="fpdt", chunks=u_attn, loss_chunks=u_small, ffn_chunks=u_small,
                       offload=i >= 4)


def _granule(args, p: int, step: str) -> int:
    """Search step: the chunked rows need whole chunks per rank; plain Ulysses is searched 16 tokens/rank fine;
    the ring row also needs ``2 R`` zig-zag pieces (:func:`loom.parallel.sequence.ring_positions`)."""
    if step == ring_step(args.ring):
        return math.lcm(p * args.chunk, 2 * args.ring)
    return p * (16 if step in (STEPS[0], CKPT_STEP) else args.chunk)


def _search_step(args, p: int, step: str) -> int:
    """The length search's step: :func:`_granule`, and for the attention-pipeline rows (FPDT's and the ring's
    alike) also whole ``--attn-chunk`` chunks per rank, so that every length they run lays out full-size
    attention chunks and their figures stay comparable (:func:`chunk_counts`: a per-rank ``--chunk`` count with
    no divisor near the wanted attention chunk count falls back to ``--chunk``-token attention chunks, 4x the
    blocks per token at half the size)."""
    gran = _granule(args, p, step)
    if step in STEPS[3:] or step == ring_step(args.ring):
        return math.lcm(gran, p * args.attn_chunk)
    return gran


def equal_length(seq: int, args, p: int, steps: list[str]) -> int:
    """The length at which ``steps`` are timed side by side: ``seq`` (Ulysses' longest) rounded down to a length
    every configuration can lay out (a multiple of each one's search granule), at least one such unit; the
    chunked rows need whole chunks per rank, which Ulysses' finer granule does not guarantee."""
    unit = math.lcm(*(_granule(args, p, st) for st in steps))
    return max(unit, seq // unit * unit)


def _device() -> torch.device:
    """This rank's device: ``cuda:local_rank`` (round-robin over the visible GPUs, made current so that
    kernels, streams and the allocator's counters are this rank's) or the CPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    info = settings.launch_info()
    local = 0 if info is None else (info.local_rank if info.local_rank is not None else info.rank)
    dev = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    return dev


class _Runner:
    PIPELINED = STEPS[3:]  # the rows whose attention runs as FPDT chunks (a sawtooth peak)
    on_probe: Callable[[str, dict[int, dict[str, float]]], None] | None = None
    """Called after every probe with the row and its probes so far (length -> measurements)."""

    def __init__(self, args, comm):
        self.args, self.comm = args, comm
        self.dtype = getattr(torch, args.dtype)
        self.device = _device()
        ring = args.ring
        u = comm.size // ring  # --ring: the plain rows' sp groups are consecutive ranks, one per replica
        self.sp = comm if ring == 1 else comm.split(comm.rank // u, comm.rank % u, name=f"{comm.name}.sp{u}")

    def sp_comm(self, step: str):
        """The sp communicator of row ``step``: every rank for the ring row, else ``P / R`` ranks."""
        ring = self.args.ring
        return self.comm if ring == 1 or step == ring_step(ring) else self.sp

    def step(self, step: str, seq: int, *, measure: bool = True) -> dict[str, float]:
        """One forward + backward at global length ``seq``; peak bytes (max over ranks), seconds, counters."""
        args, comm = self.args, self.sp_comm(step)
        cfg = _config(step, args, seq, comm.size)
        model = Llama(cfg, comm).to(device=self.device, dtype=self.dtype)
        g = torch.Generator().manual_seed(seq)
        tok = torch.randint(0, args.vocab, (args.batch, seq), generator=g)
        tgt = torch.randint(0, args.vocab, (args.batch, seq), generator=g)
        tok = shard_sequence(tok, comm, chunks=cfg.layout_chunks, ring=cfg.layout_ring).to(self.device)
        tgt = shard_sequence(tgt, comm, chunks=cfg.layout_chunks, ring=cfg.layout_ring).to(self.device)
        return self._measure(lambda: model.loss(tok, tgt).backward(), [*model.parameters(), tok, tgt], measure)

    def _measure(self, run, track: list[torch.Tensor], measure: bool) -> dict[str, float]:
        """Run ``run()`` (forward + backward) once; peak bytes (max over ranks, ``track`` counted as live),
        seconds (max over ranks), all-to-alls and host<->device bytes."""
        comm = self.comm
        reset_alltoall_stats()
        reset_transfer_stats()
        comm.barrier()
        t0 = time.perf_counter()
        peak = 0
        if measure:
            with MemoryTracker(self.device) as mem:
                mem.track(*track)
                run()
            peak = mem.peak
        else:
            run()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        secs = time.perf_counter() - t0
        comm.barrier()
        tr = transfer_stats()
        peak = comm.allreduce_object(int(peak), "max") if comm.size > 1 else int(peak)
        secs = comm.allreduce_object(secs, "max") if comm.size > 1 else secs
        return {"peak": peak, "secs": secs, "a2a": alltoall_stats()["count"], "to_host": tr["to_host"],
                "to_device": tr["to_device"]}

    def longest(self, step: str, max_seq: int | None = None, *,
                fine: bool = False) -> tuple[int, dict[str, float], int]:
        """The longest fitting global length up to ``max_seq`` (default ``--max-seq``), its measurements, and
        the number of probes run; ``fine``: to within one search step (else ``1/32`` of the length)."""
        args, p = self.args, self.sp_comm(step).size
        max_seq = args.max_seq if max_seq is None else max_seq
        gran = _search_step(args, p, step)
        budget = args.budget
        seen: dict[int, dict[str, float]] = {}

        def fits(seq: int) -> bool:
            if seq not in seen:
                seen[seq] = self.step(step, seq)
                if args.verbose and self.comm.rank == 0:
                    m = seen[seq]
                    print(f"#   probe {step}: seq {seq} peak {m['peak'] / 2**20:.2f} MiB ({m['secs']:.1f} s)",
                          flush=True)
                if self.on_probe is not None:
                    self.on_probe(step, seen)
            return seen[seq]["peak"] <= budget

        s1 = gran
        if not fits(s1):
            raise SystemExit(f"loom bench seqlen: {step} does not fit even {s1} tokens in {budget} bytes per rank; "
                             f"raise --budget or lower --chunk/--attn-chunk")
        lo, hi = s1, None
        if 2 * gran <= max_seq:  # the second probe of the slope, not past --max-seq
            fits(2 * gran)

        def rnd(x: float) -> int:
            return int(x) // gran * gran

        def beyond(seq: int) -> list[int]:
            """Lengths above a failing ``seq`` that may still fit: the first of each of the next two attention
            chunk counts (more, smaller blocks). At a fixed chunk count the peak grows with the length, but
            one more chunk shrinks every block, so the attention-pipeline rows' peak is a sawtooth."""
            if step not in self.PIPELINED and step != ring_step(args.ring):
                return []
            out, n = [], seq
            u = chunk_counts(seq // p, args)[1]
            while len(out) < 2 and n + gran <= max_seq:
                n += gran
                if chunk_counts(n // p, args)[1] > u:
                    out.append(n)
                    u = chunk_counts(n // p, args)[1]
            return out

        while True:
            ok = sorted(k for k, m in seen.items() if m["peak"] <= budget)
            bad = sorted(k for k, m in seen.items() if m["peak"] > budget)
            lo = ok[-1]
            hi = next((k for k in bad if k > lo), None)
            tol = gran if fine else max(gran, rnd(lo / 32))
            if hi is not None and hi - lo <= tol:
                more = [n for n in beyond(hi) if n not in seen]
                if not more:
                    break
                for n in more:  # verified: if one fits, the search goes on above it
                    fits(n)
                continue
            if hi is None:  # extrapolate (secant through the two longest fitting lengths), at most 4x further
                a_, b_ = (ok[-2], lo) if len(ok) > 1 else (lo, lo)
                slope = (seen[b_]["peak"] - seen[a_]["peak"]) / max(b_ - a_, 1)
                nxt = lo + (budget - seen[lo]["peak"]) / slope if slope > 0 else 4 * lo
                nxt = min(max(rnd(nxt), lo + tol), 4 * lo, rnd(max_seq))
                if nxt <= lo:  # reached --max-seq
                    break
            else:  # interpolate between the bracket's ends, kept strictly inside it
                frac = (budget - seen[lo]["peak"]) / max(seen[hi]["peak"] - seen[lo]["peak"], 1)
                nxt = min(max(rnd(lo + frac * (hi - lo)), lo + gran), hi - gran)
                if nxt in seen:
                    nxt = rnd((lo + hi) / 2)
                if nxt <= lo or nxt >= hi:
                    break
            fits(nxt)
        return lo, seen[lo], len(seen)


HF_STEPS = ("transformers sdpa", "loom ulysses", "loom fpdt")


class _HFRunner(_Runner):
    """The same search on an unmodified transformers model: sdpa on the whole sequence (no sequence
    parallelism: every rank holds it), then loom's Ulysses, then FPDT (attention chunks with offload, chunked
    MLP and LM head + loss) through :class:`loom.integrations.transformers.SequenceParallel`. No activation
    checkpointing in any row."""

    PIPELINED = HF_STEPS[2:]

    def __init__(self, args, comm):
        super().__init__(args, comm)
        from ..integrations.transformers import read_config

        self.hf = read_config(args.hf_config, "--hf-config")
        self.models: dict[str, Any] = {}

    def _model(self, step: str, seq: int):
        from transformers import AutoModelForCausalLM

        from ..integrations.transformers import SequenceParallel

        u_small, u_attn = chunk_counts(seq // self.comm.size, self.args)
        key = (step, u_attn, u_small)
        if key not in self.models:
            self.models.clear()  # one model alive at a time: the budget counts its parameters
            torch.manual_seed(0)
            cfg = type(self.hf).from_dict(self.hf.to_dict())
            cfg._attn_implementation = "sdpa"
            model = AutoModelForCausalLM.from_config(cfg, dtype=self.dtype).to(self.device)
            sp = None
            if step == HF_STEPS[1]:
                sp = SequenceParallel(model, self.comm, mode="ulysses")
            elif step == HF_STEPS[2]:
                sp = SequenceParallel(model, self.comm, mode="fpdt", chunks=u_attn, offload=True,
                                      ffn_chunks=u_small, loss_chunks=u_small)
            self.models[key] = (model, sp)
        return self.models[key]

    def step(self, step: str, seq: int, *, measure: bool = True) -> dict[str, float]:
        from ..integrations.transformers import lm_loss, shift_labels

        vocab = self.hf.vocab_size
        model, sp = self._model(step, seq)
        g = torch.Generator().manual_seed(seq)
        tok = torch.randint(0, vocab, (self.args.batch, seq), generator=g)
        if sp is not None:
            b = sp.shard(tok, labels=tok)
            ins = [b.input_ids.to(self.device), b.position_ids.to(self.device), b.shift_labels.to(self.device)]
            b.input_ids, b.position_ids, b.shift_labels = ins

            def run():
                sp.loss(b).backward()
        else:
            ins = [tok.to(self.device), shift_labels(tok).to(self.device)]

            def run():
                lm_loss(model(input_ids=ins[0], use_cache=False).logits, ins[1]).backward()
        model.zero_grad(set_to_none=True)
        out = self._measure(run, [*model.parameters(), *ins], measure)
        model.zero_grad(set_to_none=True)
        return out


def _main_hf(args, comm) -> int:
    """``--hf-config``: the longest sequence of each row, then the time per token of each at the sdpa limit."""
    run = _HFRunner(args, comm)
    h = run.hf
    model = (f"{h.model_type} layers={h.num_hidden_layers} hidden={h.hidden_size} heads={h.num_attention_heads} "
             f"kv_heads={h.num_key_value_heads} ffn={h.intermediate_size} vocab={h.vocab_size} {args.dtype} "
             f"batch={args.batch} (transformers {_hf_version()})")
    chunks = (f"FPDT: FFN/loss chunk {args.chunk} tokens/rank, attention chunk {args.attn_chunk} tokens/rank, "
              f"offload on; time per token at the sdpa limit, best of {max(1, args.repeats)}")
    ranks = f"{comm.size} (sp={comm.size} for the loom rows; sdpa holds the whole sequence on every rank)"
    table = Table("Longest Trainable Sequence, transformers model (forward + backward)",
                  ["Mode", "Max seq", "Peak MiB", "x sdpa", "us/token", "Probes"], rank=comm.rank)
    table.meta = {"model": model, "ranks": ranks, "budget": _budget_note(args, run.device), "chunks": chunks}
    table.widths = [20, 10, 11, 9, 10, 8]
    table.header()
    results: dict[str, Any] = {}
    progress = _progress(table, args, run, results)
    for st in HF_STEPS:
        seq, m, probes = run.longest(st)
        results[st] = {"max_seq": seq, "probes": probes, **m}
    seq_eq = results[HF_STEPS[0]]["max_seq"]  # a multiple of sp x chunk: every row can run it
    for st in HF_STEPS:
        best = min(run.step(st, seq_eq, measure=False)["secs"] for _ in range(max(1, args.repeats)))
        r = results[st]
        r["us_per_token"] = best / max(seq_eq, 1) * 1e6
        table.add(st, r["max_seq"], r["peak"] / 2**20, f"{r['max_seq'] / results[HF_STEPS[0]]['max_seq']:.2f}x",
                  f"{r['us_per_token']:.1f}", r["probes"])
    table.write_json(args.json, partial=False, results=results, equal_length=seq_eq, probes=progress)
    return 0


def _progress(table: Table, args, run: _Runner, results: dict[str, Any]) -> dict[str, Any]:
    """With ``--json``, rewrite the document after every probe (rank 0): ``partial`` true, the finished rows in
    ``results`` (filled in by the caller) and each row's probes so far (length -> peak bytes) with the longest
    that fit. Returns the probes dict, which the caller adds to its final document."""
    probes: dict[str, Any] = {}

    def on_probe(step: str, seen: dict[int, dict[str, float]]) -> None:
        fit = [k for k, m in seen.items() if m["peak"] <= args.budget]
        probes[step] = {"longest_fit": max(fit, default=0),
                        "peaks": {str(k): m["peak"] for k, m in sorted(seen.items())}}
        table.write_json(args.json, partial=True, results=results, probes=probes)

    if args.json:
        run.on_probe = on_probe
    return probes


def _budget_note(args, device: torch.device) -> str:
    how = "CUDA allocator" if device.type == "cuda" else "CPU live-storage tracker"
    return f"{args.budget / 2**20:.2f} MiB per rank ({how})"


def _hf_version() -> str:
    import transformers

    return transformers.__version__


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    torch.set_num_threads(1)
    comm = world()
    _check_args(args, comm)
    if args.hf_config:
        return _main_hf(args, comm)
    p = comm.size // args.ring  # the plain rows' sp size (args.ring replicas of it on the same ranks)
    run = _Runner(args, comm)
    steps = [STEPS[0], STEPS[-1]] if args.no_breakdown else list(STEPS)
    ckpt = [CKPT_STEP] if args.offload_checkpoints else []
    rows = steps[:1] + ckpt + steps[1:] + ([ring_step(args.ring)] if args.ring > 1 else [])
    model_seq = _model_longest(args, p) if ckpt else {}
    table = _table(args, run, bool(ckpt))
    results: dict[str, Any] = {}
    progress = _progress(table, args, run, results)
    cap = _search_rows(args, run, table, results, rows, model_seq)
    ratio, times, counts = _time_rows(args, run, results, steps, cap)
    ring_extra = _ring_rows(args, run, results, steps[-1], cap) if args.ring > 1 else {}
    ckpt_extra = _ckpt_summary(args, comm, results) if ckpt else {}
    table.write_json(args.json, partial=False, ratio=ratio, results=results, times=times,
                     a2a_per_layer={k: v["a2a"] / args.layers for k, v in counts.items()}, probes=progress,
                     search_cap=cap, **ring_extra, **ckpt_extra)
    return 0


def _check_args(args, comm) -> None:
    """Exit naming the flag where the ranks, the ring and the heads do not fit together."""
    ring = args.ring
    if ring < 1 or comm.size % ring:
        raise SystemExit(f"loom bench seqlen: --ring {ring} does not divide {comm.size} ranks; the ring degree is a "
                         f"divisor of the rank count (1: no ring)")
    if args.hf_config:
        if ring > 1:
            raise SystemExit(f"loom bench seqlen: --ring {ring} with --hf-config: the transformers rows have no ring "
                             f"row; drop --ring")
        if args.offload_checkpoints:
            raise SystemExit("loom bench seqlen: --offload-checkpoints with --hf-config: the transformers rows do not "
                             "checkpoint their layers, so there is no checkpoint to offload; drop "
                             "--offload-checkpoints")
        return
    p = comm.size // ring
    if args.heads % p:
        raise SystemExit(f"loom bench seqlen: --heads {args.heads} is not divisible by {p} sp ranks; "
                         f"use a multiple of {p}, or a larger --ring")
    if args.kv_heads % p and p % args.kv_heads:
        raise SystemExit(f"loom bench seqlen: --kv-heads {args.kv_heads} is neither a multiple nor a divisor of {p} "
                         f"sp ranks; choose one that is")


def _table(args, run: _Runner, ckpt: bool) -> Table:
    """The table of loom's model rows, its header printed (with the memory model's columns for ``ckpt``)."""
    comm, ring = run.comm, args.ring
    p, dp = comm.size // ring, ring
    table = Table("Longest Trainable Sequence (forward + backward)",
                  ["Mode", "Max seq", "Peak MiB", "x Ulysses", "Step gain", "Probes"]
                  + (["Model seq", "Model gain"] if ckpt else []), rank=comm.rank)
    table.meta = {
        "model": f"Llama layers={args.layers} hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} "
                 f"vocab={args.vocab} ({args.vocab / args.hidden:.1f}x hidden) ffn={args.ffn} {args.dtype} "
                 f"batch={args.batch}; Ulysses rows checkpoint every block",
        "ranks": f"{p} (sp={p})" if ring == 1 else
                 f"{comm.size}: sp={p} x dp={dp} replicas (each its own sequence) for every row but the last; "
                 f"{ring_step(ring)}: sp={comm.size} = {p} Ulysses x ring {ring}",
        "budget": _budget_note(args, run.device),
        "chunks": f"FFN/loss chunk {args.chunk} tokens/rank, attention chunk {args.attn_chunk} tokens/rank",
    }
    table.widths = [24, 10, 11, 11, 11, 8] + ([11, 12] if ckpt else [])
    table.header()
    return table


def _search_rows(args, run: _Runner, table: Table, results: dict[str, Any], rows: list[str],
                 model_seq: dict[str, int]) -> int:
    """Each row's longest sequence into ``results`` and the table; returns the search cap the later rows had
    (``--max-seq``, or ``--max-ratio`` times the first row's length)."""
    base = prev = None
    cap = args.max_seq
    for st in rows:
        seq, m, probes = run.longest(st, cap, fine=st in model_seq)
        if base is None and args.max_ratio > 0:
            cap = max(seq, min(cap, int(args.max_ratio * seq)))
        base = base or seq
        if st == CKPT_STEP:  # its peer is the Ulysses row (recompute with the inputs on the device)
            prev = results[STEPS[0]]["max_seq"]
        gain = "-" if prev is None else f"{seq / prev:.2f}x"
        model = []
        if model_seq:
            ms, m0 = model_seq.get(st), model_seq[STEPS[0]]
            model = [ms or "-", f"{ms / m0:.2f}x" if st == CKPT_STEP and ms and m0 else "-"]
        table.add(st, seq, m["peak"] / 2**20, f"{seq / base:.2f}x", gain, probes, *model)
        results[st] = {"max_seq": seq, **m} | ({"model_seq": model_seq[st]} if st in model_seq else {})
        prev = seq
    return cap


def _time_rows(args, run: _Runner, results: dict[str, Any], steps: list[str], cap: int):
    """Ulysses and FPDT timed at Ulysses' longest length (rounded to what both lay out), best of ``--repeats``;
    prints the summary lines on rank 0. Returns ``(FPDT's length over Ulysses', seconds, each one's counters)``."""
    comm, dp = run.comm, args.ring
    p = comm.size // dp
    ratio = results[steps[-1]]["max_seq"] / results[steps[0]]["max_seq"]
    seq_ul = results[steps[0]]["max_seq"]
    seq_eq = equal_length(seq_ul, args, p, steps)
    times: dict[str, float] = {}
    counts: dict[str, dict[str, float]] = {}
    for st in (steps[0], steps[-1]):
        best = None
        for _ in range(max(1, args.repeats)):
            m = run.step(st, seq_eq, measure=False)
            best = m if best is None or m["secs"] < best["secs"] else best
        times[st] = best["secs"]
        counts[st] = best
    fp = results[steps[-1]]
    if comm.rank == 0:
        tu, tf = times[steps[0]], times[steps[-1]]
        capped = f" (searched up to {cap}: --max-ratio {args.max_ratio:g})" if cap < args.max_seq else ""
        print(f"# longest sequence: Ulysses {seq_ul}, FPDT {fp['max_seq']}: {ratio:.1f}x (goal >= 16x){capped}")
        tok = dp * seq_eq  # tokens per step over all ranks: each replica its own sequence
        print(f"# equal length {seq_eq}: time/token Ulysses {tu / tok * 1e6:.1f} us, "
              f"FPDT {tf / tok * 1e6:.1f} us; "
              f"FPDT throughput = {tu / tf:.2f}x Ulysses (goal >= 0.8x)")
        for st in (steps[0], steps[-1]):
            c = counts[st]
            what = "FPDT" if "FPDT" in st else "Ulysses"
            how = "forward + backward" if "FPDT" in st else "forward + checkpoint recompute + backward"
            print(f"# {what}: {c['a2a'] / args.layers:.0f} all-to-alls per layer per step at {seq_eq} ({how})")
        print(f"# host<->device per rank per step: at {seq_eq}: {counts[steps[-1]]['to_host'] / 2**20:.1f} MiB "
              f"to host, {counts[steps[-1]]['to_device'] / 2**20:.1f} MiB back; at {fp['max_seq']}: "
              f"{fp['to_host'] / 2**20:.1f} MiB to host, {fp['to_device'] / 2**20:.1f} MiB back")
    return ratio, times, counts


def _model_longest(args, p: int) -> dict[str, int]:
    """The memory model's longest sequence (:func:`loom.train.memory.longest_sequence`, forward + backward
    terms only: these rows run no optimizer) of the Ulysses row and of :data:`CKPT_STEP` at ``p`` sp ranks,
    from the ``loom train`` config that builds the same model (recompute, no loss or FFN chunks)."""
    from ..train.config import config_from_dict
    from ..train.memory import longest_sequence

    cfg = config_from_dict({
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab, "ffn": args.ffn},
        "mesh": {"sp": p}, "data": {"seq_len": 16 * p, "batch": args.batch}, "train": {"dtype": args.dtype},
        "sequence": {"algorithm": "ulysses", "recompute": True}})
    return {st: longest_sequence(cfg, args.budget, forward_backward=True, offload_checkpoints=on)
            for st, on in ((STEPS[0], False), (CKPT_STEP, True))}


def _model_peak(args, seq: int, sp: int, ring: int) -> int | None:
    """The memory model's forward + backward peak (:func:`loom.train.memory.forward_backward_peak`) of full
    FPDT at global length ``seq`` on ``sp`` ranks in ``ring`` groups, from the ``loom train`` config that builds
    the row's model (chunks as :func:`chunk_counts` gives them, offload, no recompute), or None where no config
    does: ``loom train`` chunks the loss and the FFN as its attention, so ``--chunk`` must equal
    ``--attn-chunk``."""
    from ..train.config import config_from_dict
    from ..train.memory import forward_backward_peak, peak

    if args.chunk != args.attn_chunk:
        return None
    cfg = config_from_dict({
        "model": {"layers": args.layers, "hidden": args.hidden, "heads": args.heads, "kv_heads": args.kv_heads,
                  "vocab": args.vocab, "ffn": args.ffn},
        "mesh": {"sp": sp, "sp_ring": ring}, "data": {"seq_len": seq, "batch": args.batch},
        "train": {"dtype": args.dtype, "device": "cuda" if torch.cuda.is_available() else "cpu"},
        "sequence": {"algorithm": "fpdt", "chunks": chunk_counts(seq // sp, args)[1], "offload": True}})
    return forward_backward_peak(peak(cfg))


def _ckpt_summary(args, comm, results: dict[str, Any]) -> dict[str, Any]:
    """``--offload-checkpoints``: the measured factor of the host-checkpoint row over the Ulysses row against
    the memory model's; prints the summary line on rank 0 and returns the JSON field."""
    uly, host = results[STEPS[0]], results[CKPT_STEP]
    measured = host["max_seq"] / uly["max_seq"]
    model = host["model_seq"] / max(1, uly["model_seq"])
    off = measured / model - 1
    if comm.rank == 0:
        print(f"# checkpoint offload: longest Ulysses {uly['max_seq']} -> {host['max_seq']}: {measured:.3f}x "
              f"measured, {model:.3f}x by the memory model ({off:+.1%}; goal: within 10 %); host<->device per rank "
              f"at {host['max_seq']}: {host['to_host'] / 2**20:.1f} MiB to host, "
              f"{host['to_device'] / 2**20:.1f} MiB back")
    return {"offload_checkpoints": {"measured_factor": measured, "model_factor": model, "error": off}}


def _ring_rows(args, run: _Runner, results: dict[str, Any], fpdt: str, cap: int) -> dict[str, Any]:
    """``--ring``: FPDT x ring's longest length against FPDT's at ``sp = P / R``, and the time per token of both
    at FPDT's longest (a length both lay out); prints the summary lines on rank 0 and returns the JSON fields."""
    comm, ring = run.comm, args.ring
    rs = ring_step(ring)
    p, dp = comm.size // ring, ring
    seq_fp = results[fpdt]["max_seq"]
    # whole --attn-chunk chunks in both rows (_search_step): at a length whose FFN chunk count has no divisor near
    # the wanted attention chunk count (chunk_counts), every attention chunk is one --chunk chunk, half as long,
    # and a row does 4x the attention blocks per token (2624 tokens at 4 ranks: 41 chunks of 16 for the ring)
    unit = math.lcm(_search_step(args, p, fpdt), _search_step(args, comm.size, rs))
    seq_eq = max(unit, seq_fp // unit * unit)
    secs = {st: min(run.step(st, seq_eq, measure=False)["secs"] for _ in range(max(1, args.repeats)))
            for st in (fpdt, rs)}
    # tokens per step over all P ranks: dp sequences for FPDT at sp = P / R, one for the ring
    us = {fpdt: secs[fpdt] / (dp * seq_eq) * 1e6, rs: secs[rs] / seq_eq * 1e6}
    longer = results[rs]["max_seq"] / seq_fp
    model = {}  # the memory model's peak at each row's longest length, beside the measured one
    for st, sp, r in ((fpdt, p, 1), (rs, comm.size, ring)):
        v = _model_peak(args, results[st]["max_seq"], sp, r)
        if v is not None:
            model[st] = {"predicted": v, "measured": results[st]["peak"], "error": v / results[st]["peak"] - 1}
    if comm.rank == 0:
        capped = f" (searched up to {cap}: --max-ratio {args.max_ratio:g})" if cap < args.max_seq else ""
        print(f"# longest sequence at {comm.size} ranks: FPDT at sp={p} {seq_fp}, {rs} at sp={comm.size} "
              f"{results[rs]['max_seq']}: {longer:.2f}x (goal >= {0.9 * ring:.1f}x = 0.9 x ring){capped}")
        print(f"# equal length {seq_eq}: time/token FPDT sp={p} x dp={dp} ({dp} sequences per step) {us[fpdt]:.1f} us, "
              f"{rs} {us[rs]:.1f} us; {rs} throughput = {us[fpdt] / us[rs]:.2f}x FPDT (goal >= 0.8x)")
        if model:
            print("# memory model at each row's longest length: " + ", ".join(
                f"{st} {m['predicted'] / 2**20:.3f} MiB predicted, {m['measured'] / 2**20:.3f} measured "
                f"({m['error']:+.1%})" for st, m in model.items()) + " (goal: within 10 %)")
        else:
            print("# memory model: not compared (--chunk differs from --attn-chunk, and loom train chunks the loss "
                  "and the FFN as its attention)")
    return {"ring": {"longest_ratio": longer, "equal_length": seq_eq, "us_per_token": us, "sp": comm.size,
                     "sp_plain": p, "dp_plain": dp, "model": model}}


if __name__ == "__main__":
    raise SystemExit(main())
