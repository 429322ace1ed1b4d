"""The execution-time planner: split every pair's bytes over its candidate paths to minimise congestion.

Problem (NIMBLE section 4, capacity-normalised minimum congestion): demand ``D[s, d]`` bytes, candidate paths
``P(s, d)`` from :meth:`Topology.paths`, directed links ``e`` of capacity ``c_e`` bytes/s. Choose flows
``f_p >= 0`` with ``sum_{p in P(s,d)} f_p = D[s, d]`` minimising the congestion
``lambda = max_e load_e / c_e`` -- the seconds the busiest link needs, a lower bound on completion time.

Method (:func:`plan`; multiplicative weights in the Garg-Koenemann family, made deterministic):

1. Start from the static routes (every byte on path 0). Pairs below ``min_bytes`` stay there for good
   (splitting a small message costs more in per-message latency than it saves; NIMBLE uses ~1 MB).
2. ``increments`` rounds. Each round weights every link multiplicatively by its utilisation,
   ``w_e = exp(eta * (u_e - 1))`` with ``u_e = load_e / (c_e * lambda)`` and ``eta = ln(#links) / epsilon``,
   so the busiest links dominate. A path's cost is its *bottleneck*: ``max_{e in p} w_e / c_e`` (the data
   path is pipelined, so the slowest hop sets the rate); the sum over the path breaks ties, then the path
   order (static first). Every pair's best path gets a step ``gamma`` of its demand, ``gamma`` chosen by an
   exact line search on the exponential potential ``sum_e exp(eta * u_e)`` (a smooth maximum of the link
   utilisations), so congestion never oscillates between rounds.
3. The best round's flows are kept. Hysteresis: when they beat the static routes by less than
   ``hysteresis`` (or a ``previous`` plan, re-applied to this demand, by less than that), the old routing is
   returned unchanged -- balanced traffic stays on the direct routes, and re-planning does not flap.

Everything runs on numpy arrays in a fixed order, so every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import scipy.sparse as sp

from .topology import Path, Topology

__all__ = ["Candidates", "Plan", "plan", "candidates", "plan_from_flows"]


@dataclass(slots=True)
class Candidates:
    """The flattened path choices of every pair with demand (internal to planners, shared by baselines)."""

    topology: Topology
    demand: np.ndarray
    """``(P, P)`` bytes."""
    pairs: np.ndarray
    """``(n, 2)`` ordered pairs with demand, row-major order."""
    volume: np.ndarray
    """``(n,)`` bytes per pair."""
    paths: list[Path]
    """Every candidate path, grouped by pair."""
    pair_of: np.ndarray
    """``(n_paths,)`` pair index of each path."""
    ptr: np.ndarray
    """``(n + 1,)`` path offsets per pair."""
    incidence: sp.csr_matrix
    """``(n_paths, n_links)`` 1 where a path uses a link."""
    grid: np.ndarray
    """``(n, k_max)`` path indices per pair padded with -1."""


def candidates(topology: Topology, demand: np.ndarray) -> Candidates:
    """Enumerate the candidate paths of every pair with positive demand (diagonal excluded)."""
    D = _check_demand(topology, demand)
    src, dst = np.nonzero(D)
    keep = src != dst
    src, dst = src[keep], dst[keep]
    paths: list[Path] = []
    ptr = [0]
    cols: list[int] = []
    rowptr = [0]
    for s, d in zip(src.tolist(), dst.tolist()):
        ps = topology.paths(s, d)
        for p in ps:
            paths.append(p)
            cols.extend(p.links)
            rowptr.append(len(cols))
        ptr.append(len(paths))
    ptr_a = np.asarray(ptr, dtype=np.int64)
    counts = np.diff(ptr_a)
    pair_of = np.repeat(np.arange(len(src)), counts)
    inc = sp.csr_matrix((np.ones(len(cols)), np.asarray(cols, dtype=np.int64), np.asarray(rowptr, dtype=np.int64)),
                        shape=(len(paths), len(topology.links)))
    kmax = int(counts.max()) if len(counts) else 1
    grid = np.full((len(src), kmax), -1, dtype=np.int64)
    if len(paths):
        within = np.arange(len(paths)) - ptr_a[pair_of]
        grid[pair_of, within] = np.arange(len(paths))
    return Candidates(topology=topology, demand=D, pairs=np.stack([src, dst], axis=1) if len(src) else
                      np.zeros((0, 2), dtype=np.int64), volume=D[src, dst].astype(np.float64), paths=paths,
                      pair_of=pair_of, ptr=ptr_a, incidence=inc, grid=grid)


def _check_demand(topology: Topology, demand) -> np.ndarray:
    D = np.asarray(demand, dtype=np.float64)
    p = topology.size
    if D.shape != (p, p):
        raise ValueError(f"demand has shape {D.shape} but topology {topology.name!r} has {p} ranks; "
                         f"give a ({p}, {p}) matrix of bytes (row = source rank)")
    if not np.all(np.isfinite(D)) or (D < 0).any():
        raise ValueError("demand has negative or non-finite entries; bytes are finite and >= 0")
    return D


@dataclass(slots=True)
class Plan:
    """Flows per candidate path and the link loads they cause."""

    cands: Candidates
    flows: np.ndarray
    """``(n_paths,)`` bytes per candidate path."""
    method: str
    seconds: float = 0.0
    """Wall time spent planning."""
    loads: np.ndarray = field(init=False)
    """Bytes per directed link (:attr:`Topology.links` order)."""

    def __post_init__(self) -> None:
        self.loads = np.asarray(self.cands.incidence.T @ self.flows).ravel() if len(self.flows) else \
            np.zeros(len(self.cands.topology.links))

    @property
    def topology(self) -> Topology:
        return self.cands.topology

    @property
    def demand(self) -> np.ndarray:
        return self.cands.demand

    @property
    def utilization(self) -> np.ndarray:
        """Seconds of traffic per link (``load / capacity``; 0 for unlimited links)."""
        return self.loads / self.topology.capacity

    @property
    def congestion(self) -> float:
        """The busiest link's seconds: ``max_e load_e / c_e`` (a lower bound on completion time)."""
        u = self.utilization
        return float(u.max()) if len(u) else 0.0

    def splits(self, s: int, d: int) -> list[tuple[Path, float]]:
        """``[(path, bytes), ...]`` of the pair in path order, zero flows left out."""
        c = self.cands
        hit = np.nonzero((c.pairs[:, 0] == s) & (c.pairs[:, 1] == d))[0]
        if not len(hit):
            return []
        i = int(hit[0])
        return [(c.paths[j], float(self.flows[j])) for j in range(c.ptr[i], c.ptr[i + 1]) if self.flows[j] > 0]

    def fractions(self) -> np.ndarray:
        """Share of its pair's demand on each candidate path (sums to 1 per pair)."""
        c = self.cands
        return self.flows / np.where(c.volume[c.pair_of] > 0, c.volume[c.pair_of], 1.0)

    def check(self, rtol: float = 1e-9) -> None:
        """Raise ``ValueError`` unless flows are >= 0 and each pair's flows sum to its demand."""
        c = self.cands
        if (self.flows < -rtol * max(1.0, float(c.volume.max(initial=0)))).any():
            raise ValueError(f"plan {self.method}: negative flow")
        sums = np.bincount(c.pair_of, weights=self.flows, minlength=len(c.volume))
        bad = np.abs(sums - c.volume) > rtol * np.maximum(c.volume, 1.0)
        if bad.any():
            i = int(np.nonzero(bad)[0][0])
            raise ValueError(f"plan {self.method}: pair {tuple(c.pairs[i])} routes {sums[i]} of {c.volume[i]} bytes")

    def moved_fraction(self) -> float:
        """Share of all bytes not on the static route."""
        c = self.cands
        on_static = self.flows[c.ptr[:-1]].sum() if len(c.volume) else 0.0
        total = c.volume.sum()
        return float(1 - on_static / total) if total else 0.0


