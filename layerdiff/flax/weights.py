"""A torch reference's weights set into a Flax NNX port, through the same mapping files and
with the same checks and messages as a torch port (:mod:`layerdiff.weights`).

Names are the Flax model's own: ``fc1.kernel``, ``blocks.0.attn.qkv.kernel``, ``norm.scale``,
``embed.embedding``, BatchNorm's ``bn.mean`` and ``bn.var`` (its state, as torch's buffers are).
Layouts differ from torch's and the mapping says how: a ``Linear`` kernel is ``(in, out)``
where torch's weight is ``(out, in)``: ``transform = "transpose"``; a ``Conv`` kernel is
``(*spatial, in, out)`` (HWIO) where torch's is ``(out, in, *spatial)`` (OIHW), which a
transpose (all axes reversed: WHIO) does not give: ``transform =
"layerdiff.flax.layouts:conv_kernel"`` does, for 1, 2 and 3 spatial axes. ``Embed.embedding``
and LayerNorm's ``scale`` (torch's ``weight``) keep torch's layout and need a rename only.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.flax.graph import ModelGraph, path_name
from layerdiff.mapping import Mapping
from layerdiff.trace import open_trace
from layerdiff.weights import (
    KEPT,
    PORT_OWN,
    WeightsReport,
    as_mapping,
    refuse_unloadable,
    resolve_shapes,
    trace_weights,
    unused_reference,
)


def nnx_variables(model: nnx.Module) -> dict[str, nnx.Variable]:
    """The variables a load sets, by full name: parameters and state such as BatchNorm's
    statistics; random-number state is the port's own."""
    return {path_name(path): variable
            for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Not(nnx.RngState)))}


def load_nnx_weights(model: nnx.Module, trace_path: str | os.PathLike,
                     mapping: str | os.PathLike | Mapping | None = None) -> WeightsReport:
    """Set every variable of ``model`` from the reference trace's step-0 weights through
    ``mapping`` (cast to the variable's dtype). Raises :class:`MappingError` in one sentence
    for a shape that does not fit or a variable nothing in the reference gives."""
    with open_trace(trace_path) as trace:
        reference = trace_weights(trace)
    mapping = as_mapping(mapping)
    variables = nnx_variables(model)
    modules = {path for path, _ in ModelGraph.of(model).modules}
    shapes = {name: tuple(variable.get_value().shape) for name, variable in variables.items()}
    assignments = resolve_shapes(shapes, modules, reference, mapping, world=(0, 1))
    refuse_unloadable(assignments, reference, mapping, str(trace_path))
    report = WeightsReport({found.port: found.source.reference for found in assignments
                            if found.problem != PORT_OWN},
                           unused_reference(reference, assignments),
                           kept={found.port: found.note.removeprefix(KEPT)
                                 for found in assignments if found.problem == PORT_OWN})
    for found in assignments:
        if found.problem == PORT_OWN:
            continue
        variable = variables[found.port]
        target = variable.get_value().dtype
        value = np.asarray(found.value)
        if np.issubdtype(value.dtype, np.floating) and value.dtype != target:
            how = f"{value.dtype} -> {target}"
            report.cast[how] = report.cast.get(how, 0) + 1
        variable.set_value(jnp.asarray(value, dtype=target))
    return report
