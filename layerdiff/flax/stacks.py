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


@dataclass(frozen=True)
class Layer:
    """Layer ``k`` of the stack under ``root`` (``n`` layers along the first axis), and the
    path below the layer of the module a per-layer name stands for ("" for the layer itself,
    ``fc`` for ``layers.K.fc``)."""

    root: str
    k: int
    n: int
    below: str

    @property
    def name(self) -> str:
        return f"{self.root}.{self.k}" + (f".{self.below}" if self.below else "")


def find_layer(name: str, modules: dict[str, Any]) -> Layer | None:
    """The stack layer a per-layer module name stands for (``layers.1.fc``: layer 1 of the
    stack ``layers``, its ``fc``) where ``modules`` (the model's, by path) has the stack and
    not the name itself; None otherwise. A stack is a module every variable of which has the
    same first axis, longer than the layer's number (as the weight load reads one), whose
    path with the layer's number is the name."""
    if name in modules:
        return None
    parts = name.split(".")
    for i in range(1, len(parts)):
        if not parts[i].isdigit():
            continue
        root, below = ".".join(parts[:i]), ".".join(parts[i + 1:])
        if root not in modules or root == schema.ROOT_MODULE:
            continue
        if below and ".".join(parts[:i] + parts[i + 1:]) not in modules:
            continue
        found = list(shapes(modules[root]).values())
        n = found[0][0] if found and found[0] else 0
        if int(parts[i]) < n and _all_stacked(found, 0, n):
            return Layer(root, int(parts[i]), n, below)
    return None


def layer_slice(stacked: Any, k: int, n: int) -> Any:
    """A stacked module's layer ``k`` as a module of its own: the same graph definition over
    slice ``k`` of every leaf of its state whose first axis is the stack's ``n`` (its random
    streams' keys and counts too, as nnx.split_rngs split them). A copy: setting its variables
    leaves the stack as it was."""
    import jax

    graphdef, state = nnx.split(stacked)
    sliced = jax.tree.map(
        lambda leaf: leaf[k] if np.ndim(leaf) and np.shape(leaf)[0] == n else leaf, state)
    return nnx.merge(graphdef, sliced)


def below(module: Any, path: str) -> Any:
    """The submodule of ``module`` at the dotted ``path`` ("" for itself)."""
    for key in path.split(".") if path else []:
        module = module[int(key)] if key.isdigit() and not hasattr(module, key) else getattr(
            module, key)
    return module


class WithLayers(dict):
    """A model's modules by path (:class:`~layerdiff.flax.graph.ModelGraph`'s names), and
    each layer of a stack under its per-layer name (``layers.1``, ``layers.1.fc``), made on
    first ask as a slice of the stack (:func:`layer_slice`) and kept: replay and swap run a
    layer of a scanned stack as any other module. ``owners`` gives each sliced variable's
    owner and name (``layers.1.fc``, ``kernel``) by its identity, as the model's graph does."""

    def __init__(self, modules: dict[str, Any]) -> None:
        super().__init__(modules)
        self.model_modules = dict(modules)
        self.owners: dict[int, tuple[str, str]] = {}
        self._slices: dict[tuple[str, int], Any] = {}

    def __contains__(self, name: object) -> bool:
        return dict.__contains__(self, name) or (isinstance(name, str) and self._add(name))

    def __missing__(self, name: str) -> Any:
        if self._add(name):
            return dict.__getitem__(self, name)
        raise KeyError(name)

    def layer(self, name: str) -> Layer | None:
        return find_layer(name, self.model_modules)

    def fresh(self, name: str) -> Any:
        """The module at ``name``; a stack's layer sliced anew from the stack's variables now
        (map-check sets them between calls)."""
        layer = self.layer(name)
        if layer is None:
            return self[name]
        return below(layer_slice(self.model_modules[layer.root], layer.k, layer.n), layer.below)

    def _add(self, name: str) -> bool:
        layer = self.layer(name)
        if layer is None:
            return False
        key = (layer.root, layer.k)
        if key not in self._slices:
            self._slices[key] = sliced = layer_slice(self.model_modules[layer.root], layer.k,
                                                     layer.n)
            self._own(sliced, f"{layer.root}.{layer.k}")
        self[name] = below(self._slices[key], layer.below)
        return True

    def _own(self, sliced: Any, prefix: str) -> None:
        from layerdiff.flax.graph import ModelGraph

        graph = ModelGraph.of(sliced)
        nodes = {tuple(path): node for path, node in nnx.iter_graph(sliced)}
        for owner, owned in graph.owned.items():
            full = prefix if owner == schema.ROOT_MODULE else f"{prefix}.{owner}"
            for variable in owned:
                if variable.state_path in nodes:
                    self.owners[id(nodes[variable.state_path])] = (full, variable.name)
