"""Moving weights from a reference trace into a port, through the same mapping the diff uses.

``load_weights(port_model, "ref.h5", mapping="port.map.toml")`` sets every parameter and buffer
of the port from the reference's ``weight`` records of step 0: renamed, transposed, split or
concatenated (or a chain of these, in order) as the mapping says, shape-checked, cast to the
port's dtype. :func:`resolve_weights` says what each port tensor would get without setting
anything; ``load_weights`` and ``map_check`` both stand on it.

A chain may hold conversion functions (``"pkg.module:function"``, tensor -> tensor), applied in
order with the built-ins (:func:`combine`); a port tensor whose chain has one is compared with
the reference through it: weights as ``f(reference)`` against the port's, weight gradients
pulled back through the chain (:func:`pull_back`). Port tensors that nothing in the reference
provides and that an ``[[unmatched]] port =`` entry declares are kept as the port's own.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.errors import MappingError, TraceError
from layerdiff.mapping import CodeRef, Mapping, ParamSource, Slice
from layerdiff.mapping.code import is_code
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.joins import declared_layout
from layerdiff.trace.layout import LayoutError
from layerdiff.trace.schema import Role


@dataclass
class WeightsReport:
    loaded: dict[str, list[str]] = field(default_factory=dict)  # port name -> reference names
    unused: list[str] = field(default_factory=list)             # reference tensors not used
    cast: dict[str, int] = field(default_factory=dict)          # "float32 -> bfloat16": count
    kept: dict[str, str] = field(default_factory=dict)  # port-only tensors left as they were: why

    def summary(self) -> str:
        text = f"loaded {len(self.loaded)} port tensors from the reference"
        if self.cast:
            text += " (cast " + ", ".join(f"{n} {how}" for how, n in self.cast.items()) + ")"
        if self.kept:
            shown = "; ".join(f"{name} ({why})" for name, why in list(self.kept.items())[:4])
            text += (f"; kept the port's own: {shown}"
                     + (f" and {len(self.kept) - 4} more" if len(self.kept) > 4 else ""))
        if self.unused:
            shown = ", ".join(self.unused[:4]) + (" ..." if len(self.unused) > 4 else "")
            text += f"; {len(self.unused)} reference tensors unused ({shown})"
        return text


def load_weights(model: nn.Module, trace_path: str | os.PathLike,
                 mapping: str | os.PathLike | Mapping | None = None) -> WeightsReport:
    """Set ``model``'s parameters and buffers from the reference trace's step-0 weights.

    Raises :class:`MappingError` naming both sides when a shape does not fit, and listing the
    port tensors that nothing in the reference provides.
    """
    with open_trace(trace_path) as trace:
        reference = trace_weights(trace)
        called = set(trace.sites["module"]) if _drops_uncalled(trace.meta) else None
        described = described_weights(trace)
    return load_weights_from(model, reference, mapping, source=str(trace_path),
                             called_modules=called, described=described)


def described_weights(trace: Trace) -> dict[str, str]:
    """Full name -> layout of each first-step weight the trace could keep only as its layout,
    shape and dtype (a sparse buffer): no values to load."""
    rows = trace.records(trace.index["step"].min(), role=Role.WEIGHT, kind="value")
    found = {}
    for _, row in rows.iterrows():
        try:
            value = json.loads(row["value"])
        except (TypeError, ValueError):
            continue
        if isinstance(value, dict) and "unsupported_tensor" in value:
            found[schema.param_name(row["site"], row["arg"])] = str(
                value["unsupported_tensor"]).removeprefix("torch.")
    return found


def _drops_uncalled(meta: dict[str, Any]) -> bool:
    """A torch capture from before the tensors of modules that are never called were recorded
    at their caller, of every module (a narrowed one leaves modules out for its own reason)."""
    return (str(meta.get("producer", "")).startswith("layerdiff.capture (torch)")
            and "uncalled_weights" not in meta
            and not meta.get("include") and not meta.get("exclude"))


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """A live model's parameters and buffers as numpy, by name (a reference without a trace)."""
    return {name: _to_numpy(tensor) for name, tensor in model.state_dict().items()}


