"""Reading a trace's tensor data by byte range, for readers that stream it (the diff).

Segments are flat uint8 datasets (``tensors/NNNNNN``); the index says where each tensor lies in
one. :class:`SegmentReader` serves byte ranges of them, small ranges through a window read
ahead so that small tensors packed next to each other cost one h5py call; :func:`decode` turns
raw bytes into numbers.
"""

from __future__ import annotations

import h5py
import numpy as np

from layerdiff.errors import TraceError
from layerdiff.trace import schema

WINDOW_BYTES = 4 << 20


class SegmentReader:
    """Byte ranges of one trace's segments; small ranges through a window read ahead."""

    def __init__(self, h5: h5py.File, path: str) -> None:
        self.h5, self.path = h5, path
        self._datasets: dict[int, h5py.Dataset] = {}
        self._window = np.empty(WINDOW_BYTES, np.uint8)
        self._window_at = (-1, 0, 0)  # segment, start, length

    def _dataset(self, segment: int) -> h5py.Dataset:
        if segment not in self._datasets:
            try:
                self._datasets[segment] = self.h5[schema.segment_name(segment)]
            except KeyError:
                raise TraceError(f"{self.path}: tensor segment {segment} is missing; the file "
                                 "is damaged, capture it again") from None
        return self._datasets[segment]

    def read(self, segment: int, offset: int, nbytes: int, out: np.ndarray) -> None:
        """Fill ``out[:nbytes]`` with bytes ``offset .. offset + nbytes`` of the segment."""
        dataset = self._dataset(segment)
        if offset + nbytes > dataset.shape[0]:
            raise TraceError(f"{self.path}: tensor segment {segment} holds {dataset.shape[0]} "
                             f"bytes but the index puts a tensor at {offset}..{offset + nbytes};"
                             " the file is damaged, capture it again")
        if nbytes > WINDOW_BYTES // 4:
            dataset.read_direct(out, np.s_[offset:offset + nbytes], np.s_[0:nbytes])
            return
        seg, start, length = self._window_at
        if seg != segment or offset < start or offset + nbytes > start + length:
            length = min(WINDOW_BYTES, dataset.shape[0] - offset)
            dataset.read_direct(self._window, np.s_[offset:offset + length], np.s_[0:length])
            seg, start = segment, offset
            self._window_at = (segment, offset, length)
        out[:nbytes] = self._window[offset - start:offset - start + nbytes]


def decode(raw: np.ndarray, dtype: str, count: int) -> np.ndarray:
    """``count`` stored elements as numbers (bfloat16's bits widened to float32)."""
    values = raw[:count * schema.numpy_dtype(dtype).itemsize].view(schema.numpy_dtype(dtype))
    if dtype == "bfloat16":
        return schema.bfloat16_to_float32(values)
    return values
