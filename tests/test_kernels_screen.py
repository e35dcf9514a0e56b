"""The metric kernel's division-free screen (compare/kernels.py `_screen`) changes no column.

The kernel skips the two float64 divisions of a 1,024-element sub-block when no element can
raise the largest ratio, the finite ratio, its batch row's ratio or the largest relative error
past what the pair's earlier sub-blocks and chunks gave. These tests put the largest errors
where the screen is most likely to get it wrong: rising and falling along the tensor, tied
maxima in different chunks (the first index must win), ratios exactly at 1 (counted only above
it), products of limits and tolerances that underflow or overflow float64, and batch rows whose
maxima come late. Every exact column must equal the numpy path's, bit for bit (the 32-bit ULP
loop included), the sums to their rounding.
"""

from __future__ import annotations

import numpy as np
import pytest

from layerdiff.compare import metrics as M
from tests.test_metrics_kernel import _both, _run, assert_same


@pytest.fixture(autouse=True, scope="module")
def _kernel_loaded():
    assert M._kernel() is not None


N = 5 * 1024 + 37  # several sub-blocks, and a partial one


def _noise(size: int, seed: int, dtype=np.float32) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(size).astype(dtype)
    port = (ref * (1 + 1e-6 * rng.standard_normal(size))).astype(dtype)
    return ref, port


@pytest.mark.parametrize("shape", ["rising", "falling", "flat", "one_spike_late"])
@pytest.mark.parametrize("cuts", [(), (1024,), (700, 3000, 3001, 5000)])
def test_errors_rising_falling_or_spiking_give_the_numpy_columns(shape, cuts):
    ref, port = _noise(N, 1)
    scale = {"rising": np.linspace(0.1, 10, N), "falling": np.linspace(10, 0.1, N),
             "flat": np.ones(N), "one_spike_late": np.ones(N)}[shape]
    port = (ref + (port - ref) * scale.astype(np.float32)).astype(np.float32)
    if shape == "one_spike_late":
        port[N - 40] = ref[N - 40] + 1.0
    result = _both(ref, port, 1.3e-6, 1e-5, cuts=cuts)
    assert result["worst_index"] == _run(ref, port, 1.3e-6, 1e-5, batch=0, ulp_scale=1.0,
                                         cuts=(), kernel=False)["worst_index"]


@pytest.mark.parametrize("cuts", [(), (2048,), (1500, 4100)])
def test_a_tied_largest_ratio_keeps_its_first_index_across_chunks(cuts):
    """The same largest error at three places: the first must be the worst index, although
    the later sub-blocks only equal the limit the earlier ones set."""
    ref, port = _noise(N, 2)
    for place in (300, 2500, 4900):
        ref[place], port[place] = np.float32(1.0), np.float32(1.5)
    result = _both(ref, port, 1.3e-6, 1e-5, cuts=cuts)
    assert result["worst_index"] == "300"


def test_ratios_exactly_at_one_are_not_counted_and_just_above_are():
    """d == t gives ratio 1 (within); the next float64 above t gives a ratio over 1. The
    screen counts ``d > t`` without dividing: both must agree with the division."""
    atol = 2.0**-20
    ref = np.ones(N, np.float64)
    port = ref.copy()
    port[::7] = 1.0 + atol                 # d == atol == t: ratio exactly 1
    port[3::11] = np.nextafter(1.0 + atol, 2.0)  # d just above t
    result = _both(ref, port, 0.0, atol)
    assert result["out"] == len(range(3, N, 11))  # written after the ties: all just above
    assert result["ratio"] > 1.0


@pytest.mark.parametrize("scale", [1e-300, 1e-160, 1e150, 1e300])
@pytest.mark.parametrize("tolerance", [(1.3e-6, 1e-5), (0.0, 0.0), (1e-3, 0.0), (0.0, 1e-300)])
def test_products_that_underflow_or_overflow_still_give_the_numpy_columns(scale, tolerance):
    """Limits times tolerances far below float64's normal range (where a rounded product is not
    accurate to 2**-53) or above it: the screen must not skip what the division would count."""
    ref, port = _noise(N, 3, np.float64)
    ref, port = ref * scale, port * scale
    port[::97] = ref[::97] * (1 + 1e-3)
    port[5::1001] = ref[5::1001]  # exact zeros of difference
    ref[17::503] = 0.0
    _both(ref, port, *tolerance)


