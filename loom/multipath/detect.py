"""Which topology a job runs on: a file, a preset fitted to the job, or ``auto`` (found from the machine).

:func:`resolve` turns a ``[multipath] topology`` setting into a :class:`Topology` whose ranks are the
communicator's ranks, in order; :func:`detect` builds one from what the ranks can see (see its docstring).
"""

from __future__ import annotations

import socket

from .topology import PRESETS, Topology, preset

__all__ = ["detect", "fit_preset", "resolve"]


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


def detect(comm) -> Topology:
    """The topology of ``comm``'s ranks as the machine shows it.

    Inside a running ``loom testbed`` the testbed's own description; otherwise the ranks' host names (one
    ``allgather_object``) give the nodes, and the ranks of one host share its memory (the ``shm`` model).
    Collective: every rank of ``comm`` must call it.
    """
    from loom.testbed import current_topology

    d = current_topology()
    if d is not None and len(d["ranks"]) == comm.size:
        return Topology.from_dict(d, name="testbed")
    hosts = comm.allgather_object(socket.gethostname())
    if len(set(hosts)) == 1:
        return preset("shm", nodes=1, ranks_per_node=comm.size, rails=1)
    order = list(dict.fromkeys(hosts))
    per = {h: hosts.count(h) for h in order}
    contiguous = all(hosts[i] == order[i // per[order[0]]] for i in range(len(hosts)))
    if len(set(per.values())) != 1 or not contiguous:
        raise ValueError(f"multipath: ranks are spread unevenly or interleaved over hosts {per}; give "
                         f"[multipath] topology as a TOML file")
    return preset("shm", nodes=len(order), ranks_per_node=per[order[0]], rails=1)


def resolve(spec: str, comm) -> Topology:
    """``auto`` -> :func:`detect`; ``*.toml`` -> :meth:`Topology.from_toml`; else a preset fitted to
    ``comm`` (:func:`fit_preset`). The result has exactly ``comm.size`` ranks, or ``ValueError`` says why."""
    if spec == "auto":
        return detect(comm)
    if spec.endswith(".toml"):
        t = Topology.from_toml(spec)
    elif spec in PRESETS:
        t = fit_preset(spec, comm.size)
    else:
        raise ValueError(f"multipath topology {spec!r}: give 'auto', a TOML file or a preset "
                         f"({', '.join(PRESETS)})")
    if t.size != comm.size:
        raise ValueError(f"multipath topology {spec!r} has {t.size} ranks but the communicator has {comm.size}")
    return t
