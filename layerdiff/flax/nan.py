"""``layerdiff nan`` for a Flax model: its steps run through the capture's own call recorder
into nan's checking writer, and the operation that made the first NaN named by re-running the
origin site's one call under ``jax.experimental.checkify``.

The checking run is the capture's (:mod:`layerdiff.flax.capture`, :mod:`layerdiff.flax.linen`):
the same sites, roles and argument paths, each record handed to the writer nan gives, which
raises at the first non-finite one. Under ``jax.jit`` the records arrive through ordered
callbacks and what the writer raises is raised when the step's computation has finished.

The operation: once nan knows the origin (the site whose own code made the value, its step and
pass), the model stands at the start of that step (the run stopped before the optimizer moved
it). That step is run once more, eagerly, until the origin's call is reached; its module (its
variables of that step) and its arguments are kept, and the backward's gradient arriving at
its outputs when the origin is in the backward (a layer of an ``nnx.scan`` stack, traced once
for all its layers, is given its slice of the stacked variables and the inputs the host
recorded for it). That one call, or its ``jax.vjp`` applied to
that gradient, is then run under ``checkify`` with the NaN checks (and division by zero): the
first primitive whose output is NaN while its inputs were not, and the source line that called
it. An Inf (an overflow) is not a NaN to checkify; for an Inf the call is run once more with
``jax_debug_infs``, which names the first primitive making one.
"""

from __future__ import annotations

import re
import traceback
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from layerdiff.debug.nan import NanKind, NanOp, NanPass, NanResult
from layerdiff.errors import LayerdiffError
from layerdiff.trace import schema
from layerdiff.trace.schema import Role
from layerdiff.trace.writer import site_scope

CHECKIFY = "jax.experimental.checkify (nan and division checks)"
DEBUG_INFS = "jax_debug_infs"
# the frames of these packages are a library's: the source line named is the user's code
# calling into them (the library's own frame is kept beside it)
# primitives that make a NaN only from an Inf operand (inf - inf, 0 * inf, a sum of both)
_NAN_ONLY_FROM_INF = frozenset({"add", "add_any", "sub", "mul", "dot_general", "reduce_sum",
                                "cumsum", "conv_general_dilated", "neg", "select_n"})
_THIS = Path(__file__).resolve()
_LIBRARIES = ("site-packages", "dist-packages", str(Path(__file__).resolve().parents[1]))


class _Quiet:
    """The capture's progress bar, which nan's writer replaces."""

    def advance(self) -> None:
        pass


def run_checked(case: Any, writer: Any, steps: int, *, linen: bool) -> None:
    """Run the Flax ``case``'s steps (optimizer included) with every call recorded into
    ``writer``; the model is trained in place and left where the run stopped."""
    from layerdiff.options import CaptureOptions

    # the framework's own matmul precision: the one the case trains at
    options = CaptureOptions(steps=steps, matmul_precision="default")
    if linen:
        from layerdiff.flax import linen as L

        L.check_options(case, steps, 1.0)
        variables = L.plain(case.params)
        inputs = L.jax_inputs(case.inputs)
        graph = L.LinenGraph.of(case.model, variables, inputs)
        selected = L.selected_modules(graph, (), ())
        sink = L.LinenRecorder(writer, graph, selected, weights=True)
        L.train_steps(case, variables, inputs, sink, writer, steps, options, _Quiet())
        return
    from layerdiff.flax import capture as C
    from layerdiff.flax.graph import ModelGraph

    C.check_options(case, steps, 1.0)
    graph = ModelGraph.of(case.model)
    selected = C.selected_modules(graph, (), ())
    recorder = C.CallRecorder(writer, graph, selected, weights=True,
                               jit=bool(getattr(case, "jit", False)))
    C.train_steps(case, graph, recorder, writer, steps, 1.0, options.matmul_precision, _Quiet())


# ---- the operation

