"""``Topology``: ranks, switches and capacitated links, and the candidate paths between every pair of ranks.

Vocabulary (shared with :mod:`loom.testbed.topology`, whose ``topology_dict`` this module reads unchanged):
a *vertex* is a rank (``"r{g}"``, a GPU that can also forward) or a switch (an intra-node switch standing in
for NVLink/NVSwitch, a NIC, a *rail* switch joining NIC k of every node). A *link* is full duplex: it becomes
two *directed links* ``"a>b"`` and ``"b>a"``, each with the link's capacity (bytes/s). A *hop* is a path from
one rank to another through switches only; a *path* is one or more hops, the ranks between them being
*relays* that receive and forward (:mod:`loom.multipath.relay`).

Candidate paths per ordered pair (NIMBLE, "execution-time planning", section 3): the static route first, then

* same node: the direct hop; one relay through another rank of the node, when that relay path is
  link-disjoint from the direct hop (through a switch with per-port links a relay only adds load);
* other node: one *rail-matched* path per rail: source -> (its node's rank on that rail, if not the source)
  -> rail -> (the destination node's rank on that rail, if not the destination) -> destination.

The static route (``routes`` in the dict; by default direct when a switch-only hop exists, else PXN-style via
the source node's rank on the destination's rail) is what MPI and NCCL use for every byte of a pair.

Dict schema (``loom.testbed.topology/1``; presets build the same)::

    {"nodes": [{"id": 0, "ranks": [0, 1]}, ...],
     "ranks": [{"rank": 0, "node": 0, "rail": 0}, ...],
     "switches": [{"id": "rail0", "kind": "rail"}, {"id": "node0", "kind": "intra"}, {"id": "n0.nic0",
                   "kind": "nic"}],
     "links": [{"id": "r0-rail0", "a": "r0", "b": "rail0", "capacity": 125e6 | None}, ...],
     "routes": {"0->3": ["r0", "node0", "r1", "rail1", "r3"], ...}     # optional
    }
"""

from __future__ import annotations

import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path as _FsPath
from typing import Any, Iterable, Mapping

import numpy as np

__all__ = ["Link", "Path", "Topology", "PRESETS", "preset"]


@dataclass(frozen=True, slots=True)
class Link:
    """One direction of a full-duplex link."""

    name: str
    """``"a>b"``: traffic from vertex ``a`` to vertex ``b``."""
    capacity: float
    """Bytes per second in this direction (``math.inf`` when unlimited)."""
    kind: str
    """``"rail"`` when either end is a rail switch or NIC, else ``"intra"``."""


@dataclass(frozen=True, slots=True)
class Path:
    """A candidate route of one ordered pair."""

    src: int
    dst: int
    vertices: tuple[str, ...]
    """Every vertex from ``r{src}`` to ``r{dst}``."""
    links: tuple[int, ...]
    """Indices into :attr:`Topology.links` of the directed links used, in order."""
    relays: tuple[int, ...]
    """Ranks that must receive and forward (where the static routes alone would not follow this path)."""
    kind: str
    """``"static"``, ``"direct"``, ``"relay"`` (intra-node) or ``"rail{k}"`` (inter-node, rail-matched)."""

    @property
    def hops(self) -> tuple[int, ...]:
        """The ranks a message visits: ``(src, *relays, dst)``."""
        return (self.src, *self.relays, self.dst)


def _rank_vertex(v: str) -> int | None:
    if v.startswith("r") and v[1:].isdigit():
        return int(v[1:])
    return None


