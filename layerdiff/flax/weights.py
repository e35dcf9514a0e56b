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

A layer stack (one module whose variables hold N layers along their first axis, built with
``nnx.vmap`` and run with ``nnx.scan``: ``layers.fc.kernel`` of shape ``(N, in, out)``) loads
from the reference's per-layer tensors by the same rules as an unrolled port: a stacked
variable that no rule sources under its own name is N layers ``layers.0.fc.kernel`` ...
``layers.{N-1}.fc.kernel`` (:func:`layerdiff.flax.stacks.layer_names`), each resolved through
the mapping as any variable is (``*.kernel`` from ``*.weight``, transposed) and the N results
stacked; capture records each layer under the same names.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.errors import MappingError
from layerdiff.flax import stacks
from layerdiff.flax.graph import ModelGraph, path_name
from layerdiff.mapping import Mapping
from layerdiff.trace import open_trace
from layerdiff.weights import (
    KEPT,
    NO_SOURCE,
    PORT_OWN,
    Assignment,
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
    return load_nnx_arrays(model, reference, mapping, source=str(trace_path))


def load_nnx_arrays(model: nnx.Module, reference: dict[str, np.ndarray],
                    mapping: str | os.PathLike | Mapping | None = None, *,
                    source: str = "the reference") -> WeightsReport:
    """:func:`load_nnx_weights` from a live reference's arrays (name -> array: swap's
    reference has no trace); ``source`` names the reference in errors."""
    mapping = as_mapping(mapping)
    variables = nnx_variables(model)
    aliases = _aliases(ModelGraph.of(model), variables)
    assignments = resolve_nnx(model, reference, mapping, source)
    refuse_unloadable(assignments, reference, mapping, source)
    report = WeightsReport({found.port: found.source.reference for found in assignments
                            if found.problem != PORT_OWN},
                           unused_reference(reference, assignments),
                           kept={found.port: found.note.removeprefix(KEPT)
                                 for found in assignments if found.problem == PORT_OWN})
    layers: dict[str, dict[int, np.ndarray]] = {}
    for found in assignments:
        if found.problem == PORT_OWN:
            continue
        name, k = _slot(_canonical(found.port, aliases), variables)
        variable = variables[name]
        target = variable.get_value().dtype
        value = np.asarray(found.value)
        if np.issubdtype(value.dtype, np.floating) and value.dtype != target:
            how = f"{value.dtype} -> {target}"
            report.cast[how] = report.cast.get(how, 0) + 1
        if k is None:
            variable.set_value(jnp.asarray(value, dtype=target))
        else:
            layers.setdefault(name, {})[k] = value
    for name, parts in layers.items():  # a stack's layers, set together
        variable = variables[name]
        variable.set_value(jnp.asarray(np.stack([parts[k] for k in sorted(parts)]),
                                       dtype=variable.get_value().dtype))
    return report


def variable_shapes(model: nnx.Module) -> dict[str, tuple[int, ...]]:
    """Every name a load can set, with its shape: a tied variable under each of its names."""
    variables = nnx_variables(model)
    aliases = _aliases(ModelGraph.of(model), variables)
    return {alias: tuple(variable.get_value().shape) for name, variable in variables.items()
            for alias in aliases.get(name, [name])}


def resolve_nnx(model: nnx.Module, reference: dict[str, np.ndarray], mapping: Mapping,
                source: str) -> list[Assignment]:
    """:func:`layerdiff.weights.resolve_weights` for an NNX model: one assignment per variable
    (a tied one once, under the name the mapping sources), changing nothing. ``source`` names
    the reference in errors."""
    variables = nnx_variables(model)
    graph = ModelGraph.of(model)
    modules = {path for path, _ in graph.modules}
    found = resolve_shapes(variable_shapes(model), modules, reference, mapping, world=(0, 1))
    found = [layer for one in found
             for layer in (_layers(one, modules, reference, mapping) or [one])]
    return _one_per_variable(found, _aliases(graph, variables), source)


def _layers(found: Assignment, modules: set[str], reference: dict[str, np.ndarray],
            mapping: Mapping) -> list[Assignment]:
    """A variable no rule sources under its own name, as the layers of a stack: one
    assignment per layer (``layers.K.fc.kernel``, its shape without the first axis) when the
    mapping sources every layer, for the highest module above it that makes that so."""
    if found.problem != NO_SOURCE:
        return []
    for root, names in stacks.layer_names(found.port, modules, found.shape):
        below = [m for m in modules if m == root or m.startswith(root + ".")]
        layer_modules = {stacks.Stack(root, len(names), 0).name(m, k)
                         for k in range(len(names)) for m in below}
        layers = resolve_shapes({name: found.shape[1:] for name in names},
                                modules | layer_modules, reference, mapping, world=(0, 1))
        if all(layer.problem != NO_SOURCE for layer in layers):
            return layers
    return []


def _slot(name: str, variables: dict[str, nnx.Variable]) -> tuple[str, int | None]:
    """The variable a name sets, and the layer of its stack when it names one
    (``layers.3.fc.kernel``: layer 3 of ``layers.fc.kernel``)."""
    if name in variables:
        return name, None
    parts = name.split(".")
    for i, part in enumerate(parts):
        stacked = ".".join(parts[:i] + parts[i + 1:])
        if part.isdigit() and stacked in variables and (
                np.ndim(variables[stacked].get_value()) > 0
                and int(part) < np.shape(variables[stacked].get_value())[0]):
            return stacked, int(part)
    return name, None


def set_variable(model: nnx.Module, name: str, value: np.ndarray,
                 variables: dict[str, nnx.Variable] | None = None) -> None:
    """Set the variable ``name`` (any of a tied variable's names) to ``value``, cast to its
    dtype; ``variables`` (:func:`nnx_variables`) saves walking the model each time."""
    variables = nnx_variables(model) if variables is None else variables
    if name not in variables:
        name = _canonical(name, _aliases(ModelGraph.of(model), variables))
    name, k = _slot(name, variables)
    variable = variables[name]
    value = jnp.asarray(np.asarray(value), dtype=variable.get_value().dtype)
    variable.set_value(value if k is None else variable.get_value().at[k].set(value))


def _aliases(graph: ModelGraph, variables: dict[str, nnx.Variable]) -> dict[str, list[str]]:
    """Each tied variable's every name (``lm_head.wte.embedding`` and
    ``transformer.wte.embedding``), under the name the state gives it."""
    return {path_name(first): names for first, names in graph.shared
            if path_name(first) in variables}


def _canonical(name: str, aliases: dict[str, list[str]]) -> str:
    return next((key for key, names in aliases.items() if name in names), name)


def _one_per_variable(assignments: list[Assignment], aliases: dict[str, list[str]],
                      source: str) -> list[Assignment]:
    """A tied variable is loaded once, from whichever of its names the mapping sources (NNX
    lists it under one path only, often not the one the reference's name pairs with); two
    names sourced with different values are refused: the port ties what the reference does
    not."""
    by_name = {found.port: found for found in assignments}
    every_alias = {alias for names in aliases.values() for alias in names}
    kept = [found for found in assignments if found.port not in every_alias]
    for names in aliases.values():
        group = [by_name[name] for name in names if name in by_name]
        sourced = [found for found in group if found.problem != NO_SOURCE]
        loaded = [found for found in sourced if not found.problem and found.value is not None]
        for other in loaded[1:]:
            if not np.array_equal(np.asarray(other.value), np.asarray(loaded[0].value)):
                raise MappingError(
                    f"weights from {source}: port {loaded[0].port} and {other.port} are one "
                    f"tied variable, but the reference gives them different values "
                    f"({', '.join(loaded[0].source.reference)} and "
                    f"{', '.join(other.source.reference)}); untie them in the port or source "
                    "only one of the names in the mapping")
        kept.append((sourced or group)[0])
    return kept
