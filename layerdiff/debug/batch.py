"""``batch_independence``: does any layer make one sample's result depend on another sample?

A model that mixes samples across the batch (a ``reshape`` where a ``transpose`` belonged, a
mean over the wrong axis, a hand-written backward that applies sample 0's mask to all) trains,
but on wrong numbers. The check runs the case's forward once to record every site's call (its
arguments, cloned before the call), then tests each site *on its own*: the module is called again
on its recorded arguments, so a site is judged by its own code and never by mixing that happened
before it. The batch is split into two groups of samples, ``observed`` and ``varied``, once per
bit of the sample index and both ways round (``2 * ceil(log2 B)`` splits: every ordered pair of
samples is separated by one of them). For each split, three tests:

- gradient (forward): a loss on the observed samples' outputs (a random cotangent on them, zero
  on the others) must give exactly zero gradient on the varied samples' inputs. The gradient is
  autograd's, through the site's own backward;
- perturbation (forward): replacing the varied samples' inputs (each by another sample of the
  batch, so integer tokens and masks stay valid) must leave the observed samples' outputs
  unchanged, bit for bit. This sees dependences a gradient cannot: through masks, comparisons,
  integer inputs;
- backward perturbation: replacing the varied samples' inputs *and* output gradients must leave
  the observed samples' input gradients unchanged: the backward of sample i must not read sample
  j's data, as a hand-written backward may (the forward can be right while the backward mixes).

A site whose outputs changed is mixing in its **forward**; a site whose forward values are
independent while its gradient test or backward perturbation shows mixing is mixing in its
**backward**. When a perturbation shows a change, the site is run once more unchanged: a site
that is not deterministic (atomics on a GPU) is judged against that run-to-run noise, times
``NOISE_FACTOR``.

The batch axis: the case's inputs are split along ``batch_axis`` (0 by default), giving the batch
size B. Inside the model a tensor's batch axis is its axis of length B (``batch_axis`` when that
one has length B, else the first that does), so sequence-first sites, ``(length, batch, ...)``,
are handled; a tensor with no axis of length B (weights, broadcast masks, a batch flattened into
another axis) is passed unchanged and not judged. Choose a batch size no other dimension of the
model has: a tensor with two axes of length B is warned about.

Sites that mix by design are reported as allowed, not as findings: batch norm in training mode
(it normalizes with the batch's statistics), and any site or module path matching an ``allow``
glob. A container whose mixing comes only from allowed sites inside it is allowed too.
``mixing`` lists every other site that mixes, containers included (``holds`` names the mixing
sites inside them); ``first`` is the first in execution order with no mixing site inside it: the
innermost place where the mixing is made, whose inputs no earlier finding had mixed yet.
"""

from __future__ import annotations

import fnmatch
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import torch
from torch import nn

import layerdiff.rng as rng
from layerdiff.capture.modules import hook_every_call
from layerdiff.case import Case, load_case
from layerdiff.compare import result as R
from layerdiff.compare.origins import Words
from layerdiff.debug.origin import Record, find_origin, origin_json, sites_frame
from layerdiff.errors import CaptureError, CaseError
from layerdiff.framework import framework_of
from layerdiff.trace import schema
from layerdiff.trace.schema import Pass, Role

Progress = Callable[[int, int], None]  # (sites done, sites in all)
NOISE_FACTOR = 4.0
SHOWN_SAMPLES = 8
MIXING = Words("mixed across samples", "free of mixing", "mixing")


class MixTest(StrEnum):
    GRADIENT = "gradient"
    PERTURBATION = "perturbation"
    BACKWARD = "backward perturbation"


@dataclass
class Evidence:
    """One test that showed mixing, on one split of the batch."""

    test: MixTest
    observed: list[int]     # the samples whose results were looked at
    varied: list[int]       # the samples whose inputs were changed, or given no gradient
    affected: list[int]     # perturbation: observed samples that changed; gradient: varied
    size: float             # relative size: the change over the observed values' largest

    def as_json(self) -> dict[str, Any]:
        return {"test": str(self.test), "observed": self.observed, "varied": self.varied,
                "affected": self.affected,
                "size": self.size if math.isfinite(self.size) else None}


