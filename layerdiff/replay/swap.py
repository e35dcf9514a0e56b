"""``swap``: run the reference with some of its layers replaced by the port's, forward and
backward intact, and measure what changes against the pure reference.

A port layer goes in holding the reference's weights (through the mapping), behind an adapter
(:mod:`layerdiff.replay.adapters`) that calls it the way the replaced layer was called: its
own signature (or the mapping's call adapter for the site), its own dtype, the replaced
layer's output structure. A layer that is not torch
(per-site numpy callables) goes in through a ``torch.autograd.Function`` around its forward and
backward, with its weights as parameters so the optimizer trains them; a Flax NNX port's layer
goes in the same way, its ``jax.vjp`` making the backward
(:mod:`layerdiff.flax.in_torch`, given by the port's framework as its swap donor and
used in one place: :func:`port_layer_for`). The
reverse direction (``into="port"``) puts reference layers into a torch port, to confirm a fix.

Every comparison is keyed like a trace record (step, site, role, argument) and judged by
:mod:`layerdiff.compare.judge` with the tolerance a diff of those records would use: the
per-dtype default, ``--rtol``/``--atol``, a tolerance file's rules, or a baseline.
"""

from __future__ import annotations

import contextlib
import copy
import os
import tempfile
import traceback
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import flatten
from layerdiff.capture.modules import (
    get_module,
    hook_every_call,
    is_leaf,
    module_paths,
    named_modules,
)
from layerdiff.capture.routes import RouteForcer, RouteRecorder, StepsOf, describe
from layerdiff.capture.run import run_case
from layerdiff.compare import judge
from layerdiff.compare.baseline import FACTOR, Baseline
from layerdiff.compare.matching import port_site_for
from layerdiff.compare.outconv import DerivedPermutation, SiteConversions
from layerdiff.compare.tolerances import Tolerances, looser_dtype
from layerdiff.errors import DiffError
from layerdiff.framework import framework_of
from layerdiff.mapping import Mapping, ParamSource
from layerdiff.mapping.code import CodeRef
from layerdiff.replay.adapters import (
    NOT_RETURNED,
    CallableLayer,
    LayerAdapter,
    LayerCallError,
    SwappedAttributeError,
    skeleton,
)
from layerdiff.replay.calling import one_line
from layerdiff.signature import Signature
from layerdiff.trace import schema
from layerdiff.trace.schema import Role
from layerdiff.weights import load_weights_from, paired_parts, state_arrays


class SwapDirection(StrEnum):
    """Which model the swapped layers go into (``swap(..., into=...)``)."""

    REFERENCE = "reference"   # the port's layers into the reference: does the port break it?
    PORT = "port"             # the reference's layers into the port: does that fix it?

    @classmethod
    def parse(cls, into: str) -> SwapDirection:
        """``into`` as given (the command line passes a string), or a DiffError."""
        try:
            return cls(into)
        except ValueError:
            raise DiffError(f"into={into!r} is not a swap direction; give "
                            f"{' or '.join(repr(str(d)) for d in cls)}") from None


class SwapOutcome(StrEnum):
    WITHIN = "within"              # loss, outputs and weight gradients within tolerance
    BREAKS = "breaks"              # out of tolerance, or NaN/Inf where the reference is finite
    CANNOT_JUDGE = "cannot-judge"  # a layer could not be called, or the run raised: nothing
                                   # ran to the end to judge


@dataclass(frozen=True)
class SwapRow:
    """One compared quantity of a swapped run, keyed like the trace record it corresponds to
    (so tolerance rules and baselines apply by site, role and argument)."""

    what: str               # "loss, step 0", "weight_grad fc1.weight, step 0", ...
    step: int
    site: str               # the reference's site: "<loss>#0", "<root>#0", "fc1#0"
    role: Role
    arg: str
    ratio: float            # worst error over tolerance (inf: not finite where the ref is)
    max_abs: float
    judged: bool            # weights after the steps are reported, not judged
    tolerance: str          # where the tolerance came from

    def as_json(self) -> dict[str, Any]:
        return {**asdict(self), "ratio": _finite(self.ratio), "max_abs": _finite(self.max_abs)}


