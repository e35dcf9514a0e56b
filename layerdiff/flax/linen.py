"""Flax Linen ports as layerdiff cases: captured into the same trace as an NNX port (the same
site names, roles, argument paths and meta), and given a torch reference's weights through the
same mapping files.

A Linen case is ``Case(model=<linen module>, params=<its variables dict>, ...)``: the module is
a description and its variables (``model.init(...)``'s ``{"params": ..., "batch_stats": ...}``)
live beside it, so everything here is functional -- a load or a capture's optimizer steps
replace ``case.params``, never the module.

How a Linen step is recorded, with what :mod:`layerdiff.flax.capture` uses for NNX:

- Every submodule ``__call__`` is seen through ``flax.linen.intercept_methods`` and handed to
  NNX's call recorder (its custom-VJP taps, its weight and gradient records); the site is the
  module's scope path joined with dots (``blocks_0.attn#0``, ``<root>#0``), Linen's own names.
- The loss runs under ``jax.vjp`` of the ``params`` collection; the other collections
  (``batch_stats``) are passed as mutable and carried to the next step, as NNX's state is.
- A module's own variables are the leaves of the variables tree at its scope path, in every
  collection (``kernel``; a BatchNorm's ``mean`` in ``batch_stats``, recorded as a buffer);
  recorded at its first call, or at its nearest called ancestor's for a module whose
  ``__call__`` never runs (an ``Embed`` used through ``attend`` only).

The module paths and classes come from one abstract run (``jax.eval_shape``: no arithmetic)
with every method call seen; modules exist only while Linen applies them, so an unbound clone
of each is kept for replay (:mod:`layerdiff.flax.linen_replay`). The same run finds the
parameters a module's code uses through another module's method (a tied head,
``self.tok.attend(x)`` in the root's code, after the root called ``tok``): replay of no call
makes that part of the recorded gradient (:mod:`layerdiff.flax.reads` for NNX, same rule).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from layerdiff.case import Case, seed_everything
from layerdiff.errors import CaptureError, CaseError, LayerdiffError, interrupt_inside
from layerdiff.flax.capture import (
    ACCEPTED,
    PRODUCER,
    CallRecorder,
    apply_updates,
    check_options,
    failures_named,
    flax_meta,
    floating_cast,
    matmul_precision,
    selected_modules,
    unscaled_and_clipped,
)
from layerdiff.flax.graph import Owned
from layerdiff.mapping import Mapping as LoadMapping
from layerdiff.options import CaptureOptions
from layerdiff.progress import StepProgress
from layerdiff.trace import open_trace, schema
from layerdiff.trace.schema import Role
from layerdiff.trace.writer import TraceWriter, check_writable
from layerdiff.weights import (
    KEPT,
    PORT_OWN,
    Assignment,
    WeightsReport,
    as_mapping,
    refuse_unloadable,
    resolve_shapes,
    trace_weights,
    unused_reference,
)

PARAMS = "params"


# ---- the variables tree

def plain(variables: Any) -> dict[str, Any]:
    """A variables dict (a FrozenDict too) as nested plain dicts."""
    if isinstance(variables, Mapping):
        return {str(key): plain(value) for key, value in variables.items()}
    return variables


def check_variables(case: Any) -> None:
    """Refuse, in one sentence, a Linen case without its variables dict."""
    params = getattr(case, "params", None)
    name = getattr(case, "name", "") or "?"
    if not isinstance(params, Mapping) or PARAMS not in params:
        got = "none" if params is None else (
            f"a dict with keys {', '.join(map(str, list(params)[:4]))}"
            if isinstance(params, Mapping) else type(params).__name__)
        raise CaseError(f"case {name}: {type(case.model).__name__} is a Flax Linen module, "
                        "whose variables live outside it, so the Case needs "
                        f"params=<its variables dict> as model.init(...) returns it "
                        f"({{'params': ...}}); got {got}")


def flat_variables(variables: Mapping[str, Any]) -> dict[tuple[str, ...], Any]:
    """(collection, *module path, name) -> array, depth first in the tree's order."""
    found: dict[tuple[str, ...], Any] = {}

    def walk(node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, Mapping):
            for key, value in node.items():
                walk(value, (*path, str(key)))
        else:
            found[path] = node

    walk(variables, ())
    return found


