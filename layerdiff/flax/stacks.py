"""Layer stacks: one NNX module whose variables hold N layers along one axis (built with
``nnx.vmap``, run with ``nnx.scan``), named as torch names a layer list.

The stacked module ``layers`` (its kernel ``(N, d, d)``) is layer ``K`` under the name
``layers.K``: its sites are ``layers.K#0``, ``layers.K.fc#0``, its weights the K-th slice
(``layers.K.fc.kernel``, ``(d, d)``). The *root* of a stack is the highest module above a
sliced one (the model itself never) all of whose variables have N along the stacked axis:
capture names sites by it and the weight load fills a stacked variable by it, so the two agree.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
from flax import nnx

from layerdiff.errors import CaptureError
from layerdiff.trace import schema


@dataclass(frozen=True)
class Stack:
    """A stack of ``n`` layers along ``axis`` of every variable under ``root``."""

    root: str
    n: int
    axis: int

    def name(self, path: str, k: int) -> str:
        """``layers.fc`` as layer ``k``'s: ``layers.K.fc``."""
        return f"{self.root}.{k}{path[len(self.root):]}"

    def take(self, value: Any, k: int) -> np.ndarray:
        """Layer ``k``'s slice of a stacked value."""
        return np.take(np.asarray(value), k, axis=self.axis)


def shapes(module: Any) -> dict[tuple, tuple[int, ...]]:
    """Each variable's shape under ``module``, by its path there (random state left out)."""
    found = {}
    for path, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState):
            found[tuple(path)] = tuple(np.shape(node.get_value()))
    return found


def sliced_axis(original: dict[tuple, tuple[int, ...]], copy: dict[tuple, tuple[int, ...]],
                path: str) -> tuple[int, int] | None:
    """``(axis, n)`` when every variable of ``copy`` is its ``original``'s with one axis of
    size ``n`` taken away (a layer of a stack); None when they are the same shapes."""
    pairs = [(original[key], shape) for key, shape in copy.items() if key in original]
    if all(a == b for a, b in pairs):
        return None
    for axis in range(max(len(a) for a, _ in pairs)):
        sizes = {a[axis] for a, b in pairs if len(a) > axis and a[:axis] + a[axis + 1:] == b}
        if len(sizes) == 1 and all(len(a) > axis and a[:axis] + a[axis + 1:] == b
                                   for a, b in pairs):
            return axis, sizes.pop()
    raise CaptureError(
        f"a copy of module {path} made by an NNX transform holds variables of shapes "
        f"{[b for _, b in pairs][:3]} where the model's are {[a for a, _ in pairs][:3]}: "
        "neither the same nor one slice along a common axis, so layerdiff cannot tell which "
        "layer of a stack it is; capture the stack unrolled (an nnx.List of layers)")


def stack_root(modules: dict[str, Any], path: str, axis: int, n: int) -> str:
    """The highest module above ``path`` (itself included, the model never) whose every
    variable has ``n`` along ``axis``."""
    root = path
    parts = path.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        above = ".".join(parts[:depth])
        if above not in modules or not _all_stacked(shapes(modules[above]).values(), axis, n):
            break
        root = above
    return root


def _all_stacked(found: Iterable[tuple[int, ...]], axis: int, n: int) -> bool:
    found = list(found)
    return bool(found) and all(len(s) > axis and s[axis] == n for s in found)


def layer_names(name: str, module_paths: Iterable[str], shape: tuple[int, ...]
                ) -> list[tuple[str, list[str]]]:
    """For a variable ``name`` whose first axis may stack layers: each candidate root (highest
    first) with the per-layer names it would give (``layers.0.fc.kernel`` ...)."""
    if not shape:
        return []
    paths = set(module_paths)
    parts = name.split(".")
    found = []
    for depth in range(1, len(parts)):
        root = ".".join(parts[:depth])
        if root in paths and root != schema.ROOT_MODULE:
            rest = ".".join(parts[depth:])
            found.append((root, [f"{root}.{k}.{rest}" for k in range(shape[0])]))
    return found


def first_value(module: Any) -> list[Any]:
    """The value of ``module``'s first variable, if it has one (a loop-varying operand)."""
    for _, node in nnx.iter_graph(module):
        if isinstance(node, nnx.Variable) and not isinstance(node, nnx.RngState):
            return [node.get_value()]
    return []


def stacked_module(module: str, modules: Iterable[str]) -> str | None:
    """The stacked module a per-layer name stands for (``layers.1.fc`` -> ``layers.fc``) when
    ``modules`` has it and not the name itself; None otherwise."""
    paths = set(modules)
    if module in paths:
        return None
    parts = module.split(".")
    for i, part in enumerate(parts):
        stacked = ".".join(parts[:i] + parts[i + 1:])
        if part.isdigit() and stacked in paths:
            return stacked
    return None
