"""The pair metrics of :mod:`layerdiff.compare.metrics` compiled (numba), in one read of the data.

The numpy path makes about 25 float64 passes over every element (the diff ran at 0.25 GB/s on
one core). Here each sub-block of ``SUB`` elements, small enough for the L1 cache, is read once
from the chunk by a vectorised map (difference, ratio, relative error per element, with the
judge's NaN and Inf rules) and reduced while in cache. Every value the numpy path makes exactly
(maxima, the worst element, counts, ULPs, per-batch ratios) comes out bit for bit: the same
float64 operations in the same order per element, no fused multiply-add, and no fast-math but
on the sums. Only the sums (mean_abs, rms, cosine) are added in another order (vector lanes), so
they may differ from numpy's in the last bits.

Most sub-blocks change no maximum: once a pair's first sub-blocks have set the largest ratio
and relative error, a division-free screen (``_screen``: ``d <= limit * t`` in float64 with a
margin for its two roundings) shows that no element of the sub-block can exceed them, and its
two divisions per element, the kernel's bound, are skipped; only the counts, sums, largest
difference and ULPs are taken (1.5 ns an element instead of 2.4, in cache). Pairs of float32
are screened in float32 first (``_screen32``, 8 lanes, 0.33 ns an element against 0.83),
while the largest ratio is at most 1, and in float64 where that cannot decide. The sums are
the same calls in the same order either way, so every column, sums included, is bit for bit
what the kernel gave without the screens.

Import this module only when the metrics need it: importing numba costs ~0.3 s, which the CLI's
start-up must not pay. Compiled code is cached next to the module (numba's ``cache=True``).
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

SUB = 1024  # elements per sub-block: three float64 work arrays of 8 KiB stay in L1

_JIT = {"cache": True, "nogil": True, "error_model": "numpy"}
_TINY = float(np.finfo(np.float64).tiny)

# The screen (see _screen) skips a sub-block's divisions when every product threshold * divisor,
# shrunk by _SHRINK, is at least the difference. Two roundings of 2**-53 each separate the
# computed product from the exact one, so 2**-50 is a safe margin; products below _NORMAL may
# be subnormal, with less relative accuracy, and never let an element be skipped.
_SHRINK = 1.0 - 2.0**-50
_NORMAL = 2.0**-1000


@intrinsic
def _maxnum(typingctx, a, b):
    """llvm.maxnum of two float64: a maximum the loop vectoriser reduces without fast-math
    flags (numba puts none on its selects). Exact for what it is given here: never NaN."""
    def codegen(context, builder, signature, args):
        double = ir.DoubleType()
        function = builder.module.declare_intrinsic("llvm.maxnum", [double],
                                                    ir.FunctionType(double, [double, double]))
        return builder.call(function, args)
    return types.float64(types.float64, types.float64), codegen


@numba.njit(**_JIT)
def _screen(ref, port, rtol, atol, rel_floor, limit_ratio, limit_rel, diff):
    """The division-free pass over a sub-block: stores each ``|port - ref|`` in ``diff`` and
    returns (differences not finite, ratios over 1, elements that might raise the largest
    ratio past ``limit_ratio`` or the largest relative error past ``limit_rel``).

    A ratio ``fl(d / t)`` exceeds 1 exactly when ``d > t`` (t and d finite, t >= 0: for
    ``d > t`` the quotient is at least ``1 + ulp(t)/t > 1 + 2**-53``, which rounds above 1),
    and exceeds a limit L >= 0 only when ``d > L * t`` in exact arithmetic (rounding is
    monotonic, so ``d <= L * t`` gives ``fl(d / t) <= L``). Where no element can, the sub-block
    changes none of the maxima, and its divisions (the kernel's bound) are skipped."""
    bad = 0
    over = 0
    maybe = 0
    for i in range(ref.size):
        a = np.float64(ref[i])
        b = np.float64(port[i])
        d = abs(a - b)
        bad += d - d != 0.0
        m = abs(a)
        t = m * rtol
        t = t + atol
        over += d > t
        f = m if m > rel_floor else rel_floor
        p = limit_ratio * t
        q = limit_rel * f
        safe = (d <= p * _SHRINK) & (p >= _NORMAL)
        safe_rel = (d <= q * _SHRINK) & (q >= _NORMAL)
        skip = (d == 0.0) | (safe & safe_rel)
        maybe += not skip
        diff[i] = d
    return bad, over, maybe


# The float32 screen (_screen32) decides in float32, 8 elements to an AVX2 vector, with a
# margin of 2**-20 (16 float32 roundings of 2**-24, where its own five need 5) and products
# of at least 2**-100, far from float32's subnormals.
_SHRINK32 = np.float32(1.0 - 2.0**-20)
_NORMAL32 = np.float32(2.0**-100)
_MAX32 = np.float32(np.finfo(np.float32).max)


@numba.njit(**_JIT)
def _down32(x):
    """A float32 no larger than ``x >= 0`` and within 2**-21 of it: 0 below 2**-100,
    float32's largest at or above it (the screens only need bounds from below)."""
    if x < 2.0**-100:
        return np.float32(0.0)
    if x >= _MAX32:
        return _MAX32
    return np.float32(x * (1.0 - 2.0**-22))  # rounds to within 2**-24 of x * (1 - 2**-22)


@numba.njit(**_JIT)
def _screen32(ref, port, rtol, atol, rel_floor, limit_ratio, limit_rel):
    """True when, for elements of two float32 arrays, no ratio can exceed ``limit_ratio``
    (at most 1: so none exceeds 1 either, and no element is out of tolerance) and no relative
    error ``limit_rel``. All arguments are float32 bounds from below (_down32).

    The float32 difference, the threshold's product and sum, the limit's product and the
    margin's carry five roundings of at most 2**-24, and the float64 values the kernel
    divides two of 2**-53; the tolerances and limits, rounded down, only make the products
    smaller. So ``d32 <= p32 * (1 - 2**-20)`` with ``p32 >= 2**-100`` leaves
    ``|port - ref| < limit * t`` in float64, and ``fl(d / t) <= limit`` (_screen's
    argument). A difference that is not finite in float32 is never screened, nor is a
    product that overflows. Twice as fast as _screen's float64 (8 lanes, no counts: the only
    reduction is an or, which vectorises)."""
    maybe = False
    for i in range(ref.size):
        a = np.float32(ref[i])
        d = abs(a - np.float32(port[i]))
        m = abs(a)
        t = m * rtol
        t = t + atol
        p = limit_ratio * t
        q = limit_rel * max(m, rel_floor)
        low = min(p, q)
        skip = (d <= low * _SHRINK32) & (low >= _NORMAL32) & (max(p, q) <= _MAX32)
        maybe |= not (skip | (d == np.float32(0.0)))
    return not maybe


@numba.njit(**_JIT)
def _differences(ref, port, diff):
    """``|port - ref|`` in float64 per element (the screened path's sums and maxima)."""
    for i in range(ref.size):
        diff[i] = abs(np.float64(ref[i]) - np.float64(port[i]))


@numba.njit(**_JIT)
def _largest(values):
    """The largest of values that are never NaN and never -0.0 (vectorised)."""
    top = 0.0
    for i in range(values.size):
        top = _maxnum(top, values[i])
    return top


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
def _ulps_narrow(ref_bits, port_bits, mask):
    """_ulps for floats of 32 bits or fewer, in 32-bit lanes (8 to an AVX2 vector, against 4
    for int64): their ordered values fit an int32 and the distance between two a uint32. The
    same distances as _ordered's: -0.0 and +0.0 are both 0."""
    magnitude = np.int32(mask)
    top = np.uint32(0)
    for i in range(ref_bits.size):
        x = np.int32(ref_bits[i])
        y = np.int32(port_bits[i])
        x = np.int32(-(x & magnitude)) if x < 0 else x
        y = np.int32(-(y & magnitude)) if y < 0 else y
        distance = np.uint32(np.int64(max(x, y)) - np.int64(min(x, y)))
        top = max(top, distance)
    return np.int64(top)


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


# What fused carries from one sub-block to the next: three tuples of scalars, ``top`` (float64
# maxima), ``sums`` (float64, in _sums's order) and ``counts`` (int64: the worst index, the
# out count, the largest ULP distance, then the NaN and Inf counts in _non_finite's order).
# Only fused handles arrays; the pieces that merge a sub-block's results take and give
# scalars, which stay in registers as fused's sixteen locals did when it was one function
# (accumulators in arrays, with the arrays passed down to per-sub-block functions, measured
# 5-20% slower in cache: each array passed is reference-counted; docs/benchmarks.md, issue
# 41). Each merge makes the same float64 operations in the same order, so every column, the
# sums included, is the same bit for bit (tests/test_kernels_split.py).
_MAX_ABS, _MAX_REL, _FINITE_RATIO, _BEST = 0, 1, 2, 3  # top
_WORST, _OUT, _ULP = 0, 1, 2                            # counts (then the 4 NaN and Inf)


@numba.njit(**_JIT)
def fused(ref, port, ref_bits, port_bits, ulp_width, rtol, atol, start, per_element,
          batch_ratio, known_ratio, known_finite, known_rel):
    """Everything one call of ``PairMetrics`` needs from flat elements ``start ..`` of a pair,
    in the order PairMetrics._kernel_update unpacks them.

    ``ref_bits``/``port_bits`` are the inputs' integer views and ``ulp_width`` their width in
    bits when ULPs are wanted, else 0. ``per_element`` is the elements per batch row when
    ``batch_ratio`` (updated in place with each row's largest ratio) is wanted, else 0.
    ``rtol`` and ``atol`` must be finite and >= 0 (the caller checks): then a zero difference
    has ratio 0 and a non-finite one ratio inf, as in the numpy path however its blocks fall.

    ``known_ratio`` (-1 before the first element), ``known_finite`` and ``known_rel`` are what
    the pair's earlier chunks gave for the ratio, the finite ratio and the relative error:
    the caller merges this call's results with them by maximum, so a sub-block that cannot
    exceed them (nor its batch row's ratio) is screened without divisions (_screen). The
    maxima returned may then stop below those values; merged, every column is the same.
    """
    rel_floor = atol if atol != 0.0 else _TINY
    narrow = ref.itemsize == 4 and port.itemsize == 4  # float32 both (float16 widened)
    rtol32, atol32, floor32 = _down32(rtol), _down32(atol), _down32(rel_floor)
    mask = (np.int64(1) << np.int64(ulp_width - 1)) - np.int64(1) if ulp_width else np.int64(0)
    n = ref.size
    diff, ratio, rel = np.empty(min(n, SUB)), np.empty(min(n, SUB)), np.empty(min(n, SUB))
    top = (0.0, 0.0, 0.0, -1.0)  # best -1: the first element is the worst until a larger one
    sums = (0.0, 0.0, 0.0, 0.0, 0.0)
    zero = np.int64(0)
    counts = (np.int64(-1), zero, zero, zero, zero, zero, zero)
    begin = 0
    while begin < n:
        row = -1
        end = min(n, begin + SUB)
        if per_element > 0:  # sub-blocks within one batch row
            row = (start + begin) // per_element
            end = min(end, (row + 1) * per_element - start)
        k = end - begin
        d, r, e = diff[:k], ratio[:k], rel[:k]
        a, b = ref[begin:end], port[begin:end]
        # what an element must exceed to change anything: the ratio (first index of the
        # largest, its batch row's, the finite one) and the relative error, each as merged
        limit_ratio = min(max(top[_BEST], known_ratio), max(top[_FINITE_RATIO], known_finite))
        if row >= 0:
            limit_ratio = min(limit_ratio, batch_ratio[row])
        if limit_ratio >= 0.0:
            limit_rel = max(top[_MAX_REL], known_rel)
            if narrow and limit_ratio <= 1.0 and _screen32(
                    a, b, rtol32, atol32, floor32, _down32(limit_ratio), _down32(limit_rel)):
                _differences(a, b, d)
                bad = over = maybe = 0
            else:
                bad, over, maybe = _screen(a, b, rtol, atol, rel_floor, limit_ratio,
                                           limit_rel, d)
            if bad == 0 and maybe == 0:  # no maximum moves: counts, sums and ULPs only
                top_d, found = _largest(d), _sums(a, b, d)  # then the ULPs: a, b still in L1
                ulp = _block_ulps(ref_bits[begin:end], port_bits[begin:end], mask, ulp_width,
                                  counts[_ULP])
                top, sums, counts = _add_screened(top, sums, counts, over, top_d, found, ulp)
                begin = end
                continue
        bad = _map(a, b, rtol, atol, rel_floor, d, r, e)
        top_r, top_e, top_d, over = _maxima(r, e, d)
        worst = counts[_WORST]
        if top_r > top[_BEST]:  # the first element with the largest ratio, as numpy's argmax
            worst = start + begin + _first(r, top_r)
        if row >= 0 and top_r > batch_ratio[row]:
            batch_ratio[row] = top_r
        if bad == 0:  # what _non_finite gives, for a sub-block whose values are all finite
            # numba reads no starred call in a tuple: concatenated
            found = _sums(a, b, d) + (top_r, _block_ulps(  # noqa: RUF005
                ref_bits[begin:end], port_bits[begin:end], mask, ulp_width, zero), zero, zero,
                zero, zero)
        else:
            found = _non_finite(a, b, d, r, ref_bits[begin:end], port_bits[begin:end], mask,
                                ulp_width != 0)
        top, sums, counts = _add_divided(top, sums, counts, top_r, top_e, top_d, over, worst,
                                         found)
        begin = end
    return (top[_MAX_ABS], top[_MAX_REL], *sums, top[_BEST], counts[_WORST], top[_FINITE_RATIO],
            counts[_OUT], counts[_ULP], *counts[3:])


@numba.njit(inline="always", **_JIT)  # as if written in fused: no call, no reference counts
def _block_ulps(a_bits, b_bits, mask, ulp_width, top):
    """The larger of ``top`` and the largest ULP distance of a sub-block whose values are all
    finite (``ulp_width`` 0: ``top``)."""
    if ulp_width == 0:
        return top
    u = _ulps_narrow(a_bits, b_bits, mask) if ulp_width <= 32 else _ulps(a_bits, b_bits, mask)
    return u if u > top else top


@numba.njit(**_JIT)
def _first(values, x):
    """The index of the first element of ``values`` equal to ``x``, one of them."""
    for j in range(values.size):
        if values[j] == x:
            return j
    return -1


@numba.njit(**_JIT)
def _plus(x, y):
    """Five sums plus five more, one float64 add each."""
    return x[0] + y[0], x[1] + y[1], x[2] + y[2], x[3] + y[3], x[4] + y[4]


@numba.njit(**_JIT)
def _add_screened(top, sums, counts, over, top_d, found, ulp):
    """``top``, ``sums`` and ``counts`` after a screened sub-block: its ``over`` elements out
    of tolerance, its largest difference, its sums (_sums) and the largest ULP distance."""
    max_abs = top_d if top_d > top[_MAX_ABS] else top[_MAX_ABS]
    return ((max_abs,) + top[1:], _plus(sums, found),  # noqa: RUF005 (numba: no starred)
            (counts[_WORST], counts[_OUT] + over, ulp) + counts[3:])  # noqa: RUF005


@numba.njit(**_JIT)
def _add_divided(top, sums, counts, top_r, top_e, top_d, over, worst, found):
    """``top``, ``sums`` and ``counts`` after a sub-block taken with its divisions: its
    largest ratio, relative error and difference, ``over`` elements out of tolerance, the
    ``worst`` index so far, and ``found`` as _non_finite gives it (sums, finite ratio, ULP
    distance, NaN and Inf counts)."""
    max_abs, max_rel, finite_ratio, best = top
    max_abs = top_d if top_d > max_abs else max_abs
    max_rel = top_e if top_e > max_rel else max_rel
    finite_ratio = found[5] if found[5] > finite_ratio else finite_ratio
    best = top_r if top_r > best else best
    ulp = found[6] if found[6] > counts[_ULP] else counts[_ULP]
    return ((max_abs, max_rel, finite_ratio, best), _plus(sums, found[:5]),
            (worst, counts[_OUT] + over, ulp, counts[3] + found[7], counts[4] + found[8],
             counts[5] + found[9], counts[6] + found[10]))
