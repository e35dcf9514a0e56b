"""Putting one model's layer where another model's layer was: the call adapted both ways.

A swapped-in layer is called by code written for the layer it replaces. :class:`LayerAdapter`
stands between the two:

- the caller's arguments are renamed by the mapping's ``args`` rules and bound to the layer's
  own signature (:func:`layerdiff.replay.calling.bind_call`: by name, then by position; the
  caller's arguments the layer has no parameter for are not taken: left out, and listed);
- or, where the mapping names a call adapter for the site (``call = "pkg.module:function"``),
  the caller's arguments go to the adapter as passed (on the layer's device and dtype) and its
  ``(args, kwargs)`` make the layer's call; its tensor operations are part of the graph, so
  the caller's arguments get their gradients through it;
- floating-point inputs are cast to the layer's parameter dtype and moved to its device, and
  its outputs back (a bfloat16 or CUDA port layer inside a float32 CPU reference);
- the layer's outputs are put into the structure the replaced layer returned (a Hugging Face
  attention returns ``(output, None)``, a nanoGPT one the output alone).

What cannot be adapted, and anything the layer raises, becomes a :class:`LayerCallError` naming
the layer: the swap cannot judge it, and says so in one sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import call_arguments, flatten
from layerdiff.errors import DiffError
from layerdiff.mapping.code import CodeRef
from layerdiff.replay.calling import CannotCall, adapted_call, bind_call, one_line
from layerdiff.signature import Signature
from layerdiff.trace.arguments import dropped_arguments, map_argument


class LayerCallError(DiffError):
    """A swapped-in layer could not be called, or raised: ``module`` is the host's name."""

    def __init__(self, module: str, reason: str) -> None:
        super().__init__(f"{module}: {reason}")
        self.module = module
        self.reason = reason


class _Tensor:
    """Stands for a tensor leaf in an output skeleton."""

    def __repr__(self) -> str:
        return "<tensor>"


TENSOR = _Tensor()


@dataclass(frozen=True)
class _Keyed:
    """A mapping in an output skeleton, with its type: a Hugging Face ``ModelOutput`` (read as
    ``out[0]`` and ``out.last_hidden_state``) is rebuilt as one, not as a plain dict."""

    kind: type
    items: tuple[tuple[Any, Any], ...]


def skeleton(value: Any) -> Any:
    """An output's structure with its tensors replaced by :data:`TENSOR` (kept per module from
    the host's own run, to shape a swapped layer's outputs like the replaced layer's)."""
    if torch.is_tensor(value):
        return TENSOR
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        return type(value)(skeleton(v) for v in value) if not hasattr(value, "_fields") else (
            type(value)(*(skeleton(v) for v in value)))
    if isinstance(value, dict):
        return _Keyed(type(value), tuple((k, skeleton(v)) for k, v in value.items()))
    return value


def _fill(shape: Any, tensors: list[torch.Tensor]) -> Any:
    if shape is TENSOR:
        return tensors.pop(0)
    if isinstance(shape, (tuple, list)):
        items = [_fill(v, tensors) for v in shape]
        return type(shape)(*items) if hasattr(shape, "_fields") else type(shape)(items)
    if isinstance(shape, _Keyed):
        items = {k: _fill(v, tensors) for k, v in shape.items}
        try:
            return shape.kind(**items) if shape.kind is not dict else items
        except Exception:  # a mapping type that is not built from keywords
            return items
    return shape


def _count(shape: Any) -> int:
    """How many tensors a skeleton holds."""
    if shape is TENSOR:
        return 1
    if isinstance(shape, (tuple, list)):
        return sum(_count(v) for v in shape)
    if isinstance(shape, _Keyed):
        return sum(_count(v) for _, v in shape.items)
    return 0


class SwappedAttributeError(AttributeError):
    """An attribute the host's code reads of a swapped-in layer that neither the layer nor the
    module it replaces has: ``module`` is the host's name (the swap cannot judge it)."""

    def __init__(self, module: str, message: str) -> None:
        super().__init__(message)
        self.module = module


_MISSING = object()


