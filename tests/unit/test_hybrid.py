"""HybridParallel pieces on one process: balance vs brute force, schedules, graph capture and live sets, errors,
and (partitions, replicas) = (1, 1) training against plain torch, Keras Sequential, loom.fit."""

from __future__ import annotations

import functools
import itertools
import os
import random

os.environ.setdefault("KERAS_BACKEND", "torch")

import pytest
import torch
from torch import nn

from loom.parallel import HybridParallel, TraceError, balance
from loom.parallel.partition import capture, split_units
from loom.parallel.pipeline import schedule
from loom.testing import load_checks

CHECKS, _ = load_checks("tests/mpi/check_hybrid.py")  # the multi-rank checks' train-and-compare helpers


def brute_force(costs, parts):
    n = len(costs)
    best = None
    for cuts in itertools.combinations(range(1, n), parts - 1):
        b = [0, *cuts, n]
        worst = max(sum(costs[b[i]:b[i + 1]]) for i in range(parts))
        best = worst if best is None else min(best, worst)
    return best


def test_balance_is_minmax_optimal_and_never_empty():
    rng = random.Random(4)
    for _ in range(300):
        n = rng.randint(1, 9)
        parts = rng.randint(1, n)
        costs = [rng.choice([0, 0, 1, 2, 5, 13, 40]) * rng.random() for _ in range(n)]
        counts = balance(costs, parts)
        assert len(counts) == parts and sum(counts) == n and min(counts) >= 1
        acc = list(itertools.accumulate(counts))
        worst = max(sum(costs[a - c:a]) for a, c in zip(acc, counts))
        assert worst == pytest.approx(brute_force(costs, parts), abs=1e-12)


def test_balance_known_split_and_errors():
    assert balance([1, 1, 1, 1], 2) == [2, 2]
    assert balance([8, 1, 1, 1, 1, 1, 1, 1, 1], 2) == [1, 8]
    assert balance([0, 0, 0], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="exceeds the model's 2 layers"):
        balance([1, 2], 3)
    with pytest.raises(ValueError, match=">= 0"):
        balance([1, -2], 1)


@pytest.mark.parametrize("kind", ["gpipe", "1f1b"])
def test_schedules_run_every_microbatch_once_in_order(kind):
    for p, m in itertools.product(range(1, 6), range(1, 9)):
        for s in range(p):
            ops = schedule(kind, s, p, m)
            assert sorted(ops) == sorted([("F", i) for i in range(m)] + [("B", i) for i in range(m)])
            assert [i for o, i in ops if o == "F"] == list(range(m))
            assert [i for o, i in ops if o == "B"] == list(range(m))
            live = peak = 0
            for o, i in ops:
                assert o == "F" or ops.index(("F", i)) < ops.index(("B", i))
                live += 1 if o == "F" else -1
                peak = max(peak, live)
            if kind == "1f1b":  # activation memory bounded by the pipeline depth, not by m
                assert peak <= min(p - s, m)
    with pytest.raises(ValueError, match="not one of"):
        schedule("zb", 0, 2, 2)


def test_interleaved_schedule_is_complete_and_causal():
    from loom.parallel.pipeline import interleaved_schedule

    for p, v, m in itertools.product(range(1, 6), range(1, 4), range(1, 10)):
        per_rank = interleaved_schedule(p, v, m)
        for ops in per_rank:
            assert sorted(ops) == sorted((o, k, i) for o in "FB" for k in range(v) for i in range(m))
            for k, i in itertools.product(range(v), range(m)):
                assert ops.index(("F", k, i)) < ops.index(("B", k, i))
        # replay with blocking receives and non-blocking sends: every rank must finish
        sent, pos = set(), [0] * p
        last = p * v - 1
        while any(pos[r] < len(per_rank[r]) for r in range(p)):
            moved = False
            for r in range(p):
                if pos[r] == len(per_rank[r]):
                    continue
                op, k, i = per_rank[r][pos[r]]
                s = k * p + r
                need = ("F", s - 1, i) if op == "F" and s > 0 else ("B", s + 1, i) if op == "B" and s < last else None
                if need is None or need in sent:
                    sent.add((op, s, i))
                    pos[r] += 1
                    moved = True
            assert moved, (p, v, m, pos)


class Skip(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(4, 4) for _ in range(4))

    def forward(self, x):
        h = self.a(x)
        return self.d(self.c(self.b(h)) + h)


def _twins(cls, seed: int):
    """Two fp64 copies of ``cls()`` with the same seeded weights: one to parallelize, one as the reference."""
    torch.manual_seed(seed)
    model, ref = cls().double(), cls().double()
    ref.load_state_dict(model.state_dict())
    return model, ref


def test_fx_capture_live_sets_carry_skips_hop_by_hop():
    g = capture(Skip())
    assert g.kind == "fx" and g.inputs == ["x"]
    live = g.live_sets([1, 1, len(g.units) - 2])  # a | b | c, add, d
    assert live[0] == ["a"]
    assert live[1] == ["a", "b"]  # the skip crosses stage 1 on its way to stage 2
    assert g.param_costs()[0] == 4 * 4 + 4 + 1


