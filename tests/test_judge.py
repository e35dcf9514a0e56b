"""The one judge (``layerdiff.compare.judge``): its NaN/Inf rules, its agreement with
``torch.testing``, and the places that use it (tensor diff, summary diff, swap) saying the same
thing about a NaN."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import layerdiff
from layerdiff.compare import judge
from layerdiff.compare.judge import Verdict
from layerdiff.replay import SwapResult, swap
from layerdiff.replay.swap import SwapOutcome, SwapRow
from layerdiff.trace.schema import Role
from reference_models import mlp, mlp_port

NAN, INF = math.nan, math.inf


def _ratios(ref, port, rtol=1e-3, atol=1e-5):
    return judge.element_ratios(np.array(ref, np.float64), np.array(port, np.float64),
                                rtol, atol)


# ---- element rules

def test_nan_at_the_same_place_on_both_sides_is_a_match():
    assert _ratios([NAN, 1.0], [NAN, 1.0]).tolist() == [0.0, 0.0]


@pytest.mark.parametrize("atol", [1e-5, 1.0, 1e30])
def test_nan_in_the_port_where_the_reference_is_finite_is_out_whatever_the_tolerance(atol):
    ratios = _ratios([1.0, 2.0], [NAN, 2.0], rtol=1e3, atol=atol)
    assert ratios[0] == INF and ratios[1] == 0.0


def test_nan_in_the_reference_where_the_port_is_finite_is_out_element_wise():
    assert _ratios([NAN], [1.0], atol=1e30)[0] == INF


def test_infinities_of_the_same_sign_match_and_opposite_signs_do_not():
    assert _ratios([INF, -INF], [INF, -INF]).tolist() == [0.0, 0.0]
    assert _ratios([INF, -INF], [-INF, INF]).tolist() == [INF, INF]


@pytest.mark.parametrize("ref, port", [(INF, 1e300), (1.0, INF), (-INF, 0.0), (0.0, -INF)])
def test_an_infinity_against_a_finite_value_is_out(ref, port):
    assert _ratios([ref], [port], rtol=1e3, atol=1e30)[0] == INF


def test_zero_against_zero_with_no_tolerance_is_a_match_not_nan():
    ratios = _ratios([0.0, 1.0], [0.0, 1.0], rtol=0.0, atol=0.0)
    assert ratios.tolist() == [0.0, 0.0]
    assert _ratios([0.0], [1e-300], rtol=0.0, atol=0.0)[0] == INF


def test_the_torch_testing_boundary_is_within_and_just_past_it_is_out():
    rtol, atol = 0.25, 0.5          # exact in binary: |d| == atol + rtol * |ref| exactly
    ref = np.array([2.0, 2.0, -4.0])
    port = np.array([3.0, 3.0 + 2 ** -40, -5.5])  # 1.0 == 0.5 + 0.25 * 2; 1.5 == 0.5 + 1.0
    ratios = judge.element_ratios(ref, port, rtol, atol)
    assert ratios[0] == 1.0 and judge.within(ratios[0])
    assert ratios[1] > 1.0 and not judge.within(ratios[1])
    assert ratios[2] == 1.0
    # torch.testing draws the line at the same place
    torch.testing.assert_close(torch.tensor(port[[0, 2]]), torch.tensor(ref[[0, 2]]),
                               rtol=rtol, atol=atol)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(torch.tensor(port[1]), torch.tensor(ref[1]),
                                   rtol=rtol, atol=atol)


# ---- worst, within, verdict

def test_worst_counts_a_nan_as_inf_where_max_would_hide_it():
    assert max([0.5, NAN]) == 0.5  # what the judge must not do
    assert judge.worst([0.5, NAN]) == INF
    assert judge.worst([NAN, 0.5]) == INF
    assert judge.worst([0.5, 2.0, 0.1]) == 2.0
    assert judge.worst([]) == 0.0


def test_within_is_at_most_one_and_never_nan():
    assert judge.within(1.0) and judge.within(0.0)
    assert not judge.within(1.0000001)
    assert not judge.within(NAN)
    assert not judge.within(INF)


def test_verdict_ref_nan_only_when_the_port_is_clean_and_the_rest_within():
    assert judge.verdict(0.5) == Verdict.WITHIN
    assert judge.verdict(INF) == Verdict.OUT
    assert judge.verdict(INF, ref_nan=1, finite_ratio=0.5) == Verdict.REF_NAN
    assert judge.verdict(INF, ref_nan=1, finite_ratio=2.0) == Verdict.OUT   # hides nothing
    assert judge.verdict(INF, ref_nan=1) == Verdict.OUT                     # rest unknown
    assert judge.verdict(INF, ref_nan=1, port_nan=1, finite_ratio=0.0) == Verdict.OUT
    assert judge.verdict(INF, ref_nan=1, port_inf=1, finite_ratio=0.0) == Verdict.OUT
    assert judge.verdict(NAN) == Verdict.OUT


def test_statistics_ratio_is_out_when_the_port_has_more_non_finite_values():
    stats = np.array([0.0, 1.0, 0.5])
    assert judge.statistics_ratio(stats, stats, 1e-3, 1e-5, ref_counts=(0, 0),
                                  port_counts=(1, 0)) == INF
    assert judge.statistics_ratio(stats, stats, 1e-3, 1e-5, ref_counts=(0, 0),
                                  port_counts=(0, 1)) == INF
    assert judge.statistics_ratio(stats, stats, 1e-3, 1e-5, ref_counts=(1, 0),
                                  port_counts=(1, 0)) == 0.0


# ---- the judge agrees with torch.testing (property)

_finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False, width=64)
_tolerance = st.floats(0.0, 10.0, allow_nan=False, allow_infinity=False)


@st.composite
def _pairs(draw):
    ref = draw(hnp.arrays(np.float64, st.integers(1, 16), elements=_finite))
    # ports near the reference (a few ulps to a few tolerances away) as well as anywhere
    noise = draw(hnp.arrays(np.float64, ref.shape, elements=st.floats(-2.0, 2.0)))
    scale = draw(st.sampled_from([0.0, 1e-12, 1e-6, 1e-3, 1.0]))
    near = ref + noise * (np.abs(ref) * scale + scale)
    anywhere = draw(hnp.arrays(np.float64, ref.shape, elements=_finite))
    pick = draw(hnp.arrays(np.bool_, ref.shape))
    return ref, np.where(pick, near, anywhere)


@settings(max_examples=200, deadline=None)
@given(_pairs(), _tolerance, _tolerance)
def test_within_exactly_where_torch_isclose_says_so(pair, rtol, atol):
    ref, port = pair
    ours = judge.element_ratios(ref, port, rtol, atol) <= 1.0
    theirs = torch.isclose(torch.from_numpy(port), torch.from_numpy(ref), rtol=rtol, atol=atol,
                           equal_nan=True).numpy()
    # torch computes atol + rtol * |ref| the same way; away from the boundary by a rounding
    # the two must agree exactly
    margin = np.abs(np.abs(port - ref) - (atol + rtol * np.abs(ref)))
    clear = margin > 1e-12 * (atol + rtol * np.abs(ref) + np.abs(port - ref))
    np.testing.assert_array_equal(ours[clear], theirs[clear])


def test_a_ratio_that_overflows_to_inf_is_out_without_a_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ratios = judge.element_ratios(np.array([1e-310]), np.array([1.0]), 0.5, 0.0)
    assert ratios[0] == INF


# ---- the tensor diff and the summary diff agree on NaN

def _pair(tmp_path, ref, port, *, summary):
    paths = []
    for name, value in (("ref", ref), ("port", port)):
        path = tmp_path / f"{name}{'-summary' if summary else ''}.h5"
        with layerdiff.TraceWriter(path, meta={"case": name}, summary=summary) as w, \
                w.site("layer", "Linear") as site:
            w.record(site, "output", np.array(value, np.float32))
        paths.append(path)
    return layerdiff.diff(*paths).rows.iloc[0]


@pytest.mark.parametrize("summary", [False, True], ids=["tensors", "summary"])
def test_a_nan_in_the_port_where_the_reference_is_finite_is_out(tmp_path, summary):
    row = _pair(tmp_path, [1.0, 2.0, 3.0, 4.0], [1.0, NAN, 3.0, 4.0], summary=summary)
    assert row["verdict"] == Verdict.OUT
    assert row["ratio"] == INF and row["port_nan"] == 1 and row["ref_nan"] == 0


@pytest.mark.parametrize("summary", [False, True], ids=["tensors", "summary"])
def test_an_inf_in_the_port_where_the_reference_is_finite_is_out(tmp_path, summary):
    row = _pair(tmp_path, [1.0, 2.0, 3.0, 4.0], [1.0, INF, 3.0, 4.0], summary=summary)
    assert row["verdict"] == Verdict.OUT and row["ratio"] == INF


@pytest.mark.parametrize("summary", [False, True], ids=["tensors", "summary"])
def test_a_nan_at_the_same_place_on_both_sides_passes(tmp_path, summary):
    row = _pair(tmp_path, [1.0, NAN, 3.0, 4.0], [1.0, NAN, 3.0, 4.0], summary=summary)
    # equal bytes; a summary holds none to compare, so it knows the digests agree
    assert row["verdict"] == (Verdict.SAME_DIGEST if summary else Verdict.IDENTICAL)
    assert judge.within(row["ratio"])


def test_a_nan_in_the_reference_alone_is_reported_not_blamed_on_the_port(tmp_path):
    row = _pair(tmp_path, [1.0, NAN, 3.0, 4.0], [1.0, 2.0, 3.0, 4.0], summary=False)
    assert row["verdict"] == Verdict.REF_NAN and row["ref_nan"] == 1 and row["port_nan"] == 0


def test_a_nan_at_the_same_place_with_other_values_close_is_within(tmp_path):
    row = _pair(tmp_path, [1.0, NAN, 3.0, 4.0], [1.0, NAN, 3.0, 4.0 + 4e-6], summary=False)
    assert row["verdict"] == Verdict.WITHIN and 0 < row["ratio"] <= 1


# ---- swap: a NaN out of a swapped port layer breaks the reference

def _nan_act2():
    """The MLP's correct port, whose act2 puts NaN in the first feature of every sample."""
    case = mlp_port.port()
    layer = case.model.act2
    original = layer.forward

    def forward(x):
        y = original(x)
        poison = torch.zeros_like(y, dtype=torch.bool)
        poison[..., 0] = True
        return torch.where(poison, y * NAN, y)

    layer.forward = forward
    return case


