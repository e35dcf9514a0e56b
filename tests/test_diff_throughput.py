"""What the faster diff path (issue 15) must keep: the same rows, whatever the traces hold.

The diff reads plain segments with ``os.preadv`` on HDF5's own file descriptor (not h5py),
widens bfloat16 chunks into reused buffers, checks what it reads with the compiled statistics
and screens the metric kernel's divisions. None of that may change a row: each test here
compares a diff's rows with what the plain way gives (``Trace.read`` of whole tensors through
h5py, metrics in float64 numpy), on traces of its own making: large tensors with small ones
between them, a segment another HDF5 writer stored chunked and compressed, bfloat16.
"""

from __future__ import annotations

import h5py
import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, TraceError, TraceWriter, capture, diff, open_trace
from layerdiff.trace import schema

RTOL, ATOL = 1.3e-6, 1e-5  # float32 defaults


def _write(path, scale: float, seed: int = 0) -> None:
    """Three layers: a weight of 2**20 elements (so the compiled kernels load), a bias of a
    few KiB lying between large tensors, activations with a batch axis; the port's values
    are the reference's times (1 + scale * noise), one layer with a NaN on both sides."""
    rng = np.random.default_rng(seed)
    noise = np.random.default_rng(99)
    with TraceWriter(path, meta={"case": "throughput"}) as writer:
        for layer in range(3):
            site = writer.enter(f"layers.{layer}", "Linear")
            for role, arg, shape in (("weight", "weight", (1024, 1024)),
                                     ("weight", "bias", (1024,)),
                                     ("output", "0", (8, 3000 + layer))):
                values = rng.standard_normal(shape).astype(np.float32)
                values *= np.float32(1) + np.float32(scale) * noise.standard_normal(
                    shape).astype(np.float32)
                if layer == 1 and role == "output":
                    values[2, 7] = np.nan
                writer.record(site, role, values, arg=arg)
            writer.exit(site)


def _plain_rows(ref_path, port_path) -> dict:
    """max_abs, out count and worst flat index per record, from whole tensors read by h5py."""
    rows = {}
    with open_trace(ref_path) as ref, open_trace(port_path) as port:
        for (_, r), (_, p) in zip(ref.index.iterrows(), port.index.iterrows(), strict=True):
            a = ref.read(r).astype(np.float64).ravel()
            b = port.read(p).astype(np.float64).ravel()
            with np.errstate(invalid="ignore"):
                d = np.abs(a - b)
            d[np.isnan(a) & np.isnan(b)] = 0.0
            ratio = d / (ATOL + RTOL * np.abs(a))
            ratio[d == 0] = 0.0
            rows[(r["site"], r["role"], r["arg"])] = (float(d.max()),
                                                      int(np.count_nonzero(ratio > 1.0)))
    return rows


def _check_rows(rows, plain) -> None:
    tensors = rows[rows["numel"] > 0]
    assert len(tensors) == len(plain)
    for row in tensors.itertuples(index=False):
        max_abs, out = plain[(row.site, row.role, row.arg)]
        assert row.max_abs == max_abs, row.site
        assert round(row.frac_out * row.numel) == out, row.site


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    folder = tmp_path_factory.mktemp("throughput")
    ref, port = folder / "ref.h5", folder / "port.h5"
    _write(ref, 0.0)
    _write(port, 3e-6)
    return ref, port


def test_a_diff_gives_the_rows_whole_h5py_reads_give(pair):
    ref, port = pair
    rows = diff(ref, port).rows
    _check_rows(rows, _plain_rows(ref, port))
    assert set(rows["verdict"]) >= {"out"}


def test_the_numpy_paths_give_the_same_rows(pair, monkeypatch):
    """LAYERDIFF_NUMPY_METRICS and LAYERDIFF_STATS=numpy: the reference paths, same rows."""
    ref, port = pair
    fast = diff(ref, port).rows
    monkeypatch.setenv("LAYERDIFF_NUMPY_METRICS", "1")
    monkeypatch.setenv("LAYERDIFF_STATS", "numpy")
    from layerdiff.trace import stats
    stats.compiled.cache_clear()
    try:
        slow = diff(ref, port).rows
    finally:
        stats.compiled.cache_clear()
    exact = ["max_abs", "max_rel", "ratio", "max_ulp", "frac_out", "worst_index", "ref_nan",
             "port_nan", "verdict"]
    assert fast[exact].equals(slow[exact])
    for column in ("mean_abs", "rms"):
        np.testing.assert_allclose(fast[column], slow[column], rtol=1e-12)
    np.testing.assert_allclose(fast["cosine"], slow["cosine"], rtol=0, atol=1e-12)
    for a, b in zip(fast["batch_ratio"], slow["batch_ratio"], strict=True):
        assert (a is None and b is None) or np.array_equal(a, b)


