"""The text of the diagnostics' results: nan, diverge (and the optimizer update it reruns),
batch independence, determinism."""

from __future__ import annotations

import math

from layerdiff.compare.result import Origin
from layerdiff.compare.suggest import wrap_command
from layerdiff.debug.batch import BatchResult, Evidence, Mixing, MixTest, samples_said
from layerdiff.debug.determinism import DeterminismResult, DifferenceKind
from layerdiff.debug.diverge import DivergeResult
from layerdiff.debug.nan import NanOp, NanResult
from layerdiff.debug.optimizer_update import UpdateEvidence, names_said
from layerdiff.report.findings.diff import describe_origin
from layerdiff.report.text import WIDTH, clip, number, shape, wrap, wrap_lines

SHOWN = 12           # a NaN's producer: input ranges listed (JSON has all)
TABLE_STEPS = 24     # diverge's table shows every step up to this many, else a window
_NO_ORIGIN = ("origin: none: no site's result differs while what came into it agrees (the "
              "case's inputs differ, or a record only one run has)")


def origin_line(origin: Origin) -> str:
    """'origin: blocks.0.mix#0, forward output, step 0: its output is ...'."""
    arg = "" if origin.arg == "0" else f" '{origin.arg}'"
    return (f"origin: {origin.site}, {origin.pass_} {origin.role}{arg}, step {origin.step}: "
            f"{origin.reason}")


# ---- nan

def nan_text(result: NanResult) -> str:
    per_step = result.seconds_per_step
    timing = (f"{result.steps_run} step{'s' if result.steps_run != 1 else ''} in "
              f"{result.seconds:.2f} s ({per_step * 1e3:.1f} ms a step, "
              f"{result.records_per_step} tensors checked a step)")
    if result.first is None:
        lines = [f"no NaN or Inf in {result.case}: forward values, gradients and weights after "
                 f"each optimizer step were finite for {timing}"]
        return "\n".join([*wrap_lines(lines), *wrap_lines(result.notes)])
    first = result.first
    arg = "" if first.arg == "0" else f" '{first.arg}'"
    lines = [f"first non-finite value ({first.kind}) in {result.case}, step {first.step}: "
             f"{first.pass_} {first.role}{arg} of {first.site} "
             f"({shape(first.shape)} {first.dtype}, range {_range(first.min, first.max)})"]
    lines.append(origin_line(result.origin) if result.origin else
                 "origin: none: no site's result is non-finite while what came into it is "
                 "finite (the case's inputs hold it, or the loss's backward made it)")
    producer = result.producer
    if producer is not None:
        lines.append(f"made by: {producer.site or 'the case itself'}"
                     + (f" ({producer.type})" if producer.type else "")
                     + f", {producer.pass_}: {producer.why}")
    op = result.op
    if op is not None and op.primitive and op.where:  # the one line to act on, first
        lines.insert(0, f"first {'NaN' if first.kind == 'nan' else 'Inf'}: step {first.step} "
                        f"{first.pass_}, site {first.site} {first.role}{arg}, made by "
                        f"`{op.primitive}`"
                        + (f" in {op.site}'s own code" if op.site != first.site else "")
                        + f" at {op.where}")
    out = wrap_lines(lines)
    if producer is not None and producer.inputs:
        out.append("  from finite values:")
        shown = producer.inputs[:SHOWN]
        for value in shown:
            arg = "" if value.arg == "0" else f" '{value.arg}'"
            where = "" if value.site == producer.site else f" of {value.site}"
            out.append(f"    {value.role}{arg}{where}"[:48].ljust(48)
                       + f" {shape(value.shape)} {value.dtype}"[:26].ljust(26)
                       + f" {_range(value.min, value.max)}")
        if len(producer.inputs) > len(shown):
            out.append(f"    ... {len(producer.inputs) - len(shown)} more (--json lists "
                       "them all)")
    if op is not None:
        out.extend(wrap_lines([op_line(op)]))
    out.extend(wrap_lines([f"ran {timing}" + (f"; trace of the failing step: {result.trace}"
                                             if result.trace else ""), *result.notes]))
    return "\n".join(line[:WIDTH] for line in out)


def op_line(op: NanOp) -> str:
    """'operation: `log` at /src/model.py:9 (Gate.__call__), ...', or why none is named."""
    if not op.primitive:
        return f"operation: not named: {op.note}"
    where = f" at {op.file}:{op.line} ({op.function})" if op.file else ""
    inside = f", inside {op.library}" if op.library else ""
    return (f"operation: `{op.primitive}`{where}{inside}, found running {op.site}'s "
            f"{op.pass_} alone under {op.how}" + (f"; {op.note}" if op.note else ""))


def _range(low: float, high: float) -> str:
    if math.isnan(low) or math.isnan(high):
        return "NaN"
    return f"{number(low)} .. {number(high)}"


# ---- diverge

