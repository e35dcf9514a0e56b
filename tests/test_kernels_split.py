"""kernels.fused, split into pieces of at most 80 lines (issue 41), gives what the one
112-line function gave before, bit for bit: every column (the sums too, whose order is
kernel-specific), its Python types, and the batch rows it raises in place.

The previous body is kept below, verbatim, as the oracle; it calls the same leaf kernels
(_screen, _map, _sums, ...), so what is checked is the part that was split: the sub-block
loop, what it carries from one sub-block to the next and how it merges them. Pairs of every
dtype combination the diff passes (aot.COMBINATIONS), with NaN, Inf, zeros of both signs,
subnormals and the largest finite values, chunk starts inside a pair and batch rows, and
what earlier chunks gave (``known_*``) set so that the screens both skip and do not.
"""

from __future__ import annotations

import numba
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerdiff.compare import aot
from layerdiff.compare.kernels import (
    _TINY,
    SUB,
    _differences,
    _down32,
    _largest,
    _map,
    _maxima,
    _non_finite,
    _screen,
    _screen32,
    _sums,
    _ulps,
    _ulps_narrow,
    fused,
)


@numba.njit(cache=True, nogil=True, error_model="numpy")
def _fused_before(ref, port, ref_bits, port_bits, ulp_width, rtol, atol, start, per_element,
          batch_ratio, known_ratio, known_finite, known_rel):
    """kernels.fused as it was before its split (commit d77bd30), verbatim."""
    rel_floor = atol if atol != 0.0 else _TINY
    narrow = ref.itemsize == 4 and port.itemsize == 4  # float32 both (float16 widened)
    rtol32, atol32, floor32 = _down32(rtol), _down32(atol), _down32(rel_floor)
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
        # what an element must exceed to change anything: the ratio (first index of the
        # largest, its batch row's, the finite one) and the relative error, each as merged
        limit_ratio = min(max(best, known_ratio), max(finite_ratio, known_finite))
        if per_element > 0:
            limit_ratio = min(limit_ratio, batch_ratio[row])
        if limit_ratio >= 0.0:
            limit_rel = max(max_rel, known_rel)
            if narrow and limit_ratio <= 1.0 and _screen32(
                    a, b, rtol32, atol32, floor32, _down32(limit_ratio), _down32(limit_rel)):
                _differences(a, b, d)
                bad = over = maybe = 0
            else:
                bad, over, maybe = _screen(a, b, rtol, atol, rel_floor, limit_ratio,
                                           limit_rel, d)
            if bad == 0 and maybe == 0:  # no maximum moves: counts, sums and ULPs only
                out += over
                top_d = _largest(d)
                max_abs = top_d if top_d > max_abs else max_abs
                found = _sums(a, b, d)
                s_abs += found[0]
                s_sq += found[1]
                dot += found[2]
                ref_sq += found[3]
                port_sq += found[4]
                if ulp_width:
                    u = (_ulps_narrow(ref_bits[begin:end], port_bits[begin:end], mask)
                         if ulp_width <= 32 else
                         _ulps(ref_bits[begin:end], port_bits[begin:end], mask))
                    ulp_top = u if u > ulp_top else ulp_top
                begin = end
                continue
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
                u = (_ulps_narrow(ref_bits[begin:end], port_bits[begin:end], mask)
                     if ulp_width <= 32 else
                     _ulps(ref_bits[begin:end], port_bits[begin:end], mask))
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


def _specials(dtype) -> np.ndarray:
    info = np.finfo(dtype)
    tiny = np.nextafter(dtype(0), dtype(1))
    return np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, tiny, -tiny, info.tiny, info.max,
                     -info.max, 1.0], dtype)


@st.composite
def _calls(draw):
    """One call's arguments: a slice ``start ..`` of a pair, as PairMetrics passes it."""
    combination = draw(st.sampled_from(aot.COMBINATIONS))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    batch = draw(st.sampled_from([0, 0, 1, 3, 8]))
    total = draw(st.integers(1, 3 * SUB + 50)) * max(batch, 1)
    start = draw(st.integers(0, total - 1))
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]))
    ref = rng.standard_normal(total) * scale
    port = ref * (1 + draw(st.sampled_from([0.0, 1e-7, 1e-4, 1e-2])) * rng.standard_normal(
        total))
    with np.errstate(over="ignore"):
        ref, port = ref.astype(combination[0]), port.astype(combination[1])
    for side in (ref, port):  # specials at random places on each side
        share = draw(st.sampled_from([0.0, 0.0, 0.001, 0.05, 0.5]))
        places = rng.random(total) < share
        side[places] = rng.choice(_specials(side.dtype.type), int(places.sum()))
    if draw(st.booleans()):
        port[rng.random(total) < 0.1] = 0.0  # zero differences' neighbours
    args = list(aot.arguments(ref, port, combination[2], batch))
    if args[4]:  # the bits of the part this call takes
        args[2], args[3] = args[2][start:], args[3][start:]
    args[0], args[1] = args[0][start:], args[1][start:]
    args[5], args[6] = draw(st.sampled_from([(1.3e-6, 1e-5), (0.0, 0.0), (1e-3, 0.0),
                                             (0.0, 1e-3), (1.6e-2, 1e-5)]))
    args[7] = start
    if batch:
        args[9] = rng.choice([0.0, 0.5, 1.0, 40.0], batch)
    args[10] = draw(st.sampled_from([-1.0, 0.0, 0.3, 1.0, 5e3, np.inf]))
    args[11] = draw(st.sampled_from([0.0, 0.3, 1.0, 5e3]))
    args[12] = draw(st.sampled_from([0.0, 1e-6, 0.5, 1e3]))
    return args