@dataclass
class Mixing:
    """A site whose results for some samples depend on other samples."""

    site: str
    module: str
    type: str
    pass_: schema.Pass               # forward | backward
    evidence: list[Evidence]         # every test that showed it, the deciding one first
    holds: list[str] = field(default_factory=list)   # mixing sites inside it
    allowed: str = ""                # why it is allowed ("" for a finding)

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "module": self.module, "type": self.type,
                "pass": str(self.pass_),
                "tests": [str(e.test) for e in self.evidence],
                "evidence": [e.as_json() for e in self.evidence], "holds": self.holds,
                "allowed": self.allowed or None}


@dataclass
class BatchResult:
    """What :func:`batch_independence` found. ``found`` is true when some site mixes."""

    case: str
    batch_size: int
    batch_axis: int
    splits: int
    sites: int                            # sites called in the forward
    tested: dict[str, int]                # test -> sites it could be run on
    mixing: list[Mixing]
    allowed: list[Mixing]
    first: Mixing | None
    untested: dict[str, str]              # site -> why no test could run there
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0
    # the site whose own code mixes, by the diff's origin rule over every site's own test
    origin: R.Origin | None = None

    @property
    def found(self) -> bool:
        return bool(self.mixing)

    def as_json(self) -> dict[str, Any]:
        return {"found": self.found, "case": self.case, "batch_size": self.batch_size,
                "batch_axis": self.batch_axis, "splits": self.splits, "sites": self.sites,
                "tested": dict(self.tested),
                "first": self.first.as_json() if self.first else None,
                "origin": origin_json(self.origin),
                "mixing": [m.as_json() for m in self.mixing],
                "allowed": [m.as_json() for m in self.allowed],
                "untested": dict(self.untested), "warnings": list(self.warnings),
                "seconds": round(self.seconds, 3)}


def batch_independence(case: Case | str, allow: Sequence[str] = (), *, batch_axis: int = 0,
                       progress: Progress | None = None) -> BatchResult:
    """Check, site by site, that no sample's outputs (forward) or input gradients (backward)
    depend on another sample's data; see the module docstring for the tests.

    ``case``: a :class:`layerdiff.Case` or a ``package.module:name`` spec. ``allow``: globs over
    site names and module paths of sites that mix by design. ``batch_axis``: the axis of the
    case's inputs that holds the samples. ``progress(done, total)`` is called after each site.
    The model's parameters, buffers and the global random state are left as they were.
    """
    started = time.perf_counter()
    if isinstance(case, str):
        case = load_case(case)
    if framework_of(case).name != "torch":
        raise CaseError(f"case {case.name} is {framework_of(case).title}: batch independence "
                        "calls a torch model's layers one by one; give a torch case")
    batch = _batch_size(case, batch_axis)
    splits = _splits(batch)
    warnings: list[str] = []
    calls = _record_calls(case)
    checker = _Checker(batch, batch_axis, splits, case.seed)
    results: dict[str, _SiteResult] = {}
    for done, call in enumerate(calls, 1):
        results[call.site] = checker.check(call)
        if progress is not None:
            progress(done, len(calls))
    warnings += checker.warnings()
    warnings += _identical_samples(case, batch, batch_axis)
    mixing, allowed = _classify(calls, results, allow)
    leaves = [entry for entry in mixing if not entry.holds]
    first = leaves[0] if leaves else (mixing[0] if mixing else None)
    tested = {str(test): sum(test in r.ran for r in results.values()) for test in MixTest}
    untested = {site: r.untested for site, r in results.items() if r.untested}
    return BatchResult(case.name, batch, batch_axis, len(splits), len(calls), tested, mixing,
                       allowed, first, untested, warnings, time.perf_counter() - started,
                       mixing_origin(calls, mixing, allowed))


def mixing_origin(calls: list[_Call], mixing: list[Mixing],
                  allowed: list[Mixing]) -> R.Origin | None:
    """The diff's origin rule over the sites' own tests: a site's output (forward) or
    ``grad_input`` (backward) is off when it mixes; its inputs and output gradients never are,
    as each site ran on its own recorded arguments (an independent judgement, as in a replay).
    A site that mixes by design is off too, so that a container mixing through it is not
    named for it, but it is never the origin named."""
    passes = {entry.site: entry.pass_ for entry in [*mixing, *allowed]}
    last = 2 * len(calls)
    records = []
    for call in calls:
        mixed = passes.get(call.site)
        backward = last + 2 * (len(calls) - call.order)  # the backward runs in reverse
        records += [
            Record(0, Pass.FORWARD, 2 * call.order, call.site, Role.INPUT, "0", False),
            Record(0, Pass.FORWARD, 2 * call.order + 1, call.site, Role.OUTPUT, "0",
                   mixed == schema.Pass.FORWARD),
            Record(0, Pass.BACKWARD, backward, call.site, Role.GRAD_OUTPUT, "0", False),
            Record(0, Pass.BACKWARD, backward + 1, call.site, Role.GRAD_INPUT, "0",
                   mixed == schema.Pass.BACKWARD)]
    sites = sites_frame({(0, call.site): call.parent for call in calls})
    return find_origin(records, sites, MIXING, independent=True,
                       excused=[entry.site for entry in allowed])


