"""The HDF5 side of writing a trace: a partial file that is published only when complete.

One writer thread owns an instance; nothing here is thread-safe by itself.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from layerdiff.trace.lock import WriterLock
from layerdiff.trace.stats import table_digest, text_digest

_STRING = h5py.string_dtype("utf-8")
# Tables are written once per step, so compressing them costs little and keeps summary traces
# (index only) small enough to commit as CI goldens.
_CHUNK_ROWS = 1024


def _reason(exc: OSError) -> str:
    """The operating system's words for an h5py error (its message is long and technical)."""
    return os.strerror(exc.errno) if exc.errno else str(exc).split("(")[0].strip()


def _create(path: Path, partial: Path) -> h5py.File:
    try:
        return h5py.File(partial, "w")
    except OSError as exc:  # /proc, a full or read-only disk, a name the file system refuses
        raise CaptureError(f"cannot write trace {path}: creating {partial} failed "
                           f"({_reason(exc)}); choose another -o path") from exc


def partial_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{schema.PARTIAL_SUFFIX}")


class TraceFile:
    """Creates ``<path>.partial``, appends segments and table rows, renames to ``path`` at close."""

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any], summary: bool) -> None:
        self.path = Path(path)
        self.partial = partial_path(path)
        self.summary = summary
        self._segments = 0
        self._lock = WriterLock(self.path)  # before the .partial: one writer per path
        try:
            self._h5 = _create(self.path, self.partial)
            try:
                self._skeleton(meta, summary)
            except BaseException:
                self._h5.close()
                raise
        except BaseException:  # Ctrl-C or a full disk at the very start: let the path go
            self._lock.release()
            raise

    def _skeleton(self, meta: dict[str, Any], summary: bool) -> None:
        attrs = self._h5.attrs
        attrs[schema.ATTR_FORMAT] = schema.FORMAT_NAME
        attrs[schema.ATTR_VERSION] = schema.FORMAT_VERSION
        attrs[schema.ATTR_COMPLETE] = False
        attrs[schema.ATTR_SUMMARY] = summary
        self._meta = json.dumps(meta, default=str)
        attrs[schema.ATTR_META] = self._meta
        self._tables = {
            schema.INDEX_GROUP: _ColumnTable(self._h5.create_group(schema.INDEX_GROUP),
                                             schema.INDEX_COLUMNS),
            schema.SITES_GROUP: _ColumnTable(self._h5.create_group(schema.SITES_GROUP),
                                             schema.SITES_COLUMNS),
        }
        self._h5.create_group(schema.TENSORS_GROUP)
        # on disk now: a capture killed before its first step's flush leaves a .partial that
        # opens (and shows it holds nothing yet), not 96 bytes of superblock
        self._h5.flush()

    @property
    def segments(self) -> int:
        """Segments written so far: the number the next one gets."""
        return self._segments

    def write_segment(self, data: np.ndarray) -> int:
        """Store one contiguous run of packed tensor bytes; returns its segment number."""
        number = self._segments
        self._h5.create_dataset(schema.segment_name(number), data=data)
        self._segments += 1
        return number

    def append_rows(self, table: str, columns: dict[str, list]) -> None:
        self._tables[table].append(columns)

    def flush(self) -> None:
        self._h5.flush()

    def close(self, complete: bool) -> Path:
        """Close the file; publish it under its final name only when complete."""
        try:
            if complete:
                for name, table in self._tables.items():  # what a reader checks the tables by
                    self._h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=name)] = table.digest()
                self._h5.attrs[schema.ATTR_META_DIGEST] = text_digest(self._meta)
                self._h5.attrs[schema.ATTR_COMPLETE] = True
            self._h5.close()
            if not complete:
                return self.partial
            os.replace(self.partial, self.path)
            return self.path
        finally:
            self._lock.release()

    def abandon(self) -> None:
        """Close without marking complete, ignoring errors (the disk may be full)."""
        with contextlib.suppress(Exception):  # the original error is what the user needs
            self._h5.close()
        self._lock.release()


class _ColumnTable:
    """A table stored as one resizable 1-D dataset per column, so pandas reads it directly."""

    def __init__(self, group: h5py.Group, columns: dict[str, Any]) -> None:
        self.rows = 0
        self._kinds = columns
        self._datasets = {
            name: group.create_dataset(
                name, shape=(0,), maxshape=(None,), chunks=(_CHUNK_ROWS,),
                dtype=_STRING if kind == schema.STR else kind, compression="gzip",
                compression_opts=4, shuffle=kind != schema.STR)
            for name, kind in columns.items()
        }

    def digest(self) -> str:
        """The table's values as written, read back: :func:`table_digest`."""
        values = {name: (dataset.asstr()[:] if dataset.dtype == _STRING else dataset[:])
                  for name, dataset in self._datasets.items()}
        return table_digest(values, self._kinds)

    def append(self, columns: dict[str, list]) -> None:
        count = len(next(iter(columns.values())))
        if not count:
            return
        end = self.rows + count
        for name, dataset in self._datasets.items():
            dataset.resize((end,))
            values = columns[name]
            if dataset.dtype == _STRING:
                dataset[self.rows:end] = np.array(values, dtype=object)
            else:
                dataset[self.rows:end] = np.asarray(values, dtype=dataset.dtype)
        self.rows = end