def test_a_port_layer_that_outputs_nan_breaks_the_swap_with_an_infinite_ratio():
    result = swap(mlp.reference, _nan_act2, ["act2"])
    assert result.outcome == SwapOutcome.BREAKS and result.breaks and not result
    assert result.ratio == INF
    assert result.as_json()["ratio"] == "inf"
    assert "breaks" in result.describe()
    # the correct port at the same site stays within: it is the NaN that breaks it
    clean = swap(mlp.reference, mlp_port.port, ["act2"])
    assert clean and clean.ratio < 1


def _row(ratio, *, judged=True):
    return SwapRow("loss, step 0", 0, "<loss>#0", Role.OUTPUT, "0", ratio, 0.0, judged, "test")


def test_a_nan_ratio_among_the_rows_breaks_a_swap_result():
    """A NaN ratio is never within: ``max`` would report the 0.5 beside it."""
    result = SwapResult([("fc2", "fc2")], 1, [(1.0, 1.0)],
                        rows=[_row(0.5), _row(NAN), _row(0.1)])
    assert result.ratio == INF and result.breaks and not result
    assert result.outcome == SwapOutcome.BREAKS
    reported = SwapResult([("fc2", "fc2")], 1, [(1.0, 1.0)],
                          rows=[_row(0.5), _row(NAN, judged=False)])
    assert reported.ratio == 0.5 and reported  # weights after the steps are reported only
