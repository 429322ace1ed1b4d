"""transformers decoders under loom's sequence parallelism against single-process transformers (run on 1-4 ranks).

Every check builds a tiny random-initialised fp64 model from a config (nothing is downloaded), keeps an
untouched copy as the reference (``attn_implementation="sdpa"``, whole sequence, one process) and compares
the gathered logits, the loss summed over ``sp`` and every parameter's gradient summed over ``sp``.
Tolerance: 1e-10 relative to the largest reference entry (at least 1), fp64.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F

from loom.testing import mpi_checks, seeded
from tests.jobs import SharedDir, tiny_hf_llama, train_config, uneven_documents

TOL = 1e-10
SEQ = 24  # divisible by sp x chunks for sp in (1, 2, 4) and chunks in (1, 3)


def tiny(family: str, kv_heads: int, *, tie: bool = False, layers: int = 2, heads: int = 4):
    """A tiny random-initialised fp64 ``*ForCausalLM`` of ``family`` (same weights on every rank after seeding)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

    kind = {"llama": LlamaConfig, "mistral": MistralConfig, "qwen2": Qwen2Config}[family]
    extra = {"sliding_window": None} if family in ("mistral", "qwen2") else {}
    cfg = kind(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=layers,
               num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=128,
               tie_word_embeddings=tie, attn_implementation="sdpa", **extra)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float64)


def batch(g: torch.Generator, *, packed: bool, b: int = 2, n: int = SEQ, vocab: int = 61):
    """Token ids, labels (some ignored) and position ids (restarting per document when ``packed``)."""
    ids = torch.randint(0, vocab, (b, n), generator=g)
    labels = ids.clone()
    labels[torch.rand(b, n, generator=g) < 0.1] = -100
    pos = torch.arange(n).expand(b, n).clone()
    if packed:
        for row in range(b):
            starts = sorted(set(torch.randint(1, n, (3,), generator=g).tolist()))
            for s in starts:
                pos[row, s:] = torch.arange(n - s)
            labels[row, starts] = -100  # no target across a document boundary (the collator's convention)
    return ids, labels, pos


def reference(model, ids, labels, pos):
    """Single-process logits, mean loss over non-ignored next-token targets (fp64) and parameter gradients."""
    model.zero_grad()
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    shift = F.pad(labels[:, 1:], (0, 1), value=-100)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100)
    loss.backward()
    return logits.detach(), loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def close(name: str, got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    err = (got - want).abs().max().item() / max(1.0, want.abs().max().item())
    assert err <= TOL, f"{name}: error {err:.3g} > {TOL} ({what})"


def compare(comm, family: str, mode: str, kv_heads: int, packed: bool, *, tie: bool = False, heads: int = 4,
            ring: int = 1) -> None:
    from loom.integrations.transformers import SequenceParallel

    g = seeded(comm)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=g)))
    model = tiny(family, kv_heads, tie=tie, heads=heads)
    ref_model = copy.deepcopy(model)
    ids, labels, pos = batch(g, packed=packed)
    ref_logits, ref_loss, ref_grads = reference(ref_model, ids, labels, pos)
    chunks = 3 if mode == "fpdt" else 1
    sp = SequenceParallel(model, comm, mode=mode, chunks=chunks, offload=mode == "fpdt", ring=ring)
    what = f"{family} {mode} sp={comm.size} kv_heads={kv_heads} packed={packed} tie={tie} ring={ring}"
    b = sp.shard(ids, labels=labels, position_ids=pos)
    with torch.no_grad():
        logits = model(**b.inputs).logits
    close("logits", sp.gather(logits), ref_logits, what)
    loss = sp.loss(b)
    loss.backward()
    sp.reduce_gradients()
    total = comm.allreduce(loss.detach().reshape(1))[0]
    close("loss", total, ref_loss, what)
    for k, p in model.named_parameters():
        close(f"grad {k}", p.grad, ref_grads[k], what)
    sp.remove()


def check_llama_ulysses_gqa(comm):
    for kv in (1, 2):  # kv_heads < sp at sp = 2 (kv 1) and sp = 4 (kv 1, 2)
        compare(comm, "llama", "ulysses", kv, packed=False)


def check_llama_fpdt_gqa(comm):
    for kv in (1, 4):
        compare(comm, "llama", "fpdt", kv, packed=False)


def check_packed_documents(comm):
    compare(comm, "llama", "ulysses", 2, packed=True)
    compare(comm, "llama", "fpdt", 1, packed=True)


