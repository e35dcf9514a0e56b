"""What map-check and map-suggest need of a Flax NNX port model
(:class:`layerdiff.replay.ports.PortModel`), from :mod:`layerdiff.flax.port` and
:mod:`layerdiff.flax.weights`."""

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

    @property
    def name(self) -> str:
        return self.case.name or type(self.model).__name__

    def modules(self) -> dict[str, str]:
        return self._port.module_paths(self.model)

    def resolve(self, reference: dict[str, np.ndarray], mapping: Mapping) -> list[Assignment]:
        return self._weights.resolve_nnx(self.model, reference, mapping, "the reference trace")

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return self._weights.variable_shapes(self.model)

    def buffers(self) -> set[str]:
        return self._port.state_names(self.model)

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
        return [(arg, self._port.to_numpy(leaf) if self._port.is_array(leaf) else leaf)
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
        return self._port.watched_forward(self.case, hook)
