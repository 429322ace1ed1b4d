"""Which topology a job runs on: a file, a preset fitted to the job, or ``auto`` (found from the machine).

:func:`resolve` turns a ``[multipath] topology`` setting into a :class:`Topology` whose ranks are the
communicator's ranks, in order; :func:`detect` builds one from what the ranks can see (see its docstring).
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
import struct
import subprocess

from .topology import PRESETS, Topology, preset

__all__ = ["detect", "fit_preset", "local_nics", "resolve", "resolve_fixed"]


def fit_preset(name: str, size: int) -> Topology:
    """The preset ``name`` shaped for ``size`` ranks: ``testbed`` as 2 ranks per node on 2 rails (1 when odd),
    ``shm`` as one node, others at their default shape (which must have ``size`` ranks)."""
    if name == "testbed":
        per = 2 if size % 2 == 0 and size > 1 else 1
        return preset("testbed", nodes=max(size // per, 1), ranks_per_node=per, rails=per)
    if name == "shm":
        return preset("shm", nodes=1, ranks_per_node=size, rails=1)
    t = preset(name)
    if t.size != size:
        raise ValueError(f"preset {name!r} has {t.size} ranks but the job has {size}; launch {t.size} ranks or "
                         f"give a TOML file with the job's shape")
    return t


def _ipv4(name: str) -> ipaddress.IPv4Interface | None:
    """The interface's IPv4 address and prefix (``SIOCGIFADDR``/``SIOCGIFNETMASK``), or None."""
    import fcntl

    req = struct.pack("256s", name[:15].encode())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24])
            mask = socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x891B, req)[20:24])
        except OSError:
            return None
    return ipaddress.IPv4Interface(f"{addr}/{mask}")


