"""Seeing every NNX submodule call: the ``__call__`` of the model's module classes replaced,
for the length of a capture, by a dispatcher that hands each call to the capture in progress;
and, the same way, every read of a variable's value (``variable[...]``, ``.value``,
``get_value()``, an operator or ``jnp.asarray`` on it, ``variable.T``) handed to a watcher.

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

import jax
from flax import nnx


class CallSink(Protocol):
    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any: ...


class ReadSink(Protocol):
    def read(self, variable: nnx.Variable) -> None: ...


ACTIVE: contextvars.ContextVar[CallSink | None] = contextvars.ContextVar(
    "layerdiff_flax_capture", default=None)
READING: contextvars.ContextVar[ReadSink | None] = contextvars.ContextVar(
    "layerdiff_flax_reads", default=None)
_LOCK = threading.Lock()
# (class, attribute) -> (what it was, what replaces it, how many blocks want it replaced)
_PATCHED: dict[tuple[type, str], tuple[Callable[..., Any], Callable[..., Any], int]] = {}


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


def _patch(cls: type, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
           ) -> None:
    """Replace ``cls.name`` by ``make(original)``, once however many blocks ask (counted)."""
    original, patched, count = _PATCHED.get((cls, name), (vars(cls)[name], None, 0))
    if patched is None:
        patched = make(original)
        type.__setattr__(cls, name, patched)
    _PATCHED[(cls, name)] = (original, patched, count + 1)


def _unpatch(cls: type, name: str) -> None:
    original, patched, count = _PATCHED[(cls, name)]
    if count == 1:
        type.__setattr__(cls, name, original)
        del _PATCHED[(cls, name)]
    else:
        _PATCHED[(cls, name)] = (original, patched, count - 1)


@contextlib.contextmanager
def intercepted(modules: Iterable[Any], sink: CallSink) -> Iterator[None]:
    """Within the block, every ``__call__`` of these modules' classes goes to ``sink`` (on
    this thread and context); the classes are restored afterwards, whatever happens."""
    classes = _defining_classes(modules)
    with _LOCK:
        for cls in classes:
            _patch(cls, "__call__", _dispatcher)
    token = ACTIVE.set(sink)
    try:
        yield
    finally:
        ACTIVE.reset(token)
        with _LOCK:
            for cls in classes:
                _unpatch(cls, "__call__")


def _value_reader(original: Callable[..., Any]) -> Callable[..., Any]:
    # every read of the value goes through get_value: [...], .value, operators, __jax_array__
    @functools.wraps(original)
    def get_value(self: Any, *args: Any, **kwargs: Any) -> Any:
        sink = READING.get()
        if sink is not None:
            sink.read(self)
        return original(self, *args, **kwargs)

    return get_value


def _attribute_reader(original: Callable[..., Any]) -> Callable[..., Any]:
    # variable.T, variable.astype(...): the array's own attributes, read past get_value; its
    # shape or dtype carries no value a gradient flows from
    @functools.wraps(original)
    def __getattr__(self: Any, name: str) -> Any:
        found = original(self, name)
        sink = READING.get()
        if sink is not None and (isinstance(found, jax.Array) or (
                callable(found) and isinstance(getattr(found, "__self__", None), jax.Array))):
            sink.read(self)
        return found

    return __getattr__


# Variable's own members that read the value for something no gradient flows from (its shape,
# length, a comparison, a hash, a printout): within them a read is not handed on
_NO_GRADIENT = ("shape", "__len__", "__contains__", "__eq__", "__hash__", "__nnx_repr__",
                "__treescope_repr__")


def _unwatched(original: Any) -> Any:
    def quiet(function: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(function)
        def run(*args: Any, **kwargs: Any) -> Any:
            token = READING.set(None)
            try:
                return function(*args, **kwargs)
            finally:
                READING.reset(token)
        return run

    if isinstance(original, property):
        return property(quiet(original.fget), original.fset, original.fdel, original.__doc__)
    return quiet(original)


def _variable_patches() -> list[tuple[str, Callable[[Any], Any]]]:
    return [("get_value", _value_reader), ("__getattr__", _attribute_reader),
            *((name, _unwatched) for name in _NO_GRADIENT if name in vars(nnx.Variable))]


@contextlib.contextmanager
def reads_seen(sink: ReadSink) -> Iterator[None]:
    """Within the block, every read of an NNX variable's value on this thread and context is
    handed to ``sink`` first (not one for its shape, length, a comparison or a printout);
    ``nnx.Variable`` is restored afterwards, whatever happens."""
    patches = _variable_patches()
    with _LOCK:
        for name, make in patches:
            _patch(nnx.Variable, name, make)
    token = READING.set(sink)
    try:
        yield
    finally:
        READING.reset(token)
        with _LOCK:
            for name, _ in patches:
                _unpatch(nnx.Variable, name)