def check_llama_past_its_heads(comm):
    """2 query heads and 1 kv head over all the sp ranks: Ulysses x ring and FPDT x ring, packed documents."""
    if comm.size < 2:
        return
    compare(comm, "llama", "ulysses", 1, packed=True, heads=2, ring=comm.size // 2 if comm.size > 2 else 2)
    compare(comm, "llama", "fpdt", 1, packed=True, heads=2, ring=comm.size)


def check_qwen2_and_mistral(comm):
    compare(comm, "qwen2", "ulysses", 2, packed=False)
    compare(comm, "qwen2", "fpdt", 2, packed=True)
    compare(comm, "mistral", "fpdt", 1, packed=False, tie=True)
    compare(comm, "mistral", "ulysses", 4, packed=True)


def check_bad_input_names_the_fix(comm):
    from loom.integrations.transformers import SequenceParallel

    model = tiny("llama", 2)
    for kw, needle in (({"mode": "ring"}, "not one of"), ({"mode": "ulysses", "chunks": 2}, "mode='fpdt'")):
        try:
            SequenceParallel(model, comm, **kw)
        except ValueError as exc:
            assert needle in str(exc), exc
        else:
            raise AssertionError(f"{kw} was accepted")
    sp = SequenceParallel(model, comm, mode="fpdt", chunks=5)
    try:
        sp.shard(torch.zeros(1, SEQ, dtype=torch.long))
    except ValueError as exc:
        assert "pad to" in str(exc), exc
    else:
        raise AssertionError("a sequence that does not split into sp x chunks was accepted")
    sp.remove()


def _steps(comm, model, ref, hp, shard, loss_fn, *, what: str, after=None) -> None:
    """Three AdamW steps of ``hp`` (a HybridParallel) against one process on the whole batch: the losses and
    every tensor this rank trains (both copies of a tied weight) must agree."""
    from loom.integrations.transformers import lm_loss, shift_labels

    g = seeded(comm, 7)
    opt = torch.optim.AdamW(hp.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp, m = hp.replicas, hp.micro_batches
    mine = {id(t) for t in hp.parameters()}
    for step in range(3):
        ids, labels, pos = batch(g, packed=False, b=4)
        rows = slice(hp.replica_index * 4 // dp, (hp.replica_index + 1) * 4 // dp)
        opt.zero_grad()
        loss = float(hp.train_step(*shard(ids[rows], labels[rows], pos[rows]), loss_fn))
        if after is not None:
            loss = after(loss)
        ref_opt.zero_grad()
        tgt = shift_labels(labels)
        parts = [lm_loss(ref(input_ids=i, position_ids=p, use_cache=False).logits, t)
                 for i, p, t in zip(ids.chunk(dp * m), pos.chunk(dp * m), tgt.chunk(dp * m))]
        ref_loss = torch.stack(parts).mean()
        ref_loss.backward()
        close(f"loss step {step}", torch.tensor(loss, dtype=torch.float64), ref_loss.detach(), what)
        ref_params = dict(ref.named_parameters())
        for k, t in model.named_parameters():  # AdamW's update hides gradient scale errors: check them here
            if id(t) in mine:
                close(f"grad {k} step {step}", t.grad, ref_params[k].grad, what)
        opt.step()
        ref_opt.step()
    want = ref.state_dict()
    for k, t in model.state_dict(keep_vars=True).items():
        if id(t) in mine:
            close(f"param {k}", t.detach(), want[k], what)


def _seed_model(comm, tie: bool, layers: int = 2):
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=seeded(comm))))
    model = tiny("llama", 2, tie=tie, layers=layers)
    return model, copy.deepcopy(model)


def check_pipeline_two_stages(comm):
    """A 2-stage pipeline (x dp where the ranks allow) of a transformers Llama, untied and tied embeddings."""
    from loom.integrations.transformers import lm_loss, shift_labels
    from loom.parallel.hybrid import HybridParallel

    pp = 2 if comm.size % 2 == 0 else 1
    for tie in (False, True):
        model, ref = _seed_model(comm, tie, layers=3)
        hp = HybridParallel(model, partitions=pp, micro_batches=2, comm=comm)
        if pp > 1:
            assert hp.named_layers()[0] == "embed_tokens" if hp.stage_index == 0 else "lm_head" in hp.named_layers()
        _steps(comm, model, ref, hp, lambda i, lab, p: ((i, p), shift_labels(lab)), lm_loss,
               what=f"pipeline pp={pp} dp={hp.replicas} tie={tie}")
    if pp > 1:  # a sharded wrapper owning the gradients (ZeRO 2-3) would skip the tied copies' sum: refused
        model, _ = _seed_model(comm, True, layers=3)
        try:
            HybridParallel(model, partitions=pp, micro_batches=2, comm=comm, reduce_dp=False)
        except ValueError as exc:
            assert "tied weights" in str(exc) and "ZeRO" in str(exc), str(exc)
        else:
            raise AssertionError("tied weights across stages with reduce_dp=False were accepted")


