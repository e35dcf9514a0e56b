"""The pair metrics of :mod:`layerdiff.compare.metrics` compiled (numba), in one read of the data.

The numpy path makes about 25 float64 passes over every element (the diff ran at 0.25 GB/s on
one core). Here each sub-block of ``SUB`` elements, small enough for the L1 cache, is read once
from the chunk by a vectorised map (difference, ratio, relative error per element, with the
judge's NaN and Inf rules) and reduced while in cache. Every value the numpy path makes exactly
(maxima, the worst element, counts, ULPs, per-batch ratios) comes out bit for bit: the same
float64 operations in the same order per element, no fused multiply-add, and no fast-math but
on the sums. Only the sums (mean_abs, rms, cosine) are added in another order (vector lanes), so
they may differ from numpy's in the last bits.

Import this module only when the metrics need it: importing numba costs ~0.3 s, which the CLI's
start-up must not pay. Compiled code is cached next to the module (numba's ``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np

SUB = 1024  # elements per sub-block: three float64 work arrays of 8 KiB stay in L1

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
_TINY = float(np.finfo(np.float64).tiny)


@numba.njit(**_JIT)
def _map(ref, port, rtol, atol, rel_floor, diff, ratio, rel):
    """Per element ``|port - ref|``, its ratio and its relative error, as judge.differences and
    judge.ratios make them (NaN on both sides, or equal infinities: 0; any other non-finite
    difference: inf, and so are its ratio and relative error); returns how many differences
    were not finite. Select-only, so it vectorises."""
    bad = 0
    for i in range(ref.size):
        a = np.float64(ref[i])
        b = np.float64(port[i])
        d = abs(a - b)
        finite = d - d == 0.0
        bad += not finite
        m = abs(a)
        t = m * rtol
        t = t + atol
        r = d / t
        r = 0.0 if d == 0.0 else r
        e = d / (m if m > rel_floor else rel_floor)
        same = (a == b) | ((a != a) & (b != b))
        d = d if finite else (0.0 if same else np.inf)
        diff[i] = d
        ratio[i] = r if finite else d
        rel[i] = e if finite else d
    return bad


@numba.njit(fastmath={"nnan", "nsz"}, **_JIT)
def _maxima(ratio, rel, diff):
    """(largest ratio, largest relative error, largest difference, ratios over 1). None of
    them is NaN or -0.0 (see _map), so the flags that let these maxima vectorise are exact."""
    top_r = top_e = top_d = 0.0
    over = 0
    for j in range(ratio.size):
        x = ratio[j]
        top_r = x if x > top_r else top_r
        over += x > 1.0
        x = rel[j]
        top_e = x if x > top_e else top_e
        x = diff[j]
        top_d = x if x > top_d else top_d
    return top_r, top_e, top_d, over


@numba.njit(fastmath={"reassoc"}, **_JIT)
def _sums(ref, port, diff):
    """Sum of differences and of their squares, dot product and both squared norms, for a
    sub-block whose values are all finite. The one place allowed to reassociate: sums only."""
    s_abs = s_sq = dot = ref_sq = port_sq = 0.0
    for i in range(ref.size):
        a = np.float64(ref[i])
        b = np.float64(port[i])
        d = diff[i]
        s_abs += d
        s_sq += d * d
        dot += a * b
        ref_sq += a * a
        port_sq += b * b
    return s_abs, s_sq, dot, ref_sq, port_sq


@numba.njit(**_JIT)
def _ordered(bits, mask):
    """A float's bits as an integer whose differences count ULPs (metrics.ordered_bits)."""
    x = np.int64(bits)
    sign = x >> np.int64(63)
    return (x ^ (sign & mask)) - sign


@numba.njit(**_JIT)
def _ulps(ref_bits, port_bits, mask):
    """The largest ULP distance of a sub-block whose values are all finite (int64, wrapping as
    numpy's does for float64 values far apart)."""
    top = np.int64(0)
    for i in range(ref_bits.size):
        u = _ordered(ref_bits[i], mask) - _ordered(port_bits[i], mask)
        u = -u if u < 0 else u
        top = u if u > top else top
    return top