_RATE = re.compile(r"\brate (\d+(?:\.\d+)?)([KMGT]?)bit\b")
_UNIT = {"": 1.0, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _capacity(name: str, sys_net: str) -> float | None:
    """Bytes/s of an interface: a ``tc`` rate limit when one is set, else the link speed from sysfs; None when
    neither is known (an unlimited link to the planner)."""
    try:
        out = subprocess.run(["tc", "qdisc", "show", "dev", name], capture_output=True, text=True, timeout=5).stdout
        rates = [float(v) * _UNIT[u] / 8 for v, u in _RATE.findall(out)]
        if rates:
            return min(rates)
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        with open(os.path.join(sys_net, name, "speed")) as f:
            mbit = int(f.read().strip())
        return mbit * 1e6 / 8 if mbit > 0 else None
    except (OSError, ValueError):
        return None


def _numa(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return -1


def local_nics(sys_net: str = "/sys/class/net") -> list[dict]:
    """This rank's view of its network: every interface with an IPv4 subnet (loopback left out), its capacity
    and NUMA node, plus the InfiniBand devices behind it where ``/sys/class/infiniband`` lists them."""
    out = []
    for name in sorted(os.listdir(sys_net)) if os.path.isdir(sys_net) else []:
        ip = None if name == "lo" else _ipv4(name)
        if ip is None or ip.is_loopback:
            continue
        ib = sorted(os.listdir(os.path.join(sys_net, name, "device", "infiniband")))  \
            if os.path.isdir(os.path.join(sys_net, name, "device", "infiniband")) else []
        out.append({"name": name, "subnet": str(ip.network), "capacity": _capacity(name, sys_net),
                    "numa": _numa(os.path.join(sys_net, name, "device", "numa_node")), "ib": ib})
    return out


def _my_numa() -> int:
    """The NUMA node of the CPUs this rank may run on (-1 when unknown or spread over several)."""
    cpus = os.sched_getaffinity(0)
    nodes = set()
    base = "/sys/devices/system/node"
    for entry in os.listdir(base) if os.path.isdir(base) else []:
        if entry.startswith("node") and entry[4:].isdigit():
            for c in cpus:
                if os.path.exists(os.path.join(base, entry, f"cpu{c}")):
                    nodes.add(int(entry[4:]))
                    break
    return nodes.pop() if len(nodes) == 1 else -1


def detect(comm) -> Topology:
    """The topology of ``comm``'s ranks as the machine shows it (collective: every rank must call it).

    * Nodes: the ranks' host names (one ``allgather_object``); ranks of a node are numbered contiguously.
    * Rails: every IPv4 subnet seen by ranks of more than one node is a rail (a switch joining NIC k of every
      node); a subnet seen only within one node is that node's intra-node switch. Capacities come from each
      interface's ``tc`` rate limit, else its sysfs speed.
    * Rank-to-NIC: a rank uses the rail NIC it sees; when several rails are visible (NICs shared by the
      node's ranks), the one on its NUMA node, else local rank modulo the rails.

    With one node and no rail subnet the ranks share memory: the ``shm`` model. The emulated testbed (one
    network namespace and one host name per emulated node) is found the same way.
    """
    mine = {"host": socket.gethostname(), "nics": local_nics(), "numa": _my_numa()}
    every = comm.allgather_object(mine)
    hosts = list(dict.fromkeys(e["host"] for e in every))
    node_of = [hosts.index(e["host"]) for e in every]
    if node_of != sorted(node_of):
        raise ValueError(f"multipath: ranks interleave over hosts {[e['host'] for e in every]}; launch ranks of a "
                         f"host contiguously or give [multipath] topology as a TOML file")
    seen: dict[str, set[int]] = {}
    for e, n in zip(every, node_of):
        for nic in e["nics"]:
            seen.setdefault(nic["subnet"], set()).add(n)
    rails = sorted(sn for sn, ns in seen.items() if len(ns) > 1)
    if not rails:
        if len(hosts) > 1:
            raise ValueError("multipath: ranks on several hosts share no IPv4 subnet; give a TOML topology")
        return preset("shm", nodes=1, ranks_per_node=comm.size, rails=1)
    return Topology.from_dict(_as_dict(every, node_of, rails), name="auto")


def _rail_of(e: dict, local: int, rails: list[str]) -> tuple[int, dict]:
    mine = [nic for nic in e["nics"] if nic["subnet"] in rails]
    if len(mine) > 1 and e["numa"] >= 0:
        near = [nic for nic in mine if nic["numa"] == e["numa"]]
        mine = near or mine
    nic = mine[local % len(mine)] if len(mine) > 1 else mine[0] if mine else None
    if nic is None:
        raise ValueError(f"multipath: rank on {e['host']} sees none of the rail subnets {rails}")
    return rails.index(nic["subnet"]), nic


def _as_dict(every: list[dict], node_of: list[int], rails: list[str]) -> dict:
    """The ``loom.testbed.topology/1`` dict of what :func:`detect` gathered (vertex names as the testbed's)."""
    ranks, links = [], []
    switches = [{"id": f"rail{k}", "kind": "rail"} for k in range(len(rails))]
    for g, (e, n) in enumerate(zip(every, node_of)):
        local = g - node_of.index(n)
        k, nic = _rail_of(e, local, rails)
        ranks.append({"rank": g, "node": n, "rail": k})
        links.append({"id": f"r{g}-rail{k}", "a": f"r{g}", "b": f"rail{k}", "capacity": nic["capacity"]})
        intra = [x for x in e["nics"] if x["subnet"] not in rails]
        if node_of.count(n) > 1:
            if not any(s["id"] == f"node{n}" for s in switches):
                switches.append({"id": f"node{n}", "kind": "intra"})
            links.append({"id": f"r{g}-node{n}", "a": f"r{g}", "b": f"node{n}",
                          "capacity": intra[0]["capacity"] if intra else None})
    return {"ranks": ranks, "switches": switches, "links": links}


def resolve(spec: str, comm) -> Topology:
    """``auto`` -> :func:`detect`; ``*.toml`` -> :meth:`Topology.from_toml`; else a preset fitted to
    ``comm`` (:func:`fit_preset`). The result has exactly ``comm.size`` ranks, or ``ValueError`` says why."""
    if spec == "auto":
        return detect(comm)
    return resolve_fixed(spec, comm.size)


def resolve_fixed(spec: str, size: int | None = None) -> Topology:
    """A topology that needs no detection (a TOML file or a preset), without communicating: what
    :func:`resolve` returns for ``size`` ranks, or ``ValueError`` naming the spec and the rule. ``size=None``
    checks only that the spec names a valid topology (a preset at its default shape)."""
    import tomllib

    if spec.endswith(".toml"):
        try:
            t = Topology.from_toml(spec)
        except (OSError, tomllib.TOMLDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"multipath topology {spec!r} cannot be read ({type(exc).__name__}: {exc}); give "
                             f"'auto', a preset ({', '.join(PRESETS)}) or a readable topology TOML file") from None
    elif spec in PRESETS:
        t = preset(spec) if size is None else fit_preset(spec, size)
    else:
        raise ValueError(f"multipath topology {spec!r}: give 'auto', a TOML file or a preset "
                         f"({', '.join(PRESETS)})")
    if size is not None and t.size != size:
        raise ValueError(f"multipath topology {spec!r} has {t.size} ranks but the communicator has {size}")
    return t
