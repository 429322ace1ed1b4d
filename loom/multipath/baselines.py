"""What multi-path balancing is measured against: the static route, ECMP hashing, even rail striping, and
the exact LP optimum (for validating the planner, not for run time).

* ``single_path``: every byte of a pair on its static route (what MPI and NCCL do).
* ``ecmp``: each pair hashed (CRC32 of ``"s->d"``) onto one of its candidate paths between nodes, as a
  switch hashes flows onto equal-cost paths; within a node, the static route.
* ``stripe``: every inter-node pair split evenly over all its rail-matched paths; within a node, static.
* ``lp_optimum``: the minimum congestion over the same candidate paths, by ``scipy.optimize.linprog``
  (HiGHS): variables ``f_p >= 0`` and ``lambda``; ``sum_p f_p = D`` per pair; ``load_e <= lambda c_e``.
"""

from __future__ import annotations

import time
import zlib

import numpy as np

from .planner import Candidates, Plan, _static_flows, candidates, plan_from_flows
from .topology import Topology

__all__ = ["single_path", "ecmp", "stripe", "lp_optimum", "BASELINES"]


def _inter(c: Candidates) -> np.ndarray:
    node = np.asarray(c.topology.node_of)
    return node[c.pairs[:, 0]] != node[c.pairs[:, 1]] if len(c.pairs) else np.zeros(0, dtype=bool)


def _plan_by_rule(topology: Topology, demand: np.ndarray, name: str, flows) -> Plan:
    """The plan with bytes per path ``flows(c)`` over the candidates ``c``; its time includes finding the
    candidates, as the planner's does."""
    t0 = time.perf_counter()
    c = candidates(topology, demand)
    return plan_from_flows(c, flows(c), name, time.perf_counter() - t0)


def _ecmp_flows(c: Candidates) -> np.ndarray:
    f = np.zeros(len(c.pair_of))
    inter = _inter(c)
    for i, (s, d) in enumerate(c.pairs.tolist()):
        k = int(c.ptr[i + 1] - c.ptr[i])
        j = zlib.crc32(f"{s}->{d}".encode()) % k if inter[i] else 0
        f[c.ptr[i] + j] = c.volume[i]
    return f


def _stripe_flows(c: Candidates) -> np.ndarray:
    f = np.zeros(len(c.pair_of))
    inter = _inter(c)
    for i in range(len(c.volume)):
        a, b = int(c.ptr[i]), int(c.ptr[i + 1])
        if inter[i]:
            f[a:b] = c.volume[i] / (b - a)
        else:
            f[a] = c.volume[i]
    return f


def single_path(topology: Topology, demand: np.ndarray) -> Plan:
    """All bytes on the static route."""
    return _plan_by_rule(topology, demand, "single-path", _static_flows)


def ecmp(topology: Topology, demand: np.ndarray) -> Plan:
    """One hashed path per pair between nodes (CRC32 of ``"s->d"``), static within a node."""
    return _plan_by_rule(topology, demand, "ecmp", _ecmp_flows)


def stripe(topology: Topology, demand: np.ndarray) -> Plan:
    """Inter-node pairs split evenly over every rail path; intra-node pairs static."""
    return _plan_by_rule(topology, demand, "stripe", _stripe_flows)


def lp_optimum(topology: Topology, demand: np.ndarray, *, max_paths: int = 200_000) -> Plan:
    """The exact minimum-congestion split over the candidate paths (HiGHS; the one baseline that needs scipy,
    imported here so that the planner and the training job run without it).

    Raises:
        ValueError: more than ``max_paths`` candidate paths (the LP would not fit this machine's time).
        RuntimeError: HiGHS did not find the optimum.
    """
    import scipy.sparse as sp
    from scipy.optimize import linprog

    t0 = time.perf_counter()
    c = candidates(topology, demand)
    n = len(c.pair_of)
    if n > max_paths:
        raise ValueError(f"LP over {n} candidate paths exceeds max_paths={max_paths}; use fewer nodes for the "
                         f"LP or raise max_paths")
    if n == 0:
        return plan_from_flows(c, np.zeros(0), "lp", time.perf_counter() - t0)
    scale = float(c.volume.max())
    cap = topology.capacity
    finite = np.nonzero(np.isfinite(cap))[0]
    # Capacities normalised so that lambda is O(1): seconds * cap_scale.
    cap_scale = float(cap[finite].max()) if len(finite) else 1.0
    incT = c.incidence.T.tocsr()[finite]                      # links x paths
    a_ub = sp.hstack([incT, sp.csr_matrix(-(cap[finite] / cap_scale)[:, None])], format="csr")
    b_ub = np.zeros(len(finite))
    a_eq = sp.csr_matrix((np.ones(n), (c.pair_of, np.arange(n))), shape=(len(c.volume), n))
    a_eq = sp.hstack([a_eq, sp.csr_matrix((len(c.volume), 1))], format="csr")
    b_eq = c.volume / scale
    cost = np.zeros(n + 1)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=b_eq, bounds=[(0, None)] * (n + 1),
                  method="highs")
    if res.status != 0:
        raise RuntimeError(f"linprog (HiGHS) failed: {res.message}")
    f = np.maximum(res.x[:n], 0) * scale
    # Renormalise tiny solver residue so each pair sums to its demand exactly.
    sums = np.bincount(c.pair_of, weights=f, minlength=len(c.volume))
    f *= (c.volume / np.where(sums > 0, sums, 1.0))[c.pair_of]
    return plan_from_flows(c, f, "lp", time.perf_counter() - t0)


BASELINES = {"single-path": single_path, "ecmp": ecmp, "stripe": stripe, "lp": lp_optimum}
