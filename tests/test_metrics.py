"""The pure-numpy pair metrics: chunked accumulation, the verdict ratio, ULPs, NaN/Inf, batches.

Checks that feeding a tensor in chunks gives what feeding it whole gives; that ``ratio <= 1``
is exactly ``numpy.allclose(port, ref, rtol, atol)`` (torch.testing.assert_close's test);
ULP distances for float32, float16 and bfloat16 (across zero too); how NaN and infinities
count; per-batch-element ratios and the worst element's index; and the summary metrics
(cosine, mean_abs, rms) against numpy.
"""

from __future__ import annotations

import itertools
import math
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from layerdiff.compare.metrics import PairMetrics, ordered_bits

F32 = (1.3e-6, 1e-5)  # torch.testing defaults for float32


def _metrics(ref, port, rtol=F32[0], atol=F32[1], *, batch=0, ulp_scale=1.0, cuts=()):
    """Feed ``ref``/``port`` (any shape) as flat chunks split at ``cuts``; the result dict."""
    ref, port = np.asarray(ref), np.asarray(port)
    metrics = PairMetrics(rtol, atol, ref.size, batch, ulp_scale)
    flat_ref, flat_port = ref.reshape(-1), port.reshape(-1)
    edges = [0, *sorted(cuts), ref.size]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN chunks of max_rel
        for start, stop in itertools.pairwise(edges):
            metrics.update(flat_ref[start:stop], flat_port[start:stop], start)
    result = metrics.result(ref.shape)
    result["out"] = metrics.out
    return result


# ---------------------------------------------------------------- chunks == whole

EXACT_KEYS = ("ratio", "max_abs", "max_rel", "worst_index", "out", "frac_out", "max_ulp",
              "ref_nan", "ref_inf", "port_nan", "port_inf")
SUM_KEYS = ("mean_abs", "rms", "cosine")


@st.composite
def _pair_and_cuts(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=7))
    size = math.prod(shape)
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    kind = draw(st.sampled_from(["noise", "ties", "exact", "zeros"]))
    if kind == "ties":  # many equal ratios: the first worst element must win either way
        ref = rng.integers(-3, 4, size).astype(np.float32)
        port = ref + rng.choice(np.array([0.0, 1e-5, 3e-5], np.float32), size)
    elif kind == "zeros":
        ref = np.zeros(size, np.float32)
        port = rng.choice(np.array([0.0, 2e-5], np.float32), size)
    else:
        scale = draw(st.sampled_from([1e-3, 1.0, 1e4]))
        ref = (rng.standard_normal(size) * scale).astype(np.float32)
        error = draw(st.sampled_from([0.0, 1e-7, 1e-5, 1e-2])) if kind == "noise" else 0.0
        port = (ref * (1 + error * rng.standard_normal(size))).astype(np.float32)
    cuts = draw(st.lists(st.integers(0, size), max_size=6))  # repeats give empty chunks
    return ref.reshape(shape), port.reshape(shape), cuts


@settings(max_examples=150, deadline=None)
@given(case=_pair_and_cuts())
def test_chunks_give_the_same_result_as_the_whole(case):
    ref, port, cuts = case
    whole = _metrics(ref, port, batch=ref.shape[0])
    chunked = _metrics(ref, port, batch=ref.shape[0], cuts=cuts)
    for key in EXACT_KEYS:
        assert chunked[key] == whole[key], key
    np.testing.assert_array_equal(chunked["batch_ratio"], whole["batch_ratio"])
    for key in SUM_KEYS:
        assert chunked[key] == pytest.approx(whole[key], rel=1e-12, abs=1e-300), key
    # and the whole agrees with numpy
    a, b = ref.astype(np.float64), port.astype(np.float64)
    ratios = np.abs(a - b) / (F32[1] + F32[0] * np.abs(a))
    assert whole["ratio"] == ratios.max()
    assert whole["out"] == np.count_nonzero(ratios > 1)
    worst = np.unravel_index(np.argmax(ratios), ref.shape)
    assert whole["worst_index"] == ",".join(str(int(i)) for i in worst)
    np.testing.assert_array_equal(whole["batch_ratio"],
                                  ratios.reshape(ref.shape[0], -1).max(axis=1))


