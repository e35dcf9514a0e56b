"""The recording engine shared by every producer: staging ring, bounded queue, writer thread.

Producers (the torch hooks, the numpy TraceWriter) reserve space in a preallocated ring, copy a
tensor's bytes into it and submit a small record. A background thread computes statistics,
writes contiguous runs of the ring as packed segments and the index rows, then frees the space.
The ring's size is the memory cap: when it is full, producers wait (bounded memory).
"""

from __future__ import annotations

import collections
import os
import queue
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from layerdiff.trace.h5file import TraceFile
from layerdiff.trace.stats import EMPTY_STATS, compute_stats

DEFAULT_QUEUE_BYTES = 256 * 2**20
# A segment is written once this many bytes are pending: big enough that the ~150 us cost of
# creating a dataset vanishes, small enough to keep the ring turning over.
SEGMENT_BYTES = 16 * 2**20


@dataclass(slots=True)
class _Record:
    seq: int
    step: int
    pass_: str
    site: str
    role: str
    arg: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = -1            # ring offset, when staged
    nbytes: int = 0
    array: np.ndarray | None = None  # data not in the ring (oversized tensors)
    value: str = ""             # kind == value


_FLUSH = object()  # write pending bytes and table rows, then flush the file
_WRITE = object()  # write pending bytes: a producer waits for ring space
_STOP = object()