@dataclass
class SwapResult:
    """What the swapped run did differently from the pure reference."""

    swapped: list[tuple[str, str]]          # (reference module, port module)
    steps: int
    losses: list[tuple[float, float]]       # (reference, swapped) per step
    rows: list[SwapRow] = field(default_factory=list)
    into: SwapDirection = SwapDirection.REFERENCE  # which model the swapped layers went into
    # (layer, why): the swapped layer that could not be called, lacks an attribute the host's
    # code reads, or (the only one swapped in) was in when the run raised
    not_swapped: list[tuple[str, str]] = field(default_factory=list)
    raised: str = ""  # the run raised with several layers in, none of them named by the error
    # the swapped layers that returned fewer outputs than the layers they replace when the run
    # raised (None stood for the rest: the likely cause)
    suspects: list[str] = field(default_factory=list)
    # layer -> [(argument, why)]: the caller's arguments the layer did not take
    dropped: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    routing: str = ""  # --force-routing: what forcing the reference's routes changed

    @property
    def not_taken(self) -> dict[str, list[tuple[str, str]]]:
        return self.dropped

    @property
    def outcome(self) -> SwapOutcome:
        if self.not_swapped or self.raised:
            return SwapOutcome.CANNOT_JUDGE
        if not judge.within(self.ratio):
            return SwapOutcome.BREAKS
        return SwapOutcome.WITHIN

    @property
    def ratio(self) -> float:
        """The worst error over tolerance of the loss, outputs and weight gradients; > 1
        breaks the reference. Weights after the steps are reported, not judged: an adaptive
        optimizer (Adam) turns rounding noise in a parameter whose gradient is ~0 (a key
        projection's bias) into a step of ±lr, 19x tolerance on a correct transformer port.
        A value that is not finite where the reference's is breaks it wherever it is."""
        return judge.worst(r.ratio for r in self.rows if r.judged)

    @property
    def breaks(self) -> bool:
        return self.outcome == SwapOutcome.BREAKS

    def __bool__(self) -> bool:
        return self.outcome == SwapOutcome.WITHIN

    def describe(self) -> str:
        if self.into == SwapDirection.PORT:
            names = "the reference's " + (", ".join(ref for ref, _ in self.swapped) or
                                          "nothing") + " in the port"
        else:
            names = ", ".join(port for _, port in self.swapped) or "nothing"
        if self.raised:
            return f"cannot judge the swap of {names}: {self.raised}"
        if self.outcome == SwapOutcome.CANNOT_JUDGE:
            layer, why = self.not_swapped[0]
            return f"cannot judge the swap of {names}: layer {layer} cannot be judged: {why}"
        if not self.breaks:
            return f"with {names} swapped in: within tolerance ({self.ratio:.3g})"
        judged = [r for r in self.rows if r.judged]
        worst = max(judged, key=lambda r: r.ratio if not np.isnan(r.ratio) else np.inf)
        verb = "differs" if self.into == SwapDirection.PORT else "breaks"
        return f"with {names} swapped in: {verb}; worst {worst.what} {worst.ratio:.3g}x tolerance"

    def as_json(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "swapped": self.swapped, "steps": self.steps,
                "losses": self.losses, "breaks": self.breaks, "ratio": _finite(self.ratio),
                "not_swapped": self.not_swapped, "raised": self.raised,
                "suspects": self.suspects,
                "dropped": self.dropped, "routing": self.routing,
                "rows": [r.as_json() for r in self.rows]}


def _finite(value: float) -> float | str | None:
    return value if np.isfinite(value) else (None if np.isnan(value) else "inf")


