"""Verification's statistics through the compiled kernel refuse exactly what numpy refuses.

A reader checks every tensor it reads against its index row (trace/verify.py RecordCheck): the
digest, and min, max, mean, std, L2 norm, NaN and Inf counts recomputed chunk by chunk. The
chunks' statistics now come from the compiled kernel (trace/stats_kernel.py) once it is loaded;
numpy stays the reference and the path without numba or with LAYERDIFF_STATS=numpy. Whatever
the values (NaN, Inf, chunks of nothing but NaN, -0.0, float16 and bfloat16 extremes) and
however the bytes are cut, both paths must accept the writer's statistics and refuse the same
edits with the same sentence.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import h5py
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

from layerdiff import TraceError, TraceWriter, diff
from layerdiff.trace import schema, stats
from layerdiff.trace.stats import compute_stats
from layerdiff.trace.verify import RecordCheck


def _row(raw: np.ndarray, dtype: str, **edits) -> dict:
    """The index row the writer makes for ``raw`` (stored bits for bfloat16), edited."""
    row = dict(compute_stats(raw, dtype)._asdict(), site="layers.0#0", role="output", arg="0",
               step=0, dtype=dtype, numel=int(raw.size))
    row.update(edits)
    return row


def _judge(raw: np.ndarray, row: dict, pieces: int, *, kernel: bool) -> str:
    """'' when the check accepts the bytes fed in ``pieces``, else its sentence."""
    if kernel:
        assert stats.compiled() is not None
    else:
        stats.compiled.cache_clear()
    check = RecordCheck(row, "t.h5")
    assert (check._kernel is not None) == kernel
    flat = raw.reshape(-1)
    for part in np.array_split(flat, pieces):
        check.update(part.view(np.uint8))
    try:
        check.finish()
    except TraceError as error:
        return str(error)
    return ""


def _both(raw: np.ndarray, row: dict, pieces: int, monkeypatch) -> str:
    with_kernel = _judge(raw, row, pieces, kernel=True)
    monkeypatch.setenv("LAYERDIFF_STATS", "numpy")
    try:
        with_numpy = _judge(raw, row, pieces, kernel=False)
    finally:
        monkeypatch.delenv("LAYERDIFF_STATS")
        stats.compiled.cache_clear()
    assert _rounded(with_kernel) == _rounded(with_numpy)
    return with_kernel


def _rounded(sentence: str) -> str:
    """The sentence with its numbers to 6 digits: 'data has' is recomputed, in another
    summation order, so the last digits of an L2 norm or a standard deviation may differ (the
    decision never does: its slack is 1e-3)."""
    return re.sub(r"-?\d+\.\d+(e[-+]\d+)?", lambda m: f"{float(m.group()):.6g}", sentence)


FLOATS = st.sampled_from([np.float16, np.float32, np.float64])


@settings(max_examples=60, deadline=None)
@given(values=hnp.arrays(FLOATS, st.integers(1, 600),
                         elements=st.floats(width=16, allow_nan=True, allow_infinity=True)),
       offset=st.floats(-1e4, 1e4, width=16), pieces=st.integers(1, 7),
       bfloat=st.booleans())
def test_both_paths_accept_what_the_writer_computed(values, offset, pieces, bfloat):
    values = (values + values.dtype.type(offset)).astype(values.dtype)
    dtype = values.dtype.name
    if bfloat:  # the top halves of float32 values, stored as bits
        values = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
        dtype = "bfloat16"
    row = _row(values, dtype)
    assert _judge(values, row, pieces, kernel=True) == ""


def _finite_or(value: float, edited: float, otherwise: float) -> float:
    return edited if np.isfinite(value) else otherwise


EDITS = [("min", lambda r: _finite_or(r["min"], np.nextafter(r["min"], -np.inf), 0.0)),
         ("max", lambda r: _finite_or(r["max"], r["max"] * 1.5 + 1.0, 1e30)),
         ("mean", lambda r: r["mean"] + 0.1 * (abs(r["mean"]) + r["std"] + 1.0)),
         ("std", lambda r: r["std"] * 1.2 + 1e-3),
         ("l2", lambda r: r["l2"] * 1.01),
         ("nan", lambda r: r["nan"] + 1),
         ("inf", lambda r: r["inf"] + 1)]


@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "bfloat16"])
@pytest.mark.parametrize("column", [name for name, _ in EDITS])
@pytest.mark.parametrize("specials", [False, True])
def test_an_edited_statistic_gets_the_same_sentence_through_both_paths(dtype, column, specials,
                                                                      monkeypatch):
    rng = np.random.default_rng(7)
    values = rng.standard_normal(5000) * 3 + 1
    if specials:  # NaN and Inf, and a whole chunk of NaN
        values[:700] = np.nan
        values[[900, 1800]] = [np.inf, -np.inf]
    if dtype == "bfloat16":
        raw = (values.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    else:
        raw = values.astype(dtype)
    row = _row(raw, dtype)
    assert _both(raw, row, 7, monkeypatch) == ""
    edit = dict(EDITS)[column]
    if column == "l2" and specials:  # the norm of data with NaN is NaN: not checked
        return
    row[column] = edit(row)
    sentence = _both(raw, row, 7, monkeypatch)
    assert sentence.startswith("t.h5: the index statistics of layers.0#0 output 0 (step 0)")
    assert f"({column}" in sentence or (column == "nan" and "(nan count" in sentence) or (
        column == "inf" and "(inf count" in sentence)


def _write(path, values: np.ndarray) -> None:
    with TraceWriter(path, meta={"case": "verify-kernel"}) as writer:
        site = writer.enter("layers.0", "Linear")
        writer.record(site, "output", values)
        writer.record(site, "weight", values[:4096].copy(), arg="bias")
        writer.exit(site)


def _edit_index(path, column: str, value) -> None:
    """Change one index cell and drop the table digest (as another writer's trace would)."""
    with h5py.File(path, "r+") as h5:
        del h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP)]
        cells = h5[f"{schema.INDEX_GROUP}/{column}"]
        values = cells[:]
        values[0] = value
        cells[:] = values


