"""Capturing a Flax NNX case into a layerdiff trace: the same sites, roles and argument paths
as a torch capture, so that ``diff`` judges a Flax port against its torch reference.

How one step is recorded, with one forward and one backward and nothing added to what the
model computes:

- Every submodule call is seen by replacing its class's ``__call__`` for the length of the
  capture (:mod:`layerdiff.flax.intercept`); the site is the module's attribute path
  (``blocks.0.attn#0``, ``<root>#0``), counted per call as torch's are.
- The forward runs under ``jax.vjp`` of the loss as a function of the parameters (the whole
  step under ``jax.jit`` when the case asks: ``Case.jit``). Each call's inputs and outputs
  are sent, without their gradient (``jax.lax.stop_gradient``), to the host side
  (:mod:`layerdiff.flax.records`): directly where the code runs eagerly, through an ordered
  ``jax.debug.callback`` where JAX traces it (in an ``nnx.scan`` body), so they arrive in
  program order either way. Under jit, :mod:`layerdiff.flax.staging` sends them cheaper: the
  step's own level and an ``nnx.scan`` body's as extra outputs of the step (a scan body's
  cotangents as the gradients of zero *sinks*), an ``nnx.remat`` body's in one callback per
  pass, merged on the host in trace order. Every input and output a gradient can reach passes
  through a *tap*: an identity with a custom VJP whose backward rule sends the cotangent
  arriving at exactly that point (``grad_input`` when the tap sits on an input inside the
  call, ``grad_output`` on an output after the call returned). JAX calls a backward rule only
  where a cotangent flows, so an output nothing uses gets no ``grad_output``, as in torch; a
  value no parameter reaches (the case's inputs, token ids) takes the tap's plain path and
  gets no gradient record, as a torch tensor that does not require grad. The taps return
  their input unchanged, bit for bit.
- A layer of a stack run by ``nnx.scan`` is a copy of the stacked module holding one slice of
  its variables: each module of the step's copy carries its path as an attribute, which the
  copies transforms make keep, and :mod:`layerdiff.flax.stacks` names the layer
  (``layers.K``); the host counts which iteration it is.
- Weights are recorded at the first call of the module that owns them (or, for a module never
  called, at the end of its nearest called ancestor's first call), and weight gradients after
  the backward, in reverse order, as :mod:`layerdiff.capture.hooks` does.

This was chosen over perturbations added to every call's inputs and outputs (exact too, but one
zero array per recorded value and a second, discovery, forward to size them) and over a
``jax.vjp`` per call on its recorded inputs (one backward per call, and a gradient that is the
call's own only where every input is tapped: the taps give both in the one backward).
"""

from __future__ import annotations

import contextlib
import fnmatch
import functools
import os
import platform
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from layerdiff.case import (
    Case,
    check_loss_scale,
    check_scaled_loss,
    nothing_selected,
    seed_everything,
)
from layerdiff.errors import CaptureError, LayerdiffError, interrupt_inside
from layerdiff.flax import records, stacks
from layerdiff.flax.graph import ModelGraph
from layerdiff.flax.intercept import intercepted
from layerdiff.flax.records import Call, HostRecords, Leaf
from layerdiff.flax.stacks import Stack
from layerdiff.flax.staging import Restage, Staging, Unbatched, current_trace
from layerdiff.options import CaptureOptions
from layerdiff.progress import StepProgress
from layerdiff.signature import Signature
from layerdiff.trace import schema
from layerdiff.trace.schema import Role
from layerdiff.trace.writer import TraceWriter, check_writable

PRODUCER = "layerdiff.capture (flax)"
# the capture options a Flax capture takes (the rest are torch's hooks': --ops, --autocast...)
ACCEPTED = frozenset({"include", "exclude", "loss_scale", "steps", "summary", "weights",
                      "queue_bytes", "progress", "dtype", "extra_meta", "matmul_precision"})