@pytest.mark.parametrize("per", [300, 1024, 2500])
def test_batch_rows_whose_largest_ratio_comes_late_give_the_numpy_row_ratios(per):
    batch = 4
    ref, port = _noise(batch * per, 4)
    for row in range(batch):
        place = row * per + per - 3 - row  # each row's worst near its end
        port[place] = ref[place] + np.float32(0.01 * (row + 1))
    _both(ref, port, 1.3e-6, 1e-5, batch=batch, cuts=(per // 2, 2 * per + 5))


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ulps_of_the_extremes_through_the_32_bit_loop(dtype):
    """Largest finite against its negation, -0.0 against +0.0, subnormals: the 32-bit ULP loop
    gives the distances ordered_bits gives (-0.0 and +0.0 are 0 apart)."""
    info = np.finfo(dtype)
    tiny = np.nextafter(dtype(0), dtype(1))
    values = np.array([info.max, -info.max, 0.0, -0.0, tiny, -tiny, 1.0, -1.0], dtype)
    ref = np.resize(values, N).astype(dtype)
    for shift in range(1, len(values)):
        port = np.roll(ref, shift)
        kernel = _run(ref, port, 1e-3, 1e-5, batch=0, ulp_scale=1.0, cuts=(), kernel=True)
        numpy = _run(ref, port, 1e-3, 1e-5, batch=0, ulp_scale=1.0, cuts=(), kernel=False)
        assert_same(kernel, numpy, sums=False)
    zeros = np.zeros(N, dtype)
    result = _run(zeros, -zeros, 0.0, 0.0, batch=0, ulp_scale=1.0, cuts=(), kernel=True)
    assert result["max_ulp"] == 0.0 and result["out"] == 0


def test_a_ratio_one_ulp_above_an_earlier_largest_moves_the_worst_index():
    """With rtol 0 and atol 1 the ratio is the difference itself: a later element whose
    difference is one float64 step larger is the new worst, however small the step. (An
    early relative error of 0.4 keeps the relative errors of 0.05 out of the decision.)"""
    ref = np.full(N, 10.0)
    port = ref + 1e-3
    ref[3], port[3] = 0.0, 0.4
    port[400] = 10.5
    port[4700] = np.nextafter(10.5, 11.0)
    result = _both(ref, port, 0.0, 1.0, cuts=(2000,))
    assert result["worst_index"] == "4700" and result["ratio"] == port[4700] - 10.0


def test_a_relative_error_one_ulp_above_an_earlier_largest_is_the_new_largest():
    """The relative error's side: 0.3 at element 400, one float64 step more at 4700, while an
    early ratio of 1e5 (a large reference, atol 1) keeps the ratios out of the decision."""
    ref = np.full(N, 0.5)
    port = ref + 1e-3
    ref[3], port[3] = 1e6, 1e6 + 1e5
    port[400] = 0.8
    port[4700] = np.nextafter(0.8, 1.0)
    result = _both(ref, port, 0.0, 1.0, cuts=(2000,))
    assert result["max_rel"] == port[4700] - 0.5 > port[400] - 0.5


@pytest.mark.parametrize("cuts", [(), (1024,)])
def test_the_finite_ratio_keeps_growing_after_an_infinite_ratio(cuts):
    """An Inf in the reference makes the largest ratio inf at once; the ratio over the finite
    reference elements, which the verdict uses, must still see the later, larger errors."""
    ref, port = _noise(N, 5)
    ref[5] = np.inf
    port[2000] = ref[2000] + 0.01
    port[4000] = ref[4000] + 0.02
    result = _both(ref, port, 1.3e-6, 1e-5, cuts=cuts)
    assert result["ratio"] == np.inf and np.isfinite(result["finite_ratio"])
    assert result["finite_ratio"] > 0.019 / (1e-5 + 1.3e-6 * abs(float(ref[4000])))


@pytest.mark.parametrize("scale", [1e-305, 1e-310, 1e-315, 1e-320])
@pytest.mark.parametrize("seed", range(4))
def test_subnormal_values_and_tolerances_give_the_numpy_columns(scale, seed):
    """Differences and tolerances in float64's subnormal range: limit * tolerance rounds
    coarsely there, so no element may be skipped on such a product."""
    rng = np.random.default_rng(seed)
    ref = rng.standard_normal(N) * scale
    port = ref * (1 + np.linspace(0.0, 0.5, N) * rng.random(N))
    _both(ref, port, 1e-3, 0.0, cuts=(1024, 3000))
    _both(ref, port, 0.0, scale * 1e-2, cuts=(2500,))


U = float(np.nextafter(0.0, 1.0))  # the smallest subnormal float64


def test_a_subnormal_product_that_rounds_up_does_not_hide_a_row_ratio():
    """Row 1's first ratio is 2u/3u = 2/3; a later one is 1u/1u = 1. The limit times the
    later tolerance, (2/3) * 1u, rounds up to 1u, equal to the difference: trusting that
    product would keep row 1's ratio at 2/3. (Row 0 holds a relative error of 1e7, so only
    the ratio's side of the screen can decide.)"""
    per = 3 * 1024
    ref = np.zeros(2 * per)
    port = np.zeros(2 * per)
    ref[10], port[10] = 1.0, 1.0 + 1e7
    ref[per + 5], port[per + 5] = 6 * U, 8 * U        # t = 0.5 * 6u = 3u, d = 2u
    ref[per + 2500], port[per + 2500] = 2 * U, 3 * U  # t = 1u, d = 1u: ratio 1
    result = _both(ref, port, 0.5, 0.0, batch=2)
    assert list(result["batch_ratio"]) == [2e7, 1.0]


def test_a_subnormal_product_that_rounds_up_does_not_hide_a_relative_error():
    """The relative error's side of the same trap: 2u/3u = 2/3 first, 1u/1u = 1 later, with
    a ratio limit of 5e29 (rtol 1e-30) that lets the ratio's side pass."""
    ref = np.zeros(N)
    port = np.zeros(N)
    ref[3], port[3] = 1.0, 1.5                  # ratio 0.5 / (1e-30 + 1u) ~ 5e29, rel 0.5
    ref[700], port[700] = 3 * U, 5 * U          # rel 2u / 3u
    ref[4500], port[4500] = 1 * U, 2 * U        # rel 1u / 1u = 1
    result = _both(ref, port, 1e-30, U)
    assert result["max_rel"] == 1.0


# ------------------------------------------------ the float32 screen (_screen32)
# Pairs of float32 (and float16, widened) are screened in float32 first, with a margin for
# its roundings; these put ratios and relative errors within a few float32 roundings of the
# limits it compares against, and values where float32 products underflow or overflow.


def _float32_near(a: np.float32, target: float, rtol: float, atol: float) -> list[np.float32]:
    """The float32 ports around the one whose ratio to ``a`` is ``target`` (float64 ratio,
    as the kernel computes it): a few float32 steps either side."""
    t = abs(float(a)) * rtol + atol
    centre = np.float32(float(a) + target * t)
    found = [centre]
    for direction in (np.float32(np.inf), np.float32(-np.inf)):
        value = centre
        for _ in range(3):
            value = np.nextafter(value, direction)
            found.append(value)
    return found


@pytest.mark.parametrize("atol", [1.0, 3e-7, 1e-30])
@pytest.mark.parametrize("rtol", [0.0, 1.3e-6])
@pytest.mark.parametrize("seed", range(2))
def test_float32_ratios_a_rounding_either_side_of_the_largest_give_the_numpy_columns(
        atol, rtol, seed):
    """The first sub-block sets a largest ratio of 0.5; later sub-blocks hold elements whose
    ratios are one to three float32 steps below, at and above it. References below atol
    make the difference about as large as the port's value, so one float32 step of the port
    moves the ratio by ~2**-23, inside the screen's margin: a screen without one (or with one
    too small) skips the larger ratios and keeps the first index."""
    rng = np.random.default_rng(seed)
    ref = (rng.uniform(0.001, 0.01, N) * atol).astype(np.float32)
    port = ref.copy()
    port[100] = _float32_near(ref[100], 0.5, rtol, atol)[0]
    limit = abs(float(port[100]) - float(ref[100])) / (abs(float(ref[100])) * rtol + atol)
    for block, place in enumerate(range(1100, N - 8, 1024)):
        candidates = _float32_near(ref[place], limit, rtol, atol)
        for offset, value in enumerate(candidates[block % 2::2]):
            ref[place + offset], port[place + offset] = ref[place], value
    result = _both(ref, port, rtol, atol, cuts=(3000,))
    ratios = np.abs(port.astype(np.float64) - ref) / (np.abs(ref.astype(np.float64)) * rtol
                                                       + atol)
    assert result["ratio"] > limit
    assert result["worst_index"] == str(int(np.argmax(ratios)))


@pytest.mark.parametrize("scale", [1e-38, 1e-44, 1e30, 1e38])
@pytest.mark.parametrize("tolerance", [(1.3e-6, 1e-5), (0.0, 0.0), (1e-3, 0.0), (0.0, 1e-40),
                                       (1e-30, 1e-45)])
def test_float32_products_that_underflow_or_overflow_give_the_numpy_columns(scale, tolerance):
    """float32 values near its subnormals or its largest: the float32 products are then far
    from accurate (or infinite) and no element may be skipped on them; a difference that
    overflows float32 (but not float64) must not pass as screened."""
    ref, port = _noise(N, 3)
    with np.errstate(over="ignore", under="ignore"):
        ref = (ref.astype(np.float64) * scale).astype(np.float32)
        port = (port.astype(np.float64) * scale).astype(np.float32)
    port[::97] = ref[::97] * np.float32(1 + 1e-3)
    port[5::1001] = ref[5::1001]
    ref[17::503] = 0.0
    ref[4000], port[4000] = np.float32(3e38), np.float32(-3e38)
    _both(ref, port, *tolerance, cuts=(2048,))


def test_float16_pairs_screened_in_float32_give_the_numpy_columns():
    ref, port = _noise(N, 6, np.float16)
    port[::50] = ref[::50] + np.float16(0.01)
    _both(ref, port, 1e-3, 1e-5, batch=3)  # N = 3 * 1719


U32 = float(np.nextafter(np.float32(0), np.float32(1)))  # the smallest subnormal float32


def test_a_float32_subnormal_product_that_rounds_up_does_not_hide_a_row_ratio():
    """The float32 side of the subnormal trap: (2/3) * 1u rounds up to 1u in float32, equal
    to the later difference of 1u, whose ratio 1 must still become row 1's."""
    per = 3 * 1024
    ref = np.zeros(2 * per, np.float32)
    port = np.zeros(2 * per, np.float32)
    ref[10], port[10] = 1.0, 1.0 + 1e7
    ref[per + 5], port[per + 5] = 6 * U32, 8 * U32        # t = 3u, d = 2u: ratio 2/3
    ref[per + 2500], port[per + 2500] = 2 * U32, 3 * U32  # t = 1u, d = 1u: ratio 1
    result = _both(ref, port, 0.5, 0.0, batch=2)
    assert list(result["batch_ratio"]) == [2e7, 1.0]


def test_a_float32_threshold_that_overflows_does_not_hide_a_larger_ratio():
    """|ref| * rtol + atol past float32's largest is infinite in float32, finite in float64.
    Element 3 sets a ratio of 0.4 and a relative error of 0.8; element 3000's ratio is 0.5
    (2e38 / 4e38) and its relative error 0.67, so only the overflowing ratio side can see it."""
    ref = np.ones(N, np.float32)
    port = ref.copy()
    ref[3], port[3] = np.float32(1e38), np.float32(1.8e38)
    ref[3000], port[3000] = np.float32(3e38), np.float32(1e38)
    result = _both(ref, port, 1.0, 1e38)
    assert result["ratio"] > 0.49 and result["worst_index"] == "3000"


def test_float32_bounds_from_below_are_never_above_and_close():
    """_down32 feeds the float32 screen its tolerances and limits: a float32 above the
    float64 value would let an element past the screen."""
    from layerdiff.compare import kernels
    rng = np.random.default_rng(0)
    largest = float(np.finfo(np.float32).max)
    values = np.concatenate([2.0 ** rng.uniform(-100, 128, 2000), [2.0**-100, 1.0, 3.4e38,
                             np.nextafter(largest, 0.0), largest, 1e39, np.inf, 1e-31, 0.0]])
    for x in values:
        bound = float(kernels._down32(float(x)))
        assert bound <= x, (x, bound)
        if 2.0**-100 <= x <= largest:
            assert bound >= x * (1 - 2.0**-21), (x, bound)
