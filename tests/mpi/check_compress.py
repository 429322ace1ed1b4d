"""Compressed collectives on real ranks, against an exact float64 single-process reference.

Every rank builds every rank's input from one shared seed, so each rank can compute the exact result itself
and assert. Tolerances are the codecs' stated bounds (``Codec.error_bound``): for the allreduce
``sum_i e(x_i) + e(|sum| + sum_i e(x_i))`` (two quantizations), and 1e-5 relative for fp32-reduced lossless
paths.
"""

from __future__ import annotations

import torch

import loom.compress as lc
from loom.compress import CompressionPolicy, ErrorFeedback, get_codec
from loom.testing import mpi_checks, seeded

QUANT_CODECS = ["none", "bf16", "fp16", "int8", "int4", "int4:block=16", "zfp", "zstd"]
SIZES = [1, 3, 130, 1001, 4099]  # uneven: none divides by 3 or 4; smaller than P too


def _inputs(comm, g, n, dtype=torch.float64, scale_by_rank=True):
    """Every rank's input (list over ranks), identical on all ranks."""
    xs = []
    for r in range(comm.size):
        s = (1.0 + r) if scale_by_rank else 1.0
        xs.append((torch.randn(n, generator=g, dtype=torch.float64) * s).to(dtype))
    return xs


def _same_everywhere(comm, t: torch.Tensor) -> None:
    rows = comm.allgather(t.reshape(1, -1).contiguous())
    for r in range(comm.size):
        assert torch.equal(rows[r], rows[0]), f"rank {r} got a different result than rank 0"


def _allreduce_tol(codec, xs, ref):
    ins = sum(codec.error_bound(x) for x in xs) if comm_size(xs) > 1 else torch.zeros_like(ref)
    return ins + codec.error_bound(ref.abs() + ins) + 1e-6 * (1 + ref.abs())


def comm_size(xs):
    return len(xs)


def check_allreduce_within_bound(comm):
    g = seeded(comm, 1)
    for name in QUANT_CODECS:
        codec = get_codec(name)
        for n in SIZES:
            for dtype in (torch.float32, torch.float64):
                xs = _inputs(comm, g, n, dtype)
                ref = sum(x.double() for x in xs)
                out = lc.allreduce(xs[comm.rank], comm, codec, min_bytes=0)
                assert out.dtype == dtype and out.shape == xs[comm.rank].shape, (name, out.dtype, out.shape)
                err = (out.double() - ref).abs()
                tol = _allreduce_tol(codec, [x.double() for x in xs], ref)
                assert (err <= tol).all(), f"{name} n={n} {dtype}: max excess {(err - tol).max():.3g}"
                # The per-element bound of a coarse codec at 4 ranks can exceed |ref| itself (it would accept an
                # all-zero result): the error must also be well below the result (worst seen: 0.16, int4).
                rel = (err.norm() / ref.norm()).item()
                assert rel <= 0.5, f"{name} n={n} {dtype}: relative error {rel:.3g} (an all-zero result is 1)"
                _same_everywhere(comm, out)


def check_allreduce_shapes_and_16bit(comm):
    g = seeded(comm, 2)
    for dtype in (torch.bfloat16, torch.float16):
        xs = [torch.randn(5, 7, 3, generator=g).to(dtype) for _ in range(comm.size)]
        ref = sum(x.double() for x in xs)
        out = lc.allreduce(xs[comm.rank], comm, "int8", min_bytes=0)
        assert out.dtype == dtype and out.shape == (5, 7, 3)
        # int8 twice, then rounding the fp32 result to 16 bits
        tol = 2 * comm.size * ref.abs().max() / 100 + 0.05
        assert (out.double() - ref).abs().max() <= tol
        _same_everywhere(comm, out.float())


def check_allreduce_below_threshold_is_exact(comm):
    g = seeded(comm, 3)
    xs = _inputs(comm, g, 100, torch.float64)
    out = lc.allreduce(xs[comm.rank], comm, "int4", min_bytes=1 << 20)
    assert torch.equal(out, comm.allreduce(xs[comm.rank]))