def _bits(value) -> tuple[str, bytes]:
    """A column as its type and exact bits (NaN payloads and the sign of zero included)."""
    if isinstance(value, float):
        return "float", np.float64(value).tobytes()
    return type(value).__name__, np.int64(value).tobytes()


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(args=_calls())
def test_the_split_kernel_gives_the_previous_kernels_columns_bit_for_bit(args):
    rows_before, rows_after = args[9].copy(), args[9].copy()
    before = _fused_before(*args[:9], rows_before, *args[10:])
    after = fused(*args[:9], rows_after, *args[10:])
    assert [_bits(v) for v in after] == [_bits(v) for v in before]
    assert rows_after.tobytes() == rows_before.tobytes()


# What the kernel gave before its split (commit d77bd30) for _recorded's pairs: the columns
# and the batch rows, printed with repr (exact). A check of the oracle as much as of fused.
RECORDED = {
    ("float32", "float32", "int32", False): (
        (0.0006437301635742188, 0.00040621740482662904, 0.1939904595783446,
         3.0103107692626646e-05, 3031.1233943298544, 3031.1335441953715, 3031.1132745674445,
         47.53172853057045, 2159, 47.53172853057045, 2359, 5598, 0, 0, 0, 0),
        [35.70471077956706, 36.94666495983343, 47.53172853057045]),
    ("float64", "float64", "int64", False): (
        (0.000643701568806776, 0.00040616063106528735, 0.1939918739461464,
         3.010343257310956e-05, 3031.1233902952827, 3031.133547383714, 3031.113263310284,
         47.537903261695924, 2159, 47.537903261695924, 2359, 3004983414257, 0, 0, 0, 0),
        [35.70752343552137, 36.95784851612161, 47.537903261695924]),
    ("float32", "float32", "int32", True): (
        (np.inf, np.inf, np.inf, np.inf, 3030.989714132082, 3030.9998546481447,
         3030.979603718467, np.inf, 2000, 47.53172853057045, 2359, 5598, 1, 0, 0, 0),
        [35.70471077956706, np.inf, 47.53172853057045]),
    ("float32", "float32", "int16", True): (
        (np.inf, np.inf, np.inf, np.inf, 3030.9991225341555, 3030.997978978504,
         3031.00046212749, np.inf, 2000, 154.5117428924598, 352, 1, 1, 0, 0, 0),
        [154.10932515526514, np.inf, 154.5117428924598]),
    ("float32", "float64", "int32", True): (
        (np.inf, np.inf, np.inf, np.inf, 3030.9897085005987, 3030.9998546481447,
         3030.979592455746, np.inf, 2000, 47.535640242805265, 2359, 0, 1, 0, 0, 0),
        [35.706183532185776, np.inf, 47.535640242805265]),
}


def _recorded(ref_dtype: str, port_dtype: str, bits: str, nan: bool) -> tuple:
    """Three batch rows of 1,025 elements, relative noise 1e-4, a NaN at 2000 if ``nan``."""
    rng = np.random.default_rng(7)
    ref = rng.standard_normal(3 * 1025)
    port = ref * (1 + 1e-4 * rng.standard_normal(ref.size))
    if nan:
        ref[2000] = np.nan
    return aot.arguments(ref.astype(ref_dtype), port.astype(port_dtype), bits, batch=3)


def test_the_oracle_and_the_split_kernel_give_what_the_kernel_gave_before_its_split():
    for key, (columns, rows) in RECORDED.items():
        for kernel in (_fused_before, fused):
            args = _recorded(*key)
            got = kernel(*args)
            assert [_bits(v) for v in got] == [_bits(v) for v in columns], (key, kernel)
            assert [float(x) for x in args[9]] == rows, (key, kernel)
