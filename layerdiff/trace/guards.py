"""What a reader checks of a trace file before it trusts its structure: the meta attribute
(bounded JSON with the types readers rely on) and HDF5's global heaps (a damaged one makes
libhdf5 loop forever). Used by the reader and by the manifest's check of rank files, below
both (so neither imports the other for them)."""

from __future__ import annotations

import json
import math
import mmap
from pathlib import Path
from typing import Any

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


# meta is small (a few KiB): bounds that no writer reaches and that keep json.loads bounded
_META_BYTES = 1 << 20
_META_DEPTH = 32
# meta keys readers use, and the types they may have (other keys are free)
_META_TYPES: dict[str, tuple[type, ...]] = {
    "producer": (str,), "case": (str,), "device": (str,), "created": (str,), "host": (str,),
    "versions": (dict,), "seed": (int, type(None)), "steps": (int,),
    "dtype": (str, type(None)), "autocast": (str, type(None)), "model_dtype": (str, type(None)),
    "default_dtype": (str, type(None)), "weights": (dict, type(None)),
    "signatures": (dict,), "shared_parameters": (list, type(None)), "include": (list,),
    "exclude": (list,), "summary": (bool,),
}
# a loss scale multiplies gradients; beyond these, float32 gradients under- or overflow
LOSS_SCALE_RANGE = (1e-30, 1e30)


def parse_meta(text: Any, path: Path) -> dict[str, Any]:
    """The meta attribute as a dict, refused (TraceError) when it is not JSON text of bounded
    size and depth, or a key readers use has the wrong type."""
    def refuse(what: str) -> TraceError:
        return TraceError(f"{path}: its meta attribute {what}; the file is damaged, capture "
                          "it again")

    if text is None:
        raise refuse("is missing (every writer records one)")
    if not isinstance(text, str):
        raise refuse(f"is {type(text).__name__}, not JSON text")
    if len(text) > _META_BYTES:
        raise refuse(f"is {len(text):,} characters long, far beyond any writer's")
    if _json_depth(text) > _META_DEPTH:
        raise refuse(f"nests deeper than {_META_DEPTH} levels")
    try:
        meta = json.loads(text)
    except (ValueError, RecursionError) as exc:  # bad JSON, an integer of 5,000 digits
        raise refuse(f"is not valid JSON ({str(exc)[:80]})") from exc
    if not isinstance(meta, dict):
        raise refuse("is not a JSON object")
    for key, types in _META_TYPES.items():
        if key in meta and (not isinstance(meta[key], types)
                            or (isinstance(meta[key], bool) and bool not in types)):
            raise refuse(f"has {key} {meta[key]!r:.40}, of the wrong type")
    scale = meta.get("loss_scale", 1.0)
    number = (float(scale) if isinstance(scale, float) or (
        isinstance(scale, int) and not isinstance(scale, bool) and abs(scale) < 1 << 128)
        else math.nan)  # an integer of 400 digits does not convert
    if not (math.isfinite(number) and LOSS_SCALE_RANGE[0] <= number <= LOSS_SCALE_RANGE[1]):
        raise TraceError(f"{path}: its loss scale {scale!r:.40} is not a finite number between "
                         f"{LOSS_SCALE_RANGE[0]:g} and {LOSS_SCALE_RANGE[1]:g}; the file is "
                         "damaged, capture it again")
    versions = meta.get("versions", {})
    if not all(isinstance(v, str) for v in versions.values()):
        raise refuse("has versions that are not text")
    weights = meta.get("weights") or {}
    mapping = weights.get("mapping")
    if mapping is not None and not (isinstance(mapping, dict) and all(
            isinstance(mapping.get(k), str) for k in ("name", "text"))):
        raise refuse("records a mapping that is not {name, text}")
    return meta


def _json_depth(text: str) -> int:
    """How deep JSON text nests (brackets outside strings), without recursion."""
    if text.count("[") + text.count("{") <= _META_DEPTH:
        return 0  # cannot nest deeper than it has brackets
    depth = deepest = 0
    in_string = escaped = False
    for char in text:
        if in_string:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == '"':
                in_string = False
        elif char == '"':
            in_string = True
        elif char in "[{":
            depth += 1
            deepest = max(deepest, depth)
            if deepest > _META_DEPTH:
                return deepest
        elif char in "]}":
            depth -= 1
    return deepest
