"""``Mesh``: named parallel axes over a communicator.

Ranks are laid out row-major over the axes in the order given, the last axis fastest (as
``torch.arange(world).reshape(shape)``): in ``Mesh(dp=2, sp=2)`` ranks 0 and 1 share a ``dp`` coordinate and
form one ``sp`` group. ``mesh["sp"]`` is this rank's sub-communicator along ``sp`` (named ``"sp"`` for byte
accounting); ``mesh[("dp", "sp")]`` flattens several axes into one group.

Order the axes from the least to the most talkative, as Megatron-LM does: ``Mesh(dp=2, pp=2, tp=2)`` puts
``tp`` last, so a tp group is adjacent ranks (one node, one NUMA domain with a contiguous rank mapping) and
its allreduces, one per layer in forward and backward, never cross the slow link that dp's one gradient
allreduce per step can afford. ``loom train`` lays ``dp, pp, ep, sp, tp`` in that order.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping

from ..stats import AXES, flat_axis
from .communicator import Communicator, world

__all__ = ["Mesh", "AXES"]


class Mesh:
    """Named axes over ``comm`` (default: the world).

    Args:
        axes: ``{"dp": 2, "pp": 2}`` (ordered) or keyword arguments ``Mesh(dp=2, pp=2)``.
        comm: the communicator to lay the mesh over; the product of axis sizes must equal its size.

    Raises:
        ValueError: the sizes do not multiply to the communicator size, or an axis is repeated/non-positive.
    """

    def __init__(self, axes: Mapping[str, int] | None = None, /, *, comm: Communicator | None = None, **sizes: int):
        spec: dict[str, int] = dict(axes or {})
        for k, v in sizes.items():
            if k in spec:
                raise ValueError(f"mesh axis {k!r} given twice")
            spec[k] = v
        if not spec:
            spec = {"dp": (comm or world()).size}
        for name, n in spec.items():
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError(f"mesh axis {name!r} has size {n!r}; sizes are integers >= 1")
        self.comm = comm or world()
        self.shape: dict[str, int] = spec
        total = math.prod(spec.values())
        if total != self.comm.size:
            dims = " x ".join(f"{k}={v}" for k, v in spec.items())
            raise ValueError(
                f"mesh {dims} = {total} ranks but the communicator {self.comm.name!r} has {self.comm.size}; "
                f"choose axis sizes whose product is {self.comm.size} (or launch with -n {total})"
            )
        self.names: tuple[str, ...] = tuple(spec)
        self.coords: dict[str, int] = self.coords_of(self.comm.rank)
        self._subs: dict[tuple[str, ...], Communicator] = {}

    def __repr__(self) -> str:
        dims = ", ".join(f"{k}={v}" for k, v in self.shape.items())
        return f"Mesh({dims}; rank {self.comm.rank} at {self.coords})"

    def size(self, axis: str | Iterable[str]) -> int:
        return math.prod(self.shape[a] for a in self._axes(axis))

    def coords_of(self, rank: int) -> dict[str, int]:
        out: dict[str, int] = {}
        for name in reversed(self.names):
            n = self.shape[name]
            out[name] = rank % n
            rank //= n
        return {k: out[k] for k in self.names}

    def rank_of(self, **coords: int) -> int:
        """The communicator rank at ``coords`` (missing axes default to this rank's coordinates)."""
        full = {**self.coords, **coords}
        rank = 0
        for name in self.names:
            rank = rank * self.shape[name] + full[name]
        return rank

    def _axes(self, axis: str | Iterable[str]) -> tuple[str, ...]:
        axes = (axis,) if isinstance(axis, str) else tuple(axis)
        for a in axes:
            if a not in self.shape:
                raise KeyError(f"mesh has no axis {a!r}; its axes are {', '.join(self.names)}")
        return axes

    def __getitem__(self, axis: str | Iterable[str]) -> Communicator:
        axes = self._axes(axis)
        key = tuple(a for a in self.names if a in axes)  # canonical order
        sub = self._subs.get(key)
        if sub is None:
            # Same color for ranks that agree on every *other* axis; key orders by the selected coords.
            others = [a for a in self.names if a not in key]
            color = 0
            for a in others:
                color = color * self.shape[a] + self.coords[a]
            k = 0
            for a in key:
                k = k * self.shape[a] + self.coords[a]
            sub = self.comm.split(color, k, name=flat_axis(*key) if set(key) <= set(AXES) else "+".join(key))
            self._subs[key] = sub
        return sub

    def __contains__(self, axis: str) -> bool:
        return axis in self.shape
