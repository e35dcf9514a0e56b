"""The compiled metric kernel (compare/kernels.py) against the numpy reference path.

Every column the numpy path makes exactly (max_abs, max_rel, ratio, finite_ratio, max_ulp,
out counts, worst index, per-batch ratios, NaN and Inf counts) must come out equal, bit for bit,
on any input: float32, float16, float64, bfloat16 (stored bits widened to float32, as the
reader passes them), and a float32 reference against a float64 port (rescaled gradients); with
NaN, infinities, -0.0, subnormals, the largest finite values, equal elements, odd sizes, and
chunk and batch boundaries anywhere. The sums (mean_abs, rms, cosine) may differ only by their
summation order: relative 1e-12 for the sums of non-negative terms, 1e-12 absolute for the
cosine (a dot product of mixed signs can cancel, so only its scale, 1, bounds its rounding).
A whole diff of two traces gives the same rows through either path.
"""

from __future__ import annotations

import itertools
import math
import subprocess
import sys
import warnings

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import layerdiff
from layerdiff import TraceWriter
from layerdiff.compare import metrics as M
from layerdiff.trace import schema


@pytest.fixture(autouse=True, scope="module")
def _kernel_loaded():
    """Load the kernel up front: a process loads it for its first pair of 2**20 elements or
    more, and every pair after that, small ones too, goes through it."""
    assert M._kernel() is not None


EXACT = ("max_abs", "max_rel", "ratio", "finite_ratio", "max_ulp", "frac_out", "worst_index",
         "ref_nan", "ref_inf", "port_nan", "port_inf")
POSITIVE_SUMS = ("mean_abs", "rms")


