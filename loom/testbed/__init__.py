"""loom.testbed: an emulated multi-node, multi-rail cluster on one machine (network namespaces + tc; root).

>>> from loom.testbed import Testbed
>>> with Testbed(nodes=2, ranks_per_node=2, rails=2, rail_gbit=1, intra_gbit=10) as tb:
...     tb.run([sys.executable, "my_bench.py"], timeout=120)     # 4 MPI ranks over rate-limited links

``topology_dict(spec)`` exports the same topology for the multi-path planner (schema in
:mod:`loom.testbed.topology`). The command line is ``loom testbed run|check|show|clean``.
"""

from .netns import (NAME_PREFIX, Testbed, TestbedError, TestbedUnavailable, clean, leftovers, preflight, rank_env,
                    set_rail_rate)
from .topology import RankInfo, Route, TestbedSpec, current_topology, ranks, routes, static_path, topology_dict

__all__ = [
    "NAME_PREFIX",
    "RankInfo",
    "Route",
    "Testbed",
    "TestbedError",
    "TestbedSpec",
    "TestbedUnavailable",
    "clean",
    "current_topology",
    "leftovers",
    "preflight",
    "rank_env",
    "ranks",
    "routes",
    "set_rail_rate",
    "static_path",
    "topology_dict",
]