def diverge_text(result: DivergeResult) -> str:
    judged = ("by the looser of the per-dtype tolerance and 4x the drift float32 rounding "
              "alone gives the reference (its float64 run)" if result.golden
              else "by the per-dtype tolerances")
    lines = [clip(f"diverge: {result.port}"), clip(f"against: {result.reference}")]
    lines += _wrap(f"{result.steps} optimizer steps from the same weights; the statistics of "
                   f"every record judged {judged}", "")
    lines += _diverge_table(result)
    if not result.found:
        lines.append("no step differs: every record of every step is within tolerance")
    else:
        lines.append(f"first diverging step: {result.first_step}")
        origin = result.origin
        if origin is not None:
            lines.append(clip(f"origin: {describe_origin(origin)}"))
            if origin.hint and not result.optimizer_update:  # the update's evidence says more
                lines += _wrap(f"likely cause: {origin.hint.get('kind')} "
                               f"({origin.hint.get('evidence')})", "  ")
        if result.cause is not None:
            lines += _wrap(f"cause: {result.cause}: {result.explanation}", "  ")
        if result.optimizer_update is not None:
            first, *rest = update_lines(result.optimizer_update)
            lines += _wrap(first, "  ")
            lines += [line for text in rest for line in wrap(text, WIDTH, "    - ", "      ")]
        others = result.origins[1:]
        if others:
            shown = "; ".join(describe_origin(o) for o in others[:4])
            more = f" and {len(others) - 4} more" if len(others) > 4 else ""
            lines += _wrap(f"also: {shown}{more}", "  ")
        if result.step_command:
            lines.append("see every record of that step:")
            # a command to copy: broken at its arguments, never clipped
            lines += [f"  {line}" for line in wrap_command(result.step_command, WIDTH - 2)]
    lines += [line for text in result.notes for line in _wrap(f"note: {text}", "")]
    lines += [line for text in result.warnings for line in _wrap(f"warning: {text}", "")]
    took = ", ".join(f"{name} {value:.1f} s" for name, value in result.seconds.items())
    lines.append(clip(f"took {took}"))
    return "\n".join(lines)


def _diverge_table(result: DivergeResult) -> list[str]:
    rows = result.per_step
    if len(rows) > TABLE_STEPS:  # a window around the first diverging step, and the last
        centre = result.first_step if result.first_step is not None else 0
        keep = {0, len(rows) - 1} | set(range(max(0, centre - 3), centre + 4))
        rows = [row for row in rows if row.step in keep]
    lines = [f"{'step':>6}  {'loss (reference)':>16}  {'loss (port)':>16}  "
             f"{'records out':>11}  {'worst/tol':>9}"]
    previous = -1
    for row in rows:
        if row.step != previous + 1:
            lines.append(f"{'...':>6}")
        previous = row.step
        mark = "  <- first" if row.step == result.first_step else ""
        lines.append(f"{row.step:>6}  {number(row.loss_reference, 6, nan='nan'):>16}  "
                     f"{number(row.loss_port, 6, nan='nan'):>16}  {row.out:>11}  "
                     f"{number(row.worst, 3, nan='nan'):>9}{mark}")
    return lines


def _wrap(text: str, indent: str) -> list[str]:
    """Diverge's paragraphs: continuation lines at the first's indent, two spaces when none."""
    return wrap(text, WIDTH, indent, indent or "  ")


def update_lines(update: UpdateEvidence) -> list[str]:
    """The rerun optimizer update's evidence as sentences, for the terminal and the HTML
    page: what was rerun from what, then one finding per kind of difference."""
    given = "weights, gradients and optimizer state" if update.state_given else (
        "weights and gradients (its own optimizer state)")
    head = (f"the update that ended step {update.step}, rerun in the port's optimizer "
            f"({update.port_optimizer}; the reference's: {update.reference_optimizer}) from "
            f"the reference's {given}:")
    lines = [head]
    worst = update.grad_difference
    if worst is not None:
        lines.append(f"gradients of step {update.step}: " + (
            f"largest relative difference {worst[0]:.2g} ({worst[1]})" if worst[0] > 0
            else "the same in both, bit for bit"))
    lines += update.findings()
    agreeing = [p.port for p in update.params if not p.differs]
    if not update.differing:
        lines.append(f"every parameter ({len(agreeing)}) gets the reference's update "
                     "within rounding")
    elif agreeing:
        lines.append(f"the other {len(agreeing)} parameters get the reference's update "
                     f"within rounding ({names_said(agreeing)})")
    return lines + update.notes


def update_text(update: UpdateEvidence) -> str:
    """The rerun update on its own: its head, then each finding as a bullet."""
    head, *rest = update_lines(update)
    return "\n".join(wrap(head, WIDTH) + [line for text in rest
                                           for line in wrap(text, WIDTH, "  - ", "    ")])


# ---- batch independence