def plan_from_flows(cands: Candidates, flows: np.ndarray, method: str, seconds: float = 0.0) -> Plan:
    return Plan(cands=cands, flows=np.asarray(flows, dtype=np.float64), method=method, seconds=seconds)


def _static_flows(c: Candidates) -> np.ndarray:
    f = np.zeros(len(c.paths))
    if len(c.volume):
        f[c.ptr[:-1]] = c.volume
    return f


def _line_search(L0: np.ndarray, L1: np.ndarray, inv_c: np.ndarray, eta: float, lam: float) -> float:
    """``argmin_{g in [0,1]} sum_e exp(eta * ((1-g) L0 + g L1)_e / (c_e lam))``: the potential is convex in
    ``g``, so bisect on the sign of its derivative (60 halvings: exact to float precision)."""
    a = L0 * inv_c / lam
    b = (L1 - L0) * inv_c / lam
    live = b != 0
    if not live.any():
        return 0.0
    a, b = a[live], b[live]
    top = float(np.maximum(a, a + b).max())

    def slope(g: float) -> float:
        return float((b * np.exp(eta * (a + g * b - top))).sum())

    if slope(0.0) >= 0:
        return 0.0
    if slope(1.0) <= 0:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if slope(mid) < 0:
            lo = mid
        else:
            hi = mid
    return lo