def check_topk_allreduce(comm):
    g = seeded(comm, 4)
    xs = _inputs(comm, g, 999, torch.float32)
    out = lc.allreduce(xs[comm.rank], comm, "topk:fraction=1.0", min_bytes=0)  # keep all: exact in fp32
    ref = sum(x.double() for x in xs)
    assert (out.double() - ref).abs().max() <= 1e-5 * (1 + ref.abs().max())
    out = lc.allreduce(xs[comm.rank], comm, "topk:fraction=0.1", min_bytes=0)
    if comm.size > 1:
        assert (out != 0).sum() <= comm.size * (100 + 4)  # at most k kept per reduced shard
    _same_everywhere(comm, out)


def check_error_feedback_bounded_drift(comm):
    """100 steps: sum of outputs tracks sum of inputs; the drift equals the final residuals, not 100 errors."""
    g = seeded(comm, 5)
    for name in ("int4", "topk:fraction=0.05"):
        codec = get_codec(name)
        ef = ErrorFeedback()
        n = 777
        acc_out = torch.zeros(n, dtype=torch.float64)
        acc_in = torch.zeros(n, dtype=torch.float64)
        acc_noef = torch.zeros(n, dtype=torch.float64)
        max_step_err = 0.0
        for _ in range(100):
            xs = [0.2 + torch.randn(n, generator=g, dtype=torch.float64) for _ in range(comm.size)]
            x = xs[comm.rank].float()
            ref = sum(v.float().double() for v in xs)
            out = lc.allreduce(x, comm, codec, error_feedback=ef, key="b0", min_bytes=0)
            acc_out += out.double()
            acc_in += ref
            max_step_err = max(max_step_err, float((out.double() - ref).abs().max()))
            if name.startswith("topk"):  # without feedback, never-selected mass is lost for good
                acc_noef += lc.allreduce(x, comm, codec, min_bytes=0).double()
        drift = acc_out - acc_in
        # Identity: sum_t z_t - sum_t sum_i x_i = -(sum of final residuals over ranks)
        res = ef.get("b0")  # None on one rank: nothing is compressed there
        res_sum = comm.allreduce(res.double()) if res is not None else torch.zeros(n, dtype=torch.float64)
        assert (drift + res_sum).abs().max() <= 1e-3, f"{name}: drift is not the residual"
        if comm.size > 1:
            # Bounded: about one step's error, while without feedback the errors accumulate.
            assert drift.abs().max() <= 3 * max_step_err, (name, drift.abs().max(), max_step_err)
        if comm.size > 1 and name.startswith("topk"):
            noef = (acc_noef - acc_in).abs().max()
            assert noef > 3 * drift.abs().max(), (name, float(noef), float(drift.abs().max()))


def _rs_layouts(p):
    """Rows per rank: equal blocks (None), and uneven ones with a zero at 4 ranks."""
    return [None, [(3 * j + 1) % 5 for j in range(p)]]


def check_reduce_scatter_within_bound_even_and_uneven(comm):
    """Each rank's block of the sum within one quantization of every other rank's input (its own is exact),
    equal and uneven blocks; the bytes on the wire are exactly the encoded shards sent (int8 of fp64: 0.13x
    the raw); below min_bytes it is comm.reduce_scatter; powersgd raises by name."""
    g = seeded(comm, 11)
    p, me = comm.size, comm.rank
    for counts in _rs_layouts(p):
        rows = counts if counts is not None else [2] * p
        lo, hi = sum(rows[:me]), sum(rows[:me + 1])
        for name in QUANT_CODECS:
            codec = get_codec(name)
            for dtype in (torch.float32, torch.float64):
                xs = [(torch.randn(sum(rows), 3, generator=g, dtype=torch.float64) * (1 + r)).to(dtype)
                      for r in range(p)]
                ref = sum(x.double() for x in xs)[lo:hi]
                out = lc.reduce_scatter(xs[me], comm, codec, min_bytes=0, counts=counts)
                assert out.dtype == dtype and out.shape == (rows[me], 3), (name, out.dtype, out.shape)
                tol = sum(codec.error_bound(xs[i][lo:hi].double()) for i in range(p) if i != me) \
                    + 1e-6 * (1 + ref.abs())
                err = (out.double() - ref).abs()
                assert (err <= tol).all(), f"{name} counts={counts} {dtype}: max excess {(err - tol).max():.3g}"
    x = torch.randn(64 * p, 16, generator=g, dtype=torch.float64)
    for name in ("int8", "bf16"):
        codec = get_codec(name)
        lc.reset_stats()
        lc.reduce_scatter(x, comm, codec, min_bytes=0)
        st = lc.stats()[comm.name]
        assert st["raw"] == x.numel() * 8 * (p - 1) // p and st["calls"] == 1, st
        assert st["wire"] == (p - 1) * codec.wire_bytes(64 * 16, torch.float64), (name, st)
        if p > 1:
            assert st["wire"] <= (0.14 if name == "int8" else 0.26) * st["raw"], (name, st)
    small = lc.reduce_scatter(x, comm, "int4", min_bytes=1 << 20)
    assert torch.equal(small, comm.reduce_scatter(x))
    counts = _rs_layouts(p)[1]
    y = torch.randn(sum(counts), 5, generator=g, dtype=torch.float64) * (1 + me)
    lo = sum(counts[:me])
    want = comm.allreduce(y)[lo:lo + counts[me]]
    got = lc.reduce_scatter(y, comm, "int4", min_bytes=1 << 20, counts=counts)  # uneven, raw shards
    assert ((got - want).abs() <= 1e-12 * (1 + want.abs())).all(), "uneven uncompressed"
    try:
        lc.reduce_scatter(x, comm, "powersgd:rank=2")
    except ValueError as exc:
        assert "powersgd" in str(exc) and "int8" in str(exc), exc
    else:
        raise AssertionError("powersgd reduce_scatter did not raise")