class StandIn(nn.Module):
    """A module standing in for ``replaced`` in another model's tree (the base of the swapped-in
    layers): what the host's own code reads of it, beyond the module's own attributes, is
    answered by :meth:`stand_in_value`, from the layer inside or else the replaced module.

    Its own state is kept under names that start with ``_`` (a host's code reading
    ``self.encoder.layer`` or ``self.attn.name`` must not get the adapter's; a
    :class:`LayerAdapter` adds only its child ``wrapped`` and the read-only ``host_name`` and
    ``dropped``); ``training`` is the
    stand-in's own: the replaced module's when it goes in (the layer inside too), then set by
    the host's ``train()``/``eval()`` like any child's. ``isinstance`` checks of the host's
    code see a stand-in, not the replaced module's class: a dynamic subclass of that class
    would run its ``__init__``-less methods and hooks on the stand-in, so none is made."""

    _host_name: str

    def _stand_in(self, name: str, replaced: nn.Module | None) -> None:
        object.__setattr__(self, "_host_name", name)
        # not a child: its parameters are neither trained nor counted; it only answers reads
        object.__setattr__(self, "_replaced", replaced)
        if replaced is not None:  # in the mode of the module it replaces (a host in eval)
            self.train(replaced.training)

    def _inner(self) -> Any:
        """What the stand-in runs (a module, or a numpy layer): asked first."""
        return None

    def __getattr__(self, name: str) -> Any:
        try:  # the stand-in's own parameters, buffers and children
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("__") or "_host_name" not in self.__dict__:
                raise  # copy, pickle and the construction itself look for these
        return self.stand_in_value(name)

    def stand_in_value(self, name: str) -> Any:
        """An attribute the host's code reads (``stride``, ``num_embeddings``, ``weight``,
        ``config``): the inner layer's where it has one of the same kind as the replaced
        module's (a tensor, a module, or a value of the same type: a port's own config class
        does not answer for the reference's; a parameter slot the port leaves None, a bias it
        does not have, is its answer), else the replaced module's. A tensor both hold
        comes from the inner layer, so what the host computes with it reaches the layer's
        trained parameter; cast to the replaced one's dtype and device where they differ, and
        the replaced module's where their shapes differ (another layout)."""
        inner = self._inner()
        replaced = self.__dict__.get("_replaced")
        ours = _MISSING if inner is None else getattr(inner, name, _MISSING)
        theirs = _MISSING if replaced is None else getattr(replaced, name, _MISSING)
        if ours is _MISSING and theirs is _MISSING:
            kind = type(replaced).__name__ if replaced is not None else "module it replaces"
            raise SwappedAttributeError(
                self._host_name, f"the host's code reads '{name}' of the layer swapped in at "
                f"{self._host_name}, and neither that layer ({type(inner).__name__}) nor the "
                f"{kind} it replaces has it")
        if ours is _MISSING:
            return theirs
        if theirs is _MISSING:
            return ours
        if ours is None and isinstance(inner, nn.Module) and (
                name in inner._parameters or name in inner._buffers):
            return None  # a tensor slot the port leaves empty (Linear(bias=False)): its answer
        if torch.is_tensor(ours) and torch.is_tensor(theirs):
            if ours.shape != theirs.shape:
                return theirs
            if ours.is_floating_point() and theirs.is_floating_point() and (
                    ours.dtype != theirs.dtype or ours.device != theirs.device):
                return ours.to(device=theirs.device, dtype=theirs.dtype)
            return ours
        if isinstance(ours, nn.Module) and isinstance(theirs, nn.Module):
            return ours
        return ours if type(ours) is type(theirs) else theirs


