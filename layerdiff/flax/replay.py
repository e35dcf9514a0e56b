"""Replaying calls into a Flax NNX port's modules.

Each call runs the port module as a pure function of its own parameters and of the
reference's recorded inputs (``nnx.split`` / ``nnx.merge``: the model itself is never changed,
so a container's replay cannot touch its children, and a BatchNorm's running statistics stay as
they were), under ``jax.vjp``, compiled once per module structure and call shape
(``flax/calls.py``: the blocks of a model share one program). The backward applies
that vjp to the reference's recorded output gradients: what arrives from outside the call,
which is all a pure function's output can get.
Input gradients are recorded under the reference's argument names (mapped by the site's
``args``), and weight gradients by the module's own parameter names (``kernel``), summed over
the module's calls, as the reference records them; the diff maps them through the mapping's
``[[param]]`` rules (``transform = "transpose"``).

A parameter the port's code also reads outside every call whose replay makes its gradient (a
tied head ``self.tok.attend(x)`` in the root's own code, after the root called ``tok``) has a
recorded total no replayed call makes: found by :meth:`FlaxPort.watch_uses`
(``flax/reads.py``) and decided as torch replay decides it
(:func:`layerdiff.replay.alone.split_outside`): split with the reference case, else set aside
as "cannot judge alone", never a local error.

A call whose module draws random numbers (an ``nnx.Dropout`` that is on) cannot be replayed
exactly and is skipped, saying why, as torch replay does. A mapping's call adapter gets the
reference's arguments as JAX arrays and may return numpy, JAX or torch arrays (see
:class:`_AdapterCaller`). Matmuls run at full float32 precision
(``flax_calls.MATMUL_PRECISION``), as capture runs them.

With ``flax_calls.py``, the only replay modules that import JAX; :mod:`layerdiff.replay.replay`
imports them only for an NNX case.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.case import Case
from layerdiff.flax.calls import Call, CallRunner, Split, floating
from layerdiff.flax.graph import ModelGraph, under_called
from layerdiff.flax.port import as_jax
from layerdiff.flax.stacks import WithLayers
from layerdiff.mapping.code import CodeRef
from layerdiff.replay.alone import ReferenceAlone, split_outside
from layerdiff.replay.calling import BoundCall, CannotCall, Signature, adapted_call, bind_call
from layerdiff.replay.recorded import RecordedCall, grad_outputs_at_port, read_value
from layerdiff.trace import Trace, TraceWriter, schema
from layerdiff.trace.arguments import (
    NotPlainData,
    dropped_arguments,
    flatten,
    map_argument,
    rebuild_call,
    recorded_value,
)
from layerdiff.trace.schema import Pass, Role


class NotReplayable(Exception):
    """A call that cannot be replayed exactly (it draws random numbers). Replay lists it as
    skipped by this class's name, as it does torch replay's."""


def named_modules(model: nnx.Module) -> dict[str, nnx.Module]:
    """Module path -> module, named as capture names NNX sites (``block.fc1``, ``<root>``); a
    module reachable by two paths keeps the first."""
    return {name: module for name, module in ModelGraph.of(model).modules}


def own_variables(module: nnx.Module) -> dict[str, nnx.Variable]:
    """The variables a module holds as its own attributes (``kernel``, ``bias``, ``scale``,
    a BatchNorm's ``mean``), not its children's; random state is not a weight."""
    return {name: value for name, value in vars(module).items()
            if isinstance(value, nnx.Variable) and not isinstance(value, nnx.RngState)}


class FlaxPort:
    """A Flax NNX port's modules, replayed one recorded call at a time (the model must hold
    the reference's weights: :func:`layerdiff.flax.weights.load_nnx_weights`)."""

    def __init__(self, model: nnx.Module, ref: Trace, *, compiled: bool = True) -> None:
        graph = ModelGraph.of(model)
        # a scanned stack's layers too, sliced on first ask (``layers.1.fc``)
        self.modules = WithLayers(dict(graph.modules))
        # each variable's owner and name there, by identity: a tied variable (GPT-2's lm head
        # reaching wte's embedding through wte.attend) gets its gradient from every module
        # using it, summed where its owner records it, as capture's whole-model gradient does
        state_paths = {tuple(path): node for path, node in nnx.iter_graph(model)}
        self._owner: dict[int, tuple[str, str]] = {
            id(state_paths[variable.state_path]): (owner, variable.name)
            for owner, owned in graph.owned.items() for variable in owned
            if variable.state_path in state_paths}
        self._contributors: dict[tuple[str, str], set[str]] = {}
        self.ref = ref
        self._weights_recorded: set[str] = set()
        self._first_site: dict[str, str] = {}
        self._grad_sums: dict[str, dict[str, jax.Array]] = {}  # module -> name -> sum
        self._port_signatures: dict[str, Signature | None] = {}
        self._ref_signatures: dict[str, Signature | None] = {}
        # (owner, name) -> port modules whose own code reads it where no replayed call makes
        # its gradient (a tied head in the root's code): :meth:`watch_uses`
        self._outside: dict[tuple[str, str], list[str]] = {}
        self.set_aside: list[tuple[str, str]] = []  # (weight_grad, why): not compared
        self.notes: list[str] = []
        # the reference case's modules replayed alone, to split such a recorded gradient
        self.reference_alone: ReferenceAlone | None = None
        # port parameter's full name -> the mapping's [[param]] source for it, if any
        self.param_source: Callable[[str], Any] = lambda name: None
        self._partner: dict[str, str] = {}  # port module -> the reference module it replayed
        # reference site -> the mapping's outputs renames (reference output -> port output)
        self.output_renames: dict[str, dict[str, str]] = {}
        # each call compiled once per module structure and call shape (flax_calls.py)
        self.calls = CallRunner(compiled)
        self._splits: dict[str, Split] = {}

    def type_of(self, module: str) -> str:
        return type(self.modules[module]).__name__

    def why_unpaired(self, site: str) -> str | None:
        """Why a reference site has no port layer, where the port says more than nothing
        does: a per-layer name of a stack the port runs with nnx.scan that is no layer of it
        (``layers.7#0`` of a stack of 4, or one whose variables are not all stacked)."""
        from layerdiff.flax.stacks import stacked_module

        stacked = stacked_module(site.partition("#")[0], self.modules.model_modules)
        return (f"named as a layer of the port's stack {stacked} (one module holding every "
                "layer, run by nnx.scan), but the stack has no such layer: not every variable "
                "of it has a first axis longer than the layer's number") if stacked else None

    def watch_uses(self, case: Case) -> None:
        """Find the parameters the port's code reads outside every call whose replay makes
        their gradient, from one forward of the case (``flax/reads.py``): replay does not
        make that part of the reference's recorded gradient."""
        from layerdiff.flax.reads import outside_reads

        try:   # op by op where replay is (the benchmark's before)
            found = _abstract_reads(case, outside_reads) if self.calls.compiled else None
        except Exception:   # code that needs concrete values: the forward runs op by op
            found = None
        try:
            found = outside_reads(case) if found is None else found
        except Exception as exc:  # the replay goes on; the one thing unknown is said
            self.notes.append(f"could not look for parameters used outside their modules' "
                              f"calls (the port's forward raised {type(exc).__name__}: {exc}); "
                              "a weight gradient with such a use would differ from the "
                              "reference's recorded total")
            return
        self._outside = {self._owner[key]: sites for key, sites in found.items()
                         if key in self._owner}

    def replay(self, call: RecordedCall, site: str, args_map: dict[str, str],
               writer: TraceWriter, adapter: Any = None) -> list[tuple[str, str]]:
        module_name = schema.split_site(site)[0]
        module = self.modules[module_name]
        args_map = {} if adapter else args_map  # the adapter makes the whole call
        values, caller, dropped = self._arguments(call, site, args_map, writer, adapter)
        split = self._split_of(module_name)
        if module_name not in self._weights_recorded:
            self._weights_recorded.add(module_name)
            for name, variable in own_variables(module).items():
                writer.record(site, Role.WEIGHT, _numpy(variable[...]), arg=name,
                              pass_=Pass.FORWARD)
        wanted = {map_argument(a, args_map) for a in call.grad_input_args}
        leaves = {arg: value for arg, value in values if arg in wanted and floating(value)}
        # every recorded output gradient, read once: which outputs they pair with is known
        # when the outputs are (in the compiled program, while it is traced)
        grads = {arg: read_value(self.ref, row) for arg, row in call.grad_outputs.items()}
        renames = self.output_renames.get(call.site, {})
        ran = self.calls.run(Call(
            split, values, leaves, _shared(call, args_map, values, leaves), caller,
            _caller_key(call, args_map, adapter), _pairing(call, renames),
            (tuple(sorted(renames.items())),
             tuple((arg, str(row["shape"])) for arg, row in call.grad_outputs.items())),
            grads))
        if ran.draws:
            raise NotReplayable(f"port layer {module_name} draws random numbers (a dropout "
                                "that is on): its output cannot match the reference's")
        flat = list(flatten(ran.outputs))
        for arg, value in flat:
            writer.record(site, Role.OUTPUT, _numpy(value), arg=arg)
        if ran.grads is None:
            return dropped
        for arg, value in flat:
            if arg in ran.paired and floating(value):
                writer.record(site, Role.GRAD_OUTPUT, grads[ran.paired[arg]], arg=arg)
        param_grads, input_grads = ran.grads
        for arg, grad in input_grads.items():
            writer.record(site, Role.GRAD_INPUT, _numpy(grad), arg=arg)
        self._first_site.setdefault(module_name, site)
        for path, grad in param_grads.items():
            # a variable reached through a child this call called is that child's to sum
            if under_called(path, ran.called):
                continue
            key = id(split.params[path])
            owner, name = self._owner.get(key) or self.modules.owners[key]
            self._contributors.setdefault((owner, name), set()).add(module_name)
            sums = self._grad_sums.setdefault(owner, {})
            sums[name] = grad if name not in sums else sums[name] + grad
        return dropped

    def _split_of(self, module_name: str) -> Split:
        """The module's split, made once: the model does not change while replay runs."""
        if module_name not in self._splits:
            self._splits[module_name] = Split.of(self.modules[module_name])
        return self._splits[module_name]

    def inputs(self, call: RecordedCall, args_map: dict[str, str]) -> list[tuple[str, Any]]:
        """The reference's recorded inputs of ``call`` under the port's argument names, as
        JAX arrays."""
        return self._inputs(call, args_map)

    def outputs(self, call: RecordedCall, module_name: str, args_map: dict[str, str],
                values: list[tuple[str, Any]], adapter: Any = None) -> Any:
        """The port module's outputs on ``values`` (from :meth:`inputs`) with the variables
        the model holds now, called the way its ``__call__`` takes them or through
        ``adapter``; what ``map-check`` measures. Raises :class:`NotReplayable` for a module
        that draws random numbers."""
        args_map = {} if adapter else args_map
        caller, dropped = self._caller(call, module_name, args_map, values, adapter)
        if adapter is None:
            left_out = {head for head, _ in dropped}
            values = [(arg, value) for arg, value in values
                      if arg.partition(".")[0] not in left_out]
        # split afresh: map-check sets the variables between calls
        ran = self.calls.run(Call(Split.of(self.modules.fresh(module_name)), values, {}, {},
                                  caller,
                                  _caller_key(call, args_map, adapter), _pairing(call, {}),
                                  (), {}))
        if ran.draws:
            raise NotReplayable(f"port layer {module_name} draws random numbers (a dropout "
                                "that is on): its output cannot match the reference's")
        return ran.outputs

    def _arguments(self, call: RecordedCall, site: str, args_map: dict[str, str],
                   writer: TraceWriter, adapter: Any) -> tuple[list[tuple[str, Any]], Any,
                                                               list[tuple[str, str]]]:
        """The call's recorded arguments (those the port's layer takes recorded as its
        inputs), how to call the layer with them, and the arguments it left out."""
        module_name = schema.split_site(site)[0]
        self._partner.setdefault(module_name, call.module)
        values = self._inputs(call, args_map)
        caller, dropped = self._caller(call, module_name, args_map, values, adapter)
        left_out = {head for head, _ in dropped}
        taken = [(arg, value) for arg, value in values if arg.partition(".")[0] not in left_out]
        for arg, value in taken:
            writer.record(site, Role.INPUT, _numpy(value), arg=arg)
        # the adapter gets every argument (None for what is not data)
        return (values if adapter is not None else taken), caller, dropped

    def _caller(self, call: RecordedCall, module_name: str, args_map: dict[str, str],
                values: list[tuple[str, Any]], adapter: Any
                ) -> tuple[Callable[[list[tuple[str, Any]]], tuple[tuple, dict[str, Any]]],
                           list[tuple[str, str]]]:
        """(values -> the module's (args, kwargs), the reference arguments left out and why):
        fitted to the module's own ``__call__`` as torch replay fits a forward (an argument it
        has no parameter for, HF's cache or position_ids, is not taken, and listed), or made
        by the mapping's call adapter."""
        if adapter is None:
            bind = self._binder(call, module_name, dropped_arguments(args_map))
            dropped = bind(values).dropped  # refuses a call the port cannot take, before work
            return (lambda fresh: bind(fresh).call()), dropped
        dropped = [(arg, f"recorded as {value.type_name}, not plain data: the call adapter "
                         "gets None") for arg, value in values if isinstance(value, NotPlainData)]
        return _AdapterCaller(adapter, self.modules[module_name], module_name, values), dropped

    def _binder(self, call: RecordedCall, module_name: str,
                drop: frozenset[str]) -> Callable[[list[tuple[str, Any]]], BoundCall]:
        if module_name not in self._port_signatures:
            self._port_signatures[module_name] = Signature.of(self.modules[module_name].__call__)
        port = self._port_signatures[module_name]
        reference = self._reference_signature(call.type)
        where = f"port layer {module_name}"
        return lambda values: bind_call(values, port, reference=reference, drop=drop,
                                        where=where)

    def _reference_signature(self, type_name: str) -> Signature | None:
        """The reference module type's forward signature, as capture recorded it."""
        if type_name not in self._ref_signatures:
            signatures = self.ref.meta.get("signatures", {})
            data = signatures.get(type_name) if isinstance(signatures, dict) else None
            self._ref_signatures[type_name] = None if data is None else Signature.from_json(
                data, f"{self.ref.path} meta 'signatures' {type_name}")
        return self._ref_signatures[type_name]

    def finish(self, writer: TraceWriter, complete: set[str]) -> None:
        """Weight gradients summed over a module's calls, at its first replayed site; only
        where every call of it was replayed (``complete``), or the sums would differ."""
        for module_name, sums in self._grad_sums.items():
            if module_name in complete and module_name in self._first_site:
                for name, grad in sums.items():
                    users = self._contributors[(module_name, name)]
                    if not users <= complete:
                        continue
                    outside = self._outside.get((module_name, name))
                    if outside:  # the recorded total holds a use that no replayed call makes
                        grad = self._split(grad, module_name, name, users, outside)
                        if grad is None:
                            continue
                    writer.record(self._first_site[module_name], Role.WEIGHT_GRAD,
                                  _numpy(grad), arg=name)

    def _split(self, grad: jax.Array, owner: str, name: str, users: set[str],
               outside: list[str]) -> jax.Array | None:
        """The summed gradient made comparable with the reference's recorded total, or None,
        set aside with its reason (:func:`layerdiff.replay.alone.split_outside`)."""
        site = self._first_site[owner]
        full = schema.param_name(site, name)
        holders = [owner, *sorted(users - {owner})]
        split = split_outside(full, sorted(users), outside,
                              [self._partner[m] for m in holders if m in self._partner],
                              tuple(grad.shape), self.reference_alone, self.param_source(full))
        if split.rest is None:
            self.set_aside.append((f"{site} weight_grad {name}", split.line))
            return None
        self.notes.append(split.line)
        return grad + jnp.asarray(split.rest, dtype=grad.dtype)

    def _inputs(self, call: RecordedCall, args_map: dict[str, str]) -> list[tuple[str, Any]]:
        """The reference's recorded inputs under the port's argument names; an argument the
        mapping drops ("") is left out, as is a second use of one (``attn(x, x, x)``)."""
        drop = dropped_arguments(args_map)
        values, seen = [], set()
        for arg, row in call.inputs:
            port_arg = map_argument(arg, args_map)
            if port_arg in seen or port_arg.partition(".")[0] in drop:
                continue
            seen.add(port_arg)
            # a cache object capture kept as a repr stays NotPlainData: it can be left out
            # (not taken, or None to a call adapter), never passed, as in torch replay
            value = (read_value(self.ref, row) if row["kind"] == "tensor"
                     else recorded_value(row["value"]))
            if isinstance(value, np.ndarray):  # bfloat16 was widened to read: narrowed back
                value = jnp.asarray(value, dtype=jnp.bfloat16 if row["dtype"] == "bfloat16"
                                    else None)
            values.append((port_arg, value))
        return values


def _abstract_reads(case: Case, reads: Callable[[Case], dict[int, list[str]]]
                    ) -> dict[int, list[str]] | None:
    """``reads(case)`` (:func:`layerdiff.flax.reads.outside_reads`) on a copy of the model
    under ``jax.eval_shape``: which variable is read in which module's call is Python's, the
    same whether values are there or not, and nothing is computed or compiled (op by op, the
    Gemma pair's forward took 4-7 s compiling each operation; so, 0.2 s). Keyed by the
    model's own parameters; None where the copy's modules are named otherwise."""
    model = case.model
    found: list[dict[tuple[Any, ...], list[str]]] = []

    def run() -> None:
        graphdef, state = nnx.split(model)
        # fresh variables, made inside the trace: the forward may write them there (random
        # streams, running statistics, and putting them back at its end)
        copy = nnx.merge(graphdef, jax.tree.map(lambda leaf: leaf, state))
        if ModelGraph.of(copy).names != ModelGraph.of(model).names:
            return
        paths = {id(node): tuple(path) for path, node in nnx.iter_graph(copy)}
        found.append({paths[key]: sites for key, sites in
                      reads(dataclasses.replace(case, model=copy)).items()})

    jax.eval_shape(run)
    if not found:
        return None
    nodes = {tuple(path): node for path, node in nnx.iter_graph(model)}
    return {id(nodes[path]): sites for path, sites in found[0].items()}


class _AdapterCaller:
    """The reference's arguments, rebuilt as they were passed (JAX arrays; what capture kept
    only as a repr is None), through the mapping's call adapter; what it returns (numpy, JAX
    or torch arrays) made JAX arrays (:func:`layerdiff.flax.port.as_jax`).

    Under ``jax.vjp`` the adapter gets traced arrays, so the input gradients flow through its
    JAX operations to the reference's arguments. An adapter that needs concrete values (it
    calls ``np.asarray`` on an argument) is run on the recorded values instead, and an
    argument it returns unchanged is put back in the traced call: its gradient still flows,
    what the adapter computed from the arguments gets none."""

    def __init__(self, adapter: tuple[CodeRef, Callable[..., Any]], module: nnx.Module,
                 module_name: str, values: list[tuple[str, Any]]) -> None:
        self.ref, self.function = adapter
        self.port = module.__call__
        self.where = f"port layer {module_name}"
        self.concrete = [(arg, None if isinstance(value, NotPlainData) else value)
                         for arg, value in values]
        # whether a call was made from the recorded values: a compiled program then holds
        # them, and is not reused for another call
        self.concrete_used = False

    def _adapt(self, values: list[tuple[str, Any]]) -> tuple[tuple, dict[str, Any]]:
        args, kwargs = rebuild_call(values)
        return adapted_call(self.ref, self.function, args, kwargs, self.port, where=self.where)

    def __call__(self, fresh: list[tuple[str, Any]]) -> tuple[tuple, dict[str, Any]]:
        fresh = [(arg, None if isinstance(value, NotPlainData) else value)
                 for arg, value in fresh]
        try:
            return as_jax(self._adapt(fresh))
        except CannotCall as exc:
            if not isinstance(exc.__cause__, jax.errors.JAXTypeError) or not any(
                    isinstance(value, jax.core.Tracer) for _, value in fresh):
                raise
        concrete = dict(self.concrete)
        traced = {id(concrete[arg]): value for arg, value in fresh
                  if concrete.get(arg) is not None}
        made = self._adapt(self.concrete)
        self.concrete_used = True
        return as_jax(_replace_leaves(made, lambda leaf: traced.get(id(leaf), leaf)))


def _replace_leaves(value: Any, swap: Callable[[Any], Any]) -> Any:
    if isinstance(value, (tuple, list)):
        items = [_replace_leaves(item, swap) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _replace_leaves(item, swap) for key, item in value.items()}
    return swap(value)


def _shared(call: RecordedCall, args_map: dict[str, str], values: list[tuple[str, Any]],
            leaves: dict[str, jax.Array]) -> dict[str, str]:
    """Arguments that were one tensor in the reference's call (``attn(x, x, x)``) -> the
    differentiated argument standing for it: capture records that tensor's whole gradient once,
    under the first, so the replayed one must sum over every use too."""
    rows = {map_argument(arg, args_map): row for arg, row in call.inputs}
    shared = {}
    for arg, value in values:
        row = rows.get(arg)
        if arg in leaves or not floating(value) or row is None or not row["digest"]:
            continue
        first = next((other for other in leaves if other in rows
                      and rows[other]["digest"] == row["digest"]
                      and rows[other]["shape"] == row["shape"]
                      and rows[other]["dtype"] == row["dtype"]), None)
        if first is not None:
            shared[arg] = first
    return shared


def _caller_key(call: RecordedCall, args_map: dict[str, str],
                adapter: Any) -> tuple[Any, ...]:
    """What decides how a call's recorded arguments become the module's: the call adapter, or
    the reference's signature (by its type) and the arguments the mapping drops."""
    if adapter is not None:
        return ("adapter", adapter[0].spec)
    return ("bind", call.type, tuple(sorted(dropped_arguments(args_map))))


def _pairing(call: RecordedCall, renames: dict[str, str]) -> Callable[..., dict[str, str]]:
    """(flat outputs, output gradients) -> {port output: reference output}, by the diff's rule
    (:func:`~layerdiff.replay.recorded.grad_outputs_at_port`)."""
    def pair(flat: list[tuple[str, Any]], grads: dict[str, Any]) -> dict[str, str]:
        return {port: row["arg"] for port, row in grad_outputs_at_port(call, flat,
                                                                        renames).items()}
    return pair


def _numpy(value: Any) -> Any:
    if not isinstance(value, (jax.Array, np.ndarray)):
        return value
    array = np.asarray(value)
    if array.dtype == jnp.bfloat16:
        array = array.astype(np.float32)  # TraceWriter stores numpy dtypes
    return array