# ---------------------------------------------------------------- ratio <= 1 == allclose

_F32_VALUES = st.floats(-1e6, 1e6, width=32, allow_subnormal=True)


@settings(max_examples=300, deadline=None)
@given(ref=hnp.arrays(np.float32, st.integers(1, 8), elements=_F32_VALUES),
       factors=st.lists(st.sampled_from([0.0, 0.5, 0.999, 1.0, 1.0001, 1.01, 3.0, -1.0, -1.0001]),
                        min_size=8, max_size=8),
       tolerance=st.sampled_from([F32, (1e-3, 1e-5), (1.6e-2, 1e-5), (0.0, 1e-3), (1e-2, 0.0),
                                  (0.0, 0.0)]))
def test_ratio_within_one_is_allclose(ref, factors, tolerance):
    rtol, atol = tolerance
    bound = atol + rtol * np.abs(ref.astype(np.float64))
    port = (ref + np.array(factors[:ref.size]) * bound).astype(np.float32)
    result = _metrics(ref, port, rtol, atol)
    # |port - ref| <= atol + rtol * |ref|, evaluated in float64 on the float32 values
    close = np.allclose(port.astype(np.float64), ref.astype(np.float64), rtol=rtol, atol=atol)
    assert (result["ratio"] <= 1.0) == close
    assert (result["out"] == 0) == close


def test_ratio_is_relative_to_the_reference_not_the_port():
    # |d| = 1: within atol + rtol*|ref| = 0 + 0.5*2 = 1 when ref = 2, out when ref = 1
    assert _metrics(np.float32([2.0]), np.float32([1.0]), 0.5, 0.0)["ratio"] == 1.0
    assert _metrics(np.float32([1.0]), np.float32([2.0]), 0.5, 0.0)["ratio"] == 2.0


def test_exact_tolerance_for_integers():
    same = _metrics(np.arange(6), np.arange(6), 0.0, 0.0, ulp_scale=None)
    assert (same["ratio"], same["out"], same["max_abs"]) == (0.0, 0, 0.0)
    assert math.isnan(same["max_ulp"])  # ULPs do not apply
    differ = _metrics(np.arange(6), np.array([0, 1, 2, 4, 4, 5]), 0.0, 0.0, ulp_scale=None)
    assert differ["ratio"] == math.inf
    assert (differ["out"], differ["worst_index"], differ["max_abs"]) == (1, "3", 1.0)


# ---------------------------------------------------------------- ULPs


@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.float64])
@pytest.mark.parametrize("value", [1.0, -1.0, 0.1, -3e-3, 1000.0])
def test_adjacent_values_are_one_ulp_apart(dtype, value):
    x = dtype(value)
    for toward in (np.inf, -np.inf):
        neighbour = np.nextafter(x, dtype(toward))
        assert _metrics(np.array([x]), np.array([neighbour]))["max_ulp"] == 1.0
    two_away = np.nextafter(np.nextafter(x, dtype(np.inf)), dtype(np.inf))
    assert _metrics(np.array([x, x]), np.array([x, two_away]))["max_ulp"] == 2.0


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_ulps_across_zero(dtype):
    tiny = np.nextafter(dtype(0), dtype(1))  # smallest positive subnormal
    assert _metrics(np.array([-0.0], dtype), np.array([0.0], dtype))["max_ulp"] == 0.0
    assert _metrics(np.array([-tiny]), np.array([tiny]))["max_ulp"] == 2.0
    assert _metrics(np.array([0.0], dtype), np.array([tiny]))["max_ulp"] == 1.0
    assert _metrics(np.array([-0.0], dtype), np.array([-tiny]))["max_ulp"] == 1.0