def check_reduce_scatter_error_feedback_keeps_the_difference(comm):
    """Over 3 steps of int4 with error feedback: result + R_t - R_{t-1} = sum of inputs (R the residuals summed
    over ranks), to fp64 rounding; each rank's residual is zero on its own block and not zero elsewhere."""
    g = seeded(comm, 12)
    p, me = comm.size, comm.rank
    counts = [c + 2 for c in _rs_layouts(p)[1]]
    n0 = sum(counts)
    lo, hi = sum(counts[:me]), sum(counts[:me + 1])
    ef = ErrorFeedback()
    prev = torch.zeros(n0, 4, dtype=torch.float64)
    for step in range(3):
        xs = [torch.randn(n0, 4, generator=g, dtype=torch.float64) for _ in range(p)]
        out = lc.reduce_scatter(xs[me], comm, "int4", error_feedback=ef, key="g", min_bytes=0, counts=counts)
        whole = comm.allgatherv(out.reshape(-1).contiguous())[0].view(n0, 4)
        res = ef.get("g")
        now = comm.allreduce(res.double()) if res is not None else torch.zeros_like(prev)
        ident = (whole + now - prev - sum(xs)).abs().max()
        assert ident <= 1e-12 * (1 + sum(xs).abs().max()), f"step {step}: residuals are not the difference {ident}"
        if p > 1:
            assert torch.equal(res[lo:hi], torch.zeros_like(res[lo:hi])), "own block's residual is not zero"
            assert res.abs().max() > 0, "nothing kept: int4 drops something"
        prev = now


def _rank_r(g, m, n, r, ranks):
    a = torch.randn(m, r, generator=g, dtype=torch.float64)
    return [a @ torch.randn(n, r, generator=g, dtype=torch.float64).T for _ in range(ranks)]


def check_powersgd_exact_on_rank_r(comm):
    g = seeded(comm, 6)
    codec = get_codec("powersgd", rank=3)
    for step in range(3):  # warm-started Q must stay exact
        ms = _rank_r(g, 40, 24, 3, comm.size)
        out = lc.allreduce(ms[comm.rank], comm, codec, key="w", min_bytes=0)
        ref = sum(ms)
        assert (out - ref).abs().max() <= 1e-9 * ref.abs().max(), f"step {step}"
        _same_everywhere(comm, out)
    # layer-wise: two rank-3 layers and a bias (sent raw) packed into one flat bucket
    ef = ErrorFeedback()
    for step in range(2):
        w1, w2 = _rank_r(g, 30, 20, 3, comm.size), _rank_r(g, 16, 50, 2, comm.size)
        bias = [torch.randn(7, generator=g, dtype=torch.float64) for _ in range(comm.size)]
        flats = [torch.cat([w1[i].reshape(-1), bias[i], w2[i].reshape(-1)]) for i in range(comm.size)]
        out = lc.allreduce(flats[comm.rank], comm, codec, key="bucket", min_bytes=0, error_feedback=ef,
                           shapes=[(30, 20), (7,), (16, 50)])
        ref = sum(flats)
        assert (out - ref).abs().max() <= 1e-9 * ref.abs().max(), f"layer-wise step {step}"
        if comm.size > 1:  # nothing dropped: residual ~ 0
            assert ef.get("bucket").abs().max() <= 1e-9 * ref.abs().max()