DTYPES = {"float64": jnp.float64, "float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}


def capture_nnx(case: Case, path: str | os.PathLike, options: CaptureOptions) -> Path:
    """Run the Flax NNX ``case`` with every selected submodule call recorded into the trace
    at ``path`` (see the module's docstring; the options are
    :func:`layerdiff.capture.capture`'s). ``options.matmul_precision`` pins
    ``jax.default_matmul_precision`` for the forward and the backward (full float32 by
    default; ``"default"`` captures at the framework's own). Returns the published path."""
    options.refuse(ACCEPTED, case.name, "is a Flax model")
    steps = case.steps if options.steps is None else options.steps
    check_options(case, steps, options.loss_scale)
    if options.dtype is not None:
        cast_nnx_case(case, options.dtype)
    check_writable(path)
    graph = ModelGraph.of(case.model)
    selected = selected_modules(graph, options.include, options.exclude)
    meta = _meta(case, graph, options.matmul_precision)
    meta["shared_parameters"] = graph.shared_parameters(selected)
    meta.update(options.meta(steps))
    summary, loss_scale, precision = options.summary, options.loss_scale, options.matmul_precision
    progress, weights, queue_bytes = options.progress, options.weights, options.queue_bytes
    writer = TraceWriter(path, meta=meta, summary=summary, queue_bytes=queue_bytes,
                         producer=PRODUCER)
    sink = CallRecorder(writer, graph, selected, weights=weights,
                         jit=bool(getattr(case, "jit", False)))
    with failures_named(writer, case.name, sink), StepProgress(
            steps, enabled=progress, label=f"capture {case.name}") as bar:
        train_steps(case, graph, sink, writer, steps, loss_scale, precision, bar)
    return writer.close()


@contextlib.contextmanager
def failures_named(writer: TraceWriter, case: str, sink: Any) -> Iterator[None]:
    """A Flax capture's steps (NNX's and Linen's): whatever fails closes the trace unpublished;
    the model's exception becomes one sentence naming the site (``sink.failed``), the phase
    and the step, and a Ctrl-C wrapped on its way out is the user's Ctrl-C again."""
    try:
        yield
    except LayerdiffError:
        writer.close(complete=False)
        raise
    except Exception as exc:
        partial = writer.close(complete=False)
        if interrupt_inside(exc) is not None:
            raise KeyboardInterrupt from exc  # the user's Ctrl-C, wrapped on its way
        where = f" inside site {sink.failed}" if sink.failed else ""
        raise CaptureError(
            f"case {case}: the model raised {type(exc).__name__}: {exc}{where} during the "
            f"{sink.phase} of step {writer.current_step}; no trace was published ({partial} "
            "holds what was recorded up to there)") from exc
    except BaseException:
        writer.close(complete=False)
        raise


def check_options(case: Case, steps: int, loss_scale: float) -> None:
    if steps < 1:
        raise CaptureError(f"--steps must be at least 1 (got {steps}) for case {case.name}")
    if steps > 1 and case.optimizer is None:
        raise CaptureError(f"case {case.name} has no optimizer, so it cannot run {steps} steps; "
                           "give the Case an optax optimizer or use --steps 1")
    check_loss_scale(loss_scale, "float64" if jax.config.jax_enable_x64 else "float32")


def floating_cast(case: Case, dtype: str) -> Callable[[Any], Any]:
    """A function casting a floating array to ``dtype`` and leaving anything else as it is,
    or a refusal naming what is wrong with ``dtype`` for this case (NNX and Linen alike)."""
    if dtype not in DTYPES:
        raise CaptureError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    if dtype == "float64" and not jax.config.jax_enable_x64:
        raise CaptureError(f"--dtype float64 needs JAX's 64-bit mode, which is off (JAX would "
                           f"cast case {case.name} to float32 instead): set JAX_ENABLE_X64=1 "
                           "before JAX is imported, or jax.config.update('jax_enable_x64', "
                           "True) before the model is built")
    target = DTYPES[dtype]

    def cast(value: Any) -> Any:
        if isinstance(value, (jax.Array, np.ndarray)) and jnp.issubdtype(value.dtype,
                                                                          jnp.floating):
            return jnp.asarray(value, dtype=target)
        return value

    return cast


def cast_nnx_case(case: Case, dtype: str) -> None:
    """Cast the model's floating variables (parameters, BatchNorm statistics) and the case's
    floating inputs to ``dtype``, in place; integer inputs stay as they are."""
    cast = floating_cast(case, dtype)
    state = nnx.state(case.model, nnx.Not(nnx.RngState))
    nnx.update(case.model, jax.tree.map(cast, state))
    case.inputs = jax.tree.map(cast, case.inputs)


def selected_modules(graph: ModelGraph, include: Sequence[str], exclude: Sequence[str]) -> set[str]:
    paths = [path for path, _ in graph.modules]
    for pattern in include:
        if not any(fnmatch.fnmatchcase(path, pattern) for path in paths):
            raise CaptureError(f"--include {pattern!r} matches no module of the Flax model; "
                               f"module paths look like: {', '.join(paths[:8])}")
    selected = {path for path in paths
                if (not include or any(fnmatch.fnmatchcase(path, p) for p in include))
                and not any(fnmatch.fnmatchcase(path, p) for p in exclude)}
    if not selected:
        raise CaptureError(nothing_selected(include, exclude, "the Flax model", paths))
    return selected


def _arrays(state: Any) -> dict[tuple, jax.Array]:
    """A state's values by path (the variables unwrapped)."""
    flat = nnx.to_flat_state(state)
    leaves = jax.tree.leaves(state)
    if len(leaves) == len(flat):  # the same order: a tenth of the time of get_value() each
        return {tuple(path): leaf for (path, _), leaf in zip(flat, leaves, strict=True)}
    return {tuple(path): (value.get_value() if isinstance(value, nnx.Variable) else value)
            for path, value in flat}


@contextlib.contextmanager
def matmul_precision(name: str) -> Iterator[None]:
    if name == "default":
        yield
    else:
        with jax.default_matmul_precision(name):
            yield


def train_steps(case: Case, graph: ModelGraph, sink: CallRecorder, writer: TraceWriter,
           steps: int, loss_scale: float, precision: str, bar: StepProgress) -> None:
    """The steps: forward and backward under one ``jax.vjp`` (the two under ``jax.jit`` when
    the case asks), then the optimizer's update."""
    seed_everything(case.seed)
    model = case.model
    inputs = jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v,
                          case.inputs)
    tx = case.optimizer
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params) if tx is not None else None
    modules = [module for _, module in graph.modules]
    # the inputs' arrays are the step's arguments, their other leaves (None, flags) stay Python
    leaves, treedef = jax.tree.flatten(inputs)
    dynamic = [i for i, leaf in enumerate(leaves) if _is_array(leaf)]

    def step_fn(params: Any, rest: Any, arrays: list[Any], scale: Any) -> tuple[Any, ...]:
        staging = sink.staging
        if staging is not None:
            staging.begin_trace()
            staging.top_level()
        given = list(leaves)
        for i, array in zip(dynamic, arrays, strict=True):
            given[i] = array
        call_inputs = jax.tree.unflatten(treedef, given)
        sinks = staging.sink_zeros() if staging is not None else []

        def forward(params: Any, sinks: list[list[Any]]) -> tuple[Any, Any]:
            if staging is not None:
                staging.top_level()
                staging.take_sinks(sinks)
            copy = nnx.merge(graphdef, params, rest, copy=True)
            sink.bind(copy)
            with intercepted(modules, sink):
                output = (copy(**call_inputs) if isinstance(call_inputs, dict)
                          else copy(*call_inputs))
                loss = case.loss_fn(output)
            return loss, nnx.state(copy, nnx.Not(nnx.Param))

        sink.phase = "forward"
        loss, backward, new_rest = jax.vjp(forward, params, sinks, has_aux=True)
        sink.phase = "loss"
        if getattr(loss, "shape", None) != ():
            raise CaptureError(f"case {case.name}: loss_fn returned {type(loss).__name__} of "
                               f"shape {getattr(loss, 'shape', '?')}, not a scalar JAX array")
        sink.emit_loss(loss)
        sink.phase = "backward"
        grads, sink_grads = backward(jnp.asarray(scale, dtype=loss.dtype))
        if staging is None:
            return loss, grads, new_rest, None, None
        staging.end_trace()
        return loss, grads, new_rest, *staging.outputs(sink_grads)

    run = jax.jit(step_fn) if sink.jit else step_fn
    done = (params, rest)  # the state after the last completed step
    try:
        for step in range(steps):
            if step:
                writer.step(step)
            sink.begin_step(_arrays(params) | _arrays(rest))
            arguments = (params, rest, [leaves[i] for i in dynamic], loss_scale)
            with matmul_precision(precision):
                run, (loss, grads, rest, plan, values) = _run_step(run, step_fn, arguments,
                                                                   sink.staging)
            jax.effects_barrier()  # every record of the step has arrived
            sink.raise_kept()
            if sink.staging is not None:
                sink.staging.merge(int(plan), values)
            params, opt_state = _after_backward(case, sink, writer, loss, grads, params,
                                                opt_state, loss_scale)
            done = (params, rest)
            bar.advance()  # writer.step() checkpoints: a crash in a later step keeps this one
    finally:
        # into the model once, not each step: about 2 ms on a small model, more than its
        # compiled step
        nnx.update(model, *done)


