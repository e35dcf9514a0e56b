"""What a reader checks of a trace file's HDF5 structure before it trusts it: the global heaps
(a damaged one makes libhdf5 loop forever) and how an h5py error is said in a few words. Used by
the reader and by the manifest's check of rank files, below both (so neither imports the other
for them). The meta attribute's contract, and its check, are in schema."""

from __future__ import annotations

import mmap
from pathlib import Path

import h5py

from layerdiff.errors import TraceError
from layerdiff.trace import schema


def short(exc: BaseException) -> str:
    """An h5py error in a few words: its first line, without HDF5's error stack."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160]


# h5py and libhdf5 say what is wrong with a damaged file by any of these
H5_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError,
              UnicodeDecodeError, SystemError)


# libhdf5 (1.14) walks a global heap collection (where variable-length strings live: the meta
# attribute, the tables' text columns) object by object, each step as long as the object's
# size field says; a free-space object of size 0, which a zeroed block makes, never advances
# and the reader spins forever. The walk is repeated here, in Python, before libhdf5 does it.
_HEAP_SIGNATURE = b"GCOL"
_HEAP_HEADER = 16   # signature, version, 3 reserved bytes, collection size (8-byte lengths)
_HEAP_OBJECT = 16   # index, reference count, 4 reserved bytes, object size


def guard_global_heaps(h5: h5py.File, path: Path) -> None:
    """Refuse (TraceError) a file holding a global heap collection that would make libhdf5
    loop. Tensor segments are skipped (their bytes are data, not structure), so the cost is
    a scan of the file's small structural part."""
    skip = []
    try:
        tensors = h5.get(schema.TENSORS_GROUP, getlink=True)
        if isinstance(tensors, h5py.HardLink) and isinstance(h5[schema.TENSORS_GROUP],
                                                             h5py.Group):
            for name in h5[schema.TENSORS_GROUP]:
                dataset = h5[schema.TENSORS_GROUP].get(name)
                if isinstance(dataset, h5py.Dataset):
                    offset = dataset.id.get_offset()
                    if offset is not None:
                        skip.append((offset, offset + dataset.id.get_storage_size()))
    except H5_ERRORS as exc:
        raise TraceError(f"{path}: its tensor segments cannot be listed ({short(exc)}); the "
                         "file is damaged, capture it again") from exc
    with open(path, "rb") as handle:
        data = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        start = 0
        for begin, end in [*sorted(skip), (len(data), len(data))]:
            _check_heaps_in(data, start, begin, path)
            start = max(start, end)
    finally:
        data.close()


def _check_heaps_in(data: mmap.mmap, start: int, stop: int, path: Path) -> None:
    at = data.find(_HEAP_SIGNATURE, start, stop)
    while at >= 0:
        header = data[at:at + _HEAP_HEADER]
        if len(header) == _HEAP_HEADER and header[4] == 1:
            size = int.from_bytes(header[8:16], "little")
            if size < _HEAP_HEADER or at + size > len(data):
                raise TraceError(f"{path}: the HDF5 global heap at byte {at} claims {size} "
                                 "bytes, past the end of the file; the file is damaged or cut "
                                 "off, capture it again")
            _walk_heap(data, at, size, path)
        at = data.find(_HEAP_SIGNATURE, at + 1, stop)


def _walk_heap(data: mmap.mmap, at: int, size: int, path: Path) -> None:
    position, end = at + _HEAP_HEADER, at + size
    while position < end:
        if position + _HEAP_OBJECT > end:
            return  # too small for an object: libhdf5 takes it as free space
        index = int.from_bytes(data[position:position + 2], "little")
        length = int.from_bytes(data[position + 8:position + 16], "little")
        need = _HEAP_OBJECT + (length + 7) // 8 * 8 if index else length
        if need <= 0 or position + need > end:
            raise TraceError(f"{path}: the HDF5 global heap at byte {at} is damaged (an object "
                             f"at byte {position} is {length} bytes long), and HDF5 would "
                             "never finish reading it; the file is damaged, capture it again")
        position += need
