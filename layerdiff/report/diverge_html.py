"""A diverge result as one self-contained HTML page: the two loss curves, how far apart each
step's statistics are, and the first diverging step's full diff (the diff report's own sections).

Plots are inline PNG drawn with matplotlib's ``Figure`` (no pyplot state), as in
:mod:`layerdiff.report.html`, whose styles and sections this page reuses.
"""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from layerdiff.compare.pair import PairReader
from layerdiff.debug.diverge import DivergeResult
from layerdiff.outputs import write_text
from layerdiff.report import page
from layerdiff.report.findings.debug import update_lines
from layerdiff.report.findings.diff import describe_origin
from layerdiff.report.html import (
    COLOURS,
    error_section,
    failing_section,
    origin_section,
    origins_section,
)
from layerdiff.report.page import CSS, DPI

REFERENCE_COLOUR = "#1f77b4"
PORT_COLOUR = "#d62728"
GOLDEN_COLOUR = "#7f7f7f"


def write_diverge_html(result: DivergeResult, path: str | os.PathLike[str]) -> Path:
    """Write ``result`` as one self-contained HTML file at ``path``; returns the path."""
    return write_text(path, render_diverge_html(result))


def render_diverge_html(result: DivergeResult) -> str:
    sections = [_header(result), _update_section(result), _curves_section(result),
                _steps_section(result)]
    step = result.step_diff
    if step is not None:
        with PairReader.of(step) as reader:
            sections += [f"<h2>Step {result.first_step} in full</h2>"
                         "<p class=\"note\">Both runs again from the same start, this step "
                         "recorded whole (every tensor), and compared record by record.</p>",
                         error_section(step), origin_section(step, reader),
                         origins_section(step), failing_section(step)]
    verdict = "DIVERGES" if result.found else "AGREES"
    return page.document(f"layerdiff diverge {verdict}: {result.port}", sections, CSS)


def _header(result: DivergeResult) -> str:
    if result.found:
        origin = result.origin
        summary = (f"First diverging step: {result.first_step}"
                   + (f"; origin {describe_origin(origin)}." if origin else ".")
                   + (f" {result.explanation[:1].upper()}{result.explanation[1:]}."
                      if result.explanation else ""))
    else:
        summary = (f"Every record of all {result.steps} steps is within tolerance of the "
                   "reference.")
    facts = [("reference", result.reference), ("port", result.port),
             ("steps", str(result.steps)),
             ("first diverging step", "none" if result.first_step is None
              else str(result.first_step)),
             ("cause", "none" if result.cause is None else str(result.cause))]
    facts += [(name.replace("_", " ") + " trace", str(path))
              for name, path in result.traces.items()]
    if result.step_command:
        facts.append(("diff of that step", result.step_command))
    warnings = "".join(f"<p class=\"note\">note: {escape(text)}</p>" for text in result.notes)
    warnings += "".join(f"<p class=\"note\">warning: {escape(text)}</p>"
                        for text in result.warnings)
    verdict = "fail" if result.found else "pass"
    return ("<header>"
            f"<div class=\"banner {verdict}\"><span class=\"verdict\">"
            f"{'DIVERGES' if result.found else 'AGREES'}</span><p>{escape(summary)}</p></div>"
            "<dl class=\"facts\">"
            + "".join(f"<dt>{escape(name)}</dt><dd><code>{escape(value)}</code></dd>"
                      for name, value in facts)
            + "</dl>" + warnings + "</header>")


def _update_section(result: DivergeResult) -> str:
    """The update that ended the step before the first diverging one, rerun in the port's
    optimizer from the reference's inputs: the evidence for (or against) cause ``optimizer``."""
    update = result.optimizer_update
    if update is None:
        return ""
    head, *findings = update_lines(update)
    items = "".join(f"<li>{escape(text)}</li>" for text in findings)
    frame = pd.DataFrame([{
        "port parameter": p.port, "reference": ", ".join(p.reference), "update": p.kind,
        "elements moved": p.moved, "port/reference - 1 (x weight)": p.decay,
        "step ratio": p.step_ratio, "fit leaves": p.residual,
        "update difference": p.update_difference,
        "in the port's own run": p.actual_difference, "cosine": p.cosine,
        "gradient difference": p.grad_difference,
        "groups (reference, port)": f"{_group(p.reference_group)}, {_group(p.port_group)}",
        "status": "origin" if p.differs else ""}
        for p in sorted(update.params, key=lambda p: not p.differs)])  # those that differ first
    groups = pd.DataFrame(
        [{"side": side, "group": index, **{key: _setting(value) for key, value in group.items()}}
         for side, listed in (("reference", update.reference_groups),
                              ("port", update.port_groups))
         for index, group in enumerate(listed)])
    return (f"<h2>Optimizer update of step {update.step}</h2>"
            f"<p>{escape(head[:1].upper() + head[1:])}</p><ul>{items}</ul>"
            + (page.table(frame, [c for c in frame.columns if c != "status"], row_class="status")
               if not frame.empty else "")
            + "<p class=\"note\">Param groups as they stood after that update.</p>"
            + (page.table(groups, list(groups.columns)) if not groups.empty else ""))


