"""TraceWriter: record a trace from any framework with numpy arrays (no torch needed)."""

from __future__ import annotations

import functools
import json
import os
import platform
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import h5py
import numpy as np

from layerdiff.errors import CaptureError
from layerdiff.trace import schema
from layerdiff.trace.recorder import DEFAULT_QUEUE_BYTES, Recorder


def base_meta(producer: str) -> dict[str, Any]:
    """Provenance every trace carries; producers add their own keys."""
    return {
        "producer": producer,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "versions": {"python": platform.python_version(), "numpy": np.__version__,
                     "h5py": h5py.__version__},
        "loss_scale": 1.0,
    }


def value_json(value: Any) -> str:
    """A non-tensor value as JSON when it is plain data, otherwise its repr (never pickled)."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return json.dumps({"repr": repr(value), "type": type(value).__name__})


@contextmanager
def site_scope(writer, module: str, type_name: str = "") -> Iterator[str]:
    """``with writer.site(module) as site:``, for any writer with ``enter`` and ``exit``:
    the site is exited whatever the block does."""
    site = writer.enter(module, type_name)
    try:
        yield site
    finally:
        writer.exit(site)


class TraceWriter:
    """Write a layerdiff trace from numpy arrays.

    >>> with TraceWriter("port.h5", meta={"case": "my_port"}) as w:
    ...     with w.site("encoder.layers.0", type_name="Block") as site:
    ...         w.record(site, "input", x)
    ...         y = block(x)
    ...         w.record(site, "output", y)
    ...     w.record(site, "grad_output", dy)      # backward records may come later

    Sites are ``module#call`` with the call number counted per step; ``step()`` starts the next
    training step. The file appears under its name only when ``close()`` (or leaving the ``with``
    block without an exception) completes it.
    """

    def __init__(self, path: str | os.PathLike, *, meta: dict[str, Any] | None = None,
                 summary: bool = False, queue_bytes: int = DEFAULT_QUEUE_BYTES,
                 producer: str = "layerdiff.TraceWriter") -> None:
        full_meta = base_meta(producer)
        full_meta.update(meta or {})
        check_writable(path)
        self._recorder = Recorder(path, full_meta, summary=summary, queue_bytes=queue_bytes)
        self.current_step = 0
        self._calls: Counter[str] = Counter()
        # open calls, innermost last: (site, module, call, type_name, enter_seq)
        self._stack: list[tuple[str, str, int, str, int]] = []
        self._closed = False

    @property
    def path(self) -> Path:
        return self._recorder.file.path

    def step(self, step: int | None = None) -> None:
        """Begin a training step (the next one by default): call numbers restart."""
        self._recorder.checkpoint()
        self.current_step = self.current_step + 1 if step is None else step
        self._calls.clear()

    def enter(self, module: str, type_name: str = "", *, call: int | None = None) -> str:
        """Open a call of ``module``; returns its site name ``module#call``. The call number
        counts the module's calls in this step unless ``call`` gives it."""
        if call is None:
            call = self._calls[module]
        self._calls[module] = call + 1
        site = schema.site_name(module, call)
        self._stack.append((site, module, call, type_name, self._recorder.seq))
        return site

    def exit(self, site: str) -> None:
        """Close the call opened by ``enter``."""
        if not self._stack or self._stack[-1][0] != site:
            raise CaptureError(f"TraceWriter.exit({site!r}) does not close the innermost open "
                               f"site {self._stack[-1][0] if self._stack else None!r}")
        _, module, call, type_name, enter_seq = self._stack.pop()
        self._recorder.submit_site({
            "step": self.current_step, "site": site, "module": module, "call": call,
            "type": type_name, "parent": self._stack[-1][0] if self._stack else "",
            "enter_seq": enter_seq, "exit_seq": self._recorder.seq})

    site = site_scope

    def record(self, site: str, role: str, value: Any, *, arg: str = "0",
               pass_: str | None = None) -> None:
        """Record one tensor (numpy array, or anything ``np.asarray`` takes) or plain value."""
        if role not in schema.ROLES:
            raise CaptureError(f"role {role!r} at site {site!r} is not one of "
                               f"{', '.join(schema.ROLES)}")
        pass_ = pass_ or schema.ROLE_PASS[role]
        rec = self._recorder
        if isinstance(value, np.ndarray) or (np.isscalar(value) and isinstance(value, np.generic)):
            array = np.asarray(value, order="C")  # ascontiguousarray would make 0-d 1-d
            nbytes = array.nbytes
            dtype = _dtype_name(array.dtype)
            if nbytes > rec.max_staged:
                rec.submit(self.current_step, pass_, site, role, arg, dtype, array.shape,
                           nbytes=nbytes, array=array)
                return
            offset = rec.reserve(nbytes)
            rec.ring.buffer[offset:offset + nbytes] = array.reshape(-1).view(np.uint8)
            rec.submit(self.current_step, pass_, site, role, arg, dtype, array.shape,
                       offset=offset, nbytes=nbytes)
        else:
            rec.submit(self.current_step, pass_, site, role, arg, "", (), value=value_json(value))

    def close(self, complete: bool = True) -> Path:
        """Finish the file: published under its name when ``complete``, else left ``.partial``."""
        if self._closed:
            return self.path
        self._closed = True
        return self._recorder.close(complete and not self._stack)

    def __enter__(self) -> TraceWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)


@functools.lru_cache(maxsize=64)
def _dtype_name(dtype: np.dtype) -> str:
    return dtype.name  # ~6 us a call uncached: a tenth of a small record's cost


def check_writable(path: str | os.PathLike) -> None:
    """Refuse early, before any work, when the trace cannot be written where asked."""
    target = Path(path)
    directory = target.parent if str(target.parent) else Path(".")
    if not directory.is_dir():
        raise CaptureError(f"cannot write trace {target}: directory {directory} does not exist; "
                           "create it or choose another -o path")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise CaptureError(f"cannot write trace {target}: directory {directory} is not "
                           "writable; choose another -o path")
    if target.is_dir():
        raise CaptureError(f"cannot write trace {target}: it is a directory; give a file name "
                           "such as trace.h5")