class Swapper:
    """Builds swapped reference models for one reference case and one port case.

    ``baseline`` (a trace of the reference run the port's way) sets each comparison's
    tolerance from the error that precision makes there, as ``diff --baseline`` does; the
    reference's own trace to measure it against is captured once, on first use."""

    def __init__(self, reference: Any, port: Any, mapping: str | os.PathLike | Mapping | None
                 = None, *, tolerances: Tolerances | None = None,
                 baseline: str | os.PathLike | None = None,
                 baseline_factor: float = FACTOR, force_routing: bool = False) -> None:
        # every run trains its models, so each gets a fresh case (a copy of a given Case)
        self.make_reference = reference if callable(reference) else (
            lambda: copy.deepcopy(reference))
        self.make_port = port if callable(port) else (lambda: copy.deepcopy(port))
        self.mapping = mapping if isinstance(mapping, Mapping) else (
            Mapping.load(mapping) if mapping is not None else Mapping())
        self.tolerances = tolerances or Tolerances()
        self.baseline_path = None if baseline is None else Path(baseline)
        self.baseline_factor = baseline_factor
        # mixture of experts: every swapped run takes the pure reference's routes (its
        # router-like top-k calls, per step in call order), so a swapped layer's experts are
        # judged apart from routing
        self.force_routing = force_routing
        self._routes: dict[int, dict[int, list[Any]]] = {}  # steps -> the pure run's routes
        self._baseline_judges: dict[int, Baseline] = {}
        self._baseline: Baseline | None = None  # the one judging the current run
        probe_ref, probe_port = self.make_reference(), self.make_port()
        _refuse_reference(probe_ref, probe_port)
        # how the port's layers run inside the torch reference: None where they go in as
        # they are (torch modules, a self-recording port's callables)
        self.donor = framework_of(probe_port).swap_donor(probe_port)
        self.port_name = getattr(probe_port, "name", None) or "the port"
        self.port_title = framework_of(probe_port).title
        self.reference_modules = _modules(probe_ref)
        self.port_modules = _port_modules(probe_port, self.donor)
        # what each model's modules return, and in which order they are first called
        self.order, self.reference_outputs, _, self.reference_sizes = _observe(
            self.make_reference())
        self.port_order, self.port_outputs, self.port_sizes = list(self.port_modules), {}, {}
        self._port_shapes: dict[str, dict[str, tuple[int, ...]]] = {}
        # a port that cannot run whole may still swap layer by layer: then every module
        # counts as called
        if self.donor is not None:
            with contextlib.suppress(Exception):
                self.port_order, self._port_shapes = self.donor.observe(self.make_port())
        elif not framework_of(probe_port).records_itself:
            with contextlib.suppress(Exception):
                (self.port_order, self.port_outputs, self._port_shapes,
                 self.port_sizes) = _observe(self.make_port())
        # port module -> the stacked module it is a layer of (``layers.1.fc`` -> ``layers.fc``),
        # for a port that runs a stack of layers as one module (Flax's nnx.scan)
        stacked = getattr(self.donor, "stacked", None)
        self.stacked = (lambda name: stacked(probe_port, name)) if stacked else (
            lambda name: None)
        self.pairs = self._pairs()  # reference module -> (port module, argument map)
        # reference module -> (port name, why no port module of that name can go in alone)
        self.unswappable = self._unswappable(probe_port)
        # reference module -> (call adapter, its function), imported now: a name that does not
        # import is bad input, refused before any run
        self.calls = self._call_adapters()
        self._runs: dict[int, tuple[Any, Any]] = {}
        self._reference_state = state_arrays(probe_ref.model)  # the weights swapped layers get
        # each site's output conversion, declared or derived, as the diff compares it
        self._conversions = SiteConversions(self.mapping, {
            name: tuple(value.shape) for name, value in self._reference_state.items()})

    def _pairs(self) -> dict[str, tuple[str, dict[str, str]]]:
        """Reference module -> (port module, argument map), by the diff's own name matching
        (explicit pairs, same names, rename rules) applied to each module's first call. Only
        modules that both models call: a container the port never calls (a ModuleDict) cannot
        stand in for a layer."""
        called_ref = set(self.order)
        # a stack's layer is called when the stack is: its forward runs them all
        called_port = _Called(set(self.port_order), self.stacked)
        pairs: dict[str, tuple[str, dict[str, str]]] = {}
        for ref_site in [*self.mapping.pairs, *(schema.site_name(m, 0)
                                                for m in self.reference_modules)]:
            module = schema.split_site(ref_site)[0]
            found = port_site_for(ref_site, self.mapping, called_port)
            if (found is not None and module not in pairs and module in called_ref
                    and module != schema.ROOT_MODULE):
                pairs[module] = (schema.split_site(found[0])[0], found[1])
        return pairs

    def _call_adapters(self) -> dict[str, tuple[CodeRef, Any]]:
        found: dict[str, tuple[CodeRef, Any]] = {}
        functions: dict[CodeRef, Any] = {}
        pair_sites = {schema.split_site(site)[0]: site for site in self.mapping.pairs}
        for module in self.pairs:
            ref = self.mapping.call_adapter(pair_sites.get(module, schema.site_name(module, 0)))
            if ref is not None:
                if ref not in functions:
                    functions[ref] = ref.resolve()
                found[module] = (ref, functions[ref])
        return found

    def _unswappable(self, port: Any) -> dict[str, tuple[str, str]]:
        """Reference modules with no port partner because the port's layer exists only
        inside a module that holds several (a layer of a scanned stack), outermost only."""
        found: dict[str, tuple[str, str]] = {}
        why_unswappable = getattr(self.donor, "why_unswappable", None)
        if why_unswappable is None:
            return found
        for module in self.order:
            if module in self.pairs or any(module.startswith(f + ".") for f in found):
                continue
            renamed = self.mapping.rename(module)
            name = renamed[0] if renamed else module
            why = why_unswappable(port, name)
            if why:
                found[module] = (name, why)
        return found

    def resolve(self, name: str) -> str:
        """A reference module for a name given in either model's terms (module or site; an op
        site stands for the module whose code runs it: an op is not a layer of its own)."""
        op = schema.split_op_site(name)
        if op is not None:
            name = op[0]
        module = name.rpartition("#")[0] if "#" in name else name
        if module in self.pairs:
            return module
        for ref_module, (port_module, _) in self.pairs.items():
            if port_module == module:
                return ref_module
        known = ", ".join(list(self.pairs)[:6])
        raise DiffError(f"site {name!r} has no layer in both models (neither a reference "
                        f"module with a port partner nor a port module with a reference one, "
                        f"both called in a forward pass); such layers look like: {known}")

    def run(self, modules: Sequence[str], *, steps: int | None = None,
            into: SwapDirection | str = SwapDirection.REFERENCE) -> SwapResult:
        """The host case with ``modules`` (reference names) swapped, against the reference."""
        into = SwapDirection.parse(into)
        if into == SwapDirection.PORT and self.donor is not None:
            raise DiffError(f"case {self.port_name} is {self.port_title}, and a torch "
                            "reference layer cannot run inside its computation (--into "
                            "port); swap its layers into the reference instead")
        modules = _outermost([self.resolve(m) for m in modules])
        if steps is not None and steps < 1:
            raise DiffError(f"--steps must be at least 1 (got {steps})")
        steps = steps or self.make_reference().steps
        pure, ref_run = self._pure_reference(steps)
        self._baseline = self._baseline_judge(steps)
        swapped = [(module, self.pairs[module][0]) for module in modules]
        result = SwapResult(swapped, steps, [], into=into)
        try:
            host, adapters = self._swapped_host(modules, into)
        except LayerCallError as exc:
            result.not_swapped.append((self._layer_name(exc.module, into), exc.reason))
            return result
        except DiffError:
            raise  # bad input: a mapping that does not fit, a host that cannot take layers
        except Exception as exc:  # putting the layers in failed: nothing to judge
            why = f"putting the layers in raised {type(exc).__name__}: {one_line(exc)}"
            if len(swapped) == 1:
                result.not_swapped.append((swapped[0][1], why))
            else:
                result.raised = why
            return result
        forcer = (RouteForcer(self._routes[steps], "the reference's own run")
                  if self.force_routing else None)
        try:
            with forcer if forcer is not None else contextlib.nullcontext():
                host_run = run_case(host, steps=steps,
                                    observer=StepsOf(forcer) if forcer is not None else None)
            if forcer is not None:
                for step in range(steps):
                    forcer.check_taken(step, f"the run with {swapped[0][1]} swapped in"
                                       + (" (and more)" if len(swapped) > 1 else ""))
                result.routing = describe(forcer.forced())
        except Exception as exc:  # nothing ran to the end to judge: the swap cannot judge
            blamed = _blamed(exc)
            fewer = [adapter.host_name for _, adapter in adapters if _returned_fewer(adapter)]
            # a layer that raised on what another swapped layer did not return (None) is not
            # the one to blame for sure: then the run, not the layer, cannot be judged
            doubt = blamed is not None and blamed[2] and any(m != blamed[0] for m in fewer)
            if blamed is not None and not doubt:  # could not be called, or lacks what is read
                module, why, _ = blamed
                result.not_swapped.append((self._layer_name(module, into), why))
                return result
            if blamed is None and isinstance(exc, DiffError):
                raise  # bad input (steps, a mapping's conversion), said as such
            why = _run_raised(exc, adapters, blamed)
            result.suspects = [self._layer_name(module, into) for module in fewer]
            if len(swapped) == 1:  # one layer in: it is the one that cannot be judged
                result.not_swapped.append((swapped[0][1], why))
            else:  # which of them: bisect splits the set to find out
                result.raised = why
            return result
        result.dropped = {name: adapter.dropped for name, adapter in adapters
                          if isinstance(adapter, LayerAdapter) and adapter.dropped}
        result.losses = [(float(a), float(b)) for a, b in zip(ref_run.losses, host_run.losses,
                                                              strict=True)]
        rows = result.rows
        for step, (a, b) in enumerate(zip(ref_run.losses, host_run.losses, strict=True)):
            rows.append(self._compare(f"loss, step {step}", (step, schema.LOSS_SITE,
                                                            Role.OUTPUT, "0"), a, b))
        root = schema.site_name(schema.ROOT_MODULE, 0)
        for (arg, a), (_, b) in zip(flatten(ref_run.output, ""), flatten(host_run.output, ""),
                                    strict=False):
            if torch.is_tensor(a) and torch.is_tensor(b):
                rows.append(self._compare(f"output {arg}, step {steps - 1}",
                                          (steps - 1, root, Role.OUTPUT, arg), a, b))
        if into == SwapDirection.REFERENCE:
            rows += self._parameter_rows(pure.model, host.model, steps)
            rows += self._swapped_grad_rows(pure.model, adapters, steps)
        return result

    def _layer_name(self, module: str, into: SwapDirection) -> str:
        """The swapped layer's name for a host module named by an error (the port's)."""
        return self.pairs[module][0] if into == SwapDirection.REFERENCE else module

    def _swapped_host(self, modules: list[str], into: SwapDirection
                      ) -> tuple[Any, list[tuple[str, nn.Module]]]:
        """The host case with ``modules`` replaced, and the layers put in (by reference
        module)."""
        if into == SwapDirection.REFERENCE:
            host = self.make_reference()
            donor = self.make_port()  # one port for all the swapped layers of this run
            _load_port(donor, self._reference_state, self.mapping, self.donor)
        else:
            donor = self.make_reference()
            host = self.make_port()
            if framework_of(host).records_itself:
                raise DiffError(f"case {host.name} is not a torch model, so reference layers "
                                "cannot go into it (--into port); swap its layers into the "
                                "reference instead")
            load_weights_from(host.model, self._reference_state, self.mapping)
        adapters = []
        # the host's parameters by name before any is replaced: a tie between two swapped
        # layers (GPT-2's wte and lm_head) is found by the reference's names of both
        host_params = dict(host.model.named_parameters(remove_duplicate=False))
        for module in modules:
            port_module, args_map = self.pairs[module]
            if into == SwapDirection.REFERENCE:
                replaced = get_module(host.model, module)
                layer = self._port_layer(donor, port_module, args_map, module, replaced)
                _tie_shared(host_params, module, layer, self.mapping, port_module)
                _replace(host.model, module, layer)
            else:
                if module in self.calls:
                    ref = self.calls[module][0]
                    raise LayerCallError(port_module, f"the mapping's call adapter {ref.spec!r} "
                                         f"({ref.where}) turns the reference's call of "
                                         f"{module} into the port's; the reverse, to call the "
                                         f"reference's layer from the port's code, is not "
                                         "written, so it cannot go into the port")
                replaced = get_module(host.model, port_module)
                layer = LayerAdapter(port_module, get_module(donor.model, module), args_map,
                                     caller=Signature.of(replaced.forward),
                                     expected=self.port_outputs.get(port_module),
                                     sizes=self.port_sizes.get(port_module), inverse=True,
                                     replaced=replaced,
                                     output=self._output_conversion(module, replaced,
                                                                    inverse=True))
                _replace(host.model, port_module, layer)
            adapters.append((module, layer))
        return host, adapters

    def _port_layer(self, donor: Any, port_module: str, args_map: dict[str, str],
                    ref_module: str, replaced: nn.Module) -> nn.Module:
        if framework_of(donor).records_itself:
            prefix = "" if ref_module == schema.ROOT_MODULE else ref_module + "."
            nested = [n for n in self._reference_state
                      if n.startswith(prefix) and "." in n[len(prefix):]]
            if nested:
                raise LayerCallError(ref_module, f"port layer {port_module} is not torch and "
                                     f"reference module {ref_module} has parameters inside its "
                                     f"children ({', '.join(nested[:3])}), which the layer "
                                     "would leave untrained; swap its children instead")
            weights = {name[len(prefix):]: value for name, value in self._reference_state.items()
                       if name.startswith(prefix) and "." not in name[len(prefix):]}
            if ref_module in self.calls:
                raise LayerCallError(ref_module, f"port layer {port_module} is not torch: the "
                                     "mapping's call adapter makes a torch call, and a numpy "
                                     "layer takes its inputs by argument path")
            return CallableLayer(ref_module, donor.layers[port_module], weights, args_map,
                                 replaced=replaced)
        layer, call = port_layer_for(donor, port_module, self.calls.get(ref_module),
                                     self.donor)
        # a call adapter makes the whole call (in torch, or in JAX inside a Flax layer)
        return LayerAdapter(ref_module, layer, {} if ref_module in self.calls else args_map,
                            caller=Signature.of(replaced.forward),
                            expected=self.reference_outputs.get(ref_module),
                            sizes=self.reference_sizes.get(ref_module),
                            call=call, replaced=replaced,
                            output=self._output_conversion(ref_module, layer))

    def _output_conversion(self, ref_module: str, port_layer: nn.Module, *,
                           inverse: bool = False) -> tuple[Any, Any] | None:
        """The site's output conversion (compare/outconv.py ``SiteConversions``, as the diff
        finds it) and the function that puts the port layer's outputs in the reference's
        layout; ``inverse``: the reference layer's outputs in the port's (a reference layer
        swapped into the port), which only a derived row permutation has (a declared
        ``output_transform`` is one way): a LayerCallError says so."""
        port_module = self.pairs[ref_module][0]
        prefix = "" if port_module == schema.ROOT_MODULE else port_module + "."
        params = {prefix + name: tuple(tensor.shape)
                  for held in (port_layer._parameters, port_layer._buffers)
                  for name, tensor in held.items() if tensor is not None}
        shape = self._port_shapes.get(port_module, {}).get("0")
        site = next((s for s in self.mapping.pairs if schema.split_site(s)[0] == ref_module),
                    schema.site_name(ref_module, 0))
        conversion = self._conversions.find(site, port_module, params,
                                            shape[-1] if shape else None)
        if conversion is None:
            return None
        if not inverse:
            return conversion, self._conversions.function(conversion)
        if not isinstance(conversion, DerivedPermutation):
            raise LayerCallError(port_module, f"the mapping's {conversion.describe()} "
                                 f"({conversion.where}) turns the port's outputs into the "
                                 "reference's; its inverse, to put the reference layer's "
                                 "outputs in the port's layout, is not written")
        return conversion, conversion.resolve_inverse()

    def _compare(self, what: str, key: tuple[int, str, str, str], expected: torch.Tensor,
                 got: torch.Tensor, *, judged: bool = True) -> SwapRow:
        """One quantity of the swapped run against the pure reference's, by the judge."""
        step, site, role, arg = key
        a = expected.detach().double().cpu().numpy()
        b = got.detach().double().cpu().numpy()
        ref_dtype = str(expected.dtype).removeprefix("torch.")
        port_dtype = str(got.dtype).removeprefix("torch.")
        tolerance = self.tolerances.lookup(site, role, arg, looser_dtype(ref_dtype, port_dtype))
        rms_limit = None
        if a.shape != b.shape:
            return SwapRow(what, step, site, Role(role), arg, np.inf, np.inf, judged,
                           f"shapes differ: {a.shape} vs {b.shape}")
        if self._baseline is not None and tolerance.kind not in ("rule", "flags"):
            limit = self._baseline.limit(key, _statistics(a), port_dtype, 1.0)
            if limit is not None:
                tolerance, rms_limit = limit.tolerance, limit.rms
        ratios = judge.element_ratios(a, b, tolerance.rtol, tolerance.atol)
        ratio = float(ratios.max()) if ratios.size else 0.0
        if rms_limit is not None:
            rms = float(np.sqrt(np.mean((a - b) ** 2))) if a.size else 0.0
            ratio = judge.worst([ratio, rms / rms_limit if rms_limit > 0 else (
                0.0 if rms == 0 else np.inf)])
        with np.errstate(invalid="ignore"):
            diff = np.abs(a - b)
        max_abs = float(np.nanmax(diff, initial=0.0)) if np.isfinite(ratio) else np.inf
        # not finite where the reference is: a break wherever it is, reported rows included
        broken = bool((np.isfinite(a) & ~np.isfinite(b)).any())
        return SwapRow(what, step, site, Role(role), arg, ratio, max_abs, judged or broken,
                       tolerance.describe())

    def _parameter_rows(self, reference: nn.Module, host: nn.Module, steps: int
                        ) -> list[SwapRow]:
        """Weights after the steps (reported) and the last step's weight gradients (judged),
        for the parameters both models have under the same name."""
        ours = dict(reference.named_parameters())
        rows = []
        for name, param in host.named_parameters():
            if name not in ours:  # the swapped layers' own parameters have other names
                continue
            module, _, leaf = name.rpartition(".")
            site = schema.site_name(module or schema.ROOT_MODULE, 0)
            rows.append(self._compare(f"weight {name} after {steps} step(s)",
                                      (steps - 1, site, Role.WEIGHT, leaf), ours[name], param,
                                      judged=False))
            if ours[name].grad is not None and param.grad is not None:
                rows.append(self._compare(f"weight_grad {name}, step {steps - 1}",
                                          (steps - 1, site, Role.WEIGHT_GRAD, leaf),
                                          ours[name].grad, param.grad))
        return rows

    def _swapped_grad_rows(self, reference: nn.Module, adapters: list[tuple[str, nn.Module]],
                           steps: int) -> list[SwapRow]:
        """The swapped port layers' weight gradients against the reference's, through the
        mapping (a fused QKV gradient is compared part by part)."""
        ref_params = dict(reference.named_parameters())
        partner = {port: ref for ref, (port, _) in self.pairs.items()}
        rows = []
        for ref_module, adapter in adapters:
            if not isinstance(adapter, LayerAdapter):
                continue  # a numpy layer's parameters carry the reference's names already
            port_module = self.pairs[ref_module][0]
            for name, param in adapter.wrapped.named_parameters():
                found = self.mapping.param_source(f"{port_module}.{name}", partner) or \
                    ParamSource([f"{ref_module}.{name}"])
                refs = [ref_params.get(n) for n in found.reference]
                if param.grad is None or any(r is None or r.grad is None for r in refs):
                    continue
                # a conversion's pull-back needs the reference weights (exact for a linear one)
                for ref_name, ref_grad, port_grad in paired_parts(
                        found, [r.grad for r in refs], param.grad,
                        at=[r.detach() for r in refs]):
                    module, _, leaf = ref_name.rpartition(".")
                    rows.append(self._compare(
                        f"weight_grad {ref_name} (port {port_module}.{name}), step {steps - 1}",
                        (steps - 1, schema.site_name(module or schema.ROOT_MODULE, 0),
                         Role.WEIGHT_GRAD, leaf), ref_grad, port_grad))
        return rows

    def _pure_reference(self, steps: int):
        """The pure reference, run once per number of steps (every probe compares with it)."""
        if steps not in self._runs:
            case = self.make_reference()
            recorder = RouteRecorder() if self.force_routing else None
            with recorder if recorder is not None else contextlib.nullcontext():
                self._runs[steps] = (case, run_case(
                    case, steps=steps,
                    observer=StepsOf(recorder) if recorder is not None else None))
            if recorder is not None:
                self._routes[steps] = recorder.routes
        return self._runs[steps]

    def _baseline_judge(self, steps: int) -> Baseline | None:
        """The baseline's error against the reference's own trace of ``steps`` steps (captured
        once), as :func:`layerdiff.diff` measures it."""
        if self.baseline_path is None:
            return None
        if steps not in self._baseline_judges:
            from layerdiff.capture import capture
            from layerdiff.compare.engine import measure_baseline
            from layerdiff.trace import open_trace

            with tempfile.TemporaryDirectory(prefix="layerdiff-swap-") as tmp:
                trace = capture(self.make_reference(), Path(tmp) / "reference.h5",
                                steps=steps)
                with open_trace(trace) as ref, open_trace(self.baseline_path) as base:
                    self._baseline_judges[steps] = measure_baseline(
                        ref, base, self.baseline_factor, None)
        return self._baseline_judges[steps]

    def leaves(self) -> list[str]:
        """Reference modules whose port partner is a leaf of the port, in execution order."""
        port = self.make_port()
        if framework_of(port).records_itself:
            names = set(port.layers)
            port_leaves = {n for n in names if not any(o.startswith(n + ".") for o in names)}
        elif self.donor is not None:
            port_leaves = self.donor.leaf_paths(port) - {schema.ROOT_MODULE}
        else:
            port_leaves = {path for path, module in named_modules(port.model)
                           if path != schema.ROOT_MODULE and is_leaf(module)}
        return [m for m in self.order if m in self.pairs and (
            self.pairs[m][0] in port_leaves or self.stacked(self.pairs[m][0]) in port_leaves)]

    def containers(self) -> list[str]:
        """Paired reference modules that are not :meth:`leaves`, in execution order: layers
        with code of their own around their children (an attention's scaling, a residual)."""
        leaves = set(self.leaves())
        return [m for m in self.order if m in self.pairs and m not in leaves]

    def execution_order(self) -> list[str]:
        """Reference modules in the order of their first call (one forward pass)."""
        return list(self.order)