def plan(
    topology: Topology,
    demand: np.ndarray | Sequence[Sequence[float]],
    *,
    epsilon: float = 0.05,
    increments: int = 32,
    min_bytes: float = 1 << 20,
    hysteresis: float = 0.05,
    previous: Plan | None = None,
) -> Plan:
    """Plan multi-path routes for ``demand`` (bytes, ``(P, P)``, row = source) on ``topology``.

    Args:
        topology: ranks, links and candidate paths.
        demand: bytes from every rank to every rank (the diagonal is local and ignored).
        epsilon: accuracy of the multiplicative weights (``eta = ln(#links) / epsilon``); smaller follows the
            bottleneck more sharply.
        increments: rounds of re-routing (each moves a line-searched share of every pair's demand).
        min_bytes: pairs with less demand keep their static route.
        hysteresis: keep the static routes (or ``previous``) unless the new plan's congestion is lower by
            more than this fraction.
        previous: the plan in force; its per-pair path shares are re-applied to ``demand`` for the
            hysteresis test.

    Returns:
        A feasible :class:`Plan` (every pair's flows sum to its demand).
    """
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0 (typical 0.02-0.2)")
    if not isinstance(increments, int) or increments < 0:
        raise ValueError(f"increments={increments!r} must be an int >= 0")
    if not hysteresis >= 0:
        raise ValueError(f"hysteresis={hysteresis} must be >= 0")
    t0 = time.perf_counter()
    c = candidates(topology, demand)
    static = _static_flows(c)
    x = static.copy()
    inc = c.incidence
    cap = topology.capacity
    inv_c = np.where(np.isfinite(cap), 1.0 / cap, 0.0)
    flexible = (c.volume >= min_bytes) & (np.diff(c.ptr) > 1)
    n_links = max(len(cap), 2)
    eta = math.log(n_links) / epsilon
    best_x, best_lam = x, _congestion(inc, x, inv_c)
    if flexible.any() and best_lam > 0:
        # Warm start: each flexible pair's demand split evenly over its candidate paths, when that is less
        # congested than the static routes. On large clusters the rounds alone, each moving flow between
        # two paths per pair, did not get from the static routes to even striping (32 nodes x 8 ranks,
        # zipf-pairs: 3.8 s against striping's 2.5 s).
        k = np.diff(c.ptr).astype(np.float64)
        even = np.where(flexible[c.pair_of], c.volume[c.pair_of] / k[c.pair_of], static)
        even_lam = _congestion(inc, even, inv_c)
        if even_lam < best_lam:
            x, best_x, best_lam = even, even, even_lam
        grid = c.grid[flexible]
        fixed = np.zeros(len(x))
        fixed_pairs = ~flexible
        sel = np.zeros(len(x), dtype=bool)
        sel[c.ptr[:-1][fixed_pairs]] = True
        fixed[sel] = static[sel]
        # Indices into the CSR data for the bottleneck (max) and sum of each path's link costs.
        starts = inc.indptr[:-1]
        # Small instances (every run-time plan of a job's alltoallv) use dense arrays: ~20x fewer overheads.
        dense = inc.shape[0] * inc.shape[1] <= 100_000
        if dense:
            inc = inc.toarray()
        rows = np.arange(len(grid))
        valid = grid >= 0
        safe = np.maximum(grid, 0)
        for it in range(increments):
            # Continuation: start smooth (eta = ln m) and sharpen to the target over the first half of the
            # rounds; a steep potential from the start makes the first Newton steps needlessly short.
            frac = min(1.0, 2.0 * (it + 1) / max(increments, 1))
            eta = math.log(n_links) / (epsilon ** frac)
            L = np.asarray(inc.T @ x).ravel()
            u = L * inv_c
            lam = float(u.max())
            if lam <= 0:
                break
            scale = eta * inv_c / lam
            wexp = np.exp(eta * (u / lam - 1.0))
            w = wexp * inv_c                       # multiplicative link weights (per byte)
            g1, g2 = scale * wexp, scale * scale * wexp   # the potential's gradient and curvature per link
            if dense:
                bottleneck = (inc * w).max(axis=1)
                grad = inc @ g1
            else:
                bottleneck = np.maximum.reduceat(w[inc.indices], starts)
                grad = np.add.reduceat(g1[inc.indices], starts)
            step = None
            # Directions, first that lowers the potential wins: NIMBLE's bottleneck cost (ties broken by
            # the gradient), then the potential's own gradient when a shared bottleneck stalls it.
            for cost in (bottleneck + 1e-9 * grad / max(float(grad.max()), 1e-300), grad):
                best = grid[rows, np.argmin(np.where(valid, cost[safe], np.inf), axis=1)]
                # Shift flow from each pair's costliest used path (by gradient) to its best one, by the
                # amount a Newton step on the potential gives for that pair alone (Jacobi), clipped.
                used = np.where(valid & (x[safe] > 0), grad[safe], -np.inf)
                worst = grid[rows, np.argmax(used, axis=1)]
                dm = inc[best] - inc[worst]
                d1 = dm @ g1
                d2 = (dm * dm if dense else dm.multiply(dm)) @ g2
                t = np.where((best != worst) & (d1 < 0), -d1 / np.maximum(d2, 1e-300), 0.0)
                t = np.minimum(t, x[worst])
                if not (t > 0).any():
                    continue
                y = x.copy()
                np.add.at(y, worst, -t)
                np.add.at(y, best, t)
                Ly = np.asarray(inc.T @ y).ravel()
                g = _line_search(L, Ly, inv_c, eta, lam)
                if g > 0:
                    step = (g, y)
                    break
            if step is None:
                break
            g, y = step
            x = np.maximum((1 - g) * x + g * y, 0.0)
            lam_x = _congestion(inc, x, inv_c)
            if lam_x < best_lam:
                best_x, best_lam = x.copy(), lam_x
    chosen, method = best_x, "mwu"
    inc = c.incidence
    static_lam = _congestion(inc, static, inv_c)
    if best_lam >= static_lam / (1 + hysteresis):
        chosen, method = static, "mwu(static)"
    if previous is not None and _same_shape(previous.cands, c):
        prev = previous.fractions() * c.volume[c.pair_of]
        prev_lam = _congestion(inc, prev, inv_c)
        if prev_lam <= _congestion(inc, chosen, inv_c) * (1 + hysteresis):
            chosen, method = prev, "mwu(previous)"
    return Plan(cands=c, flows=chosen, method=method, seconds=time.perf_counter() - t0)


def _same_shape(a: Candidates, b: Candidates) -> bool:
    return a.topology is b.topology and a.pairs.shape == b.pairs.shape and bool((a.pairs == b.pairs).all())


def _congestion(inc: sp.csr_matrix, x: np.ndarray, inv_c: np.ndarray) -> float:
    if not len(x):
        return 0.0
    return float((np.asarray(inc.T @ x).ravel() * inv_c).max())
