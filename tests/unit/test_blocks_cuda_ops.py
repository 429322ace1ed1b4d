"""The CUDA block kernels of loom.parallel.blocks run on CPU against faithful emulations of the four CUDA SDPA ops.

Each emulated op binds its arguments by the real op's schema (``torch.ops.aten.<op>.default._schema``: names,
order, defaults, kwarg-only), so a swapped or missing argument lands in the wrong slot and fails; it returns
the schema's number of outputs in the CUDA kernel's layouts (outputs laid out ``[B, L, H, D]`` in memory, the
memory-efficient log-sum-exp padded to 32 rows with NaN, fully masked rows NaN); and it refuses what the CUDA
code refuses or silently misreads (pytorch's attention.cu, attention_backward.cu, flash_api.cpp and
mem_eff_attention/kernel_backward.h): different q/kv head counts or a misaligned bias for the memory-efficient
kernel, an ``out`` whose rows are not ``heads * head_dim`` apart (its backward reads ``out`` with that row
stride, ``o_strideM()``), a non-contiguous or wrongly shaped flash log-sum-exp, a causal flash block that is
not square (FlashAttention-2 aligns its causal mask bottom-right), dtypes that differ from q's. The maths is
fp64 so that the whole path (GQA fold/repeat, padded log-sum-exp, mask pieces, merges) is checked to 1e-10,
both per block and through the FPDT pipeline (with and without the host chunk store).
"""

from __future__ import annotations

import itertools
import math
import types

import pytest
import torch

from loom.parallel import blocks
from tests.attention import sdpa_reference

TOL = 1e-10
_real = torch.ops.aten


def _bind(name, args, kwargs):
    """Arguments by name, as the dispatcher binds them to ``aten::<name>``'s schema (types checked)."""
    schema = getattr(_real, name).default._schema
    pos = list(args)
    out = {}
    for a in schema.arguments:
        if not a.kwarg_only and pos:
            val = pos.pop(0)
        elif a.name in kwargs:
            val = kwargs.pop(a.name)
        elif a.has_default_value():
            val = a.default_value
        else:
            raise TypeError(f"{name}: missing argument {a.name}")
        t = str(a.type)
        if t.startswith("Tensor"):
            assert val is None or isinstance(val, torch.Tensor), (name, a.name, type(val))
        elif t in ("float", "float?"):
            assert (val is None and t.endswith("?")) or isinstance(val, (int, float)) and not isinstance(val, bool), (
                name, a.name, val)
        elif t == "bool":
            assert isinstance(val, bool), (name, a.name, val)
        elif t.startswith("bool["):
            assert isinstance(val, (list, tuple)) and all(isinstance(x, bool) for x in val), (name, a.name, val)
        elif t in ("SymInt", "int"):
            assert isinstance(val, int) and not isinstance(val, bool), (name, a.name, val)
        out[a.name] = val
    assert not pos and not kwargs, f"{name}: unexpected arguments {pos} {kwargs}"
    return out, len(schema.returns)


def _bhld(t):
    """A tensor laid out ``[B, L, H, D]`` in memory, viewed as ``[B, H, L, D]`` (what the CUDA kernels return)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


def _scores(q, k, scale, causal, bias, square_causal):
    b, h, lq, d = q.shape
    g = h // k.shape[1]
    s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scale
    if bias is not None:
        s = s + bias
    if causal:
        lk = k.shape[2]
        if square_causal:
            assert lq == lk, "causal FlashAttention-2 aligns its mask bottom-right: a causal block must be square"
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).tril().logical_not(), float("-inf"))
    return s


def _fwd(q, k, v, scale, causal, bias, square_causal):
    s = _scores(q, k, scale, causal, bias, square_causal)
    lse = torch.logsumexp(s, -1)  # -inf for a row with no key
    p = torch.exp(s - lse[..., None])  # NaN there, as a kernel dividing by a zero sum
    g = q.shape[1] // k.shape[1]
    return p @ v.repeat_interleave(g, 1), lse


def _bwd(do, q, k, v, out, lse, scale, causal, bias, square_causal):
    b, h, lq, d = q.shape
    hk = k.shape[1]
    g = h // hk
    s = _scores(q, k, scale, causal, bias, square_causal)
    p = torch.exp(s - lse[..., None])
    delta = (do * out).sum(-1, keepdim=True)
    vr, kr = v.repeat_interleave(g, 1), k.repeat_interleave(g, 1)
    dv = p.transpose(-1, -2) @ do
    ds = p * (do @ vr.transpose(-1, -2) - delta)
    dq = ds @ kr * scale
    dk = ds.transpose(-1, -2) @ q * scale
    fold = (b, hk, g, k.shape[2], d)
    return dq, dk.reshape(fold).sum(2), dv.reshape(fold).sum(2)


def _lse_dtype(q):
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _bind_qkv(name, args, kwargs, same_heads):
    """``_bind`` and the checks every emulated op makes of q, k and v: ``(args by name, outputs, q, k, v)``."""
    a, n = _bind(name, args, kwargs)
    q, k, v = a["query"], a["key"], a["value"]
    assert q.dim() == k.dim() == v.dim() == 4
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "last dimension must be contiguous"
    assert k.dtype == v.dtype == q.dtype
    if same_heads:
        assert q.shape[1] == k.shape[1] == v.shape[1], "memory-efficient attention: equal q and kv head counts"
    else:
        assert q.shape[1] % k.shape[1] == 0 and k.shape[1] == v.shape[1]
    return a, n, q, k, v


def _outputs(res, n):
    """``res``, which must hold as many outputs as the real op's schema returns (``n``)."""
    assert len(res) == n
    return res


