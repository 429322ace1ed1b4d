"""Learned link capacities (loom.multipath.links) on synthetic timings: a fluid model of the links stands in
for the network, so the estimator and the re-planning it triggers are tested without the testbed
(tests/integration/test_testbed_degrade.py runs the same loop over real rate-limited links)."""

from __future__ import annotations

import numpy as np
import pytest

from loom.multipath import demand_matrix, plan, preset
from loom.multipath.links import LinkMonitor, rail_shares
from loom.multipath.paths import path_table

# Steps (measured calls) within which a halved rail must lose traffic, and regain it once restored: at
# smoothing 0.5 one sample takes a halved link's estimate to 0.75, past the 5 % re-plan threshold, and the
# next plans follow it down (links.py).
WITHIN = 3


def _link_times(mon, pl, true_cap: np.ndarray, overhead: float, rng) -> np.ndarray:
    """The monitor's per-link seconds in a fluid model: every link drains its bytes at its true capacity, a
    message (one per path used) arrives when the slowest link of its path is drained, and the whole call is
    ``overhead`` times slower (protocol, software) with 2 % noise per message."""
    c = pl.cands
    drain = pl.loads / true_cap
    rows = [c.links[j] for j in range(len(c.pair_of)) if pl.flows[j] > 0]
    rows += list(path_table(pl.topology).static[c.fixed_pairs])
    paths = [r[r >= 0] for r in rows]
    arrived = [drain[e].max() * overhead * (1 + 0.02 * rng.standard_normal()) for e in paths]
    return mon.last_arrivals(pl.loads, paths, arrived)


def _run(topo, D, true_caps, *, seed=0, **kw):
    """Plan, measure and re-plan once per step under ``true_caps[step]``; the rail shares and monitors."""
    mon = LinkMonitor(topology=topo, **kw)
    rng = np.random.default_rng(seed)
    shares, versions = [], []
    for cap in true_caps:
        pl = mon.plan = plan(topo, D, previous=mon.plan, capacity=mon.capacity)
        shares.append(rail_shares(pl))
        mon.observe(pl.loads, _link_times(mon, pl, cap, 1.3, rng))
        versions.append(mon.version)
    return np.array(shares), versions, mon


def _testbed():
    topo = preset("testbed")  # 2 nodes x 2 ranks, 2 rails at 1 Gbit/s, intra 10 Gbit/s
    return topo, demand_matrix(topo.size, "hot-pair", 16 << 20)


def _rail_links(topo, k):
    return np.array([f"rail{k}" in lk.name.split(">") for lk in topo.links])


def test_halved_rail_loses_traffic_within_steps_and_regains_it():
    topo, D = _testbed()
    c0 = topo.capacity
    slow = np.where(_rail_links(topo, 0), c0 / 2, c0)
    n = 8
    shares, versions, mon = _run(topo, D, [c0] * n + [slow] * n + [c0] * n)
    before, during, after = shares[:n, 0], shares[n:2 * n, 0], shares[2 * n:, 0]
    # Balanced, and stable: noise and overhead alone may start a new version, but the planner's hysteresis
    # keeps the plan in force.
    assert np.allclose(before, before[0], atol=0.01) and 0.45 <= before[0] <= 0.55, before
    # The halved rail's share drops toward the optimum 1/3 within WITHIN steps and stays there.
    assert (during[WITHIN:] <= 0.40).all(), during
    assert (after[WITHIN:] >= 0.45).all(), after


def test_lightly_loaded_links_keep_their_capacity():
    topo, D = _testbed()
    c0 = topo.capacity
    slow = np.where(_rail_links(topo, 0), c0 / 2, c0)
    _, _, mon = _run(topo, D, [slow] * 6)
    intra = np.array([lk.kind == "intra" for lk in topo.links])
    # Intra links (10x the rails) finish when their messages' rail lets them: slow, but never the bottleneck.
    assert np.allclose(mon.health[intra], 1.0)
    hit = _rail_links(topo, 0) & (mon.health < 1)
    assert hit.any() and np.allclose(mon.health[hit], 0.5, atol=0.08), mon.health[hit]
    assert np.allclose(mon.health[_rail_links(topo, 1)], 1.0, atol=0.05)


def test_uniform_slowdown_changes_nothing():
    topo, D = _testbed()
    shares, versions, _ = _run(topo, D, [topo.capacity * 0.3] * 6)
    assert np.allclose(shares, shares[0], atol=0.01), shares


def test_h100_halved_rail_sheds_traffic():
    topo = preset("h100", nodes=2)
    D = demand_matrix(topo.size, "zipf-pairs:1.5", 16 << 20, seed=0)
    c0 = topo.capacity
    names = [lk.name.split(">") for lk in topo.links]
    slow = np.where([any(v.endswith("nic1") or v == "rail1" for v in ns) for ns in names], c0 / 2, c0)
    shares, versions, _ = _run(topo, D, [c0] * 4 + [slow] * 6)
    assert np.allclose(shares[:4, 1], shares[0, 1], atol=0.01), shares[:4, 1]
    assert shares[4 + WITHIN:, 1].max() < shares[3, 1] - 0.03, shares[:, 1]


def test_monitor_and_capacity_validation():
    topo, _ = _testbed()
    for kw in ({"smoothing": 0}, {"critical": 1.5}, {"replan": 0}, {"every": 0}):
        with pytest.raises(ValueError):
            LinkMonitor(topology=topo, **kw)
    mon = LinkMonitor(topology=topo)
    with pytest.raises(ValueError, match="one entry per"):
        mon.observe(np.ones(3), np.ones(3))
    with pytest.raises(ValueError, match="bytes/s > 0"):
        plan(topo, np.ones((topo.size, topo.size)), capacity=np.zeros(len(topo.links)))


def test_plan_for_other_capacities_is_not_reused():
    topo, D = _testbed()
    first = plan(topo, D)
    cap = topo.capacity.copy()
    cap[_rail_links(topo, 0)] /= 2
    again = plan(topo, D, previous=first, capacity=cap)
    assert again.method != "mwu(reused)"
    assert rail_shares(again)[0] < rail_shares(first)[0] - 0.05