def _rechunk(path, segment: int) -> None:
    """Store a segment chunked and gzip-compressed, as another HDF5 writer may: its bytes no
    longer lie in the file as they are, so the diff must read it through h5py."""
    with h5py.File(path, "r+") as h5:
        name = schema.segment_name(segment)
        data = h5[name][:]
        del h5[name]
        h5.create_dataset(name, data=data, chunks=(1 << 16,), compression="gzip",
                          compression_opts=1)


def test_a_chunked_compressed_segment_is_read_through_h5py(pair, tmp_path):
    ref, port = pair
    copy = tmp_path / "port.h5"
    copy.write_bytes(port.read_bytes())
    with open_trace(copy) as trace:
        segments = sorted(set(trace.index["segment"]) - {-1})
    _rechunk(copy, segments[0])
    rows = diff(ref, copy).rows
    _check_rows(rows, _plain_rows(ref, copy))


def test_a_flipped_byte_in_a_chunked_segment_is_still_refused(pair, tmp_path):
    ref, port = pair
    copy = tmp_path / "port.h5"
    copy.write_bytes(port.read_bytes())
    with open_trace(copy) as trace:
        row = trace.index[trace.index["segment"] >= 0].iloc[0]
    _rechunk(copy, int(row["segment"]))
    with h5py.File(copy, "r+") as h5:
        data = h5[schema.segment_name(int(row["segment"]))]
        at = int(row["offset"]) + 1000
        data[at] = data[at] ^ 0x10
    with pytest.raises(TraceError, match="does not match its digest"):
        diff(ref, copy)


class _Wide(nn.Module):
    """A model of my own with wide layers: 2**20-element weights in bfloat16."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(1024, 1024)
        self.fc2 = nn.Linear(1024, 64)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _wide_case(shift: float) -> Case:
    torch.manual_seed(0)
    model = _Wide()
    with torch.no_grad():
        model.fc1.weight.mul_(1 + shift)
    x = torch.randn(16, 1024)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                steps=1, name="tests.test_diff_throughput:wide")


def test_a_bfloat16_diff_gives_the_rows_of_whole_reads(tmp_path):
    """bfloat16 chunks are widened into reused buffers: the same float32 values as
    Trace.read's widening, so the same maxima."""
    ref = capture(_wide_case(0.0), tmp_path / "ref.h5", dtype="bfloat16")
    port = capture(_wide_case(1e-2), tmp_path / "port.h5", dtype="bfloat16")
    rows = diff(ref, port).rows
    assert set(rows.loc[rows["numel"] > 0, "dtype"]) == {"bfloat16"}
    with open_trace(ref) as r, open_trace(port) as p:
        for row in rows[rows["numel"] > 0].itertuples(index=False):
            pick = (r.index["site"] == row.site) & (r.index["role"] == row.role) & (
                r.index["arg"] == row.arg) & (r.index["step"] == row.step)
            pick_port = (p.index["site"] == row.port_site) & (p.index["role"] == row.role) & (
                p.index["arg"] == row.port_arg) & (p.index["step"] == row.step)
            a = r.read(r.index[pick].iloc[0]).astype(np.float64)
            b = p.read(p.index[pick_port].iloc[0]).astype(np.float64)
            assert row.max_abs == float(np.abs(a - b).max()), (row.site, row.role)


def _flip(path, site: str, arg: str, at: int) -> None:
    with open_trace(path) as trace:
        index = trace.index
        row = index[(index["site"] == site) & (index["arg"] == arg)].iloc[0]
    with h5py.File(path, "r+") as h5:
        data = h5[schema.segment_name(int(row["segment"]))]
        position = int(row["offset"]) + at
        data[position] = data[position] ^ 0x04


@pytest.mark.parametrize("damaged, named", [
    ({"ref": ("layers.1#0", "weight")}, "ref"),
    ({"port": ("layers.1#0", "weight")}, "port"),
    ({"ref": ("layers.1#0", "weight"), "port": ("layers.1#0", "weight")}, "ref"),
    ({"ref": ("layers.2#0", "weight"), "port": ("layers.0#0", "weight")}, "port"),
])
def test_the_first_damaged_record_is_named_and_in_it_the_reference(pair, tmp_path, damaged,
                                                                   named):
    """Both sides are checked chunk by chunk ahead of the metrics: the sentence names the
    first record in diff order that is damaged, and the reference when both sides of it
    are."""
    paths = {}
    for side, original in zip(("ref", "port"), pair, strict=True):
        paths[side] = tmp_path / f"{side}.h5"
        paths[side].write_bytes(original.read_bytes())
        if side in damaged:
            _flip(paths[side], *damaged[side], at=3_000_001)  # in the weight's third MiB
    with pytest.raises(TraceError, match="does not match its digest") as caught:
        diff(paths["ref"], paths["port"])
    message = str(caught.value)
    assert message.startswith(f"{paths[named]}:")
    site = damaged[named][0]
    assert f"{site} weight weight" in message


# ------------------------------------------------------------------------- mapped bytes

