"""The vectorised path enumeration (loom.multipath._enumerate) equals the per-pair reference
(Topology.paths, Topology.static_route) on every ordered pair of several topologies."""

from __future__ import annotations

import numpy as np
import pytest

from loom.multipath import Topology, preset
from loom.multipath.paths import path_table
from loom.multipath.topology import _rail_cluster
from loom.testbed import TestbedSpec, topology_dict


def _detected_like():
    """The testbed's dict without its routes (as loom.multipath.detect builds it: default static rule)."""
    d = topology_dict(TestbedSpec(nodes=3, ranks_per_node=2, rails=2))
    return Topology.from_dict({k: v for k, v in d.items() if k != "routes"}, name="auto")


TOPOLOGIES = {
    "h100x2": lambda: preset("h100", nodes=2),
    "h100x3-2rails": lambda: preset("h100", nodes=3, rails=2),
    "mesh": lambda: preset("mesh", nodes=2),
    "testbed-routes": lambda: preset("testbed", nodes=3, ranks_per_node=2, rails=2),
    "testbed-1x": lambda: preset("testbed", nodes=2, ranks_per_node=1, rails=1),
    "auto": _detected_like,
    "shm": lambda: preset("shm"),
    "odd-shared-nics": lambda: _rail_cluster("odd", nodes=3, ranks_per_node=5, rails=2, rail_bw=1.0, intra_bw=4.0,
                                             intra="switch", nic_bw=2.0),
    "mesh-3rails": lambda: _rail_cluster("m3", nodes=2, ranks_per_node=6, rails=3, rail_bw=1.0, intra_bw=2.0,
                                         intra="mesh"),
}


@pytest.mark.parametrize("name", list(TOPOLOGIES))
def test_table_equals_reference(name):
    fast, ref = TOPOLOGIES[name](), TOPOLOGIES[name]()
    p = fast.size
    pid = np.array([s * p + d for s in range(p) for d in range(p) if s != d])
    table = path_table(fast)
    rows = table.ensure(pid[::-1].copy())[::-1]  # any order of first sight
    _assert_table_matches(fast, ref, pid, rows)


@pytest.mark.parametrize("name", ["h100x2", "testbed-routes", "odd-shared-nics"])
def test_table_grows_over_many_batches(name):
    """Pairs met a few at a time over many steps (the table grows with room to spare, and wider when a batch
    has more paths or longer ones) give the same table as one batch."""
    fast, ref = TOPOLOGIES[name](), TOPOLOGIES[name]()
    p = fast.size
    pid = np.array([s * p + d for s in range(p) for d in range(p) if s != d])
    node = np.asarray(fast.node_of)
    same = node[pid // p] == node[pid % p]
    intra, inter = pid[same], pid[~same]
    table = path_table(fast)
    for chunk in [intra[:1], inter[:3], intra[1:5], *np.array_split(inter[3:], 7), intra[5:]]:
        if len(chunk):
            table.ensure(chunk.copy())
    assert table.n == len(pid) and len(table.k) >= table.n
    _assert_table_matches(fast, ref, pid, table.slot[pid])


def _assert_table_matches(fast, ref, pid, rows):
    table, p = path_table(fast), fast.size
    for q, r in zip(pid.tolist(), rows.tolist()):
        s, d = divmod(q, p)
        want = ref.paths(s, d)
        assert int(table.k[r]) == len(want), (s, d)
        for j, w in enumerate(want):
            assert table.path(r, j) == w, (s, d, j)
        st = table.static[q]
        assert tuple(st[st >= 0].tolist()) == ref._links_of(ref.static_route(s, d)), (s, d)


@pytest.mark.parametrize("name", ["h100x2", "testbed-routes", "odd-shared-nics"])
def test_candidates_split_flexible_and_fixed_pairs(name):
    """The one-pass split of the demand: pairs at or above min_bytes flexible with all their paths, the rest
    fixed on their static routes and summed into the per-link base load; the diagonal ignored."""
    from loom.multipath.paths import candidates

    t, ref = TOPOLOGIES[name](), TOPOLOGIES[name]()
    p = t.size
    rng = np.random.default_rng(7)
    D = rng.exponential(1.0, (p, p)) * (rng.random((p, p)) < 0.7)
    D[0, 1] = 0.5  # exactly at the threshold: flexible
    D[1, 1] = 9.0  # local
    c = candidates(t, D, min_bytes=0.5)
    flex = [(s, d) for s in range(p) for d in range(p) if s != d and D[s, d] >= 0.5]
    fixed = [(s, d) for s in range(p) for d in range(p) if s != d and 0 < D[s, d] < 0.5]
    assert [tuple(x) for x in c.pairs.tolist()] == flex
    np.testing.assert_array_equal(c.volume, [D[s, d] for s, d in flex])
    assert c.fixed_pairs.tolist() == [s * p + d for s, d in fixed]
    np.testing.assert_array_equal(c.fixed_volume, [D[s, d] for s, d in fixed])
    base = np.zeros(len(t.links))
    for s, d in fixed:
        for e in ref._links_of(ref.static_route(s, d)):
            base[e] += D[s, d]
    np.testing.assert_allclose(c.base, base, rtol=1e-12)
    for bad in (np.nan, -1.0, np.inf):
        E = D.copy()
        E[p - 1, p - 1] = bad  # checked on the diagonal too
        with pytest.raises(ValueError, match="negative or non-finite"):
            candidates(t, E)
    with pytest.raises(ValueError, match="shape"):
        candidates(t, D[:, :-1])


def test_planner_runs_without_scipy():
    """scipy is imported only by the LP baseline and the simulator: loom.multipath imports and plans without it
    (a GPU machine's python may lack it), and the LP then names it."""
    import subprocess
    import sys

    from loom.testing import ROOT

    code = """
import sys
sys.modules["scipy"] = None  # import scipy now fails, as where it is not installed
import numpy as np
from loom.multipath import lp_optimum, plan, preset
topo = preset("testbed")
demand = np.arange(16, dtype=float).reshape(4, 4) * 1e6
np.fill_diagonal(demand, 0)
p = plan(topo, demand)
assert p.congestion > 0, p
try:
    lp_optimum(topo, demand)
except ImportError as e:
    print("lp needs scipy:", e)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "lp needs scipy: " in proc.stdout and "scipy" in proc.stdout.split(":", 1)[1], proc.stdout