def _after_backward(case: Case, sink: CallRecorder, writer: TraceWriter, loss: Any, grads: Any,
                    params: Any, opt_state: Any, loss_scale: float) -> tuple[Any, Any]:
    """The scaled loss checked, the weight gradients recorded, and the optimizer's update:
    the parameters and optimizer state the next step starts from."""
    if loss_scale != 1.0:
        check_scaled_loss(case.name, writer.current_step, float(loss),
                          float(loss * jnp.asarray(loss_scale, loss.dtype)),
                          str(loss.dtype), loss_scale)
    sink.record_weight_grads(_arrays(grads))
    sink.phase = "optimizer step"
    tx = case.optimizer
    if tx is None:
        return params, opt_state
    grads = unscaled_and_clipped(grads, loss_scale, case.clip_grad_norm)
    updates, opt_state = tx.update(grads, opt_state, params)
    return apply_updates(params, updates), opt_state


def _run_step(run: Callable[..., Any], step_fn: Callable[..., Any], arguments: tuple,
              staging: Staging | None) -> tuple[Callable[..., Any], tuple]:
    """One step's results, and the (maybe re-traced) step to run the next steps with: traced
    again once with the sinks its first trace sized, or with one callback per nested event
    where the records inside a nested trace cannot be staged."""
    try:
        with scans(staging):
            try:
                return run, run(*arguments)
            except Restage:
                run = jax.jit(step_fn)
                return run, run(*arguments)
    except Unbatched:
        run = jax.jit(step_fn)
        with scans(staging):
            return run, run(*arguments)


