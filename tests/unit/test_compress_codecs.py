"""Codecs, error feedback and the policy in one process (no mpiexec)."""

from __future__ import annotations


import pytest
import torch

import loom.compress as lc
from loom.compress import CompressionPolicy, ErrorFeedback, get_codec
from loom.compress.codecs import matrix_view_shape

LOSSY_BOUNDED = ["bf16", "fp16", "int8", "int4", "int8:block=7", "int4:block=10", "topk:fraction=0.3",
                 "zfp", "zfp:rate=8", "zfp:rate=24"]
SHAPES = [(1,), (7,), (1001,), (3, 5, 7), (64, 33), (2, 0, 3)]


@pytest.fixture
def g():
    return torch.Generator().manual_seed(1234)


@pytest.mark.parametrize("name", LOSSY_BOUNDED)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_roundtrip_within_stated_bound(name, shape, dtype, g):
    codec = get_codec(name)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 5).to(dtype)
    y = codec.roundtrip(x)
    assert y.shape == x.shape and y.dtype == x.dtype
    err = (y.double() - x.double()).abs()
    assert (err <= codec.error_bound(x)).all(), float((err - codec.error_bound(x)).max())


@pytest.mark.parametrize("name", ["none", "zstd"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.int8])
def test_lossless_bit_exact(name, dtype, g):
    x = (torch.randn(3, 1001, generator=g) * 100).to(dtype)
    pkt = get_codec(name).encode(x)
    assert torch.equal(get_codec(name).decode(pkt), x)
    assert get_codec(name).lossless