@dataclass(kw_only=True, slots=True)
class Topology:
    """A cluster as a graph of ranks and switches; build with :meth:`from_dict`, :meth:`from_toml` or
    :func:`preset`.

    Raises:
        ValueError: ranks not numbered ``0..n-1``, a link to an unknown vertex, a negative capacity.
    """

    name: str = "custom"
    """Label for tables and plots."""
    node_of: tuple[int, ...]
    """Node of each rank, in rank order."""
    rail_of: tuple[int, ...]
    """Rail of each rank's NIC, in rank order."""
    switches: Mapping[str, str]
    """Switch vertex id -> kind (``intra``, ``rail``, ``nic``, ...)."""
    edges: tuple[tuple[str, str, str, float], ...]
    """Full-duplex links ``(id, a, b, capacity bytes/s or inf)``."""
    routes: Mapping[tuple[int, int], tuple[str, ...]] = field(default_factory=dict)
    """Static route (vertex path) per ordered pair; missing pairs get the default rule."""

    links: list[Link] = field(init=False)
    """Directed links, sorted by name (indices used by every plan)."""
    capacity: np.ndarray = field(init=False)
    _index: dict[str, int] = field(init=False)
    _adj: dict[str, list[str]] = field(init=False)
    _hops: dict[int, dict[int, list[tuple[str, ...]]]] = field(init=False)
    _paths: dict[tuple[int, int], list[Path]] = field(init=False)
    _static: dict[tuple[int, int], tuple[str, ...]] = field(init=False)
    _first: dict[tuple[int, int], int] = field(init=False)
    _rankv: dict[str, int] = field(init=False)
    _railv: frozenset = field(init=False)
    _cache: dict[str, Any] = field(init=False, repr=False, compare=False)
    """Per-topology planner state (:func:`loom.multipath.paths.path_table`)."""

    def __post_init__(self) -> None:
        n = len(self.node_of)
        if n < 1 or len(self.rail_of) != n:
            raise ValueError(f"topology {self.name!r}: node_of ({n}) and rail_of ({len(self.rail_of)}) must list "
                             f"every rank once")
        verts = {f"r{g}" for g in range(n)} | set(self.switches)
        adj: dict[str, list[str]] = {v: [] for v in verts}
        directed: dict[str, Link] = {}
        for lid, a, b, cap in self.edges:
            for v in (a, b):
                if v not in verts:
                    raise ValueError(f"topology {self.name!r}: link {lid!r} joins unknown vertex {v!r}; vertices "
                                     f"are r0..r{n - 1} and the switches {sorted(self.switches)}")
            if not cap > 0:
                raise ValueError(f"topology {self.name!r}: link {lid!r} has capacity {cap}; give bytes/s > 0 "
                                 f"(None/inf for unlimited)")
            kind = "rail" if any(self.switches.get(v) in ("rail", "nic") for v in (a, b)) else "intra"
            for x, y in ((a, b), (b, a)):
                directed[f"{x}>{y}"] = Link(f"{x}>{y}", float(cap), kind)
                adj[x].append(y)
        self.links = [directed[k] for k in sorted(directed)]
        self._index = {lk.name: i for i, lk in enumerate(self.links)}
        self.capacity = np.array([lk.capacity for lk in self.links], dtype=np.float64)
        self._adj = {v: sorted(set(ns)) for v, ns in adj.items()}
        self._hops = {}
        self._paths = {}
        self._static = {}
        self._first = {}
        for g in range(n - 1, -1, -1):
            self._first[(self.node_of[g], self.rail_of[g])] = g
        self._rankv = {f"r{g}": g for g in range(n)}
        self._railv = frozenset(v for v, k in self.switches.items() if k in ("rail", "nic"))
        self._cache = {}

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], *, name: str | None = None) -> "Topology":
        """Read the ``loom.testbed.topology/1`` schema (see the module docstring)."""
        try:
            ranks = sorted(d["ranks"], key=lambda r: int(r["rank"]))
            if [int(r["rank"]) for r in ranks] != list(range(len(ranks))):
                raise ValueError(f"ranks must be numbered 0..{len(ranks) - 1}, got {[r['rank'] for r in ranks]}")
            node_of = tuple(int(r["node"]) for r in ranks)
            rail_of = tuple(int(r.get("rail", 0)) for r in ranks)
            switches = {str(s["id"]): str(s.get("kind", "switch")) for s in d.get("switches", [])}
            edges = tuple(
                (str(e["id"]), str(e["a"]), str(e["b"]),
                 math.inf if e.get("capacity") is None else float(e["capacity"]))
                for e in d["links"]
            )
        except KeyError as exc:
            raise ValueError(f"topology dict lacks key {exc}; expected the loom.testbed.topology/1 schema "
                             f"(nodes, ranks, switches, links)") from None
        routes = {}
        for key, verts in (d.get("routes") or {}).items():
            s, t = (int(x) for x in str(key).split("->"))
            routes[(s, t)] = tuple(str(v) for v in verts)
        return cls(name=name or str(d.get("name", "custom")), node_of=node_of, rail_of=rail_of,
                   switches=switches, edges=edges, routes=routes)

    @classmethod
    def from_toml(cls, path: str | _FsPath) -> "Topology":
        """A TOML file with a ``[preset]`` table (``name = "h100"``, ``nodes = 4``, other preset arguments)
        or the dict schema's ``[[ranks]]``/``[[switches]]``/``[[links]]`` arrays."""
        with open(path, "rb") as f:
            doc = tomllib.load(f)
        if "preset" in doc:
            kw = dict(doc["preset"])
            return preset(kw.pop("name"), **kw)
        return cls.from_dict(doc, name=_FsPath(path).stem)

    # ------------------------------------------------------------------ facts
    @property
    def size(self) -> int:
        """Number of ranks."""
        return len(self.node_of)

    @property
    def nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def rails(self) -> int:
        return len(set(self.rail_of))

    def link_index(self, name: str) -> int:
        return self._index[name]

    def describe(self) -> str:
        caps = sorted({lk.capacity for lk in self.links})
        shown = ", ".join("unlimited" if math.isinf(c) else f"{c / 1e9:g} GB/s" for c in caps)
        return (f"{self.name}: {self.size} ranks on {self.nodes} node(s), {self.rails} rail(s), "
                f"{len(self.links)} directed links ({shown})")

    # ------------------------------------------------------------------ hops and paths
    def _hops_from(self, u: int) -> dict[int, list[tuple[str, ...]]]:
        """Every switch-only vertex path from rank ``u`` to other ranks (depth-first, sorted, simple)."""
        got = self._hops.get(u)
        if got is not None:
            return got
        out: dict[int, list[tuple[str, ...]]] = {}
        start = f"r{u}"
        stack: list[tuple[str, ...]] = [(start,)]
        while stack:
            path = stack.pop()
            for nb in self._adj[path[-1]]:
                if nb in path:
                    continue
                g = self._rankv.get(nb)
                if g is not None:
                    out.setdefault(g, []).append(path + (nb,))
                elif len(path) < 6:
                    stack.append(path + (nb,))
        for paths in out.values():
            paths.sort(key=lambda p: (len(p), p))
        self._hops[u] = out
        return out

    def _links_of(self, verts: Iterable[str]) -> tuple[int, ...]:
        v = tuple(verts)
        return tuple(self._index[f"{a}>{b}"] for a, b in zip(v[:-1], v[1:]))

    def _has_rail(self, verts: tuple[str, ...]) -> bool:
        return not self._railv.isdisjoint(verts)

    def static_route(self, s: int, d: int) -> tuple[str, ...]:
        """The vertex path MPI uses for every byte from ``s`` to ``d`` (given, or the default rule)."""
        got = self._static.get((s, d)) or self.routes.get((s, d))
        if got is not None:
            return got
        direct = self._hops_from(s).get(d)
        if direct:
            self._static[(s, d)] = direct[0]
            return direct[0]
        # PXN-style: over the intra switch to the source node's rank on the destination's rail.
        k = self._first.get((self.node_of[s], self.rail_of[d]))
        if k is not None and k != s:
            a, b = self._hops_from(s).get(k), self._hops_from(k).get(d)
            if a and b:
                self._static[(s, d)] = a[0] + b[0][1:]
                return a[0] + b[0][1:]
        raise ValueError(f"topology {self.name!r}: no route from rank {s} to rank {d}; give one in 'routes'")

    def _relays(self, verts: tuple[str, ...]) -> tuple[int, ...]:
        """The fewest intermediate ranks at which an MPI-level forward is needed so that every segment
        between forwards follows a static route exactly (greedy farthest reach)."""
        rv = self._rankv
        rank_pos = [(i, rv[v]) for i, v in enumerate(verts) if v in rv]
        relays: list[int] = []
        cur = 0  # index into rank_pos
        while cur < len(rank_pos) - 1:
            i0, u = rank_pos[cur]
            nxt = cur + 1
            for j in range(len(rank_pos) - 1, cur, -1):
                i1, v = rank_pos[j]
                if self.static_route(u, v) == verts[i0:i1 + 1]:
                    nxt = j
                    break
            if nxt != len(rank_pos) - 1:
                relays.append(rank_pos[nxt][1])
            cur = nxt
        return tuple(relays)

    def _make(self, s: int, d: int, verts: tuple[str, ...], kind: str) -> Path:
        return Path(src=s, dst=d, vertices=verts, links=self._links_of(verts), relays=self._relays(verts),
                    kind=kind)

    def paths(self, s: int, d: int) -> list[Path]:
        """Candidate paths from rank ``s`` to rank ``d`` (``s != d``), the static route first, fixed order."""
        key = (s, d)
        got = self._paths.get(key)
        if got is not None:
            return got
        if not (0 <= s < self.size and 0 <= d < self.size) or s == d:
            raise ValueError(f"paths({s}, {d}): need two different ranks in 0..{self.size - 1}")
        static = self.static_route(s, d)
        cands: list[tuple[tuple[str, ...], str]] = [(static, "static")]
        node = self.node_of
        if node[s] == node[d]:
            for hop in self._hops_from(s).get(d, []):
                if not self._has_rail(hop):  # looping out through a NIC is not an intra-node path
                    cands.append((hop, "direct"))
            base = set(self._links_of(static))
            for k in range(self.size):
                if node[k] != node[s] or k in (s, d):
                    continue
                a, b = self._hops_from(s).get(k), self._hops_from(k).get(d)
                if not a or not b or self._has_rail(a[0]) or self._has_rail(b[0]):
                    continue
                verts = a[0] + b[0][1:]
                if base.isdisjoint(self._links_of(verts)):
                    cands.append((verts, "relay"))
        else:
            for rail in sorted(set(self.rail_of)):
                a = s if self.rail_of[s] == rail else self._first_on(node[s], rail)
                b = d if self.rail_of[d] == rail else self._first_on(node[d], rail)
                if a is None or b is None:
                    continue
                mid = [h for h in self._hops_from(a).get(b, []) if self._has_rail(h)]
                if not mid:
                    continue
                verts: tuple[str, ...] = (f"r{s}",)
                ok = True
                for u, v, seg in ((s, a, None), (a, b, mid[0]), (b, d, None)):
                    if u == v:
                        continue
                    if seg is None:
                        hops = [h for h in self._hops_from(u).get(v, []) if not self._has_rail(h)]
                        if not hops:
                            ok = False
                            break
                        seg = hops[0]
                    verts = verts + seg[1:]
                if ok and len(set(verts)) == len(verts):
                    cands.append((verts, f"rail{rail}"))
        seen: set[tuple[str, ...]] = set()
        out: list[Path] = []
        for verts, kind in cands:
            if verts in seen:
                continue
            seen.add(verts)
            out.append(self._make(s, d, verts, kind))
        self._paths[key] = out
        return out

    def _first_on(self, node: int, rail: int) -> int | None:
        return self._first.get((node, rail))


