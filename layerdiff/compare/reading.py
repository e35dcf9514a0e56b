"""Streaming tensor pairs out of two traces, chunk by chunk, with reads ahead on a thread.

A prefetch thread maps (or reads) both sides of each pair in ~1 MiB chunks while the caller
computes metrics on the previous chunks (numba, numpy and h5py all release the GIL); a pool of
slots bounds the chunks in flight, so memory is bounded whatever the traces' size (PERF-NOTES:
1 MiB blocks, a reader thread ahead of the compute). The bytes of plain segments are mapped
from the file, or read with ``os.preadv`` on the descriptor HDF5 holds
(:class:`layerdiff.trace.direct.DirectReader`, the one reader of a file's bytes past h5py);
anything else goes through h5py (:class:`layerdiff.trace.segments.SegmentReader`).
"""

from __future__ import annotations

import contextlib
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerdiff.compare import aot
from layerdiff.mapping import Slice
from layerdiff.trace import schema
from layerdiff.trace.direct import DirectReader
from layerdiff.trace.segments import SegmentReader, decode
from layerdiff.trace.verify import RecordCheck, check_bytes

CHUNK_BYTES = 1 << 20
POOL = 6  # chunk buffer pairs in flight
WINDOW_CHUNKS = 8  # chunks per mapped window: 8 MiB maps ran 11-12 GB/s, 1 MiB maps 7-8


@dataclass(frozen=True)
class TensorRef:
    """Where one side's tensor lies, and what to do to it before comparing: cut it to
    ``part``, then transpose it when ``transpose`` (in that order; every transform chain of a
    mapping comes down to it, see :class:`layerdiff.mapping.PartView`)."""

    segment: int
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    part: Slice | None = None
    transpose: bool | tuple[int, ...] = False   # True: reverse every axis; a tuple: those axes
    check: Mapping[str, Any] | None = None  # the index row its bytes are checked against
    statistics: bool = True  # the row's statistics too, not only its digest

    @property
    def streamable(self) -> bool:
        """Readable as flat chunks: no transpose, and any slice along axis 0 (unless the bytes
        are checked: a digest covers the whole tensor, so it is read whole)."""
        return not self.transpose and (self.part is None or (
            self.check is None and self.part.axis in (0, -len(self.shape))))

    def byte_range(self) -> tuple[int, int]:
        """(offset, nbytes) of the elements compared, for a streamable tensor."""
        if self.part is None:
            return self.offset, self.nbytes
        row = self.nbytes // max(self.shape[0], 1)
        return self.offset + self.part.start * row, (self.part.stop - self.part.start) * row


@dataclass
class Chunk:
    pair: int          # the caller's index of the pair
    start: int         # first flat element in this chunk
    ref: np.ndarray    # decoded values (bfloat16 widened to float32), flat
    port: np.ndarray
    last: bool


def stream_pairs(ref: SegmentReader, port: SegmentReader,
                 pairs: list[tuple[TensorRef, TensorRef]]) -> Iterator[Chunk]:
    """Chunks of every pair in order (each side's bytes from its trace's
    :meth:`~layerdiff.trace.Trace.segments`); each chunk's arrays are valid until the next
    one."""
    free: queue.Queue = queue.Queue()
    for _ in range(POOL):
        free.put(_Slot())
    ready: queue.Queue = queue.Queue(maxsize=POOL)
    stop = threading.Event()
    readers = (DirectReader(ref), DirectReader(port))

    def take_slot() -> _Slot | None:
        slot = free.get()
        return None if stop.is_set() else slot

    def produce() -> None:
        try:
            for number, (ref, port) in enumerate(pairs):
                for item in _pair_chunks(number, ref, port, readers, take_slot):
                    ready.put(item)
                if stop.is_set():
                    return
        except BaseException as exc:  # surfaced in the caller's thread
            ready.put(exc)
            return
        ready.put(None)

    thread = threading.Thread(target=produce, name="layerdiff-prefetch", daemon=True)
    thread.start()
    pending = None
    try:
        while True:
            item = ready.get()
            if pending is not None:
                free.put(pending)
                pending = None
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            chunk, slot = item
            pending = slot
            yield chunk
    finally:
        stop.set()
        while thread.is_alive():  # unblock the producer so it can see the stop
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()
            free.put(_Slot(0))
            thread.join(timeout=0.05)