def load_weights_from(model: nn.Module, reference: dict[str, np.ndarray],
                      mapping: str | os.PathLike | Mapping | None = None, *,
                      source: str = "the reference",
                      called_modules: Collection[str] | None = None,
                      described: dict[str, str] | None = None) -> WeightsReport:
    """Set ``model``'s parameters and buffers from ``reference`` (name -> array) through
    ``mapping``; see :func:`load_weights`. ``called_modules``, the modules with sites in a
    reference trace captured before the tensors of modules that are never called were
    recorded, lets a tensor missing from it be explained. ``described`` (full name ->
    layout) are reference tensors recorded without their values (sparse): a port tensor that
    only they would give keeps its own, saying so."""
    mapping = as_mapping(mapping)
    assignments = resolve_weights(model, reference, mapping)
    for found in assignments:
        absent = [ref for ref in found.source.reference if ref not in reference]
        if found.problem == NO_SOURCE and described and absent and all(
                ref in described for ref in absent):
            found.problem = PORT_OWN
            found.note = KEPT + ", ".join(
                f"the reference's trace holds {ref} ({described[ref]}) as its layout, shape "
                "and dtype alone" for ref in absent)
    refuse_unloadable(assignments, reference, mapping, source, called_modules)
    targets = port_tensors(model)
    report = WeightsReport({found.port: found.source.reference for found in assignments
                            if found.problem != PORT_OWN},
                           unused_reference(reference, assignments),
                           kept={found.port: found.note.removeprefix(KEPT)
                                 for found in assignments if found.problem == PORT_OWN})
    with torch.no_grad():
        for found in assignments:
            if found.problem == PORT_OWN:
                continue
            target = targets[found.port]
            value = torch.from_numpy(np.array(found.value, order="C"))
            if value.is_floating_point() and value.dtype != target.dtype:
                how = (f"{str(value.dtype).removeprefix('torch.')} -> "
                       f"{str(target.dtype).removeprefix('torch.')}")
                report.cast[how] = report.cast.get(how, 0) + 1
            value = value.to(target.dtype)
            if target.layout is not torch.strided:  # a port holding it sparse: made sparse
                value = value.to_sparse(layout=target.layout)
            target.copy_(value)
    return report


def refuse_unloadable(assignments: list[Assignment], reference: dict[str, np.ndarray],
                      mapping: Mapping, source: str,
                      called_modules: Collection[str] | None = None) -> None:
    """Raise :class:`MappingError` in one sentence when a port tensor's shape does not fit
    what the mapping makes, or nothing in the reference gives one (any framework's port)."""
    for found in assignments:
        if found.problem == SHAPE_MISMATCH:
            fix = (f"fix the [[param]] rule in {mapping.name}" if mapping.path else
                   "give it a [[param]] rule in a mapping file (--map)")
            raise MappingError(f"weights from {source}: {found.note}; {fix}")
    missing = [found.port for found in assignments if found.problem == NO_SOURCE]
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        uncalled = _never_called(assignments, reference, called_modules)
        rules = (f"add [[site]] or [[param]] rules to "
                 f"{mapping.name if mapping.path else 'a mapping file (--map)'}")
        if uncalled:
            modules = ("module " if len(uncalled) == 1 else "modules ") + ", ".join(
                uncalled[:3]) + (" ..." if len(uncalled) > 3 else "")
            raise MappingError(
                f"weights from {source}: nothing in the reference gives port {shown} "
                f"({len(missing)} tensors), and the reference never called {modules} (a "
                "trace captured before layerdiff recorded the parameters of such modules at "
                f"their caller lacks them): capture the reference again (or {rules})")
        raise MappingError(f"weights from {source}: nothing in the reference gives port "
                           f"{shown} ({len(missing)} tensors); {rules}, or look at the port: "
                           f"{_port_side(missing)}")


def _port_side(missing: list[str]) -> str:
    """Where a port tensor no reference tensor gives may come from the port itself: an extra
    parameter (a bias or a norm weight the reference's layer does not have), or a buffer it
    makes for itself (declared with [[unmatched]])."""
    modules = list(dict.fromkeys(name.rpartition(".")[0] or "<root>" for name in missing))
    shown = ", ".join(modules[:3]) + (" ..." if len(modules) > 3 else "")
    return (f"the port's {'module' if len(modules) == 1 else 'modules'} {shown} may have a "
            "parameter the reference's layer does not (an extra bias or weight: the two "
            "layers differ there), or a buffer it makes itself (declare it with [[unmatched]] "
            f"port = \"{missing[0]}\")")