def scans(staging: Staging | None) -> contextlib.AbstractContextManager[None]:
    """Under jit, a scan's body records as the scan's outputs (:meth:`Staging.scans`)."""
    return staging.scans() if staging is not None else contextlib.nullcontext()


def unscaled_and_clipped(grads: Any, loss_scale: float, max_norm: float | None) -> Any:
    if loss_scale != 1.0:
        grads = jax.tree.map(lambda g: g / loss_scale, grads)
    if max_norm is not None:  # as torch.nn.utils.clip_grad_norm_: coefficient capped at 1
        norm = jnp.sqrt(sum(jnp.sum(jnp.square(g.astype(jnp.float32)))
                            for g in jax.tree.leaves(grads)))
        coefficient = jnp.minimum(max_norm / (norm + 1e-6), 1.0)
        grads = jax.tree.map(lambda g: (g * coefficient).astype(g.dtype), grads)
    return grads


def apply_updates(params: Any, updates: Any) -> Any:
    import optax

    return optax.apply_updates(params, updates)


def _is_array(value: Any) -> bool:
    return isinstance(value, (jax.Array, np.ndarray))


def _differentiable(value: Any) -> bool:
    """A value that depends on a parameter under the step's vjp: a tracer of a float dtype."""
    return isinstance(value, jax.core.Tracer) and jnp.issubdtype(value.dtype, jnp.inexact)


