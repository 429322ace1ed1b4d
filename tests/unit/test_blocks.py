"""The attention block kernels of loom.parallel.blocks against SDPA in fp64: the tiled pure-torch kernel and
the SDPA-with-log-sum-exp path (its GQA fold, K/V repeat, padded log-sum-exp and aligned mask logic run on
CPU through the CPU flash kernel; the CUDA kernels' argument plumbing runs on meta tensors, which have their
shape functions). Tolerance 1e-10 in fp64."""

from __future__ import annotations

import itertools

import pytest
import torch

from loom.parallel import blocks
from tests.attention import sdpa_reference

TOL = 1e-10


def _data(g, b, h, hk, lq, lk, d, docs: bool):
    q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64, requires_grad=True)
    dd = None
    if docs:  # documents of a few tokens each (a new one starts where the draw is 0)
        ids = torch.cumsum(torch.randint(0, 3, (b, max(lq, lk)), generator=g) == 0, 1)
        dd = (ids[:, :lq], ids[:, :lk])
    return q, k, v, dd


def _blocks_of(n, parts):
    cuts = sorted({0, n, *(n * i // parts for i in range(1, parts))})
    return list(zip(cuts[:-1], cuts[1:]))


def _check(kernel, g, b, h, hk, lq, lk, d, causal, docs, kv_parts, tile=None):
    """One q block against ``kv_parts`` kv blocks merged through the log-sum-exp, forward and backward."""
    q, k, v, dd = _data(g, b, h, hk, lq, lk, d, docs)
    scale = 0.37
    ref, ref_lse = sdpa_reference(q, k, v, causal, dd, scale)
    go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    want = torch.autograd.grad(ref, (q, k, v), go)
    parts = _blocks_of(lk, kv_parts) if not causal else [(0, lk)]
    o = lse = None
    with torch.no_grad():
        for k0, k1 in parts:
            bd = None if dd is None else (dd[0], dd[1][:, k0:k1])
            ob, lb = blocks.block_forward(q, k[:, :, k0:k1], v[:, :, k0:k1], causal, scale, kernel, bd)
            o, lse = blocks.merge(o, lse, ob, lb)
        assert (o - ref).abs().max() <= TOL
        fin = torch.isfinite(ref_lse)
        assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max() <= TOL
        out = o.to(q.dtype)
        dq = torch.zeros_like(q)
        dk, dv = torch.zeros_like(k), torch.zeros_like(v)
        for k0, k1 in parts:
            bd = None if dd is None else (dd[0], dd[1][:, k0:k1])
            gq, gk, gv = blocks.block_backward(go, q, k[:, :, k0:k1], v[:, :, k0:k1], out, lse, causal, scale, kernel,
                                               bd)
            dq += gq
            dk[:, :, k0:k1] += gk
            dv[:, :, k0:k1] += gv
    for got, ref_g in zip((dq, dk, dv), want):
        assert (got - ref_g).abs().max() <= TOL


CASES = list(itertools.product((True, False), ((4, 4), (4, 2), (4, 1)), (False, True)))


@pytest.mark.parametrize("causal, heads, docs", CASES)
def test_tiled_torch_kernel_is_exact(causal, heads, docs, monkeypatch):
    """Tiles of 5 rows: lengths 13 and 11 leave uneven last tiles; kv split in 1 and 3 merged blocks."""
    monkeypatch.setattr(blocks, "TILE", 5)
    g = torch.Generator().manual_seed(11)
    for lq, lk, parts in ((13, 13, 1), (13, 11, 3), (4, 17, 2)):
        if causal and lq != lk:
            continue
        _check("torch", g, 2, *heads, lq, lk, 6, causal, docs, parts)


@pytest.mark.parametrize("mask_tile", [4096, 4])
@pytest.mark.parametrize("causal, heads, docs", CASES)
def test_cpu_flash_kernel_is_exact(causal, heads, docs, mask_tile, monkeypatch):
    """mask_tile 4: packed-document blocks run as 4-row pieces merged through their log-sum-exp."""
    monkeypatch.setattr(blocks, "MASK_TILE", mask_tile)
    g = torch.Generator().manual_seed(12)
    for lq, lk, parts in ((13, 13, 1), (13, 11, 3)):
        if causal and lq != lk:
            continue
        _check("flash", g, 2, *heads, lq, lk, 8, causal, docs, parts)


def _pad_lse(fwd):
    def run(q, k, v, causal, bias, scale):
        out, lse = fwd(q, k, v, causal, bias, scale)
        n = lse.shape[-1]
        pad = torch.full((*lse.shape[:-1], -(-n // 32) * 32 - n), float("nan"), dtype=lse.dtype)
        return out, torch.cat([lse, pad], -1)
    return run


def _take_padded(bwd):
    def run(do, q, k, v, out, lse, causal, bias, scale):
        assert lse.shape[-1] % 32 == 0 and lse.is_contiguous(), lse.shape
        assert q.shape[1] == k.shape[1], "a kernel without GQA got fewer kv heads"
        if bias is not None:
            assert bias.shape[1] == q.shape[1] and bias.stride(1) == 0 and bias.stride(2) % 16 == 0
        return bwd(do, q, k, v, out, lse[..., :q.shape[2]], causal, bias, scale)
    return run


@pytest.mark.parametrize("causal, heads, docs", CASES)
def test_sdpa_path_without_gqa_is_exact(causal, heads, docs, monkeypatch):
    """The memory-efficient kernel's constraints on a CPU kernel: no GQA (fold or repeat), log-sum-exp rows
    padded to 32 (NaN in the padding), masks expanded over heads with 16-aligned rows."""
    cpu = blocks._OPS["cpu-flash"]

    def fwd(q, k, v, causal, bias, scale):
        assert q.shape[1] == k.shape[1], "a kernel without GQA got fewer kv heads"
        return cpu.fwd(q, k, v, causal, bias, scale)

    ops = blocks._Ops(_pad_lse(fwd), _take_padded(cpu.bwd), gqa=False, lse_align=32, bias_align=16,
                      bias_heads=True)
    monkeypatch.setitem(blocks._OPS, "cpu-flash", ops)
    monkeypatch.setattr(blocks, "MASK_TILE", 6)
    g = torch.Generator().manual_seed(13)
    for lq, lk, parts in ((13, 13, 1), (13, 11, 3)):
        if causal and lq != lk:
            continue
        _check("flash", g, 2, *heads, lq, lk, 8, causal, docs, parts)


@pytest.mark.parametrize("dtype, docs, kind", [(torch.bfloat16, False, "cuda-flash"),
                                               (torch.float16, False, "cuda-flash"),
                                               (torch.bfloat16, True, "cuda-efficient"),
                                               (torch.float32, False, "cuda-efficient"),
                                               (torch.float32, True, "cuda-efficient")])
@pytest.mark.parametrize("causal, hk", [(True, 2), (False, 2), (False, 8)])
def test_cuda_kernels_take_their_arguments(dtype, docs, kind, causal, hk):
    """On meta tensors (the CUDA ops' shape functions): each kernel is chosen as documented and its calls
    return ``out [B,h,Lq,D]``, ``lse [B,h,Lq]`` and gradients of the inputs' shapes."""
    b, h, lq, d = 2, 8, 100, 64
    q = torch.empty(b, h, lq, d, dtype=dtype, device="meta")
    k = torch.empty(b, hk, lq, d, dtype=dtype, device="meta")
    assert blocks.block_kernel("flash", q.device, dtype, d, docs) == kind
    dd = None
    if docs:
        ids = torch.zeros(b, lq, dtype=torch.int64, device="meta")
        dd = (ids, ids)
    out, lse = blocks.block_forward(q, k, k, causal, 0.1, "flash", dd)
    assert out.shape == q.shape and out.dtype == dtype and tuple(lse.shape) == (b, h, lq)
    assert lse.dtype == torch.float32
    dq, dk, dv = blocks.block_backward(out, q, k, k, out.contiguous(), lse, causal, 0.1, "flash", dd)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == k.shape


def test_kernel_choice():
    meta = torch.device("meta")
    assert blocks.block_kernel("flash", meta, torch.float64, 64, False) == "torch"  # no CUDA kernel for fp64
    assert blocks.block_kernel("flash", meta, torch.bfloat16, 320, False) == "cuda-efficient"  # > 256
    assert blocks.block_kernel("torch", torch.device("cpu"), torch.float32, 64, False) == "torch"
    assert blocks.block_kernel("flash", torch.device("cpu"), torch.float32, 64, True) == "cpu-flash"


def test_torch_kernel_working_set_is_a_tile(monkeypatch):
    """The tiled kernel's peak (CPU live-storage tracker) beyond its inputs grows linearly in the block
    length, not with its square: the untiled kernel held ~5 fp32 [B, h, L, L] score blocks."""
    from loom.parallel.offload import MemoryTracker

    monkeypatch.setattr(blocks, "TILE", 32)
    g = torch.Generator().manual_seed(5)
    peaks = []
    for n in (128, 256, 512):
        q = torch.randn(1, 4, n, 16, generator=g)
        k = torch.randn(1, 2, n, 16, generator=g)
        v = torch.randn(1, 2, n, 16, generator=g)
        with MemoryTracker() as mem:
            o, lse = blocks.block_forward(q, k, v, True, 0.25, "torch")
            blocks.block_backward(q, q, k, v, o, lse, True, 0.25, "torch")
        peaks.append(mem.peak)
    assert abs((peaks[2] - peaks[1]) - 2 * (peaks[1] - peaks[0])) <= 0.1 * 2 * (peaks[1] - peaks[0]), peaks
    # the dry-run's workspace term plus the blocks read and returned (q, k, v, out, lse, dq, dk, dv, twice
    # for the accumulation-dtype copies) bounds it
    n = 512
    io = 4 * (4 * n * 16 + 2 * 2 * n * 16 + 4 * n * 16 + 4 * n)
    ws = blocks.workspace("torch", 1, 4, 2, n, n, 16, 4)
    assert peaks[2] <= ws + 2 * io, (peaks[2], ws, io)
