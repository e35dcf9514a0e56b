"""The HDF5 side of writing a trace: a partial file that is published only when complete.

One writer thread owns an instance; nothing here is thread-safe by itself.

A write that fails (a full disk, a file size limit) ends the file: libhdf5 keeps the failed
metadata in its cache and retries it at every later flush and close, and after some failures
that crashes the process (a segmentation fault at exit). So once a write failed the file's
descriptor is pointed at the null device (libhdf5 can then close without touching the disk),
the ``.partial`` is removed and the error is one sentence for the user.
"""

from __future__ import annotations

import contextlib
import errno as errnos
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from layerdiff.trace.lock import WriterLock, remove_stale
from layerdiff.trace.signals import FileSizeSignalIgnored, interrupts_deferred
from layerdiff.trace.stats import table_digest, text_digest

_STRING = h5py.string_dtype("utf-8")
# Tables are written once per step, so compressing them costs little and keeps summary traces
# (index only) small enough to commit as CI goldens.
_CHUNK_ROWS = 1024
# what the system's words for a write error mean for someone capturing a trace
_HINTS = {errnos.ENOSPC: "the disk is full", errnos.EFBIG: "a file size limit (ulimit -f) was "
          "reached", errnos.EROFS: "the file system is read-only",
          errnos.EDQUOT: "the disk quota is used up"}


def _reason(exc: BaseException) -> str:
    """The operating system's words for an h5py error (its message is long and technical:
    libhdf5 names the errno inside it when the error did not come with one)."""
    number = getattr(exc, "errno", None)
    if not number:
        found = re.search(r"errno = (\d+)", str(exc))
        number = int(found.group(1)) if found else None
    if number:
        hint = _HINTS.get(number)
        return f"{os.strerror(number)}: {hint}" if hint else os.strerror(number)
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text.split("(")[0].strip()[:120]


def _create(path: Path, partial: Path) -> h5py.File:
    """A new, empty ``.partial``, created (never opened: ``x`` mode is O_CREAT|O_EXCL, which
    refuses a symbolic link as any existing name) after removing what a stopped capture
    left. Called under the writer lock, so what is at that name is no live writer's."""
    remove_stale(partial, f"cannot write trace {path}")
    try:
        return h5py.File(partial, "x")
    except FileExistsError as exc:  # planted between the removal and the creation
        raise CaptureError(f"cannot write trace {path}: {partial} appeared while it was being "
                           "created (another program is writing there); choose another -o "
                           "path") from exc
    except OSError as exc:  # /proc, a full or read-only disk, a name the file system refuses
        raise CaptureError(f"cannot write trace {path}: creating {partial} failed "
                           f"({_reason(exc)}); choose another -o path") from exc


def partial_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}{schema.PARTIAL_SUFFIX}")