# ---------------------------------------------------------------------- presets
def _rail_cluster(name: str, *, nodes: int, ranks_per_node: int, rails: int, rail_bw: float, intra_bw: float,
                  intra: str, nic_bw: float | None = None) -> Topology:
    """A rail-optimised cluster: rank ``l`` of a node uses NIC ``l * rails // ranks_per_node``.

    ``intra="switch"``: one intra switch per node, each rank a link of ``intra_bw`` to it (NVSwitch port
    model). ``intra="mesh"``: a direct link of ``intra_bw`` between every two ranks of a node (xGMI-like).
    With one rank per NIC the rank attaches to its rail switch directly; with several, through a NIC vertex
    (GPU->NIC links of ``nic_bw``, NIC->rail of ``rail_bw``).
    """
    if intra not in ("switch", "mesh"):
        raise ValueError(f"intra={intra!r}; valid: switch, mesh")
    for k, v in (("nodes", nodes), ("ranks_per_node", ranks_per_node), ("rails", rails)):
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be an int >= 1")
    if rails > ranks_per_node:
        raise ValueError(f"rails={rails} exceeds ranks_per_node={ranks_per_node}; each rail needs a rank per node")
    r = ranks_per_node
    rail_of = tuple((g % r) * rails // r for g in range(nodes * r))
    switches: dict[str, str] = {f"rail{k}": "rail" for k in range(rails)}
    edges: list[tuple[str, str, str, float]] = []
    shared = r > rails
    for n in range(nodes):
        ranks = range(n * r, n * r + r)
        if r > 1 and intra == "switch":
            switches[f"node{n}"] = "intra"
            edges += [(f"r{g}-node{n}", f"r{g}", f"node{n}", intra_bw) for g in ranks]
        elif r > 1:
            edges += [(f"r{a}-r{b}", f"r{a}", f"r{b}", intra_bw) for a in ranks for b in ranks if a < b]
        for k in range(rails):
            if shared:
                nic = f"n{n}.nic{k}"
                switches[nic] = "nic"
                edges.append((f"{nic}-rail{k}", nic, f"rail{k}", rail_bw))
                edges += [(f"r{g}-{nic}", f"r{g}", nic, nic_bw or rail_bw) for g in ranks if rail_of[g] == k]
            else:
                edges += [(f"r{g}-rail{k}", f"r{g}", f"rail{k}", rail_bw) for g in ranks if rail_of[g] == k]
    return Topology(name=name, node_of=tuple(g // r for g in range(nodes * r)), rail_of=rail_of,
                    switches=switches, edges=tuple(edges))


def _testbed(nodes: int = 2, ranks_per_node: int = 2, rails: int = 2, rail_gbit: float = 1.0,
             intra_gbit: float = 10.0) -> Topology:
    """The emulated cluster of :mod:`loom.testbed` (its own ``topology_dict`` when importable)."""
    try:
        from loom.testbed.topology import TestbedSpec, topology_dict
    except ImportError:  # the testbed package is optional; the same shape built here
        return _rail_cluster("testbed", nodes=nodes, ranks_per_node=ranks_per_node, rails=rails,
                             rail_bw=rail_gbit * 1e9 / 8 if rail_gbit else math.inf,
                             intra_bw=intra_gbit * 1e9 / 8 if intra_gbit else math.inf, intra="switch")
    spec = TestbedSpec(nodes=nodes, ranks_per_node=ranks_per_node, rails=rails, rail_gbit=rail_gbit,
                       intra_gbit=intra_gbit)
    return Topology.from_dict(topology_dict(spec), name="testbed")


def _h100(nodes: int = 2, ranks_per_node: int = 8, rails: int = 4) -> Topology:
    """8 GPUs on an NVSwitch (450 GB/s per GPU each way), 4 x 400 Gbit/s rails, 2 GPUs per NIC (PCIe 64 GB/s)."""
    return _rail_cluster("h100", nodes=nodes, ranks_per_node=ranks_per_node, rails=rails, rail_bw=50e9,
                         intra_bw=450e9, intra="switch", nic_bw=64e9)


def _mesh(nodes: int = 2, ranks_per_node: int = 8, rails: int = 4) -> Topology:
    """8 GPUs in a full mesh of 64 GB/s links (xGMI-like: intra-node relays help), 4 x 400 Gbit/s rails."""
    return _rail_cluster("mesh", nodes=nodes, ranks_per_node=ranks_per_node, rails=rails, rail_bw=50e9,
                         intra_bw=64e9, intra="mesh", nic_bw=64e9)


def _shm(nodes: int = 1, ranks_per_node: int = 4, rails: int = 1) -> Topology:
    """One machine's shared memory seen as a mesh (for runs without a testbed): 5 GB/s per pair."""
    return _rail_cluster("shm", nodes=nodes, ranks_per_node=ranks_per_node, rails=rails, rail_bw=1.25e9,
                         intra_bw=5e9, intra="mesh")


PRESETS = {"testbed": _testbed, "h100": _h100, "mesh": _mesh, "shm": _shm}


def preset(name: str, **kw: Any) -> Topology:
    """A named topology: ``testbed`` (2 nodes x 2 ranks, 2 rails, 1 Gbit/s), ``h100`` (8 GPUs, 4 rails per
    node, NVSwitch), ``mesh`` (8 GPUs in a full mesh, 4 rails), ``shm`` (one node, mesh); ``nodes=`` etc."""
    try:
        fn = PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown topology preset {name!r}; valid: {', '.join(PRESETS)}") from None
    try:
        return fn(**kw)
    except TypeError as exc:
        raise ValueError(f"preset {name!r}: {exc}; see help(loom.multipath.topology.{fn.__name__})") from None
