"""One recorded call of an NNX module run as a pure function, its backward included: eager
under ``jax.vjp``, or compiled once per module structure and call shape and reused.

Replay runs every submodule of a port on the reference's recorded inputs. Run eagerly, JAX
dispatches each operation of the forward and of the backward on its own and compiles each
new operation shape once: on the Gemma validation pair that was ~200 compilations and ~0.1 s
of dispatch a call, before the first layer's verdict. Compiled, a call is one program of the
forward, its vjp and the cotangents, traced once for every call of the same module structure
(NNX's ``GraphDef``: the classes, their static attributes, the nesting) on inputs and
parameters of the same shapes (:class:`CallKey`): the blocks of a model share one program,
and their norms another.

What a compiled program closes over must be the same for every call that shares it: the
module's structure, how the recorded arguments are fitted to its ``__call__`` (the site's
``args`` rules, or the call adapter), each non-array argument (``None``, a flag) and each
integer or boolean array by its bytes (positions, a mask: the code may read them as Python
values, so they stay concrete), and which outputs get the reference's gradient. Everything
else is an argument of the program: the parameters, the floating inputs, the module's other
state (running statistics, random streams). A call whose code needs concrete floating values,
or a call adapter that falls back to the recorded values (:class:`_AdapterCaller` in
``flax/replay.py``), runs eagerly, as do later calls of the same shape.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.flax.intercept import intercepted
from layerdiff.trace.arguments import NotPlainData, flatten

# Full float32 matmuls and convolutions, as capture pins them: JAX's default on accelerators
# computes float32 dots in TF32 (NVIDIA from Ampere) or bfloat16 passes (TPU), ~1e-3 relative,
# which would be every layer's "own error" against a float32 reference.
MATMUL_PRECISION = "float32"

# On the CPU, a program is compiled without LLVM's optimisations: replay runs each program once
# per call that shares it, on one recorded batch, and compiling took most of the time (the
# Gemma validation pair's blocks: 5.5 s at the default level, 2.8 s so; its results differ
# from the optimised code's by float32 rounding, ~2e-7 relative, as the eager ones do).
# Elsewhere (a GPU) the default is kept: not measured there.
CPU_COMPILER_OPTIONS = {"xla_backend_optimization_level": 0}

# (values -> the module's (args, kwargs))
Caller = Callable[[list[tuple[str, Any]]], tuple[tuple, dict[str, Any]]]
# (flat outputs, the reference's output gradients) -> {port output: reference output}
Pairing = Callable[[list[tuple[str, Any]], dict[str, Any]], dict[str, str]]


@dataclass
class Split:
    """A module's ``nnx.split``, its parameters by path, and the shapes its state has (part of
    a compiled program's key): replay's model does not change while it runs, so one each."""

    graphdef: Any
    state: Any
    params: dict[tuple[Any, ...], nnx.Variable]
    state_shapes: tuple[tuple[tuple[int, ...], str], ...]
    counts: list[Any]   # the random streams' counts before any call

    @classmethod
    def of(cls, module: nnx.Module) -> Split:
        graphdef, state = nnx.split(module)
        return cls(graphdef, state, reached_params(module),
                   tuple(_shape(leaf) for leaf in jax.tree.leaves(state)), rng_counts(module))


@dataclass
class Call:
    """What one run needs: the module split, the arguments fitted to it, and how its outputs
    pair with the reference's output gradients."""

    split: Split
    values: list[tuple[str, Any]]         # port argument -> value, in call order
    leaves: dict[str, jax.Array]          # arguments whose gradient is wanted
    shared: dict[str, str]                # argument -> the leaf standing for it (attn(x, x, x))
    caller: Caller
    caller_key: tuple[Any, ...]           # what decides the caller's behaviour
    pairing: Pairing
    pairing_key: tuple[Any, ...]          # what decides the pairing's answer
    grads: dict[str, np.ndarray]          # the reference's output gradients, by its name


@dataclass
class Ran:
    """What a run made: the outputs, whether a random stream moved, which outputs got which
    reference output gradient, the gradients (parameters by path, inputs by argument; None
    when no output got one), and the submodules the call called (their paths)."""

    outputs: Any
    draws: bool
    paired: dict[str, str]
    grads: tuple[dict[tuple[Any, ...], jax.Array], dict[str, jax.Array]] | None
    called: set[tuple[Any, ...]]


@dataclass
class _Program:
    run: Callable[..., Any]
    called: set[tuple[Any, ...]] = field(default_factory=set)
    paired: dict[str, str] = field(default_factory=dict)


