"""What map-check and map-suggest need of a Flax NNX port model
(:class:`layerdiff.replay.ports.PortModel`), from :mod:`layerdiff.flax.port` and
:mod:`layerdiff.flax.weights`.

A layer stack the port runs with ``nnx.scan`` (one module ``layers`` whose variables hold N
layers along their first axis) is shown as a torch port's layer list would be: modules
``layers.0`` ... ``layers.{N-1}.fc``, tensors ``layers.K.fc.kernel`` (each layer's slice), calls
one layer after another (:mod:`layerdiff.flax.layered`), so the tools pair, draft and check
each layer as they would an unrolled port's, and a glob rule (``layers.*.fc.kernel``) serves
them all. Which modules are stacks, one forward of the case tells (a copy of a module called
with one axis of its variables taken away), found once, when first needed."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import numpy as np

from layerdiff.case import Case
from layerdiff.mapping import Mapping
from layerdiff.replay.ports import Hook
from layerdiff.trace import Trace
from layerdiff.trace.arguments import flatten
from layerdiff.weights import Assignment

CONV_KERNEL = "layerdiff.flax.layouts:conv_kernel"


class FlaxModel:
    """A Flax NNX port model (see the module's docstring); its functions are
    :mod:`layerdiff.flax.port`'s and :mod:`layerdiff.flax.weights`'."""

    framework = "flax"

    def __init__(self, case: Case) -> None:
        from layerdiff.flax import port, weights

        self.case, self.model = case, case.model
        self._port, self._weights = port, weights
        self._variables = weights.nnx_variables(self.model)
        self._stacks: dict[str, Any] | None = None  # stack root -> Stack, once found

    def stacks(self) -> dict[str, Any]:
        """The model's scanned stacks by root path (``layers``), from one forward."""
        if self._stacks is None:
            from layerdiff.flax.layered import watched_layers

            _, found = watched_layers(self.case, lambda path, kind, run, args, kwargs:
                                      run(*args, **kwargs))
            self._stacks = {stack.root: stack for stack in found.values()}
        return self._stacks

    def _stack_of(self, name: str) -> Any:
        """The stack a stacked name (``layers.fc`` or ``layers.fc.kernel``) lies under."""
        return next((stack for root, stack in self.stacks().items()
                     if name == root or name.startswith(root + ".")), None)

    def _per_layer(self, named: dict[str, Any], drop_axis: bool) -> dict[str, Any]:
        """``named`` (by module or tensor path) with each stacked name as its N per-layer
        names (a shape losing the stack's axis where ``drop_axis``), in layer order."""
        out: dict[str, Any] = {}
        held: dict[str, list[tuple[str, Any]]] = {}
        for name, value in named.items():
            stack = self._stack_of(name) if self._may_stack(name) else None
            if stack is None:
                out[name] = value
                continue
            if stack.root not in held:
                held[stack.root] = []
                out[stack.root] = None  # its place
            held[stack.root].append((name, value))
        layered: dict[str, Any] = {}
        for name, value in out.items():
            if name not in held:
                layered[name] = value
                continue
            stack = self.stacks()[name]
            for k in range(stack.n):
                for path, item in held[name]:
                    layered[stack.name(path, k)] = (
                        item[:stack.axis] + item[stack.axis + 1:] if drop_axis else item)
        return layered

    def _may_stack(self, name: str) -> bool:
        """Whether a stack could hold ``name`` (without a forward where the model has none):
        some module's variables all share a first axis longer than one."""
        if self._stacks is not None:
            return True
        return any(len({shape[0] if shape else None for shape in shapes}) == 1
                   and shapes and shapes[0] and shapes[0][0] > 1
                   for shapes in self._module_shapes().values())

    def _module_shapes(self) -> dict[str, list[tuple[int, ...]]]:
        found: dict[str, list[tuple[int, ...]]] = {}
        for name, shape in self._weights.variable_shapes(self.model).items():
            found.setdefault(name.rpartition(".")[0], []).append(tuple(shape))
        return found

    @property
    def name(self) -> str:
        return self.case.name or type(self.model).__name__

    def modules(self) -> dict[str, str]:
        return self._per_layer(self._port.module_paths(self.model), drop_axis=False)

    def resolve(self, reference: dict[str, np.ndarray], mapping: Mapping) -> list[Assignment]:
        """Each variable's source; a stacked one no rule sources as a whole, layer by layer
        (the load reads it so where every layer is sourced; here each layer says its own)."""
        from layerdiff.weights import resolve_shapes

        found = self._weights.resolve_nnx(self.model, reference, mapping, "the reference trace")
        # a stacked variable by its own name (``layers.fc.kernel``), not a layer's
        own = self._weights.variable_shapes(self.model)
        stacked = [one for one in found if one.port in own and self._may_stack(one.port)
                   and self._stack_of(one.port) is not None]
        if not stacked:
            return found
        modules = set(self.modules()) | set(self._port.module_paths(self.model))
        out = []
        for one in found:
            stack = self._stack_of(one.port) if one in stacked else None
            if stack is None:
                out.append(one)
                continue
            shape = one.shape[:stack.axis] + one.shape[stack.axis + 1:]
            out.extend(resolve_shapes({stack.name(one.port, k): shape for k in range(stack.n)},
                                      modules, reference, mapping, world=(0, 1)))
        return out

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._per_layer(self._weights.variable_shapes(self.model), drop_axis=True)

    def buffers(self) -> set[str]:
        return set(self._per_layer({name: None for name in self._port.state_names(self.model)},
                                   drop_axis=False))

    def ties(self) -> list[list[str]]:
        return self._port.tied_names(self.model)

    def set(self, name: str, value: np.ndarray) -> None:
        self._weights.set_variable(self.model, name, value, self._variables)

    def restored(self) -> contextlib.AbstractContextManager[None]:
        return self._port.restored(self.model)

    def replayer(self, ref: Trace) -> Any:
        from layerdiff.flax.replay import FlaxPort

        return FlaxPort(self.model, ref)

    def leaves(self, value: Any) -> list[tuple[str, Any]]:
        return list(flatten(value))

    def is_array(self, value: Any) -> bool:
        return self._port.is_array(value)

    def arrays(self, value: Any) -> list[tuple[str, Any]]:
        """Its arrays as numpy; a traced one (a scanned layer's, :mod:`layerdiff.flax.layered`)
        has no value and is left as it is: no evidence."""
        import jax

        return [(arg, self._port.to_numpy(leaf) if self._port.is_array(leaf)
                 and not isinstance(leaf, jax.core.Tracer) else leaf)
                for arg, leaf in flatten(value)]

    def eps(self, value: Any) -> float:
        return max([float(np.finfo(self._port.to_numpy(leaf).dtype).eps)
                    for _, leaf in flatten(value) if self._port.is_array(leaf)
                    and np.issubdtype(self._port.to_numpy(leaf).dtype, np.floating)],
                   default=0.0)

    def layout_conversions(self) -> list[tuple[str, Callable[[tuple[int, ...]], Any]]]:
        """A convolution's kernel: torch's (out, in, *spatial) as Flax's (*spatial, in, out),
        :func:`layerdiff.flax.layouts.conv_kernel`."""
        return [(CONV_KERNEL, lambda shape: (*shape[2:], shape[1], shape[0])
                 if 3 <= len(shape) <= 5 else None)]

    def dense_layout(self, type_name: str) -> str | None:
        """nnx.Linear keeps its kernel (in, out)."""
        return "in_out" if type_name in ("Linear", "LinearGeneral", "Einsum") else None

    def watch(self, hook: Hook) -> Any:
        """The case's forward, every call through ``hook``, a stack's layers one by one."""
        from layerdiff.flax.layered import watched_layers

        out, found = watched_layers(self.case, hook)
        if self._stacks is None:
            self._stacks = {stack.root: stack for stack in found.values()}
        return out
