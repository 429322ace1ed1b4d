"""Single-GPU FPDT benchmark (P = 1): longest sequence, MFU and offload/compute overlap on one CUDA device.

Run it where a GPU is available; a Llama-shaped model of about 1.2B parameters (20 layers, hidden 2048,
16 heads of 128, 4 kv heads, vocab 64000) on an H200::

    python scripts/seqlen_cuda.py --layers 20 --hidden 2048 --heads 16 --kv-heads 4 --vocab 64000 \\
        --budget 100G --chunk 8192 --attn-chunk 32768 --no-breakdown --repeats 1 --peak-tflops 989

It reuses ``loom bench seqlen`` (same model, same search, memory from ``torch.cuda.max_memory_allocated``)
for the Ulysses-vs-FPDT table at ``P = 1`` (Ulysses at ``P = 1`` is plain SDPA with block checkpointing),
then, at the FPDT limit, times one step with and without offload using CUDA events and reports:

* MFU: ``(6 N T + 6 L T^2 hidden) / (step time x peak FLOP/s)`` with ``N`` the non-embedding parameters and
  ``T`` the sequence length (causal attention: half of the ``12 L T^2 hidden`` of full attention);
* offload/compute overlap: ``1 - (t_offload - t_no_offload) / t_copy``, where ``t_copy`` is the time the
  offloaded bytes take on their own through pinned memory (1 = transfers fully hidden behind compute), at the
  FPDT limit or, when the step without offload does not fit there, at the longest halving of it that does.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch


def _step_time(run, cfg_overrides: dict, seq: int, repeats: int = 3) -> float:
    from loom.models.llama import Llama

    from loom.bench.seqlen import _config

    best = float("inf")
    for _ in range(repeats):
        cfg = _config("+ offload (FPDT)", run.args, seq, 1)
        for k, v in cfg_overrides.items():
            setattr(cfg, k, v)
        model = Llama(cfg, run.comm).to(device=run.device, dtype=run.dtype)
        tok = torch.randint(0, run.args.vocab, (run.args.batch, seq), device=run.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        model.loss(tok, tok).backward()
        end.record()
        torch.cuda.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
        del model
    return best


def _copy_time(nbytes: int, device: torch.device) -> float:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    host.copy_(dev, non_blocking=True)
    dev.copy_(host, non_blocking=True)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / 2  # per direction


def main(argv: list[str] | None = None) -> int:
    if not torch.cuda.is_available():
        print("SKIP: seqlen_cuda.py needs a CUDA device (torch.cuda.is_available() is False)", flush=True)
        return 0
    from loom.bench import seqlen
    from loom.comm import world
    from loom.parallel.offload import reset_transfer_stats, transfer_stats

    extra = argparse.ArgumentParser(add_help=False)
    extra.add_argument("--peak-tflops", type=float, default=989.0, help="device peak dense bf16 TFLOP/s")
    ours, rest = extra.parse_known_args(argv)
    if "--dtype" not in rest:
        rest += ["--dtype", "bfloat16"]
    args = seqlen.parser().parse_args(rest)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.json or os.path.join(tmp, "seqlen.json")
        rc = seqlen.main(rest if args.json else [*rest, "--json", path])  # the table, with CUDA allocator peaks
        with open(path) as f:
            seq = json.load(f)["meta"]["results"]["+ offload (FPDT)"]["max_seq"]  # the search is not run twice
    run = seqlen._Runner(args, world())
    t_off = _step_time(run, {}, seq)
    # Overlap compares the same step with and without offload; without offload the FPDT limit rarely fits
    # the device, so it is measured at the longest length (halving, on the search granule) that does.
    gran = seqlen._granule(args, 1, "+ offload (FPDT)")
    at = seq
    while True:
        try:
            t_dev = _step_time(run, {"offload": False}, at)
            break
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            if at <= gran:
                t_dev = float("nan")
                break
            at = max(gran, at // 2 // gran * gran)
    t_at = t_off if at == seq else _step_time(run, {}, at)
    reset_transfer_stats()
    _step_time(run, {}, at, repeats=1)
    moved = transfer_stats()
    t_copy = _copy_time(max(1, moved["to_host"]), run.device) + _copy_time(max(1, moved["to_device"]), run.device)
    cfg = seqlen._config("+ offload (FPDT)", args, seq, 1)
    h, f, layers = cfg.hidden, cfg.ffn_hidden, cfg.layers
    kvd = cfg.kv_heads * cfg.head_dim
    n_params = layers * (2 * h * h + 2 * h * kvd + (3 if cfg.ffn == "swiglu" else 2) * h * f) + h * cfg.vocab
    flops = args.batch * (6 * n_params * seq + 6 * layers * seq * seq * h)
    mfu = flops / (t_off * ours.peak_tflops * 1e12)
    overlap = 1.0 - (t_at - t_dev) / t_copy if t_copy > 0 else float("nan")
    print(f"# FPDT at {seq} tokens: step {t_off:.3f} s with offload; MFU {mfu * 100:.1f} % "
          f"(peak {ours.peak_tflops} TFLOP/s)")
    print(f"# offload overlap at {at} tokens: step {t_at:.3f} s with offload, {t_dev:.3f} s without; moved "
          f"{moved['to_host'] / 2**30:.2f} GiB to host, {moved['to_device'] / 2**30:.2f} GiB back; copy alone "
          f"{t_copy:.3f} s; overlap {overlap:.2f} (1 = transfers hidden behind compute)")
    return rc


if __name__ == "__main__":
    t0 = time.time()
    code = main()
    print(f"# total {time.time() - t0:.0f} s")
    raise SystemExit(code)