class CallRunner:
    """Runs calls, compiled where it can (``compiled=False``: every call eager, as replay ran
    before programs were kept; the benchmark compares the two)."""

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled
        self._programs: dict[tuple[Any, ...], _Program] = {}
        self._eager: set[tuple[Any, ...]] = set()   # keys whose calls run eagerly

    @property
    def programs(self) -> int:
        """How many compiled programs are kept (one per module structure and call shape)."""
        return len(self._programs)

    @property
    def eager_shapes(self) -> int:
        """How many call shapes run eagerly (their code needs concrete values)."""
        return len(self._eager)

    def run(self, call: Call) -> Ran:
        key = _key(call) if self.compiled else None
        if key is not None and key not in self._eager:
            try:
                ran = self._compiled(call, key)
            except Exception:   # what tracing cannot run (concrete values needed) runs eagerly
                self._programs.pop(key, None)
                self._eager.add(key)
            else:
                if not getattr(call.caller, "concrete_used", False):
                    return ran
                # the adapter needed this call's recorded values: they are in the program
                self._programs.pop(key, None)
                self._eager.add(key)
                return ran
        return _eager(call)

    def _compiled(self, call: Call, key: tuple[Any, ...]) -> Ran:
        program = self._programs.get(key)
        if program is None:
            program = self._programs[key] = _program(call)
        floats = {arg: value for arg, value in call.values if _is_float_input(arg, value, call)}
        params = {path: variable[...] for path, variable in call.split.params.items()
                  if floating(variable[...])}
        with jax.default_matmul_precision(MATMUL_PRECISION):
            outputs, counts, grads = program.run(params, call.leaves, floats, call.split.state,
                                                 call.grads)
        return Ran(outputs, _moved(call.split.counts, counts), dict(program.paired), grads,
                   set(program.called))


def _program(call: Call) -> _Program:
    """The call's forward, pairing and vjp as one jitted function; what tracing learns (the
    submodules called, the outputs paired) kept beside it."""
    program = _Program(run=lambda *args: None)
    template = list(call.values)
    split, shared, caller, pairing = call.split, dict(call.shared), call.caller, call.pairing
    param_paths = {path for path, variable in split.params.items() if floating(variable[...])}

    def run(params, leaves, floats, state, grads):
        def pure(params, leaves):
            values = [(arg, leaves.get(shared.get(arg, arg), floats.get(arg, value)))
                      for arg, value in template]
            return call_module(split.graphdef, state, param_paths, params, values, caller,
                               program.called)

        if not grads:
            outputs, counts = pure(params, leaves)
            return outputs, counts, None
        outputs, vjp, counts = jax.vjp(pure, params, leaves, has_aux=True)
        flat = list(flatten(outputs))
        program.paired = pairing(flat, grads)
        if not program.paired:
            return outputs, counts, None
        return outputs, counts, vjp(cotangents(outputs, flat, program.paired, grads))

    options = CPU_COMPILER_OPTIONS if jax.default_backend() == "cpu" else None
    program.run = jax.jit(run, compiler_options=options)
    return program


def _eager(call: Call) -> Ran:
    """The call under ``jax.vjp`` op by op, on the concrete state."""
    split, called = call.split, set()
    params = {path: variable[...] for path, variable in split.params.items()
              if floating(variable[...])}

    def pure(params, leaves):
        values = [(arg, leaves.get(call.shared.get(arg, arg), value))
                  for arg, value in call.values]
        return call_module(split.graphdef, split.state, set(params), params, values,
                           call.caller, called)

    with jax.default_matmul_precision(MATMUL_PRECISION):
        outputs, vjp, counts = jax.vjp(pure, params, call.leaves, has_aux=True)
        draws = _moved(split.counts, counts)
        flat = list(flatten(outputs))
        paired = call.pairing(flat, call.grads) if call.grads and not draws else {}
        grads = vjp(cotangents(outputs, flat, paired, call.grads)) if paired else None
    return Ran(outputs, draws, paired, grads, called)


def call_module(graphdef: Any, state: Any, param_paths: set[tuple[Any, ...]],
                params: dict[tuple[Any, ...], jax.Array], values: list[tuple[str, Any]],
                caller: Caller, called: set[tuple[Any, ...]]) -> tuple[Any, list[Any]]:
    """(outputs, the random streams' counts after): the module merged afresh from its split
    state with ``params`` in place, called on ``values``; the submodules it calls are added to
    ``called`` (their paths in its state)."""
    # rebuilt inside the trace: variables made outside it may not be written in it
    fresh = jax.tree.map(lambda leaf: leaf, state)
    for path in param_paths:
        holder = fresh
        for key in path[:-1]:
            holder = holder[key]
        holder[path[-1]] = holder[path[-1]].replace(params[path])
    copy = nnx.merge(graphdef, fresh)
    args, kwargs = caller(values)
    with intercepted([node for _, node in nnx.iter_graph(copy)
                      if isinstance(node, nnx.Module)], _CalledChildren(copy, called)):
        outputs = copy(*args, **kwargs)
    return outputs, rng_counts(copy)


