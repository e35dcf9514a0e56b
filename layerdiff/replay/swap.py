"""``swap``: run the reference with some of its layers replaced by the port's, forward and
backward intact, and measure what changes against the pure reference.

A port layer goes in holding the reference's weights (through the mapping), behind an adapter
that hands it the reference's call arguments under the port's argument names. A layer that is
not torch (per-site numpy callables) goes in through a ``torch.autograd.Function`` around its
forward and backward, with its weights as parameters so the optimizer trains them. The reverse
direction (``into="port"``) puts reference layers into the port, to confirm a fix.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import _arguments, flatten
from layerdiff.capture.run import run_case
from layerdiff.case import ExternalCase
from layerdiff.compare.mapping import Mapping, ParamSource
from layerdiff.compare.matching import port_site_for
from layerdiff.compare.tolerances import Tolerances
from layerdiff.errors import DiffError
from layerdiff.replay.arguments import map_argument, rebuild_call
from layerdiff.trace import schema
from layerdiff.weights import load_weights_from, paired_parts, state_arrays


@dataclass
class SwapResult:
    """What the swapped run did differently from the pure reference."""

    swapped: list[tuple[str, str]]          # (reference module, port module)
    steps: int
    losses: list[tuple[float, float]]       # (reference, swapped) per step
    rows: list[dict[str, Any]] = field(default_factory=list)  # what, ratio, max_abs
    into: str = "reference"                 # which model the swapped layers went into

    @property
    def ratio(self) -> float:
        """The worst error over tolerance of the loss, outputs and weight gradients; > 1
        breaks the reference. Weights after the steps are reported, not judged: an adaptive
        optimizer (Adam) turns rounding noise in a parameter whose gradient is ~0 (a key
        projection's bias) into a step of ±lr, 19x tolerance on a correct transformer port."""
        return max((r["ratio"] for r in self.rows if r["judged"]), default=0.0)

    @property
    def breaks(self) -> bool:
        return not self.ratio <= 1.0  # NaN breaks

    def describe(self) -> str:
        if self.into == "port":
            names = "the reference's " + (", ".join(ref for ref, _ in self.swapped) or
                                          "nothing") + " in the port"
        else:
            names = ", ".join(port for _, port in self.swapped) or "nothing"
        judged = [r for r in self.rows if r["judged"]]
        worst = max(judged, key=lambda r: r["ratio"] if np.isfinite(r["ratio"]) else np.inf,
                    default=None)
        if not self.breaks:
            return f"with {names} swapped in: within tolerance ({self.ratio:.3g})"
        verb = "differs" if self.into == "port" else "breaks"
        return (f"with {names} swapped in: {verb}; worst {worst['what']} "
                f"{worst['ratio']:.3g}x tolerance")

    def as_json(self) -> dict[str, Any]:
        return {"swapped": self.swapped, "steps": self.steps, "losses": self.losses,
                "breaks": self.breaks, "ratio": _finite(self.ratio), "rows": [
                    {**r, "ratio": _finite(r["ratio"])} for r in self.rows]}


def _finite(value: float) -> float | str | None:
    return value if np.isfinite(value) else (None if np.isnan(value) else "inf")


class Swapper:
    """Builds swapped reference models for one reference case and one port case."""

    def __init__(self, reference: Any, port: Any, mapping: str | os.PathLike | Mapping | None
                 = None, *, tolerances: Tolerances | None = None) -> None:
        # every run trains its models, so each gets a fresh case (a copy of a given Case)
        self.make_reference = reference if callable(reference) else (
            lambda: copy.deepcopy(reference))
        self.make_port = port if callable(port) else (lambda: copy.deepcopy(port))
        self.mapping = mapping if isinstance(mapping, Mapping) else (
            Mapping.load(mapping) if mapping is not None else Mapping())
        self.tolerances = tolerances or Tolerances()
        probe_ref, probe_port = self.make_reference(), self.make_port()
        self.reference_modules = _modules(probe_ref)
        self.port_modules = _port_modules(probe_port)
        self.pairs = self._pairs()  # reference module -> (port module, argument map)
        self._baselines: dict[int, tuple[Any, Any]] = {}
        self._reference_state = state_arrays(probe_ref.model)  # the weights swapped layers get

    def _pairs(self) -> dict[str, tuple[str, dict[str, str]]]:
        """Reference module -> (port module, argument map), by the diff's own name matching
        (explicit pairs, same names, rename rules) applied to each module's first call."""
        pairs: dict[str, tuple[str, dict[str, str]]] = {}
        for ref_site in [*self.mapping.pairs, *(schema.site_name(m, 0)
                                                for m in self.reference_modules)]:
            module = schema.split_site(ref_site)[0]
            found = port_site_for(ref_site, self.mapping, set(self.port_modules))
            if found is not None and module not in pairs and module != schema.ROOT_MODULE:
                pairs[module] = (schema.split_site(found[0])[0], found[1])
        return pairs

    def resolve(self, name: str) -> str:
        """A reference module for a name given in either model's terms (module or site)."""
        module = name.rpartition("#")[0] if "#" in name else name
        if module in self.pairs:
            return module
        for ref_module, (port_module, _) in self.pairs.items():
            if port_module == module:
                return ref_module
        known = ", ".join(list(self.pairs)[:6])
        raise DiffError(f"site {name!r} has no layer in both models (neither a reference "
                        f"module with a port partner nor a port module with a reference one); "
                        f"such layers look like: {known}")

    def run(self, modules: Sequence[str], *, steps: int | None = None,
            into: str = "reference") -> SwapResult:
        """The host case with ``modules`` (reference names) swapped, against the reference."""
        modules = _outermost([self.resolve(m) for m in modules])
        if steps is not None and steps < 1:
            raise DiffError(f"--steps must be at least 1 (got {steps})")
        steps = steps or self.make_reference().steps
        baseline, ref_run = self._baseline(steps)
        if into == "reference":
            host = self.make_reference()
            donor = self.make_port()  # one port for all the swapped layers of this run
            if not isinstance(donor, ExternalCase):
                load_weights_from(donor.model, self._reference_state, self.mapping)
        else:
            donor = self.make_reference()
            host = self.make_port()
            if isinstance(host, ExternalCase):
                raise DiffError(f"case {host.name} is not a torch model, so reference layers "
                                "cannot go into it (--into port); swap its layers into the "
                                "reference instead")
            load_weights_from(host.model, self._reference_state, self.mapping)
        swapped, layers = [], []
        for module in modules:
            port_module, args_map = self.pairs[module]
            if into == "reference":
                layer = self._port_layer(donor, port_module, args_map, module)
                _replace(host.model, module, layer)
                layers.append((module, port_module, layer))
            else:
                layer = _ArgumentAdapter(_get(donor.model, module), args_map, inverse=True)
                _replace(host.model, port_module, layer)
            swapped.append((module, port_module))
        host_run = run_case(host, steps=steps)
        result = SwapResult(swapped, steps, [(float(a), float(b)) for a, b in zip(
            ref_run.losses, host_run.losses, strict=True)], into=into)
        for step, (a, b) in enumerate(zip(ref_run.losses, host_run.losses, strict=True)):
            result.rows.append(_compare(f"loss, step {step}", a, b, self.tolerances))
        for (arg, a), (_, b) in zip(flatten(ref_run.output, ""), flatten(host_run.output, ""),
                                    strict=False):
            if torch.is_tensor(a) and torch.is_tensor(b):
                result.rows.append(_compare(f"output {arg}, step {steps - 1}", a, b,
                                                 self.tolerances))
        if into == "reference":
            result.rows += _parameter_rows(baseline.model, host.model, steps, self.tolerances)
            result.rows += self._swapped_grad_rows(baseline.model, layers, steps)
        return result

    def _swapped_grad_rows(self, reference: nn.Module, layers: list, steps: int
                           ) -> list[dict[str, Any]]:
        """The swapped port layers' weight gradients against the reference's, through the
        mapping (a fused QKV gradient is compared part by part)."""
        ref_params = dict(reference.named_parameters())
        partner = {port: ref for ref, (port, _) in self.pairs.items()}
        rows = []
        for ref_module, port_module, adapter in layers:
            if not isinstance(adapter, _ArgumentAdapter):
                continue  # a numpy layer's parameters carry the reference's names already
            for name, param in adapter.layer.named_parameters():
                found = self.mapping.param_source(f"{port_module}.{name}", partner) or \
                    ParamSource([f"{ref_module}.{name}"])
                refs = [ref_params.get(n) for n in found.reference]
                if param.grad is None or any(r is None or r.grad is None for r in refs):
                    continue
                for ref_name, ref_grad, port_grad in _grad_pairs(found, [r.grad for r in refs],
                                                                 param.grad):
                    rows.append(_compare(f"weight_grad {ref_name} (port {port_module}.{name}), "
                                         f"step {steps - 1}", ref_grad, port_grad,
                                         self.tolerances))
        return rows

    def _baseline(self, steps: int):
        """The pure reference, run once per number of steps (every probe compares with it)."""
        if steps not in self._baselines:
            case = self.make_reference()
            self._baselines[steps] = (case, run_case(case, steps=steps))
        return self._baselines[steps]

    def leaves(self) -> list[str]:
        """Reference modules whose port partner is a leaf of the port, in execution order."""
        port = self.make_port()
        if isinstance(port, ExternalCase):
            names = set(port.layers)
            port_leaves = {n for n in names if not any(o.startswith(n + ".") for o in names)}
        else:
            port_leaves = {name for name, module in port.model.named_modules()
                           if name and not any(True for _ in module.children())}
        order = self.execution_order()
        return [m for m in order if m in self.pairs and self.pairs[m][0] in port_leaves]

    def execution_order(self) -> list[str]:
        """Reference modules in the order of their first call (one forward pass)."""
        case = self.make_reference()
        seen: dict[str, None] = {}
        handles = [module.register_forward_pre_hook(
            lambda _m, _a, name=name: seen.setdefault(name or schema.ROOT_MODULE))
            for name, module in case.model.named_modules()]
        try:
            with torch.no_grad():
                case.call_model()
        finally:
            for handle in handles:
                handle.remove()
        return list(seen)

    def _port_layer(self, donor: Any, port_module: str, args_map: dict[str, str],
                    ref_module: str) -> nn.Module:
        if isinstance(donor, ExternalCase):
            prefix = "" if ref_module == schema.ROOT_MODULE else ref_module + "."
            nested = [n for n in self._reference_state
                      if n.startswith(prefix) and "." in n[len(prefix):]]
            if nested:
                raise DiffError(f"port layer {port_module} is not torch and reference module "
                                f"{ref_module} has parameters inside its children "
                                f"({', '.join(nested[:3])}), which the layer would leave "
                                "untrained; swap its children instead")
            weights = {name[len(prefix):]: value for name, value in self._reference_state.items()
                       if name.startswith(prefix) and "." not in name[len(prefix):]}
            return _CallableLayer(donor.layers[port_module], weights, args_map)
        return _ArgumentAdapter(_get(donor.model, port_module), args_map)

    def _reference_of(self, port_module: str) -> str:
        return next(ref for ref, (port, _) in self.pairs.items() if port == port_module)


def swap(reference: Any, port: Any, sites: Sequence[str], *,
         mapping: str | os.PathLike | Mapping | None = None, steps: int | None = None,
         into: str = "reference", tolerances: Tolerances | None = None) -> SwapResult:
    """Run ``reference`` (a Case, or a function making one) with the port's layers at
    ``sites`` in place (``into="port"``: the reference's layers in the port instead) and
    compare loss, outputs, weight gradients and weights after the steps with the pure reference.
    Cases are built afresh for each run when given as functions (recommended: a run trains).
    ``tolerances`` (see :meth:`Tolerances.build`) judges the comparisons."""
    return Swapper(reference, port, mapping, tolerances=tolerances).run(sites, steps=steps,
                                                                         into=into)


class _ArgumentAdapter(nn.Module):
    """Calls ``layer`` with the caller's arguments renamed by ``args_map`` (reference argument
    -> port argument), or, ``inverse``, a reference layer with a port caller's arguments (one
    port argument may feed several reference ones: attn(x) -> attn(x, x, x))."""

    def __init__(self, layer: nn.Module, args_map: dict[str, str], *,
                 inverse: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.args_map = args_map
        self.inverse = inverse

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not self.args_map:
            return self.layer(*args, **kwargs)
        values = _inverse_arguments(args, kwargs, self.args_map) if self.inverse else (
            _mapped_arguments(args, kwargs, self.args_map))
        call_args, call_kwargs = rebuild_call(values)
        return self.layer(*call_args, **call_kwargs)


def _mapped_arguments(args: tuple, kwargs: dict, args_map: dict[str, str]
                      ) -> list[tuple[str, Any]]:
    values, seen = [], set()
    for path, value in _arguments(args, kwargs):
        mapped = map_argument(path, args_map)
        if mapped not in seen:  # attn(x, x, x) -> attn(x)
            seen.add(mapped)
            values.append((mapped, value))
    return values


def _inverse_arguments(args: tuple, kwargs: dict, args_map: dict[str, str]
                       ) -> list[tuple[str, Any]]:
    values = []
    for path, value in _arguments(args, kwargs):
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


class _CallableLayer(nn.Module):
    """A per-site numpy layer as a torch module: its weights are this module's parameters."""

    def __init__(self, layer: Any, weights: dict[str, np.ndarray],
                 args_map: dict[str, str]) -> None:
        super().__init__()
        self.layer, self.args_map = layer, args_map
        for name, value in weights.items():
            self.register_parameter(name, nn.Parameter(torch.from_numpy(value.copy())))

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        values = _mapped_arguments(args, kwargs, self.args_map)
        tensors = [(p, v) for p, v in values if torch.is_tensor(v)]
        plain = tuple((p, v) for p, v in values if not torch.is_tensor(v))
        names = [n for n, _ in self.named_parameters(recurse=False)]
        outputs = _CallableFunction.apply(self.layer, plain, names, [p for p, _ in tensors],
                                          *(v for _, v in tensors),
                                          *(p for _, p in self.named_parameters(recurse=False)))
        return outputs[0] if len(outputs) == 1 else outputs


def _grad_pairs(found: ParamSource, ref_grads: list[torch.Tensor], port_grad: torch.Tensor
                ) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(reference name, reference gradient, port gradient) with the transform chain undone."""
    return paired_parts(found, ref_grads, port_grad)


def _parameter_rows(reference: nn.Module, host: nn.Module, steps: int,
                    tolerances: Tolerances) -> list[dict[str, Any]]:
    """Weights after the steps (reported) and the last step's weight gradients (judged), for
    the parameters both models have under the same name."""
    ours = dict(reference.named_parameters())
    rows = []
    for name, param in host.named_parameters():
        if name in ours:  # the swapped layers' own parameters have other names
            rows.append(_compare(f"weight {name} after {steps} step(s)", ours[name], param,
                                 tolerances, judged=False))
            if ours[name].grad is not None and param.grad is not None:
                rows.append(_compare(f"weight_grad {name}, step {steps - 1}", ours[name].grad,
                                     param.grad, tolerances))
    return rows


def _compare(what: str, expected: torch.Tensor, got: torch.Tensor, tolerances: Tolerances, *,
             judged: bool = True) -> dict[str, Any]:
    a = expected.detach().double().cpu()
    b = got.detach().double().cpu()
    if a.shape != b.shape:
        return {"what": what, "ratio": np.inf, "max_abs": np.inf, "judged": judged}
    tolerance = tolerances.lookup(what, "*", "", str(expected.dtype).removeprefix("torch."))
    diff = (a - b).abs()
    ratio = diff / (tolerance.atol + tolerance.rtol * a.abs())
    ratio[diff == 0] = 0
    worst = float(ratio.max()) if ratio.numel() else 0.0
    return {"what": what, "ratio": worst if not torch.isnan(ratio).any() else np.nan,
            "max_abs": float(diff.max()) if diff.numel() else 0.0, "judged": judged}


def _modules(case: Any) -> list[str]:
    return [name or schema.ROOT_MODULE for name, _ in case.model.named_modules()]


def _port_modules(port: Any) -> list[str]:
    if isinstance(port, ExternalCase):
        if not port.layers:
            raise DiffError(f"case {port.name} gives no per-site layers to swap in; give the "
                            "ExternalCase a 'layers' dict of forward/backward callables")
        return list(port.layers)
    return _modules(port)


def _outermost(modules: Sequence[str]) -> list[str]:
    """Of nested modules only the outer one is swapped (it holds the inner)."""
    chosen = sorted(set(modules), key=len)
    return [m for i, m in enumerate(chosen)
            if not any(m.startswith(outer + ".") for outer in chosen[:i])]


def _get(model: nn.Module, path: str) -> nn.Module:
    return model if path == schema.ROOT_MODULE else model.get_submodule(path)


def _replace(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(_get(model, parent) if parent else model, name, layer)



