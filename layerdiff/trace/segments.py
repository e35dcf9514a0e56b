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
from layerdiff.trace.digest import DIGEST_NAME

WINDOW_BYTES = 4 << 20


def segment_dataset(h5: h5py.File, segment: int, path: str, record: str = "") -> h5py.Dataset:
    """Tensor segment ``segment`` of an open trace, refused (TraceError) when the file lacks it
    or it is not a plain 1-D byte dataset stored in this file (an external link, external
    storage or a virtual dataset would read another file)."""
    name = schema.segment_name(segment)
    holding = f" (the index puts {record} there)" if record else ""
    try:
        group = h5.get(schema.TENSORS_GROUP, getlink=True)
        if group is not None and not isinstance(group, h5py.HardLink):
            raise TraceError(f"{path}: /{schema.TENSORS_GROUP} is a {type(group).__name__}, "
                             "which a trace never holds (it would read another file); refused,"
                             " capture it again")
        link = h5.get(name, getlink=True)
        if link is None:
            raise TraceError(f"{path}: " + (f"the index puts {record} in tensor segment "
                                            f"{segment}, which the file lacks" if record else
                                            f"tensor segment {segment} is missing")
                             + "; the file is damaged, capture it again")
        if not isinstance(link, h5py.HardLink):
            raise TraceError(f"{path}: tensor segment {segment} is a {type(link).__name__}, "
                             "which a trace never holds (it would read another file); refused,"
                             " capture it again")
        dataset = h5[name]
        if not isinstance(dataset, h5py.Dataset) or dataset.ndim != 1 or (
                dataset.dtype != np.uint8):
            raise TraceError(f"{path}: tensor segment {segment}{holding} is not a 1-D uint8 "
                             "dataset; the file is damaged, capture it again")
        if dataset.external or dataset.is_virtual:
            raise TraceError(f"{path}: tensor segment {segment} keeps its bytes in other files "
                             f"({'virtual dataset' if dataset.is_virtual else 'external storage'}"
                             "), which a trace never does; refused, capture it again")
    except TraceError:
        raise
    except (OSError, RuntimeError, ValueError, TypeError, KeyError) as exc:
        first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
        raise TraceError(f"{path}: tensor segment {segment}{holding} cannot be read ({first}); "
                         "the file is damaged, capture it again") from exc
    return dataset


class SegmentReader:
    """Byte ranges of one trace's segments; small ranges through a window read ahead."""

    def __init__(self, h5: h5py.File, path: str, digest_algorithm: str = DIGEST_NAME) -> None:
        self.h5, self.path = h5, path
        self.digest_algorithm = digest_algorithm  # how the index digests its records
        self._datasets: dict[int, h5py.Dataset] = {}
        self._window = np.empty(WINDOW_BYTES, np.uint8)
        self._window_at = (-1, 0, 0)  # segment, start, length

    def _dataset(self, segment: int) -> h5py.Dataset:
        if segment not in self._datasets:
            self._datasets[segment] = segment_dataset(self.h5, segment, self.path)
        return self._datasets[segment]

    def read(self, segment: int, offset: int, nbytes: int, out: np.ndarray) -> None:
        """Fill ``out[:nbytes]`` with bytes ``offset .. offset + nbytes`` of the segment."""
        dataset = self._dataset(segment)
        if offset < 0 or nbytes < 0 or offset + nbytes > dataset.shape[0]:
            raise TraceError(f"{self.path}: tensor segment {segment} holds {dataset.shape[0]} "
                             f"bytes but the index puts a tensor at {offset}..{offset + nbytes};"
                             " the file is damaged, capture it again")
        try:
            if nbytes > WINDOW_BYTES // 4:
                dataset.read_direct(out, np.s_[offset:offset + nbytes], np.s_[0:nbytes])
                return
            seg, start, length = self._window_at
            if seg != segment or offset < start or offset + nbytes > start + length:
                self._window_at = (-1, 0, 0)
                length = min(WINDOW_BYTES, dataset.shape[0] - offset)
                dataset.read_direct(self._window, np.s_[offset:offset + length],
                                    np.s_[0:length])
                seg, start = segment, offset
                self._window_at = (segment, offset, length)
        except (OSError, RuntimeError, ValueError) as exc:  # a damaged chunk or filter
            first = str(exc).splitlines()[0][:160] if str(exc) else type(exc).__name__
            raise TraceError(f"{self.path}: bytes {offset}..{offset + nbytes} of tensor segment "
                             f"{segment} cannot be read ({first}); the file is damaged, capture "
                             "it again") from exc
        out[:nbytes] = self._window[offset - start:offset - start + nbytes]


def decode(raw: np.ndarray, dtype: str, count: int) -> np.ndarray:
    """``count`` stored elements as numbers (bfloat16's bits widened to float32)."""
    values = raw[:count * schema.numpy_dtype(dtype).itemsize].view(schema.numpy_dtype(dtype))
    if dtype == "bfloat16":
        return schema.bfloat16_to_float32(values)
    return values
