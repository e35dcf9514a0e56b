"""One Flax NNX module run inside a torch model, forward and backward: how ``swap`` and
``bisect`` put a Flax port's layer into the torch reference.

:class:`FlaxLayer` is a ``torch.nn.Module`` around one NNX submodule. Its floating-point
parameters become torch parameters under the Flax names (``kernel``, ``fc1.kernel``), so the
host's optimizer trains them and swap compares their gradients through the mapping as it does
a torch port layer's. Each call runs the module as a pure function of those parameters and of
the call's tensors (``pure_call`` of :mod:`layerdiff.flax.calls`: the module merged
afresh from its split state, so the model itself never changes) under ``jax.vjp``; a
``torch.autograd.Function`` hands the vjp the cotangents torch sends back and returns the
input and parameter gradients. Tensors cross by a copy through numpy, keeping their dtype
(bfloat16 by its bits); arguments that are not tensors pass through as they are; the outputs'
tuples, lists and dicts are kept, their arrays made tensors on the caller's device.

The layer runs in the torch mode of the module it replaces (``train()``/``eval()`` set NNX's
``deterministic`` and ``use_running_average``); a call that draws random numbers (a dropout
that is on) raises, as replay refuses it: its output cannot match the reference's. Matmuls run
at full float32 precision, as capture and replay run them.

Imported only once a Flax case is in hand (the Flax framework's swap donor imports it), beside
``flax/replay.py``, whose pure call it reuses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import torch
from flax import nnx
from torch import nn

from layerdiff.capture.hooks import call_arguments
from layerdiff.case import Case
from layerdiff.flax.calls import MATMUL_PRECISION, pure_call, reached_params, unflatten
from layerdiff.flax.calls import floating as _floating
from layerdiff.flax.graph import ModelGraph
from layerdiff.flax.port import watched_forward
from layerdiff.flax.replay import _AdapterCaller
from layerdiff.mapping.code import CodeRef
from layerdiff.trace import schema
from layerdiff.trace.arguments import flatten


class FlaxLayer(nn.Module):
    """``module`` (an NNX module holding the weights it should start from) as a torch module
    called like the NNX module's ``__call__``; ``name`` is its path in the port, for
    messages.

    ``adapter`` (the mapping's call adapter for the site, and its function) makes the
    module's call from the caller's arguments instead: it gets them as JAX arrays, as replay
    gives them (an adapter written for replay works here unchanged), inside the traced call
    so the caller's arguments get their gradients through it; the layer then takes any
    arguments (``forward(*args, **kwargs)``)."""

    def __init__(self, module: nnx.Module, name: str,
                 adapter: tuple[CodeRef, Callable[..., Any]] | None = None, *,
                 aliases: dict[str, list[str]] | None = None) -> None:
        super().__init__()
        self._flax = module
        self._name = name
        self._adapter = adapter
        # full name in the port -> every full name of that variable (a tied one has several)
        self._aliases = aliases or {}
        # torch parameter name -> the variable's path in the module's split state
        self._paths: dict[str, tuple[Any, ...]] = {}
        for path, variable in reached_params(module).items():
            value = variable[...]
            if not _floating(value):
                continue  # an integer "parameter" takes no gradient: it stays in the state
            holder = self
            for key in path[:-1]:
                child = holder._modules.get(str(key))
                if child is None:
                    child = nn.Module()
                    holder.add_module(str(key), child)
                holder = child
            holder.register_parameter(str(path[-1]), nn.Parameter(to_torch(value)))
            self._paths[".".join(str(key) for key in path)] = path
        # called the way the NNX module's __call__ is (the swap binds the caller's arguments
        # to this signature): an instance's forward, signed like that __call__
        signature = inspect.signature(module.__call__ if adapter is None else _any_call)

        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(args, kwargs)

        forward.__signature__ = signature  # type: ignore[attr-defined]
        forward.__qualname__ = f"{type(module).__name__}.__call__"
        object.__setattr__(self, "forward", forward)

    @property
    def flax_module(self) -> nnx.Module:
        return self._flax

    def port_names(self, name: str) -> list[str]:
        """Every full name in the port of the variable behind parameter ``name``: the layer's
        own path first, then the other paths of a variable the port ties (GPT-2's
        ``lm_head.wte.embedding`` is ``transformer.wte.embedding``), by which a swap finds
        the host's parameter to share."""
        own = name if self._name == schema.ROOT_MODULE else f"{self._name}.{name}"
        return [own, *(other for other in self._aliases.get(own, []) if other != own)]

    def extra_repr(self) -> str:
        return f"{type(self._flax).__name__} at {self._name}"

    def train(self, mode: bool = True) -> FlaxLayer:
        super().train(mode)
        # NNX's switches: deterministic (Dropout, attention) and use_running_average
        # (BatchNorm) follow the torch mode, as the replaced torch module's would
        if mode:
            self._flax.train()
        else:
            self._flax.eval()
        return self

    def _call(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        tensors: list[torch.Tensor] = []
        if self._adapter is None:
            shape = _slots((args, kwargs), tensors)
        else:  # by argument path, as the adapter takes them in replay
            shape = [(path, _slots(value, tensors))
                     for path, value in call_arguments(args, kwargs)]
        names = list(self._paths)
        params = [self.get_parameter(name) for name in names]
        box: list[Any] = []
        flat = _FlaxCall.apply(_Runner(self, shape, names, box), len(tensors), *tensors,
                               *params)
        structure, kinds = box[0]
        it = iter(flat)
        return unflatten(structure, [next(it) if kind else value for kind, value in kinds])


def _any_call(*args: Any, **kwargs: Any) -> Any:
    """The signature of a layer whose call adapter makes its call: it takes anything."""


class _Slot:
    """Stands for the ``index``-th tensor of a call in its (args, kwargs) skeleton."""

    def __init__(self, index: int) -> None:
        self.index = index


def _slots(value: Any, tensors: list[torch.Tensor]) -> Any:
    """``value`` with each tensor replaced by a :class:`_Slot` (appended to ``tensors``)."""
    if torch.is_tensor(value):
        tensors.append(value)
        return _Slot(len(tensors) - 1)
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        items = [_slots(item, tensors) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _slots(item, tensors) for key, item in value.items()}
    return value


def _filled(value: Any, arrays: dict[str, Any]) -> Any:
    if isinstance(value, _Slot):
        return arrays[str(value.index)]
    if isinstance(value, (tuple, list)):
        items = [_filled(item, arrays) for item in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {key: _filled(item, arrays) for key, item in value.items()}
    return value


class _Runner:
    """One call of a :class:`FlaxLayer`: its arguments' skeleton and what the autograd node
    needs to run it and hand back the output structure."""

    def __init__(self, layer: FlaxLayer, shape: Any, names: list[str], box: list[Any]) -> None:
        self.layer, self.shape, self.names, self.box = layer, shape, names, box

    def forward(self, tensors: tuple[torch.Tensor, ...], params: tuple[torch.Tensor, ...]
                ) -> tuple[list[Any], Callable[..., Any], list[Any]]:
        """The outputs' arrays, the vjp, and the output leaves (for cotangents' shapes)."""
        arrays = [to_jax(tensor) for tensor in tensors]
        module, adapter = self.layer.flax_module, self.layer._adapter
        if adapter is None:  # keyed by the tensor's number, put back into the skeleton
            self.keys = [str(i) for i in range(len(arrays))]
            values = list(zip(self.keys, arrays, strict=True))

            def caller(fresh: list[tuple[str, Any]]) -> tuple[tuple, dict[str, Any]]:
                return _filled(self.shape, dict(fresh))

        else:  # keyed by argument path, rebuilt by the adapter as replay's caller does
            self.keys = [path for path, value in self.shape if isinstance(value, _Slot)]
            values = [(path, arrays[value.index] if isinstance(value, _Slot) else value)
                      for path, value in self.shape]
            caller = _AdapterCaller(adapter, module, self.layer._name, values)
        wanted = set(self.keys)
        leaves = {arg: value for arg, value in values if arg in wanted and _floating(value)}
        paths = {self.layer._paths[name]: to_jax(param)
                 for name, param in zip(self.names, params, strict=True)}
        pure = pure_call(module, values, set(paths), {}, caller, set())
        with jax.default_matmul_precision(MATMUL_PRECISION):
            outputs, vjp, draws = jax.vjp(pure, paths, leaves, has_aux=True)
        if bool(draws):
            raise ValueError(f"Flax layer {self.layer._name} draws random numbers (a dropout "
                             "that is on): its output cannot match the reference's")
        flat = [value for _, value in flatten(outputs)]
        kinds = [(isinstance(value, jax.Array), value) for value in flat]
        self.box.append((outputs, kinds))
        return [value for value in flat if isinstance(value, jax.Array)], vjp, flat


class _FlaxCall(torch.autograd.Function):
    """A Flax module's call as one autograd node: forward through ``jax.vjp``, backward by
    the vjp (output cotangents in; the inputs' and the parameters' gradients out)."""

    @staticmethod
    def forward(ctx, runner: _Runner, count: int, *tensors: torch.Tensor):
        inputs, params = tensors[:count], tensors[count:]
        arrays, vjp, flat = runner.forward(inputs, params)
        device = next((t.device for t in inputs), None) or (
            params[0].device if params else torch.device("cpu"))
        outputs = tuple(to_torch(array).to(device) for array in arrays)
        ctx.vjp, ctx.flat, ctx.structure = vjp, flat, runner.box[-1][0]
        ctx.names, ctx.paths = runner.names, runner.layer._paths
        ctx.places = [(t.dtype, t.device) for t in tensors]
        ctx.count, ctx.keys = count, runner.keys
        ctx.mark_non_differentiable(*(t for t in outputs if not t.is_floating_point()))
        return outputs

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None):
        it = iter(grads)
        cotangents = []
        for value in ctx.flat:
            if not isinstance(value, jax.Array):
                cotangents.append(value)  # None or plain data: a leaf the vjp carries as is
                continue
            grad = next(it)
            if not _floating(value):  # an integer output takes float0's empty cotangent
                cotangents.append(np.zeros(value.shape, dtype=jax.dtypes.float0))
            elif grad is None:
                cotangents.append(jnp.zeros_like(value))
            else:
                cotangents.append(to_jax(grad).astype(value.dtype).reshape(value.shape))
        structure = unflatten(ctx.structure, cotangents)
        with jax.default_matmul_precision(MATMUL_PRECISION):
            param_grads, input_grads = ctx.vjp(structure)
        found = [input_grads.get(key) for key in ctx.keys]
        found += [param_grads.get(ctx.paths[name]) for name in ctx.names]
        return (None, None, *(None if grad is None or not needed else
                              to_torch(grad).to(device=device, dtype=dtype)
                              for grad, needed, (dtype, device) in zip(
                                  found, ctx.needs_input_grad[2:], ctx.places, strict=True)))


def to_jax(tensor: torch.Tensor) -> jax.Array:
    """A torch tensor as a JAX array of the same dtype, copied (the tensor may change in place
    later: an optimizer's step, a caller's ``x += ...``); bfloat16 by its bits."""
    tensor = tensor.detach().cpu().contiguous()
    if tensor.dtype == torch.bfloat16:
        return jnp.array(tensor.view(torch.int16).numpy().view(ml_dtypes.bfloat16))
    if tensor.dtype == torch.float64 and not jax.config.jax_enable_x64:
        raise ValueError("a float64 tensor cannot go into a Flax layer while JAX computes in "
                         "float32 (jax_enable_x64 is off); enable it, or run the reference "
                         "in float32")
    return jnp.array(tensor.numpy())


def to_torch(array: Any) -> torch.Tensor:
    """A JAX (or numpy) array as a CPU torch tensor of the same dtype, copied."""
    value = np.array(array)
    if value.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(value.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(value)


def flax_layer(model: nnx.Module, module_path: str,
               adapter: tuple[CodeRef, Callable[..., Any]] | None = None) -> FlaxLayer:
    """The submodule of ``model`` at ``module_path`` (``block.fc1``, ``<root>``), as named by
    :class:`~layerdiff.flax.graph.ModelGraph`, or one layer of a stack the model runs with
    nnx.scan (``layers.1``, ``layers.1.fc``: that layer's slice of the stack's variables,
    :class:`~layerdiff.flax.stacks.WithLayers`), wrapped for torch (``adapter``: the mapping's
    call adapter for the site, see :class:`FlaxLayer`)."""
    from layerdiff.flax.stacks import WithLayers

    graph = ModelGraph.of(model)
    modules = WithLayers(dict(graph.modules))
    if module_path not in modules:
        raise KeyError(f"the Flax model has no module {module_path!r}")
    aliases = {name: names for _, names in graph.shared for name in names}
    return FlaxLayer(modules[module_path], module_path, adapter, aliases=aliases)


def module_paths(model: nnx.Module) -> list[str]:
    """The model's module paths in torch's order (the root first, as ``<root>``)."""
    return [path for path, _ in ModelGraph.of(model).modules]


def leaf_paths(model: nnx.Module) -> set[str]:
    """The modules with no module below them (their own code does all their work)."""
    paths = module_paths(model)
    return {p for p in paths if not any(o.startswith(p + ".") for o in paths)}


def observe(case: Case) -> tuple[list[str], dict[str, dict[str, tuple[int, ...]]]]:
    """One forward of the case: its modules in the order of their first call, and each one's
    first call's output shapes by argument path (the model's variables put back)."""
    order: dict[str, None] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}

    def hook(path: str, _kind: str, run: Callable[..., Any], args: tuple,
             kwargs: dict) -> Any:
        order.setdefault(path)
        out = run(*args, **kwargs)
        shapes.setdefault(path, {arg: tuple(value.shape) for arg, value in flatten(out)
                                 if isinstance(value, jax.Array)})
        return out

    watched_forward(case, hook)
    return list(order), shapes


class FlaxDonor:
    """What swap and bisect need of a Flax NNX port (given by its framework,
    :meth:`layerdiff.frameworks.flax.FlaxFramework.swap_donor`): its module paths, first-call
    order and shapes, leaves, the reference's arrays loaded through a mapping, and one layer
    as a torch module that applies the mapping's call adapter itself."""

    hosts_reference_layers = False  # a torch layer cannot run inside its JAX computation

    def module_paths(self, case: Case) -> list[str]:
        return module_paths(case.model)

    def observe(self, case: Case) -> tuple[list[str], dict[str, dict[str, tuple[int, ...]]]]:
        return observe(case)

    def leaf_paths(self, case: Case) -> set[str]:
        return leaf_paths(case.model)

    def load_arrays(self, case: Case, arrays: dict[str, Any], mapping: Any) -> None:
        from layerdiff.flax.weights import load_nnx_arrays

        load_nnx_arrays(case.model, arrays, mapping)

    def why_unswappable(self, case: Case, module_path: str) -> str | None:
        """Why the port has no module ``module_path`` that could go in alone: a name of a layer
        of a stack it runs with nnx.scan that the stack does not have (``layers.7`` of 4)."""
        from layerdiff.flax.stacks import stacked_module

        if self.stacked(case, module_path):
            return None
        stacked = stacked_module(module_path, module_paths(case.model))
        return (f"named as a layer of the port's stack {stacked} (one module holding every "
                "layer, run by nnx.scan), but the stack has no such layer: not every variable "
                "of it has a first axis longer than the layer's number") if stacked else None

    def stacked(self, case: Case, module_path: str) -> str | None:
        """The stacked module (``layers.fc``) whose layer ``module_path`` is (``layers.1.fc``),
        where swap can put that layer in alone (its slice of the stack); None for a module of
        the model's own or no layer of a stack."""
        from layerdiff.flax.stacks import find_layer

        if getattr(self, "_modules", (None,))[0] is not case.model:  # one walk per model
            self._modules = (case.model, dict(ModelGraph.of(case.model).modules))
        layer = find_layer(module_path, self._modules[1])
        if layer is None:
            return None
        return layer.root + (f".{layer.below}" if layer.below else "")

    def layer(self, case: Case, module_path: str, call: Any) -> tuple[nn.Module, Any]:
        """The layer, and the call adapter left for swap to apply in torch (none: it applies
        it itself, to JAX arrays as replay does)."""
        return flax_layer(case.model, module_path, call), None
