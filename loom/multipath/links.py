"""Link capacities learned from the traffic: each all-to-allv's per-link throughput, smoothed, fed back to the
planner, which re-plans when a link degrades (NIMBLE plans from capacities; a congested or slow rail must be
noticed by the run, not only by the preset).

Measurement (one all-to-allv through :func:`loom.multipath.relay.alltoallv` with a ``monitor``): the ranks
start together (a barrier) and every final receiver notes when each message arrived. A message is charged to
the *bottleneck* of its path, the link(s) with the longest predicted busy time ``B_e / c_e`` under the current
estimate (``B_e``: the bytes link ``e`` carries in the call, known to every rank from the schedule);
:meth:`LinkMonitor.last_arrivals` keeps per link the last arrival charged to it, and one ``max`` allreduce
of ``#links`` floats gives ``T_e``, the seconds the link took to deliver its traffic.

Estimate (:meth:`LinkMonitor.observe`, the same arithmetic on every rank, so every rank re-plans alike):

* Only links that are some path's bottleneck and *critical* are sampled: busy at least ``critical`` times
  the busiest link's predicted time. A link that is no message's bottleneck finishes when the other links of
  its paths let it, so its ``B_e / T_e`` says nothing about its own speed; a bottleneck's achieved rate is
  its capacity up to the per-call overhead.
* The overhead (latency, protocol, software) slows every link of a call alike, so a sample is *relative*: link
  ``e`` achieved ``r_e = B_e / T_e / c0_e`` of its nominal capacity ``c0_e``, and its health sample is
  ``r_e / max_critical r``. A uniform slowdown changes no share, and a uniform slowdown changes no optimal
  plan either. (When every critical link degrades alike nothing is learned, and nothing needs to be.)
* Health is an exponential moving average with weight ``smoothing`` per sample; the capacity estimate is
  ``c0_e * health_e``. With ``smoothing = 0.5`` a link halved in rate is estimated below 0.75 of nominal after
  one measured call and below 0.63 after two.
* The plans use the capacities of the last *version*: a new version starts when some link's estimate moved by
  more than ``replan`` (relative) since, and the next call re-plans for it. The planner's hysteresis keeps
  the plan in force unless the new one is at least 5 % less congested, so noise that starts a version does
  not move traffic; a coarser threshold would leave the plan up to that share off once a rail recovers (the
  estimate approaches nominal geometrically, in ever smaller steps). A halved link is re-planned for after
  one measured call at the defaults.

A link the new plan unloads is no longer critical and keeps its last estimate; one the plan still loads (the
planner balances the slow link to the same busy time as the others, so it usually stays critical) goes on
being sampled, so when its rate comes back its estimate rises and the traffic returns.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from .planner import Plan
from .topology import Topology

__all__ = ["LinkMonitor", "rail_shares"]


@dataclass(kw_only=True, slots=True)
class LinkMonitor:
    """Learned link capacities of one topology, for :func:`loom.multipath.relay.alltoallv`'s ``monitor``.

    >>> mon = LinkMonitor(topology=topo)
    >>> for step in range(steps):
    ...     out, rc = alltoallv(x, counts, comm, topology=topo, monitor=mon)   # plans for mon.capacity
    """

    topology: Topology
    """The links being measured (their nominal capacities are the starting estimate)."""
    smoothing: float = 0.5
    """Weight of a new sample in the moving average of each link's health (0 < smoothing <= 1)."""
    critical: float = 0.5
    """A link is sampled when its predicted busy time is at least this share of the busiest link's (0..1]."""
    replan: float = 0.05
    """Re-plan when some link's estimate moved by more than this share since the capacities in force (the
    planner's ``hysteresis`` then decides whether traffic moves)."""
    every: int = 1
    """Measure one call in this many (a measured call costs a barrier and an allreduce of #links floats)."""
    health: np.ndarray = field(init=False)
    """Estimated share of nominal capacity per directed link (1 = as nominal)."""
    version: int = field(init=False)
    """Bumped whenever :attr:`capacity` changes (plans are cached per version)."""
    calls: int = field(init=False)
    """All-to-allv calls seen (measured or not)."""
    measured: int = field(init=False)
    """Calls folded in by :meth:`observe`."""
    plan: Plan | None = field(init=False)
    """The plan in force (the relay all-to-allv sets it; the next plan warm-starts from it)."""
    _in_force: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        if not 0 < self.smoothing <= 1:
            raise ValueError(f"smoothing={self.smoothing} must be in (0, 1] (weight of a new sample)")
        if not 0 < self.critical <= 1:
            raise ValueError(f"critical={self.critical} must be in (0, 1] (share of the busiest link's time)")
        if not self.replan > 0:
            raise ValueError(f"replan={self.replan} must be > 0 (relative change that triggers a re-plan)")
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"every={self.every!r} must be an int >= 1 (measure one call in this many)")
        n = len(self.topology.links)
        self.health = np.ones(n)
        self._in_force = np.ones(n)
        self.version = 0
        self.calls = 0
        self.measured = 0
        self.plan = None

    @property
    def nominal(self) -> np.ndarray:
        """The topology's capacities (bytes/s per directed link)."""
        return self.topology.capacity

    @property
    def capacity(self) -> np.ndarray:
        """The capacities plans are made for: nominal times the health of the current :attr:`version`."""
        return self.nominal * self._in_force

    def due(self) -> bool:
        """Count one call; whether it is to be measured (every ``every``-th, the first included)."""
        self.calls += 1
        return (self.calls - 1) % self.every == 0

    def busy(self, loads: np.ndarray) -> np.ndarray:
        """Predicted seconds per directed link to carry ``loads`` bytes at the current estimate (0 when
        unlimited)."""
        c = self.nominal * self.health
        return np.where(np.isfinite(c), np.asarray(loads, dtype=np.float64) / c, 0.0)

    def last_arrivals(self, loads: np.ndarray, paths: Sequence[Sequence[int]],
                      arrived: Sequence[float | None]) -> np.ndarray:
        """Per directed link, the latest of ``arrived`` (seconds; None: not seen here) among the messages whose
        path (``paths``: directed links of each message) has that link as its predicted bottleneck; 0 where
        none. The ``max`` over ranks is :meth:`observe`'s ``seconds``."""
        busy = self.busy(loads)
        out = np.zeros(len(busy))
        for links, t in zip(paths, arrived):
            if t is None or not len(links):
                continue
            idx = np.asarray(links, dtype=np.int64)
            b = busy[idx]
            top = b.max()
            if top > 0:
                hit = idx[b >= (1 - _TIE) * top]
                out[hit] = np.maximum(out[hit], t)
        return out

    def observe(self, loads: np.ndarray, seconds: np.ndarray) -> bool:
        """Fold in one measured call: ``loads`` bytes and ``seconds`` (from the common start to the last
        arrival charged to the link, :meth:`last_arrivals`; 0: no message had it as bottleneck) per directed
        link. Returns whether :attr:`capacity` changed (a new version: re-plan)."""
        n = len(self.health)
        loads = np.asarray(loads, dtype=np.float64)
        seconds = np.asarray(seconds, dtype=np.float64)
        if loads.shape != (n,) or seconds.shape != (n,):
            raise ValueError(f"loads {loads.shape} and seconds {seconds.shape} must both have one entry per "
                             f"directed link ({n})")
        c0 = self.nominal
        live = np.isfinite(c0) & (loads > 0) & (seconds > 0)
        if not live.any():
            return False
        self.measured += 1
        busy = self.busy(loads)
        hot = live & (busy >= self.critical * busy.max())
        rate = np.where(hot, loads / np.where(hot, seconds * c0, 1.0), 0.0)
        sample = rate[hot] / rate[hot].max()
        self.health[hot] += self.smoothing * (sample - self.health[hot])
        moved = np.abs(self.health - self._in_force) > self.replan * self._in_force
        if not moved.any():
            return False
        self._in_force = self.health.copy()
        self.version += 1
        return True


# Links whose predicted busy time is within this share of their path's longest are all its bottleneck (the
# loads of a balanced plan tie).
_TIE = 0.05
_RAIL = re.compile(r"(?:^rail|\.nic)(\d+)$")


def rail_shares(plan: Plan) -> np.ndarray:
    """Share of the plan's rail bytes on each rail (``(rails,)``, sums to 1 when any byte crosses a rail):
    bytes on the directed links that touch rail ``k``'s switch or a node's NIC ``k``, over all rail links'."""
    topo = plan.topology
    k_max = max(topo.rail_of) + 1
    per = np.zeros(k_max)
    for i, link in enumerate(topo.links):
        if link.kind != "rail":
            continue
        for v in link.name.split(">"):
            m = _RAIL.search(v)
            if m:
                per[int(m.group(1))] += plan.loads[i]
                break
    total = per.sum()
    return per / total if total > 0 else per