class StagingRing:
    """Fixed memory handed out first-in first-out; space comes back through ``release``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.buffer = np.empty(capacity, dtype=np.uint8)
        self.buffer.fill(0)  # touch the pages now, not inside the first captured step
        self._head = 0
        self._used = 0
        self._spans: collections.deque[int] = collections.deque()
        self._cond = threading.Condition()

    def try_reserve(self, nbytes: int) -> int | None:
        """Offset of ``nbytes`` of free space, or None when the ring is too full."""
        size = max(schema.ALIGN, -(-nbytes // schema.ALIGN) * schema.ALIGN)
        with self._cond:
            if self._used == 0:
                self._head = 0
            wraps = self._head + size > self.capacity
            waste = self.capacity - self._head if wraps else 0  # the unused tail of the ring
            if self._used + waste + size > self.capacity:
                return None
            start = 0 if wraps else self._head
            self._head = start + size
            self._used += waste + size
            self._spans.append(waste + size)
            return start

    def wait(self, timeout: float) -> None:
        with self._cond:
            self._cond.wait(timeout)

    def release(self, count: int) -> None:
        with self._cond:
            for _ in range(count):
                self._used -= self._spans.popleft()
            self._cond.notify_all()


class Recorder:
    """Owns the trace file, the ring and the writer thread of one capture."""

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any], *, summary: bool = False,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES) -> None:
        if queue_bytes < 4 * schema.ALIGN:
            raise CaptureError(f"the writer queue cap of {queue_bytes} bytes is too small")
        self.summary = summary
        self.file = TraceFile(path, meta, summary)
        self.ring = StagingRing(queue_bytes)
        self.max_staged = queue_bytes // 2
        self.seq = 0
        self.bytes_submitted = 0
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="layerdiff-writer", daemon=True)
        self._thread.start()

    # ---- producer side (the capturing thread) ----
    def reserve(self, nbytes: int) -> int:
        """Offset in ``ring.buffer`` where ``nbytes`` may be written; waits while the ring is full."""
        offset = self.ring.try_reserve(nbytes)
        while offset is None:
            self._queue.put(_WRITE)  # the writer may be holding a part-filled segment
            self.ring.wait(0.05)
            self.raise_if_failed()
            offset = self.ring.try_reserve(nbytes)
        return offset

    def submit(self, step: int, pass_: str, site: str, role: str, arg: str, dtype: str,
               shape: tuple[int, ...], *, offset: int = -1, nbytes: int = 0,
               array: np.ndarray | None = None, value: str = "") -> None:
        """Queue one record: staged bytes (offset), an array to write now, or a value."""
        if self.error is not None:
            self.raise_if_failed()
        record = _Record(self.seq, step, pass_, site, role, arg, dtype, shape,
                         offset, nbytes, array, value)
        self.seq += 1
        self.bytes_submitted += nbytes
        self._queue.put(record)
        if array is not None:
            # The array may be the caller's live memory: wait until it is on disk.
            self._queue.join()
            self.raise_if_failed()

    def submit_site(self, row: dict[str, Any]) -> None:
        self._queue.put(row)

    def flush(self, wait: bool = True) -> None:
        """Write out everything queued so far (end of a step): a crash later keeps it.

        With ``wait=False`` the writer does it in the background while the next step runs.
        """
        self._queue.put(_FLUSH)
        if wait:
            self._queue.join()
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            error = self.error
            raise CaptureError(
                f"writing trace {self.file.partial} failed: {error}; nothing was published as "
                f"complete ({self.file.partial} holds what was written before the failure, "
                "delete it to free the space)") from error

    def close(self, complete: bool) -> Path:
        """Stop the writer and publish the file if ``complete``; returns the path written."""
        self._queue.put(_STOP)
        self._thread.join()
        if self.error is not None:
            self.file.abandon()
            self.raise_if_failed()
        if not complete:
            self.file.abandon()
            return self.file.partial
        return self.file.close(complete=True)

    # ---- writer thread ----
    def _run(self) -> None:
        writer = _SegmentWriter(self)
        while True:
            item = self._queue.get()
            try:
                if self.error is None:
                    if item is _FLUSH or item is _STOP:
                        writer.flush()
                    elif item is _WRITE:
                        writer.write_pending()
                    elif isinstance(item, dict):
                        writer.add_site(item)
                    else:
                        writer.add(item)
                        if writer.should_write():
                            writer.write_pending()
                elif isinstance(item, _Record) and item.offset >= 0:
                    self.ring.release(1)  # after a failure: drain so producers never block
            except BaseException as exc:  # noqa: BLE001 - reported to the producer
                self.error = exc
                writer.drop_pending()
            finally:
                self._queue.task_done()
            if item is _STOP:
                return


class _SegmentWriter:
    """Writer-thread state: records whose bytes are staged but not yet written."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.ring = recorder.ring
        self.file = recorder.file
        self.pending: list[tuple[_Record, Any]] = []  # staged records with their stats
        self.pending_bytes = 0
        self.segment_bytes = min(SEGMENT_BYTES, recorder.ring.capacity // 4)
        self.rows = {name: [] for name in schema.INDEX_COLUMNS}
        self.sites = {name: [] for name in schema.SITES_COLUMNS}

    def add(self, record: _Record) -> None:
        if record.value or (record.offset < 0 and record.array is None):
            self._row(record, -1, 0, EMPTY_STATS, kind="value" if record.value else "tensor")
            return
        if record.array is not None:  # oversized: its own segment, written now
            self.write_pending()
            flat = record.array.reshape(-1)
            stats = compute_stats(flat, record.dtype)
            segment = -1 if self.file.summary else self.file.write_segment(flat.view(np.uint8))
            self._row(record, segment, 0, stats)
            return
        if self.pending and record.offset < self.pending[-1][0].offset:
            self.write_pending()  # the ring wrapped: a segment must be one contiguous run
        raw = self.ring.buffer[record.offset:record.offset + record.nbytes]
        stats = compute_stats(_typed(raw, record), record.dtype)
        if self.file.summary:
            self._row(record, -1, 0, stats)
            self.ring.release(1)
            return
        self.pending.append((record, stats))
        self.pending_bytes += record.nbytes

    def should_write(self) -> bool:
        return self.pending_bytes >= self.segment_bytes

    def write_pending(self) -> None:
        if not self.pending:
            return
        start = self.pending[0][0].offset
        last = self.pending[-1][0]
        segment = self.file.write_segment(self.ring.buffer[start:last.offset + last.nbytes])
        for record, stats in self.pending:
            self._row(record, segment, record.offset - start, stats)
        self.ring.release(len(self.pending))
        self.pending.clear()
        self.pending_bytes = 0

    def drop_pending(self) -> None:
        self.ring.release(len(self.pending))
        self.pending.clear()

    def flush(self) -> None:
        self.write_pending()
        if self.rows["seq"]:
            # Values are rowed at once, tensors when their segment is written: restore the
            # recording order, so that file order is seq order for readers without layerdiff.
            order = np.argsort(self.rows["seq"], kind="stable")
            self.rows = {k: [v[i] for i in order] for k, v in self.rows.items()}
            self.file.append_rows(schema.INDEX_GROUP, self.rows)
            self.rows = {name: [] for name in schema.INDEX_COLUMNS}
        if self.sites["site"]:
            self.file.append_rows(schema.SITES_GROUP, self.sites)
            self.sites = {name: [] for name in schema.SITES_COLUMNS}
        self.file.flush()

    def add_site(self, row: dict[str, Any]) -> None:
        for name, values in self.sites.items():
            values.append(row[name])

    def _row(self, record: _Record, segment: int, offset: int, stats, kind: str = "tensor") -> None:
        numel = int(np.prod(record.shape)) if kind == "tensor" else 0
        values = (record.seq, record.step, record.pass_, record.site, record.role, record.arg,
                  kind, record.dtype, schema.format_shape(record.shape), numel, segment, offset,
                  record.nbytes, *stats, record.value)
        for column, value in zip(self.rows.values(), values, strict=True):
            column.append(value)


def _typed(raw: np.ndarray, record: _Record) -> np.ndarray:
    return raw.view(schema.numpy_dtype(record.dtype))