# ---- resolution: what each port tensor would get (load_weights and map_check share it)

NO_SOURCE = "no-source"
SHAPE_MISMATCH = "shape-mismatch"
PORT_OWN = "port-own"  # no source, and declared the port's own ([[unmatched]] port = ...)
KEPT = "kept the port's own: "


@dataclass
class Assignment:
    """What one port parameter or buffer receives from the reference, or why it cannot."""

    port: str                     # the port tensor's name
    shape: tuple[int, ...]        # its shape
    source: ParamSource           # reference names and the transform chain
    value: np.ndarray | None = None  # what the chain makes (None when it cannot make one)
    problem: str = ""             # "" | NO_SOURCE | SHAPE_MISMATCH | PORT_OWN
    note: str = ""                # the problem, said for people


def as_mapping(mapping: str | os.PathLike | Mapping | None) -> Mapping:
    """A Mapping from a file name, a Mapping, or nothing (names as they are)."""
    if isinstance(mapping, Mapping):
        return mapping
    return Mapping.load(mapping) if mapping is not None else Mapping()


def port_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors a load sets: parameters, and buffers that are part of the state (those
    registered with persistent=False are the port's own)."""
    persistent = set(model.state_dict())
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n in persistent)
    return targets


def resolve_weights(model: nn.Module, reference: dict[str, np.ndarray], mapping: Mapping,
                    world: tuple[int, int] | None = None) -> list[Assignment]:
    """One assignment per port tensor: the reference tensors the mapping gives it, combined
    through the rule's transform chain, cut to this rank's part where a [[shard]] rule says
    (``world``: (rank, world size), by default torch.distributed's), and shape-checked.
    Changes nothing."""
    shapes = {name: tuple(tensor.shape) for name, tensor in port_tensors(model).items()}
    modules = {name for name, _ in model.named_modules() if name}
    return resolve_shapes(shapes, modules, reference, mapping, world)


def resolve_shapes(shapes: dict[str, tuple[int, ...]], port_modules: Collection[str],
                   reference: dict[str, np.ndarray], mapping: Mapping,
                   world: tuple[int, int] | None = None) -> list[Assignment]:
    """:func:`resolve_weights` for a port of any framework, given its tensors' names and
    shapes and its module paths (a Flax model's, see :mod:`layerdiff.flax.weights`)."""
    world = world or rank_and_world()
    partner = mapping.module_partners(
        port_modules, (name.rpartition(".")[0] for name in reference))
    assignments = []
    for name, shape in shapes.items():
        found = mapping.param_source(name, partner) or ParamSource([name])
        absent = [ref for ref in found.reference if ref not in reference]
        why = mapping.why_unmatched("port", name) if absent else None
        if why is not None:  # only where nothing provides it: a declaration never hides a load
            assignments.append(Assignment(name, shape, found, problem=PORT_OWN,
                                          note=KEPT + why))
            continue
        if absent:
            note = f"the reference has no {', '.join(absent)}" + (
                "; no [[param]] rule names it and its module pairs with none by name"
                if found.reference == [name] else "") + (
                "; or a parameter only the port's layer has (an extra bias or weight)")
            assignments.append(Assignment(name, shape, found, problem=NO_SOURCE, note=note))
            continue
        assignments.append(_checked(_shard(_combined(Assignment(name, shape, found),
                                                     reference), mapping, world)))
    return assignments


def rank_and_world() -> tuple[int, int]:
    """This process's rank and world size under torch.distributed; (0, 1) outside it."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _shard(found: Assignment, mapping: Mapping, world: tuple[int, int]) -> Assignment:
    """This rank's part of a tensor a [[shard]] rule cuts (a tensor-parallel port loading
    from a one-process reference): what the rule's layout puts on rank ``rank`` (a split's
    equal part, a zigzag's two chunks, the experts it holds)."""
    rank, size = world
    module, _, leaf = found.port.rpartition(".")
    if size < 2 or found.value is None:
        return found
    value = found.value
    try:
        layout, rules = declared_layout(mapping, module, Role.WEIGHT, leaf, size)
    except TraceError as error:
        found.problem, found.note = SHAPE_MISMATCH, str(error)
        return found
    if layout is None or layout.replicated:
        return found
    problem = ""
    if layout.reduces:
        problem = "declares a partial sum, which a loaded weight cannot be"
    elif any(p.kind == "shard" and (not -value.ndim <= p.dim < value.ndim
                                    or value.shape[p.dim] % m)
             for p, m in zip(layout.placements, layout.mesh, strict=True)):
        problem = f"does not divide it into equal parts ({layout.describe()})"
    else:
        try:
            found.value = np.ascontiguousarray(value[np.ix_(*layout.part_index(
                rank, value.shape))])
        except LayoutError as error:
            problem = f"cannot cut it ({error})"
    if problem:
        found.problem = SHAPE_MISMATCH
        found.note = (f"{'; '.join(rule.describe() for rule in rules)} {problem}: port "
                      f"{found.port} from reference shape {tuple(value.shape)}")
    return found


