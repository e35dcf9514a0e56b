"""Open a trace, refusing files that are missing, foreign, too new or cut off."""

from __future__ import annotations

import json
import math
import os
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.trace import schema
from layerdiff.trace.h5file import partial_path
from layerdiff.trace.verify import check_bytes, describe


class Trace:
    """A trace opened for reading. Tables are pandas DataFrames read once, on first use.

    With ``verify`` (the default) every tensor read is checked against its index row (digest
    and statistics, :mod:`layerdiff.trace.verify`) and every segment the index names must
    exist; a damaged or edited file raises :class:`TraceError` instead of giving numbers.
    """

    def __init__(self, path: str | os.PathLike, *, allow_incomplete: bool = False,
                 verify: bool = True) -> None:
        self.path = Path(path)
        self.verify = verify
        self._h5 = _open_h5(self.path)
        try:
            self._check(allow_incomplete)
        except BaseException:
            self._h5.close()
            raise

    def _check(self, allow_incomplete: bool) -> None:
        attrs = self._h5.attrs
        if attrs.get(schema.ATTR_FORMAT) != schema.FORMAT_NAME:
            if self.path.name.endswith(schema.PARTIAL_SUFFIX) and not len(attrs):
                raise TraceError(_nothing_yet(self.path))
            raise TraceError(f"{self.path} is an HDF5 file but not a layerdiff trace (it has no "
                             f"{schema.ATTR_FORMAT}={schema.FORMAT_NAME!r} attribute); pass a "
                             "file written by `layerdiff capture` or layerdiff.TraceWriter")
        self.version = int(attrs.get(schema.ATTR_VERSION, 0))
        if self.version > schema.FORMAT_VERSION:
            raise TraceError(f"{self.path} is trace format v{self.version}, newer than the "
                             f"v{schema.FORMAT_VERSION} this layerdiff reads; upgrade layerdiff")
        if self.version < 1:
            raise TraceError(f"{self.path} has an invalid trace format version {self.version}")
        # exactly True: a string "false" or a NaN is truthy, and a damaged flag is no promise
        complete = attrs.get(schema.ATTR_COMPLETE, False)
        self.complete = isinstance(complete, (bool, np.bool_)) and bool(complete)
        if not self.complete and not allow_incomplete:
            raise TraceError(f"{self.path} is incomplete: the capture that wrote it did not "
                             "finish (crash, kill, full disk or an error in the model); capture "
                             "again, or open it with --allow-incomplete to see what it holds")
        self.summary = bool(attrs.get(schema.ATTR_SUMMARY, False))
        try:
            self.meta: dict[str, Any] = json.loads(attrs.get(schema.ATTR_META, "{}"))
        except json.JSONDecodeError as exc:
            raise TraceError(f"{self.path}: the meta attribute is not valid JSON ({exc})") from exc
        if not isinstance(self.meta, dict):
            raise TraceError(f"{self.path}: the meta attribute is not a JSON object; the file is "
                             "damaged, capture it again")
        scale = self.meta.get("loss_scale", 1.0)
        if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
            raise TraceError(f"{self.path}: its loss scale {scale!r} is not a finite positive "
                             "number; the file is damaged, capture it again")
        for group in (schema.INDEX_GROUP, schema.SITES_GROUP):
            if group not in self._h5:
                raise TraceError(f"{self.path} has no /{group} table: it is damaged or was not "
                                 "written by a layerdiff trace writer; capture it again")

    @property
    def h5(self) -> h5py.File:
        """The open HDF5 file, for readers that stream tensor data (the diff)."""
        return self._h5

    @property
    def loss_scale(self) -> float:
        return float(self.meta.get("loss_scale", 1.0))

    @cached_property
    def index(self) -> pd.DataFrame:
        """One row per stored tensor or value, in recording order (see docs/trace-format.md)."""
        index = _read_table(self._h5[schema.INDEX_GROUP], schema.INDEX_COLUMNS, self.path,
                            "seq")
        if self.verify:
            self._check_segments(index)
        return index

    def _check_segments(self, index: pd.DataFrame) -> None:
        """Every segment the index points into exists and is long enough."""
        stored = index[(index["kind"] == "tensor") & (index["segment"] >= 0)]
        if stored.empty:
            return
        ends = (stored["offset"] + stored["nbytes"]).groupby(stored["segment"]).max()
        for segment, end in ends.items():
            dataset = self._h5.get(schema.segment_name(int(segment)))
            if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1:
                row = stored[stored["segment"] == segment].iloc[0]
                raise TraceError(f"{self.path}: the index puts {describe(row)} in tensor "
                                 f"segment {int(segment)}, which the file lacks; the file is "
                                 "damaged, capture it again")
            if dataset.shape[0] < end:
                raise TraceError(f"{self.path}: tensor segment {int(segment)} holds "
                                 f"{dataset.shape[0]} bytes but the index puts data up to byte "
                                 f"{int(end)}; the file is damaged, capture it again")

    @cached_property
    def sites(self) -> pd.DataFrame:
        """One row per module call per step, in call order."""
        return _read_table(self._h5[schema.SITES_GROUP], schema.SITES_COLUMNS, self.path,
                           "enter_seq")

    def records(self, step: int | None = None, site: str | None = None,
                role: str | None = None, *, pass_: str | None = None,
                kind: str | None = None) -> pd.DataFrame:
        """The index rows that match every filter given, in recording order."""
        index = self.index
        keep = np.ones(len(index), dtype=bool)
        for column, wanted in (("step", step), ("site", site), ("role", role),
                               ("pass", pass_), ("kind", kind)):
            if wanted is not None:
                keep &= (index[column] == wanted).to_numpy()
        return index[keep]

    def find(self, step: int, site: str, role: str, arg: str, *, pass_: str | None = None,
             kind: str | None = None) -> pd.Series | None:
        """The index row of one record (the first, should a site record an argument twice),
        or None when the trace holds no such record. ``pass_`` and ``kind`` narrow it."""
        rows = self.records(step, site, role, pass_=pass_, kind=kind)
        rows = rows[rows["arg"] == arg]
        return None if rows.empty else rows.iloc[0]

    def read(self, row: pd.Series | int, *, raw: bool = False) -> np.ndarray:
        """The tensor of one index row (a row, or its position in ``index``).

        bfloat16 comes back as float32 unless ``raw``, which gives the stored bits.
        """
        if not isinstance(row, pd.Series):
            row = self.index.iloc[row]
        if row["kind"] != "tensor":
            raise TraceError(f"{self.path}: {row['site']} {row['role']} {row['arg']} is a "
                             "value, not a tensor; its value is in the index 'value' column")
        if row["segment"] < 0:
            raise TraceError(
                f"{self.path} stores no data for {row['site']} {row['role']} {row['arg']}"
                + (": it is a summary trace (statistics only); capture without --summary to "
                   "keep tensors" if self.summary else ""))
        name = schema.segment_name(int(row["segment"]))
        start = int(row["offset"])
        try:
            data = self._h5[name][start:start + int(row["nbytes"])]
        except (KeyError, OSError) as exc:
            raise TraceError(f"{self.path}: tensor data of {row['site']} {row['role']} "
                             f"{row['arg']} cannot be read ({exc}); the file is damaged") from exc
        if self.verify:
            check_bytes(data, row, str(self.path))
        array = data.view(schema.numpy_dtype(row["dtype"]))
        array = array.reshape(schema.parse_shape(row["shape"]))
        if row["dtype"] == "bfloat16" and not raw:
            return schema.bfloat16_to_float32(array)
        return array

    def close(self) -> None:
        self._h5.close()

    def __enter__(self) -> Trace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def open_trace(path: str | os.PathLike, *, allow_incomplete: bool = False,
               verify: bool = True) -> Trace:
    """Open a trace for reading; see :class:`Trace`."""
    return Trace(path, allow_incomplete=allow_incomplete, verify=verify)


