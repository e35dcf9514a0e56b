"""A recorded call's arguments, back from the index rows: the inverse of capture's flattening.

Capture stores ``layer(x, (h, c), mask=m)`` as arguments ``0``, ``1.0``, ``1.1`` and ``mask``;
replay needs the call again. Numeric path parts rebuild tuples, other parts dicts.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

from layerdiff.errors import DiffError


class _Leaf:
    """A recorded value in the tree of paths (a dict value must not read as nesting)."""

    def __init__(self, value: Any) -> None:
        self.value = value


def flatten(value: Any, prefix: str = "", *,
            is_leaf: Callable[[Any], bool] = lambda value: False) -> Iterator[tuple[str, Any]]:
    """(argument path, leaf) pairs of nested tuples, lists and dicts: ``layer(x, (h, c),
    mask=m)`` gives ``0``, ``1.0``, ``1.1``, ``mask`` (the inverse of :func:`rebuild_call`).
    ``is_leaf`` keeps a tuple that is one value (torch's ``Size``) whole."""
    if isinstance(value, (tuple, list)) and not is_leaf(value):
        for i, item in enumerate(value):
            yield from flatten(item, f"{prefix}.{i}" if prefix else str(i), is_leaf=is_leaf)
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from flatten(item, f"{prefix}.{key}" if prefix else str(key), is_leaf=is_leaf)
    else:
        yield prefix or "0", value


def rebuild_call(values: list[tuple[str, Any]]) -> tuple[tuple, dict[str, Any]]:
    """``[(argument path, value)]`` -> ``(args, kwargs)`` for calling the layer."""
    root: dict[str, Any] = {}
    for path, value in values:
        parts = path.split(".")
        node = root
        for part in parts[:-1]:
            node = node.setdefault(part, {})
        node[parts[-1]] = _Leaf(value)
    positional = sorted((k for k in root if k.isdigit()), key=int)
    if positional != [str(i) for i in range(len(positional))]:
        raise DiffError(f"recorded positional arguments {positional} have gaps; the call "
                        "cannot be rebuilt")
    args = tuple(_freeze(root[k]) for k in positional)
    kwargs = {k: _freeze(v) for k, v in root.items() if not k.isdigit()}
    return args, kwargs


def _freeze(node: Any) -> Any:
    if isinstance(node, _Leaf):
        return node.value
    if node and all(k.isdigit() for k in node):
        return tuple(_freeze(node[str(i)]) for i in range(len(node)))
    return {k: _freeze(v) for k, v in node.items()}


class NotPlainData:
    """A recorded argument capture could keep only as its type and repr (a Hugging Face
    ``DynamicCache``): it cannot be rebuilt, so it can be left out of a call, never passed."""

    def __init__(self, type_name: str, text: str) -> None:
        self.type_name, self.text = type_name, text

    def __repr__(self) -> str:
        return f"<{self.type_name}, not plain data>"


def plain_value(text: str, where: str) -> Any:
    """A recorded non-tensor argument, or an error when capture could only keep its repr."""
    value = recorded_value(text)
    if isinstance(value, NotPlainData):
        raise DiffError(f"{where} was recorded as {value.type_name} {value.text}, which is not "
                        "plain data: the call cannot be rebuilt for replay")
    return value


def recorded_value(text: str) -> Any:
    """A recorded non-tensor argument, or :class:`NotPlainData` where capture kept its repr."""
    value = json.loads(text) if text else None
    if isinstance(value, dict) and set(value) == {"repr", "type"}:
        return NotPlainData(str(value["type"]), str(value["repr"]))
    return value


def describe_value(value: Any) -> str:
    """What an argument holds, in a few words for a message: ``float32 (4,1,16,16)`` for a
    tensor, ``(float32 (1,16,16), float32 (1,16,16))`` for a tuple of them, the repr of plain
    data (cut at 40 characters)."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        dtype = str(value.dtype).removeprefix("torch.")
        return f"{dtype} ({','.join(str(n) for n in value.shape)})"
    if isinstance(value, NotPlainData):
        return f"{value.type_name}, not plain data"
    if isinstance(value, (tuple, list)) and any(hasattr(v, "shape") for v in value):
        inner = ", ".join(describe_value(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if isinstance(value, dict) and any(hasattr(v, "shape") for v in value.values()):
        return "{" + ", ".join(f"{k}: {describe_value(v)}" for k, v in value.items()) + "}"
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def map_argument(path: str, args: dict[str, str]) -> str:
    """A reference argument path under the port's names (the top-level part is mapped).

    A rule with an empty port name drops the argument (``dropped_arguments``): it is no
    rename, so the path keeps its reference name."""
    if path in args:  # a rule for the whole path wins over its head's
        return args[path] or path
    head, dot, rest = path.partition(".")
    return args[head] + dot + rest if args.get(head) else path


def dropped_arguments(args: dict[str, str]) -> frozenset[str]:
    """Reference arguments the mapping drops (``args = { past_key_values = "" }``): the port
    has no such argument, so they are left out of its call."""
    return frozenset(name for name, port in args.items() if port == "")
