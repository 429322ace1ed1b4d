"""Tensor parallelism (loom.parallel.tensor, loom.models.parallelize) against one process on random fp64 data.

Every tp rank builds the whole model (identical weights: Llama seeds each parameter by its name) and a
reference copy; the tp copy is split with ``parallelize_llama``. Tolerance: 1e-9 absolute in fp64 for outputs,
losses, gradients and parameters after several AdamW steps (the sums are reordered, nothing else differs).
Compressed tp (bf16 activations): each allreduce within the codec's bound (``sum_i e(y_i) + e(s)``), the
model's loss within 1e-2 relative. Sizes that do not divide by tp (vocabulary 101, FFN width 136 at tp = 3)
are split unevenly; heads that do not divide are refused.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from loom import stats
from loom.compress import codec_names, get_codec
from loom.models.llama import Llama, LlamaConfig
from loom.models.parallelize import validate_tensor_parallel, parallelize_llama
from loom.parallel.tensor import (
    ColumnParallelLinear,
    ParallelFeedForward,
    RowParallelLinear,
    TPLink,
    VocabParallelEmbedding,
    gather_from_sequence_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_region,
    scatter_to_tp_region,
    shard_range,
    split_heads,
    vocab_parallel_cross_entropy,
)
from loom.testing import mpi_checks, seeded
from tests.jobs import SharedDir, train_config, uneven_documents

TOL = 1e-9
B, S = 2, 12  # S divides by tp = 1-4 (sequence parallelism splits it)


def _close(a, b, what, tol=TOL):
    err = (a - b).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{what}: max |diff| {err:.3e} > {tol:.0e}"


def _linear(i, o, g):
    lin = nn.Linear(i, o, bias=True, dtype=torch.float64)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(o, i, generator=g, dtype=torch.float64))
        lin.bias.copy_(torch.randn(o, generator=g, dtype=torch.float64))
    return lin


def _grad_of(fn, x, go):
    x = x.detach().clone().requires_grad_()
    y = fn(x)
    y.backward(go)
    return y.detach(), x.grad


def check_column_and_row_parallel_linear(comm):
    """Column (gathered and split output) and row (split and replicated input) layers, uneven widths, bias."""
    g = seeded(comm)
    p, r = comm.size, comm.rank
    link = TPLink(comm)
    for i, o in ((7, 13), (12, 6)):
        lin = _linear(i, o, g)
        x = torch.randn(B, S, i, generator=g, dtype=torch.float64)
        go = torch.randn(B, S, o, generator=g, dtype=torch.float64)
        ref_y, ref_gx = _grad_of(lin, x, go)
        ref_w = torch.autograd.grad(lin(x), [lin.weight, lin.bias], go)
        lo, hi = shard_range(o, p, r)

        col = ColumnParallelLinear.from_linear(lin, link, gather_output=True)
        y, gx = _grad_of(col, x, go)
        _close(y, ref_y, f"column {i}x{o} gathered forward")
        _close(gx, ref_gx, f"column {i}x{o} input grad")
        _close(col.weight.grad, ref_w[0][lo:hi], f"column {i}x{o} weight grad")
        _close(col.bias.grad, ref_w[1][lo:hi], f"column {i}x{o} bias grad")

        col = ColumnParallelLinear.from_linear(lin, link)
        y, gx = _grad_of(col, x, go[..., lo:hi])
        _close(y, ref_y[..., lo:hi], f"column {i}x{o} split forward")
        _close(gx, ref_gx, f"column {i}x{o} split-output input grad")

        ilo, ihi = shard_range(i, p, r)
        row = RowParallelLinear.from_linear(lin, link, input_is_parallel=False)
        y, gx = _grad_of(row, x, go)
        _close(y, ref_y, f"row {i}x{o} forward")
        _close(gx, ref_gx, f"row {i}x{o} scattered input grad")
        w = torch.autograd.grad(row(x), [row.weight, row.bias], go)
        _close(w[0], ref_w[0][:, ilo:ihi], f"row {i}x{o} weight grad")
        _close(w[1], ref_w[1], f"row {i}x{o} bias grad")

        row = RowParallelLinear.from_linear(lin, link)
        y, gx = _grad_of(row, x[..., ilo:ihi], go)
        _close(y, ref_y, f"row {i}x{o} parallel-input forward")
        _close(gx, ref_gx[..., ilo:ihi], f"row {i}x{o} parallel-input grad")


def check_region_functions(comm):
    """gather/scatter/reduce regions: forward values and the gradients their backward routes."""
    g = seeded(comm)
    p, r = comm.size, comm.rank
    full = torch.randn(B, 5 * p + 1, generator=g, dtype=torch.float64)  # uneven over p > 1
    lo, hi = shard_range(full.shape[-1], p, r)
    go = torch.randn(full.shape, generator=g, dtype=torch.float64)
    y, gx = _grad_of(lambda x: gather_from_tp_region(x, comm, full.shape[-1]), full[..., lo:hi], go)
    _close(y, full, "gather forward")
    _close(gx, go[..., lo:hi], "gather backward")
    y, gx = _grad_of(lambda x: scatter_to_tp_region(x, comm), full, go[..., lo:hi])
    _close(y, full[..., lo:hi], "scatter forward")
    _close(gx, go, "scatter backward (every rank's slice of the same go, gathered)")
    parts = [torch.randn(B, 4, generator=g, dtype=torch.float64) for _ in range(p)]
    y, gx = _grad_of(lambda x: reduce_from_tp_region(x, comm), parts[r], go[:, :4])
    _close(y, sum(parts), "reduce forward")
    _close(gx, go[:, :4], "reduce backward (identity)")
    # Megatron-SP: tokens (dim -2) gathered / reduce-scattered
    toks = torch.randn(B, 3 * p, 5, generator=g, dtype=torch.float64)
    gt = torch.randn(B, 3 * p, 5, generator=g, dtype=torch.float64)
    mine = slice(3 * r, 3 * r + 3)
    y, gx = _grad_of(lambda x: gather_from_sequence_region(x, comm), toks[:, mine], gt)
    _close(y, toks, "token gather forward")
    _close(gx, p * gt[:, mine], "token gather backward (reduce-scatter of the same gradient on every rank)")
    parts = [torch.randn(B, 3 * p, 5, generator=g, dtype=torch.float64) for _ in range(p)]
    y, gx = _grad_of(lambda x: reduce_scatter_to_sequence_region(x, comm), parts[r], gt[:, mine])
    _close(y, sum(parts)[:, mine], "token reduce-scatter forward")
    _close(gx, gt, "token reduce-scatter backward (all-gather)")


def check_feedforward_and_embedding(comm):
    """SwiGLU and GELU FFN with an inner width that does not divide; the vocabulary-parallel embedding."""
    g = seeded(comm)
    p, r = comm.size, comm.rank
    h, f = 10, 3 * p + 1
    w1, w2, w3 = (nn.Linear(a, b, bias=False, dtype=torch.float64) for a, b in ((h, f), (f, h), (h, f)))
    for lin in (w1, w2, w3):
        with torch.no_grad():
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g, dtype=torch.float64))
    x = torch.randn(B, S, h, generator=g, dtype=torch.float64)
    go = torch.randn(B, S, h, generator=g, dtype=torch.float64)
    lo, hi = shard_range(f, p, r)
    for gate in (w3, None):
        def ref(t, gate=gate):
            return w2(F.silu(w1(t)) * gate(t)) if gate is not None else w2(F.gelu(w1(t)))
        ry, rgx = _grad_of(ref, x, go)
        rw = torch.autograd.grad(ref(x), [w1.weight, w2.weight], go)
        ffn = ParallelFeedForward.from_dense(w1, w2, gate, comm)
        y, gx = _grad_of(ffn, x, go)
        kind = "swiglu" if gate is not None else "gelu"
        _close(y, ry, f"{kind} forward")
        _close(gx, rgx, f"{kind} input grad")
        _close(ffn.w1.weight.grad, rw[0][lo:hi], f"{kind} w1 grad")
        _close(ffn.w2.weight.grad, rw[1][:, lo:hi], f"{kind} w2 grad")

    v = 4 * p + 3
    emb = nn.Embedding(v, h, dtype=torch.float64)
    with torch.no_grad():
        emb.weight.copy_(torch.randn(v, h, generator=g, dtype=torch.float64))
    ids = torch.randint(0, v, (B, S), generator=g)
    ids[0, :3] = torch.tensor([0, v - 1, v // 2])  # both ends of the table
    pe = VocabParallelEmbedding.from_embedding(emb, comm)
    y = pe(ids)
    y.backward(go)
    emb(ids).backward(go)
    _close(y, emb(ids), "embedding forward")
    _close(pe.weight.grad, emb.weight.grad[pe.vocab_start:pe.vocab_end], "embedding grad")


def check_vocab_parallel_cross_entropy(comm):
    """The loss of split logits equals F.cross_entropy of the whole ones (sum, mean, none), ignore_index too."""
    g = seeded(comm)
    p, r = comm.size, comm.rank
    n, v = 23, 7 * p + 2
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, v, (n,), generator=g)
    targets[:3] = torch.tensor([0, v - 1, -100])
    lo, hi = shard_range(v, p, r)
    for red in ("sum", "mean", "none"):
        go = (torch.randn(n, generator=g, dtype=torch.float64) if red == "none"
              else torch.tensor(1.7, dtype=torch.float64))
        ref, rg = _grad_of(lambda t, red=red: F.cross_entropy(t, targets, reduction=red, ignore_index=-100),
                           logits, go)
        got, gg = _grad_of(lambda t, red=red: vocab_parallel_cross_entropy(t, targets, comm, lo, reduction=red),
                           logits[:, lo:hi], go)
        _close(got, ref, f"vocab-parallel loss ({red})")
        _close(gg, rg[:, lo:hi], f"vocab-parallel logits grad ({red})")


def check_exact_reductions_bypass_every_tp_codec(comm):
    """The cross-entropy's reductions are marked exact (``TPLink.allreduce(..., exact=True)``): with every codec
    on the tp link (``min_bytes=0``) the vocab-parallel loss and its gradient equal F.cross_entropy (fp64,
    1e-9) and no compressed collective ran (loom.compress counts each call under the comm's name), while an
    unmarked allreduce on the same link does go through the codec (so a codec that touched them would show)."""
    if comm.size == 1:
        return
    g = seeded(comm)
    n, v = 19, 5 * comm.size + 1
    logits = torch.randn(n, v, generator=g, dtype=torch.float64) * 4
    targets = torch.randint(0, v, (n,), generator=g)
    lo, hi = shard_range(v, comm.size, comm.rank)
    ref, rg = _grad_of(lambda t: F.cross_entropy(t, targets, reduction="sum"), logits, torch.tensor(1.0))
    tp = comm.dup(name="tp-exact")
    for name in codec_names():
        try:
            codec = get_codec(name)
        except ImportError:  # zfp without zfpy
            continue
        link = TPLink(tp, codec, min_bytes=0)
        stats.reset("compress")
        got, gg = _grad_of(lambda t, link=link: vocab_parallel_cross_entropy(t, targets, link, lo), logits[:, lo:hi],
                           torch.tensor(1.0))
        calls = stats.snapshot("compress").get("tp-exact", {}).get("calls", 0)
        assert calls == 0, f"codec {name} ran {calls} times on the cross-entropy's exact reductions"
        _close(got, ref, f"vocab-parallel loss with codec {name} on the tp link")
        _close(gg, rg[:, lo:hi], f"vocab-parallel logits grad with codec {name} on the tp link")
    link = TPLink(tp, "bf16", min_bytes=0)
    link.allreduce(logits)
    assert stats.snapshot("compress")["tp-exact"]["calls"] == 1, "an unmarked allreduce skipped the codec"
    try:
        link.allreduce(logits, op="max")
    except ValueError as exc:
        assert "exact=True" in str(exc), exc
    else:
        raise AssertionError("a max allreduce went through a summing codec")


def _cfg(p: int, **kw) -> LlamaConfig:
    # heads 6 divide by 1, 2, 3; kv_heads = p keeps GQA at every size (one kv head per tp rank: callers that
    # need several pass heads and kv_heads); vocab 101 and FFN width 136 are uneven
    kv = p if p in (2, 3) else 3
    return LlamaConfig(**{**dict(layers=2, hidden=48, heads=6, kv_heads=kv, vocab=101), **kw})


def _slice_ref(model, name: str, t: torch.Tensor) -> torch.Tensor:
    """The part of the one-rank tensor ``t`` (parameter ``name``) that this tp rank holds."""
    mod = model.get_submodule(name.rpartition(".")[0])
    if isinstance(mod, ColumnParallelLinear):
        return t[mod.out_start:mod.out_end]
    if isinstance(mod, RowParallelLinear):
        return t[:, mod.in_start:mod.in_end]
    if isinstance(mod, VocabParallelEmbedding):
        return t[mod.vocab_start:mod.vocab_end]
    return t


def _llama_pair(comm, sequence_parallel=False, **kw):
    if comm.size > 3:
        return None
    cfg = _cfg(comm.size, **kw)
    ref = Llama(cfg).to(torch.float64)
    tp = parallelize_llama(copy.deepcopy(ref), comm, sequence_parallel=sequence_parallel)
    return cfg, ref, tp


def check_llama_forward_backward_and_adamw(comm):
    """Whole model: logits, loss, every gradient and every parameter after 4 AdamW steps equal one rank's
    (untied and tied embeddings; loss and FFN in 2 chunks; packed documents in one step; with and without
    sequence parallelism; one and two kv heads per tp rank, two query heads per kv head: a rank must hold
    its query heads' own kv heads, in order)."""
    several_kv = dict(heads=4 * comm.size, kv_heads=2 * comm.size)
    for kw in (dict(), dict(tie_embeddings=True, loss_chunks=2, ffn="gelu", **several_kv),
               dict(sequence_parallel=True, loss_chunks=2, ffn_chunks=2, **several_kv),
               dict(sequence_parallel=True, tie_embeddings=True, checkpoint=True)):
        pair = _llama_pair(comm, **kw)
        if pair is None:
            return
        cfg, ref, tp = pair
        g = seeded(comm)
        tok = torch.randint(0, cfg.vocab, (B, S), generator=g)
        with torch.no_grad():
            _close(tp(tok), ref(tok), f"logits {kw}")
        names = [n for n, _ in ref.named_parameters()]
        assert names == [n for n, _ in tp.named_parameters()], "parameter names changed"
        opt_r = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.1)
        opt_t = torch.optim.AdamW(tp.parameters(), lr=1e-2, weight_decay=0.1)
        for step in range(4):
            tok = torch.randint(0, cfg.vocab, (B, S), generator=g)
            tgt = torch.randint(0, cfg.vocab, (B, S), generator=g)
            tgt[0, -1] = -100
            doc = torch.cumsum((torch.rand(B, S, generator=g) < 0.3).long(), 1) if step == 2 else None
            lr, lt = ref.loss(tok, tgt, doc_ids=doc), tp.loss(tok, tgt, doc_ids=doc)
            _close(lt.detach(), lr.detach(), f"loss step {step} {kw}")
            opt_r.zero_grad()
            opt_t.zero_grad()
            lr.backward()
            lt.backward()
            rp, tpp = dict(ref.named_parameters()), dict(tp.named_parameters())
            for n in names:
                _close(tpp[n].grad, _slice_ref(tp, n, rp[n].grad), f"grad {n} step {step} {kw}")
            opt_r.step()
            opt_t.step()
        rp = dict(ref.named_parameters())
        for n, prm in tp.named_parameters():
            _close(prm.detach(), _slice_ref(tp, n, rp[n].detach()), f"param {n} after AdamW {kw}")


def check_compressed_tp_within_codec_bound(comm):
    """bf16 on the tp activation allreduce: each within sum_i e(y_i) + e(s); the model's loss within 1e-2
    relative and equal (1e-9) to the exact cross-entropy of the compressed model's own logits (the loss's
    reductions stay exact); the bytes land under "tp" with wire < raw."""
    g = seeded(comm)
    p, r = comm.size, comm.rank
    codec = get_codec("bf16")
    parts = [torch.randn(64, 300, generator=g, dtype=torch.float64) for _ in range(p)]
    exact = sum(parts)
    link = TPLink(comm, codec, min_bytes=0)
    got = reduce_from_tp_region(parts[r], link)
    bound = sum(codec.error_bound(t) for t in parts) + codec.error_bound(exact.abs() + 2 * sum(
        codec.error_bound(t) for t in parts)) + 1e-12
    assert ((got - exact).abs() <= bound).all(), "compressed tp allreduce outside the bf16 bound"
    if p > 1:
        assert ((got - exact).abs().max() > 0).item(), "bf16 tp allreduce was exact: the codec did not run"
    pair = _llama_pair(comm)
    if pair is None:
        return
    cfg, ref, _ = pair
    stats.reset("compress")
    tpc = parallelize_llama(copy.deepcopy(ref), comm.dup(name="tp"), codec="bf16", min_bytes=0)
    tok = torch.randint(0, cfg.vocab, (B, S), generator=g)
    tgt = torch.randint(0, cfg.vocab, (B, S), generator=g)
    lr, lc = ref.loss(tok, tgt), tpc.loss(tok, tgt)
    lc.backward()
    rel = abs(lc.item() - lr.item()) / abs(lr.item())
    assert rel < 1e-2, f"bf16 tp loss {lc.item()} vs {lr.item()}: relative {rel:.2e} >= 1e-2"
    with torch.no_grad():  # the loss is exact on the compressed model's own logits (gathered uncompressed)
        own = gather_from_tp_region(tpc.head(tpc.norm(tpc.hidden_states(tok))), comm, cfg.vocab)
        _close(lc.detach(), F.cross_entropy(own.flatten(0, 1), tgt.flatten()),
               "bf16 tp loss vs the exact cross-entropy of its own logits (a codec on the loss's reductions)")
    if p > 1:
        c = stats.snapshot("compress")["tp"]
        assert c["calls"] > 0 and c["wire"] < c["raw"], f"tp compression counters {c}"


def check_refuses_bad_sizes(comm):
    """Heads or kv heads that do not divide tp, sequence parallelism and MoE with tp: ValueErrors that name
    the value and the fix."""
    for heads, kv, tp, word in ((6, 3, 2, "kv_heads = 3"), (4, 2, 3, "heads = 4"), (6, 6, 4, "heads = 6")):
        try:
            split_heads(heads, kv, tp)
        except ValueError as exc:
            assert word in str(exc) and f"tp size {tp}" in str(exc) and "choose tp from" in str(exc), exc
        else:
            raise AssertionError(f"heads {heads}, kv {kv} at tp {tp} accepted")
    for cfg, word in ((LlamaConfig(heads=4, sequence_parallel="fpdt"), "fpdt"),
                      (LlamaConfig(heads=4, ffn="moe"), "moe"), (LlamaConfig(heads=4, vocab=1), "vocab = 1")):
        try:
            validate_tensor_parallel(cfg, 2)
        except ValueError as exc:
            assert word in str(exc), exc
        else:
            raise AssertionError(f"{cfg} accepted at tp 2")
    if comm.size in (2, 3):
        bad = LlamaConfig(layers=1, hidden=48, heads=6, kv_heads=3 if comm.size == 2 else 2,
                          vocab=17)
        try:
            parallelize_llama(Llama(bad), comm)
        except ValueError as exc:
            assert "kv_heads" in str(exc), exc
        else:
            raise AssertionError(f"kv_heads {bad.kv_heads} accepted at tp {comm.size}")
        _, _, sp = _llama_pair(comm, sequence_parallel=True)
        try:
            sp.loss(torch.zeros(1, 3 * comm.size + 1, dtype=torch.long), torch.zeros(1, 3 * comm.size + 1,
                                                                                     dtype=torch.long))
        except ValueError as exc:
            assert f"sequence length {3 * comm.size + 1}" in str(exc) and "pad it to" in str(exc), exc
        else:
            raise AssertionError("a sequence that does not divide by tp was accepted under sequence parallelism")


# ------------------------------------------------------------------------------------------- loom train
TRAIN = {
    "model": {"layers": 2, "hidden": 48, "heads": 6, "kv_heads": 3, "vocab": 256},
    "data": {"seq_len": 16, "batch": 4, "max_bytes": 60_000},
    "train": {"steps": 4, "dtype": "float64", "eval_every": 2, "eval_batches": 1, "progress": "none",
              "plots": False},
    "optim": {"warmup": 2, "lr": 1e-2, "grad_clip": 0.5},
    "checkpoint": {"every": 0},
}
_DIR = SharedDir("loom-tp-")
_tmp = _DIR.path


def _train_meshes(p: int) -> list[dict]:
    kv = {"model": {"kv_heads": 2}} if p == 2 else {}
    tp = p if p in (2, 3) else 2
    several_kv = {"heads": 4 * tp, "kv_heads": 2 * tp}  # two kv heads per tp rank: heads 8, kv 4 at tp = 2
    if p in (2, 3):
        return [{"mesh": {"tp": p}, "model": several_kv},
                {"mesh": {"tp": p}, "model": {**kv.get("model", {}), "ffn": "gelu", "vocab": 257}},
                {**kv, "mesh": {"tp": p, "tp_sequence_parallel": True}, "data": {"seq_len": 18 if p == 3 else 16}}]
    if p == 4:
        kv = {"model": {"kv_heads": 2}}
        return [{**kv, "mesh": {"dp": 2, "tp": 2}}, {**kv, "mesh": {"dp": 2, "tp": 2}, "zero": {"stage": 1}},
                {**kv, "mesh": {"dp": 2, "tp": 2}, "zero": {"stage": 2}},
                {**kv, "mesh": {"dp": 2, "tp": 2}, "zero": {"stage": 3, "bucket_mb": 0.01}},
                {"mesh": {"sp": 2, "tp": 2}, "model": {"heads": 4, "kv_heads": 2}},  # Ulysses: 1 kv head, 2 sp
                {"mesh": {"pp": 2, "tp": 2}, "data": {"micro_batches": 2}, "model": several_kv},
                {**kv, "mesh": {"pp": 2, "tp": 2, "tp_sequence_parallel": True}, "data": {"micro_batches": 2},
                 "mesh_schedule": "gpipe"}]
    return []


def check_train_tp_matches_one_rank(comm):
    """loom train at tp (with Megatron-SP; dp x tp, ZeRO-1 over dp; Ulysses sp x tp; pp x tp, 1F1B and GPipe
    with Megatron-SP; one and two kv heads per tp rank, heads 8 / kv 4 at tp = 2): losses, eval losses,
    clipped gradient norms and every parameter equal the one-rank run (fp64, 1e-9); a clipped step is among
    them (grad_clip 0.5); every axis of the mesh moved bytes. dp x tp at ZeRO-1 reduce-scatters over dp (its
    clip sums the tp-split elements of its blocks over tp, the replicated ones once) and sends stage 0's dp
    bytes within 2 % (DDP's bytes, not an allreduce's plus an allgather's 1.5x)."""
    import math

    from loom.train.trainer import Trainer

    dp_bytes = {}  # dp x tp, by ZeRO stage 0-1
    for extra in _train_meshes(comm.size):
        solo = comm.split(comm.rank, 0, name="solo")
        keep = {k: v for k, v in extra.items() if k not in ("mesh", "zero", "mesh_schedule")}
        ref = Trainer(train_config(TRAIN, keep), solo, out=_tmp(comm, f"ref{comm.rank}"), quiet=True)
        ref_recs = ref.run()
        tr = Trainer(train_config(TRAIN, extra), comm, out=_tmp(comm, "tp"), quiet=True)
        assert tr.model.tp.sequence_parallel == extra["mesh"].get("tp_sequence_parallel", False)
        recs = tr.run()
        assert any(q["grad_norm"] > 0.5 for q in ref_recs), "no step clipped: the tp norm is not tested"
        for r, q in zip(recs, ref_recs, strict=True):
            for k in ("loss", "eval_loss", "grad_norm"):
                if q[k] is not None:
                    assert math.isclose(r[k], q[k], rel_tol=1e-9, abs_tol=1e-9), (extra, k, r["step"], r[k], q[k])
        for axis, n in extra["mesh"].items():
            if isinstance(n, int) and not isinstance(n, bool) and n > 1:
                assert recs[-1]["bytes"].get(axis, {}).get("wire", 0) > 0, (extra, axis, recs[-1]["bytes"])
        stage = extra.get("zero", {}).get("stage", 0)
        if extra["mesh"].get("dp", 1) > 1 and stage <= 1:
            assert stage == 0 or tr._zero1_rs and tr.opt.reduce, extra
            dp_bytes[stage] = recs[-1]["bytes"]["dp"]["wire"]
        named = dict(ref.model.named_parameters())
        mine = tr.full_parameters() if tr.sdp is not None else dict(tr.model.named_parameters())  # ZeRO: gathered
        assert tr.param_names, "this rank trains no parameters"
        for n in tr.param_names:  # under a pipeline: this rank's stage
            err = float((mine[n].detach() - tr._my_shard(n, named[n].detach()).to(mine[n].device)).abs().max())
            assert err < 1e-9, (extra, n, err)
    if dp_bytes:
        assert abs(dp_bytes[1] - dp_bytes[0]) <= 0.02 * dp_bytes[0], dp_bytes


def _packed_meshes(p: int) -> list[dict]:
    kv = {"model": {"kv_heads": 2}}
    if p == 2:
        return [{**kv, "mesh": {"tp": 2}}, {**kv, "mesh": {"tp": 2, "tp_sequence_parallel": True}}]
    if p == 3:
        return [{"mesh": {"tp": 3, "tp_sequence_parallel": True}}]
    if p == 4:
        return [{**kv, "mesh": {"dp": 2, "tp": 2}},
                {"mesh": {"sp": 2, "tp": 2}, "model": {"heads": 4, "kv_heads": 2}},
                {**kv, "mesh": {"pp": 2, "tp": 2}, "data": {"micro_batches": 2}},
                {**kv, "mesh": {"pp": 2, "tp": 2, "tp_sequence_parallel": True}, "data": {"micro_batches": 2},
                 "mesh_schedule": "gpipe"}]
    return []


def check_train_tp_packed_matches_one_rank(comm):
    """Packed documents (``data.pack``, uneven documents: rows and micro-batches of different real-target counts)
    under tp (with Megatron-SP, whose attention and RoPE see the gathered sequence's document ids and
    positions; dp x tp; Ulysses sp x tp; pp x tp, 1F1B and GPipe with Megatron-SP): losses, eval losses,
    gradient norms and every parameter equal the one-rank run (fp64, 1e-9)."""
    import math

    from loom.train.trainer import Trainer

    meshes = _packed_meshes(comm.size)
    if not meshes:
        return
    docs = _tmp(comm, "docs")
    data = comm.bcast_object(uneven_documents(docs) if comm.rank == 0 else None)
    base = {**TRAIN, "data": {**data, "seq_len": 36, "batch": 4}, "train": {**TRAIN["train"], "steps": 2}}
    for k, extra in enumerate(meshes):
        solo = comm.split(comm.rank, 0, name="solo")
        keep = {key: v for key, v in extra.items() if key not in ("mesh", "mesh_schedule")}
        ref = Trainer(train_config(base, keep), solo, out=_tmp(comm, f"pref{k}-{comm.rank}"), quiet=True)
        want = ref.run()
        tr = Trainer(train_config(base, extra), comm, out=_tmp(comm, f"ptp{k}"), quiet=True)
        got = tr.run()
        for r, q in zip(got, want, strict=True):
            for key in ("loss", "eval_loss", "grad_norm"):
                if q[key] is not None:
                    assert math.isclose(r[key], q[key], rel_tol=1e-9, abs_tol=1e-9), (extra, key, r[key], q[key])
        named, mine = dict(ref.model.named_parameters()), dict(tr.model.named_parameters())
        assert tr.param_names, "this rank trains no parameters"
        for n in tr.param_names:  # under a pipeline: this rank's stage
            err = float((mine[n].detach() - tr._my_shard(n, named[n].detach())).abs().max())
            assert err < 1e-9, (extra, n, err)


def check_train_tp_resume_is_bit_exact(comm):
    """Checkpoints gather the tp slices into whole tensors; --resume slices them again: a run stopped after
    step 2 and resumed ends bit for bit where the uninterrupted one does (fp32; uneven vocabulary at tp 2-3,
    at 4 ranks ZeRO-1 over dp in dp x tp (the unsharded optimizer state's moments gathered over dp and tp),
    ZeRO-3 over dp in dp x tp (one directory of shard files per tp rank) and pp x tp with Megatron-SP (one file
    per stage, its slices gathered over tp))."""
    from loom.train.trainer import Trainer

    meshes = _train_meshes(comm.size)
    if not meshes:
        return
    for k, mesh in enumerate(meshes[-1:] if comm.size < 4 else [meshes[1], meshes[3], meshes[-1]]):
        extra = {**mesh, "train": {"dtype": "float32"}, "checkpoint": {"every": 2}}
        full = Trainer(train_config(TRAIN, extra), comm, out=_tmp(comm, f"full{k}"), quiet=True)
        full.run()
        cut = Trainer(train_config(TRAIN, extra), comm, out=_tmp(comm, f"cut{k}"), quiet=True)
        cut.run(until=2)
        again = Trainer(train_config(TRAIN, extra), comm, out=_tmp(comm, f"cut{k}"), quiet=True, resume=True)
        assert again.start_step == 2
        again.run()
        a, b = full.full_parameters(), again.full_parameters()
        for n in a:
            assert torch.equal(a[n], b[n]), f"{n} differs after resume ({mesh})"


def check_train_tp_compressed_loss_within_1_percent(comm):
    """compress.policy = hybrid sends the tp activations as bf16: the loss curve stays within 1 % of the
    uncompressed one and the tp counters show fewer bytes on the wire than raw."""
    from loom.train.trainer import Trainer

    meshes = _train_meshes(comm.size)
    if comm.size not in (2, 3):
        return
    extra = {**meshes[0], "train": {"dtype": "float32"}}
    plain = Trainer(train_config(TRAIN, extra), comm, out=_tmp(comm, "plain"), quiet=True).run()
    comp = {**extra, "compress": {"policy": "hybrid", "min_kb": 0}}
    recs = Trainer(train_config(TRAIN, comp), comm, out=_tmp(comm, "bf16"), quiet=True).run()
    for r, q in zip(recs, plain, strict=True):
        assert abs(r["loss"] - q["loss"]) <= 0.01 * abs(q["loss"]), (r["step"], r["loss"], q["loss"])
    b = recs[-1]["bytes"]["tp"]
    assert b["wire"] < b["raw"], b


if __name__ == "__main__":
    mpi_checks(globals())
