"""``find_nan``: run a case's training steps until the first NaN or Inf, and say where it came from.

How it stays cheap enough for thousands of steps: the capture's own module hooks
(:class:`layerdiff.capture.hooks.ModuleRecorder`, so sites, roles and the order of records are the
capture's) feed a stand-in for its stager that copies nothing: for each floating tensor it queues
one reduction, ``torch.aminmax``, whose result stays on the tensor's device. NaN propagates into
both ends and an Inf shows as one, so the pair says whether the tensor is finite and, when it is,
its range. The step's pairs are read back once, when the step ends (one device sync a step), after
the weights have been checked the same way once the optimizer has stepped. An input that is the
very tensor an earlier call returned, unchanged since (same object, same version counter), reuses
that output's pair instead of reducing it again.

The first non-finite record of the first failing step, in recording order, is ``first``. Where it
was made (``producer``) follows from which record it is, since every earlier record was finite:

- a forward output (or a backward ``grad_input`` / ``weight_grad``): the site itself made it from
  finite inputs (submodules' outputs are recorded before their container's);
- a forward input (or a backward ``grad_output``): no submodule made it, so the code of the
  enclosing site between its submodule calls did (the loss's backward for the model's own output
  gradient); the model's own input: the case's data;
- a weight after the optimizer step: the optimizer (or gradient clipping) made it from the finite
  weight and gradient of that step.

A port that records itself (:class:`layerdiff.ExternalCase`) is given a stand-in for its
:class:`layerdiff.TraceWriter` that checks each array as it is recorded; the weights it records at
a step's first call are the weights after the previous step's optimizer.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

import layerdiff.rng as rng
from layerdiff.capture.hooks import ModuleRecorder, select_modules
from layerdiff.capture.run import check_run_options, run_case
from layerdiff.capture.stage import dtype_name
from layerdiff.case import Case, ExternalCase, load_case
from layerdiff.compare import result as R
from layerdiff.compare.origins import Words
from layerdiff.debug.origin import Record, find_origin, origin_json, sites_frame
from layerdiff.errors import CaptureError, LayerdiffError
from layerdiff.framework import Framework, framework_of
from layerdiff.trace import schema
from layerdiff.trace.schema import COMPUTED_ROLES, PARAM_ROLES, RESULT_ROLES, Pass, Role
from layerdiff.trace.writer import site_scope

Progress = Callable[[int, int], None]  # (steps done, steps to run)
_DTYPE_NAMES = {t: dtype_name(t) for t in (torch.float32, torch.float64, torch.float16,
                                           torch.bfloat16)}
NON_FINITE = Words(
    "non-finite", "finite", "non-finite",
    ("the case's initial weights hold a NaN or Inf",
     "its weight is non-finite at step {step} while it was finite after the last optimizer "
     "step: something changed it in place"))


class NanPass(StrEnum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"   # the weights after the optimizer step (clipping included)


class NanKind(StrEnum):
    NAN = "nan"   # the tensor holds a NaN (perhaps Infs too)
    INF = "inf"   # Infs, no NaN


@dataclass(frozen=True)
class ValueRange:
    """One recorded tensor of the failing step and its range (non-finite ends are +-inf or NaN)."""

    site: str
    role: str
    arg: str
    min: float
    max: float
    shape: tuple[int, ...]
    dtype: str

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "role": self.role, "arg": self.arg,
                "min": _json_number(self.min), "max": _json_number(self.max),
                "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class FirstNonFinite:
    """The first non-finite record: ``site``, ``pass``, ``role``, ``step`` and ``kind``."""

    site: str
    pass_: str
    role: str
    arg: str
    step: int
    kind: str
    min: float          # NaN when the tensor holds a NaN
    max: float
    shape: tuple[int, ...]
    dtype: str

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "pass": self.pass_, "role": self.role, "step": self.step,
                "kind": self.kind, "arg": self.arg, "min": _json_number(self.min),
                "max": _json_number(self.max), "shape": list(self.shape), "dtype": self.dtype}


@dataclass(frozen=True)
class Producer:
    """The innermost site that made the first non-finite value from finite inputs.

    ``site`` is None when the value came in with the case itself (its inputs or its initial
    weights). ``inputs`` are the ranges of what it computed from, all finite. ``op`` is the
    tensor operation, when op-level capture can say (not yet: None).
    """

    site: str | None
    pass_: str
    type: str
    why: str
    inputs: tuple[ValueRange, ...] = ()
    op: str | None = None

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "pass": self.pass_, "type": self.type, "why": self.why,
                "inputs": [value.as_json() for value in self.inputs], "op": self.op}


@dataclass(frozen=True)
class NanOp:
    """The operation that made the first NaN, found by re-running the origin site's one call
    (its recorded arguments, its weights of that step) with every operation checked.

    ``primitive`` is the framework's operation (``log``, ``rsqrt``, ``div``), ``file``,
    ``line`` and ``function`` the source line that called it (the innermost frame outside the
    framework's own code), ``library`` the innermost frame when that lies in a library (a
    Flax layer's ``rsqrt``). When the re-run cannot name one, ``primitive`` is None and
    ``note`` says why."""

    site: str | None
    pass_: str
    primitive: str | None = None
    file: str | None = None
    line: int | None = None
    function: str | None = None
    library: str | None = None      # "file:line (function)" of the innermost frame
    how: str = ""                   # what re-ran it: "jax.experimental.checkify (nan_checks)"
    note: str = ""

    @property
    def where(self) -> str:
        """``model.py:41`` (the file's name only), or "" when no line is known."""
        if self.file is None:
            return ""
        return f"{Path(self.file).name}:{self.line}"

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "pass": self.pass_, "primitive": self.primitive,
                "file": self.file, "line": self.line, "function": self.function,
                "library": self.library, "how": self.how, "note": self.note}


@dataclass
class NanResult:
    """What ``find_nan`` found: true ``found`` when some value was NaN or Inf."""

    case: str
    steps: int                     # steps asked for
    steps_run: int                 # steps run: through the failing one when found
    first: FirstNonFinite | None
    producer: Producer | None
    seconds: float                 # in all, the case's setup (optimizer ...) included
    seconds_per_step: float = 0.0  # the steps alone
    records_per_step: int = 0      # tensors checked in the last step run
    trace: str | None = None       # the failing step's trace, when one was asked for
    notes: list[str] = field(default_factory=list)
    # the site whose own code made the first non-finite value, by the diff's origin rule
    origin: R.Origin | None = None
    # the operation and source line that made it, where the framework can say (Flax NNX)
    op: NanOp | None = None

    @property
    def found(self) -> bool:
        return self.first is not None

    def as_json(self) -> dict[str, Any]:
        return {"case": self.case, "found": self.found, "steps": self.steps,
                "steps_run": self.steps_run,
                "first": self.first.as_json() if self.first else None,
                "producer": self.producer.as_json() if self.producer else None,
                "origin": origin_json(self.origin),
                "op": self.op.as_json() if self.op else None,
                "seconds": round(self.seconds, 4),
                "seconds_per_step": round(self.seconds_per_step, 6),
                "records_per_step": self.records_per_step, "trace": self.trace,
                "notes": list(self.notes)}


def find_nan(case: Case | ExternalCase | str, steps: int | None = None, *,
             output: str | os.PathLike | None = None,
             progress: Progress | None = None) -> NanResult:
    """Run ``case``'s training steps (its own count unless ``steps``), optimizer included, until
    the first NaN or Inf in a forward value, a gradient, or a weight after the optimizer step.

    ``case`` is a :class:`layerdiff.Case`, a port that records itself, or a spec
    ``package.module:name``. Nothing is written unless ``output`` is given and something is
    found: the case is then run again from its start to the failing step, and that step alone is
    captured in full into ``output`` (as the trace's step 0, its meta ``nan.step`` saying which
    step it was) from the same weights, optimizer state and random state; a port that records
    itself is captured from its first step through the failing one. ``progress`` is called as
    ``progress(steps_done, steps_total)``. The case's model is trained in place, as
    :func:`layerdiff.run_case` does.
    """
    if isinstance(case, str):
        case = load_case(case)
    total = case.steps if steps is None else steps
    if output is not None:
        from layerdiff.trace.writer import check_writable

        check_writable(output)  # before the run, not after thousands of steps
    started = time.perf_counter()
    framework = framework_of(case)
    if framework.name == "torch":  # its watch hooks torch modules and runs torch steps
        check_run_options(case, total, 1.0)
        watch: _Watch = _TorchWatch(case, total, progress, keep_start=output is not None)
    else:  # the framework runs the case into a checking stand-in for its trace writer
        watch = _WriterWatch(case, framework, total, progress)
    found = watch.run()
    result = NanResult(case.name, total, watch.steps_run, None, None,
                       time.perf_counter() - started, watch.seconds_per_step(),
                       watch.records_per_step, notes=list(watch.notes))
    if found is not None:
        result.first, result.producer, result.origin = found
        # the operation and source line, where the framework can re-run the origin's call
        result.op = framework.nan_op(case, result)
        if result.op is not None and result.producer is not None and (
                result.op.primitive and result.op.site == result.producer.site):
            result.producer = replace(result.producer, op=result.op.primitive)
        if output is not None:
            try:
                result.trace = str(watch.capture_failing_step(output, result))
            except CaptureError as exc:  # the model raised at the NaN: what was found stands
                result.notes.append(f"no trace was written: {exc}")
    return result


# ---- the records of one step ----

class _Entry(NamedTuple):  # a tuple: made for every record, so made cheaply
    """One checked tensor; ``slot`` indexes the step's ranges (shared by aliases)."""

    seq: int
    pass_: str
    site: str
    role: str
    arg: str
    shape: tuple[int, ...]
    dtype: str
    slot: int


@dataclass(slots=True)
class _Site:
    site: str
    type: str
    parent: str


class _StepLog:
    """What one step recorded: entries in order, their (min, max) pairs, its sites."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.entries: list[_Entry] = []
        self.lows: list[Any] = []    # device scalars (torch) or floats (numpy) until resolved
        self.highs: list[Any] = []
        self.sites: dict[str, _Site] = {}
        self.ranges: list[tuple[float, float]] = []

    def add(self, seq: int, pass_: str, site: str, role: str, arg: str,
            shape: tuple[int, ...], dtype: str, low: Any, high: Any) -> int:
        slot = len(self.ranges) + len(self.lows)
        self.lows.append(low)
        self.highs.append(high)
        self.entries.append(_Entry(seq, pass_, site, role, arg, shape, dtype, slot))
        return slot

    def alias(self, seq: int, pass_: str, site: str, role: str, arg: str,
              shape: tuple[int, ...], dtype: str, slot: int) -> None:
        self.entries.append(_Entry(seq, pass_, site, role, arg, shape, dtype, slot))

    def resolve(self) -> None:
        """Bring the pairs added since the last call to the host at once (one sync)."""
        lows, highs = self.lows, self.highs
        if lows and isinstance(lows[0], torch.Tensor):
            try:
                both = torch.stack([*lows, *highs]).double().cpu().tolist()
            except RuntimeError:  # scalars on several devices (a model split over GPUs)
                both = [float(x) for x in (*lows, *highs)]
            lows, highs = both[:len(lows)], both[len(lows):]
        self.ranges.extend(zip(lows, highs, strict=True))
        self.lows, self.highs = [], []

    def first_bad(self) -> int | None:
        """Position in ``entries`` of the first non-finite one, or None."""
        if all(math.isfinite(lo) and math.isfinite(hi) for lo, hi in self.ranges):
            return None
        return next(i for i, entry in enumerate(self.entries)
                    if not _finite(*self.ranges[entry.slot]))

    def value(self, entry: _Entry) -> ValueRange:
        low, high = self.ranges[entry.slot] if entry.slot < len(self.ranges) else (math.nan,) * 2
        return ValueRange(entry.site, entry.role, entry.arg, low, high, entry.shape,
                          entry.dtype)


def _finite(low: float, high: float) -> bool:
    return math.isfinite(low) and math.isfinite(high)


class _Found(Exception):
    """Ends the run at the end of the failing step (or at the failing record of a port)."""

    def __init__(self, log: _StepLog, position: int) -> None:
        super().__init__("non-finite value found")
        self.log = log
        self.position = position


class _Watch:
    """Runs a case and checks it; subclasses for torch cases and for ports recording themselves."""

    steps_run = 0
    records_per_step = 0
    began: list[float]   # perf_counter when steps 0 and 1 began
    notes: list[str]

    def seconds_per_step(self) -> float:
        """Step 1 on, when there is one: step 0 pays one-off costs (torch imports its compiler
        at the first optimizer step, ~2 s)."""
        counted = self.steps_run - len(self.began) + 1
        if not self.began or counted < 1:
            return 0.0
        return (time.perf_counter() - self.began[-1]) / counted

    def run(self) -> tuple[FirstNonFinite, Producer, R.Origin | None] | None:
        raise NotImplementedError

    def capture_failing_step(self, output: str | os.PathLike, result: NanResult) -> Path:
        raise NotImplementedError


# ---- torch cases ----

class _Checker:
    """Stands in for the capture's Stager (the hooks call it the same way): instead of copying
    a tensor, queue its min and max. Also its ``recorder`` (the hooks read ``seq`` and submit
    site rows there)."""

    def __init__(self) -> None:
        self.recorder = self
        self.seq = 0
        self.log = _StepLog(0)
        # forward outputs of this step by (id, version): an input that is one of them unchanged
        # reuses its pair (the tensor is held, so its id cannot be reused meanwhile)
        self._outputs: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}

    def begin_step(self, step: int) -> None:
        self.log = _StepLog(step)
        self._outputs.clear()

    def end_forward(self) -> None:
        self._outputs.clear()  # inputs are forward only: hold nothing through the backward

    def submit_site(self, row: dict[str, Any]) -> None:
        self.log.sites[row["site"]] = _Site(row["site"], row["type"], row["parent"])

    def any(self, step: int, pass_: str, site: str, role: str, arg: str, value: Any) -> None:
        if isinstance(value, torch.Tensor):
            self.tensor(step, pass_, site, role, arg, value)

    def tensor(self, step: int, pass_: str, site: str, role: str, arg: str,
               tensor: torch.Tensor) -> None:
        self.seq += 1
        if (not tensor.is_floating_point() or tensor.layout != torch.strided
                or tensor.numel() == 0):
            return  # integers and booleans are always finite
        dtype = _DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor.dtype)
        shape = tuple(tensor.shape)
        key = None
        if pass_ == Pass.FORWARD and not tensor.is_inference():
            # a container returns its last submodule's output, a layer takes the previous
            # one's: the same tensor, unchanged, is reduced once
            key = (id(tensor), tensor._version)
            seen = self._outputs.get(key)
            if seen is not None and seen[0] is tensor:
                self.log.alias(self.seq, pass_, site, role, arg, shape, dtype, seen[1])
                return
        # detached only when needed: a gradient has no graph to leave (and detach costs 1 us)
        low, high = torch.aminmax(tensor.detach() if tensor.requires_grad else tensor)
        log = self.log  # _StepLog.add, inlined: this runs for every record
        slot = len(log.ranges) + len(log.lows)
        log.lows.append(low)
        log.highs.append(high)
        log.entries.append(_Entry(self.seq, pass_, site, role, arg, shape, dtype, slot))
        if key is not None and role == Role.OUTPUT:
            self._outputs[key] = (tensor, slot)


class _TorchWatch(_Watch):
    """The step loop's observer: hooks on every module, the weights checked after each step."""

    phase = "setup"

    def __init__(self, case: Case, total: int, progress: Progress | None, *,
                 keep_start: bool) -> None:
        self.case = case
        self.total = total
        self.progress = progress
        self.notes = []
        self.began = []
        self.step = 0
        self.checker = _Checker()
        modules = select_modules(case.model, (), ())
        self.hooks = ModuleRecorder(modules, self.checker)  # type: ignore[arg-type]
        self.optimizers: list[torch.optim.Optimizer] = []
        self.start = _snapshot(case.model) if keep_start else None

    # StepObserver
    def begin_step(self, step: int) -> None:
        if step < 2:
            self.began.append(time.perf_counter())
        self.step = step
        self.checker.begin_step(step)
        self.hooks.begin_step(step)

    def record_loss(self, loss: torch.Tensor) -> None:
        self.hooks.record_loss(loss)
        self.checker.end_forward()

    def after_backward(self) -> None:
        self.hooks.after_backward()

    def end_step(self, step: int) -> None:
        checker = self.checker
        # every parameter once, under the site the capture records it at (that of a module
        # never called, such as nn.MultiheadAttention's out_proj, at its called ancestor)
        for site, name, tensor in self.hooks.weight_records():
            if isinstance(tensor, torch.nn.Parameter):
                checker.tensor(step, NanPass.OPTIMIZER, site, Role.WEIGHT, name, tensor)
        self.steps_run = step + 1
        self._check()
        if self.progress is not None:
            self.progress(step + 1, self.total)

    def _check(self) -> None:
        log = self.checker.log
        log.resolve()
        self.records_per_step = len(log.entries)
        position = log.first_bad()
        if position is not None:
            raise _Found(log, position)

    def run(self) -> tuple[FirstNonFinite, Producer, R.Origin | None] | None:
        case = replace(self.case, optimizer=self._spy(self.case.optimizer))
        self.hooks.attach()
        try:
            run_case(case, steps=self.total, observer=self)
        except _Found as found:
            return self._explain(found)
        except LayerdiffError:
            raise
        except Exception as exc:
            # a model may raise because of the NaN (a NaN probability, a failed check): what
            # was checked before it says where the NaN came from
            log = self.checker.log
            log.resolve()
            position = log.first_bad()
            if position is None:
                raise CaptureError(
                    f"case {self.case.name}: the model raised {type(exc).__name__}: {exc} "
                    f"during the {self.phase} of step {self.step}, before any NaN or Inf was "
                    "seen; fix the case so that it runs") from exc
            self.steps_run = self.step + 1
            self.notes.append(f"the run stopped there: the model raised "
                              f"{type(exc).__name__} during the {self.phase}")
            return self._explain(_Found(log, position))
        finally:
            self.hooks.detach()
        return None

    def _spy(self, factory: Callable | None) -> Callable | None:
        if factory is None:
            return None

        def build(params):
            optimizer = factory(params)
            self.optimizers.append(optimizer)
            return optimizer

        return build

    def _explain(self, found: _Found) -> tuple[FirstNonFinite, Producer, R.Origin | None]:
        log = found.log
        entry = log.entries[found.position]
        optimizer, detail = "optimizer", ""
        if entry.pass_ == NanPass.OPTIMIZER and self.optimizers:
            opt = self.optimizers[-1]
            rates = dict.fromkeys(f"{float(group['lr']):g}" for group in opt.param_groups
                                  if "lr" in group)  # a tensor lr too; in group order
            optimizer = type(opt).__name__
            detail = f"lr {', '.join(rates)}" if rates else ""
            if self.case.clip_grad_norm is not None:
                detail += (", " if detail else "") + (
                    f"after clipping the gradient norm to {self.case.clip_grad_norm:g}")
        return explain(log, found.position, optimizer, detail)

    def capture_failing_step(self, output: str | os.PathLike, result: NanResult) -> Path:
        """Run the case again from its start to the failing step, then capture that step alone
        (as the trace's step 0) from the same weights, optimizer state and random state."""
        from layerdiff.capture import capture

        assert result.first is not None and self.start is not None
        failing = result.first.step
        _restore(self.case.model, self.start)
        optimizers: list[torch.optim.Optimizer] = []
        resume = None
        if failing > 0:
            def keep(params, factory=self.case.optimizer):
                optimizers.append(factory(params))
                return optimizers[-1]

            run_case(replace(self.case, optimizer=keep), steps=failing)
            state = optimizers[-1].state_dict()
            random_state = rng.save()

            def resume(params, factory=self.case.optimizer):
                optimizer = factory(params)
                optimizer.load_state_dict(state)
                random_state.restore()  # capture seeded the generators just before this
                return optimizer

        single = replace(self.case, steps=1, optimizer=resume or self.case.optimizer)
        meta = {"nan": {"step": failing, "first": result.first.as_json(),
                        "note": f"this trace holds step {failing} of {self.case.name} alone, "
                                "recorded as step 0"}}
        return capture(single, output, steps=1, extra_meta=meta)


def _snapshot(model: torch.nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tensors = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return [(t, t.detach().clone()) for t in tensors.values()]


def _restore(model: torch.nn.Module, saved: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    with torch.no_grad():
        for tensor, value in saved:
            tensor.copy_(value)
    model.zero_grad(set_to_none=True)


# ---- ports that record themselves ----

class _CheckingWriter:
    """Stands in for a TraceWriter: checks each floating array as the port records it."""

    def __init__(self, on_step: Callable[[int], None]) -> None:
        self.current_step = 0
        self.seq = 0
        self.log = _StepLog(0)
        self.previous: _StepLog | None = None
        self._on_step = on_step
        self._calls: Counter[str] = Counter()
        self._stack: list[str] = []
        self.found: _Found | None = None

    def step(self, step: int | None = None) -> None:
        self.log.resolve()
        self._on_step(self.current_step)
        self.current_step = self.current_step + 1 if step is None else step
        self.previous, self.log = self.log, _StepLog(self.current_step)
        self._calls.clear()

    def enter(self, module: str, type_name: str = "", *, call: int | None = None) -> str:
        call = self._calls[module] if call is None else call
        self._calls[module] = call + 1
        site = schema.site_name(module, call)
        self.log.sites[site] = _Site(site, type_name, self._stack[-1] if self._stack else "")
        self._stack.append(site)
        return site

    def exit(self, site: str) -> None:
        if self._stack and self._stack[-1] == site:
            self._stack.pop()

    site = site_scope  # the writer's own, over enter and exit above

    def record(self, site: str, role: str, value: Any, *, arg: str = "0",
               pass_: str | None = None) -> None:
        if self.found is not None:
            # a record from compiled code found it and the port held the exception (a
            # callback's); what still arrives from its eager code is later: the first stands
            raise self.found
        self.seq += 1
        array = np.asarray(value) if isinstance(value, (np.ndarray, np.generic)) else None
        if array is None or array.dtype.kind != "f" or array.size == 0:
            return
        low, high = float(array.min()), float(array.max())
        pass_ = pass_ or schema.ROLE_PASS.get(role, Pass.FORWARD)
        self.log.add(self.seq, pass_, site, role, arg, array.shape, array.dtype.name, low, high)
        if not _finite(low, high):
            self.log.resolve()
            self.found = _Found(self.log, len(self.log.entries) - 1)
            raise self.found


class _WriterWatch(_Watch):
    """A case its framework runs into a checking stand-in for the trace writer: a port that
    records itself, or a Flax model through the framework's own call recorder."""

    def __init__(self, case: Case | ExternalCase, framework: Framework, total: int,
                 progress: Progress | None) -> None:
        if total < 1:
            raise CaptureError(f"--steps must be at least 1 (got {total}) for case {case.name}")
        self.case = case
        self.framework = framework
        self.total = total
        self.progress = progress
        who = ("a port that records itself" if framework.records_itself else
               f"{framework.title}, whose weights are recorded at each step's first call,")
        self.notes = [f"{who} shows its weights after an optimizer step only when the next "
                      "step records them: the last step's are not checked"]

    def _stepped(self, step: int) -> None:
        self.steps_run = step + 1
        self.records_per_step = len(self.writer.log.entries)
        if self.progress is not None:
            self.progress(step + 1, self.total)

    def run(self) -> tuple[FirstNonFinite, Producer, R.Origin | None] | None:
        self.writer = _CheckingWriter(self._stepped)
        rng.seed_everything(self.case.seed)
        self.began = [time.perf_counter()]
        try:
            self.framework.run_checked(self.case, self.writer, self.total)
        except _Found as found:
            self.steps_run = found.log.step + 1
            self.records_per_step = len(found.log.entries)  # up to the failing one
            return self._explain(found)
        except LayerdiffError:
            raise
        except Exception as exc:
            what = "port" if self.framework.records_itself else "model"
            raise CaptureError(f"case {self.case.name}: the {what} raised "
                               f"{type(exc).__name__}: {exc} at step "
                               f"{self.writer.current_step}, before any NaN or Inf was seen; "
                               f"fix the {what} so that it runs") from exc
        self._stepped(self.writer.current_step)
        return None

    def _explain(self, found: _Found) -> tuple[FirstNonFinite, Producer, R.Origin | None]:
        log, entry = found.log, found.log.entries[found.position]
        previous = self.writer.previous
        if (entry.role == Role.WEIGHT and entry.pass_ == NanPass.FORWARD and log.step > 0
                and previous is not None):
            # recorded at this step's first call: what the previous optimizer step left
            previous.add(entry.seq, NanPass.OPTIMIZER, entry.site, Role.WEIGHT, entry.arg,
                         entry.shape, entry.dtype, *log.ranges[entry.slot])
            previous.resolve()
            return explain(previous, len(previous.entries) - 1)
        return explain(log, found.position)

    def capture_failing_step(self, output: str | os.PathLike, result: NanResult) -> Path:
        """Such a case is captured from its first step: every step through the failing one."""
        from layerdiff.capture import capture

        assert result.first is not None
        if self.framework.records_itself:
            return capture(self.case, output, steps=result.first.step + 1)
        # a model the framework trains in place stopped at the start of the failing step
        failing = result.first.step
        if result.first.pass_ == NanPass.OPTIMIZER:
            raise CaptureError(f"the weights of step {failing + 1} hold it, which the model "
                               "has been trained to: the optimizer step that made them is not "
                               "in a trace of one step")
        meta = {"nan": {"step": failing, "first": result.first.as_json(),
                        "note": f"this trace holds step {failing} of {self.case.name} alone, "
                                "recorded as step 0, from the weights it started from (the "
                                "optimizer's state is not carried over)"}}
        return capture(replace(self.case, steps=1), output, steps=1, extra_meta=meta)


# ---- where it was made ----

def explain(log: _StepLog, position: int, optimizer: str = "optimizer",
            detail: str = "") -> tuple[FirstNonFinite, Producer, R.Origin | None]:
    """``first``, ``producer`` and ``origin`` from the failing step's records (every earlier one
    finite)."""
    first, producer = _first_and_producer(log, position, optimizer, detail)
    origin = step_origin(log)
    if origin is not None and origin.pass_ == NanPass.OPTIMIZER:
        origin.reason = producer.why  # the optimizer's name, rate and clipping
    return first, producer, origin


def step_origin(log: _StepLog) -> R.Origin | None:
    """The site whose own code made the step's first non-finite value, by the diff's origin
    rule over the step's records (each off when non-finite); None when the case's inputs hold
    it."""
    records = [Record(log.step, entry.pass_, entry.seq, entry.site, entry.role, entry.arg,
                      not _finite(*log.ranges[entry.slot]), entry.dtype)
               for entry in log.entries if entry.slot < len(log.ranges)]
    # the weights after the optimizer step are those the next step starts from: they count
    # only when everything of this step was finite (else the NaN reached them from its origin)
    stepped = [r for r in records if r.pass_ != NanPass.OPTIMIZER]
    if any(r.bad for r in stepped):
        records = stepped
    sites = sites_frame({(log.step, s.site): s.parent for s in log.sites.values()})
    return find_origin(records, sites, NON_FINITE)


def _first_and_producer(log: _StepLog, position: int, optimizer: str,
                        detail: str) -> tuple[FirstNonFinite, Producer]:
    entry = log.entries[position]
    low, high = log.ranges[entry.slot]
    kind = NanKind.NAN if math.isnan(low) or math.isnan(high) else NanKind.INF
    first = FirstNonFinite(entry.site, entry.pass_, entry.role, entry.arg, log.step, kind,
                           low, high, entry.shape, entry.dtype)
    before = log.entries[:position]
    site = log.sites.get(entry.site)
    parent = site.parent if site else ""
    if entry.pass_ == NanPass.OPTIMIZER:
        used = [e for e in before if e.site == entry.site and e.arg == entry.arg
                and e.role in PARAM_ROLES and e.pass_ != NanPass.OPTIMIZER]
        why = ("the optimizer step" + (f" ({detail})" if detail else "")
               + " turned a finite weight and gradient into a non-finite weight")
        return first, Producer(entry.site, NanPass.OPTIMIZER, optimizer, why,
                               _values(log, used))
    if entry.site == schema.LOSS_SITE:
        root = _outermost(log)
        used = [e for e in before if e.site == root and e.role == Role.OUTPUT]
        return first, Producer(entry.site, NanPass.FORWARD, "loss",
                               "the loss function made it from the model's finite output",
                               _values(log, used))
    if entry.role in COMPUTED_ROLES:
        return first, _made_by(log, before, entry.site, entry.pass_, site,
                               f"its {entry.pass_} made a non-finite {entry.role}")
    if entry.role == Role.WEIGHT:
        why = ("the case's initial weights hold it" if log.step == 0 else
               "changed in place during the forward: the weights were finite after the last "
               "optimizer step")
        return first, Producer(None, entry.pass_, "", why)
    # an input (forward) or the gradient arriving at an output (backward): made by no submodule
    if not parent:
        if entry.pass_ == NanPass.FORWARD:
            return first, Producer(None, entry.pass_, "", "the case's inputs hold it: it came in "
                                   "with the data")
        loss = [e for e in before if e.site == schema.LOSS_SITE]
        return first, Producer(schema.LOSS_SITE, entry.pass_, "loss",
                               "the loss's backward made a non-finite gradient of the model's "
                               "output", _values(log, loss))
    what = ("before calling" if entry.pass_ == NanPass.FORWARD else "behind the output of")
    return first, _made_by(log, before, parent, entry.pass_, log.sites.get(parent),
                           f"its own code (no submodule) made it {what} {entry.site}")


def _made_by(log: _StepLog, before: list[_Entry], site: str, pass_: str, row: _Site | None,
             why: str) -> Producer:
    roles = (Role.INPUT, Role.WEIGHT) if pass_ == NanPass.FORWARD else (
        Role.INPUT, Role.WEIGHT, Role.GRAD_OUTPUT)
    used = [e for e in before if e.site == site and e.role in roles and e.pass_ != "optimizer"]
    # what its own code between submodule calls worked on: their outputs, and backward, the
    # gradients they sent back
    children = {name for name, s in log.sites.items() if s.parent == site}
    child_roles = (Role.OUTPUT,) if pass_ == NanPass.FORWARD else RESULT_ROLES
    used += [e for e in before if e.site in children and e.role in child_roles]
    names = {Role.INPUT: "inputs", Role.WEIGHT: "weights", Role.GRAD_OUTPUT: "output gradients",
             Role.OUTPUT: "submodule outputs", Role.GRAD_INPUT: "submodule input gradients"}
    present = [names[role] for role in (Role.GRAD_OUTPUT, Role.INPUT, Role.WEIGHT, Role.OUTPUT,
                                        Role.GRAD_INPUT)
               if any(e.role == role for e in used)]
    if present:
        why += " from finite " + (", ".join(present[:-1]) + " and " if len(present) > 1
                                  else "") + present[-1]
    return Producer(site, pass_, row.type if row else "", why, _values(log, used))


def _values(log: _StepLog, entries: list[_Entry]) -> tuple[ValueRange, ...]:
    seen: set[tuple[str, str, str, str]] = set()
    values = []
    for entry in entries:
        key = (entry.site, entry.pass_, entry.role, entry.arg)
        if key not in seen:
            seen.add(key)
            values.append(log.value(entry))
    return tuple(values)


def _outermost(log: _StepLog) -> str:
    return next((name for name, s in log.sites.items()
                 if not s.parent and name != schema.LOSS_SITE), schema.site_name(
                     schema.ROOT_MODULE, 0))


# ---- JSON ----

def _json_number(value: float) -> float | str | None:
    if math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


__all__ = ["FirstNonFinite", "NanKind", "NanOp", "NanPass", "NanResult", "Producer", "ValueRange",
           "find_nan"]
