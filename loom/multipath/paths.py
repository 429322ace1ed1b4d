"""Candidate paths as arrays: a per-topology table filled once per pair, and the per-demand view planners use.

Enumerating a pair's paths (:meth:`Topology.paths`) walks the graph in Python; a run-time planner asks for
the same pairs every step. :class:`PathTable` (one per topology, :func:`path_table`) keeps every pair it has
seen as padded integer arrays (paths x links, -1 padding) plus the static routes of *all* pairs as one sparse
matrix, so :func:`candidates` is a handful of numpy gathers once the pairs are known.

:class:`Candidates` holds the *flexible* pairs (those a planner may split) with every candidate path, and the
rest as fixed traffic on their static routes, summed into per-link ``base`` loads: at 512 ranks a dense
demand has 261,632 pairs, of which only the ~14,000 above the splitting threshold need their paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import scipy.sparse as sp

from .topology import Path, Topology

__all__ = ["Candidates", "PathTable", "candidates", "check_demand", "path_table"]


class PathTable:
    """Every candidate path of the pairs seen so far, as arrays (one table per :class:`Topology`)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        p = topology.size
        self.slot = np.full(p * p, -1, dtype=np.int64)
        """Row of pair ``s * P + d`` in :attr:`links` (-1: not enumerated yet)."""
        self.links = np.full((0, 1, 1), -1, dtype=np.int32)
        """``(pairs, k_max, l_max)`` directed-link indices of each path, -1 padded."""
        self.k = np.zeros(0, dtype=np.int64)
        """Candidate paths per enumerated pair."""
        self.paths: list[list[Path]] = []
        self._static: np.ndarray | None = None
        self._views: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def ensure(self, pid: np.ndarray) -> np.ndarray:
        """Enumerate the pairs ``pid = s * P + d`` not seen before; return their rows."""
        missing = np.unique(pid[self.slot[pid] < 0])
        if len(missing):
            p = self.topology.size
            new = [self.topology.paths(int(q) // p, int(q) % p) for q in missing.tolist()]
            kmax = max(self.links.shape[1], max(len(ps) for ps in new))
            lmax = max(self.links.shape[2], max(len(x.links) for ps in new for x in ps))
            block = np.full((len(new), kmax, lmax), -1, dtype=np.int32)
            for i, ps in enumerate(new):
                for j, x in enumerate(ps):
                    block[i, j, :len(x.links)] = x.links
            old = self.links
            grown = np.full((len(old) + len(new), kmax, lmax), -1, dtype=np.int32)
            grown[:len(old), :old.shape[1], :old.shape[2]] = old
            grown[len(old):] = block
            self.slot[missing] = np.arange(len(old), len(old) + len(new))
            self.links = grown
            self.k = np.concatenate([self.k, [len(ps) for ps in new]]).astype(np.int64)
            self.paths.extend(new)
        return self.slot[pid]

    @property
    def static(self) -> np.ndarray:
        """``(P * P, l_max)``: the directed links of pair ``s * P + d``'s static route, -1 padded (built
        once; the diagonal's rows are empty)."""
        if self._static is None:
            t = self.topology
            p = t.size
            routes = [t._links_of(t.static_route(s, d)) if s != d else () for s in range(p) for d in range(p)]
            out = np.full((p * p, max(len(r) for r in routes)), -1, dtype=np.int32)
            for i, r in enumerate(routes):
                out[i, :len(r)] = r
            self._static = out
        return self._static

    def view(self, pid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ptr, pair_of, links, rows)`` of the pairs ``pid`` (see :class:`Candidates`); the last few pair
        sets are kept, since a job's heavy pairs stay the same over many steps."""
        key = pid.tobytes()
        got = self._views.pop(key, None)
        if got is None:
            slots = self.ensure(pid)
            k = self.k[slots]
            ptr = np.zeros(len(pid) + 1, dtype=np.int64)
            np.cumsum(k, out=ptr[1:])
            pair_of = np.repeat(np.arange(len(pid)), k)
            within = np.arange(int(ptr[-1])) - ptr[pair_of]
            rows = np.stack([slots[pair_of], within], axis=1)
            links = self.links[rows[:, 0], rows[:, 1]] if len(rows) else np.full((0, 1), -1, dtype=np.int32)
            got = (ptr, pair_of, np.ascontiguousarray(links), rows)
        self._views[key] = got
        if len(self._views) > 8:
            self._views.pop(next(iter(self._views)))
        return got

    def static_loads(self, flat: np.ndarray) -> np.ndarray:
        """Bytes per directed link when every pair ``s * P + d`` sends ``flat[s * P + d]`` on its static route."""
        from ._mwu import loads

        out = np.empty(len(self.topology.links))
        loads(self.static, flat, np.zeros(len(out)), out)
        return out


def path_table(topology: Topology) -> PathTable:
    """The topology's :class:`PathTable` (created on first use, kept for the topology's lifetime)."""
    got = topology._cache.get("paths")
    if got is None:
        got = topology._cache["paths"] = PathTable(topology)
    return got


def check_demand(topology: Topology, demand) -> np.ndarray:
    """``demand`` as a ``(P, P)`` float64 array of finite, non-negative bytes (``ValueError`` otherwise)."""
    D = np.asarray(demand, dtype=np.float64)
    p = topology.size
    if D.shape != (p, p):
        raise ValueError(f"demand has shape {D.shape} but topology {topology.name!r} has {p} ranks; "
                         f"give a ({p}, {p}) matrix of bytes (row = source rank)")
    if not np.all(np.isfinite(D)) or (D < 0).any():
        raise ValueError("demand has negative or non-finite entries; bytes are finite and >= 0")
    return D


def _incidence(links: np.ndarray, n_links: int) -> sp.csr_matrix:
    """``(paths, n_links)`` 0/1 matrix of -1 padded link rows."""
    m = links >= 0
    ptr = np.concatenate([[0], np.cumsum(m.sum(1))])
    return sp.csr_matrix((np.ones(int(ptr[-1])), links[m].astype(np.int64), ptr), shape=(len(links), n_links))


@dataclass(slots=True)
class Candidates:
    """The flexible pairs' candidate paths, flattened, and the fixed pairs' static load."""

    topology: Topology
    demand: np.ndarray
    """``(P, P)`` bytes."""
    pairs: np.ndarray
    """``(n, 2)`` flexible ordered pairs, row-major order."""
    volume: np.ndarray
    """``(n,)`` bytes per flexible pair."""
    ptr: np.ndarray
    """``(n + 1,)`` path offsets per pair (a pair's static route first)."""
    pair_of: np.ndarray
    """``(n_paths,)`` pair index of each path."""
    links: np.ndarray
    """``(n_paths, l_max)`` directed links of each path, -1 padded."""
    rows: np.ndarray
    """``(n_paths, 2)`` (table row, index within the pair) of each path, for :attr:`paths`."""
    fixed_pairs: np.ndarray
    """``(m,)`` ids ``s * P + d`` of the pairs kept on their static route (demand below the threshold)."""
    fixed_volume: np.ndarray
    """``(m,)`` their bytes."""
    base: np.ndarray
    """Bytes per directed link from the fixed pairs."""
    _paths: list[Path] | None = field(default=None, repr=False)
    _incidence: sp.csr_matrix | None = field(default=None, repr=False)

    @property
    def paths(self) -> list[Path]:
        """Every candidate path of the flexible pairs, grouped by pair (built on first use)."""
        if self._paths is None:
            table = path_table(self.topology)
            self._paths = [table.paths[r][j] for r, j in self.rows.tolist()]
        return self._paths

    @property
    def incidence(self) -> sp.csr_matrix:
        """``(n_paths, n_links)``: 1 where a path uses a link."""
        if self._incidence is None:
            self._incidence = _incidence(self.links, len(self.topology.links))
        return self._incidence

    def fixed_incidence(self) -> sp.csr_matrix:
        """``(m, n_links)``: the fixed pairs' static routes."""
        return _incidence(path_table(self.topology).static[self.fixed_pairs], len(self.topology.links))

    def loads(self, flows: np.ndarray) -> np.ndarray:
        """Bytes per directed link when the flexible paths carry ``flows``, fixed pairs included."""
        from ._mwu import loads

        out = np.empty(len(self.base))
        loads(self.links, np.ascontiguousarray(flows, dtype=np.float64), self.base, out)
        return out


def candidates(topology: Topology, demand, min_bytes: float = 0.0, *, trusted: bool = False) -> Candidates:
    """Every pair with at least ``min_bytes`` (and > 0) of demand, with all its candidate paths; the rest
    fixed on their static routes (the diagonal is local and ignored). ``trusted``: ``demand`` already passed
    :func:`check_demand`."""
    D = demand if trusted else check_demand(topology, demand)
    p = topology.size
    flat = D.ravel().copy()
    flat[:: p + 1] = 0
    live = flat > 0
    flex = live & (flat >= min_bytes)
    pid = np.flatnonzero(flex)
    fixed = np.flatnonzero(live & ~flex)
    table = path_table(topology)
    ptr, pair_of, links, rows = table.view(pid)
    base = np.zeros(len(topology.links))
    if len(fixed):
        base = table.static_loads(np.where(live & ~flex, flat, 0.0))
    return Candidates(topology=topology, demand=D, pairs=np.stack([pid // p, pid % p], axis=1), volume=flat[pid],
                      ptr=ptr, pair_of=pair_of, links=links, rows=rows, fixed_pairs=fixed,
                      fixed_volume=flat[fixed], base=base)
