"""ShardedDataParallel on real ranks: loss and every parameter after several Adam steps equal one process on the
same global batch (fp64: 1e-10) at stages 0-3, with parameter sizes that do not divide by the rank count, a frozen
parameter, a parameter unused in one step on every rank and in another on some ranks only, a raw parameter
of the root module, gradient clipping that clips, and two micro-batches; sharded checkpoints saved at P ranks
and loaded at P' ranks continue the same run; bad input is refused on every rank."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from loom.comm import Mesh
from loom.parallel.data import GradReducer
from loom.parallel.offload import MemoryTracker
from loom.parallel.zero import ShardedDataParallel, reset_zero_stats, zero_stats
from loom.testing import mpi_checks, seeded
from tests.jobs import tiny_hf_llama

TOL = 1e-10
ROWS = 12  # global batch, divisible by 1-4 ranks
STEPS = 4
_SELF: dict[int, object] = {}


class Net(nn.Module):
    """Uneven sizes (7x13, 13x13, 13x5...), a frozen layer, a branch used only when asked, a root parameter."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(7, 13)
        self.blocks = nn.ModuleList([nn.Linear(13, 13) for _ in range(3)])
        self.frozen = nn.Linear(13, 13)
        self.frozen.requires_grad_(False)
        self.sometimes = nn.Linear(13, 11)
        self.back = nn.Linear(11, 13, bias=False)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 13))
        self.head = nn.Linear(13, 5)
        self.register_buffer("shift", torch.linspace(-0.1, 0.1, 5))

    def forward(self, x, use: bool = True):
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        h = self.frozen(h) * self.scale
        if use:
            h = h + self.back(torch.tanh(self.sometimes(h)))
        return self.head(h) + self.shift


def _model(seed: int, dtype=torch.float64) -> Net:
    torch.manual_seed(seed)
    return Net().to(dtype)


def _data(g, steps=STEPS):
    return [(torch.randn(ROWS, 7, generator=g, dtype=torch.float64),
             torch.randn(ROWS, 5, generator=g, dtype=torch.float64)) for _ in range(steps)]


def _uses(step: int, rank: int) -> bool:
    """Step 1: nobody uses the branch; step 2: only even ranks do (DDP's "None on some ranks")."""
    return not (step == 1 or step == 2 and rank % 2)


def _local_loss(model, x, y, rank, size, step, micro=1):
    rows = ROWS // size
    xs, ys = x[rank * rows:(rank + 1) * rows], y[rank * rows:(rank + 1) * rows]
    losses = []
    for xm, ym in zip(xs.chunk(micro), ys.chunk(micro)):
        loss = ((model(xm, _uses(step, rank)) - ym) ** 2).sum() / ys.numel()  # chunks may be uneven
        loss.backward()
        losses.append(loss.detach())
    return sum(losses)


def _reference(seed, data, size, *, max_norm, steps_from=0, model=None, opt=None):
    """One process: the mean over the virtual ranks' local losses (each with its own branch use)."""
    model = model or _model(seed)
    params = [p for p in model.parameters() if p.requires_grad]
    if opt is None:
        for p in params:
            p.grad = torch.zeros_like(p)  # a missing gradient counts as zero, as in the flat shard
        opt = torch.optim.Adam(params, lr=0.05)
    losses = []
    for step, (x, y) in enumerate(data, start=steps_from):
        opt.zero_grad(set_to_none=False)
        total = 0.0
        for r in range(size):
            rows = ROWS // size
            xr, yr = x[r * rows:(r + 1) * rows], y[r * rows:(r + 1) * rows]
            loss = ((model(xr, _uses(step, r)) - yr) ** 2).mean() / size
            loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        losses.append(total)
    return model, opt, losses


def _train(sdp, opt, data, comm, *, max_norm, steps_from=0, micro=1):
    losses = []
    for step, (x, y) in enumerate(data, start=steps_from):
        loss = _local_loss(sdp, x, y, comm.rank, comm.size, step, micro)
        sdp.step(opt, max_norm=max_norm)
        losses.append(comm.allreduce(loss.reshape(1), op="avg").item())
    return losses


def _assert_state_equal(got, want, what):
    assert got.keys() == want.keys(), (what, sorted(set(got) ^ set(want)))
    for k in want:
        err = (got[k].double() - want[k].double()).abs().max().item() if want[k].numel() else 0.0
        assert err < TOL, f"{what}: {k} differs by {err:.3g}"


def _replicas_agree(comm, model, what):
    for name, t in [*model.named_parameters(), *model.named_buffers()]:  # a stage-3 module's state_dict() raises
        if t.stride() and 0 in t.stride():
            continue  # a stage-3 placeholder: the value lives in the shards
        ts = comm.allgather(t.detach().reshape(1, -1).clone())
        assert bool((ts == ts[0]).all()), f"{what}: replicas diverged on {name}"