def rebuild(value: Any, prefix: str, leaf: Callable[[str, Any], Any]) -> Any:
    """``value`` with each leaf replaced by ``leaf(argument path, leaf)``: the paths and their
    order are :func:`layerdiff.trace.arguments.flatten`'s (``0``, ``1.0``, ``mask``)."""
    if isinstance(value, (tuple, list)):
        items = [rebuild(item, f"{prefix}.{i}" if prefix else str(i), leaf)
                 for i, item in enumerate(value)]
        if hasattr(value, "_fields"):  # a namedtuple
            return type(value)(*items)
        return type(value)(items)
    if isinstance(value, dict):
        return {key: rebuild(item, f"{prefix}.{key}" if prefix else str(key), leaf)
                for key, item in value.items()}
    return leaf(prefix or "0", value)


# the attribute each module of the step's copy carries, its path: NNX keeps a module's plain
# attributes in its graph definition, so the copies a transform makes (nnx.scan's layer, a
# module under nnx.remat) carry it too
TAG = "_layerdiff_path"


@dataclass(eq=False)
class _Grad:
    """Where a tap's cotangent goes: the host's grad event for one call, role and argument;
    under jit, ``staging`` and whether the cotangent sends what its trace buffered
    (:mod:`layerdiff.flax.staging`)."""

    records: HostRecords
    call: Call
    role: str
    arg: str
    staging: Staging | None = None
    flush: bool = True
    sink: tuple[int, int] | None = None  # its sink's place, where its cotangent leaves so

    def emit(self, cotangent: Any) -> None:
        static = (self.call, self.role, self.arg)
        if self.sink is not None:
            self.staging.send_sunk(self.records.grad, static, self.sink)
        elif self.staging is not None:
            self.staging.send(self.records.grad, static, [cotangent], flush=self.flush)
        else:
            _send(self.records, self.records.grad, static, [cotangent],
                  staged=isinstance(cotangent, jax.core.Tracer))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tap(where: _Grad, x: Any) -> Any:
    """``x`` unchanged; the cotangent that reaches it is sent to ``where``."""
    return x


def _tap_forward(where: _Grad, x: Any) -> tuple[Any, None]:
    return x, None


def _tap_backward(where: _Grad, _: None, cotangent: Any) -> tuple[Any]:
    where.emit(cotangent)
    return (cotangent,)


_tap.defvjp(_tap_forward, _tap_backward)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _sink_tap(where: _Grad, x: Any, sink: Any) -> Any:
    """``x`` unchanged; the cotangent that reaches it is also ``sink``'s, to leave the step
    as the sink's gradient (:meth:`Staging.sink_zeros`)."""
    return x


def _sink_tap_forward(where: _Grad, x: Any, sink: Any) -> tuple[Any, None]:
    return x, None


def _sink_tap_backward(where: _Grad, _: None, cotangent: Any) -> tuple[Any, Any]:
    where.emit(cotangent)
    return cotangent, cotangent


_sink_tap.defvjp(_sink_tap_forward, _sink_tap_backward)


