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
    for q, r in zip(pid.tolist(), rows.tolist()):
        s, d = divmod(q, p)
        want = ref.paths(s, d)
        assert int(table.k[r]) == len(want), (s, d)
        for j, w in enumerate(want):
            assert table.path(r, j) == w, (s, d, j)
        st = table.static[q]
        assert tuple(st[st >= 0].tolist()) == ref._links_of(ref.static_route(s, d)), (s, d)