def _nothing_yet(path: Path) -> str:
    return (f"{path} holds nothing yet: the capture that was writing it stopped (killed or "
            "crashed) before it wrote its first records; capture again")


def _open_h5(path: Path) -> h5py.File:
    if not path.exists():
        partial = partial_path(path)
        if partial.exists():
            raise TraceError(f"trace {path} was never finished: {partial} is what a capture "
                             "left when it stopped early; capture again, or open the .partial "
                             "file with --allow-incomplete to see what it holds")
        raise TraceError(f"trace {path} does not exist; check the path")
    if path.is_dir():
        raise TraceError(f"{path} is a directory, not a trace file")
    empty_partial = _nothing_yet(path)
    if not h5py.is_hdf5(path):
        if path.name.endswith(schema.PARTIAL_SUFFIX):
            raise TraceError(empty_partial)
        raise TraceError(f"{path} is not an HDF5 file, so not a layerdiff trace")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        if path.name.endswith(schema.PARTIAL_SUFFIX):
            raise TraceError(empty_partial) from exc
        if "truncated" in str(exc).lower():
            raise TraceError(f"{path} is cut off: the file is shorter than its own header says "
                             "(an interrupted copy or write); capture or copy it again") from exc
        raise TraceError(f"{path} cannot be opened as HDF5 ({exc})") from exc


def _read_table(group: h5py.Group, columns: dict[str, Any], path: Path,
                order: str) -> pd.DataFrame:
    data = {}
    try:
        for name in columns:
            dataset = group[name]
            data[name] = dataset.asstr()[:] if dataset.dtype.kind == "O" else dataset[:]
    except (KeyError, OSError) as exc:
        raise TraceError(f"{path}: table /{group.name.strip('/')} cannot be read ({exc}); "
                         "the file is damaged or cut off; capture it again") from exc
    frame = pd.DataFrame(data)
    return frame.sort_values(order, kind="stable", ignore_index=True)
