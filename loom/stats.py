"""One registry of this process's counters, which every subsystem records into, keyed by typed axis names.

Layout: ``kind -> scope -> counter -> value``. A *kind* is the subsystem that records (:data:`KINDS`); a
*scope* is what the counter is about, usually a mesh axis or a flattened group of axes (:func:`flat_axis`),
else a communicator's name such as ``"world"``:

============  =======================  =======================================================================
kind          scope                    counters
============  =======================  =======================================================================
``comm``      communicator name        bytes this rank sent, per operation (``loom.comm.stats()`` is a view)
``compress``  communicator name        ``raw``/``wire`` bytes and ``calls`` of compressed collectives
                                       (``loom.compress.stats()`` is a view)
``offload``   ``"host"``               ``to_host``/``to_device`` bytes moved by FPDT's chunk stores
``sequence``  ``"sp"``                 ``alltoall``: sequence-parallel all-to-alls issued
``time``      axis                     ``comm``: seconds spent in that axis's communication
============  =======================  =======================================================================

Mesh axes have one spelling, :class:`Axis` (torchtitan's ``MeshAxisName``): ``dp``, ``pp``, ``sp``, ``tp``,
``ep``; a group over several axes is named by :func:`flat_axis` (``flat_axis("ep", "dp") == "dp+ep"``), which
is also how :class:`loom.comm.Mesh` names its sub-communicators, so a counter recorded under a mesh group and a
lookup by axes always agree. This module imports only the standard library: everything, ``loom.comm``
included, can record into it.
"""

from __future__ import annotations

import enum
from collections.abc import MutableMapping
from typing import Iterator, Literal

__all__ = ["Axis", "AXES", "AxisName", "flat_axis", "Kind", "KINDS", "add", "counters", "snapshot", "reset",
           "AxisCounter"]


class Axis(enum.StrEnum):
    """A mesh axis: data, pipeline, sequence, tensor or expert parallel. Compares equal to its string."""

    DP = "dp"
    PP = "pp"
    SP = "sp"
    TP = "tp"
    EP = "ep"


#: the mesh axes in their canonical order (the order of a flattened name)
AXES: tuple[str, ...] = tuple(a.value for a in Axis)
AxisName = Literal["dp", "pp", "sp", "tp", "ep"]

Kind = Literal["comm", "compress", "offload", "sequence", "time"]
KINDS: tuple[str, ...] = ("comm", "compress", "offload", "sequence", "time")

_DATA: dict[str, dict[str, dict[str, float]]] = {k: {} for k in KINDS}


def flat_axis(*axes: Axis | AxisName) -> str:
    """The name of the group spanning ``axes``: the axes in canonical order joined by ``+`` (``"dp+ep"``).

    Raises:
        ValueError: an axis is not one of :data:`AXES`, is repeated, or none is given.
    """
    names = [str(a) for a in axes]
    bad = [a for a in names if a not in AXES]
    if bad or not names or len(set(names)) != len(names):
        raise ValueError(f"flat_axis{tuple(names)}: give distinct mesh axes from {', '.join(AXES)}")
    return "+".join(sorted(names, key=AXES.index))


def _kind(kind: str) -> dict[str, dict[str, float]]:
    try:
        return _DATA[kind]
    except KeyError:
        raise ValueError(f"unknown stats kind {kind!r}; valid: {', '.join(KINDS)}") from None


def counters(kind: Kind, scope: str) -> dict[str, float]:
    """The live counter dict of ``(kind, scope)``, created empty; a hot path keeps it and adds in place.
    :func:`reset` empties it without replacing it, so a kept reference stays valid."""
    return _kind(kind).setdefault(str(scope), {})


def add(kind: Kind, scope: str, **amounts: float) -> None:
    """Add each ``counter=amount`` to ``(kind, scope)``: ``add("offload", "host", to_host=4096)``."""
    d = counters(kind, scope)
    for key, n in amounts.items():
        d[key] = d.get(key, 0) + n


def snapshot(kind: Kind | None = None) -> dict:
    """A copy of one kind (``{scope: {counter: value}}``), or of every kind (``{kind: ...}``), without empty
    scopes."""
    if kind is None:
        return {k: snapshot(k) for k in KINDS}
    return {scope: dict(d) for scope, d in _kind(kind).items() if d}


def reset(kind: Kind | None = None) -> None:
    """Zero one kind's counters, or every kind's."""
    for k in (KINDS if kind is None else (kind,)):
        for d in _kind(k).values():
            d.clear()


class AxisCounter(MutableMapping):
    """One counter of one kind seen as ``{scope: value}``, e.g. the seconds of communication per axis:
    ``AxisCounter("time", "comm")["sp"] += dt`` adds to ``counters("time", "sp")["comm"]``. A scope not
    recorded yet (or since :func:`reset`) reads 0, as in ``collections.Counter``."""

    __slots__ = ("kind", "key")

    def __init__(self, kind: Kind, key: str):
        _kind(kind)
        self.kind, self.key = kind, key

    def __getitem__(self, scope: str) -> float:
        return _DATA[self.kind].get(str(scope), {}).get(self.key, 0)

    def __contains__(self, scope: object) -> bool:
        return self.key in _DATA[self.kind].get(str(scope), {})

    def __setitem__(self, scope: str, value: float) -> None:
        counters(self.kind, scope)[self.key] = value

    def __delitem__(self, scope: str) -> None:
        del _DATA[self.kind][str(scope)][self.key]

    def __iter__(self) -> Iterator[str]:
        return iter([s for s, d in _DATA[self.kind].items() if self.key in d])

    def __len__(self) -> int:
        return sum(1 for d in _DATA[self.kind].values() if self.key in d)

    def __repr__(self) -> str:
        return f"AxisCounter({self.kind!r}, {self.key!r}: {dict(self)})"
