"""loom.multipath: execution-time multi-path balancing for skewed all-to-allv (NIMBLE).

>>> from loom.multipath import preset, plan, alltoallv
>>> topo = preset("testbed")                     # 2 nodes x 2 ranks, 2 rails at 1 Gbit/s
>>> p = plan(topo, demand_bytes)                 # min-congestion split of every pair over its paths
>>> out, rc = alltoallv(x, send_counts, comm, topology=topo)   # drop-in for comm.alltoallv
>>> mon = LinkMonitor(topology=topo)             # capacities learned from the traffic, re-plans when a link slows
>>> out, rc = alltoallv(x, send_counts, comm, topology=topo, monitor=mon)
"""

from .baselines import BASELINES, ecmp, lp_optimum, single_path, stripe
from .demand import SKEWS, demand_matrix, parse_skew
from .links import LinkMonitor, rail_shares
from .planner import Plan, plan
from .relay import alltoallv
from .simulate import SimResult, simulate
from .topology import PRESETS, Link, Path, Topology, preset

__all__ = [
    "BASELINES",
    "PRESETS",
    "SKEWS",
    "Link",
    "LinkMonitor",
    "Path",
    "Plan",
    "SimResult",
    "Topology",
    "alltoallv",
    "demand_matrix",
    "ecmp",
    "lp_optimum",
    "parse_skew",
    "plan",
    "preset",
    "rail_shares",
    "simulate",
    "single_path",
    "stripe",
]