def unused_reference(reference: dict[str, np.ndarray],
                     assignments: list[Assignment]) -> list[str]:
    """Reference tensors that no port tensor takes anything from."""
    used = {ref for found in assignments if found.problem not in (NO_SOURCE, PORT_OWN)
            for ref in found.source.reference}
    # a tied tensor's other names (trace_weights gives them the same array) are used with it
    used_arrays = {id(reference[ref]) for ref in used if ref in reference}
    return sorted(name for name in set(reference) - used
                  if id(reference[name]) not in used_arrays)


def _combined(found: Assignment, reference: dict[str, np.ndarray]) -> Assignment:
    names = " + ".join(found.source.reference)
    try:
        value = combine(found.source, [reference[n] for n in found.source.reference],
                        port=found.port)
    except ValueError as exc:  # parts that do not concatenate or split: a shape problem too
        found.problem = SHAPE_MISMATCH
        found.note = (f"reference {names} cannot be combined by ({found.source.transform}) "
                      f"for port {found.port}: {exc}")
        return found
    found.value = value
    return found


def _checked(found: Assignment) -> Assignment:
    value = found.value
    if found.problem or value is None or tuple(value.shape) == found.shape:
        return found
    found.problem = SHAPE_MISMATCH
    names = " + ".join(found.source.reference)
    found.note = (f"port {found.port} has shape {found.shape} but reference {names} gives "
                  f"{tuple(value.shape)} ({found.source.transform})")
    return found


def combine(source: ParamSource, parts: list[np.ndarray], *, port: str = "") -> np.ndarray:
    """The port's tensor made from the reference tensors ``parts``: the source's transform
    chain applied in order (a transpose, or a conversion function, before a concat applies to
    every part). A chain with a function runs in torch and comes back as numpy in the
    reference's dtype; ``port`` names the port tensor in its errors."""
    if not source.functions:
        return _chain(source, list(parts), np.concatenate, np.split, lambda a: a.T, None)
    dtypes = [part.dtype for part in parts]
    tensors = [torch.from_numpy(np.array(part, order="C")) for part in parts]
    with torch.no_grad():
        value = apply_chain(source, tensors, port=port)
    return _to_numpy(value).astype(dtypes[0], copy=False)


def apply_chain(source: ParamSource, parts: Sequence[torch.Tensor], *,
                port: str = "") -> torch.Tensor:
    """:func:`combine` on torch tensors, differentiable (the gradient is pulled back through
    it); conversion functions imported and called here."""
    functions = conversions(source)

    def call(step: str, tensor: torch.Tensor) -> torch.Tensor:
        return _call_conversion(step, functions[step], source, tensor, port)

    return _chain(source, list(parts), _torch_concat, _torch_split,
                  lambda t: t.permute(*range(t.ndim - 1, -1, -1)), call)


def _torch_concat(parts: list[torch.Tensor], axis: int) -> torch.Tensor:
    """torch.cat, with numpy's ValueError for parts that do not fit (a shape problem)."""
    try:
        return torch.cat(parts, dim=axis)
    except (RuntimeError, IndexError) as exc:
        raise ValueError(str(exc).splitlines()[0]) from None


def _torch_split(tensor: torch.Tensor, parts: int, axis: int) -> tuple[torch.Tensor, ...]:
    if not -tensor.ndim <= axis < tensor.ndim or tensor.shape[axis] % parts:
        raise ValueError(f"a tensor of shape {tuple(tensor.shape)} does not split into "
                         f"{parts} equal parts along axis {axis}")
    return torch.chunk(tensor, parts, dim=axis)


