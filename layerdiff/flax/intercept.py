"""Seeing every NNX submodule call: the ``__call__`` of the model's module classes replaced,
for the length of a capture, by a dispatcher that hands each call to the capture in progress.

The classes are shared by every model of the process, so the replacement is counted (two
captures at once patch once and restore once) and which capture a call belongs to is a context
variable, never a global: a module of another model, or a call on another thread, runs as
written.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable, Iterable, Iterator
from typing import Any, Protocol

from flax import nnx


class CallSink(Protocol):
    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any: ...


ACTIVE: contextvars.ContextVar[CallSink | None] = contextvars.ContextVar(
    "layerdiff_flax_capture", default=None)
_LOCK = threading.Lock()
_PATCHED: dict[type, tuple[Callable[..., Any], Callable[..., Any], int]] = {}


def _dispatcher(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def __call__(self: Any, *args: Any, **kwargs: Any) -> Any:
        sink = ACTIVE.get()
        if sink is None:
            return original(self, *args, **kwargs)
        return sink.call(original, self, args, kwargs)

    return __call__


def _defining_classes(modules: Iterable[Any]) -> set[type]:
    """The classes whose own ``__call__`` a call of these modules can run (a subclass that
    calls ``super().__call__`` runs two)."""
    found: set[type] = set()
    for module in modules:
        for cls in type(module).__mro__:
            if cls in (nnx.Module, object):
                break
            if "__call__" in vars(cls):
                found.add(cls)
    return found


@contextlib.contextmanager
def intercepted(modules: Iterable[Any], sink: CallSink) -> Iterator[None]:
    """Within the block, every ``__call__`` of these modules' classes goes to ``sink`` (on
    this thread and context); the classes are restored afterwards, whatever happens."""
    classes = _defining_classes(modules)
    with _LOCK:
        for cls in classes:
            original, patched, count = _PATCHED.get(cls, (vars(cls)["__call__"], None, 0))
            if patched is None:
                patched = _dispatcher(original)
                type.__setattr__(cls, "__call__", patched)
            _PATCHED[cls] = (original, patched, count + 1)
    token = ACTIVE.set(sink)
    try:
        yield
    finally:
        ACTIVE.reset(token)
        with _LOCK:
            for cls in classes:
                original, patched, count = _PATCHED[cls]
                if count == 1:
                    type.__setattr__(cls, "__call__", original)
                    del _PATCHED[cls]
                else:
                    _PATCHED[cls] = (original, patched, count - 1)