# ---- the batch and its splits


def _batch_size(case: Case, axis: int) -> int:
    if axis < 0:  # counted from the end it would name another axis in inputs of other ranks
        dims = sorted({value.dim() for _, value in _case_tensors(case)})
        raise CaseError(f"case {case.name}: --batch-axis {axis} is negative; pass the axis that "
                        f"holds the samples counted from 0 (its input tensors have "
                        f"{' or '.join(map(str, dims)) or 'no'} dimensions)")
    for _, value in _case_tensors(case):
        if value.dim() > axis:
            batch = int(value.shape[axis])
            if batch < 2:
                raise CaseError(f"case {case.name}: its inputs hold {batch} sample along axis "
                                f"{axis}; batch independence needs at least 2 (3 or more is "
                                "better): give the case a larger batch")
            return batch
    raise CaseError(f"case {case.name}: no input tensor has a batch axis {axis}; pass "
                    "--batch-axis with the axis that holds the samples")


def _case_tensors(case: Case) -> list[tuple[str, torch.Tensor]]:
    items = case.inputs.items() if isinstance(case.inputs, dict) else enumerate(case.inputs)
    return [(str(k), v) for k, v in items if isinstance(v, torch.Tensor)]


def _splits(batch: int) -> list[tuple[list[int], list[int]]]:
    """(observed, varied) groups: by each bit of the sample index, both ways round."""
    splits = []
    for bit in range(max(1, math.ceil(math.log2(batch)))):
        ones = [i for i in range(batch) if i >> bit & 1]
        zeros = [i for i in range(batch) if not i >> bit & 1]
        splits += [(zeros, ones), (ones, zeros)]
    return splits


def _identical_samples(case: Case, batch: int, axis: int) -> list[str]:
    """Sample j is replaced by sample j+1 in the perturbation: equal ones change nothing."""
    tensors = [v for _, v in _case_tensors(case) if v.dim() > axis and v.shape[axis] == batch]
    same = [j for j in range(batch)
            if all(torch.equal(t.select(axis, j), t.select(axis, (j + 1) % batch))
                   for t in tensors)]
    if not same:
        return []
    return [f"samples {samples_said(same)} of the case's inputs equal the sample after them, so "
            "replacing them changes nothing and the perturbation tests cannot see what reads "
            "them; give the case distinct samples"]


# ---- recording every call's arguments


@dataclass
class _Call:
    site: str
    path: str
    module: nn.Module
    parent: str
    order: int
    depth: int
    args: tuple
    kwargs: dict


def _record_calls(case: Case) -> list[_Call]:
    """Every module call of one forward of the case, with its arguments cloned before it ran."""
    calls: list[_Call] = []
    stack: list[_Call] = []
    counts: dict[str, int] = {}

    def before(path: str, module: nn.Module, args: tuple, kwargs: dict) -> None:
        number = counts.get(path, 0)
        counts[path] = number + 1
        call = _Call(schema.site_name(path, number), path, module,
                     stack[-1].site if stack else "", len(calls), len(stack),
                     _clone(args), _clone(kwargs))
        calls.append(call)
        stack.append(call)

    def after(*_: Any) -> None:
        stack.pop()

    saved = _Buffers(case.model)
    try:
        with hook_every_call(case.model, before, after), rng.preserved(_cuda_devices(case.model)):
            rng.seed_everything(case.seed)
            case.call_model()
    except Exception as exc:
        where = f" inside site {stack[-1].site}" if stack else ""
        raise CaptureError(f"case {case.name}: the model raised {type(exc).__name__}: {exc}"
                           f"{where} during its forward") from exc
    finally:
        saved.restore()
    return calls