def test_untraceable_model_names_construct_and_fix():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.l = nn.Linear(2, 2)

        def forward(self, x):
            if x.sum() > 0:
                return self.l(x)
            return x

    with pytest.raises(TraceError, match="torch.fx cannot trace DataDependent.*control flow.*Fix"):
        HybridParallel(DataDependent())
    with pytest.raises(TypeError, match="torch.nn.Module or a Keras"):
        HybridParallel(object())


def test_a_registered_graph_source_splits_the_models_it_claims(monkeypatch):
    """capture() asks the registered sources before its own front ends; the partitioner names no library."""
    from loom.parallel import partition

    monkeypatch.setattr(partition, "_GRAPH_SOURCES", {})

    class Opaque(nn.Module):  # untraceable by fx: only its source knows how to split it
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

        def forward(self, x):
            return self.b(self.a(x)) if x.sum() > 0 else x

    with pytest.raises(TraceError, match="registered now: none"):
        capture(Opaque())
    partition.register_graph_source("opaque", lambda m: isinstance(m, Opaque),
                                    lambda m: capture(nn.Sequential(m.a, m.b)))
    g = capture(Opaque())
    assert g.kind == "sequential" and len(g.units) == 2 and partition.graph_sources() == ["opaque"]
    assert capture(Skip()).kind == "fx"  # a model no source claims goes to the built-in front ends
    partition.register_graph_source("opaque", lambda m: False, lambda m: None)  # the same name replaces it
    assert partition.graph_sources() == ["opaque"]
    with pytest.raises(TraceError, match="registered now: opaque"):
        capture(Opaque())
    with pytest.raises(TypeError, match="must be callables"):
        partition.register_graph_source("bad", None, lambda m: None)


def test_config_errors():
    seq = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="schedule='zb'"):
        HybridParallel(seq, schedule="zb")
    with pytest.raises(ValueError, match="micro_batches=0"):
        HybridParallel(seq, micro_batches=0)
    with pytest.raises(ValueError, match="balance='flops'"):
        HybridParallel(seq, balance="flops")
    with pytest.raises(ValueError, match="2 ranks but the communicator"):
        HybridParallel(seq, partitions=2, replicas=1)
    with pytest.raises(ValueError, match="sample_inputs"):
        HybridParallel(seq, balance="time")
    with pytest.raises(ValueError, match="reduce_dp='later' is not True"):
        HybridParallel(seq, reduce_dp="later")
    with pytest.raises(ValueError, match="a grad_hook would never run"):
        HybridParallel(seq, reduce_dp="after", grad_hook=lambda flat, comm, i: flat)
    with pytest.raises(ValueError, match=r"balance=\[1, 2\] must give 1 positive layer counts"):
        split_units(capture(seq), 1, [1, 2])
    hp = HybridParallel(seq, micro_batches=3)
    with pytest.raises(ValueError, match="batch of 4 rows is not divisible by micro_batches=3"):
        hp.train_step(torch.zeros(4, 2), torch.zeros(4, 2), nn.MSELoss())


def test_single_rank_microbatched_equals_plain_torch_and_time_balance():
    model, ref = _twins(Skip, 0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    hp = HybridParallel(model, micro_batches=4, balance="time", sample_inputs=x[:2])
    opt, ropt = torch.optim.Adam(hp.parameters(), lr=0.05), torch.optim.Adam(ref.parameters(), lr=0.05)
    CHECKS.train_against(hp, opt, x, y, ref, ropt, x, y, steps=5, tol=1e-12)
    want = ref.state_dict()
    CHECKS.assert_all_close(hp.state_dict().values(), [want[k] for k in hp.state_dict()], 1e-12)


def test_keras_sequential_single_rank():
    keras = pytest.importorskip("keras")
    keras.utils.set_random_seed(3)
    keras.config.set_floatx("float32")

    def build():
        return keras.Sequential([keras.Input((5,)), keras.layers.Dense(7, activation="relu"),
                                 keras.layers.Dense(7, activation="tanh"), keras.layers.Dense(2)])

    m, ref = build(), build()
    ref.set_weights(m.get_weights())
    g = capture(m)
    assert g.kind == "keras-sequential" and len(g.units) == 3
    x, y = torch.randn(8, 5), torch.randn(8, 2)
    hp = HybridParallel(m, micro_batches=2, schedule="gpipe")
    opt = torch.optim.SGD(hp.parameters(), lr=0.1)
    ropt = torch.optim.SGD([v.value for v in ref.trainable_weights], lr=0.1)
    CHECKS.train_against(hp, opt, x, y, ref, ropt, x, y, steps=5, tol=1e-5)
    CHECKS.assert_all_close(m.get_weights(), ref.get_weights(), 1e-5)


def test_fit_equals_manual_loop_and_validates():
    import loom

    model, ref = _twins(Skip, 1)
    x, y = torch.randn(24, 4, dtype=torch.float64), torch.randn(24, 4, dtype=torch.float64)
    hist = loom.fit(model, (x, y), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1), epochs=2,
                    batch_size=8, micro_batches=2, validation=(x, y), progress=True)
    ropt = torch.optim.SGD(ref.parameters(), lr=0.1)
    losses = []
    for _ in range(2):
        tot = 0.0
        for i in range(0, 24, 8):
            ropt.zero_grad()
            rl = nn.MSELoss()(ref(x[i:i + 8]), y[i:i + 8])
            rl.backward()
            ropt.step()
            tot += rl.item()
        losses.append(tot / 3)
    assert hist.loss == pytest.approx(losses, abs=1e-12)
    with torch.no_grad():
        assert hist.val_loss[-1] == pytest.approx(nn.MSELoss()(ref(x), y).item(), abs=1e-12)
    sd = hist.model.state_dict()
    for k, v in ref.state_dict().items():
        assert (sd[k] - v).abs().max().item() < 1e-12
    with pytest.raises(ValueError, match="needs batch_size"):
        loom.fit(Skip(), (x, y), nn.MSELoss(), torch.optim.SGD, epochs=1)
    with pytest.raises(TypeError, match="one-shot iterator"):
        loom.fit(Skip(), iter([(x, y)]), nn.MSELoss(), functools.partial(torch.optim.SGD, lr=0.1))


