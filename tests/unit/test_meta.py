"""Per-stage materialisation (loom.parallel.materialize): a model built on the meta device gets real tensors for
one pipeline stage only; they equal the same tensors of a whole build from the same seed (fp64, exact), and the
memory live during construction is the stage's, not the model's (CPU live-storage tracker)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from loom.models.llama import Llama, LlamaConfig
from loom.parallel import MemoryTracker, materialize, meta_names
from loom.parallel.partition import capture, split_units
from loom.train.model import Positions, StageView


def _stage_names(view: nn.Module, stages: int, s: int) -> list[str]:
    """Names (in ``view``) of the tensors stage ``s`` of ``stages`` reads, as HybridParallel splits it."""
    graph = capture(view)
    counts = split_units(graph, stages, "params")
    ids = {id(t) for n in graph.stage_nodes(counts, s) for t in n.params}
    return [n for n, t in view.named_parameters() if id(t) in ids]


def _llama_meta(cfg: LlamaConfig) -> tuple[Llama, StageView]:
    with torch.device("meta"):
        model = Llama(cfg)
    return model, StageView(model, Positions())


@pytest.mark.parametrize("ffn", ["swiglu", "moe"])
@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_llama_stage_equals_whole_build(ffn, stages):
    cfg = LlamaConfig(layers=4, hidden=32, heads=4, kv_heads=2, vocab=40, ffn=ffn, experts=4)
    whole = dict(Llama(cfg).double().named_parameters())
    seen = set()
    for s in range(stages):
        model, view = _llama_meta(cfg)
        keep = _stage_names(view, stages, s)
        got = materialize(view, keep, dtype=torch.float64)
        assert got == keep and keep
        for name, t in view.named_parameters():
            mine = view.model_names[name]
            if name in keep:
                assert t.dtype == torch.float64 and torch.equal(t, whole[mine]), (stages, s, mine)
                seen.add(mine)
            else:
                assert t.is_meta, (stages, s, mine)
        assert all(p.is_meta == (n not in {view.model_names[k] for k in keep}) for n, p in model.named_parameters())
    assert seen == set(whole)  # the stages cover the model


class Net(nn.Module):
    """torch's default initialisation (global random stream), modules registered in construction order."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8)) for _ in range(5)])
        self.emb = nn.Embedding(11, 8)
        self.out = nn.Linear(8, 3)


@pytest.mark.parametrize("keep", [["inp.weight"], ["blocks.2.0.weight", "blocks.2.1.bias", "out.bias"], None])
def test_reset_parameters_replay_keeps_the_random_stream(keep):
    torch.manual_seed(5)
    whole = dict(Net().double().named_parameters())
    torch.manual_seed(5)
    with torch.device("meta"):
        net = Net()
    materialize(net, keep, dtype=torch.float64)
    kept = set(keep or whole)
    for name, t in net.named_parameters():
        assert t.is_meta == (name not in kept), name
        if name in kept:
            assert torch.equal(t, whole[name]), name
    assert isinstance(net.inp.weight, nn.Parameter)


def test_redraw_materialises_in_several_calls_from_one_stream_state():
    """Each call replays from the same stream state; redraw=True also draws for the modules materialised by
    earlier calls (on scratch, leaving their tensors alone), so every call's tensors equal a whole build's;
    without it the later calls' draws shift and differ."""
    torch.manual_seed(5)
    whole = dict(Net().named_parameters())
    after = torch.rand(2)
    groups = [["out.weight"], ["inp.weight", "inp.bias"], ["blocks.3.0.weight", "emb.weight"]]
    for redraw in (True, False):
        torch.manual_seed(5)
        with torch.device("meta"):
            net = Net()
        start = torch.get_rng_state()
        for keep in groups:
            torch.set_rng_state(start)
            materialize(net, keep, redraw=redraw)
        same = all(torch.equal(dict(net.named_parameters())[n], whole[n]) for g in groups for n in g)
        assert same == redraw, redraw
        if redraw:
            assert torch.equal(torch.rand(2), after)  # the stream ends where the whole build left it
            assert net.blocks[0][0].weight.is_meta and not net.out.weight.is_meta