@numba.njit(**_JIT)
def _non_finite(ref, port, diff, ratio, ref_bits, port_bits, mask, ulp):
    """What a sub-block with NaN or Inf adds: its NaN and Inf counts, its sums (the products
    over the elements finite on both sides), the largest ratio where the reference is finite
    and the largest ULP distance where both are. Element by element; rare."""
    ref_nan = ref_inf = port_nan = port_inf = 0
    s_abs = s_sq = dot = ref_sq = port_sq = 0.0
    finite_ratio = 0.0
    top = np.int64(0)
    for i in range(ref.size):
        a = np.float64(ref[i])
        b = np.float64(port[i])
        a_nan = a != a
        b_nan = b != b
        a_inf = not a_nan and a - a != 0.0
        b_inf = not b_nan and b - b != 0.0
        ref_nan += a_nan
        ref_inf += a_inf
        port_nan += b_nan
        port_inf += b_inf
        d = diff[i]
        s_abs += d
        s_sq += d * d
        if a_nan or a_inf:
            continue
        if ratio[i] > finite_ratio:
            finite_ratio = ratio[i]
        if b_nan or b_inf:
            continue
        dot += a * b
        ref_sq += a * a
        port_sq += b * b
        if ulp:
            u = _ordered(ref_bits[i], mask) - _ordered(port_bits[i], mask)
            u = -u if u < 0 else u
            top = u if u > top else top
    return (s_abs, s_sq, dot, ref_sq, port_sq, finite_ratio, top, ref_nan, ref_inf, port_nan,
            port_inf)


@numba.njit(**_JIT)
def fused(ref, port, ref_bits, port_bits, ulp_width, rtol, atol, start, per_element,
          batch_ratio):
    """Everything one call of ``PairMetrics`` needs from flat elements ``start ..`` of a pair,
    in the order PairMetrics._kernel_update unpacks them.

    ``ref_bits``/``port_bits`` are the inputs' integer views and ``ulp_width`` their width in
    bits when ULPs are wanted, else 0. ``per_element`` is the elements per batch row when
    ``batch_ratio`` (updated in place with each row's largest ratio) is wanted, else 0.
    ``rtol`` and ``atol`` must be finite and >= 0 (the caller checks): then a zero difference
    has ratio 0 and a non-finite one ratio inf, as in the numpy path however its blocks fall.
    """
    rel_floor = atol if atol != 0.0 else _TINY
    mask = (np.int64(1) << np.int64(ulp_width - 1)) - np.int64(1) if ulp_width else np.int64(0)
    n = ref.size
    diff = np.empty(min(n, SUB))
    ratio = np.empty(min(n, SUB))
    rel = np.empty(min(n, SUB))
    max_abs = max_rel = finite_ratio = 0.0
    s_abs = s_sq = dot = ref_sq = port_sq = 0.0
    best = -1.0  # below every ratio: the first element is the worst until a larger one
    worst = -1
    out = 0
    ulp_top = np.int64(0)
    ref_nan = ref_inf = port_nan = port_inf = 0
    begin = 0
    while begin < n:
        row = 0
        end = min(n, begin + SUB)
        if per_element > 0:  # sub-blocks within one batch row
            row = (start + begin) // per_element
            end = min(end, (row + 1) * per_element - start)
        k = end - begin
        d, r, e = diff[:k], ratio[:k], rel[:k]
        a, b = ref[begin:end], port[begin:end]
        bad = _map(a, b, rtol, atol, rel_floor, d, r, e)
        top_r, top_e, top_d, over = _maxima(r, e, d)
        out += over
        max_abs = top_d if top_d > max_abs else max_abs
        max_rel = top_e if top_e > max_rel else max_rel
        if top_r > best:  # the first element with the largest ratio, as numpy's argmax
            for j in range(k):
                if r[j] == top_r:
                    best = top_r
                    worst = start + begin + j
                    break
        if per_element > 0 and top_r > batch_ratio[row]:
            batch_ratio[row] = top_r
        if bad == 0:
            found = _sums(a, b, d)
            finite_ratio = top_r if top_r > finite_ratio else finite_ratio
            if ulp_width:
                u = _ulps(ref_bits[begin:end], port_bits[begin:end], mask)
                ulp_top = u if u > ulp_top else ulp_top
        else:
            rare = _non_finite(a, b, d, r, ref_bits[begin:end], port_bits[begin:end], mask,
                               ulp_width != 0)
            found = rare[:5]
            finite_ratio = rare[5] if rare[5] > finite_ratio else finite_ratio
            ulp_top = rare[6] if rare[6] > ulp_top else ulp_top
            ref_nan += rare[7]
            ref_inf += rare[8]
            port_nan += rare[9]
            port_inf += rare[10]
        s_abs += found[0]
        s_sq += found[1]
        dot += found[2]
        ref_sq += found[3]
        port_sq += found[4]
        begin = end
    return (max_abs, max_rel, s_abs, s_sq, dot, ref_sq, port_sq, best, worst, finite_ratio,
            out, ulp_top, ref_nan, ref_inf, port_nan, port_inf)
