"""Traffic matrices for the benchmarks and ``loom plan``: how skew is defined decides the result.

``skew`` names (NIMBLE section 6 distinguishes the two kinds of zipf skew):

* ``balanced``: ``size`` bytes from every rank to every other rank.
* ``hot-pair``: a few heavy pairs (``max(1, P // 4)`` of them, rank ``k`` to rank ``P - 1 - k``) carry 90 %
  of the balanced volume, the rest is spread evenly. Multi-path helps by up to the number of disjoint paths.
* ``zipf-pairs:A``: the balanced volume spread over the ordered pairs with zipf(A) weights, pairs ranked in a
  seeded random order. Heavy pairs again.
* ``zipf-dest:A``: every source spreads its balanced volume over destinations with zipf(A) weights on a
  seeded ranking of destinations (the same for all sources): hot *destinations*, whose incoming links are
  the limit that no routing can lift.

Every matrix has the balanced total volume ``size * P * (P - 1)`` and a zero diagonal.
"""

from __future__ import annotations

import numpy as np

__all__ = ["demand_matrix", "parse_skew", "SKEWS"]

SKEWS = ("balanced", "hot-pair", "zipf-pairs:A", "zipf-dest:A")


def parse_skew(text: str) -> tuple[str, float]:
    """``"zipf-pairs:1.5"`` -> ``("zipf-pairs", 1.5)``; ``"balanced"`` -> ``("balanced", 0.0)``."""
    kind, _, arg = str(text).partition(":")
    if kind in ("balanced", "hot-pair") and not arg:
        return kind, 0.0
    if kind in ("zipf-pairs", "zipf-dest"):
        try:
            a = float(arg) if arg else 1.5
        except ValueError:
            raise ValueError(f"skew {text!r}: exponent {arg!r} is not a number; e.g. {kind}:1.5") from None
        if a <= 0:
            raise ValueError(f"skew {text!r}: exponent must be > 0")
        return kind, a
    raise ValueError(f"unknown skew {text!r}; valid: {', '.join(SKEWS)} (A a positive exponent, e.g. 1.5)")


def demand_matrix(p: int, skew: str, size: float, *, seed: int = 0) -> np.ndarray:
    """``(p, p)`` bytes for ``skew`` with the volume of ``size`` bytes per ordered pair (see module doc)."""
    kind, a = parse_skew(skew)
    if p < 1:
        raise ValueError(f"p={p} ranks must be >= 1")
    off = ~np.eye(p, dtype=bool)
    total = float(size) * p * (p - 1)
    D = np.zeros((p, p))
    if p == 1:
        return D
    rng = np.random.default_rng(seed)
    if kind == "balanced":
        D[off] = size
    elif kind == "hot-pair":
        hot = [(k, p - 1 - k) for k in range(max(1, p // 4)) if k != p - 1 - k]
        D[off] = 0.1 * total / (p * (p - 1))
        for s, d in hot:
            D[s, d] += 0.9 * total / len(hot)
    elif kind == "zipf-pairs":
        idx = np.flatnonzero(off.ravel())
        order = rng.permutation(len(idx))
        w = 1.0 / np.arange(1, len(idx) + 1) ** a
        flat = np.zeros(p * p)
        flat[idx[order]] = w / w.sum() * total
        D = flat.reshape(p, p)
    else:  # zipf-dest
        rank = rng.permutation(p)
        w = 1.0 / (rank + 1.0) ** a
        for s in range(p):
            ws = w.copy()
            ws[s] = 0
            D[s] = ws / ws.sum() * total / p
    return D
