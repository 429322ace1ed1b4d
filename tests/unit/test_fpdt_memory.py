"""FPDT's memory promise, checked on CPU where a GPU showed it broken (issue 25, "What to build" item 4), and
`loom bench seqlen`'s chunking and search. Memory is the CPU live-storage tracker's peak
(:class:`loom.parallel.offload.MemoryTracker`, deterministic: it sums the bytes of live storages)."""

from __future__ import annotations

import pytest
import torch

from loom.bench import seqlen
from loom.comm import world
from loom.parallel import blocks


def _args(*extra: str):
    return seqlen.parser().parse_args(["--layers", "1", "--hidden", "32", "--heads", "4", "--kv-heads", "2",
                                       "--vocab", "256", "--chunk", "64", *extra])


def test_fpdt_peak_grows_linearly_with_the_torch_kernel(monkeypatch):
    """With the pure-torch kernel (the one every device but the CPU got), one attention chunk per rank so that
    the block is the whole sequence: FPDT's peak from S to 2S and from 2S to 4S grows by the same amount per
    token (within 10 %), and at 4S it is below Ulysses'. The untiled kernel's ``[B, h, S, S]`` score blocks
    failed both."""
    monkeypatch.setenv("LOOM_ATTN_KERNEL", "torch")
    monkeypatch.setattr(blocks, "TILE", 64)
    torch.set_num_threads(1)
    args = _args("--attn-chunk", "4096")
    run = seqlen._Runner(args, world())
    fpdt, uly = seqlen.STEPS[-1], seqlen.STEPS[0]
    sizes = (256, 512, 1024)
    peaks = [run.step(fpdt, n)["peak"] for n in sizes]
    d1, d2 = peaks[1] - peaks[0], peaks[2] - peaks[1]
    assert abs(d2 / 2 - d1) <= 0.1 * d1, (sizes, peaks)
    assert peaks[2] < run.step(uly, sizes[2])["peak"], peaks


def test_attention_chunks_hold_at_most_attn_chunk_tokens():
    """The attention chunk count rounds up: a block never holds more than --attn-chunk tokens per rank
    (rounding down let 3072 tokens per rank with --attn-chunk 2048 run as one 3072-token chunk)."""
    args = _args("--attn-chunk", "128")
    for s_local in range(64, 64 * 40, 64):
        u_small, u_attn = seqlen.chunk_counts(s_local, args)
        assert s_local == u_small * 64 and u_small % u_attn == 0
        assert s_local // u_attn <= 128, (s_local, u_attn)
    args = _args("--attn-chunk", "2048", "--chunk", "1024")
    assert seqlen.chunk_counts(3072, args) == (3, 3)


class _Sawtooth(seqlen._Runner):
    """A runner whose peak is the sawtooth of the attention pipeline: linear in the length plus the square of
    the attention block, which shrinks when the chunk count grows."""

    def __init__(self, args):
        self.args, self.comm = args, world()
        self.probes: list[int] = []

    def step(self, step, seq, *, measure=True):
        self.probes.append(seq)
        _, u = seqlen.chunk_counts(seq, self.args)
        block = seq / u
        return {"peak": int(100 * seq + block * block), "secs": 0.0, "a2a": 0, "to_host": 0, "to_device": 0}


@pytest.mark.parametrize("budget", [400_000, 520_000, 1_000_000])
def test_search_finds_the_longest_fitting_length_in_whole_attention_chunks(budget):
    """The attention-pipeline rows search only lengths of whole --attn-chunk chunks per rank (off that grid the
    sawtooth's smaller fallback blocks would fit longer lengths at several times the time per token), and find
    the longest such length that fits."""
    args = _args("--attn-chunk", "512", "--max-seq", "8192", "--budget", str(budget))
    run = _Sawtooth(args)
    got, m, _ = run.longest(seqlen.STEPS[-1])
    assert all(n % 512 == 0 for n in run.probes), run.probes
    grid = range(512, 8192 + 1, 512)
    best = max(n for n in grid if run.step(seqlen.STEPS[-1], n)["peak"] <= budget)
    assert m["peak"] <= budget
    assert got == best, (got, best)
