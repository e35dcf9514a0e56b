"""The trace file as a contract: readable with h5py and pandas alone, refused when broken."""

from __future__ import annotations

import json
import subprocess
import sys

import h5py
import numpy as np
import pandas as pd
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff import TraceError
from layerdiff.trace import TraceWriter, open_trace, schema


def _write_small(path, **kw):
    with TraceWriter(path, meta={"case": "small"}, **kw) as w:
        with w.site("enc", "Encoder") as enc:
            w.record(enc, "input", np.arange(12, dtype=np.float32).reshape(3, 4))
            with w.site("enc.lin", "Linear") as lin:
                w.record(lin, "weight", np.eye(4, dtype=np.float64), arg="weight")
                w.record(lin, "output", np.array([1, 2, 3], dtype=np.int64))
            w.record(enc, "output", np.array([1.0, np.nan, np.inf], dtype=np.float32))
            w.record(enc, "input", {"mode": "train"}, arg="cfg")
        w.record(enc, "grad_output", np.full((2, 2), 0.5, np.float16))
    return path


def test_roundtrip_keeps_values_order_and_sites(trace_path):
    _write_small(trace_path)
    with open_trace(trace_path) as trace:
        index = trace.index
        assert list(index["site"]) == ["enc#0", "enc.lin#0", "enc.lin#0", "enc#0", "enc#0",
                                       "enc#0"]
        assert list(index["pass"]) == ["forward"] * 5 + ["backward"]
        np.testing.assert_array_equal(trace.read(0), np.arange(12, dtype=np.float32).reshape(3, 4))
        np.testing.assert_array_equal(trace.read(1), np.eye(4))
        assert trace.read(2).dtype == np.int64
        assert trace.read(5).dtype == np.float16
        value = index.iloc[4]
        assert value["kind"] == "value" and json.loads(value["value"]) == {"mode": "train"}
        with pytest.raises(TraceError, match="is a value"):
            trace.read(4)
        sites = trace.sites
        assert sites.set_index("site").loc["enc.lin#0", "parent"] == "enc#0"
        assert trace.meta["case"] == "small"


def test_find_and_records_look_records_up(trace_path):
    _write_small(trace_path)
    with open_trace(trace_path) as trace:
        row = trace.find(0, "enc.lin#0", "weight", "weight")
        np.testing.assert_array_equal(trace.read(row), np.eye(4))
        assert trace.find(0, "enc#0", "input", "cfg")["kind"] == "value"
        assert trace.find(0, "enc#0", "input", "cfg", kind="tensor") is None
        assert trace.find(0, "enc#0", "grad_output", "0", pass_="forward") is None
        assert trace.find(0, "enc#0", "grad_output", "0", pass_="backward") is not None
        assert trace.find(1, "enc#0", "input", "0") is None
        assert list(trace.records(0, "enc#0", "input")["arg"]) == ["0", "cfg"]
        assert len(trace.records(role="output", kind="tensor")) == 2


def test_zero_dimensional_arrays_keep_their_shape(trace_path):
    """A loss recorded from numpy is 0-d, as torch capture records it: the shapes must agree."""
    with TraceWriter(trace_path) as w, w.site("<loss>", "loss") as loss:
        w.record(loss, "output", np.asarray(np.float32(0.25)))
        w.record(loss, "output", np.float64(2.0), arg="1")
    with open_trace(trace_path) as trace:
        assert list(trace.index["shape"]) == ["", ""]
        assert trace.read(0).shape == () and float(trace.read(0)) == 0.25
        assert trace.read(1).shape == () and float(trace.read(1)) == 2.0


def test_statistics_count_nan_and_inf(trace_path):
    _write_small(trace_path)
    with open_trace(trace_path) as trace:
        row = trace.index.iloc[3]
        assert (row["nan"], row["inf"]) == (1, 1)
        assert row["min"] == 1.0 and row["max"] == np.inf
        first = trace.index.iloc[0]
        values = np.arange(12, dtype=np.float64)
        assert first["mean"] == pytest.approx(values.mean())
        assert first["std"] == pytest.approx(values.std(), rel=1e-6)
        assert first["l2"] == pytest.approx(np.linalg.norm(values), rel=1e-6)


def test_readable_with_h5py_and_pandas_alone(trace_path):
    """The recipe in docs/trace-format.md, without any layerdiff code."""
    _write_small(trace_path)
    with h5py.File(trace_path, "r") as f:
        assert f.attrs["layerdiff_format"] == "layerdiff-trace"
        assert f.attrs["layerdiff_version"] == 2 and f.attrs["complete"]
        index = pd.DataFrame({k: (d.asstr()[:] if d.dtype.kind == "O" else d[:])
                              for k, d in f["index"].items()})
        row = index[index["site"] == "enc#0"].iloc[0]
        data = f["tensors"][f"{row['segment']:06d}"][row["offset"]:row["offset"] + row["nbytes"]]
        tensor = data.view(row["dtype"]).reshape([int(s) for s in row["shape"].split(",")])
    np.testing.assert_array_equal(tensor, np.arange(12, dtype=np.float32).reshape(3, 4))