def _clone(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_clone(v) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


class _Slot:
    """Where a tensor goes back when a call's arguments are rebuilt."""

    def __init__(self, index: int) -> None:
        self.index = index


def _template(value: Any, leaves: list[torch.Tensor]) -> Any:
    """``value`` with every tensor replaced by a slot; the tensors appended to ``leaves``."""
    if isinstance(value, torch.Tensor):
        leaves.append(value)
        return _Slot(len(leaves) - 1)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_template(v, leaves) for v in value))
    if isinstance(value, (tuple, list)):
        return type(value)(_template(v, leaves) for v in value)
    if isinstance(value, dict):
        return {k: _template(v, leaves) for k, v in value.items()}
    return value


def _fill(template: Any, leaves: Sequence[torch.Tensor]) -> Any:
    if isinstance(template, _Slot):
        return leaves[template.index]
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        return type(template)(*(_fill(v, leaves) for v in template))
    if isinstance(template, (tuple, list)):
        return type(template)(_fill(v, leaves) for v in template)
    if isinstance(template, dict):
        return {k: _fill(v, leaves) for k, v in template.items()}
    return template


def _tensors(value: Any) -> list[torch.Tensor]:
    leaves: list[torch.Tensor] = []
    _template(value, leaves)
    return leaves


class _Buffers:
    """A module's buffers (batch norm's running statistics, counters) as they were.

    Each run gets fresh copies (``fresh``) rather than having the originals written back in
    place: an earlier run's graph may have saved them, and an in-place write would invalidate
    its backward. ``restore`` puts the original tensors back, with their first values."""

    def __init__(self, module: nn.Module) -> None:
        self.entries = [(owner, name, tensor, tensor.detach().clone())
                        for owner in module.modules()
                        for name, tensor in owner._buffers.items() if tensor is not None]

    def fresh(self) -> None:
        for owner, name, _, saved in self.entries:
            owner._buffers[name] = saved.clone()

    def restore(self) -> None:
        with torch.no_grad():
            for owner, name, original, saved in self.entries:
                owner._buffers[name] = original
                original.copy_(saved)


def _cuda_devices(module: nn.Module) -> list[int]:
    return rng.cuda_devices((*module.parameters(), *module.buffers()))


# ---- one site's tests


@dataclass
class _SiteResult:
    evidence: dict[MixTest, Evidence] = field(default_factory=dict)
    ran: set[MixTest] = field(default_factory=set)
    untested: str = ""


@dataclass
class _Run:
    """One call of a module on (possibly changed) arguments: its outputs and gradient leaves."""

    outputs: list[torch.Tensor]
    leaves: dict[int, torch.Tensor]      # argument position -> leaf that requires grad


class _Checker:
    def __init__(self, batch: int, axis: int, splits: list[tuple[list[int], list[int]]],
                 seed: int) -> None:
        self.batch, self.axis, self.splits, self.seed = batch, axis, splits, seed
        self.ambiguous: dict[str, tuple[int, ...]] = {}
        self.noisy: list[str] = []

    def warnings(self) -> list[str]:
        found = []
        if self.ambiguous:
            site, shape = next(iter(self.ambiguous.items()))
            found.append(f"{len(self.ambiguous)} site(s) have a tensor with several axes of "
                         f"length {self.batch} (e.g. {site}, shape {tuple(shape)}): axis "
                         f"{self.axis} was taken as the batch axis where it has that length; if "
                         "such a site runs sequence-first, choose a batch size no other "
                         "dimension has")
        if self.noisy:
            found.append(f"{len(self.noisy)} site(s) give different values when run twice on "
                         f"the same arguments ({', '.join(self.noisy[:4])}): judged against "
                         f"{NOISE_FACTOR:g}x that noise")
        return found

    def batch_axis(self, site: str, tensor: torch.Tensor) -> int | None:
        axes = [a for a, size in enumerate(tensor.shape) if size == self.batch]
        if not axes:
            return None
        if len(axes) > 1:
            self.ambiguous.setdefault(site, tuple(tensor.shape))
        return self.axis if self.axis in axes else axes[0]

    def check(self, call: _Call) -> _SiteResult:
        result = _SiteResult()
        leaves: list[torch.Tensor] = []
        template = _template((call.args, call.kwargs), leaves)
        in_axes = {i: self.batch_axis(call.site, t) for i, t in enumerate(leaves)}
        in_axes = {i: a for i, a in in_axes.items() if a is not None}
        if not in_axes:
            result.untested = "no argument has a batch axis"
            return result
        site = _Site(self, call, template, leaves, in_axes)
        try:
            site.run_tests(result)
        except Exception as exc:  # a module that cannot be called on its own
            result.evidence.clear()
            result.untested = (f"calling it again on its recorded arguments raised "
                               f"{type(exc).__name__}: {_first_line(exc)}")
        finally:
            site.buffers.restore()
        return result