def test_train_and_eval_modes_reach_dropout():
    keras = pytest.importorskip("keras")
    keras.config.set_floatx("float32")
    km = keras.Sequential([keras.Input((4,)), keras.layers.Dense(64), keras.layers.Dropout(0.5),
                           keras.layers.Dense(2)])
    tm = nn.Sequential(nn.Linear(4, 64), nn.Dropout(0.5), nn.Linear(64, 2))
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    for model, infer in ((km, lambda: km(x, training=False)), (tm, lambda: tm.eval()(x))):
        hp = HybridParallel(model, micro_batches=2)
        with torch.no_grad():
            want = infer()
            assert (hp.eval_step(x) - want).abs().max().item() < 1e-6  # eval: dropout off
            assert hp.eval_step(x, y, nn.MSELoss()) == pytest.approx(nn.MSELoss()(want, y).item(), rel=1e-5)
        torch.manual_seed(0)
        a = hp.train_step(x, y, nn.MSELoss())
        torch.manual_seed(1)
        b = hp.train_step(x, y, nn.MSELoss())
        assert a != b  # train: dropout on (different masks)


class ShapeBranch(nn.Module):
    """fx cannot trace the shape-dependent `if`; torch.export specialises it to the sample micro-batch."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2)

    def forward(self, x, z):
        h = self.a(x)
        if h.shape[0] > 1:
            h = h + torch.tanh(self.b(h))
        return self.c(h * z) + h[:, :2]


def test_torch_export_fallback_with_sample_inputs():
    model, ref = _twins(ShapeBranch, 2)
    x, z, y = (torch.randn(8, d, dtype=torch.float64) for d in (4, 4, 2))
    with pytest.raises(TraceError, match="sample_inputs="):
        HybridParallel(model, micro_batches=2)
    hp = HybridParallel(model, micro_batches=2, sample_inputs=(x[:4], z[:4]))
    assert hp.graph.kind == "export"
    # parameter reads sit right before their users, so every unit owning a weight also computes
    assert all(n.label.endswith("(attribute)") is False for n in hp.graph.nodes[-1:])
    opt, ropt = torch.optim.SGD(hp.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    assert len(list(hp.parameters())) == 6
    for _ in range(3):
        opt.zero_grad()
        loss = hp.train_step((x, z), y, nn.MSELoss())
        opt.step()
        ropt.zero_grad()
        rl = nn.MSELoss()(ref(x, z), y)
        rl.backward()
        ropt.step()
        assert abs(loss - rl.item()) < 1e-12
    for k, v in ref.state_dict().items():
        assert (hp.state_dict()[k] - v).abs().max().item() < 1e-12


def test_train_step_returns_the_loss_on_the_device_without_a_host_read(monkeypatch):
    """On CUDA a host read per step waits for the whole step: the loss comes back as a float64 scalar tensor on
    the parameters' device, which ``loom train`` reads once with the gradient norm."""
    model, ref = _twins(Skip, 0)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    hp = HybridParallel(model, micro_batches=2, sample_inputs=x[:2])

    def no_item(self):
        raise AssertionError("train_step read a tensor on the host (.item())")

    monkeypatch.setattr(torch.Tensor, "item", no_item)
    loss = hp.train_step(x, y, nn.MSELoss())
    monkeypatch.undo()
    assert isinstance(loss, torch.Tensor) and loss.shape == () and loss.dtype == torch.float64
    assert loss.device == next(hp.parameters()).device
    assert abs(float(loss) - nn.MSELoss()(ref(x), y).item()) < 1e-12
