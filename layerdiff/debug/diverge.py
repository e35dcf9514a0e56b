"""``diverge``: train reference and port side by side from the same weights, find the first step
where anything differs, and diff that step in full.

Why two phases: a bug that shows only after some steps (a learning-rate schedule, a clipping
rule, an optimizer detail, drift) needs many steps to appear, and recording every tensor of
every step costs memory and disk in proportion. So:

1. Both cases run ``steps`` optimizer steps under a *summary* capture (statistics only: min,
   max, mean, std, L2 norm and NaN/Inf counts of every record, the loss among them, no tensor
   data), the port starting from the reference's weights. The summary diff of the two finds
   ``first_step``, the first step with any record out of tolerance. Where the mapping names
   code, the tensor data that code reads is kept too, and only that (:func:`data_needed`: the
   inputs of the sites a call adapter rebuilds, the parameters a conversion makes).
2. Both run again from the same starting point up to ``first_step``, recording that step alone
   in full (``capture(..., record_steps={k})``), and the full diff of that step names the
   origin. Weights are recorded at the start of each step, so an origin that is a weight at
   step k > 0 while every record of step k-1 (its gradients included) agreed is the optimizer
   update that ended step k-1: a learning rate, its schedule, momentum, weight decay, clipping.
3. When ``first_step`` > 0, the update that ended the step before is rerun in the port's
   optimizer from the reference's weights, gradients and optimizer state
   (:mod:`layerdiff.debug.optimizer_update`). Where it makes another update, the cause is
   ``optimizer`` even when the weights it makes are still within tolerance and the first
   record out is a forward output (a weight decay of lr*wd = 1e-5 stays inside float32's
   tolerance on a weight near 1): the evidence says which parameters and param groups differ
   and how (weight decay, step size, direction). ``forward`` and ``backward`` are left for a
   step whose update was the reference's.

What "out of tolerance" means over many steps: two correct float32 implementations do not stay
within float32 rounding of each other for long. Training amplifies rounding: Adam turns a
gradient element that is zero up to rounding into a full step of +-lr whose sign is the
rounding's, and every later step compounds it. So by default (``golden``) the reference also
runs in float64 from the same weights, and each record of the port may differ from the
reference by up to ``FACTOR`` (4) times what float32 rounding alone moved the reference there
(the float64 run used as the diff's *baseline*, :mod:`layerdiff.compare.baseline`), or by
its per-dtype tolerance where that is looser: a correct port stays inside, a bug leaves it.
``golden=False`` judges every step by the per-dtype tolerances alone (right for a few steps of
SGD; too strict for long Adam runs).

The port gets the reference's weights through ``mapping`` (:func:`layerdiff.weights.
load_weights_from`), as ``capture --weights-from`` does. A port that records itself
(:class:`layerdiff.ExternalCase`) sets its own weights; its step k is captured with the steps
before it (it cannot record only some), and those earlier records are left out of the pairing.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import tempfile
import time
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from layerdiff.capture import capture
from layerdiff.capture.modules import module_paths
from layerdiff.capture.torch_capture import weights_meta
from layerdiff.case import Case, ExternalCase, is_case, load_case
from layerdiff.compare import diff
from layerdiff.compare.hints.attach import attach_hints
from layerdiff.compare.judge import PASSING
from layerdiff.compare.origins import find_origins
from layerdiff.compare.pair import PairReader
from layerdiff.compare.result import Column, Diff, Origin
from layerdiff.compare.suggest import diff_options
from layerdiff.compare.tolerances import Tolerances
from layerdiff.debug.optimizer_update import UpdateEvidence, compare_update
from layerdiff.errors import CaptureError, CaseError, LayerdiffError
from layerdiff.framework import Framework, framework_of
from layerdiff.mapping import Mapping
from layerdiff.outputs import make_folder
from layerdiff.trace import open_trace, schema
from layerdiff.trace.schema import Pass, Role
from layerdiff.weights import as_mapping, load_weights_from, port_tensors

# Measured: the planted optimizer bugs (a schedule one step early, Adam's L2 for AdamW's decay)
# move 37-100% of a weight's elements out of tolerance; Adam amplifying near-zero gradients of
# a correct port (the large transformer, step 1) moved 0.03%.
SPARSE_UPDATE = 0.01


class Cause(StrEnum):
    """Where the first difference was made, from the kind of record its origin is."""

    LOAD = "load"              # weights differ at step 0: the port did not get the reference's
    OPTIMIZER = "optimizer"    # weights differ after an update made from gradients that agreed
    FORWARD = "forward"
    BACKWARD = "backward"
    UNKNOWN = "unknown"        # records out of tolerance, but no origin among them


@dataclass
class StepRow:
    """One step of the side-by-side run: the two losses and how far the statistics are apart."""

    step: int
    loss_reference: float | None
    loss_port: float | None
    out: int               # records out of tolerance (judged by their statistics)
    worst: float | None    # the largest error over tolerance among the step's records
    loss_golden: float | None = None   # the reference's loss in float64

    def as_json(self) -> dict[str, Any]:
        return {"step": self.step, "loss_reference": _finite(self.loss_reference),
                "loss_port": _finite(self.loss_port),
                "loss_golden": _finite(self.loss_golden), "out": self.out,
                "worst": _finite(self.worst)}


@dataclass
class DivergeResult:
    """What :func:`diverge` found. ``found`` is true when some step differs."""

    reference: str
    port: str
    steps: int
    first_step: int | None
    per_step: list[StepRow]
    cause: Cause | None
    explanation: str
    summary_diff: Diff
    step_diff: Diff | None
    traces: dict[str, Path]
    seconds: dict[str, float] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    # the update that ended step first_step - 1, rerun from the reference's inputs
    optimizer_update: UpdateEvidence | None = None
    notes: list[str] = field(default_factory=list)  # how it ran (data kept for the mapping)
    # the diff of the first diverging step's traces, with every option it needs (the mapping)
    step_command: str = ""

    @property
    def found(self) -> bool:
        return self.first_step is not None

    @property
    def origin(self) -> Origin | None:
        return self.step_diff.origin if self.step_diff is not None else None

    @property
    def origins(self) -> list[Origin]:
        return list(self.step_diff.origins) if self.step_diff is not None else []

    @property
    def optimizer_step(self) -> int | None:
        """The step whose optimizer update made the first wrong weights, when that is the cause."""
        return self.first_step - 1 if self.cause == Cause.OPTIMIZER else None

    @property
    def golden(self) -> bool:
        """Whether the port was judged against the band of a float64 run of the reference."""
        return "golden_summary" in self.traces

    @property
    def losses(self) -> dict[str, list[float | None]]:
        losses = {"reference": [row.loss_reference for row in self.per_step],
                  "port": [row.loss_port for row in self.per_step]}
        if self.golden:
            losses["golden"] = [row.loss_golden for row in self.per_step]
        return losses

    def as_json(self) -> dict[str, Any]:
        step = self.step_diff
        return {
            "found": self.found,
            "reference": self.reference,
            "port": self.port,
            "steps": self.steps,
            "golden": self.golden,
            "first_step": self.first_step,
            "cause": None if self.cause is None else str(self.cause),
            "optimizer_step": self.optimizer_step,
            "explanation": self.explanation,
            "origin": self.origin.as_json() if self.origin else None,
            "origins": [origin.as_json() for origin in self.origins],
            "per_step": [row.as_json() for row in self.per_step],
            "losses": {side: [_finite(v) for v in values]
                       for side, values in self.losses.items()},
            "step_diff": None if step is None else {
                "verdict": step.verdict, "first_failing_step": step.first_failing_step,
                "rows": len(step.rows), "failing": len(step.failing())},
            "optimizer_update": (None if self.optimizer_update is None
                                 else self.optimizer_update.as_json()),
            "traces": {name: str(path) for name, path in self.traces.items()},
            "seconds": {name: round(value, 3) for name, value in self.seconds.items()},
            "warnings": list(self.warnings),
            "notes": list(self.notes),
            "step_command": self.step_command or None,
        }


def diverge(reference: Case | str, port: Case | ExternalCase | str, *,
            mapping: str | os.PathLike | Mapping | None = None, steps: int,
            tolerances: str | os.PathLike | Tolerances | None = None,
            output_dir: str | os.PathLike | None = None, golden: bool = True,
            progress: bool = False) -> DivergeResult:
    """Run ``reference`` and ``port`` (cases or ``package.module:name`` specs) for ``steps``
    optimizer steps from the reference's weights, find the first step where any record differs
    beyond tolerance, and diff that step in full; see the module docstring.

    ``mapping`` pairs names that differ (used to load the weights and to pair records);
    ``tolerances`` overrides the per-dtype defaults (a rule in it wins over the golden band).
    ``golden`` runs the reference in float64 too and allows each record the rounding drift it
    shows (see the module docstring). The traces are written to ``output_dir`` (a new temporary
    folder when None, kept so that the step can be examined). ``progress`` shows each
    capture's progress bar. The cases' models are trained in place and restored to their
    starting weights before each later run.
    """
    started = time.perf_counter()
    ref_case = _as_case(reference)
    port_case = _as_case(port)
    port_framework = _refuse(ref_case, port_case, steps)
    out = make_folder(output_dir if output_dir is not None else tempfile.mkdtemp(
        prefix="layerdiff-diverge-"), "-o")
    warnings: list[str] = []
    extra_meta = _load_port_weights(ref_case, port_case, mapping, warnings)
    starts = {side: _snapshot(case) for side, case in (("reference", ref_case),
                                                        ("port", port_case))}
    seconds: dict[str, float] = {}

    # Phase 1: statistics of every record of every step, and tensor data where the mapping's
    # code must read it (the inputs a call adapter rebuilds, the parameters a conversion makes)
    data = data_needed(ref_case, port_case, mapping)
    notes = [data.note] if data.note else []
    traces = {"reference_summary": out / "reference.summary.h5",
              "port_summary": out / "port.summary.h5"}
    capture(ref_case, traces["reference_summary"], steps=steps, progress=progress,
            **data.options("reference"))
    if golden:
        traces["golden_summary"] = out / "golden.summary.h5"
        golden = _golden(ref_case, starts["reference"], traces, "golden_summary", warnings,
                         steps=steps, progress=progress, **data.options("reference"))
    capture(port_case, traces["port_summary"], steps=steps, progress=progress,
            extra_meta=extra_meta, **data.options("port"))
    summary = _diff(traces, "reference_summary", "port_summary", "golden_summary", mapping,
                    tolerances, warnings)
    per_step = _per_step(summary, traces, steps)
    first = summary.first_failing_step
    seconds["statistics"] = time.perf_counter() - started
    if first is None:
        return DivergeResult(ref_case.name, port_case.name, steps, None, per_step, None, "",
                             summary, None, traces, seconds, warnings, notes=notes)

    # Phase 2: the first diverging step, in full, from the same start.
    phase2 = time.perf_counter()
    for side, case in (("reference", ref_case), ("port", port_case)):
        _restore(case, starts[side])
    _capture_step(ref_case, port_case, first, out, traces, golden and starts["reference"],
                  warnings, progress, extra_meta)
    step_diff = _diff(traces, "reference_step", "port_step", "golden_step", mapping,
                      tolerances, warnings)
    _drop_earlier_steps(step_diff, first)
    seconds["first step in full"] = time.perf_counter() - phase2
    update = None
    if first > 0 and not port_framework.records_itself:
        rerun = time.perf_counter()
        update = _rerun_update(ref_case, port_case, starts, mapping, first - 1, warnings)
        seconds["update rerun"] = time.perf_counter() - rerun
    step_command = shlex.join(["layerdiff", "diff", str(traces["reference_step"]),
                               str(traces["port_step"]), *diff_options(mapping, tolerances),
                               "--verbose"])
    cause, explanation = _explain(step_diff, first, update)
    if step_diff.first_failing_step is None:
        warnings.append(f"the statistics of step {first} are out of tolerance but its full "
                        "records are not: a reduction-order difference at the edge of "
                        "tolerance, or a run that is not deterministic")
    return DivergeResult(ref_case.name, port_case.name, steps, first, per_step, cause,
                         explanation, summary, step_diff, traces, seconds, warnings, update,
                         notes, step_command)


@dataclass
class DataPlan:
    """What the statistics phase keeps tensor data for, per side: the modules whose records a
    diff through the mapping's code reads element by element (``None``: none, a summary
    capture; ``"all"``: a full capture, where a side cannot keep data for some modules only)."""

    reference: frozenset[str] | str | None = None
    port: frozenset[str] | str | None = None
    why: list[str] = field(default_factory=list)   # what needs data, for the note
    note: str = ""                                 # one line for the user, when data is kept

    def options(self, side: str) -> dict[str, Any]:
        """The capture options of ``side``'s statistics run."""
        kept = getattr(self, side)
        if kept is None:
            return {"summary": True}
        if kept == "all":
            return {"summary": False}
        return {"summary": False, "data_modules": sorted(kept)}