def _send(records: HostRecords, event: Callable[..., None], static: tuple, values: list[Any],
          *, staged: bool) -> None:
    """Hand an event to the host: now, in eager code (after whatever compiled code still runs
    has sent its own: jax.effects_barrier, about a microsecond), or from the compiled code
    when it runs, in program order (an ordered debug callback)."""
    if staged:
        jax.debug.callback(functools.partial(records.staged, event, *static), *values,
                           ordered=True)
    else:
        jax.effects_barrier()
        event(*static, *values)


class CallRecorder:
    """The traced side of a capture (see the module's docstring): each intercepted call made a
    :class:`Call`, its inputs and outputs sent to the host's :class:`HostRecords`, and a tap
    put on each value a gradient can reach."""

    def __init__(self, writer: TraceWriter, graph: ModelGraph, selected: set[str], *,
                 weights: bool, jit: bool = False) -> None:
        self.writer = writer
        self.graph = graph
        self.selected = selected
        self.jit = jit
        self.modules = dict(graph.modules)
        self.owned = ({path: owned for path, owned in graph.owned.items() if path in selected}
                      if weights else {})
        # owners under each selected module, with their names relative to it (nearest first)
        self.below: dict[str, list[tuple[str, str]]] = {}
        for owner in self.owned:
            if owner == schema.ROOT_MODULE:
                continue
            parts = owner.split(".")
            for depth in range(len(parts) - 1, -1, -1):
                ancestor = ".".join(parts[:depth]) or schema.ROOT_MODULE
                if ancestor in selected:
                    self.below.setdefault(ancestor, []).append(
                        (owner, ".".join(parts[depth:]) + "."))
        self.host = HostRecords(writer, self.owned, self.below)
        # under jit: how records leave the compiled step; the trace each open call runs in
        self.staging = Staging() if jit else None
        self.traces: list[Any] = []
        self.paths: dict[int, str] = {}
        self.copies: dict[int, tuple[str, Stack | None]] = {}
        self.original_shapes: dict[str, dict[tuple, tuple[int, ...]]] = {}
        self.stack: list[int] = []
        self.calls: list[Call] = []    # the recorded calls open now, innermost last
        self.phase = "setup"
        self.failed = ""

    def begin_step(self, values: dict[tuple, Any]) -> None:
        self.host.begin_step(values)

    def bind(self, model: nnx.Module) -> None:
        """The copy of the model this step runs: its modules' identities and paths, each
        module tagged with its path for the copies transforms make of it."""
        self.paths = self.graph.module_names(model)
        for _, node in nnx.iter_graph(model):
            if isinstance(node, nnx.Module) and id(node) in self.paths:
                setattr(node, TAG, self.paths[id(node)])
        self.copies.clear()
        self.stack.clear()
        self.calls.clear()

    def emit_loss(self, loss: Any) -> None:
        if self.staging is not None:
            self.staging.send_loss(self.host.loss, jax.lax.stop_gradient(loss))
            return
        _send(self.host, self.host.loss, (), [jax.lax.stop_gradient(loss)],
              staged=isinstance(jax.lax.stop_gradient(loss), jax.core.Tracer))

    def raise_kept(self) -> None:
        """What a callback of the compiled step raised, raised here."""
        error, self.host.error = self.host.error, None
        if error is not None:
            raise error

    def record_weight_grads(self, grads: dict[tuple, Any]) -> None:
        self.host.record_weight_grads(grads)

    # ---- the intercepted call
    def _identify(self, module: Any) -> tuple[str, Stack | None]:
        key = id(module)
        path = self.paths.get(key)
        stack = None
        if path is None:
            if key in self.copies:
                return self.copies[key]
            path = vars(module).get(TAG)
            if path is None:
                where = f" inside {self.calls[-1].path}" if self.calls else ""
                raise CaptureError(
                    f"a {type(module).__name__} that the model does not hold as an attribute "
                    f"was called{where}: a module made during the call; layerdiff names sites "
                    "by attribute path, so make it in __init__")
            if path not in self.original_shapes:
                self.original_shapes[path] = stacks.shapes(self.modules[path])
            found = stacks.sliced_axis(self.original_shapes[path], stacks.shapes(module), path)
            if found is not None:
                axis, n = found
                stack = Stack(stacks.stack_root(self.modules, path, axis, n), n, axis)
        if stack is None:  # a submodule of a layer with no variables of its own (an act)
            stack = next((c.stack for c in reversed(self.calls) if c.stack is not None
                          and records.under(path, c.stack.root)), None)
        if key not in self.paths:
            self.copies[key] = (path, stack)
        return path, stack

    def call(self, original: Callable[..., Any], module: Any, args: tuple,
             kwargs: dict) -> Any:
        key = id(module)
        path, stack = self._identify(module)
        if (self.stack and self.stack[-1] == key) or path not in self.selected:
            self.stack.append(key)  # super().__call__, or a module left out: not a site
            try:
                return original(module, *args, **kwargs)
            finally:
                self.stack.pop()
        call = Call(path, type(module).__name__, stack)
        trace = current_trace() if self.staging is not None else None
        # the first recorded call of its trace: under jit, its end sends what the trace holds
        outermost = trace is not None and not any(t is trace for t in self.traces)
        self.stack.append(key)
        self.calls.append(call)
        self.traces.append(trace)
        try:
            args, kwargs = self._inputs(call, module, args, kwargs, outermost)
            output = original(module, *args, **kwargs)
            output = self._outputs(call, module, output, outermost)
        except LayerdiffError:
            raise
        except Exception:
            self.failed = self.failed or f"{path} ({type(module).__name__})"
            raise
        finally:
            self.stack.pop()
            self.calls.pop()
            self.traces.pop()
        return output

    def _inputs(self, call: Call, module: Any, args: tuple, kwargs: dict,
                outermost: bool = False) -> tuple[tuple, dict]:
        # a value passed under several argument paths (attn(x, x, x)) is one value with one
        # gradient: its grad_input is recorded under its first path, as torch does
        first: dict[int, Any] = {}
        leaves: list[Leaf] = []
        values: list[Any] = []

        def leaf(arg: str, value: Any) -> Any:
            self._keep(arg, value, leaves, values)
            if not _differentiable(value):
                return value
            if id(value) not in first:
                where = self._grad(call, Role.GRAD_INPUT, arg)
                taps.append(where)
                first[id(value)] = self._tap(where, value)
            return first[id(value)]

        taps: list[_Grad] = []
        args = tuple(rebuild(value, str(i), leaf) for i, value in enumerate(args))
        kwargs = {key: rebuild(value, key, leaf) for key, value in kwargs.items()}
        if outermost and len(taps) == 1:
            # the one input's cotangent is the last the backward of this call computes:
            # it sends what the backward's trace buffered (staging's docstring)
            taps[0].flush = True
            self.staging.mark_flushing()
        self._send(self.host.begin, call, module, leaves, values)
        return args, kwargs

    def _tap(self, where: _Grad, value: Any) -> Any:
        """``value`` tapped; in a scan body under jit, its cotangent handed to a sink."""
        found = self.staging.sink_for(value) if self.staging is not None else None
        if found is None:
            return _tap(where, value)
        sink, where.sink = found
        return _sink_tap(where, value, sink)

    def _grad(self, call: Call, role: str, arg: str) -> _Grad:
        if self.staging is None:
            return _Grad(self.host, call, role, arg)
        # in a nested trace, a cotangent buffers only where a later one sends (a flushing
        # input tap traced before it); before that, each sends itself
        flush = not self.staging.has_flushing()
        return _Grad(self.host, call, role, arg, self.staging, flush)

    def _outputs(self, call: Call, module: Any, output: Any, outermost: bool = False) -> Any:
        leaves: list[Leaf] = []
        values: list[Any] = []

        def leaf(arg: str, value: Any) -> Any:
            self._keep(arg, value, leaves, values)
            if _differentiable(value):
                return self._tap(self._grad(call, Role.GRAD_OUTPUT, arg), value)
            return value

        output = rebuild(output, "", leaf)
        self._send(self.host.end, call, module, leaves, values)
        if outermost:
            self.staging.flush()
        return output

    @staticmethod
    def _keep(arg: str, value: Any, leaves: list[Leaf], values: list[Any]) -> None:
        if _is_array(value):
            leaves.append((arg, len(values), None))
            # the value without its gradient: concrete in eager code (its primal)
            values.append(jax.lax.stop_gradient(value) if isinstance(value, jax.Array)
                          else value)
        else:
            leaves.append((arg, -1, value))

    def _send(self, event: Callable[..., None], call: Call, module: Any, leaves: list[Leaf],
              values: list[Any]) -> None:
        staged = self.jit or any(isinstance(v, jax.core.Tracer) for v in values)
        if staged and call.stack is not None and not values:
            # no loop-varying operand: JAX would hoist the callback out of the scan
            values = [jnp.ravel(v)[:1] for v in stacks.first_value(module)]
        if self.staging is not None:
            self.staging.send(event, (call, leaves), values, flush=False)
        else:
            _send(self.host, event, (call, leaves), values, staged=staged)

