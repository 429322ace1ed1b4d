"""Candidate paths and static routes of many pairs at once, with numpy (the rules are :meth:`Topology.paths`'s
and :meth:`Topology.static_route`'s, which stay the reference: tests/unit/test_multipath_paths.py compares
every pair).

Every path is a row of directed-link indices (-1 padded). A *hop* (switch-only path between two ranks) is
looked up in three ``(P, P, width)`` tables built once per topology from each rank's hop search: the first
hop of the pair in the topology's order, the first through a rail switch or NIC, the first without one.
Then, for a batch of pairs, as arrays:

* static route: the first hop, else PXN (first hop to the source node's rank on the destination's rail, then
  its first hop on), routes given in the topology overriding both;
* candidates of a pair on two nodes: the static route, then per rail the rail-matched path (no-rail hop to the
  node's rank on the rail, the rail hop, no-rail hop from the far node's rank on it), kept when it exists,
  visits no vertex twice and is not a path already listed;
* relays: the greedy farthest reach over the path's ranks (a segment needs no forward when it is exactly the
  static route between its ends), vectorised over the candidates with the same number of ranks.

Pairs within one node: the static route, every hop without a rail vertex, and relays through the node's other
ranks (per pair in Python: a node has few ranks), relays vectorised as above.
"""

from __future__ import annotations

import numpy as np

from .topology import Topology

__all__ = ["Enumerator", "enumerator"]


def _pack(rows: list[tuple[int, ...]], width: int) -> np.ndarray:
    """-1 padded ``(len(rows), width)`` array of int tuples (grouped by length: one numpy call per length)."""
    out = np.full((len(rows), max(width, 1)), -1, dtype=np.int32)
    by_len: dict[int, list[int]] = {}
    for i, r in enumerate(rows):
        by_len.setdefault(len(r), []).append(i)
    for n, idx in by_len.items():
        if n:
            out[idx, :n] = np.array([rows[i] for i in idx], dtype=np.int32)
    return out


def _concat(parts: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray]:
    """Row-wise concatenation of -1 padded rows ``(rows, lengths)``; returns ``(rows, lengths)``."""
    n = len(parts[0][1])
    out = np.full((n, max(1, sum(r.shape[1] for r, _ in parts))), -1, dtype=np.int32)
    pos = np.zeros(n, dtype=np.int64)
    idx = np.arange(n)
    for rows, lens in parts:
        for j in range(rows.shape[1]):
            m = j < lens
            out[idx[m], pos[m] + j] = rows[m, j]
        pos += lens
    return out, pos