def data_needed(reference: Case, port: Case | ExternalCase,
                mapping: str | os.PathLike | Mapping | None) -> DataPlan:
    """The modules whose records the statistics phase must keep in full for the diff through
    ``mapping``'s code: a call adapter rebuilds the port's call from the reference's recorded
    arguments and compares what it makes with the port's recorded inputs (both sides' inputs
    of the sites it names); a conversion makes the port's parameter from the reference's
    tensors (the modules owning both). Statistics cannot stand in for either. A side that
    cannot keep data for some modules only (a port that records itself, a Flax model) is
    captured in full, and the note says so."""
    rules = as_mapping(mapping)
    if not rules.code_refs():
        return DataPlan()
    ref_paths = module_paths(reference.model)
    port_paths = (module_paths(port.model) if framework_of(port).name == "torch"
                  else None)
    ref_keep: set[str] = set()
    port_keep: set[str] = set()
    adapted, converted, outputs = set(), set(), set()
    # [[site]] rules with call = ... or an output conversion (a function of the port's outputs,
    # and the reference's inputs, cannot be applied to statistics)
    for path in ref_paths:
        rule = rules.site_rule(path)
        if rule is None or (rule.call is None and rule.output_transform is None):
            continue
        ref_keep.add(path)
        if rule.call is not None:
            adapted.add(rule.call.spec)
        if rule.output_transform is not None:
            outputs.add(rule.output_transform.spec)
        renamed = rules.rename(path)
        if renamed is not None:
            port_keep.add(renamed[0])
    # [[pair]] rules with call = ... or an output conversion
    pair_rules = [(site, code.spec, adapted) for site, code in rules.pair_calls.items()]
    pair_rules += [(site, conversion.spec, outputs)
                   for site, conversion in rules.pair_output_transforms.items()]
    for ref_site, spec, found in pair_rules:
        ref_keep.add(schema.split_site(ref_site)[0])
        port_keep.add(schema.split_site(rules.pairs[ref_site])[0])
        found.add(spec)
    if port_paths is not None:  # [[param]] rules whose chain names a function
        partner = rules.module_partners(port_paths, ref_paths)
        for name in port_tensors(port.model):
            source = rules.param_source(name, partner)
            if source is None or not source.functions:
                continue
            converted.update(source.functions)
            port_keep.add(name.rpartition(".")[0] or schema.ROOT_MODULE)
            ref_keep.update(ref.rpartition(".")[0] or schema.ROOT_MODULE
                            for ref in source.reference)
    ref_keep &= set(ref_paths)
    what = ([f"the inputs of the sites call adapter{'s' if len(adapted) > 1 else ''} "
             f"{', '.join(sorted(adapted))} rebuild{'' if len(adapted) > 1 else 's'}"]
            if adapted else []) + (
        [f"the parameters conversion{'s' if len(converted) > 1 else ''} "
         f"{', '.join(sorted(converted))} make{'' if len(converted) > 1 else 's'}"]
        if converted else []) + (
        [f"the outputs output conversion{'s' if len(outputs) > 1 else ''} "
         f"{', '.join(sorted(outputs))} take{'' if len(outputs) > 1 else 's'}"]
        if outputs else [])
    if not ref_keep and not port_keep:
        return DataPlan()
    plan = DataPlan(frozenset(ref_keep),
                    "all" if port_paths is None else frozenset(port_keep & set(port_paths)),
                    what)
    if port_paths is None:
        plan.note = (f"the port keeps all its tensor data in the statistics run (it records "
                     f"itself or is no torch model, so it cannot keep some only); the mapping's "
                     f"code reads {' and '.join(what)}")
    else:
        plan.note = (f"the statistics runs keep tensor data of {len(plan.reference)} reference "
                     f"and {len(plan.port)} port modules: the mapping's code reads "
                     f"{' and '.join(what)}")
    return plan