def _group(index: int | None) -> str:
    return "?" if index is None else str(index)


def _setting(value: object) -> object:
    return ", ".join(map(str, value)) if isinstance(value, list) else value


def _curves_section(result: DivergeResult) -> str:
    head = "<h2>Loss curves</h2>"
    if not result.per_step:
        return head + "<p class=\"note\">No steps ran.</p>"
    tolerance = ("the looser of the per-dtype tolerance and 4 times the drift float32 "
                 "rounding alone gives the reference there (its float64 run)" if result.golden
                 else "the per-dtype tolerance")
    caption = ("Top: the loss of each step, reference and port, from the same weights. Bottom: "
               "each step's largest error over its tolerance among the statistics (min, max, "
               f"mean, std, rms) of every record, the tolerance being {tolerance}; the dashed "
               "line is the tolerance (ratio 1). "
               + (f"The vertical line marks step {result.first_step}, the first out of "
                  "tolerance." if result.found else ""))
    return head + page.figure(page.png(_curves_figure(result)), "loss curves of reference and port",
                          caption)


def _curves_figure(result: DivergeResult) -> Figure:
    steps = np.array([row.step for row in result.per_step])
    ref = np.array([_nan(row.loss_reference) for row in result.per_step])
    port = np.array([_nan(row.loss_port) for row in result.per_step])
    worst = np.array([_nan(row.worst) for row in result.per_step])
    fig = Figure(figsize=(10, 6), dpi=DPI, layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=[3, 2])
    marker = "o" if len(steps) <= 60 else None
    top.plot(steps, ref, color=REFERENCE_COLOUR, marker=marker, ms=4, label="reference")
    top.plot(steps, port, color=PORT_COLOUR, marker=marker, ms=3, ls="--", label="port")
    if result.golden:
        golden = np.array([_nan(row.loss_golden) for row in result.per_step])
        top.plot(steps, golden, color=GOLDEN_COLOUR, lw=1, ls=":",
                 label="reference in float64")
    top.set_ylabel("loss")
    top.legend(frameon=False)
    top.grid(alpha=0.3)
    shown = np.where(np.isfinite(worst) & (worst > 0), worst, np.nan)
    out = np.array([row.out > 0 for row in result.per_step])
    bottom.plot(steps, shown, color="#555555", lw=1)
    bottom.scatter(steps[~out], shown[~out], s=14, color=COLOURS["within"], label="within",
                   zorder=3)
    bottom.scatter(steps[out], shown[out], s=18, color=COLOURS["origin"], label="out",
                   zorder=3)
    infinite = out & ~np.isfinite(worst)
    if infinite.any():  # not finite: drawn on the top edge
        bottom.scatter(steps[infinite], np.full(infinite.sum(), _top(shown)), marker="^",
                       color=COLOURS["origin"], zorder=3)
    bottom.axhline(1.0, color="#333333", ls="--", lw=1)
    bottom.set_yscale("log")
    bottom.set_ylabel("worst error / tolerance")
    bottom.set_xlabel("step")
    bottom.grid(alpha=0.3)
    if result.first_step is not None:
        for ax in (top, bottom):
            ax.axvline(result.first_step, color=COLOURS["origin"], lw=1, alpha=0.6)
    if len(steps) <= 30:
        bottom.set_xticks(steps)
    return fig


def _steps_section(result: DivergeResult) -> str:
    frame = pd.DataFrame(
        [{"step": row.step, "loss (reference)": row.loss_reference,
          "loss (port)": row.loss_port,
          **({"loss (float64)": row.loss_golden} if result.golden else {}),
          "loss difference": (None if row.loss_reference is None or row.loss_port is None
                              else abs(row.loss_port - row.loss_reference)),
          "records out": row.out, "worst error / tolerance": row.worst,
          "status": "origin" if row.step == result.first_step else ""}
         for row in result.per_step])
    if frame.empty:
        return ""
    return ("<h2>Per step</h2>" + page.table(frame, [c for c in frame.columns if c != "status"],
                                         row_class="status"))


def _nan(value: float | None) -> float:
    return math.nan if value is None else float(value)


def _top(values: np.ndarray) -> float:
    finite = values[np.isfinite(values)]
    return float(finite.max()) * 10 if finite.size else 10.0