def _all_columns_equal(a, b) -> None:
    assert list(a.columns) == list(b.columns)
    for column in a.columns:
        for x, y in zip(a[column], b[column], strict=True):
            if isinstance(x, np.ndarray) or isinstance(y, np.ndarray):
                assert np.array_equal(x, y), column
            else:
                assert x == y or (x != x and y != y), (column, x, y)


def test_mapped_windows_and_plain_reads_give_the_same_rows(pair, monkeypatch):
    """The diff maps plain segments in windows of several chunks; with windows of one and of
    two chunks, and with nothing mapped (every byte read by preadv), every column of every
    row is the same."""
    from layerdiff.compare import reading
    from layerdiff.trace import direct
    ref, port = pair
    mapped = diff(ref, port).rows
    for window in (1, 2):
        monkeypatch.setattr(reading, "WINDOW_CHUNKS", window)
        _all_columns_equal(mapped, diff(ref, port).rows)
    monkeypatch.setattr(direct.DirectReader, "mapped", lambda *args: None)
    _all_columns_equal(mapped, diff(ref, port).rows)


def test_a_mapped_range_is_the_bytes_a_read_gives_and_out_of_range_is_not_mapped(pair):
    from layerdiff.trace.direct import DirectReader
    with open_trace(pair[0]) as trace:
        row = trace.index[trace.index["numel"] == 1 << 20].iloc[0]
        reader = DirectReader(trace.segments())
        segment, offset = int(row["segment"]), int(row["offset"])
        view = reader.mapped(segment, offset + 4096, 3 << 20)
        read = np.empty(3 << 20, np.uint8)
        reader.read(segment, offset + 4096, 3 << 20, read)
        assert view is not None and np.array_equal(view, read)
        size = trace.h5[schema.segment_name(segment)].shape[0]
        assert reader.mapped(segment, size - 8, 16) is None  # past the segment
        assert reader.mapped(segment, offset + 4, 64) is None  # not 8-byte aligned
        assert reader.mapped(segment, -8, 16) is None


# ------------------------------------------------------------ what the check rests on

def _edit_and_reseal(path, column: str, value) -> None:
    """Edit one index cell and write the table digest anew, as a writer would have: the
    index is sealed, and only the record's own bytes can tell the cell is wrong."""
    from layerdiff.trace.stats import table_digest
    with h5py.File(path, "r+") as h5:
        group = h5[schema.INDEX_GROUP]
        cells = group[column][:]
        cells[0] = value
        group[column][:] = cells
        data = {name: (group[name].asstr()[:] if group[name].dtype.kind == "O"
                       else group[name][:].astype(kind))
                for name, kind in schema.INDEX_COLUMNS.items()}
        h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP)] = table_digest(
            data, schema.INDEX_COLUMNS)


def test_a_compared_record_of_a_sealed_index_is_checked_by_its_digest_alone(pair, tmp_path):
    """A sealed index and a digest vouch for a record's statistics; when the diff compares
    the record element by element no verdict rests on them, so they are not recomputed (a
    third of a diff's CPU). Reading the record on its own still checks them."""
    ref, port = pair
    copy = tmp_path / "port.h5"
    copy.write_bytes(port.read_bytes())
    _edit_and_reseal(copy, "max", 100.0)
    with open_trace(copy) as trace:
        assert trace.index_sealed
        first = trace.index.iloc[0]
        with pytest.raises(TraceError, match="max: index says 100"):
            trace.read(first)
    rows = diff(ref, copy).rows
    _check_rows(rows, _plain_rows(ref, port))


def test_a_read_for_an_element_wise_comparison_is_checked_by_its_digest_alone(pair, tmp_path):
    """What the hints read of an origin (compared=True) is checked as the diff checks what it
    compares: a digest under a sealed index, no statistics recomputed (at 2**20 elements and
    more that loaded numba's statistics kernel, ~0.4 s). Flipped bits are still refused."""
    _, port = pair
    copy = tmp_path / "port.h5"
    copy.write_bytes(port.read_bytes())
    _edit_and_reseal(copy, "max", 100.0)
    with open_trace(copy) as trace:
        first = trace.index.iloc[0]
        assert trace.read(first, compared=True).size == int(first["numel"])
        with pytest.raises(TraceError, match="max: index says 100"):
            trace.read(first)
    with h5py.File(copy, "r+") as h5:  # the bytes themselves damaged: the digest refuses
        segment = h5[schema.segment_name(int(first["segment"]))]
        segment[int(first["offset"])] ^= 0xFF
    with open_trace(copy) as trace, pytest.raises(TraceError, match="digest"):
        trace.read(trace.index.iloc[0], compared=True)


def test_a_record_decided_from_the_index_is_still_checked_against_its_statistics(pair,
                                                                                tmp_path):
    """A port identical to the reference is decided by equal digests, its data read only to
    be checked: digest and statistics both, sealed index or not."""
    ref, _ = pair
    copy = tmp_path / "copy.h5"
    copy.write_bytes(ref.read_bytes())
    _edit_and_reseal(copy, "max", 100.0)
    with pytest.raises(TraceError, match="max: index says 100"):
        diff(ref, copy)