def _rerun_update(ref: Case, port: Case, starts: dict[str, Any],
                  mapping: str | os.PathLike | Mapping | None, step: int,
                  warnings: list[str]) -> UpdateEvidence | None:
    """The update that ended ``step``, rerun from the reference's inputs; None (with a
    warning) where an optimizer does not let itself be rerun so: the cause is then read from
    the records alone."""
    try:
        return compare_update(ref, port, starts, mapping, step)
    except (LayerdiffError, RuntimeError, ValueError, TypeError, KeyError,
            AttributeError) as exc:  # an optimizer that is not torch's kind
        warnings.append(f"the optimizer update that ended step {step} could not be rerun from "
                        f"the reference's weights, gradients and state ({type(exc).__name__}: "
                        f"{exc}); the cause is read from the records alone")
        return None


# ---- the cases and their weights


def _refuse(ref_case: Case, port_case: Case | ExternalCase, steps: int) -> Framework:
    """One sentence for cases diverge cannot train; the port's framework otherwise."""
    if framework_of(ref_case).name != "torch":
        raise CaseError(f"reference {ref_case.name} is {framework_of(ref_case).title}; diverge "
                        "runs the reference as a torch module: give a torch reference case")
    port_framework = framework_of(port_case)
    if not port_framework.records_itself and port_framework.name != "torch":
        # its weights are loaded, snapshot and restored as a torch module's state_dict here
        raise CaseError(f"port {port_case.name} is {port_framework.title}, which diverge does not "
                        "train yet (it sets and restores a port's weights as a torch "
                        f"module's); capture both for --steps {steps} (the port with "
                        "--weights-from REF.h5 and its --map) and diff the two traces, whose "
                        "first failing step is the one diverge would name")
    if steps < 1:
        raise CaseError(f"--steps must be at least 1 (got {steps}) to diverge {port_case.name} "
                        f"from {ref_case.name}")
    return port_framework