def _chain(source: ParamSource, parts: list, concat, split, transpose,
           call: Callable[[str, Any], Any] | None):
    for step in source.transforms:
        if step == "concat":
            parts = [concat(parts, source.axis)]
        elif step == "split":
            parts = [split(parts[0], source.parts, source.axis)[source.part]]
        elif step == "transpose":
            parts = [transpose(part) for part in parts]
        elif is_code(step) and call is not None:
            parts = [call(step, part) for part in parts]
    return parts[0]


def conversions(source: ParamSource) -> dict[str, Callable[..., Any]]:
    """The chain's conversion functions, imported (MappingError naming the rule when one does
    not import)."""
    return {ref.spec: ref.resolve() for ref in source.code_refs()}


def _call_conversion(name: str, function: Callable[..., Any], source: ParamSource,
                     tensor: torch.Tensor, port: str) -> torch.Tensor:
    """One conversion step: the user's function on a torch tensor; what it raises, or a result
    that is not a tensor, is one sentence naming the rule, the port tensor and the function."""
    target = f" for port {port}" if port else ""
    try:
        value = function(tensor)
    except Exception as exc:
        raise MappingError(f"{source.where or 'mapping'}: conversion {name} raised "
                           f"{type(exc).__name__} on reference {' + '.join(source.reference)} "
                           f"of shape {tuple(tensor.shape)}{target}: {exc}; fix the function "
                           "(it takes the reference's tensor and returns the port's)") from None
    if not torch.is_tensor(value):
        raise MappingError(f"{source.where or 'mapping'}: conversion {name} returned a "
                           f"{type(value).__name__}{target}, not a torch.Tensor; return the "
                           "port's tensor")
    return value.to(tensor.dtype) if value.is_floating_point() and tensor.is_floating_point() \
        else value


def conversion_refs(mapping: Mapping) -> list[CodeRef]:
    """The conversion functions a mapping's [[param]] rules name (not its call adapters)."""
    names = {step for rule in mapping.param_rules for step in rule.transforms if is_code(step)}
    return [ref for ref in mapping.code_refs() if ref.spec in names]


def conversions_provenance(mapping: str | os.PathLike | Mapping) -> list[dict[str, str]]:
    """What a port trace records of the conversions its weights were loaded through: each
    function's name and its module's source sha256 (``meta.weights.conversions``)."""
    return [ref.provenance() for ref in conversion_refs(as_mapping(mapping))]


def paired_parts(source: ParamSource, references: list, port: Any, *,
                 at: list | None = None) -> list[tuple[str, Any, Any]]:
    """``(reference name, reference tensor, the part of the port's tensor that is it)`` for
    each reference tensor of ``source``: the chain undone. Numpy arrays or torch tensors (a
    weight gradient is paired with its reference's this way).

    A chain with a conversion function cannot be undone by slices: there ``references`` and
    ``port`` are gradients, and the port's is pulled back to each reference tensor through the
    chain (:func:`pull_back`) at the reference's weights ``at``. Without ``at`` the chain must
    be linear (a permutation, a reshape: its pull-back is the same everywhere), which is
    checked; a weight is compared with its reference through :func:`combine` instead."""
    if source.functions:
        pulled = pull_back(source, at, port, like=references)
        return [(name, ref, part) for name, ref, part
                in zip(source.reference, references, pulled, strict=True)]
    shapes = [tuple(r.shape) for r in references]
    pairs = []
    for view in source.views(shapes, tuple(port.shape)):
        ref, part = references[view.reference], port
        if view.ref_slice is not None:
            ref = ref[_index(view.ref_slice, ref.ndim)]
        if view.port_slice is not None:
            part = part[_index(view.port_slice, part.ndim)]
        if view.transpose_port:
            part = part.permute(*range(part.ndim - 1, -1, -1)) if torch.is_tensor(part) \
                else part.T
        pairs.append((source.reference[view.reference], ref, part))
    return pairs