class _Site:
    """The tests of one site: a base run, then per split a gradient test and a perturbed run."""

    def __init__(self, checker: _Checker, call: _Call, template: Any,
                 leaves: list[torch.Tensor], in_axes: dict[int, int]) -> None:
        self.checker, self.call, self.template = checker, call, template
        self.leaves, self.in_axes = leaves, in_axes
        self.buffers = _Buffers(call.module)
        self.devices = _cuda_devices(call.module) or sorted(
            {t.device.index or 0 for t in leaves if t.is_cuda})
        self._noise: tuple[list[float], dict[int, float]] | None = None

    def run(self, leaves: Sequence[torch.Tensor]) -> _Run:
        """Call the module on these arguments; floating batched ones become grad leaves."""
        grads: dict[int, torch.Tensor] = {}
        given = list(leaves)
        for i in self.in_axes:
            if given[i].is_floating_point():
                grads[i] = given[i].detach().clone().requires_grad_(True)
                given[i] = grads[i].clone()  # an in-place op in the module may change it
        args, kwargs = _fill(self.template, given)
        self.buffers.fresh()
        # the same dropout masks every run
        with rng.seeded(self.checker.seed, self.devices), torch.enable_grad():
            output = self.call.module(*args, **kwargs)
        return _Run(_tensors(output), grads)

    def run_tests(self, result: _SiteResult) -> None:
        checker, site = self.checker, self.call.site
        base = self.run(self.leaves)
        self.out_axes = {k: checker.batch_axis(site, t) for k, t in enumerate(base.outputs)}
        self.out_axes = {k: a for k, a in self.out_axes.items() if a is not None}
        if not self.out_axes:
            result.untested = "no output has a batch axis"
            return
        self.base = base
        self.graded = [k for k in self.out_axes if base.outputs[k].requires_grad
                       and base.outputs[k].is_floating_point()]
        can_grad = bool(self.graded and base.leaves)
        generator = torch.Generator().manual_seed(self.checker.seed)
        self.cotangent = {k: torch.randn(base.outputs[k].shape, generator=generator,
                                         dtype=base.outputs[k].dtype).to(base.outputs[k].device)
                          for k in self.graded}
        self.base_grads = self.gradients(base, self.cotangent) if can_grad else {}
        result.ran.add(MixTest.PERTURBATION)
        if can_grad:
            result.ran.update((MixTest.GRADIENT, MixTest.BACKWARD))
        for observed, varied in checker.splits:
            if MixTest.PERTURBATION in result.evidence and (
                    MixTest.GRADIENT in result.evidence or not can_grad):
                break  # nothing more to learn
            if can_grad and MixTest.GRADIENT not in result.evidence:
                found = self.gradient_test(observed, varied)
                if found:
                    result.evidence[MixTest.GRADIENT] = found
            if MixTest.PERTURBATION in result.evidence:
                continue  # the forward mixes: the backward test has nothing more to say
            changed = self.perturbed(varied)
            found = self.forward_test(changed, observed, varied)
            if found:
                result.evidence[MixTest.PERTURBATION] = found
                result.evidence.pop(MixTest.BACKWARD, None)
            elif can_grad and MixTest.BACKWARD not in result.evidence:
                found = self.backward_test(changed, observed, varied)
                if found:
                    result.evidence[MixTest.BACKWARD] = found

    # the three tests

    def gradient_test(self, observed: list[int], varied: list[int]) -> Evidence | None:
        base = self.base
        cotangent = {k: g * self.mask(g, self.out_axes[k], observed)
                     for k, g in self.cotangent.items()}
        grads = self.gradients(base, cotangent)
        leak, own, affected = 0.0, 0.0, set()
        for i, grad in grads.items():
            axis = self.in_axes[i]
            per_sample = _sample_max(grad, axis)
            own = max(own, max(per_sample[j] for j in observed))
            for j in varied:
                if per_sample[j] > 0:
                    affected.add(j)
                    leak = max(leak, per_sample[j])
        if not affected:
            return None
        return Evidence(MixTest.GRADIENT, observed, varied, sorted(affected),
                        leak / own if own > 0 else math.inf)

    def forward_test(self, changed: _Run, observed: list[int],
                     varied: list[int]) -> Evidence | None:
        noise = None
        affected, size = set(), 0.0
        for k, axis in self.out_axes.items():
            ref = self.base.outputs[k]
            other = changed.outputs[k] if k < len(changed.outputs) else None
            if other is None or other.shape != ref.shape:
                return Evidence(MixTest.PERTURBATION, observed, varied, list(observed), math.inf)
            diff = _sample_diff(ref, other, axis)
            if not any(diff[j] > 0 for j in observed):
                continue
            noise = noise if noise is not None else self.noise()[0]
            scale = max(_sample_max(ref, axis)[j] for j in observed)
            for j in observed:
                if diff[j] > NOISE_FACTOR * noise[k]:
                    affected.add(j)
                    size = max(size, diff[j] / scale if scale > 0 else math.inf)
        if not affected:
            return None
        return Evidence(MixTest.PERTURBATION, observed, varied, sorted(affected), size)

    def backward_test(self, changed: _Run, observed: list[int],
                      varied: list[int]) -> Evidence | None:
        cotangent = {k: self.vary(g, self.out_axes[k], varied)
                     for k, g in self.cotangent.items()}
        grads = self.gradients(changed, cotangent)
        noise = None
        affected, size = set(), 0.0
        for i, ref in self.base_grads.items():
            axis = self.in_axes[i]
            diff = _sample_diff(ref, grads[i], axis)
            if not any(diff[j] > 0 for j in observed):
                continue
            noise = noise if noise is not None else self.noise()[1]
            scale = max(_sample_max(ref, axis)[j] for j in observed)
            for j in observed:
                if diff[j] > NOISE_FACTOR * noise.get(i, 0.0):
                    affected.add(j)
                    size = max(size, diff[j] / scale if scale > 0 else math.inf)
        if not affected:
            return None
        return Evidence(MixTest.BACKWARD, observed, varied, sorted(affected), size)

    # helpers

    def perturbed(self, varied: list[int]) -> _Run:
        leaves = list(self.leaves)
        for i, axis in self.in_axes.items():
            leaves[i] = self.vary(leaves[i], axis, varied)
        return self.run(leaves)

    def vary(self, tensor: torch.Tensor, axis: int, varied: list[int]) -> torch.Tensor:
        """Each varied sample j replaced by sample j+1 (valid tokens, masks and values)."""
        batch = self.checker.batch
        index = torch.tensor(varied, device=tensor.device)
        source = torch.tensor([(j + 1) % batch for j in varied], device=tensor.device)
        return tensor.detach().index_copy(axis, index, tensor.detach().index_select(axis,
                                                                                    source))

    def mask(self, tensor: torch.Tensor, axis: int, keep: list[int]) -> torch.Tensor:
        mask = torch.zeros(self.checker.batch, dtype=tensor.dtype, device=tensor.device)
        mask[keep] = 1
        shape = [1] * tensor.dim()
        shape[axis] = self.checker.batch
        return mask.view(shape)

    def gradients(self, run: _Run, cotangent: dict[int, torch.Tensor]
                  ) -> dict[int, torch.Tensor]:
        """The gradients on the run's leaves of <cotangent, outputs>; zeros where none flows."""
        keys = list(run.leaves)
        outputs = [run.outputs[k] for k in cotangent]
        found = torch.autograd.grad(outputs, [run.leaves[i] for i in keys],
                                    list(cotangent.values()), retain_graph=True,
                                    allow_unused=True)
        return {i: torch.zeros_like(run.leaves[i]) if g is None else g
                for i, g in zip(keys, found, strict=True)}

    def noise(self) -> tuple[list[float], dict[int, float]]:
        """Run-to-run difference of the outputs and input gradients on the same arguments."""
        if self._noise is None:
            again = self.run(self.leaves)
            outputs = [_largest_diff(a, b) for a, b in zip(self.base.outputs, again.outputs,
                                                            strict=False)]
            grads = {}
            if self.base_grads:
                repeat = self.gradients(again, self.cotangent)
                grads = {i: _largest_diff(g, repeat[i]) for i, g in self.base_grads.items()}
            if any(outputs) or any(grads.values()):
                self.checker.noisy.append(self.call.site)
            self._noise = (outputs, grads)
        return self._noise


