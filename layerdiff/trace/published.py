"""Whether a capture published its trace: the last word of an interrupted or failed capture is
what is on disk, not a guess from where the interrupt landed.

A writer publishes by renaming a complete file over its target, so the file at the target
after the capture is this capture's only when it is not the one that was there before (an
``--force`` capture replaces the old file only at the publish). No torch here.
"""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np

from layerdiff.errors import TraceError
from layerdiff.trace import schema
from layerdiff.trace.attributes import read_root_attributes
from layerdiff.trace.guards import guard_global_heaps

Identity = tuple[int, int, int, int] | None


def file_identity(path: str | os.PathLike) -> Identity:
    """What tells one file at ``path`` from the next (device, inode, mtime, size); None when
    there is none."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_size)


def is_new(path: str | os.PathLike, before: Identity) -> bool:
    """Whether a file is at ``path`` that is not the one ``before`` identified."""
    return file_identity(path) not in (None, before)


def complete_trace(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a complete trace (its writer published it)."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            guard_global_heaps(h5, path)
            return is_complete(read_root_attributes(h5, path))
    except (OSError, TraceError):
        return False


def published_since(path: str | os.PathLike, before: Identity) -> bool:
    """Whether a complete trace was published at ``path`` since ``before`` was taken."""
    return is_new(path, before) and complete_trace(path)


def is_complete(attrs: dict) -> bool:
    """Whether a trace's root attributes say its writer completed it."""
    complete = attrs.get(schema.ATTR_COMPLETE, False)
    return attrs.get(schema.ATTR_FORMAT) == schema.FORMAT_NAME and isinstance(
        complete, (bool, np.bool_)) and bool(complete)