def test_bfloat16_ulps_through_scale():
    bits = np.array([0x3F800000, 0x80010000, 0x00000000, 0xC2F70000], np.uint32)
    ref = bits.view(np.float32)  # 1.0, -smallest bf16 subnormal, 0.0, -123.5
    port = np.array([0x3F810000, 0x00010000, 0x80000000, 0xC2F50000], np.uint32).view(np.float32)
    for i, expected in enumerate([1.0, 2.0, 0.0, 2.0]):
        got = _metrics(ref[i:i + 1], port[i:i + 1], 1.6e-2, 1e-5, ulp_scale=2.0**16)["max_ulp"]
        assert got == expected, i
    assert _metrics(ref, port, 1.6e-2, 1e-5, ulp_scale=2.0**16)["max_ulp"] == 2.0


def test_ordered_bits_follow_the_value_order():
    rng = np.random.default_rng(7)
    values = np.concatenate([
        (rng.standard_normal(500) * 10.0 ** rng.integers(-44, 37, 500)).astype(np.float32),
        np.float32([0.0, np.inf, -np.inf, 1e-45, -1e-45, np.finfo(np.float32).max]),
    ])
    order = np.sort(values)
    keys = ordered_bits(order)
    assert np.all(np.diff(keys) >= 0)
    assert np.all((np.diff(keys) == 0) == (np.diff(order) == 0))


# ---------------------------------------------------------------- NaN and Inf


def test_nan_on_both_sides_at_the_same_place_is_equal():
    ref = np.float32([1.0, np.nan, 3.0])
    result = _metrics(ref, ref.copy())
    assert (result["ratio"], result["out"], result["max_abs"]) == (0.0, 0, 0.0)
    assert (result["ref_nan"], result["port_nan"]) == (1, 1)
    assert result["cosine"] == pytest.approx(1.0, abs=1e-12)  # over the finite pairs


def test_nan_only_in_the_port_is_out():
    ref = np.float32([[1.0, 2.0], [3.0, 4.0]])
    port = ref.copy()
    port[1, 0] = np.nan
    result = _metrics(ref, port)
    assert result["ratio"] == math.inf
    assert (result["out"], result["frac_out"], result["worst_index"]) == (1, 0.25, "1,0")
    assert (result["port_nan"], result["ref_nan"]) == (1, 0)


def test_infinity_only_in_the_port_is_out():
    result = _metrics(np.float32([1.0, 2.0]), np.float32([1.0, -np.inf]))
    assert result["ratio"] == math.inf
    assert (result["out"], result["worst_index"], result["port_inf"]) == (1, "1", 1)


@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_same_infinity_on_both_sides_is_equal(value):
    ref = np.float32([value, 5.0])
    result = _metrics(ref, ref.copy())
    assert (result["ratio"], result["out"], result["max_abs"]) == (0.0, 0, 0.0)
    assert (result["ref_inf"], result["port_inf"]) == (1, 1)


@pytest.mark.parametrize(("ref_value", "port_value"), [(np.inf, -np.inf), (-np.inf, np.inf),
                                                       (np.inf, 1.0), (np.nan, 1.0),
                                                       (np.nan, np.inf), (-np.inf, np.nan)])
def test_non_finite_reference_with_a_different_port_is_out(ref_value, port_value):
    result = _metrics(np.float32([ref_value, 2.0]), np.float32([port_value, 2.0]))
    assert result["ratio"] == math.inf
    assert (result["out"], result["worst_index"]) == (1, "0")


def test_opposite_infinities_in_a_later_chunk_are_out():
    ref = np.float32([1.0, 2.0, np.inf, 4.0])
    port = np.float32([1.0, 2.0, -np.inf, 4.0])
    result = _metrics(ref, port, cuts=[2])
    assert not result["ratio"] <= 1.0
    assert result["out"] == 1


# ---------------------------------------------------------------- per batch element