class LayerAdapter(StandIn):
    """``layer`` called the way the replaced layer was (see the module's docstring), standing
    in for ``replaced`` (see :class:`StandIn`): the layer is this module's child ``wrapped``.

    ``args_map`` renames the caller's arguments (reference argument -> port argument; with
    ``inverse``, a port caller's arguments for a reference layer: one port argument may feed
    several reference ones, attn(x) -> attn(x, x, x)). ``caller`` is the replaced layer's
    signature, ``expected`` its output skeleton (None: return what the layer returns), ``sizes``
    the shapes its first output tensor had (None: not known).
    ``call`` (the mapping's call adapter and its function) makes the layer's call instead of
    ``args_map``."""

    def __init__(self, name: str, layer: nn.Module, args_map: dict[str, str], *,
                 caller: Signature | None = None, expected: Any = None,
                 sizes: set[tuple[int, ...]] | None = None, inverse: bool = False,
                 call: tuple[CodeRef, Any] | None = None,
                 replaced: nn.Module | None = None,
                 output: tuple[Any, Any] | None = None) -> None:
        super().__init__()
        self.wrapped = layer
        self._args_map = {k: v for k, v in args_map.items() if v != ""}
        self._drop = frozenset() if inverse else dropped_arguments(args_map)
        self._inverse = inverse
        self._signature = Signature.of(layer.forward)
        self._caller = caller
        self._expected = expected
        self._sizes = sizes
        self._call = call
        # (the site's output conversion, the function that brings the layer's outputs into the
        # caller's layout): compare/outconv.py, the one the diff compares them through
        self._output = output
        self._dropped: list[tuple[str, str]] = []  # what the last call left out, and why
        self._caller_values: dict[str, Any] | None = None
        self._stand_in(name, replaced)

    @property
    def host_name(self) -> str:
        """The replaced module's name in the host."""
        return self._host_name

    @property
    def dropped(self) -> list[tuple[str, str]]:
        """What the last call left out, and why."""
        return self._dropped

    def _inner(self) -> Any:
        return self._modules.get("wrapped")

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        # the caller's arguments by path, for an output conversion that also takes some of
        # them (the routing weights a reference passes its experts)
        self._caller_values = (dict(call_arguments(args, kwargs)) if self._output is not None
                               and getattr(self._output[0], "reference_inputs", ()) else None)
        if self._call is not None:
            return self._adapted(args, kwargs)
        values = (_inverse_arguments(args, kwargs, self._args_map) if self._inverse
                  else _mapped_arguments(args, kwargs, self._args_map))
        try:
            bound = bind_call(values, self._signature, reference=self._caller, drop=self._drop,
                              where=f"layer {self._host_name} ({self._describe()})")
        except CannotCall as exc:
            raise LayerCallError(self._host_name, str(exc)) from exc
        self._dropped = bound.dropped
        call_args, call_kwargs = bound.call()
        caller = _placement([v for _, v in values])
        layer = _placement([*self.wrapped.parameters(), *self.wrapped.buffers()])
        moved = caller is not None and layer is not None and (
            caller[1] != layer[1] or (None not in (caller[0], layer[0]) and caller[0] != layer[0]))
        if moved:  # a bfloat16 or CUDA port layer inside a float32 CPU reference
            call_args, call_kwargs = _moved((call_args, call_kwargs), caller, layer)
        outputs = self._run(call_args, call_kwargs)
        if moved:
            outputs = _moved(outputs, layer, caller)
        return self._shaped(outputs)

    def _adapted(self, args: tuple, kwargs: dict[str, Any]) -> Any:
        """The call through the mapping's adapter: the caller's arguments, moved to the
        layer's device and dtype, become the adapter's ``(args, kwargs)`` for the layer."""
        caller = _placement([v for _, v in call_arguments(args, kwargs)])
        layer = _placement([*self.wrapped.parameters(), *self.wrapped.buffers()])
        moved = caller is not None and layer is not None and (
            caller[1] != layer[1] or (None not in (caller[0], layer[0]) and caller[0] != layer[0]))
        if moved:
            args, kwargs = _moved((args, kwargs), caller, layer)
        ref, function = self._call
        try:
            call_args, call_kwargs = adapted_call(ref, function, args, kwargs,
                                                  self.wrapped.forward,
                                                  where=f"layer {self._host_name}")
        except CannotCall as exc:
            raise LayerCallError(self._host_name, str(exc)) from exc
        self._dropped = []
        outputs = self._run(call_args, call_kwargs)
        if moved:
            outputs = _moved(outputs, layer, caller)
        return self._shaped(outputs)

    def _run(self, call_args: tuple, call_kwargs: dict[str, Any]) -> Any:
        try:
            return self.wrapped(*call_args, **call_kwargs)
        except (LayerCallError, SwappedAttributeError):
            raise
        except Exception as exc:  # the layer's own code failed: it cannot be judged here
            raise LayerCallError(self._host_name, f"{self._describe()} raised "
                                 f"{type(exc).__name__}: {one_line(exc)}") from exc

    def _describe(self) -> str:
        return self._signature.describe() if self._signature else type(self.wrapped).__name__

    def _shaped(self, outputs: Any) -> Any:
        """The layer's tensors in the replaced layer's output structure. A layer that returns
        fewer tensors fills the leading ones, and None stands for the rest (a Hugging Face
        attention also returns its weights, which its block does not use unless asked): said
        in ``dropped``, and a caller that does use them fails the run, which the swap then
        cannot judge, saying which output was None."""
        outputs = self._converted(outputs)
        expected = self._expected
        tensors = [v for _, v in flatten(outputs, "") if torch.is_tensor(v)]
        self._check_size(tensors[0] if tensors else None)
        if expected is None or skeleton(outputs) == expected:
            return outputs
        wanted = _count(expected)
        if len(tensors) > wanted or not tensors:
            raise LayerCallError(self._host_name, f"{self._describe()} returns {len(tensors)} "
                                 f"tensor(s) where the layer it replaces returns {wanted} "
                                 f"({expected!r}), so its outputs cannot stand in for "
                                 "that layer's; swap the layer around it instead")
        if len(tensors) < wanted:
            self._dropped = [*self._dropped, (f"output {len(tensors)}.." if wanted - len(tensors)
                                              > 1 else f"output {len(tensors)}",
                                              NOT_RETURNED)]
        return _fill(expected, tensors + [None] * (wanted - len(tensors)))


    def _converted(self, outputs: Any) -> Any:
        """The layer's outputs through the site's output conversion (a q/k projection's rows
        put back in the caller's order, experts' outputs into their weighted sum): in the
        graph, so the gradient the caller sends flows back through it. One that cannot be
        applied (an output it takes is not returned) is a LayerCallError: cannot judge."""
        if self._output is None:
            return outputs
        from layerdiff.compare.outconv import CannotConvert, convert_outputs

        conversion, function = self._output
        try:
            made = convert_outputs(conversion, function, list(flatten(outputs, "")),
                                   f"the layer swapped in at {self._host_name}",
                                   self._caller_values)
        except CannotConvert as exc:
            raise LayerCallError(self._host_name, str(exc)) from exc
        values = [value for _, value in made]
        return values[0] if len(values) == 1 else tuple(values)

    def _check_size(self, first: torch.Tensor | None) -> None:
        """A first output with another number of elements than the replaced layer's is another
        quantity (a decoder that ends in its tied head returns logits where the replaced one
        returned hidden states): the caller's code would raise on it, or broadcast it into a
        wrong answer taken for a break, so the layer cannot stand in there."""
        if first is None or not self._sizes:
            return
        if any(math.prod(shape) == first.numel() for shape in self._sizes):
            return
        theirs = " or ".join(str(shape) for shape in sorted(self._sizes))
        raise LayerCallError(self._host_name, f"{self._describe()} returns a first output of "
                             f"shape {tuple(first.shape)} where the layer it replaces returns "
                             f"{theirs}: another quantity, so it cannot stand in for that "
                             "layer; swap the layer around it instead")