def _sample_max(tensor: torch.Tensor, axis: int) -> list[float]:
    """Each sample's largest finite magnitude."""
    values = tensor.detach().double().abs()
    values = torch.where(torch.isfinite(values), values, torch.zeros_like(values))
    return values.movedim(axis, 0).reshape(values.shape[axis], -1).amax(dim=1).tolist()


def _sample_diff(a: torch.Tensor, b: torch.Tensor, axis: int) -> list[float]:
    """Each sample's largest difference; equal NaNs and equal infinities count as equal, a
    value that became non-finite (or finite) as an infinite difference."""
    a, b = a.detach(), b.detach()
    if not (a.is_floating_point() or a.is_complex()):
        diff = (a != b).double()
    else:
        a, b = a.double(), b.double()
        same = (a == b) | (torch.isnan(a) & torch.isnan(b))
        diff = torch.where(same, torch.zeros_like(a), (a - b).abs())
        diff = torch.where(torch.isnan(diff), torch.full_like(diff, math.inf), diff)
    return diff.movedim(axis, 0).reshape(diff.shape[axis], -1).amax(dim=1).tolist()


def _largest_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape or a.dim() == 0:
        return 0.0 if a.shape == b.shape and torch.equal(a, b) else math.inf
    return max(_sample_diff(a.reshape(1, -1), b.reshape(1, -1), 0))