def unflatten(flat: Mapping[tuple[str, ...], Any]) -> dict[str, Any]:
    tree: dict[str, Any] = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def module_name(path: tuple[str, ...]) -> str:
    """A scope path (``("blocks_0", "attn")``) as a site's module (``blocks_0.attn``)."""
    return ".".join(path) or schema.ROOT_MODULE


def variable_names(variables: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Each variable's full name (``blocks_0.fc1.kernel``, a BatchNorm's ``bn.mean``) -> its
    path in the variables tree (its collection first)."""
    names: dict[str, tuple[str, ...]] = {}
    for path in flat_variables(variables):
        name = ".".join(path[1:])
        if name in names:
            raise CaseError(f"Linen variable {name} is in two collections ({names[name][0]} and "
                            f"{path[0]}); layerdiff names a variable by its module path and "
                            "name alone, so rename one of them")
        names[name] = path
    return names


def tree_modules(variables: Mapping[str, Any]) -> set[str]:
    """Every module path that holds a variable, and their ancestors."""
    found = {schema.ROOT_MODULE}
    for path in flat_variables(variables):
        for depth in range(1, len(path) - 1):
            found.add(module_name(path[1:depth + 1]))
    return found


# ---- the model's structure, from one abstract run

@dataclass
class LinenGraph:
    """The modules of one Linen model as one run applies them: (path, class name) in the
    order of their first call (parents before children, as torch's ``named_modules``), an
    unbound clone of each (``module.apply`` runs it alone), and the variables each records."""

    modules: list[tuple[str, str]]
    clones: dict[str, nn.Module]
    owned: dict[str, list[Owned]]
    shared: list[Any] = field(default_factory=list)  # Linen shares by scope: no aliases
    # (owner module, parameter) -> the modules whose own code uses it where no call on the
    # stack makes its gradient (see :class:`_Uses`)
    outside: dict[tuple[str, str], list[str]] = field(default_factory=dict)

    def shared_parameters(self, selected: set[str]) -> list[dict[str, Any]]:
        return []

    @classmethod
    def of(cls, model: nn.Module, variables: Mapping[str, Any], inputs: tuple | dict
           ) -> LinenGraph:
        seen: dict[str, tuple[str, nn.Module]] = {}
        uses = _Uses(variables)

        def interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                        context: Any) -> Any:
            path = module_name(tuple(context.module.scope.path))
            if path not in seen and context.method_name != "setup":
                seen[path] = (type(context.module).__name__, context.module.clone(
                    parent=None, _deep_clone=True, _reset_names=True, name=None))
            return uses.run(next_fun, args, kwargs, context)

        def run(variables: Any) -> Any:
            with nn.intercept_methods(interceptor):
                return apply(model, variables, inputs)

        try:
            jax.eval_shape(run, variables)
        except LayerdiffError:
            raise
        except Exception as exc:
            if interrupt_inside(exc) is not None:
                raise KeyboardInterrupt from exc
            where = f" inside site {uses.failed}#0" if uses.failed else ""
            rng = (" (layerdiff gives a Linen apply no random streams: run the port with its "
                   "dropout off, deterministic=True, as the reference compares with it off)"
                   if type(exc).__name__ == "InvalidRngError" else "")
            raise CaptureError(f"{type(model).__name__}: the Linen model raised "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0]}{where} in "
                               f"the run that lists its modules{rng}") from exc
        owned = _owned(variables)
        paths = list(seen)
        for owner in owned:  # a module never called whose variables exist: after its parent
            if owner not in seen:
                paths.append(owner)
        return cls([(path, seen[path][0] if path in seen else "Module") for path in paths],
                   {path: clone for path, (_, clone) in seen.items()}, owned,
                   outside=uses.outside)


class _Uses:
    """Where a module's code uses another module's parameters through one of its methods
    other than ``__call__`` (``tok.attend``). Replaying a call makes the gradient of a
    parameter its code reaches unless the parameter's module is, or lies under, a child that
    call called (that child's replay makes it): a use for which no call on the stack makes it
    is outside, at the innermost call's module -- :func:`layerdiff.flax.graph.under_called`'s
    rule, as :mod:`layerdiff.flax.reads` applies it to NNX."""

    def __init__(self, variables: Mapping[str, Any]) -> None:
        self.params: dict[tuple[str, ...], list[str]] = {}
        for path in flat_variables({PARAMS: variables.get(PARAMS, {})}):
            self.params.setdefault(path[1:-1], []).append(path[-1])
        self.stack: list[tuple[tuple[str, ...], set[tuple[str, ...]]]] = []
        self.outside: dict[tuple[str, str], list[str]] = {}
        self.failed = ""  # the innermost call that raised

    def run(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict,
            context: Any) -> Any:
        path = tuple(context.module.scope.path)
        if context.method_name == "__call__":
            for _, called in self.stack:
                called.add(path)
            self.stack.append((path, set()))
            try:
                return next_fun(*args, **kwargs)
            except Exception:
                self.failed = self.failed or module_name(path)
                raise
            finally:
                self.stack.pop()
        if context.method_name != "setup" and self.stack and path in self.params and not any(
                self._makes(frame, called, path) for frame, called in self.stack):
            for name in self.params[path]:
                where = self.outside.setdefault((module_name(path), name), [])
                if module_name(self.stack[-1][0]) not in where:
                    where.append(module_name(self.stack[-1][0]))
        return next_fun(*args, **kwargs)

    @staticmethod
    def _makes(frame: tuple[str, ...], called: set[tuple[str, ...]],
               owner: tuple[str, ...]) -> bool:
        return owner[:len(frame)] == frame and not any(
            len(child) > len(frame) and owner[:len(child)] == child for child in called)


def _owned(variables: Mapping[str, Any]) -> dict[str, list[Owned]]:
    owned: dict[str, list[Owned]] = {}
    for path in flat_variables(variables):
        owner = module_name(path[1:-1])
        owned.setdefault(owner, []).append(Owned(path[-1], path, path[0] == PARAMS))
    return owned


def apply(model: nn.Module, variables: Mapping[str, Any], inputs: tuple | dict,
          **options: Any) -> tuple[Any, dict[str, Any]]:
    """The model's forward on ``inputs`` with ``variables``; every collection but ``params``
    mutable (a BatchNorm's statistics in training mode). Returns (output, updated collections)."""
    mutable = [name for name in variables if name != PARAMS]
    args, kwargs = (((), dict(inputs)) if isinstance(inputs, dict) else (tuple(inputs), {}))
    if not mutable:
        return model.apply(variables, *args, **kwargs, **options), {}
    output, updated = model.apply(variables, *args, mutable=mutable, **kwargs, **options)
    return output, plain(updated)


def jax_inputs(inputs: tuple | dict) -> tuple | dict:
    return jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v, inputs)


# ---- capture

def capture_linen(case: Case, path: str | os.PathLike, options: CaptureOptions) -> Path:
    """Run the Flax Linen ``case`` with every selected submodule call recorded into the trace
    at ``path``: :func:`layerdiff.flax.capture.capture_nnx` for Linen (see the module's
    docstring); ``case.params`` holds the variables after the steps. Returns the path."""
    options.refuse(ACCEPTED, case.name, "is a Flax model")
    steps = case.steps if options.steps is None else options.steps
    check_options(case, steps, options.loss_scale)
    if options.dtype is not None:
        cast_linen_case(case, options.dtype)
    check_writable(path)
    variables = plain(case.params)
    inputs = jax_inputs(case.inputs)
    graph = LinenGraph.of(case.model, variables, inputs)
    selected = selected_modules(graph, options.include, options.exclude)
    meta = _meta(case, graph, variables, options.matmul_precision)
    meta["shared_parameters"] = []
    meta.update(options.meta(steps))
    writer = TraceWriter(path, meta=meta, summary=options.summary,
                         queue_bytes=options.queue_bytes, producer=PRODUCER)
    sink = LinenRecorder(writer, graph, selected, weights=options.weights)
    with failures_named(writer, case.name, sink), StepProgress(
            steps, enabled=options.progress, label=f"capture {case.name}") as bar:
        train_steps(case, variables, inputs, sink, writer, steps, options, bar)
    return writer.close()


def cast_linen_case(case: Case, dtype: str) -> None:
    """Cast the case's floating variables and inputs to ``dtype`` (``case.params`` replaced);
    integer inputs stay as they are."""
    cast = floating_cast(case, dtype)
    case.params = jax.tree.map(cast, plain(case.params))
    case.inputs = jax.tree.map(cast, case.inputs)


class LinenRecorder(CallRecorder):
    """NNX's call recorder fed by Linen's method interceptor: a module is known by its scope
    path, set for each call just before the recorder looks it up by identity."""

    def __init__(self, writer: TraceWriter, graph: LinenGraph, selected: set[str], *,
                 weights: bool) -> None:
        super().__init__(writer, graph, selected, weights=weights)  # type: ignore[arg-type]

    def begin_forward(self) -> None:
        self.paths, self.stack, self.sites = {}, [], []

    def intercept(self, next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                  context: Any) -> Any:
        if context.method_name != "__call__":  # setup, attend, encode: code of the caller
            return next_fun(*args, **kwargs)
        module = context.module
        self.paths[id(module)] = module_name(tuple(module.scope.path))
        return self.call(lambda _module, *a, **k: next_fun(*a, **k), module, args, kwargs)


def train_steps(case: Case, variables: dict[str, Any], inputs: tuple | dict, sink: LinenRecorder,
           writer: TraceWriter, steps: int, options: CaptureOptions,
           bar: StepProgress) -> None:
    seed_everything(case.seed)
    params = variables[PARAMS]
    rest = {name: value for name, value in variables.items() if name != PARAMS}
    tx = case.optimizer
    opt_state = tx.init(params) if tx is not None else None
    loss_scale = options.loss_scale
    for step in range(steps):
        if step:
            writer.step(step)
        sink.begin_step(flat_variables({PARAMS: params, **rest}))
        sink.phase = "forward"

        def forward(params: Any, rest: Any = rest) -> tuple[Any, Any]:
            sink.begin_forward()
            with nn.intercept_methods(sink.intercept):
                output, updated = apply(case.model, {PARAMS: params, **rest}, inputs)
                loss = case.loss_fn(output)
            return loss, updated

        with matmul_precision(options.matmul_precision):
            loss, backward, updated = jax.vjp(forward, params, has_aux=True)
            sink.phase = "loss"
            if getattr(loss, "shape", None) != ():
                raise CaptureError(f"case {case.name}: loss_fn returned "
                                   f"{type(loss).__name__} of shape "
                                   f"{getattr(loss, 'shape', '?')}, not a scalar JAX array")
            with writer.site("<loss>", "loss") as site:
                writer.record(site, Role.OUTPUT, np.asarray(loss))
            sink.phase = "backward"
            scale = jnp.asarray(loss_scale, dtype=loss.dtype)
            if loss_scale != 1.0:
                from layerdiff.case import check_scaled_loss

                check_scaled_loss(case.name, writer.current_step, float(loss),
                                  float(loss * scale), str(loss.dtype), loss_scale)
            (grads,) = backward(scale)
        sink.record_weight_grads(flat_variables({PARAMS: grads}))
        sink.phase = "optimizer step"
        if tx is not None:
            grads = unscaled_and_clipped(grads, loss_scale, case.clip_grad_norm)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = apply_updates(params, updates)
        rest = {**rest, **updated}
        case.params = {PARAMS: params, **rest}
        bar.advance()


def _meta(case: Case, graph: LinenGraph, variables: dict[str, Any],
          precision: str) -> dict[str, Any]:
    """What only a Linen capture knows of its run: NNX's meta, and which Flax API."""
    leaves = [value for value in flat_variables({PARAMS: variables[PARAMS]}).values()
              if isinstance(value, jax.Array | np.ndarray)]
    return {**flax_meta(case, leaves, list(graph.clones.values()), "flax.linen.", precision),
            "flax_api": "linen"}


# ---- weights from a torch reference

def variable_shapes(variables: Mapping[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every name a load can set (``blocks_0.fc1.kernel``), with its shape."""
    flat = flat_variables(variables)
    return {name: tuple(np.shape(flat[path]))
            for name, path in variable_names(variables).items()}


def resolve_linen(variables: Mapping[str, Any], reference: dict[str, np.ndarray],
                  mapping: LoadMapping) -> list[Assignment]:
    """:func:`layerdiff.weights.resolve_weights` for a Linen variables tree, changing nothing."""
    return resolve_shapes(variable_shapes(variables), tree_modules(variables), reference,
                          mapping, world=(0, 1))


def with_variable(variables: Mapping[str, Any], name: str, value: Any) -> dict[str, Any]:
    """A copy of ``variables`` with the variable ``name`` set to ``value`` (cast to its
    dtype); the arrays not set are shared, not copied."""
    flat = flat_variables(variables)
    path = variable_names(variables)[name]
    flat[path] = jnp.asarray(np.asarray(value), dtype=flat[path].dtype)
    return unflatten(flat)


def load_linen_weights(case: Case, trace_path: str | os.PathLike,
                       mapping: str | os.PathLike | LoadMapping | None = None
                       ) -> WeightsReport:
    """Set every variable of the Linen ``case`` (``case.params`` replaced) from the reference
    trace's step-0 weights through ``mapping``, with :func:`layerdiff.weights.load_weights`'s
    checks and messages."""
    with open_trace(trace_path) as trace:
        reference = trace_weights(trace)
    mapping = as_mapping(mapping)
    variables = plain(case.params)
    assignments = resolve_linen(variables, reference, mapping)
    refuse_unloadable(assignments, reference, mapping, str(trace_path))
    report = WeightsReport({found.port: found.source.reference for found in assignments
                            if found.problem != PORT_OWN},
                           unused_reference(reference, assignments),
                           kept={found.port: found.note.removeprefix(KEPT)
                                 for found in assignments if found.problem == PORT_OWN})
    flat = flat_variables(variables)
    names = variable_names(variables)
    for found in assignments:
        if found.problem == PORT_OWN:
            continue
        path = names[found.port]
        target = flat[path].dtype
        value = np.asarray(found.value)
        if np.issubdtype(value.dtype, np.floating) and value.dtype != target:
            how = f"{value.dtype} -> {target}"
            report.cast[how] = report.cast.get(how, 0) + 1
        flat[path] = jnp.asarray(value, dtype=target)
    case.params = unflatten(flat)
    return report


def subtree(variables: Mapping[str, Any], module: str) -> dict[str, Any]:
    """The variables of the module at path ``module`` (its children's too), every
    collection, rooted as that module's own ``apply`` takes them."""
    keys = [] if module == schema.ROOT_MODULE else module.split(".")
    found: dict[str, Any] = {}
    for collection, tree in variables.items():
        node = tree
        for key in keys:
            if not isinstance(node, Mapping) or key not in node:
                node = None
                break
            node = node[key]
        if isinstance(node, Mapping):
            found[collection] = node
    return found


def watched_forward(case: Case, hook: Callable[[str, str, Callable[..., Any], tuple, dict],
                                                Any]) -> Any:
    """The case's forward once (seeded; full float32 matmuls), every submodule ``__call__``
    (the model's too) going through ``hook(path, class, run, args, kwargs)``; the case's
    variables are left as they were."""
    def interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                    context: Any) -> Any:
        if context.method_name != "__call__":
            return next_fun(*args, **kwargs)
        module = context.module
        return hook(module_name(tuple(module.scope.path)), type(module).__name__, next_fun,
                    args, kwargs)

    seed_everything(case.seed)
    with jax.default_matmul_precision("float32"), nn.intercept_methods(interceptor):
        return apply(case.model, plain(case.params), jax_inputs(case.inputs))[0]