def _capture_step(ref_case: Case, port_case: Case | ExternalCase, first: int, out: Path,
                  traces: dict[str, Path], golden_start: dict[str, torch.Tensor] | bool,
                  warnings: list[str], progress: bool, extra_meta: dict[str, Any]) -> None:
    """Phase 2's traces: step ``first`` in full, from the same start (the float64 reference
    too, from ``golden_start``, unless it is False)."""
    traces["reference_step"] = out / f"reference.step{first}.h5"
    traces["port_step"] = out / f"port.step{first}.h5"
    capture(ref_case, traces["reference_step"], steps=first + 1, record_steps={first},
            progress=progress)
    if golden_start is not False:
        traces["golden_step"] = out / f"golden.step{first}.h5"
        _golden(ref_case, golden_start, traces, "golden_step", warnings,
                steps=first + 1, record_steps={first}, progress=progress)
    if framework_of(port_case).records_itself:  # all its steps: it cannot record only some
        capture(port_case, traces["port_step"], steps=first + 1, progress=progress)
    else:
        capture(port_case, traces["port_step"], steps=first + 1, record_steps={first},
                progress=progress, extra_meta=extra_meta)


def _as_case(given: Case | ExternalCase | str) -> Case | ExternalCase:
    if isinstance(given, str):
        return load_case(given)
    if not is_case(given):
        raise CaseError(f"diverge takes cases or package.module:name specs, got "
                        f"{type(given).__name__}")
    return given