NOT_RETURNED = "the port layer does not return it: None"


def _placement(values: list[Any]) -> tuple[torch.dtype | None, torch.device] | None:
    """The dtype of the first floating-point tensor among ``values`` (None when there is
    none: an embedding's token ids) and the device of the first tensor."""
    tensors = [v for v in values if torch.is_tensor(v)]
    if not tensors:
        return None
    dtype = next((t.dtype for t in tensors if t.is_floating_point()), None)
    return dtype, tensors[0].device


def _moved(value: Any, source: tuple[torch.dtype | None, torch.device],
           target: tuple[torch.dtype | None, torch.device]) -> Any:
    """Tensors on ``source``'s device moved to ``target``'s, floating ones of ``source``'s
    dtype cast to ``target``'s (differentiably: gradients flow back the same way)."""
    if torch.is_tensor(value):
        if value.device != source[1]:
            return value
        cast = None not in (source[0], target[0]) and value.dtype == source[0]
        return value.to(device=target[1], dtype=target[0] if cast else value.dtype)
    if isinstance(value, (tuple, list)) and not isinstance(value, torch.Size):
        items = [_moved(v, source, target) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
    if isinstance(value, dict):
        return {k: _moved(v, source, target) for k, v in value.items()}
    return value


def _mapped_arguments(args: tuple, kwargs: dict, args_map: dict[str, str]
                      ) -> list[tuple[str, Any]]:
    values, seen = [], set()
    for path, value in call_arguments(args, kwargs):
        mapped = map_argument(path, args_map)
        if mapped not in seen:  # attn(x, x, x) -> attn(x)
            seen.add(mapped)
            values.append((mapped, value))
    return values


def _inverse_arguments(args: tuple, kwargs: dict, args_map: dict[str, str]
                       ) -> list[tuple[str, Any]]:
    values = []
    for path, value in call_arguments(args, kwargs):
        head, dot, rest = path.partition(".")
        targets = [ref for ref, port in args_map.items() if port == head]
        if head not in args_map:
            targets.append(head)
        values += [(target + dot + rest, value) for target in targets]
    return sorted(values, key=lambda item: (not item[0].split(".")[0].isdigit(), item[0]))


class _CallableFunction(torch.autograd.Function):
    """A per-site numpy layer's forward and backward as an autograd node."""

    @staticmethod
    def forward(ctx, layer, plain, names, arg_paths, *tensors):
        inputs = dict(plain)
        inputs.update((p, t.detach().cpu().numpy()) for p, t in zip(
            arg_paths, tensors, strict=False))
        weights = {n: t.detach().cpu().numpy() for n, t in zip(
            names, tensors[len(arg_paths):], strict=True)}
        outputs, context = layer.forward(inputs, weights)
        like = tensors[0]
        ctx.layer, ctx.context, ctx.arg_paths, ctx.names = layer, context, arg_paths, names
        ctx.out_args = list(outputs)
        ctx.inputs = [(t.dtype, t.device) for t in tensors]
        return tuple(torch.from_numpy(np.ascontiguousarray(outputs[a])).to(like.device, like.dtype)
                     for a in ctx.out_args)

    @staticmethod
    def backward(ctx, *grads):
        given = {a: g.detach().cpu().numpy() for a, g in zip(ctx.out_args, grads, strict=True)
                 if g is not None}
        grad_inputs, weight_grads = ctx.layer.backward(ctx.context, given)
        found = [grad_inputs.get(p) for p in ctx.arg_paths] + [weight_grads.get(n)
                                                                for n in ctx.names]
        return (None, None, None, None, *(
            None if value is None else torch.from_numpy(np.ascontiguousarray(value)).to(
                device, dtype) for value, (dtype, device) in zip(found, ctx.inputs,
                                                                  strict=True)))


class CallableLayer(StandIn):
    """A per-site numpy layer as a torch module: its weights are this module's parameters
    (under the reference's names), and what else the host reads of it is answered as
    :class:`StandIn` says."""

    def __init__(self, name: str, layer: Any, weights: dict[str, np.ndarray],
                 args_map: dict[str, str], *, replaced: nn.Module | None = None) -> None:
        super().__init__()
        self._layer, self._args_map = layer, args_map
        for key, value in weights.items():
            self.register_parameter(key, nn.Parameter(torch.from_numpy(value.copy())))
        self._stand_in(name, replaced)

    def _inner(self) -> Any:
        return self._layer

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = _mapped_arguments(args, kwargs, self._args_map)
        tensors = [(p, v) for p, v in values if torch.is_tensor(v)]
        plain = tuple((p, v) for p, v in values if not torch.is_tensor(v))
        names = [n for n, _ in self.named_parameters(recurse=False)]
        try:
            outputs = _CallableFunction.apply(
                self._layer, plain, names, [p for p, _ in tensors], *(v for _, v in tensors),
                *(p for _, p in self.named_parameters(recurse=False)))
        except Exception as exc:
            raise LayerCallError(self._host_name, f"the port's callable raised "
                                 f"{type(exc).__name__}: {one_line(exc)}") from exc
        return outputs[0] if len(outputs) == 1 else outputs