def test_trace_package_does_not_import_torch(tmp_path):
    code = ("import sys, numpy as np; from layerdiff.trace import TraceWriter, open_trace;"
            f"w = TraceWriter({str(tmp_path / 'x.h5')!r}); w.record('a#0', 'output', np.ones(3));"
            "w.close(); open_trace(w.path).index; assert 'torch' not in sys.modules, 'torch'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_summary_trace_has_statistics_but_no_data(trace_path, tmp_path):
    full = _write_small(tmp_path / "full.h5")
    _write_small(trace_path, summary=True)
    with open_trace(trace_path) as summary, open_trace(full) as complete:
        assert summary.summary
        assert (summary.index["segment"] == -1).all()
        cols = ["min", "max", "mean", "digest"]
        pd.testing.assert_frame_equal(summary.index[cols], complete.index[cols])
        with pytest.raises(TraceError, match="summary trace"):
            summary.read(0)


@settings(max_examples=25, deadline=None)
@given(sizes=st.lists(st.integers(min_value=0, max_value=3000), min_size=1, max_size=40),
       queue=st.sampled_from([1024, 4096, 20000]))
def test_any_sequence_of_tensors_roundtrips_through_a_small_ring(tmp_path_factory, sizes, queue):
    """Ring wrap-around, backpressure and the oversized path all keep the bytes intact."""
    path = tmp_path_factory.mktemp("ring") / "t.h5"
    rng = np.random.default_rng(len(sizes))
    arrays = [rng.standard_normal(n).astype(np.float32) for n in sizes]
    with TraceWriter(path, queue_bytes=queue) as w:
        for i, array in enumerate(arrays):
            w.record(f"m{i}#0", "output", array)
    with open_trace(path) as trace:
        assert len(trace.index) == len(arrays)
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(trace.read(i), array)


# ---- refusals: each one sentence that names the file and says what to do ----

def test_missing_file_is_refused(tmp_path):
    with pytest.raises(TraceError, match="does not exist"):
        open_trace(tmp_path / "nope.h5")


def test_not_hdf5_is_refused(tmp_path):
    path = tmp_path / "notes.h5"
    path.write_text("hello")
    with pytest.raises(TraceError, match="not an HDF5 file"):
        open_trace(path)


def test_hdf5_that_is_not_a_trace_is_refused(tmp_path):
    path = tmp_path / "other.h5"
    with h5py.File(path, "w") as f:
        f["x"] = np.ones(3)
    with pytest.raises(TraceError, match="not a layerdiff trace"):
        open_trace(path)


def test_newer_format_version_is_refused(trace_path):
    _write_small(trace_path)
    with h5py.File(trace_path, "a") as f:
        f.attrs[schema.ATTR_VERSION] = schema.FORMAT_VERSION + 1
    newer = rf"newer than the v{schema.FORMAT_VERSION} .*upgrade layerdiff"
    with pytest.raises(TraceError, match=newer):
        open_trace(trace_path)


def test_cut_off_file_is_refused(trace_path):
    _write_small(trace_path)
    data = trace_path.read_bytes()
    trace_path.write_bytes(data[: len(data) // 2])
    with pytest.raises(TraceError, match=r"cut off|damaged"), open_trace(trace_path) as trace:
        trace.index  # noqa: B018 - reading is what must fail


def test_unfinished_capture_is_refused_unless_asked(trace_path):
    writer = TraceWriter(trace_path)
    writer.record("a#0", "output", np.ones(3, np.float32))
    writer.close(complete=False)
    assert not trace_path.exists()
    partial = trace_path.with_name(trace_path.name + ".partial")
    with pytest.raises(TraceError, match="never finished"):
        open_trace(trace_path)
    with pytest.raises(TraceError, match="incomplete"):
        open_trace(partial)
    with open_trace(partial, allow_incomplete=True) as trace:
        assert not trace.complete
        np.testing.assert_array_equal(trace.read(0), np.ones(3, np.float32))


def test_exception_inside_writer_block_publishes_nothing(trace_path):
    with pytest.raises(RuntimeError), TraceWriter(trace_path) as w:
        w.record("a#0", "output", np.ones(3))
        raise RuntimeError("port crashed")
    assert not trace_path.exists()
