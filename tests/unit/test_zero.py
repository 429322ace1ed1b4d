"""ShardedDataParallel on one process (a group of one rank): every check of tests/mpi/check_zero.py and
tests/mpi/check_zero_deep.py, plus the pieces that need no peers (bucket layout, refusal of bad input,
checkpoint files)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from loom.comm import world
from loom.parallel import ShardedDataParallel

_SPEC = importlib.util.spec_from_file_location("check_zero", Path(__file__).parents[1] / "mpi" / "check_zero.py")
cz = importlib.util.module_from_spec(_SPEC)
_SPEC.loader.exec_module(cz)

_DEEP = importlib.util.spec_from_file_location("check_zero_deep",
                                              Path(__file__).parents[1] / "mpi" / "check_zero_deep.py")
czd = importlib.util.module_from_spec(_DEEP)
_DEEP.loader.exec_module(czd)

CHECKS = [(cz, k) for k in vars(cz) if k.startswith("check_")] + [(czd, k) for k in vars(czd) if k.startswith("check_")]


@pytest.mark.parametrize("mod, name", CHECKS, ids=[n for _, n in CHECKS])
def test_check_on_one_rank(mod, name):
    torch.set_num_threads(1)
    getattr(mod, name)(world())


def test_buckets_follow_modules_and_pad():
    sdp = ShardedDataParallel(cz._model(0), world(), stage=3, bucket_mb=0.0015)
    names = [n for b in sdp.buckets for n in b.names]
    assert "frozen.weight" not in names and names[:2] == ["scale", "inp.weight"]  # the root module first
    trainable = sum(p.numel() for p in cz._model(0).parameters() if p.requires_grad)
    assert sum(b.numel for b in sdp.buckets) == trainable == sdp.flat_shard().numel()  # one rank: no padding


def test_manifest_is_written_last_and_atomically(tmp_path):
    sdp = ShardedDataParallel(cz._model(0), world(), stage=2)
    opt = torch.optim.Adam(sdp.parameters())
    sdp.save_sharded(tmp_path, opt, extra={"step": 7})
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert man["world"] == 1 and man["files"] == ["shard-00000-of-00001.pt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["manifest.json", "shard-00000-of-00001.pt"]
    with pytest.raises(ValueError, match="manifest"):
        sdp.load_sharded(tmp_path / "nowhere")


@pytest.mark.parametrize("zero, match", [
    ({"stage": 5}, "zero.stage = 5"),
    ({"stage": 1, "axes": ["tp"]}, "zero.axes"),
    ({"stage": 3, "bucket_mb": 0}, "zero.bucket_mb = 0"),
    ({"stage": 3, "master_dtype": "float16"}, "zero.master_dtype = 'float16'"),
    ({"stage": 1, "master_dtype": "float32"}, "needs zero.stage = 2 or 3"),
    ({"stage": 3, "progress": "spin"}, "zero.progress = 'spin' must be one of auto, hooks, thread"),
    ({"stage": 1, "progress": "thread"}, "with zero.stage = 1: stage 1 reduces after backward"),
])
def test_zero_config_refuses_bad_input(zero, match):
    from loom.train.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match=match):
        config_from_dict({"zero": zero})


def test_zero_progress_is_one_option_for_data_parallel_and_zero():
    """``--zero.progress=...`` reaches the config in the one CLI vocabulary, with the library's own modes."""
    from loom.parallel.data import PROGRESS_MODES
    from loom.train import config

    assert config.PROGRESS_MODES == PROGRESS_MODES
    assert config.load_config(None, ["--zero.progress=thread", "--zero.stage=3"]).zero.progress == "thread"
    assert config.load_config(None, ["--zero.progress=hooks"]).zero.progress == "hooks"  # stage 0: dp's reducer
    assert config.config_from_dict({}).zero.progress == "auto"


def test_zero_stages_compose_with_pipelines_sp_and_cuda():
    from loom.train.config import config_from_dict

    assert config_from_dict({"zero": {"stage": 3}, "mesh": {"pp": 2}}).zero.stage == 3
    for stage in (1, 2, 3):  # the shards live where the parameters live
        assert config_from_dict({"zero": {"stage": stage}, "train": {"device": "cuda"}}).zero.stage == stage
    assert config_from_dict({"zero": {"stage": 3, "axes": ["dp", "sp"]}, "mesh": {"sp": 2}}).zero.stage == 3