def check_dp_x_sp_adamw(comm):
    """dp x sp (Ulysses and FPDT) training through HybridParallel for a few AdamW steps equals one process."""
    from loom.comm import Mesh
    from loom.integrations.transformers import SequenceParallel
    from loom.parallel.hybrid import HybridParallel

    sp_size = 2 if comm.size % 2 == 0 else 1
    mesh = Mesh(pp=1, dp=comm.size // sp_size, sp=sp_size, comm=comm)
    for mode, chunks in (("ulysses", 1), ("fpdt", 3)):
        model, ref = _seed_model(comm, tie=mode == "fpdt")
        sp = SequenceParallel(model, mesh["sp"], mode=mode, chunks=chunks)
        hp = HybridParallel(model, partitions=1, mesh=mesh, micro_batches=2)

        def shard(ids, labels, pos, sp=sp):
            b = sp.shard(ids, labels=labels, position_ids=pos)
            return (b.input_ids, b.position_ids), b.shift_labels

        def after(loss, sp=sp):  # gradients: summed over sp once the dp average is done; loss shares summed too
            sp.reduce_gradients()
            return float(mesh["sp"].allreduce_object(loss))

        _steps(comm, model, ref, hp, shard, sp.loss_fn, after=after,
               what=f"dp={hp.replicas} x sp={sp_size} {mode}")


# loom train, packed documents of uneven lengths on a transformers Llama (heads/kv heads in "model"): Ulysses, FPDT
# (offload) and dp; past the heads Ulysses x ring and FPDT x ring (1 query head at sp 2: ring 2; 2 heads at sp 4:
# Ulysses 2 x ring 2, FPDT chunks 3 x ring 2 with a chunk cut at the zig-zag boundary; 1 head: FPDT x ring 4).
HF_PACKED = {
    2: [{"mesh": {"sp": 2}},
        {"mesh": {"sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
        {"mesh": {"dp": 2}},
        {"model": (1, 1), "mesh": {"sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2}}],
    4: [{"mesh": {"sp": 4}, "sequence": {"algorithm": "fpdt", "chunks": 2}},
        {"mesh": {"dp": 2, "sp": 2}},
        {"model": (2, 1), "mesh": {"sp": 4}},
        {"model": (2, 1), "mesh": {"sp": 4}, "sequence": {"algorithm": "fpdt", "chunks": 3, "offload": True}},
        {"model": (1, 1), "mesh": {"sp": 4}, "sequence": {"algorithm": "fpdt", "chunks": 2}}],
}
_DIR = SharedDir("loom-hf-train-")


def check_train_packed_matches_one_rank(comm):
    """``loom train --data.pack=true`` on a transformers Llama: losses, held-out losses and every parameter after
    two AdamW steps equal the one-rank run (transformers' own sdpa, its documents found where the position ids
    restart; that run equals each document alone: tests/unit/test_packing.py), 1e-9 in fp64."""
    import math

    from loom.train.trainer import Trainer

    if comm.size not in HF_PACKED:
        return
    docs = _DIR.path(comm, "docs")
    data = comm.bcast_object(uneven_documents(docs) if comm.rank == 0 else None)
    base = {"data": {**data, "seq_len": 48, "batch": 4},
            "train": {"steps": 2, "dtype": "float64", "eval_every": 2, "eval_batches": 1, "progress": "none",
                      "plots": False}, "optim": {"warmup": 1, "lr": 1e-2}, "checkpoint": {"every": 0}}
    for k, extra in enumerate(HF_PACKED.get(comm.size, [])):
        heads, kv = extra.get("model", (4, 2))
        hf = tiny_hf_llama(comm, _DIR.path(comm, f"llama{heads}-{kv}.json"), heads=heads, kv_heads=kv)
        run = {**extra, "model": {"hf_config": hf}}
        solo = comm.split(comm.rank, 0, name="solo")
        ref = Trainer(train_config(base, {"model": run["model"]}), solo, out=_DIR.path(comm, f"ref{k}-{comm.rank}"),
                      quiet=True)
        want = ref.run()
        tr = Trainer(train_config(base, run), comm, out=_DIR.path(comm, f"mesh{k}"), quiet=True)
        got = tr.run()
        for r, q in zip(got, want, strict=True):
            for key in ("loss", "eval_loss"):
                if q[key] is not None:
                    assert math.isclose(r[key], q[key], rel_tol=1e-9, abs_tol=1e-9), (extra, key, r[key], q[key])
        named = dict(ref.model.named_parameters())
        for n, p in tr.model.named_parameters():
            err = float((p.detach() - named[n].detach()).abs().max())
            assert err < 1e-9, (extra, n, err)
        ring = tr.cfg.mesh.sp_ring
        assert ring == (1 if heads >= tr.cfg.mesh.sp else tr.cfg.mesh.sp // heads), (extra, ring)
    _DIR.remove(comm)


if __name__ == "__main__":
    mpi_checks(globals())