class Tower(nn.Module):
    """Only torch layers initialised by their own ``reset_parameters`` (what a meta build replays): uneven
    widths, a LayerNorm, a frozen layer, a BatchNorm's buffers; built in fp64 so no cast follows the init."""

    def __init__(self, width: int = 13, depth: int = 3):
        super().__init__()
        kw = {"dtype": torch.float64}
        self.inp = nn.Linear(7, width, **kw)
        self.norm = nn.LayerNorm(width, **kw)
        self.blocks = nn.ModuleList([nn.Linear(width, width, **kw) for _ in range(depth)])
        self.frozen = nn.Linear(width, width, **kw)
        self.frozen.requires_grad_(False)
        self.bn = nn.BatchNorm1d(width, **kw)
        self.head = nn.Linear(width, 5, **kw)

    def forward(self, x):
        h = self.norm(torch.tanh(self.inp(x)))
        for b in self.blocks:
            h = h + torch.tanh(b(h))
        return self.head(self.bn(self.frozen(h)))


def _built(make: Callable[[], nn.Module], seed: int, meta: bool) -> nn.Module:
    """``make()`` after seeding (torch's default dtype fp64, so a name-based init fills fp64 directly)."""
    torch.manual_seed(seed)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        with torch.device("meta") if meta else contextlib.nullcontext():
            model = make()
    finally:
        torch.set_default_dtype(old)
    assert all(t.is_meta for t in model.parameters()) == meta, f"{type(model).__name__}: not built on meta"
    return model


def _meta_cases():
    from loom.models.llama import Llama, LlamaConfig

    cfg = LlamaConfig(layers=2, hidden=16, heads=4, kv_heads=2, vocab=31, tie_embeddings=True)
    tokens = torch.arange(4 * 6).reshape(4, 6) % cfg.vocab
    # (what, make, keep, loss, whether the init replays torch's stream: then it must end where a plain build's
    # does; Llama's init is by name, while its plain build also draws for the layers' own default init)
    return [("torch layers", Tower, lambda m: [],
             lambda sdp, m, r, g: ((sdp(torch.randn(6, 7, generator=g, dtype=torch.float64)) - 1) ** 2).mean(), True),
            ("llama", lambda: Llama(cfg), lambda m: [m.head],
             lambda sdp, m, r, g: sdp.call(m.loss, (tokens + r) % cfg.vocab, (tokens + r + 1) % cfg.vocab), False)]


def check_stage3_meta_build_equals_plain_build(comm):
    """Stage 3 over a model built on the meta device (materialised bucket by bucket) equals stage 3 over the
    same model built for real from the same seed: every tensor exactly, torch's random stream (when the init
    replays it) left where the plain build leaves it, and two Adam steps (fp64) to 1e-10."""
    seed = int(torch.randint(0, 2**30, (1,), generator=seeded(comm, 40)))
    for what, make, keep, loss_fn, replays in _meta_cases():
        runs = []
        for meta in (False, True):
            model = _built(make, seed, meta)
            sdp = ShardedDataParallel(model, comm, stage=3, bucket_mb=0.002, keep=keep(model))
            after = torch.rand(3)
            state = sdp.state_dict()
            opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
            g = torch.Generator().manual_seed(seed + comm.rank)
            for _ in range(2):
                loss_fn(sdp, model, comm.rank, g).backward()
                sdp.step(opt, max_norm=0.5)
            runs.append((state, after, sdp.state_dict(), len(sdp.buckets)))
        (plain, r0, trained0, nb), (got, r1, trained1, _) = runs
        assert nb > 2, f"{what}: {nb} buckets; the check needs several"
        assert plain.keys() == got.keys(), (what, sorted(set(plain) ^ set(got)))
        bad = [k for k in plain if not torch.equal(plain[k], got[k])]
        assert not bad, f"{what} at {comm.size} ranks: the meta build differs from the plain one at {bad[:4]}"
        assert torch.equal(r0, r1) or not replays, f"{what}: torch's random stream differs after construction"
        _assert_state_equal(trained1, trained0, f"{what}: 2 steps after a meta build")


