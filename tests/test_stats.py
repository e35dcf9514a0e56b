"""Statistics: the batched path for small tensors agrees with the per-tensor one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff.trace.stats import batch_stats, compute_stats

ALIGN = 64


@settings(max_examples=40, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=300), min_size=1, max_size=12),
       dtypes=st.lists(st.sampled_from(["float32", "float64", "int64"]), min_size=12,
                       max_size=12),
       specials=st.sampled_from([None, np.nan, np.inf]))
def test_batch_stats_match_compute_stats(sizes, dtypes, specials):
    rng = np.random.default_rng(sum(sizes))
    arrays = [(rng.standard_normal(n) * 3 + 1).astype(dtypes[i]) for i, n in enumerate(sizes)]
    if specials is not None and arrays[0].size and arrays[0].dtype.kind == "f":
        arrays[0][0] = specials
    buffer = np.zeros(sum(a.nbytes + ALIGN for a in arrays) + ALIGN, dtype=np.uint8)
    spans, offset = [], 0
    for array in arrays:
        buffer[offset:offset + array.nbytes] = array.view(np.uint8)
        spans.append((offset, array.nbytes, array.dtype.name))
        offset += -(-max(array.nbytes, 1) // ALIGN) * ALIGN
    for array, got in zip(arrays, batch_stats(buffer, spans, fused=False), strict=True):
        want = compute_stats(array, array.dtype.name)
        if got is None:
            continue  # left to compute_stats: not a batched dtype, empty, or not finite
        assert np.isfinite(array).all()
        assert got.digest == want.digest
        assert (got.min, got.max, got.nan, got.inf) == (want.min, want.max, 0, 0)
        assert got.mean == pytest.approx(want.mean, rel=1e-6, abs=1e-9)
        assert got.l2 == pytest.approx(want.l2, rel=1e-5)
        assert got.std == pytest.approx(want.std, rel=1e-4, abs=1e-6)


def test_nan_and_inf_are_counted_per_tensor():
    values = np.array([1.0, np.nan, np.inf, -np.inf, 2.0], dtype=np.float32)
    stats = compute_stats(values, "float32")
    assert (stats.nan, stats.inf) == (1, 2)
    assert (stats.min, stats.max) == (-np.inf, np.inf)
    assert stats.mean == pytest.approx(1.5)
    assert np.isnan(stats.l2)


def test_bfloat16_bits_are_widened():
    bits = (np.array([1.5, -2.0], dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    stats = compute_stats(bits, "bfloat16")
    assert (stats.min, stats.max) == (-2.0, 1.5)


def test_std_keeps_its_digits_far_from_zero():
    """E[x^2] - E[x]^2 cancels for a small spread far from zero; the std must not."""
    values = np.array([1000.0, 1000.001, 1000.002], np.float32)
    want = values.std(dtype=np.float64)
    assert compute_stats(values, "float32").std == pytest.approx(want, rel=1e-6)
    buffer = np.zeros(256, np.uint8)
    buffer[:12] = values.view(np.uint8)
    buffer[64:76] = values.view(np.uint8)
    got = batch_stats(buffer, [(0, 12, "float32"), (64, 12, "float32")])
    assert got[0].std == pytest.approx(want, rel=1e-6)
