"""Flow-level completion time of a plan: for scales this machine cannot run (64 nodes x 8 GPUs x 4 rails).

Model: every (pair, path) with bytes is one fluid flow over all its links at once (relays are pipelined, so
a path moves at its bottleneck's share). Links share their capacity max-min fairly among the flows crossing
them (progressive filling: raise every unfrozen flow's rate together until a link saturates, freeze the
flows on it, repeat). Events are flow completions; between events rates are constant. The completion time
is when the last byte lands; it is at least :attr:`Plan.congestion` (the busiest link's seconds) and equals
it when the busiest link never idles. At scale, ``batch`` re-shares capacity only after a fraction of the flows
finished (one rate computation per batch instead of per flow; see :func:`simulate`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from .planner import Plan

if TYPE_CHECKING:  # imported where simulate() runs, so that importing loom.multipath needs no scipy
    import scipy.sparse as sp

__all__ = ["SimResult", "simulate", "maxmin_rates"]


@dataclass(frozen=True, slots=True)
class SimResult:
    seconds: float
    """When the last flow finishes."""
    flows: int
    """Fluid flows simulated."""
    events: int
    """Rate recomputations (flow completions)."""


def maxmin_rates(inc: sp.csr_matrix, cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of the flows (rows of ``inc``, 0/1 flow x link) on links of capacity ``cap``."""
    n = inc.shape[0]
    rate = np.zeros(n)
    frozen = np.zeros(n, dtype=bool)
    rem = cap.astype(np.float64).copy()
    incT = inc.T.tocsr()
    for _ in range(inc.shape[1] + 1):
        live = (~frozen).astype(np.float64)
        if not live.any():
            break
        users = incT @ live
        with np.errstate(divide="ignore", invalid="ignore"):
            share = np.where(users > 0, rem / users, np.inf)
        inc_rate = float(share.min())
        if not np.isfinite(inc_rate):  # remaining flows cross only unlimited links
            rate[~frozen] = np.inf
            break
        rate[~frozen] += inc_rate
        rem -= inc_rate * users
        tight = (users > 0) & (rem <= 1e-9 * np.maximum(cap, 1.0))
        hit = np.asarray(inc @ tight.astype(np.float64)).ravel() > 0
        frozen |= hit
    return rate


def simulate(plan: Plan, *, batch: float = 0.0, max_events: int = 100_000) -> SimResult:
    """Completion time of ``plan``'s flows under max-min fair sharing (see the module docstring).

    ``batch`` trades exactness for speed at scale: with ``batch = b > 0`` the rates are recomputed only once
    a fraction ``b`` of the running flows finished (at least one), rather than at every completion; in
    between, every flow keeps its rate, so capacity freed by finished flows is not re-shared until then.
    Events fall from one per flow to about ``ln(flows) / b``. Measured with ``loom plan --topology h100
    --nodes 8 --skew zipf-pairs:1.5 --no-lp --sim-batch B`` (four methods, 4000-6400 flows each): ``B = 0.01``
    within 0.01 % of the exact times, the command 62.9 s -> 5.1 s; ``B = 0.05`` within 0.13 % in 2.3 s.
    """
    if not 0.0 <= batch < 1.0:
        raise ValueError(f"simulate: batch={batch} must be in [0, 1) (0 = exact, 0.01 = 1 % of flows per event)")
    c = plan.cands
    on = np.nonzero(plan.flows > 0)[0]
    # Pairs below the planner's threshold travel their static routes alongside the planned flows.
    fixed = c.fixed_volume > 0
    size = np.concatenate([plan.flows[on], c.fixed_volume[fixed]]).astype(np.float64)
    if not len(size):
        return SimResult(0.0, 0, 0)
    import scipy.sparse as sp

    inc = sp.vstack([c.incidence[on], c.fixed_incidence()[fixed]], format="csr")
    left = size.copy()
    cap = plan.topology.capacity
    t = 0.0
    alive = np.ones(len(size), dtype=bool)
    events = 0
    while alive.any():
        if events >= max_events:
            raise RuntimeError(f"simulate: more than {max_events} events; raise max_events")
        idx = np.nonzero(alive)[0]
        rate = maxmin_rates(inc[idx], cap)
        with np.errstate(divide="ignore"):
            ttf = np.where(rate > 0, left[idx] / rate, np.inf)
        if batch > 0.0 and len(idx) > 1:
            k = max(1, int(batch * len(idx)))
            dt = float(np.partition(ttf, k - 1)[k - 1])
        else:
            dt = float(ttf.min())
        if not np.isfinite(dt):
            raise RuntimeError("simulate: a flow gets no bandwidth (a link of zero capacity?)")
        t += dt
        left[idx] -= np.where(np.isfinite(rate), rate * dt, left[idx])
        done = left[idx] <= 1e-9 * np.maximum(size[idx], 1.0)
        done |= ttf <= dt * (1 + 1e-12)
        alive[idx[done]] = False
        events += 1
    return SimResult(t, len(size), events)