def check_allgather(comm):
    g = seeded(comm, 7)
    for name in ("int8", "bf16", "zstd", "zfp"):
        codec = get_codec(name)
        xs = [torch.randn(9, 13, generator=g) for _ in range(comm.size)]
        out = lc.allgather(xs[comm.rank], comm, codec, min_bytes=0)
        ref = torch.cat(xs)
        tol = torch.cat([codec.error_bound(x) for x in xs]) + 1e-7
        assert out.shape == ref.shape
        assert ((out.double() - ref.double()).abs() <= tol).all(), name
        _same_everywhere(comm, out)


def check_alltoallv(comm):
    g = seeded(comm, 8)
    p, me = comm.size, comm.rank
    counts = [[(i * 3 + j * 5) % 7 for j in range(p)] for i in range(p)]  # counts[src][dst], some zero
    data = [torch.randn(sum(counts[i]), 6, generator=g) for i in range(p)]
    for name in ("int8", "zstd"):
        codec = get_codec(name)
        out, rc = lc.alltoallv(data[me], counts[me], comm, codec, min_bytes=0)
        assert rc == [counts[i][me] for i in range(p)]
        pieces = []
        for i in range(p):
            start = sum(counts[i][:me])
            pieces.append(data[i][start:start + counts[i][me]])
        ref = torch.cat(pieces)
        tol = torch.cat([codec.error_bound(b) for b in pieces]) + 1e-7
        assert out.shape == ref.shape and ((out - ref).abs().double() <= tol).all(), name
        out2, _ = lc.alltoallv(data[me], counts[me], comm, codec, recv_counts=rc, min_bytes=0)
        assert torch.equal(out, out2)


def check_send_recv_chain(comm):
    g = seeded(comm, 9)
    p, me = comm.size, comm.rank
    for name in ("int8", "zstd", "powersgd:rank=2", "bf16"):
        codec = get_codec(name)
        msgs = [torch.randn(33, 17, generator=g) for _ in range(p)]
        if me > 0:
            out = torch.full((33, 17), float("nan"))  # poisoned
            lc.recv(out, me - 1, comm, codec, min_bytes=0)
            b = codec.error_bound(msgs[me - 1])
            if b is not None:
                assert ((out.double() - msgs[me - 1].double()).abs() <= b + 1e-7).all(), name
            else:
                assert torch.isfinite(out).all()
        if me < p - 1:
            lc.send(msgs[me], me + 1, comm, codec, min_bytes=0)
    # below threshold: exact, plain send
    if p > 1:
        if me == 0:
            lc.send(torch.arange(4.0), 1, comm, "int4")
        elif me == 1:
            assert torch.equal(lc.recv(torch.zeros(4), 0, comm, "int4"), torch.arange(4.0))


def check_dp_hook_mean_and_stats(comm):
    g = seeded(comm, 10)
    lc.reset_stats()
    hook = lc.dp_hook(CompressionPolicy.preset("hybrid", min_bytes=0))
    for _step in range(3):
        for bucket, n in ((0, 5000), (1, 1234)):
            xs = [torch.randn(n, generator=g) for _ in range(comm.size)]
            out = hook(xs[comm.rank], comm, bucket)
            ref = sum(x.double() for x in xs) / comm.size
            assert (out.double() - ref).abs().max() <= 2 * ref.abs().max() * comm.size / 7 + 1e-6
    if comm.size > 1:
        assert len(hook.error_feedback) == 2
        s = lc.stats()[comm.name]
        assert s["calls"] == 6 and s["wire"] * 3 < s["raw"], s  # int4: ~6x fewer bytes
    plain = lc.dp_hook(CompressionPolicy.preset("none"))
    x = torch.randn(100, generator=g)
    assert torch.equal(plain(x, comm, 0), comm.allreduce(x, "avg"))


if __name__ == "__main__":
    mpi_checks(globals())