def test_zero_config_with_experts_is_refused_and_axes_parse():
    from loom.train.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError, match="mesh.ep"):
        config_from_dict({"zero": {"stage": 1}, "mesh": {"ep": 2}, "model": {"ffn": "moe", "experts": 4}})
    assert config_from_dict({"zero": {"stage": 1, "axes": "dp,sp"}}).zero.axes == ["dp", "sp"]


def test_groups_and_missing_grad_refuse_bad_input():
    model = cz._model(0)
    with pytest.raises(TypeError, match="list of dicts with a 'params' entry"):
        ShardedDataParallel(model, world(), stage=3, groups={"params": list(model.parameters())})
    with pytest.raises(ValueError, match="more than one group"):
        ShardedDataParallel(model, world(), stage=3, groups=[{"params": [model.inp.weight]},
                                                             {"params": [model.inp.weight]}])
    with pytest.raises(ValueError, match="not a trainable parameter"):
        ShardedDataParallel(model, world(), stage=3, groups=[{"params": [torch.zeros(3)]}])
    with pytest.raises(ValueError, match="missing_grad='none'"):
        ShardedDataParallel(model, world(), stage=2, missing_grad="none")


def test_unlisted_parameters_form_a_last_group_and_buckets_keep_groups_apart():
    model = cz._model(0)
    vectors = [p for p in model.parameters() if p.dim() == 1 and p.requires_grad]
    sdp = ShardedDataParallel(model, world(), stage=2, bucket_mb=64, groups=[{"params": vectors, "lr": 0.5}])
    groups = sdp.optim_groups()
    assert [g.get("lr") for g in groups] == [0.5, None] and len(sdp.buckets) == 2  # one bucket per group
    ids = {id(p) for p in vectors}
    for b in sdp.buckets:
        assert len({id(p) in ids for p in b.params}) == 1, b.names


def test_remove_gives_stage3_parameters_back_their_class():
    model = cz._model(0)
    sdp = ShardedDataParallel(model, world(), stage=3, bucket_mb=0.0015)
    assert type(model.head.weight).__name__ == "_ShardedParameter"
    sdp.remove()
    assert type(model.head.weight) is torch.nn.Parameter


def test_stage3_frees_a_bucket_before_allocating_its_flat_gradient():
    """Stage 3 keeps a bucket's gradients in ``.grad`` until the last one arrives and frees the gathered bucket
    before its flat gradient is allocated, so backward never holds a bucket's parameters, its flat gradient and a
    parameter's fresh gradient together (issue 26: ``loom bench zero`` stage 3 against FSDP2's peak). One rank, so
    no reduce-scatter stays in flight: beyond the shards and their gradients (both the model's size here) the
    step's peak is one bucket and change (two buckets when the flat gradient is allocated at the first arrival)."""
    from loom.parallel.offload import MemoryTracker

    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, depth = 128, 6
    bucket = width * (width + 1) * 4  # one Linear per bucket
    sdp = ShardedDataParallel(torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)]), world(),
                              stage=3, bucket_mb=bucket / 2**20)
    opt = torch.optim.SGD(sdp.parameters(), lr=0.1)
    x = torch.randn(4, width)

    def step():
        sdp(x).square().mean().backward()
        sdp.step(opt)

    step()
    with MemoryTracker() as mem:
        mem.track(*sdp.parameters())
        step()
    extra = (mem.peak - 2 * depth * bucket) / bucket
    assert len(sdp.buckets) == depth and extra < 1.5, f"stage-3 step peaked at {extra:.2f} buckets over the state"


def test_gpu_tier_placement_check_holds_at_every_stage():
    """tests/gpu/check_zero_cuda.py's placement assertions, on the CPU after one step of each stage: they must
    hold where nothing is wrong (stage 0 has no gathered buckets, only the reducer's buffers)."""
    from tests.gpu import check_zero_cuda as gpu

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    data = czd._data(g, 1)
    for stage in (0, 1, 2, 3):
        sdp, opt, _ = gpu._train(world(), 1, data, "cpu", stage, "hooks")
        gpu._placed(sdp, opt, "cpu", f"stage {stage}")
        sdp.remove()
