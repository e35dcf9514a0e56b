"""Replaying calls into a port that is not torch: per-site callables.

A port gives ``layers``: module path -> an object with

- ``forward(inputs, weights) -> (outputs, context)``: ``inputs`` and ``outputs`` map argument
  paths (``"0"``, ``"1"``, ``"mask"``) to numpy arrays or plain values; ``weights`` maps the
  module's parameter names to arrays, taken from the reference trace;
- ``backward(context, grad_outputs) -> (grad_inputs, weight_grads)``, all dicts of arrays.

and optionally ``type_name``. See ``reference_models.convlstm_numpy.layers`` for an example.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from layerdiff.compare.shapes import as_shape
from layerdiff.errors import DiffError
from layerdiff.replay.recorded import RecordedCall, read_value, reference_weights
from layerdiff.trace import Trace, TraceWriter, schema
from layerdiff.trace.arguments import map_argument
from layerdiff.trace.schema import Role


class Layer(Protocol):
    def forward(self, inputs: dict[str, Any],
                weights: dict[str, np.ndarray]) -> tuple[dict[str, Any], Any]: ...

    def backward(self, context: Any, grad_outputs: dict[str, np.ndarray]
                 ) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]: ...


class CallablePort:
    """A port's per-site callables, replayed one recorded call at a time."""

    def __init__(self, layers: dict[str, Layer], ref: Trace) -> None:
        self.layers = layers
        self.modules = set(layers)
        self.ref = ref
        self._weights: dict[str, dict[str, np.ndarray]] = {}
        self._weight_grads: dict[str, tuple[str, dict[str, np.ndarray]]] = {}

    def type_of(self, module: str) -> str:
        return getattr(self.layers[module], "type_name", type(self.layers[module]).__name__)

    def replay(self, call: RecordedCall, site: str, args_map: dict[str, str],
               writer: TraceWriter, adapter: Any = None) -> None:
        module = schema.split_site(site)[0]
        if adapter is not None:
            raise DiffError(f"port layer {module} is not torch: the mapping's call adapter "
                            f"{adapter[0].spec!r} ({adapter[0].where}) makes a torch call, and "
                            "a numpy layer takes its inputs as a dict by argument path")
        inputs = {}
        for arg, row in call.inputs:
            inputs.setdefault(map_argument(arg, args_map), read_value(self.ref, row))
        for arg, value in inputs.items():
            writer.record(site, Role.INPUT, value, arg=arg)
        if module not in self._weights:
            first = schema.site_name(call.module, 0)  # weights are recorded at the first call
            self._weights[module] = reference_weights(self.ref, first)
            for name, value in self._weights[module].items():
                writer.record(site, Role.WEIGHT, value, arg=name)
        outputs, context = self.layers[module].forward(inputs, self._weights[module])
        for arg, value in outputs.items():
            writer.record(site, Role.OUTPUT, value, arg=arg)
        grads = {arg: read_value(self.ref, row) for arg, row in call.grad_outputs.items()
                 if arg in outputs}
        if not grads:
            return
        for arg, grad in grads.items():
            writer.record(site, Role.GRAD_OUTPUT, grad, arg=arg)
            # in the layer's own output shape where the two differ only by axes of size 1
            grads[arg] = as_shape(grad, np.shape(outputs[arg]))
        grad_inputs, weight_grads = self.layers[module].backward(context, grads)
        wanted = {map_argument(a, args_map) for a in call.grad_input_args}
        for arg, grad in grad_inputs.items():
            if arg in wanted:
                writer.record(site, Role.GRAD_INPUT, grad, arg=arg)
        _, sums = self._weight_grads.setdefault(module, (site, {}))
        for name, grad in weight_grads.items():
            sums[name] = grad if name not in sums else sums[name] + grad

    def finish(self, writer: TraceWriter, complete: set[str]) -> None:
        for module, (site, sums) in self._weight_grads.items():
            if module in complete:
                for name, grad in sums.items():
                    writer.record(site, Role.WEIGHT_GRAD, grad, arg=name)