def _run(ref, port, rtol, atol, *, batch, ulp_scale, cuts, kernel):
    """Feed flat ``ref``/``port`` split at ``cuts`` through one path; the row's columns."""
    metrics = M.PairMetrics(rtol, atol, ref.size, batch, ulp_scale)
    metrics.scratch = M.Scratch()
    edges = [0, *sorted(cuts), ref.size]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the numpy path's all-NaN blocks
        for start, stop in itertools.pairwise(edges):
            a, b = ref[start:stop], port[start:stop]
            if kernel:
                assert a.size == 0 or metrics._kernel_update(a, b, start), "kernel not used"
            else:
                for begin in range(0, a.size, M.BLOCK):
                    metrics._numpy_update_block(a[begin:begin + M.BLOCK],
                                                b[begin:begin + M.BLOCK], start + begin)
    result = metrics.result((batch, ref.size // batch) if batch else (ref.size,))
    result["out"] = metrics.out
    return result


def assert_same(kernel: dict, numpy: dict, *, sums: bool = True) -> None:
    """Exact columns equal; sums within their rounding (``sums``: when no partial sum can
    overflow float64, where the order decides between inf, NaN and a finite number)."""
    for key in (*EXACT, "out"):
        if key not in numpy:  # a diff row has no finite_ratio nor out
            continue
        got, want = kernel[key], numpy[key]
        assert got == want or (got != got and want != want), (key, got, want)
    if isinstance(numpy["batch_ratio"], np.ndarray):
        np.testing.assert_array_equal(kernel["batch_ratio"], numpy["batch_ratio"])
    if not sums:
        return
    for key in POSITIVE_SUMS:
        np.testing.assert_allclose(kernel[key], numpy[key], rtol=1e-12, atol=0, equal_nan=True,
                                   err_msg=key)
    np.testing.assert_allclose(kernel["cosine"], numpy["cosine"], rtol=0, atol=1e-12,
                               equal_nan=True, err_msg="cosine")


def _both(ref, port, rtol=1.3e-6, atol=1e-5, *, batch=0, ulp_scale=1.0, cuts=()):
    args = {"batch": batch, "ulp_scale": ulp_scale, "cuts": cuts}
    kernel = _run(ref, port, rtol, atol, kernel=True, **args)
    finite = [np.abs(side[np.isfinite(side)], dtype=np.float64) for side in (ref, port)]
    largest = max((float(side.max()) for side in finite if side.size), default=0.0)
    assert_same(kernel, _run(ref, port, rtol, atol, kernel=False, **args),
                sums=largest < 1e150)
    return kernel


# ---------------------------------------------------------------- generated pairs

DTYPES = ("float32", "float16", "float64", "bfloat16", "float32-vs-float64")
TOLERANCES = [(1.3e-6, 1e-5), (1e-3, 1e-5), (0.0, 0.0), (1e-2, 0.0), (0.0, 1e-3), (1.6e-2, 1e-5)]


def _specials(dtype) -> np.ndarray:
    info = np.finfo(dtype)
    tiny = np.nextafter(dtype(0), dtype(1))
    return np.array([np.nan, np.inf, -np.inf, 0.0, -0.0, tiny, -tiny, info.tiny, info.max,
                     -info.max, 1.0, -1.0], dtype)


@st.composite
def _pairs(draw):
    kind = draw(st.sampled_from(DTYPES))
    batch = draw(st.sampled_from([0, 1, 2, 3, 7]))
    per = draw(st.integers(1, 700))
    size = per * batch if batch else draw(st.integers(1, 3000))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    storage = {"float16": np.float16, "float64": np.float64}.get(kind, np.float32)
    scale = draw(st.sampled_from([1e-30, 1e-3, 1.0, 1e4, 1e30]))
    ref = (rng.standard_normal(size) * scale).astype(storage)
    error = draw(st.sampled_from([0.0, 1e-7, 1e-5, 1e-2, 1.0]))
    port = (ref * (1 + error * rng.standard_normal(size))).astype(storage)
    equal = rng.random(size) < draw(st.sampled_from([0.0, 0.5]))
    port[equal] = ref[equal]
    specials = _specials(storage)
    for side in (ref, port):  # specials at random places on each side, some on both
        share = draw(st.sampled_from([0.0, 0.001, 0.05, 0.5]))
        places = rng.random(size) < share
        side[places] = rng.choice(specials, int(places.sum()))
    both = rng.random(size) < draw(st.sampled_from([0.0, 0.02]))
    port[both] = ref[both]
    ulp_scale = 1.0
    if kind == "bfloat16":  # stored bits, widened as segments.decode widens them
        ref = schema.bfloat16_to_float32((ref.view(np.uint32) >> 16).astype(np.uint16))
        port = schema.bfloat16_to_float32((port.view(np.uint32) >> 16).astype(np.uint16))
        ulp_scale = 2.0**16
    elif kind == "float32-vs-float64":  # a rescaled gradient: ULPs of neither side
        port = port.astype(np.float64) * draw(st.sampled_from([1.0, 0.5, 3.0]))
        ulp_scale = None
    cuts = draw(st.lists(st.integers(0, size), max_size=5))
    rtol, atol = draw(st.sampled_from(TOLERANCES))
    return ref, port, rtol, atol, batch, ulp_scale, cuts


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=_pairs())
def test_kernel_gives_the_numpy_paths_columns(case):
    ref, port, rtol, atol, batch, ulp_scale, cuts = case
    _both(ref, port, rtol, atol, batch=batch, ulp_scale=ulp_scale, cuts=cuts)


# ---------------------------------------------------------------- chosen edges


def test_blocks_and_sub_blocks_boundaries_with_a_late_nan_and_ties():
    """Past the numpy path's 64K blocks and the kernel's 1K sub-blocks: the first of equal
    worst elements wins, a NaN in one late block changes only that block's rules."""
    rng = np.random.default_rng(3)
    size = 5 * 41791  # 3 blocks and a part, 5 batch rows
    ref = rng.integers(-3, 4, size).astype(np.float32)
    port = ref + rng.choice(np.float32([0.0, 1e-5, 3e-5]), size)
    port[2 * M.BLOCK + 17] = np.nan
    ref[M.BLOCK - 1] = np.inf
    port[M.BLOCK - 1] = np.inf
    for batch in (0, 5):
        found = _both(ref, port, batch=batch, cuts=[M.BLOCK + 3, 2 * M.BLOCK + 100])
        assert found["ratio"] == math.inf and found["port_nan"] == 1
        assert found["ref_inf"] == found["port_inf"] == 1
    clean = _both(ref[:M.BLOCK - 1], port[:M.BLOCK - 1], batch=0)
    assert clean["ratio"] > 1 and clean["worst_index"] != ""


def test_float64_values_far_apart_wrap_their_ulps_as_numpy_does():
    big = np.finfo(np.float64).max
    ref = np.array([big, -big, 1.0, 5e-324], np.float64)
    port = np.array([-big, big, -1.0, -5e-324], np.float64)
    _both(ref, port)


def test_zero_tolerance_counts_every_difference_and_none_where_equal():
    ref = np.float32([0.0, -0.0, 1.0, 2.0, np.nan, np.inf])
    port = np.float32([-0.0, 0.0, 1.0, 2.0000002, np.nan, np.inf])
    found = _both(ref, port, 0.0, 0.0)
    assert found["out"] == 1 and found["worst_index"] == "3" and found["ratio"] == math.inf


def test_integer_and_complex_tensors_keep_the_numpy_path():
    ints = np.arange(10, dtype=np.int64)
    metrics = M.PairMetrics(0.0, 0.0, 10)
    assert not metrics._kernel_update(ints, ints + 1, 0)
    cplx = np.ones(4, np.complex64)
    assert not M.PairMetrics(1e-5, 1e-5, 4)._kernel_update(cplx, cplx, 0)


# ---------------------------------------------------------------- a whole diff


def _write(path, seed: int, *, port: bool) -> None:
    """A trace of float32, float16 and float64 tensors, batched and not, one with a NaN and an
    Inf in the port, a few larger than a read chunk (1 MiB). (bfloat16 is decoded to float32
    before the metrics, as the generated pairs above have it.)"""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(seed + 1)  # the port's errors, apart from the values' draws
    shapes = {"float32": (8, 70000), "float16": (4, 3001), "float64": (5, 40000)}
    with TraceWriter(path, meta={"case": "kernel"}) as writer:
        for layer in range(3):
            site = writer.enter(f"layers.{layer}", "Linear")
            for dtype, shape in shapes.items():
                values = rng.standard_normal(shape)
                if port:
                    values = values * (1 + 3e-6 * noise.standard_normal(shape))
                    if layer == 1 and dtype == "float32":
                        values[2, 5] = np.nan
                        values[3, 9] = np.inf
                writer.record(site, "output", values.astype(dtype), arg=dtype)
                writer.record(site, "weight", values[:1].astype(np.float32), arg=dtype)
            writer.exit(site)


def test_a_whole_diff_gives_the_same_rows_through_either_path(tmp_path, monkeypatch):
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    _write(ref, 0, port=False)
    _write(port, 0, port=True)
    kernel = layerdiff.diff(ref, port).rows
    monkeypatch.setenv("LAYERDIFF_NUMPY_METRICS", "1")
    numpy = layerdiff.diff(ref, port).rows
    assert len(kernel) == len(numpy) == 18
    assert set(kernel["dtype"]) == {"float32", "float16", "float64"}
    for (_, k), (_, n) in zip(kernel.iterrows(), numpy.iterrows(), strict=True):
        assert_same(k.to_dict(), n.to_dict())
        assert k["verdict"] == n["verdict"]
    nan_row = kernel[(kernel["port_nan"] > 0)]
    assert len(nan_row) == 1 and nan_row.iloc[0]["port_inf"] == 1
    assert {"out", "within"} <= set(kernel["verdict"])


def test_a_diff_of_small_tensors_does_not_load_numba(tmp_path):
    """numba's import and cache cost ~1 s once: a diff whose tensors are all small keeps the
    numpy path and never pays it (CLI start-up on small traces)."""
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    for path, factor in ((ref, 1.0), (port, 1.0 + 1e-3)):
        with TraceWriter(path) as writer:
            site = writer.enter("layer", "Linear")
            writer.record(site, "output", np.linspace(1, 2, 5000, dtype=np.float32) * factor)
            writer.exit(site)
    code = ("import sys, layerdiff; rows = layerdiff.diff(sys.argv[1], sys.argv[2]).rows; "
            "assert rows['verdict'].iloc[0] == 'out'; print('numba' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(ref), str(port)], check=True,
                          capture_output=True, text=True)
    assert done.stdout.strip() == "False"


def _one_tensor_pair(tmp_path, numel: int) -> tuple[str, str]:
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    for path, factor in ((ref, 1.0), (port, 1.0 + 1e-3)):
        with TraceWriter(path) as writer:
            site = writer.enter("layer", "Linear")
            writer.record(site, "output", np.linspace(1, 2, numel, dtype=np.float32) * factor)
            writer.exit(site)
    return str(ref), str(port)


def test_the_diff_command_on_small_traces_does_not_load_numba(tmp_path):
    """`layerdiff diff` end to end (the CLI's imports and its report too) on a small pair."""
    ref, port = _one_tensor_pair(tmp_path, 5000)
    code = ("import runpy, sys\n"
            "sys.argv = ['layerdiff', 'diff', sys.argv[1], sys.argv[2]]\n"
            "try:\n    runpy.run_module('layerdiff', run_name='__main__')\n"
            "except SystemExit as exit:\n    code = exit.code\n"
            "print(code, 'numba' in sys.modules, 'layerdiff.compare.kernels' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, ref, port], check=True,
                          capture_output=True, text=True)
    assert done.stdout.split()[-3:] == ["1", "False", "False"]
