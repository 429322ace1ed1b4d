"""The execution-time planner: split every pair's bytes over its candidate paths to minimise congestion.

Problem (NIMBLE section 4, capacity-normalised minimum congestion): demand ``D[s, d]`` bytes, candidate paths
``P(s, d)`` from :meth:`Topology.paths`, directed links ``e`` of capacity ``c_e`` bytes/s. Choose flows
``f_p >= 0`` with ``sum_{p in P(s,d)} f_p = D[s, d]`` minimising the congestion
``lambda = max_e load_e / c_e`` -- the seconds the busiest link needs, a lower bound on completion time.

Method (:func:`plan`; multiplicative weights in the Garg-Koenemann family, made deterministic):

1. Start from the static routes (every byte on path 0). Pairs below ``min_bytes`` stay there for good
   (splitting a small message costs more in per-message latency than it saves; NIMBLE uses ~1 MB); they
   enter only as fixed per-link loads. Each flexible pair's demand split evenly over its paths, or the
   ``previous`` plan's shares re-applied to this demand, replaces the static start when less congested.
2. ``increments`` rounds. Each round weights every link multiplicatively by its utilisation,
   ``w_e = exp(eta * (u_e - 1))`` with ``u_e = load_e / (c_e * lambda)`` and ``eta = ln(#links) / epsilon``, so
   the busiest links dominate (from a start far from the optimum ``eta`` grows to that over the first half of the
   rounds, which spreads the traffic first; from the plan in force, or a start within 1 % of the cut bound below,
   it is that from the first round). A path's cost is its *bottleneck*: ``max_{e in p} w_e / c_e`` (the data path
   is pipelined, so the slowest hop sets the rate); the potential's gradient breaks exact ties (a lexicographic
   comparison, so the choice does not depend on the unit of the capacities), then the path order (static first).
   Every pair shifts flow from its costliest used path to its best one by a Newton step on the exponential
   potential ``sum_e exp(eta * u_e)`` (a smooth maximum of the link utilisations), and the round's joint step is
   scaled by an exact line search on that potential, so congestion never oscillates between rounds. When a shared
   bottleneck stalls the bottleneck direction, the potential's own gradient picks the paths instead. Rounds stop
   early when no pair can improve, after ``patience`` rounds without a 0.1 % gain, or once within 0.1 % of the
   *cut bound*: per rank its outgoing and incoming links, per node the links leaving and entering it, carry every
   byte between the two sides whatever the routing, so ``max_cut bytes / capacity`` is a lower bound on the
   congestion of any plan (:class:`loom.multipath.paths.Cuts`). A start already within 0.1 % of it runs no rounds
   (even striping on a rail-symmetric cluster meets it exactly).
3. The best round's flows are kept. Hysteresis: when they beat the static routes by less than
   ``hysteresis`` (or a ``previous`` plan, re-applied to this demand, by less than that), the old routing is
   returned unchanged -- balanced traffic stays on the direct routes, and re-planning does not flap.

Run-time costs (every step of a job re-plans from that step's counts): candidate paths are enumerated once
per topology and pair (:mod:`loom.multipath.paths`); one compiled pass over the demand splits it into
flexible pairs and the fixed pairs' link loads and sums the bytes over every cut; the rounds are compiled
(:mod:`loom.multipath._mwu`, one pass over every pair's paths each, O(paths x links per path), choosing,
stepping and shifting the loads at once); the link loads of each start are computed once and carried into
the rounds; a ``previous`` plan warm-starts the rounds when it is the best start, and is reused outright
while the demand moved by less than ``reuse`` (relative L1 change). ``loom plan`` prints the median planning
time.

Everything runs in a fixed order, so every rank computes the same plan from the same inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .paths import Candidates, candidates, cuts
from .topology import Path, Topology

__all__ = ["Candidates", "Plan", "plan", "candidates", "plan_from_flows"]

# A round that lowers congestion by less than this share does not reset ``patience``: on 40 random
# instances (tests/unit/test_multipath.py) patience 4 at 0.1 % stays within 1.5 % of the LP optimum and
# halves the rounds of patience 8 at 0.01 %.
_GAIN = 1e-3
# A start this close to the cut bound runs its rounds at full steepness, as a warm start does: on h100
# clusters under zipf skews it reaches the bound in fewer rounds and no random instance of
# tests/unit/test_multipath.py changes (their bounds are looser than this).
_NEAR = 1e-2


@dataclass(slots=True)
class Plan:
    """Flows per candidate path and the link loads they cause (fixed pairs included)."""

    cands: Candidates
    flows: np.ndarray
    """``(n_paths,)`` bytes per candidate path of the flexible pairs."""
    method: str
    seconds: float = 0.0
    """Wall time spent planning."""
    rounds: int = 0
    """Multiplicative-weights rounds run (0 when none were needed)."""
    capacity: np.ndarray | None = None
    """Bytes/s per directed link the plan was made for (``None``: the topology's own)."""
    bound: float = 0.0
    """A lower bound on the congestion of any routing of this demand (the cut bound of
    :class:`loom.multipath.paths.Cuts`; 0 when not computed)."""
    loads: np.ndarray | None = None
    """Bytes per directed link (:attr:`Topology.links` order); computed from the flows when not given."""

    def __post_init__(self) -> None:
        if self.loads is None:
            self.loads = self.cands.loads(self.flows)

    @property
    def topology(self) -> Topology:
        return self.cands.topology

    @property
    def demand(self) -> np.ndarray:
        return self.cands.demand

    @property
    def utilization(self) -> np.ndarray:
        """Seconds of traffic per link (``load / capacity``; 0 for unlimited links)."""
        return self.loads / (self.topology.capacity if self.capacity is None else self.capacity)

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
            vol = float(c.demand[s, d]) if s != d else 0.0
            return [(self.topology.paths(s, d)[0], vol)] if vol > 0 else []
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
        fixed = float(c.fixed_volume.sum())
        on_static = (self.flows[c.ptr[:-1]].sum() if len(c.volume) else 0.0) + fixed
        total = c.volume.sum() + fixed
        return float(1 - on_static / total) if total else 0.0


def plan_from_flows(cands: Candidates, flows: np.ndarray, method: str, seconds: float = 0.0) -> Plan:
    return Plan(cands=cands, flows=np.asarray(flows, dtype=np.float64), method=method, seconds=seconds)


def _static_flows(c: Candidates) -> np.ndarray:
    f = np.zeros(len(c.pair_of))
    if len(c.volume):
        f[c.ptr[:-1]] = c.volume
    return f


def _carry(previous: Plan, c: Candidates) -> np.ndarray | None:
    """``previous``'s per-pair path shares applied to ``c``'s volumes (pairs new to ``c``: static)."""
    if previous.topology is not c.topology:
        return None
    from ._mwu import carry

    p = c.topology.size
    old = previous.cands
    out = np.empty(len(c.pair_of))
    carry(old.pairs[:, 0] * p + old.pairs[:, 1], old.ptr, np.ascontiguousarray(previous.flows, dtype=np.float64),
          old.volume, c.pairs[:, 0] * p + c.pairs[:, 1], c.ptr, c.volume, out)
    return out


def _max_util(loads: np.ndarray, inv_c: np.ndarray) -> float:
    u = loads * inv_c
    return float(u.max()) if len(u) else 0.0


def _improve(c: Candidates, inv_c: np.ndarray, given: list[tuple[np.ndarray, np.ndarray]], increments: int,
             epsilon: float, patience: int, bound: float) -> tuple[np.ndarray, float, int, np.ndarray | None]:
    """The rounds from the least congested start: ``given`` ``[(flows, loads), ...]`` (the static routes, then
    the plan in force re-applied when there is one) and even striping; none when that start is within
    ``_GAIN`` of ``bound`` (no routing is lower); returns ``(flows, congestion, rounds run, their loads or
    None when the rounds changed them)``."""
    k = np.diff(c.ptr).astype(np.float64)
    even = c.volume[c.pair_of] / k[c.pair_of]
    # Even striping as a start: on large clusters the rounds alone, each moving flow between two paths per
    # pair, did not get from the static routes to even striping (tests/unit/test_multipath.py).
    starts = [given[0], (even, c.loads(even)), *given[1:]]
    lam0, which = min((_max_util(L, inv_c), i) for i, (_, L) in enumerate(starts))
    x0, L0 = starts[which]
    if lam0 <= bound * (1 + _GAIN):
        return x0, lam0, 0, L0
    from . import _mwu

    # A warm start from the plan in force, or any start within _NEAR of the cut bound (so of the optimum), is
    # near the optimum already: full steepness from the first round. The gentle start of the schedule
    # spreads a far start; from a near one it only delays the rounds that close the gap.
    sharp = (len(given) > 1 and which == 2) or lam0 <= bound * (1 + _NEAR)
    x, lam, done = _mwu.rounds(c.links, c.ptr, x0.copy(), L0.copy(), inv_c, increments, float(epsilon), sharp,
                               patience, _GAIN, bound)
    return x, lam, done, None  # the rounds' loads are updated in steps: the plan's are summed afresh


def _validate(epsilon: float, increments: int, hysteresis: float, reuse: float, patience: int) -> None:
    if not epsilon > 0:
        raise ValueError(f"epsilon={epsilon} must be > 0 (typical 0.02-0.2)")
    if not isinstance(increments, int) or increments < 0:
        raise ValueError(f"increments={increments!r} must be an int >= 0")
    if not hysteresis >= 0:
        raise ValueError(f"hysteresis={hysteresis} must be >= 0")
    if not isinstance(patience, int) or patience < 0:
        raise ValueError(f"patience={patience!r} must be an int >= 0 (0 = run every round)")
    if not reuse >= 0:
        raise ValueError(f"reuse={reuse} must be >= 0 (0 = always re-plan)")


def _capacity(topology: Topology, capacity) -> np.ndarray | None:
    """``capacity`` as ``(#links,)`` bytes/s > 0 (``inf``: unlimited), or ``None`` for the topology's own."""
    if capacity is None:
        return None
    cap = np.asarray(capacity, dtype=np.float64)
    n = len(topology.links)
    if cap.shape != (n,) or not (cap > 0).all() or np.isnan(cap).any():
        raise ValueError(f"capacity has shape {cap.shape} or entries <= 0; give {n} bytes/s > 0 per directed link "
                         f"of topology {topology.name!r} (Topology.links order, inf for unlimited)")
    return cap


def _reusable(previous: Plan | None, D: np.ndarray, topology: Topology, reuse: float,
              capacity: np.ndarray | None) -> bool:
    if previous is None or reuse <= 0 or previous.topology is not topology:
        return False
    if (previous.capacity is None) != (capacity is None) or (
            capacity is not None and not np.array_equal(previous.capacity, capacity)):
        return False  # the links changed: the old shares may be wrong however little the demand moved
    from ._mwu import l1_change

    moved, total = l1_change(D, np.ascontiguousarray(previous.demand, dtype=np.float64))
    return moved <= reuse * total


def plan(
    topology: Topology,
    demand: np.ndarray | Sequence[Sequence[float]],
    *,
    epsilon: float = 0.05,
    increments: int = 32,
    min_bytes: float = 1 << 20,
    hysteresis: float = 0.05,
    previous: Plan | None = None,
    reuse: float = 0.02,
    patience: int = 4,
    capacity: np.ndarray | None = None,
) -> Plan:
    """Plan multi-path routes for ``demand`` (bytes, ``(P, P)``, row = source) on ``topology``.

    Args:
        topology: ranks, links and candidate paths.
        demand: bytes from every rank to every rank (the diagonal is local and ignored).
        epsilon: accuracy of the multiplicative weights (``eta = ln(#links) / epsilon``); smaller follows the
            bottleneck more sharply.
        increments: most rounds of re-routing (each moves a line-searched share of every pair's demand).
        min_bytes: pairs with less demand keep their static route.
        hysteresis: keep the static routes (or ``previous``) unless the new plan's congestion is lower by
            more than this fraction.
        previous: the plan in force; its per-pair path shares are re-applied to ``demand`` as a start for the
            rounds and for the hysteresis test.
        reuse: with ``previous``, return its shares re-applied without planning when the demand moved by at
            most this fraction (``sum |D - D_prev| <= reuse * sum D_prev``); 0 always plans.
        patience: stop the rounds after this many without a 0.1 % gain in congestion (0: run them all, with no
            stop at the cut bound either).
        capacity: bytes/s per directed link to plan for instead of the topology's (measured capacities,
            :class:`loom.multipath.links.LinkMonitor`); a ``previous`` plan made for other capacities is
            re-planned, never reused.

    Returns:
        A feasible :class:`Plan` (every pair's flows sum to its demand).
    """
    _validate(epsilon, increments, hysteresis, reuse, patience)
    t0 = time.perf_counter()
    c = candidates(topology, demand, min_bytes)
    D = c.demand
    given = _capacity(topology, capacity)
    cap = topology.capacity if given is None else given
    inv_c = np.where(np.isfinite(cap), 1.0 / cap, 0.0)
    static = _static_flows(c)
    carried = None if previous is None else _carry(previous, c)
    if carried is not None and _reusable(previous, D, topology, reuse, given):
        return Plan(cands=c, flows=carried, method="mwu(reused)", seconds=time.perf_counter() - t0, capacity=given)
    static_L = c.static_loads
    static_lam = _max_util(static_L, inv_c)
    bound = cuts(topology).lower_bound(c.crossing, cap)
    best_x, best_lam, done, best_L = static, static_lam, 0, static_L
    carried_L = None if carried is None else c.loads(carried)
    carried_lam = None if carried is None else _max_util(carried_L, inv_c)
    if (np.diff(c.ptr) > 1).any() and static_lam > 0:
        starts = [(static, static_L)] + ([] if carried is None else [(carried, carried_L)])
        # patience 0 runs every round: no stop at the bound either.
        best_x, best_lam, done, best_L = _improve(c, inv_c, starts, increments, epsilon, patience,
                                                  bound if patience else 0.0)
    chosen, lam, method, loads = best_x, best_lam, "mwu", best_L
    if best_lam >= static_lam / (1 + hysteresis):
        chosen, lam, method, loads = static, static_lam, "mwu(static)", static_L
    if carried is not None and carried_lam <= lam * (1 + hysteresis):
        chosen, method, loads = carried, "mwu(previous)", carried_L
    return Plan(cands=c, flows=chosen, method=method, seconds=time.perf_counter() - t0, rounds=int(done),
                capacity=given, bound=bound, loads=loads)