class TraceFile:
    """Creates ``<path>.partial``, appends segments and table rows, renames to ``path`` at close.

    Every write that fails raises :class:`CaptureError` (one sentence: the file, the system's
    reason, what to do); the file is then dead: later writes raise the same, ``abandon`` and
    ``close`` remove the ``.partial``.
    """

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any], summary: bool) -> None:
        self.path = Path(path)
        self.partial = partial_path(path)
        self.summary = summary
        self.failure: BaseException | None = None  # the first write that failed
        self._segments = 0
        self._h5: h5py.File | None = None
        self._descriptor: tuple[int, os.stat_result] | None = None
        self._lock = WriterLock(self.path)  # before the .partial: one writer per path
        self._signals = FileSizeSignalIgnored()
        # A Ctrl-C while h5py converts an attribute is swallowed there and surfaces as a
        # TypeError ("Operation not defined for data type class"): hold it until the skeleton
        # is written, then raise it as itself.
        with interrupts_deferred(lambda: None) as interrupt:
            try:
                self._h5 = _create(self.path, self.partial)
                self._descriptor = _descriptor(self._h5)
                with self._writing():
                    self._skeleton(meta, summary)
            except BaseException:  # a full disk at the very start: nothing was recorded
                self._discard(remove=True)
                if interrupt.pending:
                    raise KeyboardInterrupt from None
                raise
        if interrupt.pending:
            self._discard(remove=True)
            raise KeyboardInterrupt

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
        with self._writing():
            self._room(data.nbytes)
            self._h5.create_dataset(schema.segment_name(number), data=data)
        self._segments += 1
        return number

    def _room(self, nbytes: int) -> None:
        """Refuse a segment that the file size limit (``ulimit -f``) or the free space cannot
        take with room to spare for the tables, before libhdf5 tries to write it: a write it
        fails leaves the file one it will not close (see _discard)."""
        if self._descriptor is None:
            return
        need = nbytes + _ROOM_FOR_TABLES
        limit = _file_size_limit()
        if limit is not None and os.fstat(self._descriptor[0]).st_size + need > limit:
            raise OSError(errnos.EFBIG, os.strerror(errnos.EFBIG))
        disk = os.statvfs(self.partial)
        if disk.f_bavail * disk.f_frsize < need:
            raise OSError(errnos.ENOSPC, os.strerror(errnos.ENOSPC))

    def append_rows(self, table: str, columns: dict[str, list]) -> None:
        with self._writing():
            self._tables[table].append(columns)

    def flush(self) -> None:
        with self._writing():
            self._h5.flush()

    def close(self, complete: bool, extra_meta: dict[str, Any] | None = None) -> Path:
        """Close the file; publish it under its final name only when complete, with
        ``extra_meta``'s keys added to (or replacing) its meta first: the meta digest is taken
        of the final text."""
        try:
            with self._writing():
                if complete and extra_meta:
                    self._meta = json.dumps({**json.loads(self._meta), **extra_meta},
                                            default=str)
                    self._h5.attrs[schema.ATTR_META] = self._meta
                if complete:
                    for name, table in self._tables.items():  # what a reader checks them by
                        self._h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=name)] = \
                            table.digest()
                    self._h5.attrs[schema.ATTR_META_DIGEST] = text_digest(self._meta)
                    self._h5.attrs[schema.ATTR_COMPLETE] = True
                self._h5.close()
            self._h5 = self._descriptor = None  # closed: its descriptor may be reused
            if not complete:
                return self.partial
            try:
                os.replace(self.partial, self.path)
            except OSError as exc:
                self.failure = exc
                raise CaptureError(self.failure_sentence(
                    f"renaming {self.partial} to {self.path}")) from exc
            return self.path
        except BaseException:
            self._discard(remove=False)
            raise
        finally:
            self._release()

    def abandon(self) -> None:
        """Close without marking complete, ignoring errors (the original error is what the
        user needs). The ``.partial`` stays for ``--allow-incomplete``, unless a write failed:
        then it is cut at a point nobody knows, and the space it takes is wanted."""
        self._discard(remove=False)

    def failure_sentence(self, doing: str | None = None) -> str:
        return (f"cannot write trace {self.path}: {doing or f'writing {self.partial}'} failed "
                f"({_reason(self.failure)}); nothing was published; free space or choose "
                "another -o path")

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Any h5py error inside becomes the file's failure, and a CaptureError."""
        if self.failure is not None:
            raise CaptureError(self.failure_sentence())
        try:
            yield
        except (OSError, RuntimeError) as exc:
            self.failure = exc
            self._detach()
            raise CaptureError(self.failure_sentence()) from exc

    def _detach(self) -> None:
        """Point libhdf5's descriptor at the null device: what it retries after a failed
        write goes nowhere, and closing the file cannot crash the process."""
        if self._descriptor is None:
            return
        fd, opened = self._descriptor
        self._descriptor = None
        with contextlib.suppress(OSError):
            if os.path.samestat(os.fstat(fd), opened):  # still the .partial's descriptor
                null = os.open(os.devnull, os.O_RDWR)
                try:
                    os.dup2(null, fd)
                finally:
                    os.close(null)

    def _discard(self, remove: bool) -> None:
        """Close the file, whatever state it is in; remove the ``.partial`` when ``remove`` or
        a write failed; let the path go."""
        if self._h5 is not None:
            for _ in range(2):  # after a failure, the first close can fail where the next does not
                try:
                    self._h5.close()
                    break
                except Exception as exc:  # the error that led here is the one to say
                    self.failure = self.failure or exc  # closing writes: it failed too
                    self._detach()
            else:
                # libhdf5 would not close the file (its failed write is sticky): freeing
                # its h5py objects later crashed the process in a segfault. They are kept
                # until the process ends (the command line ends it without teardown).
                _UNCLOSABLE.append((self._h5, self._tables if hasattr(self, "_tables") else None))
            self._h5 = None
        if remove or self.failure is not None:
            with contextlib.suppress(OSError):
                self.partial.unlink()
        self._release()

    def _release(self) -> None:
        self._lock.release()
        self._signals.restore()


# Room a segment must leave in the file size limit and on the disk: the index and sites rows
# appended after it and the file's own metadata (a few MiB for 100k records)
_ROOM_FOR_TABLES = 8 * 2**20


def _file_size_limit() -> int | None:
    """This process's file size limit in bytes (``ulimit -f``), None if unlimited or unknown."""
    try:
        import resource
    except ImportError:  # not on Windows
        return None
    soft = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    return None if soft == resource.RLIM_INFINITY else soft


# h5py objects of files libhdf5 refused to close (see TraceFile._discard)
_UNCLOSABLE: list[tuple[object, object]] = []


def unclosable() -> bool:
    """Whether libhdf5 refused to close a trace in this process (after a failed write)."""
    return bool(_UNCLOSABLE)


def _descriptor(h5: h5py.File) -> tuple[int, os.stat_result] | None:
    """The POSIX descriptor libhdf5 writes the file through, and what it was opened on."""
    if os.name != "posix":
        return None
    try:
        fd = int(h5.id.get_vfd_handle())
        return fd, os.fstat(fd)
    except (OSError, RuntimeError, ValueError, TypeError):
        return None


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