def pull_back(source: ParamSource, at: list | None, port_grad: Any, *,
              like: list | None = None, port: str = "") -> list[Any]:
    """The port's weight gradient as gradients of each reference tensor: the chain's
    vector-Jacobian product at the reference's weights ``at`` (chain rule: a port tensor
    ``p = f(w)`` gives ``dL/dw = J_f(w)^T dL/dp``). Exact for any differentiable chain.
    Numpy in, numpy out; torch in, torch out; each in the dtype of ``like`` (the reference's
    gradients) where given, else the port gradient's.

    ``at`` None: the chain is taken to be linear (a permutation, a reshape), pulled back at
    zeros and at a random point of the shapes of ``like``, and refused when the two disagree
    (a nonlinear conversion needs the weights)."""
    numpy_in = not torch.is_tensor(port_grad)
    grad = _as_torch(port_grad)
    given = at if at is not None else like
    if not given:
        raise ValueError("pull_back needs the reference tensors (at=) or their gradients "
                         "(like=)")
    dtype = grad.dtype if grad.is_floating_point() else torch.float64
    shapes = [tuple(r.shape) for r in given]
    if at is not None:
        points = [[_as_torch(a).to(dtype) for a in at]]
    else:
        generator = torch.Generator().manual_seed(0)
        points = [[torch.zeros(s, dtype=dtype) for s in shapes],
                  [torch.randn(s, generator=generator, dtype=dtype) for s in shapes]]
    results = []
    for primals in points:
        _, vjp = torch.func.vjp(lambda *w: apply_chain(source, w, port=port), *primals)
        results.append(vjp(grad.to(dtype)))
    scale = float(grad.abs().max()) if grad.numel() else 0.0
    if len(results) > 1 and not all(torch.allclose(a, b, rtol=1e-5, atol=1e-6 * scale)
                                    for a, b in zip(*results, strict=True)):
        raise MappingError(f"{source.where or 'mapping'}: conversion "
                           f"{', '.join(source.functions)} is not linear, so its gradient "
                           "cannot be pulled back without the reference's weights; pass them "
                           "(at=)")
    pulled = []
    for number, value in enumerate(results[0]):
        ref = like[number] if like is not None else None
        if numpy_in:
            value = _to_numpy(value)
            pulled.append(value.astype(ref.dtype, copy=False) if isinstance(ref, np.ndarray)
                          else value)
        else:
            pulled.append(value.to(ref.dtype) if torch.is_tensor(ref) else value)
    return pulled


def _as_torch(value: Any) -> torch.Tensor:
    if torch.is_tensor(value):
        return value.detach()
    return torch.from_numpy(np.array(value, order="C"))


def _index(part: Slice, ndim: int) -> tuple[slice, ...]:
    index = [slice(None)] * ndim
    index[part.axis] = slice(part.start, part.stop)
    return tuple(index)


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def trace_weights(trace: Trace) -> dict[str, np.ndarray]:
    """A reference trace's first-step weights (parameters and buffers), by full name."""
    if trace.summary:
        raise MappingError(f"{trace.path} is a summary trace: it has no tensor data to take "
                           "weights from; capture the reference without --summary")
    rows = trace.records(trace.index["step"].min(), role=Role.WEIGHT)
    if rows.empty:
        raise MappingError(f"{trace.path} records no weights (was it captured with "
                           "--no-weights?); capture the reference with weights")
    # a tensor the trace could keep only as its layout, shape and dtype (a sparse buffer) has
    # no values to load: the port keeps its own, and replay compares the two descriptions
    weights = {schema.param_name(row["site"], row["arg"]): np.array(trace.read(row))
               for _, row in rows.iterrows() if row["kind"] == "tensor"}
    # a tied tensor is recorded once: every other name it had gives the same values, so that a
    # port that does not tie it (or ties it the other way round) still finds it by name
    for shared in trace.meta.get("shared_parameters") or []:
        if isinstance(shared, dict) and shared.get("name") in weights:
            for alias in shared.get("users") or []:
                weights.setdefault(alias, weights[shared["name"]])
    return weights


def _never_called(assignments: list[Assignment], reference: dict[str, np.ndarray],
                  called: Collection[str] | None) -> list[str]:
    """Reference modules holding a missing tensor that have no call in the trace, under one
    that has: a module the reference used without calling (nn.MultiheadAttention's
    out_proj), whose tensors a trace captured before they were recorded at the caller lacks."""
    if not called:
        return []
    modules = {name.rpartition(".")[0] for found in assignments if found.problem == NO_SOURCE
               for name in found.source.reference if name not in reference}
    return sorted(m for m in modules
                  if m and m not in called and _called_ancestor(m, called))


def _called_ancestor(module: str, called: Collection[str]) -> bool:
    while module:
        module = module.rpartition(".")[0]
        if (module or schema.ROOT_MODULE) in called:
            return True
    return False
