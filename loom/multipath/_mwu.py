"""The planner's loops compiled with numba (the method is in :mod:`loom.multipath.planner`'s docstring).

Arrays: ``links`` ``(paths, l_max)`` int32 directed-link indices, -1 padded; ``ptr`` ``(pairs + 1,)`` path
offsets per pair; ``x`` ``(paths,)`` bytes per path; ``base`` bytes per link from pairs not being planned;
``inv_c`` ``1 / capacity`` per link (0 for unlimited links). One round costs O(paths x l_max); the loops run
in the same order on every rank, so equal inputs give bit-identical plans.

Compiled on first use and cached on disk next to this file (numba ``cache=True``), so a job pays the
compilation once per machine, not once per rank and run.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

__all__ = ["carry", "cut_bytes", "gather_paths", "l1_change", "loads", "rounds", "split_demand"]

# Terms of the potential more than this many e-folds below its largest term change no float64 result.
_NEGLIGIBLE = 40.0


@njit(cache=True)
def _add_path(links, p, f, out):
    """``out[e] += f`` for every directed link ``e`` of path ``p``."""
    for j in range(links.shape[1]):
        e = links[p, j]
        if e < 0:
            break
        out[e] += f


@njit(cache=True)
def loads(links, x, base, out):
    """``out = base + sum_p x_p [e in p]``."""
    out[:] = base
    for p in range(links.shape[0]):
        if x[p] != 0.0:
            _add_path(links, p, x[p], out)


@njit(cache=True)
def split_demand(D, min_bytes, static, node, pid, vol, base, flex, sent, received, local):
    """One pass over the ``(P, P)`` demand ``D``: pairs with at least ``min_bytes`` (and > 0) go to ``pid``
    (``s * P + d``) and ``vol`` and their bytes to ``flex`` along their static routes (``static``, one row per
    ``s * P + d``), the other non-zero pairs' bytes to ``base`` along theirs; per rank the bytes ``sent`` and
    ``received``, per node (``node``: each rank's) the bytes between its own ranks (``local``). The diagonal
    is skipped; every output array is zeroed here. Returns the flexible count, or -1 at the first negative or non-finite
    entry (diagonal included)."""
    p = D.shape[0]
    base[:] = 0.0
    flex[:] = 0.0
    received[:] = 0.0
    local[:] = 0.0
    nf = 0
    for s in range(p):
        row = 0.0
        for d in range(p):
            v = D[s, d]
            if not (v >= 0.0 and v < np.inf):
                return -1
            if s == d or v == 0.0:
                continue
            row += v
            received[d] += v
            if node[s] == node[d]:
                local[node[s]] += v
            q = s * p + d
            if v >= min_bytes:
                pid[nf] = q
                vol[nf] = v
                nf += 1
                _add_path(static, q, v, flex)
            else:
                _add_path(static, q, v, base)
        sent[s] = row
    return nf


@njit(cache=True)
def cut_bytes(sent, received, local, node, out):
    """``out``: bytes over each cut of :class:`loom.multipath.paths.Cuts` (rank 0 out, rank 0 in, ...; then,
    when ``out`` has room, node 0 out, node 0 in, ...: its ranks' bytes less those between them)."""
    p = sent.size
    for r in range(p):
        out[2 * r] = sent[r]
        out[2 * r + 1] = received[r]
    if out.size > 2 * p:
        for n in range(local.size):
            out[2 * p + 2 * n] = -local[n]
            out[2 * p + 2 * n + 1] = -local[n]
        for r in range(p):
            out[2 * p + 2 * node[r]] += sent[r]
            out[2 * p + 2 * node[r] + 1] += received[r]


@njit(cache=True)
def gather_paths(slots, k, table):
    """The candidate paths of the path-table rows ``slots`` (``k``: paths per row, ``table``: ``(rows, k_max,
    l_max)`` links) flattened in row order: ``(ptr, pair_of, links)`` as :class:`Candidates` holds them."""
    n = slots.size
    ptr = np.zeros(n + 1, np.int64)
    for i in range(n):
        ptr[i + 1] = ptr[i] + k[slots[i]]
    m = ptr[n]
    width = table.shape[2]
    pair_of = np.empty(m, np.int64)
    links = np.empty((m, width), np.int32)
    for i in range(n):
        r = slots[i]
        for j in range(ptr[i + 1] - ptr[i]):
            q = ptr[i] + j
            pair_of[q] = i
            for e in range(width):
                links[q, e] = table[r, j, e]
    return ptr, pair_of, links


@njit(cache=True)
def carry(old_pid, old_ptr, old_flows, old_vol, pid, ptr, vol, out):
    """``out``: each pair of ``pid`` (ascending ``s * P + d``, paths at ``ptr``) gets ``vol`` bytes split in
    the shares its paths had in the old plan (``old_*``, ascending too); a pair new to it all on path 0."""
    j = 0
    for i in range(pid.size):
        q = pid[i]
        while j < old_pid.size and old_pid[j] < q:
            j += 1
        a, b = ptr[i], ptr[i + 1]
        if j < old_pid.size and old_pid[j] == q and old_vol[j] > 0.0:
            o = old_ptr[j]
            for t in range(b - a):
                out[a + t] = old_flows[o + t] / old_vol[j] * vol[i]
        else:
            out[a] = vol[i]
            for t in range(a + 1, b):
                out[t] = 0.0


@njit(cache=True)
def l1_change(D, old):
    """``(sum |D - old|, sum old)``."""
    diff = 0.0
    total = 0.0
    for s in range(D.shape[0]):
        for d in range(D.shape[1]):
            diff += abs(D[s, d] - old[s, d])
            total += old[s, d]
    return diff, total


@njit(cache=True)
def _max_util(L, inv_c):
    m = 0.0
    for e in range(L.size):
        v = L[e] * inv_c[e]
        if v > m:
            m = v
    return m


@njit(cache=True)
def _slope(a, b, k, g, eta, top):
    """The potential's first and second derivative in ``g`` (scaled by ``exp(-eta top)``)."""
    s1 = 0.0
    s2 = 0.0
    for i in range(k):
        v = b[i] * math.exp(eta * (a[i] + g * b[i] - top))
        s1 += v
        s2 += b[i] * v
    return s1, eta * s2


@njit(cache=True)
def _line_search(L0, L1, inv_c, eta, lam, a, b):
    """``argmin_{g in [0,1]} sum_e exp(eta ((1-g) L0 + g L1)_e / (c_e lam))``: convex in ``g``, so Newton on
    its derivative inside a shrinking bracket (bisection when Newton leaves it), to float precision.
    ``a``, ``b``: scratch."""
    m = 0
    top = -np.inf
    for e in range(L0.size):
        be = (L1[e] - L0[e]) * inv_c[e] / lam
        if be != 0.0:
            ae = L0[e] * inv_c[e] / lam
            a[m] = ae
            b[m] = be
            m += 1
            top = max(top, ae, ae + be)
    if m == 0:
        return 0.0
    k = 0
    cut = top - _NEGLIGIBLE / eta
    for i in range(m):
        if max(a[i], a[i] + b[i]) >= cut:
            a[k] = a[i]
            b[k] = b[i]
            k += 1
    if _slope(a, b, k, 0.0, eta, top)[0] >= 0.0:
        return 0.0
    if _slope(a, b, k, 1.0, eta, top)[0] <= 0.0:
        return 1.0
    lo, hi, g = 0.0, 1.0, 0.5
    for _ in range(64):
        s1, s2 = _slope(a, b, k, g, eta, top)
        if s1 < 0.0:
            lo = g
        else:
            hi = g
        nxt = g - s1 / s2 if s2 > 0.0 else 0.5 * (lo + hi)
        if not lo < nxt < hi:
            nxt = 0.5 * (lo + hi)
        done = abs(nxt - g) <= 1e-13 or hi - lo <= 1e-13
        g = nxt
        if done:
            break
    return g


@njit(cache=True)
def _sym_diff(links, p, q, g2, mark, stamp):
    """``sum g2`` over the links in exactly one of paths ``p`` and ``q`` (the Newton step's curvature);
    ``mark``: per-link scratch, ``stamp``: a value not yet in it."""
    s = 0.0
    for j in range(links.shape[1]):
        e = links[q, j]
        if e < 0:
            break
        mark[e] = stamp
        s += g2[e]
    for j in range(links.shape[1]):
        e = links[p, j]
        if e < 0:
            break
        if mark[e] == stamp:
            s -= g2[e]  # on both paths: no change of load
        else:
            s += g2[e]
    return s


@njit(cache=True)
def _directions(links, ptr, x, w, g1, g2, by_gradient, best, worst, t, mark, stamp, L, Ly):
    """Per pair: the cheapest path, the costliest used path and the Newton shift between them, in one pass
    over each pair's paths; ``Ly``: the link loads ``L`` after every shift in full. Returns ``(whether any
    pair moves, the next unused stamp)``.

    Cost of a path: its bottleneck ``max w_e`` with the gradient ``sum g1_e`` breaking exact ties (compared
    as a pair, so the choice does not depend on the unit of the capacities), or the gradient alone when
    ``by_gradient``; ties go to the earlier path."""
    any_move = False
    Ly[:] = L
    for i in range(ptr.size - 1):
        a, b = ptr[i], ptr[i + 1]
        t[i] = 0.0
        if b - a < 2:
            continue
        bi, bb, bg = a, np.inf, np.inf
        wi, wg = -1, -np.inf
        for p in range(a, b):
            bm = 0.0
            s = 0.0
            for j in range(links.shape[1]):
                e = links[p, j]
                if e < 0:
                    break
                if w[e] > bm:
                    bm = w[e]
                s += g1[e]
            if (s < bg) if by_gradient else (bm < bb or (bm == bb and s < bg)):
                bi, bb, bg = p, bm, s
            if x[p] > 0.0 and s > wg:
                wi, wg = p, s
        d1 = bg - wg
        if wi < 0 or bi == wi or not d1 < 0.0:
            continue
        d2 = max(_sym_diff(links, bi, wi, g2, mark, stamp), 0.0)
        stamp += 1
        step = min(-d1 / max(d2, 1e-300), x[wi])
        if step > 0.0:
            best[i], worst[i], t[i] = bi, wi, step
            _add_path(links, bi, step, Ly)
            _add_path(links, wi, -step, Ly)
            any_move = True
    return any_move, stamp


@njit(cache=True)
def rounds(links, ptr, x, L, inv_c, increments, epsilon, sharp, patience, gain, bound):
    """Run up to ``increments`` rounds from the flows ``x`` (modified) and their link loads ``L`` (modified;
    fixed pairs included); return ``(best flows, their congestion, rounds run)``. ``sharp``:
    start at the target steepness (a warm start near the optimum). ``patience``: stop after that many rounds
    without a relative ``gain`` in congestion (0: never). ``bound``: a lower bound on the congestion; stop
    once within ``gain`` of it."""
    n_links = L.size
    n_pairs = ptr.size - 1
    log_m = math.log(max(n_links, 2))
    best_lam = _max_util(L, inv_c)
    best_x = x.copy()
    Ly = np.empty(n_links)
    w, g1, g2 = np.empty(n_links), np.empty(n_links), np.empty(n_links)
    sa, sb = np.empty(n_links), np.empty(n_links)
    best, worst = np.zeros(n_pairs, np.int64), np.zeros(n_pairs, np.int64)
    t = np.zeros(n_pairs)
    mark = np.zeros(n_links, np.int64)
    stamp = 1
    done = 0
    since = 0
    for it in range(increments):
        done = it + 1
        frac = 1.0 if sharp else min(1.0, 2.0 * (it + 1) / max(increments, 1))
        eta = log_m / epsilon ** frac
        lam = _max_util(L, inv_c)
        if lam <= 0.0:
            break
        for e in range(n_links):
            scale = eta * inv_c[e] / lam
            wexp = math.exp(eta * (L[e] * inv_c[e] / lam - 1.0))
            w[e] = wexp * inv_c[e]
            g1[e] = scale * wexp
            g2[e] = scale * scale * wexp
        g = 0.0
        for by_gradient in (False, True):
            moved, stamp = _directions(links, ptr, x, w, g1, g2, by_gradient, best, worst, t, mark, stamp, L, Ly)
            if not moved:
                continue
            g = _line_search(L, Ly, inv_c, eta, lam, sa, sb)
            if g > 0.0:
                break
        if g <= 0.0:
            break
        for i in range(n_pairs):
            if t[i] > 0.0:
                x[worst[i]] = max(x[worst[i]] - g * t[i], 0.0)
                x[best[i]] += g * t[i]
        for e in range(n_links):
            L[e] += g * (Ly[e] - L[e])
        lam_x = _max_util(L, inv_c)
        since += 1
        if lam_x < best_lam:
            if lam_x < best_lam * (1.0 - gain):
                since = 0
            best_lam = lam_x
            best_x[:] = x
        if (patience > 0 and since >= patience) or best_lam <= bound * (1.0 + gain):
            break
    return best_x, best_lam, done