def swap(reference: Any, port: Any, sites: Sequence[str], *,
         mapping: str | os.PathLike | Mapping | None = None, steps: int | None = None,
         into: SwapDirection | str = SwapDirection.REFERENCE,
         tolerances: Tolerances | None = None,
         baseline: str | os.PathLike | None = None, force_routing: bool = False) -> SwapResult:
    """Run ``reference`` (a Case, or a function making one) with the port's layers at
    ``sites`` in place (``into="port"``: the reference's layers in the port instead) and
    compare loss, outputs, weight gradients and weights after the steps with the pure reference.
    ``into``: a :class:`SwapDirection` or its value. Cases are built afresh for each run when
    given as functions (recommended: a run trains).
    ``tolerances`` (see :meth:`Tolerances.build`) and ``baseline`` judge the comparisons.
    ``force_routing``: the swapped run's router-like top-k calls take the pure reference's
    routes (mixture of experts: experts judged apart from routing)."""
    return Swapper(reference, port, mapping, tolerances=tolerances, baseline=baseline,
                   force_routing=force_routing).run(sites, steps=steps, into=into)


def _observe(case: Any) -> tuple[list[str], dict[str, Any], dict[str, dict[str, tuple]],
                                 dict[str, set[tuple[int, ...]]]]:
    """One forward pass of ``case``: its modules in the order of their first call, the
    structure of what each returned (tensors as placeholders), its tensor outputs' shapes by
    argument path (first call), and the shapes its first output tensor had over its calls."""
    order: dict[str, None] = {}
    outputs: dict[str, Any] = {}
    shapes: dict[str, dict[str, tuple[int, ...]]] = {}
    sizes: dict[str, set[tuple[int, ...]]] = {}

    def before(name: str, _module: nn.Module, _args: tuple, _kwargs: dict) -> None:
        order.setdefault(name)

    def after(name: str, _module: nn.Module, _args: tuple, _kwargs: dict, out: Any) -> None:
        outputs.setdefault(name, skeleton(out))
        shapes.setdefault(name, {arg: tuple(value.shape) for arg, value in flatten(out, "")
                                 if torch.is_tensor(value)})
        first = next((v for _, v in flatten(out, "") if torch.is_tensor(v)), None)
        if first is not None:
            sizes.setdefault(name, set()).add(tuple(first.shape))

    # a module called as child.forward(...) (llama2.c) is called too
    with hook_every_call(case.model, before, after, direct_calls=True), torch.no_grad():
        case.call_model()
    return list(order), outputs, shapes, sizes


