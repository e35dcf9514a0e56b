"""The layout kinds' first test (do the sorted tensors agree?) answers what a full sort answers,
while an error that is no rearrangement is turned down from the tensors' ends alone."""

from __future__ import annotations

import numpy as np
import pytest

from layerdiff.compare.hints import layout
from layerdiff.compare.hints._common import NOISE, Judge

RTOL, ATOL = 1.3e-6, 1e-5


def sorted_agree_whole(judge: Judge) -> bool:
    """The rule as it was written before the ends came first: both tensors sorted whole."""
    ref, port = np.sort(judge.ref, axis=None), np.sort(judge.port, axis=None)
    bound = judge.atol + judge.rtol * np.abs(ref)
    return bool(np.all(np.abs(port - ref) <= NOISE * np.maximum(bound, 1e-300)))


def cases(rng: np.random.Generator):
    """Pairs of every kind the hints meet: rearrangements (which agree), noise, a scale, one
    element off at either end or in the middle, ties, and sizes around twice the tail."""
    for size in (1, 7, 2 * layout.TAIL - 1, 2 * layout.TAIL, 2 * layout.TAIL + 1, 1000, 40_000):
        ref = rng.standard_normal(size)
        yield ref, rng.permutation(ref)
        yield ref, ref * (1 + 1e-5 * rng.standard_normal(size))
        yield ref, ref * (1 + 1e-7 * rng.standard_normal(size))
        yield ref, ref * 1.01
        for at in (0, size // 2, size - 1):
            order = np.argsort(ref)
            port = rng.permutation(ref)
            port[np.flatnonzero(port == ref[order[at]])[0]] += 1e-3
            yield ref, port
        ties = np.round(ref, 1)
        yield ties, rng.permutation(ties)
        yield ties, rng.permutation(ties) + 1e-4


def test_the_ends_first_give_the_full_sorts_answer():
    rng = np.random.default_rng(7)
    answers = []
    for ref, port in cases(rng):
        judge = Judge(ref.reshape(-1, 1), port.reshape(-1, 1), RTOL, ATOL)
        answers.append(layout._same_values(judge))
        assert answers[-1] == sorted_agree_whole(judge), (ref.size, ref[:4], port[:4])
    assert True in answers and False in answers


def test_noise_is_turned_down_without_a_full_sort(monkeypatch):
    """A 2^20-element origin with noise on it (the common origin): sorting it whole cost
    50-80 ms a side, asked twice (transpose, permutation). Now the ends answer, once."""
    rng = np.random.default_rng(3)
    ref = rng.standard_normal((1024, 1024))
    port = ref * (1 + 1e-5 * rng.standard_normal(ref.shape))
    judge = Judge(ref, port, RTOL, ATOL)
    sorted_whole = []
    real_sort = np.sort

    def counting_sort(values, *args, **kwargs):
        sorted_whole.append(np.size(values) == ref.size)
        return real_sort(values, *args, **kwargs)

    monkeypatch.setattr(layout.np, "sort", counting_sort)
    assert layout.transpose(judge, None) is None
    assert layout.permutation(judge, None) is None
    assert not any(sorted_whole)
    assert judge.memo == {"same_values": False}


@pytest.mark.parametrize("kind", ["transpose", "permutation"])
def test_a_rearrangement_is_still_named(kind):
    rng = np.random.default_rng(5)
    ref = rng.standard_normal((16, 24))
    port = ref.T.reshape(ref.shape) if kind == "transpose" else np.concatenate(
        [ref[8:], ref[:8]])
    judge = Judge(ref, port, RTOL, ATOL)
    found = getattr(layout, kind)(judge, None)
    assert found is not None and str(found.kind) == kind


def test_the_ends_are_the_sorted_tensors_ends():
    """Ties, a constant tensor, half zeros (after a ReLU), both signs, sizes near the sample."""
    rng = np.random.default_rng(11)
    for values in (rng.standard_normal(10_000), np.zeros(5000), np.maximum(
            rng.standard_normal(70_000), 0), np.round(rng.standard_normal(9000)),
            rng.standard_normal(layout.SAMPLE * 2 + 3), np.arange(300.0)[::-1]):
        low, high = layout._ends(values)
        whole = np.sort(values)
        assert np.array_equal(low, whole[:layout.TAIL])
        assert np.array_equal(high, whole[-layout.TAIL:])