def nan_op(case: Any, result: NanResult, *, linen: bool) -> NanOp | None:
    """The primitive and source line that made ``result``'s first non-finite value (see the
    module's docstring), or a NanOp whose note says why none is named."""
    first, origin = result.first, result.origin
    if first is None:
        return None
    if origin is None:
        return NanOp(None, first.pass_, note="no site's own code made it (the case's inputs "
                     "hold it, or the loss's backward made it): there is no call to re-run")
    site, pass_ = origin.site, origin.pass_
    if pass_ == NanPass.OPTIMIZER:
        return NanOp(site, pass_, note="the optimizer's update made it, not a module's call: "
                     "no call to re-run")
    if site == schema.LOSS_SITE:
        return NanOp(site, pass_, note="the case's loss_fn made it, which is not a module "
                     "call that can be re-run alone")
    if linen:
        return NanOp(site, pass_, note="naming the operation re-runs a Flax NNX module's "
                     "call; a Linen module's call is not re-run yet")
    caught = _catch(case, site, backward=pass_ == NanPass.BACKWARD)
    if isinstance(caught, str):
        return NanOp(site, pass_, note=caught)
    run, values = caught
    try:
        op = _checkify(run, values, site, pass_)
        if op is None and first.kind == NanKind.INF:
            op = _debug_infs(run, values, site, pass_)
        elif op is not None and op.primitive in _NAN_ONLY_FROM_INF:
            # finite operands cannot give these a NaN: an Inf made earlier in the call did
            made = _debug_infs(run, values, site, pass_)
            if made is not None and made.primitive:
                op = replace(made, how=f"{CHECKIFY}, then {DEBUG_INFS}", note=(
                    f"it made an Inf, which `{op.primitive}` at {op.where} turned into the "
                    "NaN"))
    except LayerdiffError:
        raise
    except Exception as exc:  # the call that ran in the step fails alone: say so, keep nan's
        return NanOp(site, pass_, note=f"re-running {site}'s call alone raised "
                     f"{type(exc).__name__}: {exc}")
    if op is not None:
        return op
    why = ("an Inf" if first.kind == NanKind.INF else "a NaN")
    return NanOp(site, pass_, how=CHECKIFY, note=(
        f"re-run alone on its arguments of step {first.step}, {site}'s {pass_} made no "
        f"{why.split()[1]}: the value came in through its inputs in a way the re-run does "
        "not repeat (an operation outside JAX's primitives, or rounding that differs from "
        "the compiled step's)"))


_IN_TRANSFORM = ("{site} is a layer of a stack run inside a JAX transform (an nnx.scan or "
                 "nnx.vmap body), whose values are not concrete outside it: its call is not "
                 "re-run alone")


class _Stop(Exception):
    """Ends the re-run step once the origin's call (and its gradient) is in hand."""


class _CatchWriter:
    """Stands in for the trace writer in the re-run: counts calls as it does (so the origin's
    site name matches) and keeps the gradients arriving at the origin's outputs."""

    def __init__(self, target: str) -> None:
        self.target = target
        self.current_step = 0
        self.last = ""
        self.grads: dict[str, Any] = {}
        self.inputs: dict[str, Any] = {}   # a stack layer's, which its traced call lacks
        self._calls: Counter[str] = Counter()

    def step(self, step: int | None = None) -> None:
        raise _Stop  # one step only

    def enter(self, module: str, type_name: str = "", *, call: int | None = None) -> str:
        call = self._calls[module] if call is None else call
        self._calls[module] = call + 1
        self.last = schema.site_name(module, call)
        return self.last

    def exit(self, site: str) -> None:
        pass

    site = site_scope

    def record(self, site: str, role: str, value: Any, *, arg: str = "0",
               pass_: str | None = None) -> None:
        if site == self.target and role == Role.GRAD_OUTPUT:
            self.grads.setdefault(arg, value)
        elif site == self.target and role == Role.INPUT:
            self.inputs.setdefault(arg, value)