def _blamed(exc: BaseException) -> tuple[str, str, bool] | None:
    """(host module, why, whether it was the layer's own call) when ``exc`` or what it was
    raised from names a swapped layer: one that could not be called or raised in its own call
    (True), or lacks an attribute read of it (False: that is certain)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, LayerCallError):
            return exc.module, exc.reason, True
        if isinstance(exc, SwappedAttributeError):
            return exc.module, str(exc), False
        exc = exc.__cause__ or exc.__context__
    return None


def _run_raised(exc: BaseException, adapters: list[tuple[str, nn.Module]],
                blamed: tuple[str, str, bool] | None = None) -> str:
    """One line: what the swapped run raised, where in the models' code (the innermost frame
    outside torch and layerdiff), and the outputs a swapped layer did not return (None stood
    for them: the usual cause)."""
    if blamed is not None:  # a swapped layer raised, maybe on what another did not return
        text = f"layer {blamed[0]}: {blamed[1]}"
    else:
        text = f"the run raised {type(exc).__name__}: {one_line(exc)}"
        where = _where(exc)
        if where:
            text += f" ({where})"
    missing = [f"{adapter.host_name} ({arg})" for _, adapter in adapters
               if _returned_fewer(adapter) for arg, why in adapter.dropped if why == NOT_RETURNED]
    if missing:
        text += (f"; None stood for outputs the swapped-in layer does not return: "
                 f"{', '.join(missing)}")
    return text


def _returned_fewer(adapter: nn.Module) -> bool:
    return isinstance(adapter, LayerAdapter) and any(why == NOT_RETURNED
                                                     for _, why in adapter.dropped)


def _where(exc: BaseException) -> str:
    """The innermost frame of ``exc``'s traceback outside torch and layerdiff: the model's
    own line ('modeling_whisper.py:712 in forward')."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not any(part in Path(f.filename).parts for part in ("torch", "layerdiff"))]
    if not frames:
        return ""
    last = frames[-1]
    return f"at {Path(last.filename).name}:{last.lineno} in {last.name}"


