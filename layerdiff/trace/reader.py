"""Open a trace, refusing files that are missing, foreign, too new or cut off."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import h5py
import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.trace import schema
from layerdiff.trace.attributes import read_root_attributes
from layerdiff.trace.digest import LEGACY_DIGEST
from layerdiff.trace.guards import H5_ERRORS, guard_global_heaps, short
from layerdiff.trace.h5file import partial_path
from layerdiff.trace.manifest import rank_files
from layerdiff.trace.printable import make_visible
from layerdiff.trace.segments import SegmentReader, segment_dataset
from layerdiff.trace.stats import table_digest, text_digest
from layerdiff.trace.verify import check_bytes, check_index, check_sites, describe


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
        # a multi-rank capture's manifest: the rank files it names (see trace.manifest)
        self.rank_paths: list[Path] = []
        # what reading an incomplete trace dropped, cut off when its capture stopped (one
        # sentence each, for the reader to show as warnings)
        self.notes: list[str] = []
        self._h5 = _open_h5(self.path)
        try:
            self._check(allow_incomplete)
            if "manifest" in self.meta:
                self._open_rank_zero()
        except BaseException:
            self._h5.close()
            raise

    def _open_rank_zero(self) -> None:
        """A manifest reads as its rank 0 file (every record no shard rule splits is
        replicated: rank 0's copy is the one compared), once every rank file is checked."""
        manifest = self.meta["manifest"]
        self.rank_paths = rank_files(self.path, manifest)
        first = Trace(self.rank_paths[0], verify=self.verify)
        self._h5.close()
        self._h5 = first._h5
        self._table_digests = first._table_digests
        self.summary, self.version, self.complete = first.summary, first.version, first.complete
        self.meta = {**first.meta, "manifest": manifest}

    def _check(self, allow_incomplete: bool) -> None:
        guard_global_heaps(self._h5, self.path)
        attrs = read_root_attributes(self._h5, self.path)  # type-checked before read
        name = attrs.get(schema.ATTR_FORMAT)
        if not (isinstance(name, str) and name == schema.FORMAT_NAME):
            if self.path.name.endswith(schema.PARTIAL_SUFFIX) and not attrs:
                raise TraceError(_nothing_yet(self.path))
            raise TraceError(f"{self.path} is an HDF5 file but not a layerdiff trace (it has no "
                             f"{schema.ATTR_FORMAT}={schema.FORMAT_NAME!r} attribute); pass a "
                             "file written by `layerdiff capture` or layerdiff.TraceWriter")
        self._table_digests: dict[str, str | None] = {}
        for table in (schema.INDEX_GROUP, schema.SITES_GROUP):
            claimed = attrs.get(schema.ATTR_TABLE_DIGEST.format(table=table))
            if claimed is not None and not (isinstance(claimed, str)
                                            and re.fullmatch(r"[0-9a-f]{16}", claimed)):
                raise TraceError(f"{self.path}: the digest of table /{table} is not 16 hex "
                                 "digits; the file is damaged, capture it again")
            # checked with the tables when verifying (an unverified reader trusts them)
            self._table_digests[table] = claimed if self.verify else None
        version = attrs.get(schema.ATTR_VERSION)
        if not _is_int(version) or version < 1:
            raise TraceError(f"{self.path} has an invalid trace format version {version!r:.40} "
                             "(an integer from 1 is written); the file is damaged")
        self.version = int(version)
        if self.version > schema.FORMAT_VERSION:
            raise TraceError(f"{self.path} is trace format v{self.version}, newer than the "
                             f"v{schema.FORMAT_VERSION} this layerdiff reads; upgrade layerdiff")
        # exactly True: a string "false" or a NaN is truthy, and a damaged flag is no promise
        complete = attrs.get(schema.ATTR_COMPLETE, False)
        self.complete = isinstance(complete, (bool, np.bool_)) and bool(complete)
        if not self.complete and not allow_incomplete:
            raise TraceError(f"{self.path} is incomplete: the capture that wrote it did not "
                             "finish (a crash, a kill, Ctrl-C or an error in the model); capture "
                             f"again, or see what it holds with `layerdiff show {self.path} "
                             "--allow-incomplete`")
        summary = attrs.get(schema.ATTR_SUMMARY)
        if not isinstance(summary, (bool, np.bool_)):
            raise TraceError(f"{self.path}: its {schema.ATTR_SUMMARY} attribute is "
                             f"{summary!r:.40}, not true or false; the file is damaged")
        self.summary = bool(summary)
        claimed = attrs.get(schema.ATTR_META_DIGEST)
        if (self.verify and claimed is not None and isinstance(attrs.get(schema.ATTR_META), str)
                and claimed != text_digest(attrs[schema.ATTR_META])):
            raise TraceError(f"{self.path}: its meta attribute does not match the digest its "
                             "writer left: the file was damaged or edited after capture; "
                             "capture it again")
        self.meta: dict[str, Any] = schema.parse_meta(attrs.get(schema.ATTR_META), self.path)
        for group in (schema.INDEX_GROUP, schema.SITES_GROUP):
            _member(self._h5, group, h5py.Group, self.path)
        if schema.TENSORS_GROUP in self._h5 or not self.summary:
            _member(self._h5, schema.TENSORS_GROUP, h5py.Group, self.path)

    @property
    def h5(self) -> h5py.File:
        """The open HDF5 file, for readers that stream tensor data (the diff)."""
        return self._h5

    def segments(self) -> SegmentReader:
        """A reader of byte ranges of this trace's tensor segments, for readers that stream
        tensor data (the diff, the trace browser)."""
        return SegmentReader(self._h5, str(self.path), self.digest_algorithm)

    @property
    def digest_algorithm(self) -> str:
        """The definition of the index's tensor digests (trace/digest.py)."""
        return self.meta.get("tensor_digest", LEGACY_DIGEST)

    @property
    def loss_scale(self) -> float:
        return float(self.meta.get("loss_scale", 1.0))

    @cached_property
    def index(self) -> pd.DataFrame:
        """One row per stored tensor or value, in recording order (see docs/trace-format.md)."""
        index = _read_table(self._h5, schema.INDEX_GROUP, schema.INDEX_COLUMNS, self.path,
                            "seq", self._table_digests[schema.INDEX_GROUP],
                            None if self.complete else self.notes)
        if not self.complete:
            index = self._intact_rows(index)
        check_index(index, str(self.path))
        make_visible(index, ("site", "arg"))  # names reach terminals: no control characters
        if self.summary and (index["segment"] >= 0).any():
            raise TraceError(f"{self.path} says it is a summary trace (no tensor data) but its "
                             "index points into tensor segments; the file is damaged")
        if self.verify:
            self._check_segments(index)
        return index

    def _intact_rows(self, index: pd.DataFrame) -> pd.DataFrame:
        """An incomplete trace's index without the rows whose tensor data was cut off (a
        segment missing or shorter than they say): the capture stopped while writing it."""
        stored = index[(index["kind"] == "tensor") & (index["segment"] >= 0)]
        cut = np.zeros(len(index), dtype=bool)
        for segment, rows in stored.groupby("segment"):
            try:
                dataset = segment_dataset(self._h5, int(segment), str(self.path),
                                          describe(rows.iloc[0]))
                length = dataset.shape[0]
            except TraceError:
                length = -1
            ends = rows["offset"] + rows["nbytes"]
            cut[rows.index[(ends > length).to_numpy()]] = True
        if cut.any():
            self.notes.append(f"{self.path}: {int(cut.sum()):,} records whose tensor data was "
                              "cut off when the capture stopped are left out")
            index = index[~cut].reset_index(drop=True)
        return index

    def _check_segments(self, index: pd.DataFrame) -> None:
        """Every segment the index points into exists and is long enough."""
        stored = index[(index["kind"] == "tensor") & (index["segment"] >= 0)]
        if stored.empty:
            return
        ends = (stored["offset"] + stored["nbytes"]).groupby(stored["segment"]).max()
        for segment, end in zip(ends.index.tolist(), ends.tolist(), strict=True):
            try:
                dataset = segment_dataset(self._h5, segment, str(self.path))
            except TraceError:
                # refused again, naming the segment's first record: the sentence is built only
                # here (a pandas lookup and a description per segment were half the check)
                row = stored.loc[stored["segment"] == segment].iloc[0]
                segment_dataset(self._h5, segment, str(self.path), describe(row))
                raise
            if dataset.shape[0] < end:
                raise TraceError(f"{self.path}: tensor segment {int(segment)} holds "
                                 f"{dataset.shape[0]} bytes but the index puts data up to byte "
                                 f"{int(end)}; the file is damaged, capture it again")

    @property
    def index_sealed(self) -> bool:
        """Whether the index is checked against its table digest as it is read (a verifying
        reader of a trace whose writer sealed it): its rows are then the writer's own."""
        return self._table_digests.get(schema.INDEX_GROUP) is not None

    @cached_property
    def sites(self) -> pd.DataFrame:
        """One row per module call per step, in call order."""
        sites = _read_table(self._h5, schema.SITES_GROUP, schema.SITES_COLUMNS, self.path,
                            "enter_seq", self._table_digests[schema.SITES_GROUP],
                            None if self.complete else self.notes)
        check_sites(sites, str(self.path))
        make_visible(sites, ("site", "module", "type", "parent"))
        return sites

    # Read-only mapping access, as h5py's Group is a Mapping: trace[site] -> that site's
    # records (every step), in recording order. Length and truthiness are not defined here, so
    # an opened trace is never falsy whatever it holds.
    def __getitem__(self, site: str) -> pd.DataFrame:
        rows = self.records(site=site)
        if rows.empty:
            raise KeyError(f"{self.path} records no site {site!r} (its sites: "
                           f"{', '.join(self.sites['site'].unique()[:3])}, ...)")
        return rows

    def __contains__(self, site: object) -> bool:
        return bool((self.index["site"] == site).any())

    def __iter__(self) -> Iterator[str]:
        """Every site that holds records, once, in the order they were first recorded."""
        return iter(self.index["site"].drop_duplicates().tolist())

    def keys(self) -> list[str]:
        return list(self)

    def items(self) -> Iterator[tuple[str, pd.DataFrame]]:
        for site, rows in self.index.groupby("site", sort=False):
            yield str(site), rows

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

    def read(self, row: pd.Series | int, *, raw: bool = False,
             compared: bool = False) -> np.ndarray:
        """The tensor of one index row (a row, or its position in ``index``).

        bfloat16 comes back as float32 unless ``raw``, which gives the stored bits.
        ``compared`` says the caller compares the values element by element, so no verdict of
        its rests on the index's statistics: a record that a sealed index and a digest vouch
        for is then checked by its digest alone, as the diff checks the records it compares
        (recomputing a large record's statistics loads numba's statistics kernel, ~0.4 s).
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
        dataset = segment_dataset(self._h5, int(row["segment"]), str(self.path), describe(row))
        start, nbytes = int(row["offset"]), int(row["nbytes"])
        if start + nbytes > dataset.shape[0]:
            raise TraceError(f"{self.path}: the index puts {describe(row)} at bytes {start}.."
                             f"{start + nbytes} of tensor segment {int(row['segment'])}, which "
                             f"holds {dataset.shape[0]}; the file is damaged, capture it again")
        try:
            data = dataset[start:start + nbytes]
        except (OSError, RuntimeError, ValueError) as exc:
            raise TraceError(f"{self.path}: tensor data of {describe(row)} cannot be read "
                             f"({short(exc)}); the file is damaged") from exc
        if self.verify:
            vouched = compared and self.index_sealed and bool(row["digest"])
            check_bytes(data, row, str(self.path), statistics=not vouched,
                        algorithm=self.digest_algorithm)
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
                             "left when it stopped early; capture again, or see what it holds "
                             f"with `layerdiff show {partial} --allow-incomplete`")
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
    except H5_ERRORS as exc:
        if path.name.endswith(schema.PARTIAL_SUFFIX):
            raise TraceError(empty_partial) from exc
        if "truncated" in str(exc).lower():
            raise TraceError(f"{path} is cut off: the file is shorter than its own header says "
                             "(an interrupted copy or write); capture or copy it again") from exc
        raise TraceError(f"{path} cannot be opened as HDF5 ({short(exc)}); the file is "
                         "damaged, capture or copy it again") from exc


def _rows_written(data: dict[str, Any], table: str, path: Path,
                  cut: list[str]) -> dict[str, Any]:
    """The rows of a table cut mid-append that every column holds and that were written (an
    appended row always names its site; a row made room for but never written is empty)."""
    length = min(len(values) for values in data.values())
    written = np.asarray(data["site"][:length]) != ""
    left = max(len(values) for values in data.values()) - int(written.sum())
    if left:
        cut.append(f"{path}: {left:,} rows of table /{table} that the capture was writing "
                   "when it stopped are left out")
    return {name: np.asarray(values)[:length][written] for name, values in data.items()}


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _member(parent: h5py.Group, name: str, kind: type, path: Path) -> Any:
    """``parent[name]`` when it is a plain member of this file of the right kind: external
    links, soft links, external storage and virtual datasets read other files (or loop), and
    no writer makes them, so they are refused before anything is read through them."""
    where = f"{parent.name.rstrip('/')}/{name}"
    what = "table" if kind is h5py.Group else "dataset"
    try:
        link = parent.get(name, getlink=True)
        if link is None:
            raise TraceError(f"{path} has no {where} {what}: it is damaged or was not written "
                             "by a layerdiff trace writer; capture it again")
        if not isinstance(link, h5py.HardLink):
            raise TraceError(f"{path}: {where} is a {type(link).__name__}, which a trace never "
                             "holds (it would read another file); refused, capture it again")
        item = parent[name]
        if not isinstance(item, kind):
            raise TraceError(f"{path}: {where} is not a {what}; the file is damaged, capture "
                             "it again")
        if isinstance(item, h5py.Dataset) and (item.external or item.is_virtual):
            raise TraceError(f"{path}: {where} keeps its data in other files (HDF5 "
                             f"{'virtual dataset' if item.is_virtual else 'external storage'}),"
                             " which a trace never does; refused, capture it again")
    except H5_ERRORS as exc:
        raise TraceError(f"{path}: {where} cannot be read ({short(exc)}); the file is "
                         "damaged, capture it again") from exc
    return item


# A table's column cannot hold more rows than this many per byte of file: the best gzip ratio
# is about 1,000 to 1 and the narrowest column has 4-byte rows.
_ROWS_PER_FILE_BYTE = 300


def _read_table(h5: h5py.File, group_name: str, columns: dict[str, Any], path: Path,
                order: str, claimed: str | None, cut: list[str] | None = None) -> pd.DataFrame:
    """The table's columns, checked for type and length, and against ``claimed`` (the digest
    its writer left) when there is one. ``cut`` (an incomplete trace's notes) reads a table
    its writer stopped in the middle of appending to: the rows every column holds, written
    (site not empty), are kept, and what was left out is noted in ``cut``."""
    group = _member(h5, group_name, h5py.Group, path)
    limit = max(path.stat().st_size, 1) * _ROWS_PER_FILE_BYTE
    data: dict[str, Any] = {}
    length = None
    for name, kind in columns.items():
        dataset = _member(group, name, h5py.Dataset, path)
        where = f"/{group_name}/{name}"
        try:
            wanted = ("O" if kind == schema.STR else kind.kind)
            actual = dataset.dtype.kind
            fits = (h5py.check_string_dtype(dataset.dtype) is not None if wanted == "O"
                    else actual == wanted or (wanted == "i" and actual == "u"))
            if not fits or dataset.ndim != 1:
                raise TraceError(f"{path}: column {where} holds {dataset.dtype} of shape "
                                 f"{dataset.shape}, not the 1-D {kind} column of the format; "
                                 "the file is damaged, capture it again")
            if length is None:
                length = dataset.shape[0]
                if length > limit:
                    raise TraceError(f"{path}: table /{group_name} claims {length:,} rows, "
                                     "more than the file could hold; the file is damaged")
            elif dataset.shape[0] != length and cut is not None:
                length = min(length, dataset.shape[0])
            elif dataset.shape[0] != length:
                raise TraceError(f"{path}: column {where} has {dataset.shape[0]} rows where "
                                 f"the table's other columns have {length}; the file is "
                                 "damaged or cut off, capture it again")
            values = dataset.asstr()[:] if wanted == "O" else dataset[:]
            if wanted != "O" and values.dtype != kind:
                if wanted in "iu" and len(values) and (
                        values.max() > np.iinfo(kind).max or values.min() < np.iinfo(kind).min):
                    raise TraceError(f"{path}: column {where} holds values beyond {kind}; the "
                                     "file is damaged, capture it again")
                values = values.astype(kind)
            data[name] = values
        except TraceError:
            raise
        except MemoryError as exc:
            raise TraceError(f"{path}: column {where} is too large to read into memory; the "
                             "file is damaged or not a trace") from exc
        except H5_ERRORS as exc:
            raise TraceError(f"{path}: column {where} cannot be read ({short(exc)}); the file "
                             "is damaged or cut off; capture it again") from exc
    if cut is not None:
        data = _rows_written(data, group_name, path, cut)
    if claimed is not None and table_digest(data, columns) != claimed:
        raise TraceError(f"{path}: table /{group_name} does not match the digest its writer "
                         "left: the file was damaged or edited after capture; capture it again")
    frame = pd.DataFrame(data)
    return frame.sort_values(order, kind="stable", ignore_index=True)