def _load_port_weights(ref: Case, port: Case | ExternalCase,
                       mapping: str | os.PathLike | Mapping | None,
                       warnings: list[str]) -> dict[str, Any]:
    """Give the port the reference's starting weights; what its traces' meta records of it."""
    if framework_of(port).records_itself:
        warnings.append(f"port {port.name} records itself, so it sets its own weights: they "
                        "are compared at step 0 like every other record")
        return {}
    state = {name: tensor.detach().cpu().float().numpy().copy()
             if tensor.dtype == torch.bfloat16 else tensor.detach().cpu().numpy().copy()
             for name, tensor in ref.model.state_dict().items()}
    report = load_weights_from(port.model, state, mapping, source=f"reference {ref.name}")
    if report.unused:
        warnings.append(report.summary())
    if mapping is None or isinstance(mapping, Mapping):
        return {"weights": {"from": f"case {ref.name}", "mapping": None}}
    return weights_meta(f"case {ref.name}", mapping)


def _golden(case: Case, start: dict[str, torch.Tensor], traces: dict[str, Path], key: str,
            warnings: list[str], **options: Any) -> bool:
    """Capture ``case`` from ``start`` in float64 into ``traces[key]``; False (with a warning,
    and ``key`` taken out of ``traces``) when the model cannot run in float64."""
    _restore(case, start)
    try:
        with _float64(case):
            capture(case, traces[key], extra_meta={"dtype": "float64", "golden": True},
                    **options)
    except CaptureError as exc:
        warnings.append(f"the reference cannot run in float64 ({exc}); every record is judged "
                        "by the per-dtype tolerances instead (golden=False)")
        traces.pop(key).unlink(missing_ok=True)
        return False
    finally:
        _restore(case, start)
    return True