def check_stage3_meta_build_holds_shards_not_the_model(comm):
    """Constructing stage 3 over a meta model (16 layers, one bucket each) allocates the shards, the replicated
    state (a frozen layer, norms' buffers) and at most about two buckets more (the bucket materialised and one
    module replayed in flight): under half the model's bytes at 4 ranks."""
    make = lambda: Tower(width=48, depth=16)  # noqa: E731
    model = _built(make, 5, meta=True)
    total = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
    with MemoryTracker() as mem:
        sdp = ShardedDataParallel(model, comm, stage=3, bucket_mb=0.015)
    shards = sum(sh.numel() * sh.element_size() for sh in sdp.shards)
    bucket = max(b.numel for b in sdp.buckets) * 8
    replicated = total - sum(b.numel for b in sdp.buckets) * 8
    assert len(sdp.buckets) >= 16 and bucket < total / 12, (len(sdp.buckets), bucket, total)
    assert mem.current >= shards, (mem.current, shards)
    assert mem.peak <= shards + replicated + 2 * bucket, (
        f"construction peaked at {mem.peak} bytes at {comm.size} ranks (model {total}, shards {shards}, "
        f"replicated {replicated}, largest bucket {bucket}): more than the shards and about one bucket")
    if comm.size == 4:
        assert mem.peak < total / 2, (mem.peak, total)
    if comm.rank == 0:
        print(f"  meta stage-3 construction at {comm.size} ranks: peak {mem.peak} B = "
              f"{mem.peak / total:.3f} of the model's {total} B (shards {shards} B)", flush=True)


def _run_stage(comm, stage, *, micro=1, bucket_mb=0.0015, max_norm=0.3):
    g = seeded(comm, 10 + stage)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = _data(g)
    ref, _, ref_losses = _reference(seed, data, comm.size, max_norm=max_norm)
    sdp = ShardedDataParallel(_model(seed), comm, stage=stage, bucket_mb=bucket_mb, micro_batches=micro)
    opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
    losses = _train(sdp, opt, data, comm, max_norm=max_norm, micro=micro)
    for a, b in zip(losses, ref_losses):
        assert abs(a - b) < TOL, f"stage {stage}: loss {a} != one process {b}"
    _assert_state_equal(sdp.state_dict(), ref.state_dict(), f"stage {stage} at {comm.size} ranks")
    _replicas_agree(comm, sdp.module, f"stage {stage}")
    return sdp


def check_stage0_plain_dp_equals_one_process(comm):
    _run_stage(comm, 0)


def check_stage1_equals_one_process(comm):
    sdp = _run_stage(comm, 1)
    assert len(sdp.buckets) > 3, "the test must exercise several buckets"


def check_stage2_equals_one_process(comm):
    _run_stage(comm, 2)


def check_stage3_equals_one_process(comm):
    reset_zero_stats()
    _run_stage(comm, 3)
    st = zero_stats()
    assert st["gathers"] > 0 and st["reduce_scatters"] > 0


def check_stage3_one_bucket_and_micro_batches(comm):
    _run_stage(comm, 3, bucket_mb=64, micro=2)
    _run_stage(comm, 2, micro=2)


def check_stage3_frees_parameters_between_uses(comm):
    sdp = ShardedDataParallel(_model(3), comm, stage=3, bucket_mb=0.0015)
    sizes = []
    sdp.module.blocks[1].register_forward_hook(
        lambda m, a, o: sizes.append(sum(b.full is not None for b in sdp.buckets)))
    out = sdp(torch.randn(4, 7, dtype=torch.float64))
    assert sizes and sizes[0] < len(sdp.buckets) // 2 + 2, (sizes, len(sdp.buckets))
    assert sum(b.full is not None for b in sdp.buckets) <= 1  # only the last bucket, kept for backward
    out.sum().backward()
    sdp.sync_grads()
    assert all(b.full is None for b in sdp.buckets)
    assert all(p.grad is None for b in sdp.buckets for p in b.params)


