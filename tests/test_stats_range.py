"""Index statistics and their verification agree for every value a dtype can hold.

A trace's writer computes each tensor's statistics on one of several paths (the compiled
kernel over a packed batch, over one span, numpy's reduceat batch for small tensors, numpy
per tensor); a reader verifying what it reads recomputes them chunk by chunk, compiled or in
numpy (trace/verify.py). Whatever the magnitudes (from the smallest subnormal to the largest
finite value: vanishing gradients whose squares are subnormal in float32, finfo.min masks whose
sums overflow float64), every path must give statistics every reader path accepts, and the
paths must agree to the summation's own error bound (stats.py, "scaled sums").
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff import TraceError
from layerdiff.trace import schema, stats, stats_kernel
from layerdiff.trace.stats import (
    Stats,
    batch_stats,
    compute_stats,
    numpy_batch_stats,
    span_stats,
    tensor_stats,
)
from layerdiff.trace.verify import RecordCheck, check_index

ALIGN = 64
F64_MAX = float(np.finfo(np.float64).max)
F64_MIN = float(np.finfo(np.float64).min)

# (numpy storage dtype, largest biased exponent of a finite value, mantissa bits) per float
FLOATS = {"float64": (np.uint64, 2046, 52), "float32": (np.uint32, 254, 23),
          "float16": (np.uint16, 30, 10), "bfloat16": (np.uint16, 254, 7)}
INTS = ["int64", "int32", "int8", "uint8", "bool"]


def _floats(draw, dtype: str, n: int) -> np.ndarray:
    """n values of a float dtype as stored bits: exponents within a band anywhere in the
    dtype's range (subnormals and the largest values included), random mantissas and signs,
    and some specials (0, -0, the extremes, inf, NaN)."""
    bits_type, top, mantissa = FLOATS[dtype]
    width = 8 * np.dtype(bits_type).itemsize
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    low = draw(st.integers(0, top))
    high = min(top, low + draw(st.sampled_from([0, 1, 3, 30, top])))
    exponents = rng.integers(low, high + 1, n, dtype=np.uint64)
    mantissas = rng.integers(0, 2**mantissa, n, dtype=np.uint64)
    signed = draw(st.booleans())
    signs = rng.integers(0, 2, n, dtype=np.uint64) if signed else np.zeros(n, np.uint64)
    raw = (signs << np.uint64(width - 1)) | (exponents << np.uint64(mantissa)) | mantissas
    raw = raw.astype(bits_type)
    specials = draw(st.lists(st.sampled_from(
        ["zero", "negzero", "max", "min", "tiny", "inf", "nan"]), max_size=3))
    for name in specials:
        value = {"zero": 0, "negzero": 1 << (width - 1),
                 "max": (top << mantissa) | (2**mantissa - 1),
                 "min": (1 << (width - 1)) | (top << mantissa) | (2**mantissa - 1),
                 "tiny": 1, "inf": (top + 1) << mantissa,
                 "nan": ((top + 1) << mantissa) | 1}[name]
        raw[rng.integers(0, n)] = value
    if dtype in ("bfloat16",):
        return raw
    return raw.view(dtype)


def _ints(draw, dtype: str, n: int) -> np.ndarray:
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if dtype == "bool":
        return rng.integers(0, 2, n).astype(bool)
    info = np.iinfo(dtype)
    return rng.integers(info.min, info.max, n, dtype=dtype, endpoint=True)


@st.composite
def tensors(draw, dtypes=(*FLOATS, *INTS)):
    dtype = draw(st.sampled_from(dtypes))
    n = draw(st.sampled_from([1, 2, 3, 17, 300, 5000]))
    raw = _floats(draw, dtype, n) if dtype in FLOATS else _ints(draw, dtype, n)
    return dtype, raw


def _packed(arrays: list[np.ndarray], names: list[str]):
    """Arrays packed as the recorder's ring holds them: 64-byte aligned, arbitrary gaps."""
    buffer = np.full(sum(a.nbytes + ALIGN for a in arrays) + ALIGN, 0xFF, dtype=np.uint8)
    spans, offset = [], 0
    for array, name in zip(arrays, names, strict=True):
        buffer[offset:offset + array.nbytes] = array.reshape(-1).view(np.uint8)
        spans.append((offset, array.nbytes, name))
        offset += -(-max(array.nbytes, 1) // ALIGN) * ALIGN
    return buffer, spans


def writer_paths(raw: np.ndarray, dtype: str, neighbour: np.ndarray) -> dict[str, Stats]:
    """The statistics of ``raw`` by every path a writer takes (the kernel loaded)."""
    assert stats.compiled() is not None
    buffer, spans = _packed([neighbour, raw, neighbour], [neighbour.dtype.name, dtype,
                                                          neighbour.dtype.name])
    found = {"compute_stats": compute_stats(raw, dtype),
             "tensor_stats": tensor_stats(raw, dtype),
             "batch_stats": batch_stats(buffer, spans)[1],
             "span_stats": span_stats(raw.reshape(-1).view(np.uint8), dtype)}
    small = numpy_batch_stats(buffer, spans)[1]  # None where it leaves a tensor to compute_stats
    if small is not None:
        found["numpy_batch_stats"] = small
    return {path: found_stats for path, found_stats in found.items() if found_stats is not None}


def _row(found: Stats, raw: np.ndarray, dtype: str) -> dict:
    return dict(found._asdict(), site="layers.0#0", role="output", arg="0", step=0,
                dtype=dtype, numel=int(raw.size))


def _verify(raw: np.ndarray, row: dict, cuts: list[int], *, kernel: bool) -> str:
    """'' when a reader verifying ``raw`` fed in pieces cut at ``cuts`` accepts ``row``,
    through the compiled kernel or numpy (LAYERDIFF_STATS=numpy)."""
    with pytest.MonkeyPatch.context() as patch:
        stats.compiled.cache_clear()
        if kernel:
            patch.delenv("LAYERDIFF_STATS", raising=False)
            stats.compiled()
        else:
            patch.setenv("LAYERDIFF_STATS", "numpy")
        try:
            check = RecordCheck(row, "t.h5")
            assert (check._kernel is not None) == (kernel and check._stats)
            for piece in np.split(raw.reshape(-1), cuts):
                check.update(piece.view(np.uint8))
            check.finish()
        except TraceError as error:
            return str(error)
        finally:
            stats.compiled.cache_clear()
    stats.compiled()
    return ""


def _index_row(found: Stats, raw: np.ndarray, dtype: str) -> pd.DataFrame:
    """A one-row index as the writer stores it, for check_index."""
    itemsize = schema.numpy_dtype(dtype).itemsize
    return pd.DataFrame([dict(found._asdict(), seq=0, step=0, **{"pass": "forward"},
                              site="layers.0#0", role="output", arg="0", kind="tensor",
                              dtype=dtype, shape=str(raw.size), numel=raw.size, segment=0,
                              offset=0, nbytes=raw.size * itemsize, value="")])


def _finite_values(raw: np.ndarray, dtype: str) -> np.ndarray:
    with np.errstate(invalid="ignore"):  # a signaling NaN, cast
        values = stats.as_float(raw.reshape(-1), dtype).astype(np.float64)
    return values[np.isfinite(values)]


def _agreement_bound(raw: np.ndarray, dtype: str) -> tuple[float, float]:
    """(mean slack, relative slack on squares) within which two float64 summations of these
    values must agree: 2 gamma_n (stats.py, "scaled sums"), n counting every element."""
    n = raw.size + 1
    gamma = n * 2.0**-53 / (1 - n * 2.0**-53)
    return 2 * gamma, 2 * gamma


def _assert_paths_agree(found: dict[str, Stats], raw: np.ndarray, dtype: str) -> None:
    reference = found["compute_stats"]
    values = _finite_values(raw, dtype)
    rel, rel_squares = _agreement_bound(raw, dtype)
    largest = float(np.abs(values).max()) if values.size else 0.0
    for path, got in found.items():
        assert got.digest == reference.digest, path
        assert (got.nan, got.inf) == (reference.nan, reference.inf), path
        # equal as numbers (numpy and the kernel may differ on which zero is the minimum)
        assert np.array_equal([got.min, got.max], [reference.min, reference.max],
                              equal_nan=True), path
        if not largest:
            continue
        rms = largest * math.sqrt(np.mean(np.square(values / largest)))
        # plus the rounding of each path's mean onto float64's subnormal grid
        assert abs(got.mean - reference.mean) <= rel * rms + 2.0**-1073, path
        if reference.l2 > 0 and math.isfinite(reference.l2) and math.isfinite(got.l2):
            assert abs(got.l2 / reference.l2 - 1) <= rel_squares + 2.0**-1073 / reference.l2, \
                path


@settings(max_examples=300, deadline=None)
@given(tensor=tensors(), cuts=st.lists(st.integers(0, 5000), max_size=4), data=st.data())
def test_every_writer_path_is_accepted_by_every_reader_path(tensor, cuts, data):
    dtype, raw = tensor
    neighbour = data.draw(tensors(dtypes=(dtype,)))[1]
    found = writer_paths(raw, dtype, neighbour)
    cuts = sorted({c % raw.size for c in cuts})
    for path, got in found.items():
        row = _row(got, raw, dtype)
        check_index(_index_row(got, raw, dtype), "t.h5")  # raises on a refused row
        for kernel in (True, False):
            refused = _verify(raw, row, cuts, kernel=kernel)
            assert refused == "", (path, kernel, refused, dtype, raw[:8], raw.size)
    _assert_paths_agree(found, raw, dtype)


def test_kernel_scale_constants_are_the_stats_module_constants():
    assert stats_kernel.SCALE_DOWN == stats.SCALE_DOWN
    assert stats_kernel.SCALE_UP == stats.SCALE_UP
    assert stats_kernel.TINY_SQUARES == stats.TINY_SQUARES


# --------------------------------------------------------------------- the cases

def _mask(dtype: str, size: int = 16) -> np.ndarray:
    """An HF causal mask: 0 on and below the diagonal, the dtype's lowest value above it."""
    lowest = np.finfo(np.float32 if dtype == "bfloat16" else dtype).min
    mask = np.triu(np.full((size, size), lowest, dtype=np.float64), 1)
    if dtype == "bfloat16":  # bfloat16's lowest, as stored bits
        return np.triu(np.full((size, size), 0xFF7F, np.uint16), 1)
    return mask.astype(dtype)


@pytest.mark.parametrize("dtype", ["float64", "float32", "float16", "bfloat16"])
def test_a_finfo_min_mask_has_finite_mean_and_std_and_is_accepted(dtype):
    raw = _mask(dtype)
    lowest = float(stats.as_float(raw.reshape(-1), dtype).min())
    for path, got in writer_paths(raw, dtype, _mask(dtype, 3)).items():
        assert (got.min, got.max, got.nan, got.inf) == (lowest, 0.0, 0, 0), path
        # 120 of 256 values at the lowest: the mean is exactly representable as 120/256 of it
        assert got.mean == pytest.approx(lowest / 256 * 120, rel=1e-12), path
        assert got.std == pytest.approx(abs(lowest) * math.sqrt(120 / 256 * 136 / 256),
                                        rel=1e-12), path
        # the L2 norm is sqrt(120) |lowest|: beyond float64's range only for float64
        if dtype == "float64":
            assert got.l2 == math.inf, path
        else:
            assert got.l2 == pytest.approx(abs(lowest) * math.sqrt(120), rel=1e-12), path
        check_index(_index_row(got, raw, dtype), "t.h5")
        for kernel in (True, False):
            assert _verify(raw, _row(got, raw, dtype), [37, 100], kernel=kernel) == ""


def test_a_trace_from_before_scaled_sums_still_reads():
    """Writers before the scaled sums stored mean -inf, std NaN and l2 inf for a float64
    finfo.min mask (their float64 sums overflowed): such a trace is not damaged."""
    raw = _mask("float64")
    old = compute_stats(raw, "float64")._replace(mean=-math.inf, std=math.nan, l2=math.inf)
    check_index(_index_row(old, raw, "float64"), "t.h5")
    for kernel in (True, False):
        assert _verify(raw, _row(old, raw, "float64"), [100], kernel=kernel) == ""


@pytest.mark.parametrize("column, value", [("mean", math.inf), ("mean", math.nan),
                                           ("std", math.nan), ("l2", math.inf),
                                           ("l2", math.nan), ("min", -math.inf)])
def test_a_non_finite_statistic_of_values_that_cannot_overflow_is_refused(column, value):
    """Values below sqrt(float64 max) / sqrt(n) cannot overflow any sum: inf or NaN there is
    damage, as before."""
    raw = np.linspace(-1e150, 1e150, 64)
    edited = compute_stats(raw, "float64")._replace(**{column: value})
    with pytest.raises(TraceError, match="non-finite statistic"):
        check_index(_index_row(edited, raw, "float64"), "t.h5")


def test_vanishing_gradients_agree_on_every_path():
    """The issue's deep_narrow gradients: float32 values below 4e-22, whose squares (below
    1.6e-43) are deep in float32's subnormal range. A float32 dot lost ~0.7% of their sum of
    squares there (L2 2.2535e-21 for 2.2618e-21)."""
    rng = np.random.default_rng(3)
    raw = (rng.standard_normal(1024) * 1e-22).astype(np.float32)
    exact = math.sqrt(math.fsum(float(v) ** 2 for v in raw.astype(np.float64)))
    found = writer_paths(raw, "float32", raw[:100])
    for path, got in found.items():
        assert got.l2 == pytest.approx(exact, rel=1e-12), path
    for kernel in (True, False):
        row = _row(found["compute_stats"], raw, "float32")
        assert _verify(raw, row, [100, 300], kernel=kernel) == ""
        edited = dict(row, l2=row["l2"] * 1.01)  # an edit is still seen
        assert "l2: index says" in _verify(raw, edited, [], kernel=kernel)


@pytest.mark.parametrize("scale", [2.0**-1070, 2.0**-540, 2.0**500, 2.0**1000])
def test_float64_at_the_ends_of_the_range_has_accurate_statistics(scale):
    """Squares of float64 values below 2**-511 are subnormal, above 2**512 infinite: the sums
    are scaled, so mean, std and l2 are those of the values, not of their rounding."""
    rng = np.random.default_rng(5)
    base = rng.uniform(0.5, 1.0, 1000)
    raw = base * scale
    for path, got in writer_paths(raw, "float64", raw[:10]).items():
        assert got.mean == pytest.approx(base.mean() * scale, rel=1e-12), path
        assert got.std == pytest.approx(base.std() * scale, rel=1e-9), path
        want_l2 = math.sqrt(float(np.sum(base**2))) * scale
        assert got.l2 == pytest.approx(want_l2, rel=1e-12) if math.isfinite(want_l2) \
            else got.l2 == math.inf, path
        for kernel in (True, False):
            assert _verify(raw, _row(got, raw, "float64"), [10, 500], kernel=kernel) == ""


@pytest.mark.parametrize("order", ["tiny-zero-normal-huge", "huge-normal-zero-tiny",
                                   "zero-tiny", "tiny-normal"])
def test_chunks_summed_at_different_scales_fold_into_the_writers_sums(order):
    """A reader's chunks may each be summed at another scale (values times 2**600 for a chunk
    of tiny values, 2**-600 for one of huge values, unscaled, or all zeros at none): folded,
    they must give what the writer got for the whole tensor."""
    rng = np.random.default_rng(11)
    parts = {"tiny": rng.uniform(0.5, 1, 50) * 2.0**-1060,
             "zero": np.zeros(50), "normal": rng.standard_normal(50),
             "huge": rng.uniform(-1, 1, 50) * 2.0**1020}
    names = order.split("-")
    raw = np.concatenate([parts[name] for name in names])
    cuts = list(range(50, 50 * len(names), 50))
    for path, got in writer_paths(raw, "float64", parts["normal"][:5]).items():
        for kernel in (True, False):
            assert _verify(raw, _row(got, raw, "float64"), cuts, kernel=kernel) == "", path
            edited = dict(_row(got, raw, "float64"), l2=got.l2 * 1.01)
            # an edit is still seen, at any scale, but where every value is below 2**-511:
            # older writers' unscaled float64 squares were subnormal there, and their norms
            # are still read (verify.py, _squares_floor)
            if math.isfinite(got.l2) and order != "zero-tiny":
                assert "l2: index says" in _verify(raw, edited, cuts, kernel=kernel), path
            mean_edited = dict(_row(got, raw, "float64"), mean=got.mean + 0.01 * got.std)
            assert "mean: index says" in _verify(raw, mean_edited, cuts, kernel=kernel), path