@contextlib.contextmanager
def _float64(case: Case):
    """The case's floating parameters, buffers and inputs in float64, put back afterwards
    (the same tensor objects, so that nothing holding them is left behind)."""
    model = case.model
    tensors = [t for t in (*model.parameters(), *model.buffers()) if t.is_floating_point()]
    dtypes = [t.dtype for t in tensors]
    inputs = case.inputs
    try:
        for tensor in tensors:
            tensor.data = tensor.data.to(torch.float64)
        case.inputs = _inputs_as(inputs, torch.float64)
        yield
    finally:
        for tensor, dtype in zip(tensors, dtypes, strict=True):
            tensor.data = tensor.data.to(dtype)
            tensor.grad = None
        case.inputs = inputs


def _inputs_as(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, (tuple, list)):
        return type(value)(_inputs_as(v, dtype) for v in value)
    if isinstance(value, dict):
        return {key: _inputs_as(v, dtype) for key, v in value.items()}
    return value


def _snapshot(case: Case | ExternalCase) -> dict[str, torch.Tensor] | None:
    """The model's parameters and buffers before training, to start phase 2 from them."""
    if framework_of(case).records_itself:
        return None  # it builds its model afresh on every run
    return {name: tensor.detach().clone() for name, tensor in case.model.state_dict().items()}


def _restore(case: Case | ExternalCase, state: dict[str, torch.Tensor] | None) -> None:
    if state is not None:
        case.model.load_state_dict(state, strict=True)


# ---- judging: the looser of the per-dtype tolerance and the golden band

# The columns of a diff row that follow from its tolerance (the rest is the data's).
TOLERANCE_COLUMNS = (Column.RATIO, Column.VERDICT, Column.RTOL, Column.ATOL, Column.TOL_SOURCE,
                     Column.RMS_TOL, Column.FRAC_OUT, Column.WORST_INDEX, Column.BATCH_RATIO)
ROW_KEY = [Column.STEP, Column.SEQ, Column.SITE, Column.ROLE, Column.ARG, Column.PORT_SITE,
           Column.PORT_ARG]


