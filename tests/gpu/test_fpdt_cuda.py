"""FPDT's attention on a CUDA device (the GPU tier, ``make test-gpu``; skipped where torch sees none).

One process (an sp communicator of one rank: FPDT is then chunked attention with the same block kernels
and merges). bf16 results are compared with SDPA in fp32 on the same inputs, and must be as close as SDPA's
own bf16 result is (twice its error plus 2e-3: FPDT merges its blocks in fp32); fp32 (the memory-efficient
kernel) within 2e-5 of the fp32 reference with TF32 off; the fp64 torch fallback within 1e-10.
Memory: ``torch.cuda.max_memory_allocated`` of ``loom bench seqlen``'s runner; last, activation checkpoints on the host
(``offload_checkpoints``) against checkpoints on the device.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from loom.comm import world
from loom.parallel import blocks
from loom.parallel.sequence import fpdt_attention

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch sees none)")]


@pytest.fixture(autouse=True)
def _no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _ref(q, k, v, causal, doc=None):
    """SDPA on [B, S, H, D] tensors (explicit mask for packed documents)."""
    mask = None
    if doc is not None:
        mask = doc[:, None, :, None] == doc[:, None, None, :]
        if causal:
            mask = mask & torch.ones(mask.shape[-2:], dtype=torch.bool, device=q.device).tril()
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask,
                                          is_causal=causal and mask is None,
                                          enable_gqa=q.shape[2] != k.shape[2]).transpose(1, 2)


def _inputs(b, s, h, hk, d, dtype, seed, packed=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(b, s, n, d, generator=g, device="cuda", dtype=torch.float32) for n in (h, hk, hk))
    go = torch.randn(b, s, h, d, generator=g, device="cuda")
    doc = None
    if packed:
        doc = torch.cumsum(torch.rand(b, s, generator=g, device="cuda") < 0.01, 1)  # documents of ~100 tokens
    return [t.to(dtype).requires_grad_() for t in (q, k, v)], go.to(dtype), doc


def _grads(fn, xs, go):
    out = fn(*xs)
    return out, torch.autograd.grad(out, xs, go)


@pytest.mark.parametrize("causal, hk, packed, chunks", [(True, 2, False, 4), (False, 2, False, 3),
                                                        (True, 8, False, 4), (True, 2, True, 4),
                                                        (False, 8, True, 2)])
def test_fpdt_bf16_matches_sdpa(causal, hk, packed, chunks, monkeypatch):
    """bf16: FlashAttention-2 blocks (GQA with kv heads as is) or, for packed documents, memory-efficient
    blocks with the document mask, in pieces of 160 rows; forward and backward as close to fp32 SDPA as bf16
    SDPA is."""
    monkeypatch.setattr(blocks, "MASK_TILE", 160)
    b, s, h, d = 2, 1536, 8, 64
    xs, go, doc = _inputs(b, s, h, hk, d, torch.bfloat16, seed=hk + 10 * chunks + packed)
    assert blocks.block_kernel("flash", xs[0].device, torch.bfloat16, d, packed) == (
        "cuda-efficient" if packed else "cuda-flash")
    x32 = [x.detach().float().requires_grad_() for x in xs]
    ref, ref_g = _grads(lambda q, k, v: _ref(q, k, v, causal, doc), x32, go.float())
    base, base_g = _grads(lambda q, k, v: _ref(q, k, v, causal, doc), xs, go)
    got, got_g = _grads(lambda q, k, v: fpdt_attention(q, k, v, world(), chunks=chunks, causal=causal, offload=True,
                                                       doc_ids=doc), xs, go)
    for a, r, bl in zip((got, *got_g), (ref, *ref_g), (base, *base_g)):
        err, base_err = (a.float() - r).abs().max().item(), (bl.float() - r).abs().max().item()
        assert err <= 2 * base_err + 2e-3, (err, base_err)


@pytest.mark.parametrize("causal, hk, packed", [(True, 2, False), (False, 2, False), (True, 8, True)])
def test_fpdt_fp32_memory_efficient_kernel(causal, hk, packed, monkeypatch):
    """fp32: memory-efficient blocks (GQA folded into query rows, or K/V repeated for causal and masked
    blocks; masked ones in pieces of 96 rows), within 2e-5 of fp32 SDPA."""
    monkeypatch.setattr(blocks, "MASK_TILE", 96)
    b, s, h, d = 1, 1024, 8, 32
    xs, go, doc = _inputs(b, s, h, hk, d, torch.float32, seed=3 + hk + packed)
    assert blocks.block_kernel("flash", xs[0].device, torch.float32, d, packed) == "cuda-efficient"
    ref, ref_g = _grads(lambda q, k, v: _ref(q, k, v, causal, doc), xs, go)
    got, got_g = _grads(lambda q, k, v: fpdt_attention(q, k, v, world(), chunks=4, causal=causal, doc_ids=doc),
                        xs, go)
    for a, r in zip((got, *got_g), (ref, *ref_g)):
        assert (a - r).abs().max().item() <= 2e-5


def test_fpdt_fp64_torch_fallback_is_exact():
    b, s, h, hk, d = 1, 640, 4, 2, 16
    xs, go, _ = _inputs(b, s, h, hk, d, torch.float64, seed=5)
    assert blocks.block_kernel("flash", xs[0].device, torch.float64, d, False) == "torch"
    ref, ref_g = _grads(lambda q, k, v: _ref(q, k, v, True), xs, go)
    got, got_g = _grads(lambda q, k, v: fpdt_attention(q, k, v, world(), chunks=2, causal=True), xs, go)
    for a, r in zip((got, *got_g), (ref, *ref_g)):
        assert (a - r).abs().max().item() <= 1e-10


@pytest.mark.parametrize("kernel", ["auto", "torch"])
def test_fpdt_peak_grows_linearly_on_the_cuda_allocator(kernel, monkeypatch):
    """The CPU check of tests/unit/test_fpdt_memory.py on the CUDA allocator, for both kernels: one attention
    chunk (the block is the whole sequence), S -> 2S -> 4S increments equal within 10 %, FPDT below Ulysses
    at 4S."""
    from loom.bench import seqlen

    monkeypatch.setenv("LOOM_ATTN_KERNEL", kernel)
    args = seqlen.parser().parse_args(["--layers", "2", "--hidden", "512", "--heads", "8", "--kv-heads", "2",
                                       "--vocab", "8192", "--chunk", "1024", "--attn-chunk", "65536",
                                       "--dtype", "bfloat16"])
    run = seqlen._Runner(args, world())
    assert run.device.type == "cuda"
    sizes = (4096, 8192, 16384)
    peaks = [run.step(seqlen.STEPS[-1], n)["peak"] for n in sizes]
    d1, d2 = peaks[1] - peaks[0], peaks[2] - peaks[1]
    assert abs(d2 / 2 - d1) <= 0.1 * d1, (sizes, peaks)
    assert peaks[2] < run.step(seqlen.STEPS[0], sizes[2])["peak"], peaks


def test_checkpoints_on_the_host_on_cuda():
    """``offload_checkpoints`` on the device: block inputs copied to pinned host buffers on the side stream and
    prefetched one block ahead give the loss of recompute on the device bit for bit and its gradients to the
    order of the attention backward's atomic adds (the copies are exact; fp32, TF32 off), and the CUDA
    allocator's peak falls by at least half of ``(blocks - 2)`` block inputs (the CPU test in
    tests/unit/test_memory.py holds the memory model to the measured drop)."""
    from loom.models.llama import Llama, LlamaConfig
    from loom.parallel.offload import MemoryTracker

    layers, b, s, hidden = 8, 1, 8192, 256
    g = torch.Generator().manual_seed(3)
    tok = torch.randint(0, 256, (b, s), generator=g).cuda()
    tgt = torch.randint(0, 256, (b, s), generator=g).cuda()
    got, peaks = [], []
    for on_host in (False, True):
        cfg = LlamaConfig(layers=layers, hidden=hidden, heads=4, kv_heads=2, vocab=256, checkpoint=True,
                          offload_checkpoints=on_host, loss_chunks=8, ffn_chunks=8)
        m = Llama(cfg).cuda()
        with MemoryTracker("cuda") as mem:
            loss = m.loss(tok, tgt)
            grads = torch.autograd.grad(loss, list(m.parameters()))
        got.append((loss.detach(), grads))
        peaks.append(mem.peak)
        del m, loss, grads
    assert torch.equal(got[0][0], got[1][0])
    for a, r in zip(got[0][1], got[1][1]):  # fp32 attention backward may add with atomics: not bit for bit
        torch.testing.assert_close(a, r, rtol=1e-5, atol=1e-7)
    inp = 4 * b * s * hidden
    assert peaks[0] - peaks[1] >= 0.5 * (layers - 2) * inp, (peaks, inp)