def test_batch_ratio_and_worst_index_point_at_the_planted_errors():
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((4, 3, 5)).astype(np.float32)
    port = ref.copy()
    port[1, 2, 3] += 1e-3
    port[2, 0, 4] += 1e-1  # the worst
    port[3, 1, 0] -= 1e-2
    port[3, 2, 2] += 1e-4
    a, b = ref.astype(np.float64), port.astype(np.float64)
    expected = (np.abs(a - b) / (F32[1] + F32[0] * np.abs(a))).reshape(4, -1).max(axis=1)
    for cuts in ([], [7, 29, 44], list(range(1, 60))):  # chunks across batch boundaries
        result = _metrics(ref, port, batch=4, cuts=cuts)
        batch_ratio = result["batch_ratio"]
        assert batch_ratio[0] == 0.0
        assert np.all(batch_ratio[1:] > 1.0)
        np.testing.assert_array_equal(batch_ratio, expected)
        assert result["worst_index"] == "2,0,4"
        assert result["ratio"] == batch_ratio[2] == batch_ratio.max()
        assert (result["out"], result["frac_out"]) == (4, 4 / 60)


def test_no_batch_ratio_without_a_batch_axis():
    assert _metrics(np.float32([1.0, 2.0]), np.float32([1.0, 2.0]))["batch_ratio"] is None


def test_worst_index_of_a_scalar():
    assert _metrics(np.float32(1.0), np.float32(2.0))["worst_index"] == "()"


# ---------------------------------------------------------------- summary metrics


def test_cosine():
    rng = np.random.default_rng(5)
    data = rng.standard_normal(1000).astype(np.float32)
    assert _metrics(data, data.copy())["cosine"] == pytest.approx(1.0, abs=1e-12)
    assert _metrics(data, -data)["cosine"] == pytest.approx(-1.0, abs=1e-12)
    assert _metrics(np.float32([1.0, 0.0]), np.float32([0.0, 3.0]))["cosine"] == 0.0
    assert _metrics(np.zeros(3, np.float32), np.zeros(3, np.float32))["cosine"] == 1.0
    assert _metrics(np.zeros(3, np.float32), np.float32([0.0, 1.0, 0.0]))["cosine"] == 0.0


def test_mean_abs_rms_max_abs_max_rel_on_a_known_example():
    ref = np.float32([1.0, 2.0, 3.0, 4.0])
    port = np.float32([1.5, 2.0, 2.0, 4.0])
    result = _metrics(ref, port, 0.0, 0.6)
    d = np.abs(port.astype(np.float64) - ref)
    assert result["mean_abs"] == pytest.approx(np.mean(d), rel=1e-15)
    assert result["mean_abs"] == pytest.approx(0.375)
    assert result["rms"] == pytest.approx(np.sqrt(np.mean(d**2)), rel=1e-15)
    assert result["max_abs"] == 1.0
    assert result["max_rel"] == 0.5  # 0.5 / 1 beats 1 / 3
    assert result["ratio"] == pytest.approx(1.0 / 0.6)
    assert (result["out"], result["frac_out"], result["worst_index"]) == (1, 0.25, "2")
    cosine = np.dot(ref, port) / (np.linalg.norm(ref) * np.linalg.norm(port))
    assert result["cosine"] == pytest.approx(cosine, rel=1e-6)


def test_values_near_the_largest_float_give_no_warning_and_no_cosine():
    """An additive mask of float64's finfo.min against float32's (a float64 golden run against
    a float32 one): the sums overflow, which is said as no cosine, never as a numpy warning;
    the verdict ratio is still the elementwise one."""
    ref = np.array([np.finfo(np.float64).min, 1.0, 2.0])
    port = np.array([np.finfo(np.float32).min, 1.0, 2.0])
    metrics = PairMetrics(*F32, ref.size, 0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        metrics.update(ref, port, 0)
        result = metrics.result(ref.shape)
    assert math.isnan(result["cosine"])
    assert result["ratio"] > 1 and result["worst_index"] == "0"


def test_a_zero_reference_under_a_zero_atol_gives_no_warning():
    """An exact tolerance (atol 0, as for a record compared bit for bit) over a reference
    element that is 0 makes its relative error inf, never a numpy overflow warning printed to
    the user (seen on a DeepSeek-V3 router's weights)."""
    ref, port = np.array([0.0, 1.0, 2.0]), np.array([5.0, 1.0, 2.0])  # 5 / tiny overflows
    metrics = PairMetrics(0.0, 0.0, ref.size, 0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        metrics.update(ref, port, 0)
        result = metrics.result(ref.shape)
    assert result["max_rel"] == math.inf and result["worst_index"] == "0"