class _Slot:
    """One chunk pair in flight, reused: buffers for bytes that cannot be mapped, made on
    first use, and float32 arrays that bfloat16 chunks are widened into (fresh 2-4 MiB arrays
    per chunk cost a page fault per 4 KiB)."""

    def __init__(self, nbytes: int = CHUNK_BYTES) -> None:
        self.nbytes = nbytes
        self.raw: list[np.ndarray | None] = [None, None]
        self.wide: list[np.ndarray | None] = [None, None]

    def buffer(self, side: int) -> np.ndarray:
        if self.raw[side] is None:
            self.raw[side] = np.empty(self.nbytes, np.uint8)
        return self.raw[side]

    def values(self, side: int, raw: np.ndarray, dtype: str, count: int) -> np.ndarray:
        """The first ``count`` elements of a side's bytes as numbers (see segments.decode)."""
        if dtype != "bfloat16":
            return decode(raw, dtype, count)
        if self.wide[side] is None:
            self.wide[side] = np.empty(self.nbytes // 2, np.float32)
        wide = self.wide[side][:count]
        # bfloat16 is the top half of a float32: the same bits segments.decode makes
        np.left_shift(raw[:2 * count].view(np.uint16), 16, out=wide.view(np.uint32),
                      dtype=np.uint32)
        return wide


class _Windows:
    """One side's bytes of a streamed tensor, chunk by chunk, as views of mapped windows of
    WINDOW_CHUNKS chunks; read into the slot's buffer where they cannot be mapped.

    Only bytes that are checked are mapped: the check reads them on this thread, which leaves
    them in the shared cache for the metrics. Unchecked bytes read from a map reached the
    metrics from memory, and ``--no-verify`` ran 8-10% slower than with ``preadv`` (whose copy
    does that warming): 0.61 against 0.66 GB/s at 2 GB, 0.81 against 0.89 at 8 GB."""

    def __init__(self, reader: DirectReader, segment: int, end: int, maps: bool) -> None:
        self.reader, self.segment, self.end = reader, segment, end  # end: past the tensor
        self.maps = maps
        self.window: np.ndarray | None = None
        self.start = 0

    def bytes(self, offset: int, nbytes: int, slot: _Slot, side: int) -> np.ndarray:
        window = self.window
        if self.maps and (window is None or not self.start <= offset <= offset + nbytes <= (
                self.start + window.size)):
            length = min(nbytes * WINDOW_CHUNKS, self.end - offset)
            self.window = window = self.reader.mapped(self.segment, offset, length)
            self.start = offset
        if window is not None:
            return window[offset - self.start:offset - self.start + nbytes]
        buffer = slot.buffer(side)
        self.reader.read(self.segment, offset, nbytes, buffer)
        return buffer[:nbytes]


def _pair_chunks(number: int, ref: TensorRef, port: TensorRef, readers,
                 take_slot: Callable[[], _Slot | None]) -> Iterator[tuple[Chunk, _Slot | None]]:
    """The chunks of one pair in order, each with the slot its arrays live in (None: in fresh
    memory); ``take_slot`` gives the slot of each next chunk, None to stop."""
    if not (ref.streamable and port.streamable):
        yield from ((chunk, None) for chunk in _whole_chunks(number, ref, port, readers))
        return
    ref_offset, ref_bytes = ref.byte_range()
    port_offset, _ = port.byte_range()
    ref_size = schema.numpy_dtype(ref.dtype).itemsize
    port_size = schema.numpy_dtype(port.dtype).itemsize
    total = ref_bytes // ref_size
    step = max(1, CHUNK_BYTES // max(ref_size, port_size))
    checks = [_checker(tensor, reader) for tensor, reader in zip((ref, port), readers,
                                                                strict=True)]
    windows = [_Windows(readers[0], ref.segment, ref_offset + total * ref_size,
                        checks[0] is not None),
               _Windows(readers[1], port.segment, port_offset + total * port_size,
                        checks[1] is not None)]

    def side(which: int, tensor: TensorRef, offset: int, size: int, slot: _Slot, start: int,
             count: int) -> np.ndarray:
        """One side's values of a chunk, its bytes checked while they are in cache (on its
        last chunk, judged)."""
        raw = windows[which].bytes(offset + start * size, count * size, slot, which)
        check = checks[which]
        if check is not None:
            check.update(raw)
            if start + count >= total:
                check.finish()
        return slot.values(which, raw, tensor.dtype, count)

    start = 0
    while True:
        count = min(step, total - start)
        slot = take_slot()
        if slot is None:
            return
        chunk = Chunk(number, start, side(0, ref, ref_offset, ref_size, slot, start, count),
                      side(1, port, port_offset, port_size, slot, start, count),
                      start + count >= total)
        yield chunk, slot
        start += count
        if start >= total:
            return


def _whole_chunks(number: int, ref: TensorRef, port: TensorRef, readers) -> Iterator[Chunk]:
    """Tensors that need a transpose or a slice across rows: read whole, in fresh memory (the
    one case where memory grows with a tensor: a transposed weight), compared in chunks."""
    ref_values = _whole(ref, readers[0]).reshape(-1)
    port_values = _whole(port, readers[1]).reshape(-1)
    step = max(1, CHUNK_BYTES // max(ref_values.itemsize, port_values.itemsize))
    for start in range(0, max(ref_values.size, 1), step):  # bounded metric temporaries
        stop = start + step
        yield Chunk(number, start, ref_values[start:stop], port_values[start:stop],
                    stop >= ref_values.size)


def _built_digest() -> Any:
    """The digest compiled ahead of time with the metric kernel (compare/aot.py), where numba
    is not loaded (a loaded numba serves the compiled statistics module instead)."""
    if "numba" in sys.modules:
        return None
    built = aot.load()
    return built.digest if built is not None else None


def _checker(tensor: TensorRef, reader: DirectReader) -> RecordCheck | None:
    return None if tensor.check is None else RecordCheck(
        tensor.check, reader.path, statistics=tensor.statistics,
        algorithm=reader.digest_algorithm, digest_kernel=_built_digest())


def verify_tensors(segments: SegmentReader, tensors: list[TensorRef],
                   done: Callable[[int], None] | None = None) -> None:
    """Read each tensor whole, in blocks, only to check its bytes against its index row (for
    records the diff decides from the index: identical digests, summary statistics)."""
    reader = DirectReader(segments)
    block = np.empty(WINDOW_CHUNKS * CHUNK_BYTES, np.uint8)  # a multiple of every element size
    for tensor in tensors:
        check = _checker(tensor, reader)
        for start in range(0, tensor.nbytes, block.size):
            count = min(block.size, tensor.nbytes - start)
            raw = reader.mapped(tensor.segment, tensor.offset + start, count)
            if raw is None:
                reader.read(tensor.segment, tensor.offset + start, count, block)
                raw = block[:count]
            check.update(raw)
            del raw  # the map goes with its last view
            if done is not None:
                done(count)
        check.finish()


def compare_tensors(ref: SegmentReader, port: SegmentReader,
                    pairs: list[tuple[TensorRef, TensorRef]],
                    done: Callable[[int], None] | None = None) -> list[int]:
    """Whether the bytes of each pair agree, for pairs the diff would call identical from
    their digests: both sides read whole, in blocks, each checked against its index row (where
    it has one) as it is read, and compared with each other. The numbers of the pairs whose
    bytes differ: equal digests are no proof (the digest is linear, a crafted change keeps it).
    The comparison costs a fraction of the check's digest (numpy compares 8 bytes a step)."""
    readers = DirectReader(ref), DirectReader(port)
    blocks = [np.empty(WINDOW_CHUNKS * CHUNK_BYTES, np.uint8) for _ in readers]
    differing = []
    for number, tensors in enumerate(pairs):
        checks = [_checker(tensor, reader) for tensor, reader in zip(tensors, readers,
                                                                    strict=True)]
        nbytes = tensors[0].nbytes
        same = tensors[1].nbytes == nbytes
        if not same:  # cannot be with equal shapes and dtypes: compared element by element
            nbytes = 0
        for start in range(0, nbytes, blocks[0].size):
            count = min(blocks[0].size, nbytes - start)
            raws = [_bytes(reader, tensor, start, count, block)
                    for reader, tensor, block in zip(readers, tensors, blocks, strict=True)]
            for side in (0, 1):
                if checks[side] is not None:
                    checks[side].update(raws[side])
            same = same and same_bytes(raws[0], raws[1])
            # a map goes with its last view: none may outlive the loop, in a traceback's frame
            # either (a map holds the file open, and HDF5's lock with it)
            del raws
            if done is not None:
                done(2 * count)
        for check in checks:
            if check is not None:
                check.finish()
        if not same:
            differing.append(number)
    return differing


def _bytes(reader: DirectReader, tensor: TensorRef, start: int, count: int,
           block: np.ndarray) -> np.ndarray:
    """Bytes ``start .. start + count`` of a tensor: mapped, else read into ``block``."""
    raw = reader.mapped(tensor.segment, tensor.offset + start, count)
    if raw is None:
        reader.read(tensor.segment, tensor.offset + start, count, block)
        raw = block[:count]
    return raw


def same_bytes(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two uint8 arrays hold the same bytes (8 at a time: 1.5x numpy's byte-wise)."""
    if a.size != b.size:
        return False
    whole = a.size - a.size % 8
    return bool(np.array_equal(a[:whole].view(np.uint64), b[:whole].view(np.uint64))
                and np.array_equal(a[whole:], b[whole:]))


def _whole(tensor: TensorRef, reader: DirectReader) -> np.ndarray:
    raw = np.empty(tensor.nbytes, np.uint8)
    reader.read(tensor.segment, tensor.offset, tensor.nbytes, raw)
    if tensor.check is not None:
        check_bytes(raw, tensor.check, reader.path, statistics=tensor.statistics,
                    algorithm=reader.digest_algorithm, digest_kernel=_built_digest())
    count = tensor.nbytes // max(schema.numpy_dtype(tensor.dtype).itemsize, 1)
    values = decode(raw, tensor.dtype, count).reshape(tensor.shape)
    return np.ascontiguousarray(as_compared(values, tensor.part, tensor.transpose))


def as_compared(values: np.ndarray, part: Slice | None,
                transpose: bool | tuple[int, ...]) -> np.ndarray:
    """A stored tensor as it is compared: cut to ``part`` on the stored layout first, then
    transposed (True: every axis reversed; a tuple: those axes). The one place of that rule,
    for the diff's reads and for reading a row back (:mod:`layerdiff.compare.pair`)."""
    if part is not None:
        index = [slice(None)] * values.ndim
        index[part.axis] = slice(part.start, part.stop)
        values = values[tuple(index)]
    if transpose:
        values = values.T if transpose is True else values.transpose(transpose)
    return values