def _meta(case: Case, graph: ModelGraph, precision: str) -> dict[str, Any]:
    """What only a Flax capture knows of its run (the options' part: ``options.meta``)."""
    params = [v.get_value() for _, v in nnx.to_flat_state(nnx.state(case.model, nnx.Param))]
    return flax_meta(case, params, [m for _, m in graph.modules], "flax.nnx.", precision)


def flax_meta(case: Case, params: list[Any], modules: list[Any], builtin: str,
              precision: str) -> dict[str, Any]:
    """A Flax capture's meta (NNX's and Linen's): ``params`` the parameters' arrays,
    ``modules`` the model's modules, a type from the ``builtin`` package (``"flax.nnx."``)
    being one that runs one op (the diff suggests --ops only where a module's own code can
    hold more)."""
    import flax

    first = params[0] if params else None
    model_dtype = next((str(p.dtype) for p in params if jnp.issubdtype(p.dtype, jnp.floating)),
                       "")
    signatures: dict[str, Any] = {}
    for module in modules:
        name = type(module).__name__
        if name not in signatures and "__call__" in dir(type(module)):
            signature = Signature.of(module.__call__)
            if signature is not None:
                signatures[name] = signature.as_json()
    return {
        "case": case.name,
        "seed": case.seed,
        "framework": "flax",
        "device": str(next(iter(first.devices()))) if isinstance(first, jax.Array) else "cpu",
        "default_dtype": "float64" if jax.config.jax_enable_x64 else "float32",
        "model_dtype": model_dtype,
        "autocast": None,
        "machine": platform.machine(),
        # how matmuls and convolutions ran: "float32" pinned (jax.default_matmul_precision),
        # or "default", the framework's own (TF32 or bf16 passes on accelerators)
        "matmul_precision": precision,
        # the step ran compiled (jax.jit), its records sent from inside the computation
        "jit": bool(getattr(case, "jit", False)),
        "uncalled_weights": "ancestor",
        Role.GRAD_OUTPUT: "outside",
        "signatures": signatures,
        "builtin_types": sorted({type(m).__name__ for m in modules
                                 if type(m).__module__.startswith(builtin)}),
        "versions": {**_versions(), "jax": jax.__version__, "flax": flax.__version__},
    }


def _versions() -> dict[str, str]:
    from layerdiff.trace.writer import base_meta

    return base_meta(PRODUCER)["versions"]