def _tie_shared(by_name: dict[str, nn.Parameter], module: str, layer: nn.Module,
                mapping: Mapping, port_module: str) -> None:
    """A port layer standing in for a module whose parameter is tied to another module's
    (GPT-2's lm_head and token embedding) takes the host's own parameter, so the tie holds and
    its gradient sums over every user, as in the reference. ``by_name``: the host's
    parameters (``named_parameters(remove_duplicate=False)``) before the swap."""
    if not isinstance(layer, LayerAdapter):
        return
    shared: dict[int, list[str]] = {}
    for name, param in by_name.items():
        shared.setdefault(id(param), []).append(name)
    tied = {names[0]: names for names in shared.values() if len(names) > 1}
    # a Flax layer names every path of a variable the port ties (its lm head's
    # ``lm_head.wte.embedding`` is ``transformer.wte.embedding``): the mapping sources one
    port_names = getattr(layer.wrapped, "port_names", lambda name: [f"{port_module}.{name}"])
    for name, param in list(layer.wrapped.named_parameters()):
        for full in port_names(name):
            source = mapping.param_source(full, {port_module: module})
            refs = source.reference if source is not None else [f"{module}.{name}"]
            plain = source is None or all(step == "copy" for step in source.transforms)
            if len(refs) != 1 or not plain:
                continue
            users = next((names for names in tied.values() if refs[0] in names), None)
            host_param = by_name.get(refs[0])
            if users and host_param is not None and host_param.shape == param.shape:
                owner, _, leaf = name.rpartition(".")
                setattr(layer.wrapped.get_submodule(owner) if owner else layer.wrapped, leaf,
                        host_param)
                break


