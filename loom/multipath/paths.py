"""Candidate paths as arrays: a per-topology table filled once per pair, and the per-demand view planners use.

Enumerating a pair's paths one at a time (:meth:`Topology.paths`, the reference) walks the graph in Python,
once per pair: at 512 ranks that is the static routes of all 261,632 pairs. The first plan enumerates in
batches instead (:mod:`loom.multipath._enumerate`: per-topology hop tables, then numpy over the pairs), and a
run-time planner asks for the same pairs every step: :class:`PathTable` (one per topology, :func:`path_table`)
keeps every pair it has seen as padded integer arrays (paths x links, -1
padding) plus the static routes of *all* pairs, so :func:`candidates` is a handful of numpy gathers once the
pairs are known.

:class:`Candidates` holds the *flexible* pairs (those a planner may split) with every candidate path, and the
rest as fixed traffic on their static routes, summed into per-link ``base`` loads: at 512 ranks a dense
demand has 261,632 pairs, of which only the ~14,000 above the splitting threshold need their paths.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from .topology import Path, Topology

if TYPE_CHECKING:  # scipy only where a sparse incidence is built: training's planner path runs without it
    import scipy.sparse as sp

__all__ = ["Candidates", "Cuts", "PathTable", "candidates", "check_demand", "cuts", "path_table"]


def _kind_name(code: int) -> str:
    return ("static", "direct", "relay")[code] if code < 3 else f"rail{code - 3}"


def _regrow(a: np.ndarray, shape: tuple[int, ...], fill: int) -> np.ndarray:
    """``a`` copied into the corner of a new ``shape`` array of ``fill``."""
    out = np.full(shape, fill, dtype=a.dtype)
    out[tuple(slice(0, n) for n in a.shape)] = a
    return out


class PathTable:
    """Every candidate path of the pairs seen so far, as arrays (one table per :class:`Topology`).

    Pairs are enumerated in batches (:mod:`loom.multipath._enumerate`, the rules of :meth:`Topology.paths`);
    :class:`Path` objects are built only when asked for (:meth:`path`)."""

    def __init__(self, topology: Topology):
        self.topology = topology
        p = topology.size
        self.slot = np.full(p * p, -1, dtype=np.int64)
        """Row of pair ``s * P + d`` in :attr:`links` (-1: not enumerated yet)."""
        self.links = np.full((0, 1, 1), -1, dtype=np.int32)
        """``(pairs, k_max, l_max)`` directed-link indices of each path, -1 padded."""
        self.k = np.zeros(0, dtype=np.int64)
        """Candidate paths per enumerated pair."""
        self.pair = np.zeros(0, dtype=np.int64)
        """``s * P + d`` of each row."""
        self.kinds = np.zeros((0, 1), dtype=np.int16)
        self.relays = np.full((0, 1, 1), -1, dtype=np.int32)
        self.n = 0
        """Rows filled (the arrays above have room for more)."""
        self._objects: dict[tuple[int, int], Path] = {}
        self._static: np.ndarray | None = None
        self._views: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def ensure(self, pid: np.ndarray) -> np.ndarray:
        """Enumerate the pairs ``pid = s * P + d`` not seen before; return their rows."""
        missing = np.unique(pid[self.slot[pid] < 0])
        if len(missing):
            self._append(missing, *self._enumerate(missing))
        return self.slot[pid]

    def _enumerate(self, missing: np.ndarray):
        t = self.topology
        s, d = np.divmod(missing, t.size)
        node = np.asarray(t.node_of)
        inter = node[s] != node[d]
        from ._enumerate import enumerator

        parts = []
        for m, how in ((inter, enumerator(t).inter_node), (~inter, enumerator(t).intra_node)):
            if m.any():
                parts.append((np.flatnonzero(m), *how(s[m], d[m])))
        n = len(missing)
        kmax = max(q[1].shape[1] for q in parts)
        lmax = max(q[1].shape[2] for q in parts)
        rmax = max(q[4].shape[2] for q in parts)
        rows = np.full((n, kmax, lmax), -1, dtype=np.int32)
        k = np.zeros(n, dtype=np.int64)
        kinds = np.zeros((n, kmax), dtype=np.int16)
        relays = np.full((n, kmax, rmax), -1, dtype=np.int32)
        for where, r, kk, kd, rl in parts:
            rows[where, :r.shape[1], :r.shape[2]] = r
            k[where] = kk
            kinds[where, :kd.shape[1]] = kd
            relays[where, :rl.shape[1], :rl.shape[2]] = rl
        return rows, k, kinds, relays

    def _append(self, missing, rows, k, kinds, relays) -> None:
        old, need = self.n, self.n + len(missing)
        shape = (max(self.links.shape[1], rows.shape[1]), max(self.links.shape[2], rows.shape[2]))
        rmax = max(self.relays.shape[2], relays.shape[2])
        if need > len(self.k) or shape != self.links.shape[1:] or rmax != self.relays.shape[2]:
            # Room for twice the rows: a job meets new flexible pairs over many steps, and copying the whole
            # table for each few would cost every such step O(table).
            cap = max(need, 2 * len(self.k), 64)
            self.links = _regrow(self.links[:old], (cap, *shape), -1)
            self.kinds = _regrow(self.kinds[:old], (cap, shape[0]), 0)
            self.relays = _regrow(self.relays[:old], (cap, shape[0], rmax), -1)
            self.k = _regrow(self.k[:old], (cap,), 0)
            self.pair = _regrow(self.pair[:old], (cap,), -1)
        self.links[old:need, :rows.shape[1], :rows.shape[2]] = rows
        self.kinds[old:need, :kinds.shape[1]] = kinds
        self.relays[old:need, :relays.shape[1], :relays.shape[2]] = relays
        self.k[old:need] = k
        self.pair[old:need] = missing
        self.slot[missing] = np.arange(old, need)
        self.n = need

    def path(self, row: int, j: int) -> Path:
        """Candidate ``j`` of table row ``row`` as a :class:`Path` (built on first use)."""
        got = self._objects.get((row, j))
        if got is None:
            t = self.topology
            s, d = divmod(int(self.pair[row]), t.size)
            links = self.links[row, j]
            links = tuple(int(e) for e in links[links >= 0])
            names = [t.links[e].name.split(">") for e in links]
            rel = self.relays[row, j]
            got = self._objects[(row, j)] = Path(
                src=s, dst=d, vertices=tuple([names[0][0]] + [b for _, b in names]), links=links,
                relays=tuple(int(r) for r in rel[rel >= 0]), kind=_kind_name(int(self.kinds[row, j])))
        return got

    @property
    def static(self) -> np.ndarray:
        """``(P * P, l_max)``: the directed links of pair ``s * P + d``'s static route, -1 padded (built
        once; the diagonal's rows are empty)."""
        got = self._static
        if got is None:
            from ._enumerate import enumerator

            got = self._static = enumerator(self.topology).static
        return got

    def view(self, pid: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """``(ptr, pair_of, links, slots)`` of the pairs ``pid`` (see :class:`Candidates`); the last few pair
        sets are kept, since a job's heavy pairs stay the same over many steps."""
        key = pid.tobytes()
        got = self._views.pop(key, None)
        if got is None:
            from ._mwu import gather_paths

            slots = self.ensure(pid)
            got = (*gather_paths(slots, self.k, self.links), slots)
        self._views[key] = got
        if len(self._views) > 8:
            self._views.pop(next(iter(self._views)))
        return got


class Cuts:
    """Sets of directed links that every byte between two groups of ranks must cross, whatever its path: per
    rank its outgoing and its incoming links, per node (with more than one) the links leaving and entering
    the node (its ranks, plus every switch whose adjacent ranks are all on that node: NICs, an NVSwitch).
    ``bytes over the cut / its capacity`` bounds the congestion of any routing from below (:func:`lower_bound`)."""

    def __init__(self, topology: Topology):
        from ._enumerate import enumerator

        en = enumerator(topology)
        p = topology.size
        self.node = np.asarray(topology.node_of, dtype=np.int64)
        self.nodes = int(self.node.max()) + 1 if p else 0
        owner = np.full(len(en.names), -1, dtype=np.int64)
        owner[:p] = self.node
        for v in range(p, len(en.names)):
            ranks = np.concatenate([en.dst[en.src == v], en.src[en.dst == v]])
            on = np.unique(self.node[ranks[ranks < p]])
            if len(on) == 1:
                owner[v] = on[0]
        groups = [(en.src == r, en.dst == r) for r in range(p)]
        if self.nodes > 1:
            for n in range(self.nodes):
                inside = owner == n
                groups.append((inside[en.src] & ~inside[en.dst], ~inside[en.src] & inside[en.dst]))
        sets = [np.flatnonzero(m) for g in groups for m in g]
        self.ptr = np.zeros(len(sets) + 1, dtype=np.int64)
        np.cumsum([len(x) for x in sets], out=self.ptr[1:])
        self.links = np.concatenate(sets) if sets else np.zeros(0, dtype=np.int64)
        """Links of cut ``i``: ``links[ptr[i]:ptr[i + 1]]``; order: rank 0 out, rank 0 in, ..., node 0 out,
        node 0 in, ..."""
        self.cut_of = np.repeat(np.arange(len(sets)), np.diff(self.ptr))

    def crossing(self, sent: np.ndarray, received: np.ndarray, local: np.ndarray) -> np.ndarray:
        """Bytes over each cut from per-rank bytes ``sent`` and ``received`` and per-node bytes ``local``
        (between a node's own ranks); the diagonal not counted."""
        from ._mwu import cut_bytes

        out = np.empty(len(self.ptr) - 1)
        cut_bytes(sent, received, local, self.node, out)
        return out

    def lower_bound(self, crossing: np.ndarray, capacity: np.ndarray) -> float:
        """``max_cut bytes / capacity``: no routing's congestion (busiest link's seconds) is lower."""
        cap = np.bincount(self.cut_of, weights=capacity[self.links], minlength=len(self.ptr) - 1)
        ok = cap > 0  # an empty cut bounds nothing
        return float((crossing[ok] / cap[ok]).max(initial=0.0))


def cuts(topology: Topology) -> Cuts:
    """The topology's :class:`Cuts` (built on first use, kept for the topology's lifetime)."""
    got = topology._cache.get("cuts")
    if got is None:
        got = topology._cache["cuts"] = Cuts(topology)
    return got


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
    import scipy.sparse as sp

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
    slots: np.ndarray
    """``(n,)`` each pair's row in the topology's :class:`PathTable`."""
    min_bytes: float
    """Pairs with less demand (and > 0) are fixed on their static route."""
    base: np.ndarray
    """Bytes per directed link from the fixed pairs."""
    static_loads: np.ndarray
    """Bytes per directed link when every pair, fixed or flexible, uses its static route."""
    crossing: np.ndarray
    """Bytes that must cross each of the topology's cuts (:class:`Cuts` order), whatever the routing."""
    _paths: list[Path] | None = field(default=None, repr=False)
    _incidence: sp.csr_matrix | None = field(default=None, repr=False)
    _fixed: np.ndarray | None = field(default=None, repr=False)

    @property
    def fixed_pairs(self) -> np.ndarray:
        """``(m,)`` ids ``s * P + d`` of the pairs kept on their static route (demand below the threshold)."""
        if self._fixed is None:
            flat = self.demand.ravel().copy()
            flat[:: self.topology.size + 1] = 0
            self._fixed = np.flatnonzero((flat > 0) & (flat < self.min_bytes))
        return self._fixed

    @property
    def fixed_volume(self) -> np.ndarray:
        """``(m,)`` their bytes."""
        return self.demand.ravel()[self.fixed_pairs]

    @property
    def rows(self) -> np.ndarray:
        """``(n_paths, 2)`` (table row, index within the pair) of each path."""
        return np.stack([self.slots[self.pair_of], np.arange(len(self.pair_of)) - self.ptr[self.pair_of]], axis=1)

    @property
    def paths(self) -> list[Path]:
        """Every candidate path of the flexible pairs, grouped by pair (built on first use)."""
        if self._paths is None:
            table = path_table(self.topology)
            self._paths = [table.path(r, j) for r, j in self.rows.tolist()]
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
    :func:`check_demand` (it is checked again in the same pass that splits it, at no extra cost)."""
    D = demand if trusted else np.asarray(demand, dtype=np.float64)
    p = topology.size
    if D.shape != (p, p):
        check_demand(topology, D)  # raises the shape error
    from ._mwu import split_demand

    table, cut = path_table(topology), cuts(topology)
    D = np.ascontiguousarray(D, dtype=np.float64)
    pid, vol = np.empty(p * p, dtype=np.int64), np.empty(p * p)
    base, flex = np.empty(len(topology.links)), np.empty(len(topology.links))
    sent, received, local = np.empty(p), np.empty(p), np.empty(cut.nodes)
    nf = split_demand(D, float(min_bytes), table.static, cut.node, pid, vol, base, flex, sent, received, local)
    if nf < 0:
        check_demand(topology, D)  # raises the entry error
    pid, vol = pid[:nf].copy(), vol[:nf].copy()
    ptr, pair_of, links, slots = table.view(pid)
    return Candidates(topology=topology, demand=D, pairs=np.stack([pid // p, pid % p], axis=1), volume=vol,
                      ptr=ptr, pair_of=pair_of, links=links, slots=slots, min_bytes=float(min_bytes), base=base,
                      static_loads=base + flex, crossing=cut.crossing(sent, received, local))