def cotangents(outputs: Any, flat: list[tuple[str, Any]], paired: dict[str, str],
               grads: dict[str, Any]) -> Any:
    """The vjp's cotangent in ``outputs``' structure: the reference's gradient at each paired
    output (in the output's dtype and shape), zero at an output no gradient came to (float0's
    empty one at an integer output), None at a None output (an attention's weights)."""
    leaves = []
    for arg, value in flat:
        if arg in paired and floating(value):
            grad = grads[paired[arg]]
            leaves.append(jnp.asarray(grad, dtype=value.dtype).reshape(value.shape))
        elif value is None:
            leaves.append(None)
        else:
            leaves.append(jnp.zeros_like(value) if floating(value) else
                          np.zeros(np.shape(value), dtype=jax.dtypes.float0))
    return unflatten(outputs, leaves)


def _key(call: Call) -> tuple[Any, ...] | None:
    """What decides a compiled program, or None where it cannot be told (a structure that does
    not hash): then the call runs eagerly."""
    arguments = []
    for arg, value in call.values:
        if arg in call.leaves:
            arguments.append((arg, "leaf", _shape(value)))
        elif arg in call.shared:
            arguments.append((arg, "shared", call.shared[arg]))
        elif _is_float_input(arg, value, call):
            arguments.append((arg, "float", _shape(value)))
        elif isinstance(value, (jax.Array, np.ndarray)):
            array = np.asarray(value)
            arguments.append((arg, "array", _shape(value),
                              hashlib.blake2b(array.tobytes(), digest_size=16).hexdigest()))
        elif isinstance(value, NotPlainData):
            arguments.append((arg, "repr", value.type_name))
        else:
            arguments.append((arg, type(value).__name__, repr(value)))
    split = call.split
    key = (split.graphdef, split.state_shapes,
           tuple((path, _shape(variable[...])) for path, variable in split.params.items()),
           tuple(arguments), call.caller_key, call.pairing_key,
           tuple((arg, _shape(grad)) for arg, grad in call.grads.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _is_float_input(arg: str, value: Any, call: Call) -> bool:
    return arg not in call.leaves and arg not in call.shared and floating(value)


def _shape(value: Any) -> tuple[tuple[int, ...], str]:
    return tuple(np.shape(value)), str(getattr(value, "dtype", type(value).__name__))


def _moved(before: list[Any], after: list[Any]) -> bool:
    return any(not np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(before, after, strict=True))


def reached_params(module: nnx.Module) -> dict[tuple[Any, ...], nnx.Variable]:
    """The parameters a module reaches, its children's too, by path in its split state."""
    return {tuple(path): node for path, node in nnx.iter_graph(module)
            if isinstance(node, nnx.Param)}


def rng_counts(module: nnx.Module) -> list[Any]:
    return [node[...] for _, node in nnx.iter_graph(module) if isinstance(node, nnx.RngCount)]


class _CalledChildren:
    """Records the path (in the copy) of every submodule whose ``__call__`` runs."""

    def __init__(self, copy: nnx.Module, called: set[tuple[Any, ...]]) -> None:
        self.paths = {id(node): tuple(path) for path, node in nnx.iter_graph(copy)
                      if isinstance(node, nnx.Module)}
        self.called = called

    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any:
        path = self.paths.get(id(module))
        if path:
            self.called.add(path)
        return original(module, *args, **kwargs)


def unflatten(structure: Any, leaves: list[Any]) -> Any:
    """``leaves`` (in :func:`~layerdiff.trace.arguments.flatten`'s order) put back into
    ``structure``'s shape."""
    it = iter(leaves)

    def build(node: Any) -> Any:
        if isinstance(node, (tuple, list)):
            return type(node)(build(item) for item in node)
        if isinstance(node, dict):
            return {key: build(item) for key, item in node.items()}
        return next(it)

    return build(structure)


def floating(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype,
                                                                          jnp.floating)



def pure_call(module: nnx.Module, values: list[tuple[str, Any]],
              param_paths: set[tuple[Any, ...]], shared: dict[str, str], caller: Caller,
              called: set[tuple[Any, ...]]) -> Callable[..., Any]:
    """(params, differentiated inputs) -> (outputs, whether a random stream moved): one call
    of ``module`` as a pure function (:func:`call_module`), for swap's Flax layer, which runs
    it under its own ``jax.vjp`` each time (``shared``: arguments that are another's value)."""
    graphdef, state = nnx.split(module)
    before = rng_counts(module)

    def pure(params: dict[tuple[Any, ...], jax.Array], leaves: dict[str, jax.Array]):
        outputs, after = call_module(
            graphdef, state, param_paths, params,
            [(arg, leaves.get(shared.get(arg, arg), value)) for arg, value in values],
            caller, called)
        return outputs, _moved(before, after)

    return pure


def vjp_with_draws(pure: Callable[..., Any], params: dict[Any, jax.Array],
                   leaves: dict[str, jax.Array]) -> tuple[tuple[Any, bool], Callable[..., Any]]:
    """``jax.vjp`` of a pure call, with whether it advanced a random stream beside the
    output."""
    outputs, vjp, draws = jax.vjp(pure, params, leaves, has_aux=True)
    return (outputs, bool(draws)), vjp