def describe_evidence(evidence: Evidence) -> str:
    share = _share(evidence.size)
    if evidence.test == MixTest.GRADIENT:
        return (f"a loss on the outputs of samples {samples_said(evidence.observed)} sends "
                f"gradient to the inputs of samples {samples_said(evidence.affected)} (up to "
                f"{share} the gradient on the observed samples' own inputs)")
    what = "inputs" if evidence.test == MixTest.PERTURBATION else "inputs and output gradients"
    changed = "outputs" if evidence.test == MixTest.PERTURBATION else "input gradients"
    return (f"changing the {what} of samples {samples_said(evidence.varied)} changed the "
            f"{changed} of samples {samples_said(evidence.affected)}, by up to {share} their "
            "largest value")


def describe_mixing(mixing: Mixing) -> str:
    return (f"{mixing.site} ({mixing.type}), {mixing.pass_}: "
            f"{describe_evidence(mixing.evidence[0])}"
            if mixing.evidence else f"{mixing.site} ({mixing.type}), {mixing.pass_}")


def _share(size: float) -> str:
    """A relative size as words that read before a quantity: '61.0% of', '2.0e-07 times'."""
    if not math.isfinite(size):
        return "an unbounded multiple of"
    return f"{size:.1%} of" if size >= 1e-3 else f"{size:.1e} times"


def batch_text(result: BatchResult) -> str:
    tests = ", ".join(f"{test} {count}" for test, count in result.tested.items())
    lines = [clip(f"batch independence: {result.case}"),
             clip(f"batch of {result.batch_size} (axis {result.batch_axis}), {result.sites} "
                  f"sites, {result.splits} splits of the batch, {result.seconds:.1f} s"),
             clip(f"sites tested: {tests}")]
    first = result.first
    if first is not None:
        lines.append(clip(f"MIXING: {len(result.mixing)} site(s) mix samples; the first is "
                          f"{first.site} ({first.type}), in its {first.pass_}"))
        lines += wrap(describe_evidence(first.evidence[0]), WIDTH, "  ")
        if result.origin is not None:
            lines += wrap(origin_line(result.origin), WIDTH)
        lines.append("sites that mix (containers list the mixing sites inside them):")
        for entry in result.mixing:
            if entry.holds:
                lines.append(clip(f"  {entry.site} ({entry.type}): holds "
                                  f"{', '.join(entry.holds)}"))
            else:
                tests = ", ".join(str(e.test) for e in entry.evidence)
                lines.append(clip(f"  {entry.site} ({entry.type}) {entry.pass_}: {tests}"))
    else:
        lines.append("independent: no site makes one sample's result depend on another")
    if result.allowed:
        lines.append("mixing by design (allowed, not findings):")
        lines += [clip(f"  {entry.site} ({entry.type}): {entry.allowed}")
                  for entry in result.allowed]
    if result.untested:
        shown = ", ".join(list(result.untested)[:6]) + (" ..." if len(result.untested) > 6
                                                        else "")
        lines += wrap(f"not tested ({len(result.untested)}): {shown}; the JSON says why", WIDTH)
    lines += [line for text in result.warnings for line in wrap(f"warning: {text}", WIDTH)]
    return "\n".join(lines)


# ---- determinism

def determinism_text(result: DeterminismResult) -> str:
    steps = "its own steps" if result.steps is None else f"{result.steps} step" + (
        "s" if result.steps != 1 else "")  # None: a trace that did not say
    head = (f"{result.runs} runs of {result.case} ({steps}), each in a fresh process, "
            f"{result.records:,} records each, {result.seconds:.1f} s")
    lines: list[str] = []
    if not result.found:
        lines.append(f"deterministic: {head}: identical bit for bit")
    else:
        lines.append(f"nondeterministic: {head}")
        for c in result.comparisons:
            if c.first is None:
                lines.append(f"run {c.run} is identical to run 1")
                continue
            lines.append(f"run {c.run} differs from run 1 first at {c.first.describe()}"
                         + (f" ({c.note})" if c.note else ""))
            lines.append("  " + (origin_line(c.origin) if c.origin else _NO_ORIGIN))
            if c.how == DifferenceKind.VALUES:
                size = (f"max |diff| {c.max_abs:.3g}, {c.ratio:.3g}x tolerance"
                        if c.max_abs is not None and c.ratio is not None
                        and math.isfinite(c.ratio) else f"verdict {c.verdict}")
                lines.append(f"  {'within' if c.within_tolerance else 'OUT OF'} tolerance "
                             f"there: {size} ({c.tolerance})")
            lines.append(f"  {c.differing:,} of {result.records:,} records differ; "
                         + (f"first out of tolerance: {c.first_out.describe()}"
                            if c.first_out else "none out of tolerance"))
    if result.hash_seed != "random":
        lines.append(f"PYTHONHASHSEED={result.hash_seed} in this environment: every run had "
                     "the same hash seed")
    if result.traces:
        lines.append("traces: " + " ".join(result.traces))
    out = []
    for line in lines:  # a continuation two spaces deeper than its line's own indent
        indent = " " * (len(line) - len(line.lstrip()))
        out.extend(wrap(line, WIDTH, "", indent + "  "))
    return "\n".join(out)


__all__ = ["batch_text", "describe_evidence", "describe_mixing",
           "determinism_text", "diverge_text", "nan_text", "origin_line", "update_lines",
           "update_text"]