class Enumerator:
    """Hop tables of one topology and the batch enumeration built on them."""

    def __init__(self, topology: Topology):
        t = self.t = topology
        p = self.p = t.size
        names = [f"r{g}" for g in range(p)] + sorted(set(t.switches))
        vid = {v: i for i, v in enumerate(names)}
        self.names = names
        self.src = np.array([vid[lk.name.split(">")[0]] for lk in t.links], dtype=np.int64)
        self.dst = np.array([vid[lk.name.split(">")[1]] for lk in t.links], dtype=np.int64)
        self.node = np.array(t.node_of, dtype=np.int64)
        self.rail = np.array(t.rail_of, dtype=np.int64)
        first = np.full((max(t.node_of) + 1, max(t.rail_of) + 1), -1, dtype=np.int64)
        for (n, k), g in t._first.items():
            first[n, k] = g
        self.first = first
        tables = self._hop_search(vid)
        self.hop: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        for key, got in tables.items():
            width = max((len(r) for _, _, r in got), default=1)
            rows = np.full((p, p, width), -1, dtype=np.int32)
            lens = np.zeros((p, p), dtype=np.int64)
            if got:
                u = np.array([g[0] for g in got])
                v = np.array([g[1] for g in got])
                rows[u, v] = _pack([g[2] for g in got], width)
                lens[u, v] = [len(g[2]) for g in got]
            self.hop[key] = (rows, lens)
        self._static: np.ndarray | None = None

    def _hop_search(self, vid: dict[str, int]) -> dict[str, list[tuple[int, int, tuple[int, ...]]]]:
        """Per rank, :meth:`Topology._hops_from`'s depth-first search on integer vertices, carrying the links:
        the first hop of each reachable rank in the topology's order (length, then vertex names), the first
        through a rail vertex and the first without one."""
        t, p = self.t, self.p
        rank_of_name = sorted(vid, key=lambda v: v)
        order = {vid[v]: i for i, v in enumerate(rank_of_name)}  # tuple order of ids == order of names
        railv = {vid[v] for v in t._railv}
        adj: dict[int, list[tuple[int, int]]] = {i: [] for i in vid.values()}
        for e, (a, b) in enumerate(zip(self.src.tolist(), self.dst.tolist())):
            adj[a].append((b, e))
        for a in adj:
            adj[a].sort(key=lambda x: order[x[0]])
        tables: dict[str, list[tuple[int, int, tuple[int, ...]]]] = {"any": [], "rail": [], "norail": []}
        node = t.node_of
        self.any_rail = np.zeros((p, p), dtype=bool)
        """Whether the first hop of the pair goes through a rail vertex."""
        self.plain_hops: dict[tuple[int, int], list[tuple[int, ...]]] = {}
        """Every hop without a rail vertex of each pair within a node, in order (its ``direct`` candidates)."""
        for u in range(p):
            found: dict[int, list[tuple[tuple[int, ...], tuple[int, ...], bool]]] = {}
            stack: list[tuple[tuple[int, ...], tuple[int, ...], bool]] = [((u,), (), False)]
            while stack:
                path, links, rail = stack.pop()
                for nb, e in adj[path[-1]]:
                    if nb in path:
                        continue
                    if nb < p:
                        found.setdefault(nb, []).append((path + (nb,), links + (e,), rail))
                    elif len(path) < 6:
                        stack.append((path + (nb,), links + (e,), rail or nb in railv))
            for v, hops in found.items():
                if len(hops) > 1:
                    hops.sort(key=lambda h: (len(h[0]), tuple(order[x] for x in h[0])))
                tables["any"].append((u, v, hops[0][1]))
                self.any_rail[u, v] = hops[0][2]
                if node[u] == node[v]:
                    self.plain_hops[(u, v)] = [h[1] for h in hops if not h[2]]
                for key, want in (("rail", True), ("norail", False)):
                    for h in hops:
                        if h[2] is want:
                            tables[key].append((u, v, h[1]))
                            break
        return tables

    # ------------------------------------------------------------------ static routes
    @property
    def static(self) -> np.ndarray:
        """``(P * P, width)`` the static route of pair ``s * P + d`` (the diagonal empty)."""
        if self._static is None:
            self._static = self._build_static()
        return self._static

    def _build_static(self) -> np.ndarray:
        t, p = self.t, self.p
        rows, lens = self.hop["any"]
        s, d = np.divmod(np.arange(p * p), p)
        off = s != d
        direct = off & (lens[s, d] > 0)
        out = np.full((p * p, 2 * rows.shape[2]), -1, dtype=np.int32)
        out[direct, :rows.shape[2]] = rows[s[direct], d[direct]]
        need = np.flatnonzero(off & ~direct)
        if len(need):
            s1, d1 = s[need], d[need]
            k = self.first[self.node[s1], self.rail[d1]]
            kk = np.maximum(k, 0)
            ok = (k >= 0) & (k != s1) & (lens[s1, kk] > 0) & (lens[kk, d1] > 0)
            for q in need[~ok].tolist():
                t.static_route(q // p, q % p)  # raises the reference's ValueError (no route)
            got, _ = _concat([(rows[s1, kk], lens[s1, kk]), (rows[kk, d1], lens[kk, d1])])
            out[need[ok], :got.shape[1]] = got[ok]
        if t.routes:
            given = {(a, b): t._links_of(v) for (a, b), v in t.routes.items()}
            width = max(out.shape[1], max(len(r) for r in given.values()))
            if width > out.shape[1]:
                out = np.concatenate([out, np.full((len(out), width - out.shape[1]), -1, np.int32)], axis=1)
            for (a, b), r in given.items():
                out[a * p + b] = -1
                out[a * p + b, :len(r)] = r
        used = int((out >= 0).sum(1).max(initial=1))
        return np.ascontiguousarray(out[:, :max(used, 1)])

    # ------------------------------------------------------------------ pairs on two nodes
    def inter_node(self, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Candidates of the pairs ``(s, d)`` (on different nodes): ``(links (n, k, l), k (n,), kinds (n, k),
        relays (n, k, r))``; kinds: 0 static, ``3 + rail`` rail-matched; relays -1 padded."""
        n = len(s)
        st = self.static[s * self.p + d]
        cands = [(st, (st >= 0).sum(1), np.ones(n, dtype=bool), 0)]
        for rail in sorted(set(self.t.rail_of)):
            cands.append((*self._rail_path(s, d, rail), 3 + rail))
        width = max(c[0].shape[1] for c in cands)
        rows = np.full((n, len(cands), width), -1, dtype=np.int32)
        keep = np.zeros((n, len(cands)), dtype=bool)
        kinds = np.zeros((n, len(cands)), dtype=np.int16)
        for j, (r, _, valid, kind) in enumerate(cands):
            rows[:, j, :r.shape[1]] = r
            dup = np.zeros(n, dtype=bool)
            for i in range(j):
                dup |= keep[:, i] & (rows[:, i] == rows[:, j]).all(1)
            keep[:, j] = valid & ~dup
            kinds[:, j] = kind
        # Compact each pair's kept candidates to the front, in order.
        order = np.argsort(~keep, axis=1, kind="stable")
        rows = np.take_along_axis(rows, order[:, :, None], axis=1)
        kinds = np.take_along_axis(kinds, order, axis=1)
        k = keep.sum(1)
        live = np.arange(len(cands))[None, :] < k[:, None]
        rows[~live] = -1
        used = int((rows >= 0).sum(2).max(initial=1))
        rows = rows[:, :, :max(used, 1)]
        relays = np.full((n, len(cands), 2), -1, dtype=np.int32)
        flat_rows = rows.reshape(n * len(cands), -1)
        pick = np.flatnonzero(live.ravel())
        relays.reshape(n * len(cands), 2)[pick] = self.relays(flat_rows[pick], 2)
        return rows, k, kinds, relays

    def intra_node(self, s: np.ndarray, d: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Candidates of the pairs ``(s, d)`` within one node, as :meth:`inter_node` returns them; kinds 0
        static, 1 direct (every hop without a rail vertex), 2 relay (through another rank of the node, when
        link-disjoint from the static route). Per pair in Python: a node has few ranks."""
        rows_any, lens_any = self.hop["any"]
        members: dict[int, list[int]] = {}
        for g, n in enumerate(self.t.node_of):
            members.setdefault(n, []).append(g)
        paths, kinds = [], []
        for a, b in zip(s.tolist(), d.tolist()):
            st = self.static[a * self.p + b]
            st = tuple(st[st >= 0].tolist())
            got = {st: 0}
            for h in self.plain_hops.get((a, b), []):
                got.setdefault(h, 1)
            base = set(st)
            for k in members[self.t.node_of[a]]:
                if k in (a, b) or not lens_any[a, k] or not lens_any[k, b] or self.any_rail[a, k] or \
                        self.any_rail[k, b]:
                    continue
                v = tuple(rows_any[a, k, :lens_any[a, k]].tolist()) + tuple(rows_any[k, b, :lens_any[k, b]].tolist())
                if base.isdisjoint(v):
                    got.setdefault(v, 2)
            paths.append(list(got))
            kinds.append(list(got.values()))
        n, kmax = len(paths), max(len(x) for x in paths)
        flat = [x for ps in paths for x in ps]
        rows = np.full((n, kmax, max(len(x) for x in flat)), -1, dtype=np.int32)
        code = np.zeros((n, kmax), dtype=np.int16)
        k = np.array([len(x) for x in paths], dtype=np.int64)
        live = np.arange(kmax)[None, :] < k[:, None]
        rows[live] = _pack(flat, rows.shape[2])
        code[live] = [c for cs in kinds for c in cs]
        relays = np.full((n, kmax, 2), -1, dtype=np.int32)
        relays[live] = self.relays(rows[live], 2)
        return rows, k, code, relays

    def _rail_path(self, s, d, rail):
        """The rail-matched path of every pair on ``rail``: ``(rows, lengths, valid)``."""
        a = np.where(self.rail[s] == rail, s, self.first[self.node[s], rail])
        b = np.where(self.rail[d] == rail, d, self.first[self.node[d], rail])
        valid = (a >= 0) & (b >= 0)
        a0, b0 = np.maximum(a, 0), np.maximum(b, 0)
        rail_rows, rail_lens = self.hop["rail"]
        plain_rows, plain_lens = self.hop["norail"]
        mid_len = rail_lens[a0, b0]
        valid &= mid_len > 0
        l1 = np.where(s == a0, 0, plain_lens[s, a0])
        l2 = np.where(b0 == d, 0, plain_lens[b0, d])
        valid &= ((s == a0) | (l1 > 0)) & ((b0 == d) | (l2 > 0))
        rows, lens = _concat([(plain_rows[s, a0], l1), (rail_rows[a0, b0], mid_len), (plain_rows[b0, d], l2)])
        valid &= self._simple(rows, lens)
        rows[~valid] = -1
        return rows, np.where(valid, lens, 0), valid

    def _simple(self, rows: np.ndarray, lens: np.ndarray) -> np.ndarray:
        """Rows whose vertices are all different."""
        v = np.where(rows >= 0, self.src[np.maximum(rows, 0)], -1 - np.arange(rows.shape[1])[None, :])
        last = rows[np.arange(len(rows)), np.maximum(lens - 1, 0)]
        verts = np.concatenate([v, self.dst[np.maximum(last, 0)][:, None]], axis=1)
        verts.sort(axis=1)
        return ~(np.diff(verts, axis=1) == 0).any(1)

    # ------------------------------------------------------------------ relays
    def relays(self, rows: np.ndarray, r_max: int) -> np.ndarray:
        """``(n, r_max)`` relay ranks of each path row (-1 padded): the greedy farthest reach of
        :meth:`Topology._relays` (a segment between ranks needs no forward when it is their static route)."""
        n, width = rows.shape
        out = np.full((n, r_max), -1, dtype=np.int32)
        lens = (rows >= 0).sum(1)
        verts = np.where(rows >= 0, self.src[np.maximum(rows, 0)], -1)
        is_rank = (verts >= 0) & (verts < self.p)
        counts = is_rank.sum(1) + 1  # the destination is a rank too
        for m in np.unique(counts).tolist():
            grp = np.flatnonzero(counts == m)
            pos = np.zeros((len(grp), m), dtype=np.int64)
            rank = np.zeros((len(grp), m), dtype=np.int64)
            pos[:, :-1] = np.nonzero(is_rank[grp])[1].reshape(len(grp), m - 1)
            pos[:, -1] = lens[grp]
            rank[:, :-1] = np.take_along_axis(verts[grp], pos[:, :-1], axis=1)
            rank[:, -1] = self.dst[rows[grp, lens[grp] - 1]]
            out[grp] = self._greedy(rows[grp], pos, rank, r_max)
        return out

    def _greedy(self, rows, pos, rank, r_max):
        n, m = pos.shape
        idx = np.arange(n)
        cur = np.zeros(n, dtype=np.int64)
        used = np.zeros(n, dtype=np.int64)
        out = np.full((n, r_max), -1, dtype=np.int32)
        active = cur < m - 1
        while active.any():
            nxt = cur + 1
            found = np.zeros(n, dtype=bool)
            for j in range(m - 1, 0, -1):
                c = active & ~found & (j > cur)
                if c.any():
                    hit = np.zeros(n, dtype=bool)
                    hit[c] = self._is_static(rows[c], pos[c, cur[c]], pos[c, j], rank[c, cur[c]], rank[c, j])
                    nxt[hit] = j
                    found |= hit
            relay = active & (nxt != m - 1)
            if (used[relay] >= r_max).any():
                raise ValueError(f"a path needs more than {r_max} relays")
            out[idx[relay], used[relay]] = rank[relay, nxt[relay]]
            used += relay
            cur = np.where(active, nxt, cur)
            active = cur < m - 1
        return out

    def _is_static(self, rows, i0, i1, u, v):
        """Whether ``rows[:, i0:i1]`` is exactly the static route from rank ``u`` to rank ``v``."""
        st = self.static[u * self.p + v]
        length = i1 - i0
        ok = (st >= 0).sum(1) == length
        j = np.arange(st.shape[1])[None, :]
        seg = np.take_along_axis(rows, np.minimum(i0[:, None] + j, rows.shape[1] - 1), axis=1)
        return ok & ((j >= length[:, None]) | (seg == st)).all(1)


def enumerator(topology: Topology) -> Enumerator:
    """The topology's :class:`Enumerator` (built on first use, kept with the topology)."""
    got = topology._cache.get("enumerator")
    if got is None:
        got = topology._cache["enumerator"] = Enumerator(topology)
    return got