def _check_bias(bias, q, k):
    if bias is None:
        return
    b, h, lq, _ = q.shape
    assert bias.dim() == 4 and tuple(bias.shape) == (b, h, lq, k.shape[2]), bias.shape  # BMHK, no broadcasting
    assert bias.dtype == q.dtype, "invalid dtype for bias - should match query's dtype"
    assert bias.stride(3) == 1, "attn_bias: last dimension must be contiguous"
    for dim in (0, 1, 2):
        assert bias.stride(dim) % 16 == 0, f"attn_bias is not correctly aligned (stride {dim})"


def _eff_fwd(*args, **kwargs):
    a, n, q, k, v = _bind_qkv("_scaled_dot_product_efficient_attention", args, kwargs, same_heads=True)
    assert a["dropout_p"] == 0.0 and a["compute_log_sumexp"] is True
    _check_bias(a["attn_bias"], q, k)
    out, lse = _fwd(q, k, v, a["scale"], a["is_causal"], a["attn_bias"], square_causal=False)
    lq = q.shape[2]
    pad = torch.full((*lse.shape[:-1], -(-lq // 32) * 32 - lq), float("nan"), dtype=lse.dtype)
    res = (_bhld(out), torch.cat([lse.to(_lse_dtype(q)), pad.to(_lse_dtype(q))], -1),
           torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64))
    return _outputs(res, n)


def _eff_bwd(*args, **kwargs):
    a, n, q, k, v = _bind_qkv("_scaled_dot_product_efficient_attention_backward", args, kwargs, same_heads=True)
    do, out, lse = a["grad_out_"], a["out"], a["logsumexp"]
    b, h, lq, d = q.shape
    assert a["dropout_p"] == 0.0 and list(a["grad_input_mask"])[:3] == [True, True, True]
    assert not a["grad_input_mask"][3] or a["attn_bias"] is not None
    assert do.dtype == out.dtype == q.dtype, "the kernel reads grad_out and out as q's dtype"
    assert tuple(out.shape) == tuple(q.shape) and out.stride(3) == 1
    # kernel_backward.h: o_strideM() == head_dim_value * num_heads; only the batch and head strides are read
    assert h == 1 or out.stride(2) == h * d, f"out rows must be heads*head_dim apart, got strides {out.stride()}"
    assert lse.dtype == _lse_dtype(q) and lse.stride(-1) == 1 and lse.shape[:2] == (b, h) and lse.shape[2] >= lq
    assert h <= 1 or lse.stride(1) % 8 == 0, "LSE is not correctly aligned (strideH)"
    assert b <= 1 or lse.stride(0) % 8 == 0, "LSE is not correctly aligned (strideB)"
    _check_bias(a["attn_bias"], q, k)
    dq, dk, dv = _bwd(do, q, k, v, out, lse[..., :lq], a["scale"], a["is_causal"], a["attn_bias"], False)
    res = (_bhld(dq), _bhld(dk), _bhld(dv), None)
    return _outputs(res, n)


def _flash_fwd(*args, **kwargs):
    a, n, q, k, v = _bind_qkv("_scaled_dot_product_flash_attention", args, kwargs, same_heads=False)
    assert a["dropout_p"] == 0.0 and a["return_debug_mask"] is False
    d = q.shape[-1]
    assert d % 8 == 0 and d <= 256
    out, lse = _fwd(q, k, v, a["scale"], a["is_causal"], None, square_causal=True)
    res = (_bhld(out), lse.to(_lse_dtype(q)).contiguous(), None, None, q.shape[2], k.shape[2],
           torch.zeros(2, dtype=torch.uint64), torch.zeros((), dtype=torch.uint64), torch.empty(0, dtype=q.dtype))
    return _outputs(res, n)


def _flash_bwd(*args, **kwargs):
    a, n, q, k, v = _bind_qkv("_scaled_dot_product_flash_attention_backward", args, kwargs, same_heads=False)
    do, out, lse = a["grad_out"], a["out"], a["logsumexp"]
    b, h, lq, d = q.shape
    assert a["cum_seq_q"] is None and a["cum_seq_k"] is None, "dense blocks: undefined cumulative lengths"
    assert a["max_q"] == lq and a["max_k"] == k.shape[2]
    assert a["dropout_p"] == 0.0
    assert do.dtype == out.dtype == q.dtype, "query and dout/out must have the same dtype"
    assert d % 8 == 0 and d <= 256
    # flash_api.cpp reads the log-sum-exp by pointer as a contiguous fp32 [B, H, Lq]
    assert lse.dtype == _lse_dtype(q) and lse.is_contiguous() and tuple(lse.shape) == (b, h, lq), lse.shape
    res = _bwd(do, q, k, v, out, lse, a["scale"], a["is_causal"], None, True)
    res = tuple(_bhld(t) for t in res)
    return _outputs(res, n)


_EMULATED = types.SimpleNamespace(
    _scaled_dot_product_efficient_attention=_eff_fwd,
    _scaled_dot_product_efficient_attention_backward=_eff_bwd,
    _scaled_dot_product_flash_attention=_flash_fwd,
    _scaled_dot_product_flash_attention_backward=_flash_bwd,
    _scaled_dot_product_flash_attention_for_cpu=_real._scaled_dot_product_flash_attention_for_cpu,
    _scaled_dot_product_flash_attention_for_cpu_backward=_real._scaled_dot_product_flash_attention_for_cpu_backward,
)


@pytest.fixture
def cuda_kind(monkeypatch):
    """Route every "flash" block to the emulated CUDA kernel the test names (the real choice by dtype and
    mask: cuda-flash only unmasked)."""
    monkeypatch.setattr(blocks, "_aten", _EMULATED)

    def use(kind):
        def choose(kernel, device, dtype, head_dim, masked):
            if kernel != "flash":
                return "torch"
            return "cuda-efficient" if masked else kind
        monkeypatch.setattr(blocks, "block_kernel", choose)
    return use


CASES = list(itertools.product(("cuda-flash", "cuda-efficient"), (True, False), ((4, 4), (4, 2), (4, 1)),
                               (False, True)))


@pytest.mark.parametrize("kind, causal, heads, docs", CASES)
def test_cuda_block_kernels_are_exact_on_emulated_ops(kind, causal, heads, docs, cuda_kind, monkeypatch):
    """One q block against 1-3 merged kv blocks, forward and backward; the backward gets the merged out in
    SDPA layout ``[B, H, L, D]`` contiguous (how the pipeline stores it), masks in pieces of 6 rows."""
    cuda_kind(kind)
    monkeypatch.setattr(blocks, "MASK_TILE", 6)
    g = torch.Generator().manual_seed(21)
    b, (h, hk), d, scale = 2, heads, 8, 0.37
    for lq, lk, parts in ((13, 13, 1), (13, 11, 3)):
        if causal and lq != lk:
            continue
        q = torch.randn(b, h, lq, d, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(b, hk, lk, d, generator=g, dtype=torch.float64, requires_grad=True)
        dd = None
        if docs:
            ids = torch.cumsum(torch.randint(0, 3, (b, max(lq, lk)), generator=g) == 0, 1)
            dd = (ids[:, :lq], ids[:, :lk])
        ref, ref_lse = sdpa_reference(q, k, v, causal, dd, scale)
        go = torch.randn(ref.shape, generator=g, dtype=torch.float64)
        want = torch.autograd.grad(ref, (q, k, v), go)
        cuts = sorted({0, lk, *(lk * i // parts for i in range(1, parts))}) if not causal else [0, lk]
        o = lse = None
        with torch.no_grad():
            for k0, k1 in zip(cuts[:-1], cuts[1:]):
                bd = None if dd is None else (dd[0], dd[1][:, k0:k1])
                ob, lb = blocks.block_forward(q, k[:, :, k0:k1], v[:, :, k0:k1], causal, scale, "flash", bd)
                o, lse = blocks.merge(o, lse, ob, lb)
            assert (o - ref).abs().max() <= TOL
            fin = torch.isfinite(ref_lse)
            assert torch.equal(fin, torch.isfinite(lse)) and (lse[fin] - ref_lse[fin]).abs().max() <= TOL
            out = o.to(q.dtype).contiguous()
            dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
            for k0, k1 in zip(cuts[:-1], cuts[1:]):
                bd = None if dd is None else (dd[0], dd[1][:, k0:k1])
                gq, gk, gv = blocks.block_backward(go.contiguous(), q, k[:, :, k0:k1], v[:, :, k0:k1], out, lse,
                                                   causal, scale, "flash", bd)
                dq += gq
                dk[:, :, k0:k1] += gk
                dv[:, :, k0:k1] += gv
        for got, ref_g in zip((dq, dk, dv), want):
            assert (got - ref_g).abs().max() <= TOL


@pytest.mark.parametrize("kind", ["cuda-flash", "cuda-efficient"])
@pytest.mark.parametrize("offload", [False, True])
def test_fpdt_pipeline_on_emulated_cuda_ops(kind, offload, cuda_kind):
    """The single-rank FPDT pipeline end to end: chunks, the chunk store's layouts, merges, GQA, documents."""
    from loom.comm import world
    from loom.parallel.sequence import fpdt_attention

    cuda_kind(kind)
    g = torch.Generator().manual_seed(8)
    for causal, hk, packed in itertools.product((True, False), (4, 2), (False, True)):
        q = torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
        k = torch.randn(2, 12, hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
        v = torch.randn(2, 12, hk, 8, generator=g, dtype=torch.float64, requires_grad=True)
        go = torch.randn(2, 12, 4, 8, generator=g, dtype=torch.float64)
        doc = torch.cumsum(torch.randint(0, 4, (2, 12), generator=g) == 0, 1) if packed else None
        dd = None if doc is None else (doc, doc)
        ref, _ = sdpa_reference(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal, dd, 1 / math.sqrt(8))
        ref = ref.transpose(1, 2)
        want = torch.autograd.grad(ref, (q, k, v), go)
        out = fpdt_attention(q, k, v, world(), chunks=3, causal=causal, offload=offload, doc_ids=doc)
        got = torch.autograd.grad(out, (q, k, v), go)
        assert (out - ref).abs().max() <= TOL
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= TOL


def test_emulation_refuses_what_the_cuda_ops_refuse():
    """The emulation is strict where the CUDA code is: a swapped argument, GQA on the memory-efficient kernel,
    an ``out`` in SDPA-contiguous layout for its backward, a padded log-sum-exp for flash's backward."""
    q = torch.randn(1, 2, 5, 8, dtype=torch.float64)
    kv = torch.randn(1, 1, 5, 8, dtype=torch.float64)
    with pytest.raises(AssertionError):
        _eff_fwd(q, kv, kv, None, True, 0.0, False, scale=0.3)  # fewer kv heads
    with pytest.raises(AssertionError):
        _eff_fwd(q, q, q, True, None, 0.0, False, scale=0.3)  # bias and compute_log_sumexp swapped
    out, lse, seed, off = _eff_fwd(q, q, q, None, True, 0.0, False, scale=0.3)
    _eff_bwd(out, q, q, q, None, out, lse, seed, off, 0.0, [True, True, True, False], False, scale=0.3)
    with pytest.raises(AssertionError, match="heads\\*head_dim"):
        _eff_bwd(out, q, q, q, None, out.contiguous(), lse, seed, off, 0.0, [True, True, True, False], False,
                 scale=0.3)
    o, lse, *_ = _flash_fwd(q, kv, kv, 0.0, True, False, scale=0.3)
    with pytest.raises(AssertionError):
        _flash_bwd(o, q, kv, kv, o, torch.nn.functional.pad(lse, (0, 3)), None, None, 5, 5, 0.0, True,
                   torch.zeros(2), torch.zeros(()), scale=0.3)
    with pytest.raises(AssertionError, match="square"):
        _flash_fwd(q, kv[:, :, :3], kv[:, :, :3], 0.0, True, False, scale=0.3)