@pytest.mark.parametrize("column, value, named", [("max", 100.0, "max: index says 100"),
                                                  ("nan", 3, "nan count: index says 3")])
def test_a_diff_of_a_large_tensor_refuses_an_edited_statistic_through_either_path(
        tmp_path, column, value, named, monkeypatch):
    """2**20 elements: the size at which a diff loads the compiled kernel."""
    rng = np.random.default_rng(3)
    values = rng.standard_normal((1024, 1024)).astype(np.float32)
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    _write(ref, values)
    _write(port, values * np.float32(1 + 1e-7))
    _edit_index(port, column, value)
    sentences = []
    for setting in ("numpy", ""):
        monkeypatch.setenv("LAYERDIFF_STATS", setting)
        stats.compiled.cache_clear()
        with pytest.raises(TraceError) as caught:
            diff(ref, port)
        sentences.append(str(caught.value))
    stats.compiled.cache_clear()
    assert sentences[0] == sentences[1]
    assert str(port) in sentences[0] and "layers.0#0 output 0 (step 0)" in sentences[0]
    assert named in sentences[0]


def test_layerdiff_stats_numpy_keeps_the_compiled_statistics_out_of_a_diff(tmp_path):
    """The fallback users reach for when numba misbehaves: nothing compiled is loaded for
    verification, and a damaged large tensor is still refused."""
    rng = np.random.default_rng(4)
    values = rng.standard_normal(1 << 20).astype(np.float32)
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    _write(ref, values)
    _write(port, values * np.float32(1 + 1e-7))
    _edit_index(port, "min", -100.0)
    code = ("import sys, layerdiff\n"
            "try:\n    layerdiff.diff(sys.argv[1], sys.argv[2])\n"
            "except layerdiff.TraceError as e:\n    print('refused', 'min: index says' in str(e))\n"
            "print('layerdiff.trace.stats_kernel' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(ref), str(port)], check=True,
                          capture_output=True, text=True,
                          env=dict(os.environ, LAYERDIFF_STATS="numpy"))
    assert done.stdout.split() == ["refused", "True", "False"]
