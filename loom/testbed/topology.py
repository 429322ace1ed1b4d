"""The emulated cluster's shape: which rank sits on which node and rail, its addresses and its static routes.

Pure description, no side effects: :mod:`loom.testbed.netns` turns a :class:`TestbedSpec` into namespaces,
veth pairs, bridges and ``tc`` limits, and :func:`topology_dict` exports the same facts for the multi-path
planner, so plan and reality are computed from one object.

Vocabulary: a *node* is an emulated host; a *rank* is one MPI process and lives in its own network namespace
(its "GPU + NIC"); a *rail* is one switch (a Linux bridge) joining NIC k of every node; the *intra* switch of a
node (one bridge per node) joins that node's ranks and stands in for NVLink.

Topology (rail-optimised, as in GPU clusters)::

    rank g = node * ranks_per_node + local_rank,   rail(g) = local_rank % rails

    rank g --[rail link, rail_gbit each way]--> switch "rail{rail(g)}"   (every node's rank on that rail)
    rank g --[intra link, intra_gbit each way]--> switch "node{node(g)}"   (only when ranks_per_node > 1)

Static routes (the kernel forwards; this is the "static fastest path" that multi-path balancing must beat):

* same node: over the intra switch, directly;
* other node, same rail: over the rail switch, directly;
* other node, other rail: no direct link. Like NCCL's PXN, the packet first crosses the intra switch to the
  *hop*, the rank of the source's node whose local rank equals the destination's rail (it sits on that rail),
  which forwards it over the destination's rail. The reply takes the mirror route (through the destination
  node's rank on the source's rail), so the two directions use different links.

Addresses (only inside the testbed's own namespaces): rank g has ``10.200.{rail}.{g+1}/24`` on its rail NIC
(this is the address MPI uses: ``FI_TCP_IFACE=rail``) and ``10.200.{100+node}.{g+1}/24`` on its intra NIC.
Routes to other ranks carry ``src <rail address>`` so every connection is addressed rail-to-rail whatever
interface it leaves by.

``topology_dict`` schema (version 1; JSON-serialisable; capacities in bytes/s per direction, ``None`` for
an unlimited link)::

    {
      "schema": "loom.testbed.topology/1",
      "nodes": [{"id": 0, "ranks": [0, 1]}, ...],
      "ranks": [{"rank": 0, "node": 0, "local_rank": 0, "rail": 0,
                 "rail_ip": "10.200.0.1", "intra_ip": "10.200.100.1" | None}, ...],
      "switches": [{"id": "rail0", "kind": "rail"}, {"id": "node0", "kind": "intra", "node": 0}, ...],
      "links": [{"id": "r0-rail0", "a": "r0", "b": "rail0", "kind": "rail" | "intra",
                 "capacity": 125000000.0 | None, "duplex": "full"}, ...],
      "routes": {"0->3": ["r0", "node0", "r1", "rail1", "r3"], ...},   # vertex path of every ordered pair
      "rail_gbit": 1.0, "intra_gbit": 10.0, "rails": 2
    }

Vertices are ``"r{rank}"`` (a rank, which can also forward) and switch ids. Each link is full duplex: its
capacity holds in each direction independently (``tc tbf`` on both veth ends). A route's consecutive vertex
pairs are the links it uses, in order.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .. import settings

__all__ = [
    "TestbedSpec",
    "RankInfo",
    "Route",
    "ranks",
    "routes",
    "static_path",
    "topology_dict",
    "current_topology",
    "ADDRESS_PREFIX",
    "RAIL_IFACE",
    "INTRA_IFACE",
    "MAX_RANKS",
]

#: Every address the testbed uses lies in this /16 and only inside the testbed's own namespaces.
ADDRESS_PREFIX = "10.200"
#: Interface names inside each rank's namespace (the same in every namespace).
RAIL_IFACE = "rail"
INTRA_IFACE = "intra"
#: Host part of an address is g+1 (1..254) and the intra subnets are 10.200.{100+node}.
MAX_RANKS = 64
_MAX_NODES = 100
_MAX_RAILS = 100


def _gbit_to_bytes(gbit: float) -> float | None:
    return None if gbit == 0 else gbit * 1e9 / 8


@dataclass(kw_only=True, slots=True)
class TestbedSpec:
    """Shape and link rates of an emulated cluster.

    Validation errors name the value, the rule and the fix.
    """

    nodes: int = 2
    """Emulated hosts (>= 1)."""
    ranks_per_node: int = 1
    """MPI ranks per node, each in its own network namespace with one rail NIC."""
    rails: int = 1
    """Rail switches; local rank l uses rail ``l % rails``. Needs ``rails <= ranks_per_node`` (a rail with no
    NIC on it would be unreachable)."""
    rail_gbit: float = 1.0
    """Rate of each rail NIC, Gbit/s in each direction; 0 means unlimited (no ``tc`` limit)."""
    intra_gbit: float = 10.0
    """Rate of each rank's intra-node link (stands in for NVLink), Gbit/s each way; 0 means unlimited."""

    __test__ = False  # not a pytest class despite the name

    def __post_init__(self) -> None:
        for name in ("nodes", "ranks_per_node", "rails"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}={v!r} must be an int")
            if v < 1:
                raise ValueError(f"{name}={v} must be >= 1")
        for name in ("rail_gbit", "intra_gbit"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise TypeError(f"{name}={v!r} must be a number")
            if v < 0:
                raise ValueError(f"{name}={v} must be >= 0 (0 means unlimited)")
        for name in ("rail_gbit", "intra_gbit"):
            v = getattr(self, name)
            if 0 < v < 0.001:
                raise ValueError(f"{name}={v} Gbit/s is below tc's useful range; use >= 0.001 (1 Mbit/s)")
        if self.rails > self.ranks_per_node:
            raise ValueError(
                f"rails={self.rails} exceeds ranks_per_node={self.ranks_per_node}: every rail needs a NIC on "
                f"every node (local rank l sits on rail l % rails); use --rails <= {self.ranks_per_node} "
                f"or more ranks per node"
            )
        if self.nodes > _MAX_NODES or self.rails > _MAX_RAILS:
            raise ValueError(f"nodes={self.nodes}, rails={self.rails}: at most {_MAX_NODES} nodes and "
                             f"{_MAX_RAILS} rails (address plan 10.200.rail.x / 10.200.(100+node).x)")
        if self.size > MAX_RANKS:
            raise ValueError(
                f"nodes x ranks_per_node = {self.size} ranks exceeds {MAX_RANKS}; one namespace per rank on one "
                f"machine does not scale further: use fewer nodes or ranks per node"
            )

    @property
    def size(self) -> int:
        """Total ranks."""
        return self.nodes * self.ranks_per_node

    def describe(self) -> str:
        def rate(g: float) -> str:
            return "unlimited" if g == 0 else f"{g:g} Gbit/s"

        return (f"{self.nodes} nodes x {self.ranks_per_node} ranks, {self.rails} rail(s) at {rate(self.rail_gbit)}"
             f", intra-node {rate(self.intra_gbit)}")


@dataclass(frozen=True, slots=True)
class Route:
    """One kernel route in a rank's namespace: ``ip route add {dest} via {via} dev {dev} src {src}``."""

    dest: str
    dev: str
    src: str
    via: str | None = None

    def ip_args(self) -> list[str]:
        args = ["route", "replace", self.dest]
        if self.via:
            args += ["via", self.via]
        return args + ["dev", self.dev, "src", self.src]


@dataclass(frozen=True, slots=True)
class RankInfo:
    """Where one rank sits and how it is addressed."""

    rank: int
    node: int
    local_rank: int
    rail: int
    rail_ip: str
    intra_ip: str | None
    routes: tuple[Route, ...] = field(default=())


def _rail_ip(spec: TestbedSpec, g: int) -> str:
    return f"{ADDRESS_PREFIX}.{(g % spec.ranks_per_node) % spec.rails}.{g + 1}"


def _intra_ip(spec: TestbedSpec, g: int) -> str | None:
    if spec.ranks_per_node == 1:
        return None
    return f"{ADDRESS_PREFIX}.{100 + g // spec.ranks_per_node}.{g + 1}"


def _hop(spec: TestbedSpec, src: int, dst: int) -> int | None:
    """The forwarding rank of a cross-rail inter-node pair (source node's rank on the destination's rail)."""
    r = spec.ranks_per_node
    if src // r == dst // r:
        return None
    src_rail = (src % r) % spec.rails
    dst_rail = (dst % r) % spec.rails
    if src_rail == dst_rail:
        return None
    return (src // r) * r + dst_rail  # local rank == dst_rail sits on rail dst_rail (rails <= ranks_per_node)


def routes(spec: TestbedSpec, g: int) -> tuple[Route, ...]:
    """The routes installed in rank ``g``'s namespace (beyond its two connected subnets)."""
    r = spec.ranks_per_node
    node, rail = divmod(g, r)[0], (g % r) % spec.rails
    src = _rail_ip(spec, g)
    out: list[Route] = []
    # Same node: every peer's rail address over the intra link (a /32 beats the connected rail /24).
    for peer in range(node * r, node * r + r):
        if peer != g:
            out.append(Route(dest=f"{_rail_ip(spec, peer)}/32", dev=INTRA_IFACE, src=src,
                             via=_intra_ip(spec, peer)))
    # Other rails: through the hop on this node that sits on that rail.
    for k in range(spec.rails):
        if k != rail and spec.nodes > 1:
            hop = node * r + k
            out.append(Route(dest=f"{ADDRESS_PREFIX}.{k}.0/24", dev=INTRA_IFACE, src=src, via=_intra_ip(spec, hop)))
    return tuple(out)


def ranks(spec: TestbedSpec) -> list[RankInfo]:
    """Every rank's placement, addresses and routes, in MPI rank order."""
    out = []
    for g in range(spec.size):
        node, local = divmod(g, spec.ranks_per_node)
        out.append(RankInfo(rank=g, node=node, local_rank=local, rail=local % spec.rails,
                            rail_ip=_rail_ip(spec, g), intra_ip=_intra_ip(spec, g), routes=routes(spec, g)))
    return out


def static_path(spec: TestbedSpec, src: int, dst: int) -> list[str]:
    """The vertex path packets from ``src`` to ``dst`` take (see the module docstring for vertex names)."""
    for name, v in (("src", src), ("dst", dst)):
        if not 0 <= v < spec.size:
            raise ValueError(f"{name}={v} is not a rank of this testbed (0..{spec.size - 1})")
    r = spec.ranks_per_node
    if src == dst:
        return [f"r{src}"]
    if src // r == dst // r:
        return [f"r{src}", f"node{src // r}", f"r{dst}"]
    hop = _hop(spec, src, dst)
    if hop is None:
        return [f"r{src}", f"rail{(src % r) % spec.rails}", f"r{dst}"]
    return [f"r{src}", f"node{src // r}", f"r{hop}", f"rail{(dst % r) % spec.rails}", f"r{dst}"]


def topology_dict(spec: TestbedSpec) -> dict:
    """The built topology in the form the multi-path planner reads (schema in the module docstring)."""
    infos = ranks(spec)
    r = spec.ranks_per_node
    switches: list[dict] = [{"id": f"rail{k}", "kind": "rail"} for k in range(spec.rails)]
    links: list[dict] = []
    for info in infos:
        links.append({"id": f"r{info.rank}-rail{info.rail}", "a": f"r{info.rank}", "b": f"rail{info.rail}",
                      "kind": "rail", "capacity": _gbit_to_bytes(spec.rail_gbit), "duplex": "full"})
    if r > 1:
        switches += [{"id": f"node{n}", "kind": "intra", "node": n} for n in range(spec.nodes)]
        for info in infos:
            links.append({"id": f"r{info.rank}-node{info.node}", "a": f"r{info.rank}", "b": f"node{info.node}",
                          "kind": "intra", "capacity": _gbit_to_bytes(spec.intra_gbit), "duplex": "full"})
    return {
        "schema": "loom.testbed.topology/1",
        "nodes": [{"id": n, "ranks": list(range(n * r, n * r + r))} for n in range(spec.nodes)],
        "ranks": [{"rank": i.rank, "node": i.node, "local_rank": i.local_rank, "rail": i.rail,
                   "rail_ip": i.rail_ip, "intra_ip": i.intra_ip} for i in infos],
        "switches": switches,
        "links": links,
        "routes": {f"{s}->{d}": static_path(spec, s, d) for s in range(spec.size) for d in range(spec.size)
                   if s != d},
        "rails": spec.rails,
        "rail_gbit": float(spec.rail_gbit),
        "intra_gbit": float(spec.intra_gbit),
    }


def current_topology() -> dict | None:
    """Inside a testbed rank: the running testbed's :func:`topology_dict` (from ``$LOOM_TESTBED_TOPOLOGY``);
    ``None`` outside a testbed. Lets a benchmark plan with the topology it actually runs on."""
    path = settings.get("testbed_topology")
    if not path:
        return None
    with open(path) as f:
        return json.load(f)
