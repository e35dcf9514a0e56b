"""A Flax NNX port's forward seen with a scanned stack's layers one by one, for the mapping
tools (``map-suggest`` pairs calls; it needs ``layers.0.fc`` ... as a torch port's layer list
gives them).

``nnx.scan`` traces its body once: the copy of the stacked module it calls there is one call
with traced values, standing for every layer. Each module of the model is tagged with its path
for the run (an attribute, which the copies a transform makes carry, as capture tags them); a
copy whose variables are its module's with the first axis taken away is a layer of the stack
(:func:`layerdiff.flax.stacks.sliced_axis`). That call is handed to the hook as layer 0's
(``layers.0``, its children ``layers.0.fc``), and its calls, with the same arguments and
outputs, are handed again as each other layer's, in order, without running anything more:
every layer runs the same code on values of the same shapes. Their values are traced, so they
are no evidence (:meth:`layerdiff.flax.model.FlaxModel.arrays` leaves them out); their names,
classes, shapes and order are.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.case import Case, seed_everything
from layerdiff.flax import stacks
from layerdiff.flax.graph import ModelGraph
from layerdiff.flax.intercept import intercepted
from layerdiff.flax.port import Hook, restored

TAG = "_layerdiff_watched_path"


@dataclass
class _Seen:
    """One call inside a stack's layer: its stacked module's path, class, the bound call (for
    its signature), arguments, outputs and the calls it made."""

    path: str
    type: str
    run: Callable[..., Any]
    args: tuple
    kwargs: dict
    out: Any = None
    inner: list[_Seen] = field(default_factory=list)


class _LayerWatcher:
    def __init__(self, modules: dict[str, nnx.Module], hook: Hook) -> None:
        self.modules = modules
        self.names = {id(module): path for path, module in modules.items()}
        self.hook = hook
        self.shapes: dict[str, dict[tuple, tuple[int, ...]]] = {}
        self.stacks: dict[str, stacks.Stack] = {}  # stacked module path -> its stack
        self.done: set[str] = set()                  # stacks whose layers were handed over
        self.inside: tuple[stacks.Stack, list[_Seen]] | None = None

    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any:
        run = types.MethodType(original, module)
        path = self.names.get(id(module))
        if path is not None:
            return self.hook(path, type(module).__name__, run, args, kwargs)
        path = vars(module).get(TAG)
        if path is None or path not in self.modules:
            return run(*args, **kwargs)
        stack = self._stack(module, path)
        if stack is None:  # a copy of the same shapes (nnx.jit, nnx.remat): the module itself
            return self.hook(path, type(module).__name__, run, args, kwargs)
        if self.inside is None and stack.root in self.done:  # the body traced again
            return run(*args, **kwargs)
        seen = _Seen(path, type(module).__name__, run, args, kwargs)
        if self.inside is not None:  # a call inside layer 0: named as layer 0's, kept
            outer, self.inside = self.inside, (stack, seen.inner)
            outer[1].append(seen)
            try:
                return self._as_layer_0(seen, stack)
            finally:
                self.inside = outer
        self.done.add(stack.root)
        self.inside = (stack, seen.inner)
        try:
            out = self._as_layer_0(seen, stack)
        finally:
            self.inside = None
        for k in range(1, stack.n):
            self._again(seen, stack, k)
        return out

    def _as_layer_0(self, seen: _Seen, stack: stacks.Stack) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            seen.out = seen.run(*args, **kwargs)
            return seen.out

        return self.hook(stack.name(seen.path, 0), seen.type, functools.wraps(seen.run)(run),
                         seen.args, seen.kwargs)

    def _again(self, seen: _Seen, stack: stacks.Stack, k: int) -> None:
        def run(*args: Any, **kwargs: Any) -> Any:
            for inner in seen.inner:
                self._again(inner, stack, k)
            return seen.out

        self.hook(stack.name(seen.path, k), seen.type, functools.wraps(seen.run)(run),
                  seen.args, seen.kwargs)

    def _stack(self, module: Any, path: str) -> stacks.Stack | None:
        if path not in self.shapes:
            self.shapes[path] = stacks.shapes(self.modules[path])
        found = stacks.sliced_axis(self.shapes[path], stacks.shapes(module), path)
        if found is None:
            inside = self.inside
            return inside[0] if inside and stacks_under(path, inside[0].root) else None
        axis, n = found
        stack = stacks.Stack(stacks.stack_root(self.modules, path, axis, n), n, axis)
        self.stacks[path] = stack
        return stack


def stacks_under(path: str, root: str) -> bool:
    return path == root or path.startswith(root + ".")


def watched_layers(case: Case, hook: Hook) -> tuple[Any, dict[str, stacks.Stack]]:
    """The case's forward once (seeded, matmuls at full float32, variables put back), every
    submodule call through ``hook`` and a scanned stack's layers one by one (see the module's
    docstring); with the stacks found, by stacked module path (``layers``, ``layers.fc``)."""
    graph = ModelGraph.of(case.model)
    modules = dict(graph.modules)
    watcher = _LayerWatcher(modules, hook)
    inputs = jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v,
                          case.inputs)
    tagged = []
    for path, module in modules.items():
        if TAG not in vars(module):
            object.__setattr__(module, TAG, path)
            tagged.append(module)
    seed_everything(case.seed)
    try:
        with restored(case.model), jax.default_matmul_precision("float32"), intercepted(
                list(modules.values()), watcher):
            out = case.model(**inputs) if isinstance(inputs, dict) else case.model(*inputs)
    finally:
        for module in tagged:
            object.__delattr__(module, TAG)
    return out, watcher.stacks
