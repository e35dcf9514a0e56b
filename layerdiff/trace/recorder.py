"""The recording engine shared by every producer: staging ring, bounded queue, writer thread.

Producers (the torch hooks, the numpy TraceWriter) reserve space in a preallocated ring, copy a
tensor's bytes into it and submit a small record. A background thread computes statistics,
writes contiguous runs of the ring as packed segments and the index rows, then frees the space.
The ring's size is the memory cap: when it is full, producers wait (bounded memory).
"""

from __future__ import annotations

import collections
import math
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from layerdiff.trace.digest import DIGEST_NAME
from layerdiff.trace.h5file import TraceFile
from layerdiff.trace.signals import interrupts_deferred
from layerdiff.trace.stats import EMPTY_STATS, Stats, batch_stats, compute_stats

DEFAULT_QUEUE_BYTES = 256 * 2**20
# A segment is written once this many bytes are pending: big enough that the ~150 us cost of
# creating a dataset vanishes, small enough to keep the ring turning over.
SEGMENT_BYTES = 16 * 2**20
# Records go to the writer threads in batches of this many, or sooner when this many bytes wait.
BATCH_RECORDS = 256
BATCH_BYTES = 4 * 2**20
CHECKPOINT_SECONDS = 1.0
# Records whose place in the file the I/O thread remembers for later records of the same bytes
# (a producer names one of its last few records: capture/stage.py remembers 4 tensors)
_PLACED = 4096


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
    keep: bool = True           # its data goes into the file (else its statistics only)
    # computed by the producer (the statistics thread skips it), or on their way from a
    # device (an object whose get() waits for them: capture/device_stats.py)
    stats: Any = None
    same_as: int = -1           # the seq of an earlier record whose bytes are this one's


@dataclass(slots=True)
class _Fence:
    """Waits until the device copies into the ring queued before it have landed."""

    wait: Callable[[], None]


_FLUSH = object()  # write pending bytes and table rows, then flush the file
_CHECKPOINT = object()  # the same, unless the tables were flushed less than a second ago
_WRITE = object()  # write pending bytes: a producer waits for ring space
_STOP = object()