def _catch(case: Any, site: str, *, backward: bool) -> tuple[Any, dict[str, Any]] | str:
    """Run the step the model stands at once more, eagerly, until ``site``'s call: the call as
    a function of (floating variables, floating arguments), and its values; or why not."""
    from layerdiff.flax import capture as C
    from layerdiff.flax.graph import ModelGraph

    graph = ModelGraph.of(case.model)
    modules = dict(graph.modules)
    path, number = schema.split_site(site)
    selected = C.selected_modules(graph, (), ())
    writer = _CatchWriter(site)
    kept: dict[str, Any] = {}

    class Catcher(C.CallRecorder):
        def _inputs(self, call: Any, module: Any, args: tuple, kwargs: dict, *more: Any
                    ) -> tuple[tuple, dict]:
            tapped = super()._inputs(call, module, args, kwargs, *more)
            if kept:
                return tapped
            if call.stack is None and writer.last == site:
                graphdef, state = nnx.split(module)
                kept.update(graphdef=graphdef, state=_plain(state),
                            arguments=_plain((args, kwargs)))
                if not backward:
                    raise _Stop
            elif call.stack is not None and number == 0:
                # a layer of a stack run by a transform: traced once for every layer; its
                # values are the stacked variables' slice and the inputs the host records
                layer = next((k for k in range(call.stack.n)
                              if call.stack.name(call.path, k) == path), None)
                if layer is not None:
                    graphdef, state = nnx.split(module)
                    kept.update(graphdef=graphdef, state=state, arguments=(args, kwargs),
                                stack=(call.stack, layer, call.path))
            return tapped

        def record_weight_grads(self, grads: dict) -> None:
            raise _Stop  # the backward is done: the optimizer must not move the model

    catcher = Catcher(writer, graph, selected, weights=False, jit=False)
    state_before = nnx.state(case.model)
    try:
        C.train_steps(case, graph, catcher, writer, 1, 1.0, "default", _Quiet())
    except _Stop:
        pass
    except LayerdiffError:
        raise
    except Exception as exc:
        if not kept:
            return (f"re-running the failing step eagerly to reach {site}'s call raised "
                    f"{type(exc).__name__}: {exc}")
    finally:
        nnx.update(case.model, state_before)
    if not kept:
        return f"re-running the failing step eagerly never called {site}"
    if "stack" in kept and not _concrete_layer(kept, modules, writer.inputs):
        return _IN_TRANSFORM.format(site=site)
    if any(isinstance(leaf, jax.core.Tracer) for leaf in jax.tree.leaves(
            (kept["state"], kept["arguments"]))):
        return _IN_TRANSFORM.format(site=site)
    return _as_function(kept, writer.grads if backward else None)


def _concrete_layer(kept: dict[str, Any], modules: dict[str, Any],
                    inputs: dict[str, Any]) -> bool:
    """A stack layer's call made concrete in ``kept``: its variables layer k's slice of the
    model's stacked ones, its arguments those the host recorded (by argument path). False
    when one has no concrete value."""
    from layerdiff.flax.capture import rebuild

    stack, k, module_path = kept["stack"]
    stacked = {tuple(p): v for p, v in nnx.to_flat_state(nnx.state(modules[module_path]))}
    flat = []
    for key, variable in nnx.to_flat_state(kept["state"]):
        whole = stacked.get(tuple(key))
        if whole is None:
            return False
        value = whole.get_value() if isinstance(whole, nnx.Variable) else whole
        traced = variable.get_value() if isinstance(variable, nnx.Variable) else variable
        if getattr(value, "shape", None) != getattr(traced, "shape", None):
            value = stack.take(value, k)
        flat.append((key, variable.replace(jnp.asarray(value))
                      if isinstance(variable, nnx.Variable) else jnp.asarray(value)))
    missing: list[str] = []

    def recorded(arg: str, value: Any) -> Any:
        if not isinstance(value, jax.core.Tracer):
            return value
        if arg not in inputs:
            missing.append(arg)
            return value
        return jnp.asarray(inputs[arg])

    args, kwargs = kept["arguments"]
    args = tuple(rebuild(value, str(i), recorded) for i, value in enumerate(args))
    kwargs = {key: rebuild(value, key, recorded) for key, value in kwargs.items()}
    if missing:
        return False
    kept["state"] = nnx.from_flat_state(flat)
    kept["arguments"] = (args, kwargs)
    return True


def _plain(tree: Any) -> Any:
    """``tree``'s arrays without their gradient (concrete in eager code)."""
    return jax.tree.map(lambda v: jax.lax.stop_gradient(v) if isinstance(v, jax.Array) else v,
                        tree)


def _floating(value: Any) -> bool:
    return isinstance(value, jax.Array) and jnp.issubdtype(value.dtype, jnp.floating)


