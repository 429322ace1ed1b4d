"""Rank-side checks for ``loom train``: every mesh equals the one-rank run; resume equals uninterrupted.

Run at 2 and 4 ranks by tests/integration/test_train_jobs.py. The one-rank reference runs in-process on a
size-1 communicator (``comm.split(rank)``) on every rank; fp64 everywhere, tolerance 1e-9 relative on losses
and 1e-9 absolute on parameters (only summation order differs). Resume is compared bit for bit in fp32.
"""

from __future__ import annotations

import math

import torch

from loom.testing import mpi_checks
from loom.train.trainer import Trainer
from tests.jobs import SharedDir, uneven_documents
from tests.jobs import train_config as _cfg

BASE = {
    "model": {"layers": 2, "hidden": 32, "heads": 4, "kv_heads": 2},
    "data": {"seq_len": 32, "batch": 4, "max_bytes": 60_000},
    "train": {"steps": 4, "dtype": "float64", "eval_every": 2, "eval_batches": 1, "progress": "none",
              "plots": False},
    "optim": {"warmup": 2, "lr": 1e-2},
    "checkpoint": {"every": 0},
}

MOE = {"model": {"ffn": "moe", "experts": 4, "top_k": 2}}

MESHES = {
    2: [{"mesh": {"dp": 2}},
        {**MOE, "mesh": {"ep": 2}},
        {"mesh": {"sp": 2}},
        {"mesh": {"pp": 2}, "data": {"micro_batches": 2}},
        {**MOE, "mesh": {"pp": 2}, "data": {"micro_batches": 2}},
        {**MOE, "mesh": {"ep": 2}, "multipath": {"enabled": True, "topology": "shm", "min_bytes": 0}}],
    4: [{"mesh": {"dp": 2, "sp": 2}},
        {"mesh": {"pp": 2, "sp": 2}, "data": {"micro_batches": 2},
         "sequence": {"algorithm": "fpdt", "chunks": 2}},
        {"mesh": {"dp": 2, "pp": 2}, "mesh_schedule": "gpipe"},
        # odd lengths: padded inside loom to 32 (sp x chunks = 8; under the ring sp and 2 x sp_ring = 4)
        {"mesh": {"sp": 4}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True, "recompute": True},
         "data": {"seq_len": 31}},
        # sp past the heads: 2 heads, so mesh.sp_ring is chosen as 2 (Ulysses 2 x ring 2), with ZeRO-1 over sp
        {"model": {"heads": 2, "kv_heads": 1}, "mesh": {"sp": 4}, "zero": {"stage": 1, "axes": ["dp", "sp"]},
         "data": {"seq_len": 29}},
        {"model": {"heads": 2, "kv_heads": 1}, "mesh": {"sp": 4},
         "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
        {**MOE, "mesh": {"dp": 2, "ep": 2}},
        {**MOE, "mesh": {"ep": 2, "sp": 2}},
        {**MOE, "mesh": {"ep": 2, "sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
        {**MOE, "mesh": {"pp": 2, "ep": 2}, "data": {"micro_batches": 2}},
        # Expert all-to-allv through the planner on the 2 x 2 two-rail testbed shape: relays forced.
        {**MOE, "mesh": {"ep": 4}, "multipath": {"enabled": True, "topology": "testbed", "min_bytes": 0}}],
}

_DIR = SharedDir("loom-train-")
_tmp = _DIR.path


def _params(tr: Trainer) -> dict[str, torch.Tensor]:
    named = dict(tr.model.named_parameters())
    return {n: named[n].detach().clone() for n in tr.param_names}


def _reference(comm, extra: dict, base: dict = BASE):
    """The same run on one rank (sp-independent parts of ``extra`` kept: sequence algorithm, micro-batches)."""
    solo = comm.split(comm.rank, 0, name="solo")
    keep = {k: v for k, v in extra.items() if k not in ("mesh", "mesh_schedule", "sequence")}
    keep["sequence"] = {k: v for k, v in extra.get("sequence", {}).items()
                        if k in ("recompute", "offload_checkpoints")}
    tr = Trainer(_cfg(base, keep), solo, out=_tmp(comm, f"ref{comm.rank}"), quiet=True)
    recs = tr.run()
    return recs, _params(tr)


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=rtol)


def check_meshes_match_one_rank(comm):
    for extra in MESHES[comm.size]:
        _matches_one_rank(comm, extra)


def _matches_one_rank(comm, extra: dict, base: dict = BASE):
    """Losses (train and held-out) and parameters after AdamW steps of ``base`` + ``extra`` on this job's mesh
    equal the one-rank run's, 1e-9 (fp64)."""
    ref_recs, ref_params = _reference(comm, extra, base)
    tr = Trainer(_cfg(base, extra), comm, out=_tmp(comm, "mesh"), quiet=True)
    recs = tr.run()
    assert len(recs) == len(ref_recs) == base["train"]["steps"]
    for r, q in zip(recs, ref_recs):
        assert _close(r["loss"], q["loss"], 1e-9), (extra, r["step"], r["loss"], q["loss"])
        if q["eval_loss"] is not None:
            assert _close(r["eval_loss"], q["eval_loss"], 1e-9), (extra, r["eval_loss"], q["eval_loss"])
    mine = _params(tr)
    assert mine, "this rank trains no parameters"
    if tr.hybrid is not None:  # built on meta: only this rank's stage was materialised
        assert all(p.is_meta == (n not in mine) for n, p in tr.model.named_parameters()), extra
    for name, t in mine.items():
        err = float((t - tr._my_shard(name, ref_params[name])).abs().max())
        assert err < 1e-9, (extra, name, err)
    # the mesh axes that are on actually moved bytes
    for axis, n in extra.get("mesh", {}).items():
        if n > 1:
            assert recs[-1]["bytes"].get(axis, {}).get("wire", 0) > 0, (extra, axis, recs[-1]["bytes"])


# Packed documents of uneven lengths (tests/jobs.py uneven_documents): Ulysses and FPDT at sp = 2 and 4, Ulysses x
# ring and FPDT x ring at sp = 4, dp (replicas whose real-target counts differ; also under ZeRO-3), ep (MoE ranks
# that take different rows, like dp: the count is divided by dp x ep), pipelines (micro-batches whose real-target
# counts differ; with sp under FPDT, dp under GPipe, MoE over ep), and checkpoints on the host under Ulysses and
# FPDT. Tensor parallelism: check_train_tp_packed_matches_one_rank in tests/mpi/check_tensor.py.
PACKED = {
    2: [{"mesh": {"sp": 2}},
        {**MOE, "mesh": {"ep": 2}},
        {"mesh": {"pp": 2}, "data": {"micro_batches": 2}},
        {"mesh": {"sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
        {"mesh": {"dp": 2}},
        {"mesh": {"dp": 2}, "zero": {"stage": 3}},
        {"mesh": {"sp": 2}, "sequence": {"recompute": True, "offload_checkpoints": True}}],
    4: [{"mesh": {"sp": 4}},
        {"mesh": {"sp": 4}, "sequence": {"algorithm": "fpdt", "chunks": 2}},
        {"mesh": {"dp": 2, "sp": 2},
         "sequence": {"algorithm": "fpdt", "chunks": 2, "recompute": True, "offload_checkpoints": True}},
        {**MOE, "mesh": {"dp": 2, "ep": 2}},
        {**MOE, "mesh": {"ep": 2, "sp": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True}},
        {"mesh": {"pp": 2, "sp": 2}, "data": {"micro_batches": 2}, "sequence": {"algorithm": "fpdt", "chunks": 2}},
        {"mesh": {"dp": 2, "pp": 2}, "data": {"micro_batches": 2}, "mesh_schedule": "gpipe"},
        {**MOE, "mesh": {"pp": 2, "ep": 2}, "data": {"micro_batches": 2}},
        # Ulysses 2 x ring 2 (2 heads) on an odd length: the pads are a document of their own
        {"model": {"heads": 2, "kv_heads": 1}, "mesh": {"sp": 4}, "data": {"seq_len": 29}},
        # FPDT x ring: chunks 3 inside each Ulysses group of 2 (a chunk split at the zig-zag boundary), offload,
        # padded from 29 to 36
        {"model": {"heads": 2, "kv_heads": 1}, "mesh": {"sp": 4},
         "sequence": {"algorithm": "fpdt", "chunks": 3, "offload": True}, "data": {"seq_len": 29}}],
}


def check_packed_documents_match_one_rank(comm):
    """``data.pack``: the loss over real targets (none across a boundary), the held-out loss and the
    parameters after AdamW equal the one-rank run on the same packed batches, 1e-9 (fp64). The one-rank run
    itself equals each document run alone: tests/unit/test_packing.py."""
    path = _tmp(comm, "docs")
    data = uneven_documents(path) if comm.rank == 0 else None
    data = comm.bcast_object(data)
    base = {**BASE, "data": {**BASE["data"], **data}, "train": {**BASE["train"], "steps": 2, "eval_every": 2}}
    for extra in PACKED[comm.size]:
        _matches_one_rank(comm, extra, base)


def check_dp_reduces_during_backward(comm):
    """Plain dp in ``loom train`` reduces in buckets during backward (the mechanism, not a timing), and the
    step record splits communication into exposed (part of the step's sum) and overlapped with backward."""
    extra = {"mesh": {"dp": comm.size}, "compress": {"bucket_mb": 0.01}}
    tr = Trainer(_cfg(BASE, extra), comm, out=_tmp(comm, "dp-overlap"), quiet=True)
    recs = tr.run()
    assert tr.reducer is not None and len(tr.reducer.buckets) > 2
    last = tr.reducer.last
    assert 1 <= last["posted_in_backward"] <= last["buckets"] and 0 <= last["first_posted_at"] < last["hooks"], last
    t = recs[-1]["time"]
    assert t["dp"] >= 0 and t["overlapped"] >= 0 and t["comm"] >= t["dp"], t
    assert abs(t["compute"] + t["comm"] - recs[-1]["step_time"]) < 1e-9 * max(1.0, recs[-1]["step_time"]) + 1e-12


def check_compressed_dp_trains(comm):
    extra = {"mesh": {"dp": comm.size}, "compress": {"policy": "hybrid", "bucket_mb": 0.05, "min_kb": 0}}
    ref_recs, _ = _reference(comm, {})
    tr = Trainer(_cfg(BASE, extra), comm, out=_tmp(comm, "compressed"), quiet=True)
    recs = tr.run()
    last, ref = recs[-1], ref_recs[-1]
    assert math.isfinite(last["loss"])
    assert abs(last["loss"] - ref["loss"]) < 0.05 * ref["loss"], (last["loss"], ref["loss"])
    dp = last["bytes"]["dp"]
    assert dp["raw"] > 2 * dp["wire"], dp  # int4 gradients: well under half the bytes
    assert last["compress_ratio"] > 2


def check_compressed_sp_trains(comm):
    extra = {"mesh": {"sp": comm.size}, "compress": {"policy": "hybrid", "min_kb": 0}}  # hybrid: bf16 on sp all-to-alls
    ref_recs, _ = _reference(comm, {})
    tr = Trainer(_cfg(BASE, extra), comm, out=_tmp(comm, "compressed-sp"), quiet=True)
    recs = tr.run()
    last, ref = recs[-1], ref_recs[-1]
    assert abs(last["loss"] - ref["loss"]) < 0.01 * ref["loss"], (last["loss"], ref["loss"])
    assert last["loss"] != ref["loss"]  # the codec really ran (bf16 is lossy)
    sp = last["bytes"]["sp"]
    assert sp["raw"] > sp["wire"], sp  # the step's sp bytes include the (uncompressed) gradient allreduce
    from loom.compress import stats as cstats

    a2a = cstats()["sp"]
    # The all-to-alls alone: fp64 activations travel as bf16 (4x smaller), except blocks under the codec's
    # 4 KiB minimum (the attention-output blocks at 4 ranks), which travel raw.
    assert a2a["raw"] > 1.5 * a2a["wire"], a2a


def _resume_case(comm, extra: dict, tag: str):
    cfg = {**extra, "train": {**BASE["train"], "dtype": "float32", "steps": 6}}
    full = Trainer(_cfg(BASE, cfg), comm, out=_tmp(comm, f"full-{tag}"), quiet=True)
    want = full.run()
    want_params = _params(full)
    cut = {**cfg, "checkpoint": {"every": 3, "keep": 1}}
    first = Trainer(_cfg(BASE, cut), comm, out=_tmp(comm, f"cut-{tag}"), quiet=True)
    got = first.run(until=4)  # killed after step 4: the last checkpoint is step 3
    assert [r["step"] for r in got] == [1, 2, 3, 4]
    del first
    again = Trainer(_cfg(BASE, cut), comm, resume=True, out=_tmp(comm, f"cut-{tag}"), quiet=True)
    assert again.start_step == 3, again.start_step
    rest = again.run()
    assert [r["step"] for r in rest] == [4, 5, 6]
    for r, w in zip(got[:3] + rest, want):
        assert r["loss"] == w["loss"], (tag, r["step"], r["loss"], w["loss"])  # bit-exact on CPU
        assert r["eval_loss"] == w["eval_loss"]
    for name, t in _params(again).items():
        assert torch.equal(t, want_params[name]), (tag, name)
    if comm.rank == 0:
        from loom.train.progress import MetricsLog

        steps = [r["step"] for r in MetricsLog.read(again.out / "metrics.jsonl")]
        assert steps == [1, 2, 3, 4, 5, 6], steps  # the interrupted run's step 4 was replaced, not duplicated


def check_resume_equals_uninterrupted(comm):
    _resume_case(comm, {"mesh": {"dp": 2, "sp": comm.size // 2}}, "dp-sp")
    _resume_case(comm, {**MOE, "mesh": {"ep": 2, "dp": comm.size // 2}}, "ep-dp")
    if comm.size == 4:
        _resume_case(comm, {"mesh": {"pp": 2, "dp": 2}, "data": {"micro_batches": 2}}, "pp-dp")
        _resume_case(comm, {**MOE, "mesh": {"pp": 2, "ep": 2}, "data": {"micro_batches": 2}}, "pp-ep")


def check_resume_under_other_sequence_settings(comm):
    """A Ulysses run stopped after step 4 (checkpoint at 3) and resumed under FPDT (chunks 2, offload, block
    checkpoints on the host; at 4 ranks from Ulysses 2 x ring 2 to FPDT x ring 4, 2 heads) equals the
    uninterrupted Ulysses run: losses and parameters to 1e-9 (fp64)."""
    heads = {"model": {"heads": 2, "kv_heads": 1}} if comm.size == 4 else {}
    uly = {**heads, "mesh": {"sp": comm.size}, "train": {**BASE["train"], "steps": 6, "eval_every": 3}}
    full = Trainer(_cfg(BASE, uly), comm, out=_tmp(comm, "seq-full"), quiet=True)
    want = full.run()
    cut = {**uly, "checkpoint": {"every": 3, "keep": 1}}
    first = Trainer(_cfg(BASE, cut), comm, out=_tmp(comm, "seq-cut"), quiet=True)
    first.run(until=4)
    del first
    fpdt = {**cut, "sequence": {"algorithm": "fpdt", "chunks": 2, "offload": True, "recompute": True,
                                "offload_checkpoints": True}}
    if comm.size == 4:
        fpdt["mesh"] = {"sp": 4, "sp_ring": 4}
    again = Trainer(_cfg(BASE, fpdt), comm, resume=True, out=_tmp(comm, "seq-cut"), quiet=True)
    assert again.start_step == 3 and again.model.cfg.sequence_parallel == "fpdt", again.start_step
    rest = again.run()
    assert [r["step"] for r in rest] == [4, 5, 6] and all(r["offload_bytes"] > 0 for r in rest), rest
    for r, w in zip(rest, want[3:]):
        assert _close(r["loss"], w["loss"], 1e-9), (r["step"], r["loss"], w["loss"])
        if w["eval_loss"] is not None:
            assert _close(r["eval_loss"], w["eval_loss"], 1e-9), (r["step"], r["eval_loss"], w["eval_loss"])
    want_params = _params(full)
    for name, t in _params(again).items():
        err = float((t - want_params[name]).abs().max())
        assert err < 1e-9, (name, err)


def check_resume_equals_uninterrupted_compressed(comm):
    """Bit-exact under lossy compression too: the checkpoint keeps every rank's error-feedback residuals and
    codec state (hybrid: int4 + error feedback on dp; naive: zfp on every axis, no feedback)."""
    for policy in ("hybrid", "naive"):
        _resume_case(comm, {"mesh": {"dp": 2, "sp": comm.size // 2}, "compress": {"policy": policy, "min_kb": 0}},
                     f"dp-{policy}")


def check_cleanup(comm):
    _DIR.remove(comm)


if __name__ == "__main__":
    mpi_checks(globals())
