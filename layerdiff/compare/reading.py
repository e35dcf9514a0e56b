"""Streaming tensor pairs out of two traces, chunk by chunk, with reads ahead on a thread.

A prefetch thread reads both sides of each pair into a small pool of reused ~1 MiB buffers
while the caller computes metrics on the previous chunks (h5py and numpy both release the GIL),
so memory is bounded by the pool whatever the traces' size (PERF-NOTES: 1 MiB ``read_direct``
blocks, a reader thread ahead of the compute). Small tensors packed next to each other are
served from one window read instead of one h5py call each
(:class:`layerdiff.trace.segments.SegmentReader`).
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import h5py
import numpy as np

from layerdiff.mapping import Slice
from layerdiff.trace import schema
from layerdiff.trace.segments import SegmentReader, decode
from layerdiff.trace.verify import RecordCheck, check_bytes

CHUNK_BYTES = 1 << 20
POOL = 6  # chunk buffer pairs in flight


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
    transpose: bool = False
    check: Mapping[str, Any] | None = None  # the index row its bytes are checked against

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


def stream_pairs(ref_h5: h5py.File, port_h5: h5py.File, pairs: list[tuple[TensorRef, TensorRef]],
                 paths: tuple[str, str]) -> Iterator[Chunk]:
    """Chunks of every pair in order; each chunk's arrays are valid until the next one."""
    free: queue.Queue = queue.Queue()
    for _ in range(POOL):
        free.put((np.empty(CHUNK_BYTES, np.uint8), np.empty(CHUNK_BYTES, np.uint8)))
    ready: queue.Queue = queue.Queue(maxsize=POOL)
    stop = threading.Event()
    readers = (SegmentReader(ref_h5, paths[0]), SegmentReader(port_h5, paths[1]))

    def produce() -> None:
        try:
            for number, (ref, port) in enumerate(pairs):
                if stop.is_set():
                    return
                if ref.streamable and port.streamable:
                    _produce_streamed(number, ref, port, readers, free, ready, stop)
                else:
                    _produce_whole(number, ref, port, readers, ready)
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
            chunk, buffers = item
            pending = buffers
            yield chunk
    finally:
        stop.set()
        while thread.is_alive():  # unblock the producer so it can see the stop
            with contextlib.suppress(queue.Empty):
                ready.get_nowait()
            free.put((np.empty(0, np.uint8), np.empty(0, np.uint8)))
            thread.join(timeout=0.05)


def _produce_streamed(number: int, ref: TensorRef, port: TensorRef, readers, free: queue.Queue,
                      ready: queue.Queue, stop: threading.Event) -> None:
    ref_offset, ref_bytes = ref.byte_range()
    port_offset, _ = port.byte_range()
    ref_size = schema.numpy_dtype(ref.dtype).itemsize
    port_size = schema.numpy_dtype(port.dtype).itemsize
    total = ref_bytes // ref_size
    step = max(1, CHUNK_BYTES // max(ref_size, port_size))
    checks = [_checker(tensor, reader) for tensor, reader in zip((ref, port), readers,
                                                                strict=True)]
    start = 0
    while True:
        count = min(step, total - start)
        buffers = free.get()
        if stop.is_set():
            return
        ref_buf, port_buf = buffers
        readers[0].read(ref.segment, ref_offset + start * ref_size, count * ref_size, ref_buf)
        readers[1].read(port.segment, port_offset + start * port_size, count * port_size,
                        port_buf)
        for check, buf, size in zip(checks, buffers, (ref_size, port_size), strict=True):
            if check is not None:
                check.update(buf[:count * size])
                if start + count >= total:
                    check.finish()
        chunk = Chunk(number, start, decode(ref_buf, ref.dtype, count),
                      decode(port_buf, port.dtype, count), start + count >= total)
        ready.put((chunk, buffers))
        start += count
        if start >= total:
            return


def _produce_whole(number: int, ref: TensorRef, port: TensorRef, readers,
                   ready: queue.Queue) -> None:
    """Tensors that need a transpose or a slice across rows: read whole, in fresh memory (the
    one case where memory grows with a tensor: a transposed weight), compared in chunks."""
    ref_values = _whole(ref, readers[0]).reshape(-1)
    port_values = _whole(port, readers[1]).reshape(-1)
    step = max(1, CHUNK_BYTES // max(ref_values.itemsize, port_values.itemsize))
    for start in range(0, max(ref_values.size, 1), step):  # bounded metric temporaries
        stop = start + step
        ready.put((Chunk(number, start, ref_values[start:stop], port_values[start:stop],
                         stop >= ref_values.size), None))


def _checker(tensor: TensorRef, reader: SegmentReader) -> RecordCheck | None:
    return None if tensor.check is None else RecordCheck(tensor.check, reader.path)


def verify_tensors(h5: h5py.File, path: str, tensors: list[TensorRef],
                   done: Callable[[int], None] | None = None) -> None:
    """Read each tensor whole, in blocks, only to check its bytes against its index row (for
    records the diff decides from the index: identical digests, summary statistics)."""
    reader = SegmentReader(h5, path)
    block = np.empty(4 * CHUNK_BYTES, np.uint8)  # a multiple of every element size
    for tensor in tensors:
        check = _checker(tensor, reader)
        for start in range(0, tensor.nbytes, block.size):
            count = min(block.size, tensor.nbytes - start)
            reader.read(tensor.segment, tensor.offset + start, count, block)
            check.update(block[:count])
            if done is not None:
                done(count)
        check.finish()


def _whole(tensor: TensorRef, reader: SegmentReader) -> np.ndarray:
    raw = np.empty(tensor.nbytes, np.uint8)
    reader.read(tensor.segment, tensor.offset, tensor.nbytes, raw)
    if tensor.check is not None:
        check_bytes(raw, tensor.check, reader.path)
    count = tensor.nbytes // max(schema.numpy_dtype(tensor.dtype).itemsize, 1)
    values = decode(raw, tensor.dtype, count).reshape(tensor.shape)
    if tensor.part is not None:  # the slice first, on the stored layout; then the transpose
        index = [slice(None)] * values.ndim
        index[tensor.part.axis] = slice(tensor.part.start, tensor.part.stop)
        values = values[tuple(index)]
    if tensor.transpose:
        values = values.T
    return np.ascontiguousarray(values)