def _diff(traces: dict[str, Path], reference: str, port: str, golden: str,
          mapping: str | os.PathLike | Mapping | None,
          tolerances: str | os.PathLike | Tolerances | None, warnings: list[str]) -> Diff:
    """The port's trace against the reference's, each record by the looser of its per-dtype
    tolerance and the golden band (when there is a golden trace).

    Looser, not the band alone: the band is 4x the float64 run's error plus a few roundings and
    no absolute term, tighter than the per-dtype tolerance where the float64 run computes
    exactly what the float32 one does (a buffer such as a positional table is only cast); a
    record that ``layerdiff diff`` passes at step 0 must not diverge here."""
    plain = diff(traces[reference], traces[port], mapping=mapping, tolerances=tolerances)
    if golden not in traces:
        return plain
    banded = diff(traces[reference], traces[port], mapping=mapping, tolerances=tolerances,
                  baseline=traces[golden])
    rows, other = banded.rows.copy(), plain.rows
    if len(rows) != len(other) or not rows[ROW_KEY].equals(other[ROW_KEY]):
        warnings.append("the diffs with and without the golden band paired different records; "
                        "judged by the golden band alone")
        return banded
    passes, passes_plain = rows[Column.VERDICT].isin(PASSING), other[Column.VERDICT].isin(PASSING)
    ratio = pd.to_numeric(rows[Column.RATIO], errors="coerce").to_numpy(dtype=float)
    ratio_plain = pd.to_numeric(other[Column.RATIO], errors="coerce").to_numpy(dtype=float)
    looser = (ratio_plain < ratio) | (~passes & passes_plain)
    for position in np.flatnonzero(looser.to_numpy()):
        for column in TOLERANCE_COLUMNS:
            rows.at[position, column] = other.at[position, column]
    rows[Column.STATUS], rows[Column.CAUSE] = "", ""
    with open_trace(traces[reference]) as ref_trace, open_trace(traces[port]) as port_trace:
        # the same rule as the diff's: records it excuses (arguments the port does not take,
        # declared unmatched records) do not keep their site from being judged
        origins, first = find_origins(rows, ref_trace.sites, ref_index=ref_trace.index,
                                      **banded.judging)
        attach_hints(origins, PairReader(ref_trace, port_trace, banded.pairs))
    meta = dict(banded.meta)
    meta["judged"] = ("each record by the looser of its per-dtype tolerance and the golden "
                      "band (4x the float64 run's error)")
    return Diff(banded.reference, banded.port, rows, origins, banded.unmatched, first, meta,
                pairs=banded.pairs, judging=banded.judging)


# ---- reading the results


def _per_step(summary: Diff, traces: dict[str, Path], steps: int) -> list[StepRow]:
    rows = summary.rows
    ratios = rows[Column.RATIO].to_numpy(dtype=float)
    bad = ~rows[Column.VERDICT].isin(PASSING).to_numpy()
    step_of = rows[Column.STEP].to_numpy()
    ref_loss, port_loss = _losses(traces["reference_summary"]), _losses(traces["port_summary"])
    golden = _losses(traces["golden_summary"]) if "golden_summary" in traces else {}
    table = []
    for step in range(steps):
        here = step_of == step
        finite = ratios[here & np.isfinite(ratios)]
        worst = float(finite.max()) if finite.size else None
        if (here & bad & ~np.isfinite(ratios)).any():
            worst = math.inf
        table.append(StepRow(step, ref_loss.get(step), port_loss.get(step),
                             int((here & bad).sum()), worst, golden.get(step)))
    return table


def _losses(path: Path) -> dict[int, float]:
    """Each step's loss, from the trace's loss record (a scalar: its mean is its value)."""
    with open_trace(path) as trace:
        rows = trace.records(site=schema.LOSS_SITE, role=Role.OUTPUT)
        return {int(step): float(mean) for step, mean in zip(rows["step"], rows["mean"],
                                                             strict=True)}