def test_init_as_built_equals_a_plain_build_then_cast():
    """A meta Llama cast to fp64 before materialising: init_as_built fills in fp32 (as built) and casts, so the
    values equal Llama(cfg).double(); filling the fp64 tensors directly would not round through fp32."""
    from loom.parallel.meta import init_as_built

    cfg = LlamaConfig(layers=2, hidden=16, heads=4, kv_heads=2, vocab=31)
    whole = dict(Llama(cfg).double().named_parameters())
    with torch.device("meta"):
        model = Llama(cfg)
    init = init_as_built(model)
    model.to(torch.float64)
    materialize(model, init=init)
    for name, t in model.named_parameters():
        assert t.dtype == torch.float64 and torch.equal(t, whole[name]), name
    with pytest.raises(ValueError, match="init_parameter"):
        init_as_built(Net())


def test_tied_weights_stay_tied():
    cfg = LlamaConfig(layers=2, hidden=16, heads=2, vocab=30, tie_embeddings=True)
    with torch.device("meta"):
        model = Llama(cfg)
    materialize(model)
    assert model.head.weight is model.embed.weight and not meta_names(model)
    assert torch.equal(model.embed.weight, Llama(cfg).embed.weight)


def test_meta_model_without_initialiser_is_a_clear_error():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.ones(3))

    with torch.device("meta"):
        m = Raw()
    with pytest.raises(ValueError, match=r"cannot initialise 'scale'.*init=fn\(name, tensor\)"):
        materialize(m)
    materialize(m, init=lambda name, t: t.fill_(2.0))  # an explicit initialiser covers it
    assert float(m.scale.detach().sum()) == 6.0 and float(m.lin.weight.detach().sum()) == 18.0


def _peak(fn) -> int:
    with MemoryTracker() as mem:
        fn()
    return mem.peak


def test_construction_peak_is_the_stage_not_the_model():
    cfg = LlamaConfig(layers=8, hidden=128, heads=4, vocab=64)
    model_bytes = sum(p.numel() for p in Llama(cfg).parameters()) * 4
    peaks, stage_bytes, largest = [], [], 0
    for s in range(4):
        model, view = _llama_meta(cfg)
        keep = _stage_names(view, 4, s)
        peaks.append(_peak(lambda view=view, keep=keep: materialize(view, keep)))
        kept = [t for n, t in view.named_parameters() if n in keep]
        stage_bytes.append(sum(t.numel() * 4 for t in kept))
        largest = max([largest] + [t.numel() for t in kept])
    whole = _peak(lambda: materialize(_llama_meta(cfg)[1]))
    assert whole >= model_bytes  # the tracker sees the whole model when everything is kept
    for peak, stage in zip(peaks, stage_bytes):
        # the stage itself, plus one tensor's float64 draw and its scaled copy in flight
        assert stage <= peak <= stage + 2 * 8 * largest, (peak, stage, largest)
        assert peak < 0.5 * model_bytes, (peak, model_bytes)



def test_meta_device_context_survives_a_wrapped_factory(monkeypatch):
    """transformers' from_pretrained wraps torch.linspace inside a meta device context; if torch fills its table
    of factory functions then, linspace later ignores ``torch.device("meta")``. The guard rebuilds the table."""
    from torch.utils import _device

    from loom.parallel.meta import guard_device_constructors

    builtin = torch.linspace
    _device._device_constructors.cache_clear()
    monkeypatch.setattr(torch, "linspace", lambda *a, **k: builtin(*a, **k))
    _device._device_constructors()  # the table taken while the wrapper is in place
    monkeypatch.setattr(torch, "linspace", builtin)
    try:
        with torch.device("meta"):
            assert not torch.linspace(0, 1, 4).is_meta  # the failure the guard exists for
        guard_device_constructors()
        with torch.device("meta"):
            assert torch.linspace(0, 1, 4).is_meta
    finally:
        _device._device_constructors.cache_clear()
        _device._device_constructors()