# ---- from site results to findings


def _classify(calls: list[_Call], results: dict[str, _SiteResult],
              allow: Sequence[str]) -> tuple[list[Mixing], list[Mixing]]:
    by_site = {call.site: call for call in calls}
    flagged = [call for call in calls if results[call.site].evidence]
    inside: dict[str, list[str]] = {call.site: [] for call in flagged}
    for call in flagged:
        parent = call.parent
        while parent:
            if parent in inside:
                inside[parent].append(call.site)
            parent = by_site[parent].parent
    allowed: dict[str, Mixing] = {}
    mixing: dict[str, Mixing] = {}
    for call in sorted(flagged, key=lambda c: -c.depth):  # the innermost first
        entry = _entry(call, results[call.site])
        reason = _allowed(call, allow)
        held = inside[call.site]
        if not reason and held and all(site in allowed for site in held):
            reason = f"holds only mixing by design ({', '.join(held[:3])})"
        if reason:
            entry.allowed = reason
            allowed[call.site] = entry
        else:
            entry.holds = [site for site in held if site in mixing]
            mixing[call.site] = entry
    order = {call.site: call.order for call in calls}
    return (sorted(mixing.values(), key=lambda m: order[m.site]),
            sorted(allowed.values(), key=lambda m: order[m.site]))


def _entry(call: _Call, result: _SiteResult) -> Mixing:
    evidence = result.evidence
    if MixTest.PERTURBATION in evidence:
        pass_, order = schema.Pass.FORWARD, (MixTest.PERTURBATION, MixTest.GRADIENT)
    else:
        pass_, order = schema.Pass.BACKWARD, (MixTest.BACKWARD, MixTest.GRADIENT)
    return Mixing(call.site, call.path, type(call.module).__name__, pass_,
                  [evidence[test] for test in order if test in evidence])


def _allowed(call: _Call, allow: Sequence[str]) -> str:
    module = call.module
    if isinstance(module, nn.modules.batchnorm._BatchNorm) and (
            module.training or not module.track_running_stats):
        return "batch norm in training mode: it normalizes with the batch's statistics"
    for pattern in allow:
        if fnmatch.fnmatchcase(call.site, pattern) or fnmatch.fnmatchcase(call.path, pattern):
            return f"allowed by {pattern!r}"
    return ""


# ---- text


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    # a reason kept in the JSON: one line, at most 100 characters
    return (text[0] if len(text[0]) <= 100 else text[0][:97] + "...") if text else ""


def samples_said(indices: Sequence[int]) -> str:
    """'0, 1, 2 ... (40 in all)': the first few sample indices."""
    shown = ", ".join(str(i) for i in indices[:SHOWN_SAMPLES])
    return shown + (f" ... ({len(indices)} in all)" if len(indices) > SHOWN_SAMPLES else "")
