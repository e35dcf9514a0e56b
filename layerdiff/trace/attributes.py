"""A trace's root attributes, each one's HDF5 type checked before it is read.

libhdf5 converts an attribute to the type its header claims; one damaged byte there (a
variable-length string turned into a sequence of some other base type) makes h5py read
memory it does not own, and the process dies of a segmentation fault. So the type and the
dataspace are looked at first, through h5py's low-level interface, and a type other than the
writer's is refused as damage. Attributes this reader does not use are never read.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import h5py

from layerdiff.errors import TraceError
from layerdiff.trace import schema

_TEXT, _INTEGER, _FLAG = "a variable-length string", "an integer", "a true/false flag"

# what the writer (trace/h5file.py) stores under each name
EXPECTED: dict[str, str] = {
    schema.ATTR_FORMAT: _TEXT,
    schema.ATTR_META: _TEXT,
    schema.ATTR_META_DIGEST: _TEXT,
    schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP): _TEXT,
    schema.ATTR_TABLE_DIGEST.format(table=schema.SITES_GROUP): _TEXT,
    schema.ATTR_VERSION: _INTEGER,
    schema.ATTR_COMPLETE: _FLAG,
    schema.ATTR_SUMMARY: _FLAG,
}

# libhdf5 and h5py say what is wrong with a damaged file by any of these
_H5_ERRORS = (OSError, RuntimeError, ValueError, TypeError, KeyError, AttributeError,
              UnicodeDecodeError, SystemError)


def read_root_attributes(h5: h5py.File, path: Path) -> dict[str, Any]:
    """The root attributes a trace reader uses, as plain values, each read only once its type
    is the writer's; a damaged one (its type, its shape or its bytes) is a TraceError."""
    values: dict[str, Any] = {}
    try:
        names = list(h5.attrs)[:64]  # a trace has eight; a damaged file may claim any number
        for name in names:
            expected = EXPECTED.get(name)
            if expected is None:
                continue
            found = _type_problem(h5, name, expected)
            if found is not None and name == schema.ATTR_COMPLETE:
                continue  # a flag of another type is no promise: left unread, incomplete
            if found is not None:
                raise TraceError(f"{path}: its root attribute {name!r} is {found}, not "
                                 f"{expected}; the file is damaged, capture it again")
            values[name] = h5.attrs[name]
    except _H5_ERRORS as exc:
        raise TraceError(f"{path}: its root attributes cannot be read ({_short(exc)}); the file "
                         "is damaged, capture it again") from exc
    return values


def _type_problem(h5: h5py.File, name: str, expected: str) -> str | None:
    """What the attribute ``name`` holds when that is not ``expected``, else None."""
    attribute = h5py.h5a.open(h5.id, name.encode("utf-8"))
    kind = attribute.get_space().get_simple_extent_type()
    if kind != h5py.h5s.SCALAR:
        return "an array" if kind == h5py.h5s.SIMPLE else "empty"
    stored = attribute.get_type()
    if expected == _TEXT:
        if isinstance(stored, h5py.h5t.TypeStringID) and stored.is_variable_str():
            return None
    elif expected == _INTEGER:
        if isinstance(stored, h5py.h5t.TypeIntegerID) and stored.get_size() <= 8:
            return None
    elif isinstance(stored, h5py.h5t.TypeEnumID):  # h5py stores a bool as an enum of int8
        base = stored.get_super()
        if (isinstance(base, h5py.h5t.TypeIntegerID) and base.get_size() == 1
                and stored.get_nmembers() == 2):
            return None
    return _describe(stored)


def _describe(stored: h5py.h5t.TypeID) -> str:
    size = stored.get_size()
    if isinstance(stored, h5py.h5t.TypeStringID):
        return f"a string of {size} bytes"
    names = {h5py.h5t.TypeIntegerID: "an integer", h5py.h5t.TypeFloatID: "a float",
             h5py.h5t.TypeVlenID: "a variable-length sequence",
             h5py.h5t.TypeOpaqueID: "opaque bytes", h5py.h5t.TypeCompoundID: "a compound",
             h5py.h5t.TypeEnumID: "an enum", h5py.h5t.TypeArrayID: "an array type",
             h5py.h5t.TypeReferenceID: "a reference", h5py.h5t.TypeBitfieldID: "a bitfield"}
    what = next((text for kind, text in names.items() if isinstance(stored, kind)),
                "an unknown type")
    return f"{what} of {size} bytes"


def _short(exc: BaseException) -> str:
    """An h5py error in a few words: its first line, without HDF5's error stack."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return text[:160]