class StagingRing:
    """Fixed memory handed out first-in first-out; space comes back through ``release``."""

    def __init__(self, capacity: int) -> None:
        capacity -= capacity % schema.ALIGN  # so the ring can be viewed as any dtype
        self.capacity = capacity
        # Not pre-touched: pages are committed as the ring first fills, so a small model's
        # capture does not hold the whole cap in memory.
        self.buffer = np.empty(capacity, dtype=np.uint8)
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
    """Owns the trace file, the ring and the two writer threads of one capture.

    producer --batches--> stats thread --segments--> I/O thread
    The stats thread computes statistics and digests and groups staged tensors into contiguous
    runs of the ring; the I/O thread writes those runs and the table rows and frees the ring.
    numpy and h5py release the GIL in their loops, so the two overlap each other and torch.
    Records are handed over in batches: one thread wake-up per tensor made the GIL bounce
    between threads and cost more than the copies.
    """

    def __init__(self, path: str | os.PathLike, meta: dict[str, Any], *, summary: bool = False,
                 queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 keep: Callable[[str], bool] | None = None) -> None:
        if queue_bytes < 4 * schema.ALIGN:
            raise CaptureError(f"the writer queue cap of {queue_bytes} bytes is too small")
        memory = _physical_memory()
        if memory and queue_bytes > memory // 2:
            raise CaptureError(f"the writer queue cap of {queue_bytes / 2**20:,.0f} MiB is more "
                               f"than half of this machine's {memory / 2**20:,.0f} MiB of memory;"
                               " give --queue-mib a smaller value (the default is 256)")
        self.summary = summary
        # which sites keep their tensor data (None: all, unless summary); the others, their
        # statistics only, as in a summary trace (capture --full-around)
        self._keep = keep
        self._kept: dict[str, bool] = {}
        # the index's digests are this recorder's: say which definition they follow
        self.file = TraceFile(path, {**meta, "tensor_digest": DIGEST_NAME}, summary)
        self.ring = StagingRing(queue_bytes)
        self.max_staged = queue_bytes // 2
        self.seq = 0
        self.bytes_submitted = 0
        # Set by a producer that copies into the ring asynchronously (a GPU's copy engine):
        # ``fence()`` marks the copies queued so far and returns a function that waits for them.
        self.fence: Callable[[], Callable[[], None]] | None = None
        self.copies_in_flight = False
        # Set by a producer whose statistics are reduced on a device in batches: called
        # before each batch of records goes to the threads, which then wait for them.
        self.before_send: Callable[[], None] | None = None
        self.error: BaseException | None = None
        # set by a Ctrl-C while closing: the threads stop writing tensor data and drain
        self.aborted = False
        self._closed: Path | None = None
        # meta keys known only once the run is over (add_meta), written at a complete close
        self._late_meta: dict[str, Any] = {}
        self._batch: list[Any] = []
        self._batch_bytes = 0
        self._batch_limit = min(BATCH_BYTES, queue_bytes // 4)
        self._stats_queue: queue.Queue = queue.Queue()
        self._io_queue: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._run_stats, name="layerdiff-stats", daemon=True),
            threading.Thread(target=self._run_io, name="layerdiff-io", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    # ---- producer side (the capturing thread) ----
    def reserve(self, nbytes: int) -> int:
        """Offset in ``ring.buffer`` for ``nbytes``; waits while the ring is full."""
        offset = self.ring.try_reserve(nbytes)
        while offset is None:
            self._send(_WRITE)  # the writer may be holding a part-filled segment
            self.ring.wait(0.05)
            self.raise_if_failed()
            offset = self.ring.try_reserve(nbytes)
        return offset

    def submit(self, step: int, pass_: str, site: str, role: str, arg: str, dtype: str,
               shape: tuple[int, ...], *, offset: int = -1, nbytes: int = 0,
               array: np.ndarray | None = None, value: str = "",
               stats: Stats | None = None, same_as: int = -1) -> None:
        """Queue one record: staged bytes (offset), an array to write now, or a value.
        ``stats`` are the tensor's statistics when the producer computed them; with neither
        offset nor array, they are all the record keeps (see :meth:`keeps_data`), unless
        ``same_as`` names an earlier record of this capture whose bytes are this one's (the
        same tensor recorded again unchanged: a layer's input, its predecessor's output):
        the index row then points at those bytes, which are written once."""
        if self.error is not None:
            self.raise_if_failed()
        keep = self.keeps_data(site)  # read only outside summary traces
        self._batch.append(_Record(self.seq, step, pass_, site, role, arg, dtype, shape,
                                   offset, nbytes, array, value, keep, stats, same_as))
        self.seq += 1
        self.bytes_submitted += nbytes
        self._batch_bytes += nbytes
        if array is not None:
            # The array may be the caller's live memory: wait until it is on disk.
            self._send()
            self._join()
        elif len(self._batch) >= BATCH_RECORDS or self._batch_bytes >= self._batch_limit:
            self._send()

    def can_share(self, seq: int) -> bool:
        """Whether a record submitted now may name record ``seq`` in ``same_as``: the I/O
        thread remembers where the last _PLACED records' bytes went."""
        return self.seq - seq < _PLACED

    def keeps_data(self, site: str) -> bool:
        """Whether the file keeps the tensor data of ``site`` (else its statistics only: a
        summary trace, or a site outside ``--full-around``)."""
        if self.summary:
            return False
        if self._keep is None:
            return True
        keep = self._kept.get(site)
        if keep is None:
            keep = self._kept[site] = bool(self._keep(site))
        return keep

    def submit_site(self, row: dict[str, Any]) -> None:
        self._batch.append(row)

    def flush(self) -> None:
        """Write out everything queued so far and wait until it is in the file."""
        self._send(_FLUSH)
        self._join()

    def checkpoint(self) -> None:
        """End of a step: make what was recorded survive a crash, at most once a second.

        Appending to the tables costs ~5 ms whatever their size, which would dominate the
        capture of a small model if paid every step.
        """
        self._send(_CHECKPOINT)
        self.raise_if_failed()

    def raise_if_failed(self) -> None:
        if self.error is not None:
            error = self.error
            if isinstance(error, CaptureError):  # the file's own sentence (a write failed)
                raise CaptureError(str(error)) from error.__cause__
            raise CaptureError(
                f"writing trace {self.file.partial} failed ({_said(error)}); nothing was "
                f"published ({self.file.partial} holds what was written before the failure, "
                "delete it to free the space)") from error

    def add_meta(self, extra: dict[str, Any]) -> None:
        """Meta keys learnt during the run (the layouts of sharded records): written into the
        file's meta when it closes complete, before the meta digest is taken; a ``.partial``
        keeps the meta it was created with."""
        self._late_meta.update(extra)

    def close(self, complete: bool) -> Path:
        """Stop the writer and publish the file if ``complete``; returns the path written.

        The writer threads are stopped and the file closed in every case. A Ctrl-C meanwhile
        does not cut this short (the threads would be left writing, holding libhdf5's lock,
        and the interpreter would hang at exit waiting for it): it makes the threads drain
        without writing more tensors, leaves the ``.partial`` and is raised once all is
        closed, unless the file was already being published (then the capture is complete).
        A second call returns what the first did.
        """
        if self._closed is not None:
            return self._closed
        with interrupts_deferred(self.abort) as interrupt:
            self._send(_STOP)
            for thread in self._threads:
                thread.join()
            if self.error is not None:
                self._closed = self.file.partial
                self.file.abandon()
                self.raise_if_failed()
            if not complete or interrupt.pending:
                self._closed = self.file.partial
                self.file.abandon()
            else:
                self._closed = self.file.partial  # should publishing fail
                # the writer threads have stopped: the file and its meta are this thread's
                self._closed = self.file.close(complete=True, extra_meta=self._late_meta)
        if interrupt.pending and self._closed != self.file.path:
            raise KeyboardInterrupt
        return self._closed

    def abort(self) -> None:
        """Make the writer threads finish soon: they write no more tensor data, then stop at
        the next ``close`` with the rows of what they wrote flushed."""
        self.aborted = True

    def _send(self, marker: object | None = None) -> None:
        if self.before_send is not None and self._batch:
            self.before_send()
        if marker is not None:
            self._batch.append(marker)
        if self.copies_in_flight and self.fence is not None and self._batch:
            self._batch.insert(0, _Fence(self.fence()))
            self.copies_in_flight = False
        if self._batch:
            self._stats_queue.put(self._batch)
            self._batch = []
            self._batch_bytes = 0

    def _join(self) -> None:
        self._stats_queue.join()  # the stats thread passes everything on before it is done
        self._io_queue.join()
        self.raise_if_failed()

    # ---- stats thread ----
    def _run_stats(self) -> None:
        stage = _StatsStage(self)
        while True:
            batch = self._stats_queue.get()
            try:
                if batch and isinstance(batch[0], _Fence):
                    batch.pop(0).wait()  # its bytes are not in the ring until then
                if self.error is None and not self.aborted:
                    stage.precompute(batch)
                for item in batch:
                    if self.error is None and not (self.aborted and isinstance(item, _Record)):
                        stage.take(item)
                    elif isinstance(item, _Record) and item.offset >= 0:
                        self.ring.release(1)  # after a failure: drain so producers never block
                    elif item is _STOP:
                        self._io_queue.put([_STOP])
            except BaseException as exc:
                self.error = exc
                stage.drop_pending()
                if _has_stop(batch):
                    self._io_queue.put([_STOP])
            finally:
                stage.send()
                self._stats_queue.task_done()
            if _has_stop(batch):
                return

    # ---- I/O thread ----
    def _run_io(self) -> None:
        stage = _IOStage(self)
        while True:
            batch = self._io_queue.get()
            try:
                for item in batch:
                    if self.error is None and not (self.aborted and isinstance(item, _Segment)):
                        stage.take(item)
                    elif isinstance(item, _Segment):
                        self.ring.release(len(item.records))
            except BaseException as exc:
                self.error = exc
            finally:
                self._io_queue.task_done()
            if _has_stop(batch):
                return


@dataclass(slots=True)
class _Segment:
    """Staged records with their statistics, to be written as one contiguous run of the ring."""

    start: int
    end: int
    records: list[tuple[_Record, Stats]]


class _StatsStage:
    """Stats-thread state: statistics for each tensor, grouping staged ones into segments."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.ring = recorder.ring
        self.summary = recorder.summary
        self.pending: list[tuple[_Record, Stats]] = []
        self.pending_bytes = 0
        self.segment_bytes = min(SEGMENT_BYTES, recorder.ring.capacity // 4)
        self.out: list[Any] = []
        self.to_release = 0
        self.ready: dict[int, Stats] = {}  # seq -> statistics computed for a whole batch

    def precompute(self, batch: list[Any]) -> None:
        """Statistics of the batch's small staged tensors, a few numpy calls for all of them."""
        staged = [r for r in batch if isinstance(r, _Record) and r.offset >= 0 and r.nbytes
                  and r.stats is None]
        # one increasing run of the ring at a time (it may wrap inside a batch)
        runs, run = [], []
        for record in staged:
            if run and record.offset < run[-1].offset:
                runs.append(run)
                run = []
            run.append(record)
        runs.append(run)
        for run in runs:
            spans = [(r.offset, r.nbytes, r.dtype) for r in run]
            for record, stats in zip(run, batch_stats(self.ring.buffer, spans), strict=True):
                if stats is not None:
                    self.ready[record.seq] = stats

    def take(self, item: Any) -> None:
        if not isinstance(item, _Record):  # site rows and markers keep their place in line
            if item is _FLUSH or item is _STOP or item is _WRITE or item is _CHECKPOINT:
                self.close_segment()
            self.out.append(item)
            return
        record = item
        if record.stats is not None and not isinstance(record.stats, Stats):
            record.stats = record.stats.get()  # reduced on a device: waits for its numbers
        if record.same_as >= 0:
            self.close_segment()  # its source's bytes reach the I/O thread first
            self.out.append((record, record.stats))
        elif record.value or (record.offset < 0 and record.array is None):
            self.out.append((record, record.stats or EMPTY_STATS))
        elif record.array is not None:  # oversized: written from the caller's array
            self.close_segment()
            self.out.append((record, record.stats
                             or compute_stats(record.array.reshape(-1), record.dtype)))
        else:
            if self.pending and record.offset < self.pending[-1][0].offset:
                self.close_segment()  # the ring wrapped: a segment is one contiguous run
            stats = record.stats or self.ready.pop(record.seq, None)
            if stats is None:
                raw = self.ring.buffer[record.offset:record.offset + record.nbytes]
                stats = compute_stats(raw.view(schema.numpy_dtype(record.dtype)), record.dtype)
            if not self.summary and not record.keep:
                # statistics only, inside a trace with data: the I/O thread releases its bytes
                # after the segments staged before it, so the ring is freed in order
                self.close_segment()
                self.out.append((record, stats))
                return
            if self.summary:
                self.out.append((record, stats))
                self.to_release += 1  # freed once per batch: each release wakes the producer
                return
            self.pending.append((record, stats))
            self.pending_bytes += record.nbytes
            if self.pending_bytes >= self.segment_bytes:
                self.close_segment()

    def close_segment(self) -> None:
        if self.pending:
            last = self.pending[-1][0]
            self.out.append(_Segment(self.pending[0][0].offset, last.offset + last.nbytes,
                                     self.pending))
            self.pending = []
            self.pending_bytes = 0

    def send(self) -> None:
        if self.to_release:
            self.ring.release(self.to_release)
            self.to_release = 0
        if self.out:
            self.recorder._io_queue.put(self.out)
            self.out = []

    def drop_pending(self) -> None:
        self.ring.release(len(self.pending) + self.to_release)
        self.pending = []
        self.to_release = 0


class _IOStage:
    """I/O-thread state: the file and the table rows not yet appended to it."""

    def __init__(self, recorder: Recorder) -> None:
        self.ring = recorder.ring
        self.file = recorder.file
        self.rows: list[tuple] = []  # index rows as tuples; turned into columns at flush
        self.sites: dict[str, list] = {name: [] for name in schema.SITES_COLUMNS}
        self.flushed_at = time.monotonic()
        # where the last records' bytes went (seq -> segment, offset): a record recorded
        # again points there (Recorder.submit's same_as)
        self.placed: dict[int, tuple[int, int]] = {}

    def _place(self, seq: int, segment: int, offset: int) -> None:
        self.placed[seq] = (segment, offset)
        if len(self.placed) > _PLACED:
            del self.placed[next(iter(self.placed))]

    def take(self, item: Any) -> None:
        if isinstance(item, _Segment):
            segment = self.file.write_segment(self.ring.buffer[item.start:item.end])
            for record, stats in item.records:
                self._row(record, segment, record.offset - item.start, stats)
                self._place(record.seq, segment, record.offset - item.start)
            self.ring.release(len(item.records))
        elif isinstance(item, tuple):
            record, stats = item
            if record.same_as >= 0:
                # its source was written before it (the statistics thread saw to that), unless
                # a Ctrl-C made the threads drain without writing: then no data, as for it
                segment, offset = self.placed.get(record.same_as, (-1, 0))
                self._row(record, segment, offset, stats)
            elif record.array is not None and not self.file.summary and record.keep:
                segment = self.file.write_segment(record.array.reshape(-1).view(np.uint8))
                self._row(record, segment, 0, stats)
                self._place(record.seq, segment, 0)
            else:
                self._row(record, -1, 0, stats, "value" if record.value else "tensor")
                if not (record.keep or self.file.summary or record.offset < 0
                        or record.array is not None):
                    self.ring.release(1)  # staged for its statistics only (see _StatsStage)
        elif isinstance(item, dict):
            for name, values in self.sites.items():
                values.append(item[name])
        elif item is _FLUSH or item is _STOP or (
                item is _CHECKPOINT
                and time.monotonic() - self.flushed_at >= CHECKPOINT_SECONDS):
            self.flush()

    def flush(self) -> None:
        if self.rows:
            # Values are rowed at once, tensors when their segment is written: restore the
            # recording order, so that file order is seq order for readers without layerdiff.
            self.rows.sort(key=lambda row: row[0])
            columns = dict(zip(schema.INDEX_COLUMNS, map(list, zip(*self.rows, strict=True)),
                               strict=True))
            self.file.append_rows(schema.INDEX_GROUP, columns)
            self.rows = []
        if self.sites["site"]:
            self.file.append_rows(schema.SITES_GROUP, self.sites)
            self.sites = {name: [] for name in schema.SITES_COLUMNS}
        self.file.flush()
        self.flushed_at = time.monotonic()

    def _row(self, record: _Record, segment: int, offset: int, stats: Stats,
             kind: str = "tensor") -> None:
        numel = math.prod(record.shape) if kind == "tensor" else 0
        self.rows.append((record.seq, record.step, record.pass_, record.site, record.role,
                          record.arg, kind, record.dtype, schema.format_shape(record.shape),
                          numel, segment, offset, record.nbytes, *stats, record.value))


def _has_stop(batch: list) -> bool:
    return any(item is _STOP for item in batch)


def _physical_memory() -> int | None:
    """This machine's memory in bytes, where the platform says (not on Windows)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None


def _said(error: BaseException) -> str:
    """An error in a few words: the system's for an OSError (h5py's own message runs to several
    lines of buffer addresses), the first line of anything else."""
    errno = getattr(error, "errno", None)
    if isinstance(error, OSError) and errno:
        hint = {28: ": the disk is full", 27: ": a file size limit (ulimit -f) was reached",
                30: ": the file system is read-only"}.get(errno, "")
        return f"{os.strerror(errno)}{hint}"
    return str(error).splitlines()[0] if str(error) else type(error).__name__