def _as_function(kept: dict[str, Any], grads: dict[str, Any] | None
                 ) -> tuple[Any, dict[str, Any]]:
    """The call as ``run(variables, arguments[, cotangents])`` of its floating leaves: the
    forward's outputs, or under ``grads`` the vjp's gradients of variables and arguments."""
    from layerdiff.flax.capture import rebuild

    graphdef = kept["graphdef"]
    state_leaves, state_def = jax.tree.flatten(kept["state"])
    arg_leaves, arg_def = jax.tree.flatten(kept["arguments"])
    state_at = [i for i, leaf in enumerate(state_leaves) if _floating(leaf)]
    arg_at = [i for i, leaf in enumerate(arg_leaves) if _floating(leaf)]

    def fill(leaves: list[Any], at: list[int], values: list[Any]) -> list[Any]:
        leaves = list(leaves)
        for i, value in zip(at, values, strict=True):
            leaves[i] = value
        return leaves

    names: list[str] = []   # the floating outputs' argument paths, in order

    def outputs(variables: list[Any], arguments: list[Any]) -> list[Any]:
        state = jax.tree.unflatten(state_def, fill(state_leaves, state_at, variables))
        args, kwargs = jax.tree.unflatten(arg_def, fill(arg_leaves, arg_at, arguments))
        output = nnx.merge(graphdef, state)(*args, **kwargs)
        flat: list[tuple[str, Any]] = []
        rebuild(output, "", lambda arg, v: flat.append((arg, v)) or v)
        kept = [(arg, v) for arg, v in flat if _floating_like(v)]
        names[:] = [arg for arg, _ in kept]
        return [v for _, v in kept]

    variables = [state_leaves[i] for i in state_at]
    arguments = [arg_leaves[i] for i in arg_at]
    if grads is None:
        return outputs, {"variables": variables, "arguments": arguments}
    # the cotangent of each floating output: the one the step's backward brought it, by its
    # argument path, else zero (nothing downstream used it)
    shapes = jax.eval_shape(outputs, variables, arguments)
    cotangents = [jnp.asarray(grads[name], dtype=shape.dtype) if name in grads
                  else jnp.zeros(shape.shape, shape.dtype)
                  for name, shape in zip(names, shapes, strict=True)]

    def backward(variables: list[Any], arguments: list[Any], cotangents: list[Any]) -> Any:
        _, vjp = jax.vjp(outputs, variables, arguments)
        return vjp(cotangents)

    return backward, {"variables": variables, "arguments": arguments,
                      "cotangents": cotangents}


def _floating_like(value: Any) -> bool:
    return (hasattr(value, "dtype") and hasattr(value, "shape")
            and jnp.issubdtype(value.dtype, jnp.floating))


def _checkify(run: Any, values: dict[str, Any], site: str, pass_: str) -> NanOp | None:
    from jax.experimental import checkify

    error, _ = checkify.checkify(run, errors=checkify.float_checks)(*values.values())
    exc = error.get_exception()
    if exc is None:
        return None
    primitive = getattr(exc, "prim", None) or ("div" if "division" in str(exc) else str(exc))
    return _located(site, pass_, primitive, _frames_of(exc.traceback_info), CHECKIFY)


def _frames_of(jax_traceback: Any) -> list[tuple[str, int, str]]:
    """The traceback's frames outside JAX, innermost first: (file, line, function)."""
    try:
        from jax._src import source_info_util
    except ImportError:  # a JAX without it: the primitive is still named
        return []
    return [(frame.file_name, frame.start_line, frame.function_name)
            for frame in source_info_util.user_frames(jax_traceback)]


def _debug_infs(run: Any, values: dict[str, Any], site: str, pass_: str) -> NanOp | None:
    """For an Inf: JAX's debug mode for Infs re-runs the failing computation one primitive at a
    time and raises at the first making one."""
    try:
        with jax.debug_infs(True), jax.disable_jit():
            jax.block_until_ready(run(*values.values()))
    except FloatingPointError as exc:
        found = re.search(r"encountered in (\w+)", str(exc))
        frames = [(f.filename, f.lineno or 0, f.name)
                  for f in reversed(traceback.extract_tb(exc.__traceback__))
                  if not re.search(r"[/\\]jax(lib)?[/\\]", f.filename)]
        return _located(site, pass_, found.group(1) if found else None, frames, DEBUG_INFS)
    return None


def _located(site: str, pass_: str, primitive: str | None,
             frames: list[tuple[str, int, str]], how: str) -> NanOp:
    """The op at the innermost frame outside the libraries (the user's line), the innermost
    frame kept beside it when a library's code ran the primitive."""
    # the frames inside the call: those outside it (this module's, nan's, the user's script
    # that called find_nan) did not run the primitive
    inside = []
    for frame in frames:
        if Path(frame[0]).resolve() == _THIS:
            break
        inside.append(frame)
    frames = inside
    user = next((f for f in frames if not any(lib in f[0] for lib in _LIBRARIES)), None)
    innermost = frames[0] if frames else None
    library = (f"{innermost[0]}:{innermost[1]} ({innermost[2]})"
               if innermost is not None and user is not None and innermost is not user
               else None)
    chosen = user or innermost
    if chosen is None:
        return NanOp(site, pass_, primitive, how=how,
                     note="the primitive carries no source line outside JAX")
    return NanOp(site, pass_, primitive, chosen[0], chosen[1], chosen[2], library, how)