def _drop_earlier_steps(step_diff: Diff, first: int) -> None:
    """A port that records itself captured the steps before ``first`` too: those records have
    no partner by design, not by mistake."""
    unmatched = step_diff.unmatched
    if not unmatched.empty:
        earlier = unmatched["step"].notna() & (unmatched["step"].fillna(first) < first)
        step_diff.unmatched = unmatched[~earlier].reset_index(drop=True)


def _explain(step_diff: Diff, first: int,
             update: UpdateEvidence | None = None) -> tuple[Cause, str]:
    """The cause, from the kind of record the origin is and, after step 0, from the update
    that ended the step before rerun from the reference's inputs (``update``): its optimizer
    is the cause when it makes another update from the same weights, gradients and state,
    whether or not the weights it makes already leave tolerance."""
    origin = step_diff.origin
    before = first - 1
    agreed = f"step {before}" if before == 0 else f"steps 0 to {before}"
    if update and (origin is None or origin.role != Role.WEIGHT):
        where = (f"; {origin.site} ({origin.pass_} {origin.role}) is where the difference "
                 "first leaves tolerance" if origin is not None else "")
        inputs = ("weights, gradients and state" if update.state_given
                  else "weights and gradients")
        return Cause.OPTIMIZER, (
            f"the weights at the start of step {first} are within tolerance but not the "
            f"reference's: the port's optimizer update that ended step {before} differs from "
            f"the reference's given the same {inputs} (below), while every record of {agreed} "
            f"agreed{where}")
    if origin is None:
        if step_diff.first_failing_step is None:
            return Cause.UNKNOWN, (f"step {first} differs in its statistics only; see the "
                                   "warning below")
        return Cause.UNKNOWN, (f"records of step {first} are out of tolerance but no origin "
                               "was found among them; see `layerdiff diff` of the step's traces")
    if origin.role == Role.WEIGHT and first > 0:
        text = (f"the weights at the start of step {first} differ while every record of "
                f"{agreed} agreed, the weight gradients of step {before} among them: "
                f"the optimizer update that ended step {before} differs")
        if update:
            return Cause.OPTIMIZER, text + " (below)"
        text += (" (its learning rate or schedule, momentum, weight decay, gradient clipping "
                 "or unscaling)")
        if update is not None:  # rerun, and it made the reference's update
            return Cause.OPTIMIZER, (
                text + f"; but given the reference's weights, gradients and state the port's "
                "optimizer makes the reference's update: the weights part because the "
                f"gradients of step {before}, within tolerance, differ and the optimizer "
                "magnifies that (Adam and RMSprop normalize each element), not by its rule")
        out = max((o.metrics.get("frac_out") or 0.0) for o in step_diff.origins
                  if o.role == Role.WEIGHT)
        if out < SPARSE_UPDATE:
            text += (f"; but at most {out:.2%} of any weight's elements differ: an optimizer "
                     "that normalizes each element (Adam, RMSprop) turns gradients that agreed "
                     "within tolerance but are near zero into whole steps of opposite sign, so "
                     "check that before suspecting the optimizer (a bug in it moves most "
                     "elements)")
        return Cause.OPTIMIZER, text
    if origin.role == Role.WEIGHT:
        return Cause.LOAD, ("the weights differ before anything ran: the port did not get the "
                            "reference's weights; check the mapping (layerdiff map-check)")
    rerun = (f"; the update that ended step {before}, rerun from the reference's weights, "
             "gradients and state, is the reference's" if update is not None else "")
    if origin.pass_ == Pass.FORWARD:
        return Cause.FORWARD, (
            f"{origin.site} computes a different forward value at step {first}"
            + (f" from the same weights and inputs, while {agreed} agreed: a "
               "difference that shows only on the weights or data of this step" + rerun
               if first > 0 else " from the same weights and inputs"))
    return Cause.BACKWARD, (
        f"{origin.site} computes a different gradient at step {first} from the same values"
        + (f", while {agreed} agreed" + rerun if first > 0 else ""))


# ---- JSON


def _finite(value: float | None) -> float | None:
    if value is None or not math.isfinite(value):
        return None
    return float(value)


__all__ = ["Cause", "DivergeResult", "StepRow", "diverge"]