@pytest.mark.parametrize("name", ["bf16", "fp16", "int8", "int4", "topk", "zfp", "powersgd"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_inputs_keep_dtype_and_shape(name, dtype, g):
    x = torch.randn(9, 31, generator=g).to(dtype)
    y = get_codec(name).roundtrip(x)
    assert y.dtype == dtype and y.shape == x.shape and torch.isfinite(y).all()


def test_wire_sizes_and_ratios(g):
    x = torch.randn(4096, generator=g)
    for name, ratio in (("bf16", 2.0), ("int8", 4 * 64 / 68), ("int4", 4 * 32 / 20),
                        ("topk:fraction=0.01", 16384 / (8 * 41))):
        codec = get_codec(name)
        pkt = codec.encode(x)
        assert pkt.nbytes == codec.wire_bytes(x.numel())
        assert pkt.ratio == pytest.approx(ratio, rel=0.02), name


def test_from_wire_decodes_received_bytes(g):
    codec = get_codec("int8")
    x = torch.randn(5, 100, generator=g)
    wire = torch.cat([torch.zeros(3, dtype=torch.uint8), codec.encode(x).data])[3:]  # unaligned view
    assert torch.equal(codec.decode(codec.from_wire(wire, x.shape, x.dtype)), codec.roundtrip(x))


def test_fp16_saturates_instead_of_inf():
    y = get_codec("fp16").roundtrip(torch.tensor([1e6, -1e6, 1.0]))
    assert torch.isfinite(y).all() and y[0] == 65504.0


def test_topk_keeps_the_largest(g):
    x = torch.randn(1000, generator=g)
    y = get_codec("topk", fraction=0.05).roundtrip(x)
    kept = y != 0
    assert kept.sum() == 50
    assert torch.equal(y[kept], x[kept])
    assert x[~kept].abs().max() <= x[kept].abs().min()


def test_powersgd_exact_on_rank_r_and_layer_selection(g):
    a, b = torch.randn(50, 3, generator=g, dtype=torch.float64), torch.randn(40, 3, generator=g, dtype=torch.float64)
    m = a @ b.T
    codec = get_codec("powersgd", rank=3)
    for _ in range(2):  # cold and warm start
        pkt = codec.encode(m)
        assert pkt.nbytes == (50 + 40) * 3 * 8
        assert (codec.decode(pkt) - m).abs().max() <= 1e-10 * m.abs().max()
    assert not codec.selected((64,)) and not codec.selected((4, 4)) and codec.selected((64, 64))
    assert codec.selected((1 << 16,))  # a flat bucket
    bias = torch.randn(10, generator=g)
    assert torch.equal(codec.roundtrip(bias), bias)  # not selected: sent raw
    assert matrix_view_shape((2, 3, 4)) == (2, 12) and matrix_view_shape((10,)) == (3, 4)


def test_get_codec_errors():
    with pytest.raises(ValueError, match="valid: none, bf16"):
        get_codec("int3")
    with pytest.raises(TypeError, match="does not take"):
        get_codec("int8", rate=3)
    with pytest.raises(ValueError, match="key=value"):
        get_codec("int8:32")
    with pytest.raises(ValueError, match="block"):
        get_codec("int8:block=0")
    with pytest.raises(TypeError, match="floating"):
        get_codec("int8").encode(torch.arange(10))
    assert get_codec("int8:block=32").block == 32
    c = get_codec("topk")
    assert get_codec(c) is c


def test_error_feedback_store():
    ef = ErrorFeedback()
    x = torch.ones(4)
    assert torch.equal(ef.apply("a", x), x)
    ef.set("a", torch.full((4,), 0.5))
    assert torch.equal(ef.apply("a", x), torch.full((4,), 1.5))
    assert torch.equal(ef.apply("a", torch.ones(5)), torch.ones(5))  # shape changed: not applied
    assert ef.norm() == pytest.approx(1.0)
    ef.reset()
    assert len(ef) == 0


def test_policy_presets_and_validation():
    h = CompressionPolicy.preset("hybrid")
    assert h.codec_for("dp").name == "int4" and h.codec_for("pp").name == "bf16" and h.codec_for("tp").name == "bf16"
    assert h.codec_for("dp") is h.codec_for("dp")  # one instance: stateful codecs keep state
    assert CompressionPolicy.preset("none").codec_for("dp") is None
    n = CompressionPolicy.preset("naive")
    assert {n.codec_for(a).name for a in ("dp", "pp", "sp", "tp", "ep")} == {"zfp"}
    p = CompressionPolicy(dp="powersgd:rank=2", pp="bf16", min_bytes=0)
    assert p.codec_for("dp").rank == 2 and p.codec_for("sp") is None
    with pytest.raises(ValueError, match="valid: none, naive, hybrid"):
        CompressionPolicy.preset("fast")
    with pytest.raises(ValueError, match="unknown codec"):
        CompressionPolicy(dp="int9")
    with pytest.raises(ValueError, match="min_bytes"):
        CompressionPolicy(min_bytes=-1)
    with pytest.raises(ValueError, match="mesh axis"):
        h.codec_for("xp")


def test_single_rank_collectives_are_exact(g):
    from loom.comm import world

    comm = world()
    if comm.size != 1:
        pytest.skip("unit tests run on one rank")
    x = torch.randn(1000, generator=g)
    assert torch.equal(lc.allreduce(x, comm, "int4", min_bytes=0), x)
    hook = lc.dp_hook("int8")
    assert torch.equal(hook(x, comm, 0), x)
    # allgather: every rank (this one too) gets each block as a receiver sees it, decode(encode(x)), so all
    # ranks hold the same result; exactly that, bit for bit
    assert torch.equal(lc.allgather(x, comm, "int8", min_bytes=0), get_codec("int8").roundtrip(x))


def test_compression_state_round_trips_for_resume(g):
    """What a checkpoint keeps: PowerSGD's warm start and error-feedback residuals; restored, the next step is
    bit-identical to the uninterrupted one, and without them it is not."""
    m1, m2 = torch.randn(30, 20, generator=g), torch.randn(30, 20, generator=g)
    running = get_codec("powersgd", rank=2)
    running.encode(m1)  # warms Q
    restored = get_codec("powersgd", rank=2)
    restored.load_state_dict(running.state_dict())
    cold = get_codec("powersgd", rank=2)
    want = running.encode(m2).data
    assert torch.equal(restored.encode(m2).data, want)
    assert not torch.equal(cold.encode(m2).data, want)
    ef = ErrorFeedback()
    ef.set(0, torch.full((3,), 0.25))
    again = ErrorFeedback()
    again.load_state_dict(ef.state_dict())
    assert torch.equal(again.apply(0, torch.zeros(3)), torch.full((3,), 0.25))
    hook = lc.dp_hook(CompressionPolicy.preset("hybrid"))
    hook.error_feedback.set(1, torch.ones(2))
    other = lc.dp_hook(CompressionPolicy.preset("hybrid"))
    other.load_state_dict(hook.state_dict())
    assert torch.equal(other.error_feedback.get(1), torch.ones(2))
    with pytest.raises(ValueError, match="stateless"):
        get_codec("int8").load_state_dict({"q": {}})