def _statistics(values: np.ndarray) -> dict[str, float]:
    """What a baseline limit reads of the reference's record (as a trace index row has it)."""
    finite = values[np.isfinite(values)]
    return {"min": float(finite.min()) if finite.size else 0.0,
            "max": float(finite.max()) if finite.size else 0.0,
            "l2": float(np.sqrt(np.sum(finite ** 2))), "numel": values.size}


def _refuse_reference(reference: Any, port: Any) -> None:
    """Swap and bisect run port layers inside the reference's torch autograd: the reference
    must be torch (a port's layers of another framework go into it through its donor)."""
    framework = framework_of(reference)
    if framework.name != "torch":
        raise DiffError(f"case {reference.name or '?'} is {framework.title}, and swap and bisect "
                        "run port layers inside the reference's torch autograd, so the "
                        "reference must be a torch model; give the torch model as the "
                        f"reference and {getattr(port, 'name', None) or 'the port'} as the "
                        "port")


def _load_port(port: Any, reference: dict[str, np.ndarray], mapping: Mapping,
               donor: Any) -> None:
    """The reference's weights into the port through the mapping (a port that records itself
    gets its per layer; a port of another framework through its ``donor``)."""
    if framework_of(port).records_itself:
        return
    if donor is not None:
        donor.load_arrays(port, reference, mapping)
    else:
        load_weights_from(port.model, reference, mapping)


