"""Replaying calls into a Flax Linen port's modules, and what the mapping tools need of a Linen
port model: :mod:`layerdiff.flax.replay` and :class:`layerdiff.flax.model.FlaxModel`
for Linen.

A Linen module is a description; its variables live in the case (``case.params``). Each
replayed call runs an unbound clone of the port module (kept from one abstract run of the
case, :class:`layerdiff.flax.linen.LinenGraph`) as ``clone.apply(its variables subtree,
*recorded args)`` under ``jax.vjp`` of its ``params`` and its differentiated inputs, the
backward on the reference's recorded output gradients, as an NNX module is replayed: input
gradients under the reference's argument names, weight gradients under the port's own names,
summed over the module's calls where the module that holds them records them (a variable
under a child the call called is that child's to sum). The case's variables are read afresh
at every call, so ``map-check`` may set a tensor between two runs of a module.

A module that needs a random stream (a Linen ``Dropout`` that is on asks ``apply`` for a
``"dropout"`` key, which replay does not give) cannot be replayed exactly: it is skipped,
saying why, as an NNX one that draws is.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import errors as flax_errors
from flax import linen as nn

from layerdiff.case import Case
from layerdiff.flax import linen
from layerdiff.flax.calls import MATMUL_PRECISION, unflatten, vjp_with_draws
from layerdiff.flax.calls import floating as _floating
from layerdiff.flax.graph import under_called
from layerdiff.flax.model import FlaxModel
from layerdiff.flax.replay import FlaxPort, NotReplayable, _numpy, _shared
from layerdiff.mapping import Mapping as LoadMapping
from layerdiff.replay.recorded import RecordedCall, grad_outputs_at_port, read_value
from layerdiff.trace import Trace, TraceWriter, schema
from layerdiff.trace.arguments import flatten, map_argument
from layerdiff.trace.schema import Pass, Role
from layerdiff.weights import Assignment

Variables = Callable[[], Mapping[str, Any]]


class LinenPort(FlaxPort):
    """A Flax Linen port's modules, replayed one recorded call at a time on the variables
    ``variables()`` gives (the case's, holding the reference's weights:
    :func:`layerdiff.flax.linen.load_linen_weights`). The interface is :class:`FlaxPort`'s:
    ``modules``, ``type_of``, ``replay``, ``inputs``, ``outputs``, ``finish``."""

    def __init__(self, graph: linen.LinenGraph, variables: Variables, ref: Trace) -> None:
        self.modules = dict(graph.clones)  # path -> an unbound clone: what apply runs
        self._types = dict(graph.modules)
        self._variables = variables
        self.ref = ref
        self._contributors: dict[tuple[str, str], set[str]] = {}
        self._weights_recorded: set[str] = set()
        self._first_site: dict[str, str] = {}
        self._grad_sums: dict[str, dict[str, jax.Array]] = {}
        self._port_signatures: dict[str, Any] = {}
        self._ref_signatures: dict[str, Any] = {}
        # (owner, name) -> port modules whose own code uses it where no replayed call makes
        # its gradient (a tied head's attend in the root's code): set aside or split
        self._outside: dict[tuple[str, str], list[str]] = dict(graph.outside)
        self.set_aside: list[tuple[str, str]] = []
        self.notes: list[str] = []
        self.reference_alone = None
        self.param_source: Callable[[str], Any] = lambda name: None
        self._partner: dict[str, str] = {}
        self.output_renames: dict[str, dict[str, str]] = {}

    def type_of(self, module: str) -> str:
        return self._types[module]

    def replay(self, call: RecordedCall, site: str, args_map: dict[str, str],
               writer: TraceWriter, adapter: Any = None) -> list[tuple[str, str]]:
        module_name = schema.split_site(site)[0]
        args_map = {} if adapter else args_map  # the adapter makes the whole call
        values, caller, dropped = self._arguments(call, site, args_map, writer, adapter)
        variables = linen.subtree(linen.plain(self._variables()), module_name)
        if module_name not in self._weights_recorded:
            self._weights_recorded.add(module_name)
            for name, value in _own(variables).items():
                writer.record(site, Role.WEIGHT, _numpy(value), arg=name, pass_=Pass.FORWARD)
        wanted = {map_argument(a, args_map) for a in call.grad_input_args}
        leaves = {arg: value for arg, value in values if arg in wanted and _floating(value)}
        params = {path: value for path, value in linen.flat_variables(
                      {linen.PARAMS: variables.get(linen.PARAMS, {})}).items()
                  if _floating(value)}
        called: set[tuple[str, ...]] = set()
        pure = _pure_call(self.modules[module_name], module_name, variables, values,
                          _shared(call, args_map, values, leaves), caller, called)
        with jax.default_matmul_precision(MATMUL_PRECISION):
            (outputs, _), vjp = vjp_with_draws(pure, params, leaves)
        flat = list(flatten(outputs))
        for arg, value in flat:
            writer.record(site, Role.OUTPUT, _numpy(value), arg=arg)
        recorded = grad_outputs_at_port(call, flat, self.output_renames.get(call.site, {}))
        if not recorded:
            return dropped
        cotangents = []
        for arg, value in flat:
            if arg in recorded and _floating(value):
                grad = read_value(self.ref, recorded[arg])
                writer.record(site, Role.GRAD_OUTPUT, grad, arg=arg)
                cotangents.append(jnp.asarray(grad, dtype=value.dtype).reshape(
                    value.shape))
            elif value is None:
                cotangents.append(None)
            else:
                # no gradient came to it; an integer output takes float0's empty cotangent
                float0 = jax.dtypes.float0
                cotangents.append(jnp.zeros_like(value) if _floating(value) else
                                  np.zeros(np.shape(value), dtype=float0))
        with jax.default_matmul_precision(MATMUL_PRECISION):
            param_grads, input_grads = vjp(unflatten(outputs, cotangents))
        for arg, grad in input_grads.items():
            writer.record(site, Role.GRAD_INPUT, _numpy(grad), arg=arg)
        self._first_site.setdefault(module_name, site)
        for path, grad in param_grads.items():
            relative = path[1:]  # (params, *module path under this one, name)
            if under_called(relative, called):  # that child's own replay sums it
                continue
            owner = _join(module_name, relative[:-1])
            name = relative[-1]
            self._contributors.setdefault((owner, name), set()).add(module_name)
            sums = self._grad_sums.setdefault(owner, {})
            sums[name] = grad if name not in sums else sums[name] + grad
        return dropped

    def outputs(self, call: RecordedCall, module_name: str, args_map: dict[str, str],
                values: list[tuple[str, Any]], adapter: Any = None) -> Any:
        """The port module's outputs on ``values`` with the variables the case holds now
        (what ``map-check`` measures); :meth:`FlaxPort.outputs` for Linen."""
        caller, dropped = self._caller(call, module_name, {} if adapter else args_map, values,
                                       adapter)
        if adapter is None:
            left_out = {head for head, _ in dropped}
            values = [(arg, value) for arg, value in values
                      if arg.partition(".")[0] not in left_out]
        variables = linen.subtree(linen.plain(self._variables()), module_name)
        params = linen.flat_variables({linen.PARAMS: variables.get(linen.PARAMS, {})})
        pure = _pure_call(self.modules[module_name], module_name, variables, values, {},
                          caller, set())
        with jax.default_matmul_precision(MATMUL_PRECISION):
            outputs, _ = pure(params, {})
        return outputs


def _join(module: str, below: tuple[str, ...]) -> str:
    if not below:
        return module
    return ".".join(below) if module == schema.ROOT_MODULE else ".".join((module, *below))


def _own(variables: Mapping[str, Any]) -> dict[str, Any]:
    """A module's own variables (its children's left out), every collection, by name."""
    return {name: value for tree in variables.values() if isinstance(tree, Mapping)
            for name, value in tree.items() if not isinstance(value, Mapping)}


def _pure_call(module: nn.Module, module_name: str, variables: dict[str, Any],
               values: list[tuple[str, Any]], shared: dict[str, str],
               caller: Callable[[list[tuple[str, Any]]], tuple[tuple, dict[str, Any]]],
               called: set[tuple[str, ...]]) -> Callable[..., Any]:
    """(params by path, differentiated inputs) -> (outputs, False): the module applied alone
    to its variables with ``params`` in place (its other collections mutable and the updates
    dropped: the case's variables stay as they were); ``called`` gets the paths, under the
    module, of the children whose ``__call__`` ran."""
    mutable = [name for name in variables if name != linen.PARAMS]

    def interceptor(next_fun: Callable[..., Any], args: tuple, kwargs: dict,
                    context: Any) -> Any:
        path = tuple(context.module.scope.path)
        if path and context.method_name == "__call__":
            called.add(path)
        return next_fun(*args, **kwargs)

    def pure(params: dict[tuple[str, ...], Any], leaves: dict[str, Any]) -> tuple[Any, bool]:
        tree = {**variables, **linen.unflatten(params)} if params else dict(variables)
        args, kwargs = caller([(arg, leaves.get(shared.get(arg, arg), value))
                               for arg, value in values])
        try:
            with nn.intercept_methods(interceptor):
                if mutable:
                    outputs, _ = module.apply(tree, *args, mutable=mutable, **kwargs)
                else:
                    outputs = module.apply(tree, *args, **kwargs)
        except flax_errors.InvalidRngError as exc:
            raise NotReplayable(f"port layer {module_name} draws random numbers (a dropout "
                                f"that is on: {exc}): its output cannot match the "
                                "reference's") from None
        return outputs, False

    return pure


class LinenModel(FlaxModel):
    """A Flax Linen port model for ``map-check`` and ``map-suggest`` (see
    :mod:`layerdiff.replay.ports`): its module paths and classes from one abstract run, its
    variables (``case.params``) resolved, set (``case.params`` replaced) and put back."""

    framework = "flax"

    def __init__(self, case: Case) -> None:
        from layerdiff.flax import port  # arrays as numpy, whichever Flax API made them

        self.case, self.model, self._port = case, case.model, port
        self._graph: linen.LinenGraph | None = None

    @property
    def graph(self) -> linen.LinenGraph:
        if self._graph is None:
            self._graph = linen.LinenGraph.of(self.model, linen.plain(self.case.params),
                                              linen.jax_inputs(self.case.inputs))
        return self._graph

    def modules(self) -> dict[str, str]:
        return dict(self.graph.modules)

    def resolve(self, reference: dict[str, np.ndarray], mapping: LoadMapping
                ) -> list[Assignment]:
        return linen.resolve_linen(linen.plain(self.case.params), reference, mapping)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return linen.variable_shapes(linen.plain(self.case.params))

    def buffers(self) -> set[str]:
        return {name for name, path in linen.variable_names(
            linen.plain(self.case.params)).items() if path[0] != linen.PARAMS}

    def ties(self) -> list[list[str]]:
        return []

    def set(self, name: str, value: np.ndarray) -> None:
        self.case.params = linen.with_variable(linen.plain(self.case.params), name, value)

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        saved = self.case.params
        try:
            yield
        finally:
            self.case.params = saved

    def replayer(self, ref: Trace) -> LinenPort:
        return LinenPort(self.graph, lambda: self.case.params, ref)

    def dense_layout(self, type_name: str) -> str | None:
        """Linen's Dense keeps its kernel (in, out)."""
        return "in_out" if type_name in ("Dense", "DenseGeneral", "Einsum") else None

    def watch(self, hook: Any) -> Any:
        return linen.watched_forward(self.case, hook)