def check_sharded_checkpoint_reshards(comm):
    """Save at P = world ranks after 2 steps, load at P' in {1, 2, ...} and continue: equals the uninterrupted run."""
    g = seeded(comm, 77)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = _data(g, 4)
    d = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero-") if comm.rank == 0 else None)
    sdp = ShardedDataParallel(_model(seed), comm, stage=3, bucket_mb=0.0015)
    opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
    _train(sdp, opt, data[:2], comm, max_norm=0.3)
    sdp.save_sharded(d, opt, extra={"step": 2})
    full_before = sdp.state_dict()
    _train(sdp, opt, data[2:], comm, max_norm=0.3, steps_from=3)  # from step 3 on every rank uses the branch
    want = sdp.state_dict()
    for sub_size in sorted({1, 2, comm.size} - {0}):
        if sub_size > comm.size:
            continue
        sub = comm.split(comm.rank // sub_size, name=f"zero{sub_size}")
        for stage in (1, 3):
            part = ShardedDataParallel(_model(seed + 1), sub, stage=stage, bucket_mb=0.0015)
            popt = torch.optim.Adam(part.parameters(), lr=0.05)
            extra = part.load_sharded(d, popt)
            assert extra == {"step": 2}
            _assert_state_equal(part.state_dict(), full_before, f"loaded at {sub_size} of {comm.size}")
            _train(part, popt, data[2:], sub, max_norm=0.3, steps_from=3)
            _assert_state_equal(part.state_dict(), want, f"continued at {sub_size} of {comm.size}, stage {stage}")
        sub.free()


def check_full_state_dict_round_trip(comm):
    sdp = ShardedDataParallel(_model(5), comm, stage=3, bucket_mb=0.0015)
    want = _model(6).state_dict()
    sdp.load_state_dict(want)
    _assert_state_equal(sdp.state_dict(), want, "load_state_dict/state_dict")


def check_mesh_groups(comm):
    """dp x sp: the group is the flattened pair; a stage-3 run over it equals one process."""
    if comm.size % 2:
        return
    mesh = Mesh(dp=comm.size // 2, sp=2, comm=comm)
    g = seeded(comm, 3)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = _data(g)
    ref, _, _ = _reference(seed, data, comm.size, max_norm=0.3)
    sdp = ShardedDataParallel(_model(seed), mesh, stage=3, axes=["dp", "sp"], bucket_mb=0.0015)
    assert sdp.comm.size == comm.size
    opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
    _train(sdp, opt, data, sdp.comm, max_norm=0.3)
    _assert_state_equal(sdp.state_dict(), ref.state_dict(), "dp x sp")


def check_bf16_compute_with_fp32_master(comm):
    g = seeded(comm, 9)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = [(x.float(), y.float()) for x, y in _data(g)]
    ref, _, ref_losses = _reference(seed, [(x.double(), y.double()) for x, y in data], comm.size, max_norm=0.3)
    for stage in (2, 3):
        sdp = ShardedDataParallel(_model(seed, torch.float32), comm, stage=stage, compute_dtype=torch.bfloat16)
        assert all(sh.dtype == torch.float32 for sh in sdp.shards)
        opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
        losses = []
        for step, (x, y) in enumerate(data):
            rows = ROWS // comm.size
            xs, ys = x[comm.rank * rows:][:rows].bfloat16(), y[comm.rank * rows:][:rows]
            loss = ((sdp(xs, _uses(step, comm.rank)).float() - ys) ** 2).mean()
            loss.backward()
            sdp.step(opt, max_norm=0.3)
            losses.append(comm.allreduce(loss.detach().reshape(1), op="avg").item())
        assert all(abs(a - b) < 0.05 * abs(b) + 0.02 for a, b in zip(losses, ref_losses)), (losses, ref_losses)


def check_compressed_resume_is_bit_exact(comm):
    """hybrid policy (int4 + error feedback on the reduce-scatter, int8 on the stage-3 gathers): training
    stays near the exact run, the residuals are non-zero, and a run resumed from a sharded checkpoint at
    the same size equals the uninterrupted one bit for bit (the residuals travel in the checkpoint)."""
    g = seeded(comm, 21)
    seed = int(torch.randint(0, 2**30, (1,), generator=g))
    data = [(x.float(), y.float()) for x, y in _data(g, 5)]
    d = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero-ef-") if comm.rank == 0 else None)
    for stage in (2, 3):
        exact = ShardedDataParallel(_model(seed, torch.float32), comm, stage=stage, bucket_mb=0.0015)
        eopt = torch.optim.Adam(exact.parameters(), lr=0.05)
        want = _train(exact, eopt, data, comm, max_norm=0.3, steps_from=3)
        runs = []
        for resume in (False, True):
            sdp = ShardedDataParallel(_model(seed, torch.float32), comm, stage=stage, bucket_mb=0.0015,
                                      compress="hybrid")
            opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
            losses = _train(sdp, opt, data[:2], comm, max_norm=0.3, steps_from=3)
            if resume:
                sdp.save_sharded(d, opt)
                sdp = ShardedDataParallel(_model(seed + 5, torch.float32), comm, stage=stage, bucket_mb=0.0015,
                                          compress="hybrid")
                opt = torch.optim.Adam(sdp.parameters(), lr=0.05)
                sdp.load_sharded(d, opt)
            losses += _train(sdp, opt, data[2:], comm, max_norm=0.3, steps_from=5)
            runs.append((losses, sdp.state_dict()))
            if comm.size > 1:
                assert sdp.error_feedback is not None and sdp.error_feedback.norm() > 0
        assert runs[0][0] == runs[1][0], ("resume changed the losses", runs[0][0], runs[1][0])
        for k, v in runs[0][1].items():
            assert torch.equal(v, runs[1][1][k]), f"stage {stage}: resume changed {k}"
        assert all(abs(a - b) < 0.1 * abs(b) + 0.05 for a, b in zip(runs[0][0], want)), (runs[0][0], want)


TRAIN = {"model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2},
         "data": {"seq_len": 32, "batch": 12, "max_bytes": 60_000},
         "train": {"steps": 4, "dtype": "float64", "eval_every": 0, "progress": "none", "plots": False},
         "optim": {"warmup": 2, "lr": 1e-2}, "checkpoint": {"every": 2, "keep": 3}}
TRAIN_MESHES = {1: [{"mesh": {"dp": 1}}], 2: [{"mesh": {"dp": 2}}, {"mesh": {"sp": 2}, "zero": {"axes": ["dp", "sp"]}}],
                3: [{"mesh": {"dp": 3}}],
                4: [{"mesh": {"dp": 2, "sp": 2}, "zero": {"axes": ["dp", "sp"]}},
                    {"mesh": {"dp": 2, "pp": 2}, "data": {"micro_batches": 2}}]}


def _train_cfg(*parts):
    from loom.train.config import config_from_dict

    data: dict = {}
    for part in parts:
        for sec, vals in part.items():
            data.setdefault(sec, {}).update(vals)
    return config_from_dict(data)


CLIP = {"optim": {"grad_clip": 0.3}}  # below the first steps' norms: the stage-1 clip (on blocks) is exercised


def check_train_zero_stage1_matches_stage0_and_reshards_on_resume(comm):
    """loom train with [zero] stage = 1 equals stage 0 and the one-rank run on every mesh (fp64, 1e-9: losses,
    clipped gradient norms, parameters; a clipped step among them) and, where dp > 1 and the ZeRO group is dp
    (dp alone, and dp x pp, where HybridParallel leaves the dp reduction to the reduce-scatter), sends stage 0's
    dp bytes within 2 % (a reduce-scatter and an allgather: DDP's bytes, not an allreduce's 1.5x); a run resumed
    at dp = 1 from its checkpoint continues the P-rank run (the optimizer state is saved unsharded and
    resharded). dp x tp: tests/mpi/check_tensor.py."""
    import shutil

    from loom.train.trainer import Trainer

    root = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero-train-") if comm.rank == 0 else None)
    solo = comm.split(comm.rank, name="solo")
    meshes = list(TRAIN_MESHES[comm.size])
    hf = tiny_hf_llama(comm, f"{root}/tied.json", tie=True) if comm.size == 4 else None
    if hf is not None:  # embedding and head tied across the stages: summed there, counted once in the norm
        meshes.append({"mesh": {"dp": 2, "pp": 2}, "data": {"micro_batches": 2}, "model": {"hf_config": hf}})
    for i, extra in enumerate(meshes):
        runs = {}
        for stage in (0, 1):
            zero = {"zero": {**extra.get("zero", {}), "stage": stage}}
            threaded = stage == 0 and comm.size > 1 and extra["mesh"] == {"dp": comm.size}
            if threaded:  # --zero.progress reaches data parallel's reducer
                zero["zero"]["progress"] = "thread"
            tr = Trainer(_train_cfg(TRAIN, CLIP, extra, zero), comm, out=f"{root}/m{i}s{stage}", quiet=True)
            assert stage == 0 or type(tr.opt).__name__ == "ShardedOptimizer"
            assert stage == 0 or tr._zero1_rs and tr.opt.reduce, extra  # the reduce-scatter path on every mesh
            assert not threaded or tr.reducer.progress == "thread", tr.reducer.progress
            trained = set(tr.param_names)  # under pp this rank's stage (a transformers model is built whole)
            runs[stage] = (tr.run(), {n: p.detach().clone() for n, p in tr.model.named_parameters() if n in trained})
        if i == 0:
            first = runs[1][0]  # the run whose step-2 checkpoint is resumed below
        keep = {k: v for k, v in extra.items() if k not in ("mesh", "zero")}
        ref = Trainer(_train_cfg(TRAIN, CLIP, keep), solo, out=f"{root}/ref{i}r{comm.rank}", quiet=True)
        ref_recs = ref.run()
        assert any(q["grad_norm"] > CLIP["optim"]["grad_clip"] for q in ref_recs), "no step clipped"
        for a, b, q in zip(runs[0][0], runs[1][0], ref_recs, strict=True):
            assert abs(a["loss"] - b["loss"]) < 1e-9, (extra, a["loss"], b["loss"])
            for k in ("loss", "grad_norm"):
                assert abs(b[k] - q[k]) < 1e-9 * max(1.0, abs(q[k])), (extra, k, b["step"], b[k], q[k])
        if comm.size > 1 and extra["mesh"].get("dp", 1) > 1 and extra.get("zero", {}).get("axes", ["dp"]) == ["dp"]:
            b0, b1 = (r[0][-1]["bytes"]["dp"]["wire"] for r in (runs[0], runs[1]))  # DDP's bytes, not 1.5x
            assert abs(b1 - b0) <= 0.02 * b0, (extra, b0, b1)
        want = dict(ref.model.named_parameters())
        for n, t in runs[0][1].items():
            if t.is_meta:  # under pp a rank materialises only its own stage; the other stages stay on meta
                assert runs[1][1][n].is_meta, (extra, n)
                continue
            assert (t - runs[1][1][n]).abs().max() < 1e-9, (extra, n, (t - runs[1][1][n]).abs().max())
            assert (want[n].detach() - runs[1][1][n]).abs().max() < 1e-9, (
                extra, n, (want[n].detach() - runs[1][1][n]).abs().max())
    if "pp" in meshes[0].get("mesh", {}):
        return
    # resume the first mesh's stage-1 run at dp = 1 from its step-2 checkpoint: steps 3-4 equal the P-rank run's
    src = f"{root}/m0s1"
    mine = f"{root}/solo{comm.rank}"
    shutil.copytree(f"{src}/checkpoints", f"{mine}/checkpoints")
    for f in Path(mine, "checkpoints").glob("step_000004*"):
        f.unlink()
    tr = Trainer(_train_cfg(TRAIN, CLIP, {"zero": {"stage": 1}}), solo, out=mine, resume=True, quiet=True)
    assert tr.start_step == 2, tr.start_step
    recs = tr.run()
    for a, b in zip(recs, first[2:], strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-9 * max(1.0, abs(b["loss"])), (a["loss"], b["loss"])


FPDT = {"sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}}
PIPE = {"data": {"micro_batches": 2}}
ZERO_MESHES = {1: [{"mesh": {"dp": 1}}], 2: [{"mesh": {"dp": 2}}, {"mesh": {"pp": 2}, **PIPE}],
               3: [{"mesh": {"dp": 3}}],
               4: [{"mesh": {"dp": 2, "sp": 2}, "zero": {"axes": ["dp", "sp"]}, **FPDT},
                   {"mesh": {"dp": 2, "sp": 2}, "zero": {"axes": ["dp"]}},
                   {"mesh": {"dp": 2, "pp": 2}, **PIPE},
                   # dp = 1 here, the ZeRO group spans sp; the 8-rank launch has every axis > 1
                   {"mesh": {"pp": 2, "sp": 2}, "zero": {"axes": ["dp", "sp"]}, **PIPE, **FPDT}],
               8: [{"mesh": {"dp": 2, "pp": 2, "sp": 2}, "zero": {"axes": ["dp", "sp"]}, **PIPE, **FPDT}]}
SMALL_BUCKETS = {"bucket_mb": 0.0002}  # a bucket per module: stage 3 gathers and frees each (the head apart)


def _full_params(tr) -> dict[str, torch.Tensor]:
    """This rank's trained parameters, whole (collective under ZeRO 2-3: the shards are gathered)."""
    return tr.full_parameters()


def _zero_train(comm, root: str, tag: str, *parts, resume: bool = False, until: int | None = None):
    from loom.train.trainer import Trainer

    tr = Trainer(_train_cfg(TRAIN, {"train": {"eval_every": 2, "eval_batches": 1}}, *parts), comm,
                 out=f"{root}/{tag}", resume=resume, quiet=True)
    return tr, tr.run(until)


def check_train_zero_stages_2_3_match_one_rank(comm):
    """loom train at [zero] stage 2 and 3 (small buckets) on dp, dp x sp with FPDT chunks and offload (sp in
    the group or summed after it), dp x pp and pp x sp (FPDT) with two micro-batches equals the one-rank run:
    losses, held-out losses and every parameter after 4 AdamW steps with warm-up, weight decay and clipping,
    fp64, to 1e-9; on plain dp the step record counts the reduce-scatters' overlap with backward, and
    ``zero.progress`` (hooks at stage 2, thread at stage 3) is the engine's."""
    import shutil

    root = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero23-") if comm.rank == 0 else None)
    solo = comm.split(comm.rank, name="solo")
    ref, ref_recs = _zero_train(solo, root, f"ref{comm.rank}")
    want = _full_params(ref)
    for i, extra in enumerate(ZERO_MESHES[comm.size]):
        for stage in (2, 3):
            zero = {"zero": {**extra.get("zero", {}), **SMALL_BUCKETS, "stage": stage}}
            mode = ("hooks", "thread")[stage - 2] if set(extra["mesh"]) == {"dp"} else None
            if mode:  # --zero.progress reaches the ZeRO engine
                zero["zero"]["progress"] = mode
            tr, recs = _zero_train(comm, root, f"m{i}s{stage}", extra, zero)
            assert len(tr.sdp.buckets) > 2, len(tr.sdp.buckets)
            assert not mode or tr.sdp.comm.size == 1 or tr.sdp.progress == mode, (mode, tr.sdp.progress)
            for a, b in zip(recs, ref_recs):
                assert abs(a["loss"] - b["loss"]) < 1e-9 * abs(b["loss"]), (extra, stage, a["loss"], b["loss"])
                if b["eval_loss"] is not None:
                    assert abs(a["eval_loss"] - b["eval_loss"]) < 1e-9 * abs(b["eval_loss"]), (extra, stage)
            got = _full_params(tr)
            assert got and set(got) <= set(want), (extra, sorted(got))  # under pp: this rank's stage
            for n, t in got.items():
                err = float((t - want[n]).abs().max())
                assert err < 1e-9, (extra, stage, n, err)
            if tr.sdp.comm.size > 1:  # the ZeRO group's traffic is counted on its axis
                assert set(recs[-1]["bytes"]) & {"dp", "dp+sp"}, recs[-1]["bytes"]
            if set(extra["mesh"]) == {"dp"}:  # reduce-scatters posted in backward; the record shows their overlap
                t = recs[-1]["time"]
                assert tr.sdp.last["posted_in_backward"] >= 1, (stage, tr.sdp.last)
                assert t["overlapped"] > 0 and t["comm"] >= t["zero"] >= 0, (stage, t)
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def _resume_bit_exact(comm, root: str, mesh: dict) -> None:
    base = {"train": {"dtype": "float32", "steps": 6}, "zero": {"stage": 3, "axes": ["dp", "sp"], **SMALL_BUCKETS},
            "compress": {"policy": "hybrid", "min_kb": 0}}
    whole, want = _zero_train(comm, root, "full", base, mesh)
    full = _full_params(whole)
    cut = {"checkpoint": {"every": 3, "keep": 1}}
    _, got = _zero_train(comm, root, "cut", base, mesh, cut, until=4)  # killed after step 4
    assert list(Path(root, "cut/checkpoints/step_000003.zero").rglob("manifest.json"))
    again, rest = _zero_train(comm, root, "cut", base, mesh, cut, resume=True)
    assert again.start_step == 3 and [r["step"] for r in rest] == [4, 5, 6], again.start_step
    for a, b in zip(got[:3] + rest, want):
        assert a["loss"] == b["loss"], ("resume changed the loss", mesh, a["step"], a["loss"], b["loss"])
    for n, t in _full_params(again).items():
        assert torch.equal(t, full[n]), (mesh, n)
    if comm.size > 1 and comm.rank == 0:
        files = [p for p in Path(root, "cut/checkpoints/step_000006.zero").rglob("*") if p.is_file()]
        assert len(files) == comm.size + again.stages, files  # one file per rank plus a manifest per stage


def check_train_zero3_resume_is_bit_exact_under_hybrid_and_reshards(comm):
    """Stage 3 under the hybrid policy (int4 + error feedback on the reduce-scatter, int8 gathers, bf16 sp
    all-to-alls), on dp x sp and (4 ranks) dp x pp: a run killed after step 4 and resumed from its step-3
    sharded checkpoint equals the uninterrupted run bit for bit (fp32). Then the exact stage-3 run at P ranks,
    resumed at one rank from its step-2 checkpoint (one file per rank + manifest, resharded), continues it
    to 1e-9."""
    import shutil

    root = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero3-resume-") if comm.rank == 0 else None)
    meshes = [{"mesh": {"dp": 2, "sp": comm.size // 2}} if comm.size % 2 == 0 else {"mesh": {"dp": comm.size}}]
    if comm.size == 4:
        meshes.append({"mesh": {"dp": 2, "pp": 2}, **PIPE})
    for i, mesh in enumerate(meshes):
        _resume_bit_exact(comm, f"{root}/r{i}", mesh)
    # exact run at P ranks, resumed at one rank from its step-2 checkpoint
    exact = {"zero": {"stage": 3, **SMALL_BUCKETS}}
    _, ref = _zero_train(comm, root, "p", {"mesh": {"dp": comm.size}}, exact)
    solo = comm.split(comm.rank, name="solo")
    mine = f"{root}/solo{comm.rank}"
    shutil.copytree(f"{root}/p/checkpoints", f"{mine}/checkpoints")
    for f in Path(mine, "checkpoints").glob("step_000004*"):
        shutil.rmtree(f) if f.is_dir() else f.unlink()
    tr, recs = _zero_train(solo, root, f"solo{comm.rank}", exact, resume=True)
    assert tr.start_step == 2, tr.start_step
    for a, b in zip(recs, ref[2:]):
        assert abs(a["loss"] - b["loss"]) < 1e-9 * abs(b["loss"]), (a["loss"], b["loss"])
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def check_train_zero3_bf16_compute_with_fp32_master(comm):
    """train.dtype = bfloat16 with zero.master_dtype = float32 at stage 3: AdamW steps fp32 shards, the model
    computes on bf16 gathered copies, and the losses stay within 2 % of the fp32 one-rank run."""
    import shutil

    root = comm.bcast_object(tempfile.mkdtemp(prefix="loom-zero3-bf16-") if comm.rank == 0 else None)
    solo = comm.split(comm.rank, name="solo")
    _, ref = _zero_train(solo, root, f"ref{comm.rank}", {"train": {"dtype": "float32"}})
    mixed = {"train": {"dtype": "bfloat16"}, "zero": {"stage": 3, "master_dtype": "float32", **SMALL_BUCKETS}}
    tr, recs = _zero_train(comm, root, "bf16", {"mesh": {"dp": comm.size}}, mixed)
    assert all(sh.dtype == torch.float32 for sh in tr.sdp.shards) and tr.sdp.compute_dtype == torch.bfloat16
    assert all(v.dtype == torch.float32 for v in _full_params(tr).values())
    for a, b in zip(recs, ref):
        assert abs(a["loss"] - b["loss"]) < 0.02 * b["loss"], (a["step"], a["loss"], b["loss"])
    assert any(a["loss"] != b["loss"] for a, b in zip(recs, ref))  # the bf16 compute really ran
    comm.barrier()
    if comm.rank == 0:
        shutil.rmtree(root, ignore_errors=True)


def check_comm_nonblocking_ops_it_relies_on(comm):
    """ireduce_scatter, and iallreduce / iallgather in place (out=), against their blocking forms."""
    p, r = comm.size, comm.rank
    x = torch.arange(6 * p, dtype=torch.float64) * (r + 1)
    want = comm.reduce_scatter(x.clone())
    assert torch.equal(comm.ireduce_scatter(x.clone()).wait(), want)
    assert torch.allclose(comm.ireduce_scatter(x.clone(), op="avg").wait(), want / p)
    buf = x.clone()
    ptr = buf.data_ptr()
    out = comm.iallreduce(buf, op="avg", out=buf).wait()
    assert out is buf and buf.data_ptr() == ptr and torch.allclose(buf, comm.allreduce(x, op="avg"))
    full = torch.full((3 * p,), -1.0, dtype=torch.float64)
    got = comm.iallgather(torch.full((3,), float(r), dtype=torch.float64), out=full).wait()
    assert got is full and torch.equal(full, torch.arange(p, dtype=torch.float64).repeat_interleave(3))
    try:
        comm.ireduce_scatter(torch.zeros(6 * p + 1))
    except ValueError as exc:
        assert "does not divide" in str(exc) or p == 1
    else:
        assert p == 1, "an indivisible ireduce_scatter was accepted"


def check_errors(comm):
    m = _model(1)
    for bad, kw in [(4, {}), (-1, {}), (True, {})]:
        try:
            ShardedDataParallel(m, comm, stage=bad, **kw)
        except ValueError as exc:
            assert "stage" in str(exc)
        else:
            raise AssertionError(f"stage {bad!r} accepted")
    mesh = Mesh(dp=comm.size, comm=comm)
    try:
        ShardedDataParallel(m, mesh, axes=["dp", "tp"])
    except ValueError as exc:
        assert "'tp'" in str(exc) and "axes" in str(exc)
    else:
        raise AssertionError("an axis outside the mesh was accepted")
    try:
        ShardedDataParallel(m, comm, axes=["dp"])
    except ValueError as exc:
        assert "Mesh" in str(exc)
    else:
        raise AssertionError("axes with a Communicator accepted")
    try:
        ShardedDataParallel(m, comm, stage=1, compress="hybrid")
    except ValueError as exc:
        assert "stage 2 or 3" in str(exc)
    else:
        raise AssertionError("compression at stage 1 accepted")
    bare = nn.Module()  # a meta tensor nothing can initialise: refused before anything is allocated
    bare.w = nn.Parameter(torch.empty(3, 3, device="meta"))
    for stage in (1, 3):
        try:
            ShardedDataParallel(bare, comm, stage=stage)
        except ValueError as exc:
            assert "'w'" in str(exc) and "meta device" in str(exc) and "init=" in str(exc), str(exc)
        else:
            raise AssertionError("a meta-device module without an initialiser was accepted")
        assert bare.w.is_meta


def check_plain_dp_replicas_never_diverge(comm):
    """GradReducer (plain data parallel): a gradient None on some ranks only ends the same on every rank."""
    torch.manual_seed(0)
    model = Net().double()
    params = [p for p in model.parameters() if p.requires_grad]
    red = GradReducer(params, comm, bucket_mb=0.0015)
    opt = torch.optim.SGD(params, lr=0.1)
    x = torch.randn(4, 7, dtype=torch.float64)
    red.start(1)
    model(x, use=comm.rank % 2 == 0).sum().backward()
    red.finish()
    opt.step()
    _replicas_agree(comm, model, "plain dp")
    got = model.sometimes.weight.grad
    assert got is not None, "a gradient used on another rank must reach every rank"


if __name__ == "__main__":
    mpi_checks(globals())