def port_layer_for(port: Any, module_path: str, call: tuple[CodeRef, Any] | None,
                   donor: Any) -> tuple[nn.Module, tuple[CodeRef, Any] | None]:
    """The port's layer at ``module_path`` as a torch module, from a port case already holding
    the reference's weights (:func:`_load_port`), and the mapping's call adapter for the site
    (``call``) left for :class:`LayerAdapter` to apply in torch: a torch port's own module, or
    the layer its framework's ``donor`` makes (a Flax NNX module run through its ``jax.vjp``,
    which applies the adapter itself, to JAX arrays as replay does: none left)."""
    if donor is not None:
        return donor.layer(port, module_path, call)
    return get_module(port.model, module_path), call


def _modules(case: Any) -> list[str]:
    return module_paths(case.model)


def _port_modules(port: Any, donor: Any) -> list[str]:
    if framework_of(port).records_itself:
        if not port.layers:
            raise DiffError(f"case {port.name} gives no per-site layers to swap in; give the "
                            "ExternalCase a 'layers' dict of forward/backward callables")
        return list(port.layers)
    if donor is not None:
        return donor.module_paths(port)
    return _modules(port)


class _Called:
    """The port modules a forward calls: those seen called, and each layer of a stack the
    port runs as one module (``stacked`` names its stacked module), which its forward runs."""

    def __init__(self, seen: set[str], stacked: Callable[[str], str | None]) -> None:
        self.seen, self.stacked = seen, stacked

    def __contains__(self, name: object) -> bool:
        return name in self.seen or (isinstance(name, str) and self.stacked(name) is not None)


def _outermost(modules: Sequence[str]) -> list[str]:
    """Of nested modules only the outer one is swapped (it holds the inner), in the order
    given (the same names print the same way in every run)."""
    chosen = list(dict.fromkeys(modules))
    return [m for m in chosen if not any(m.startswith(outer + ".") for outer in chosen)]


def _replace(model: nn.Module, path: str, layer: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(get_module(model, parent) if parent else model, name, layer)
