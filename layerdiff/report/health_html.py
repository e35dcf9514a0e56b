"""A health result as one self-contained HTML page: the verdicts, the loss curve of the
one-batch run, and each layer's gradient norm and update ratio over the steps (the layer a
check names drawn on top, in colour). Plots through matplotlib's ``Figure`` (no pyplot), as
every page of :mod:`layerdiff.report.page`."""

from __future__ import annotations

import math
import os
from html import escape
from pathlib import Path

import pandas as pd
from matplotlib.figure import Figure

from layerdiff.health.norms import BAND, IDEAL_RATIO
from layerdiff.health.result import HealthResult, Verdict
from layerdiff.outputs import write_text
from layerdiff.report import page
from layerdiff.report.page import CSS

HIGHLIGHT = "#d62728"
OTHERS = "#9aa4ae"
HEALTH_CSS = CSS + """
tr.fail td:first-child { border-left: 4px solid #c62828; }
tr.warn td:first-child { border-left: 4px solid #ef8f00; }
"""


def write_health_html(result: HealthResult, path: str | os.PathLike[str]) -> Path:
    """Write ``result`` as one self-contained HTML file at ``path``; returns the path."""
    return write_text(path, render_health_html(result))


def render_health_html(result: HealthResult) -> str:
    named = {c.site for c in result.checks if c.verdict in (Verdict.FAIL, Verdict.WARN)}
    sections = [_header(result), _table(result), _loss(result),
                _layers(result.grad_norms, named, "Gradient norm per layer",
                        "gradient norm (log)", None),
                _layers(result.update_ratios, named, "Update ratio per layer",
                        "||dw|| / ||w|| (log)", (IDEAL_RATIO, BAND))]
    verdict = "FAIL" if result.found else "PASS"
    return page.document(f"layerdiff health {verdict}: {result.case}", sections, HEALTH_CSS)


def _header(result: HealthResult) -> str:
    failed = [c.name for c in result.checks if c.failed]
    summary = (f"Failed: {', '.join(failed)}." if failed else
               "Every check passes or warns.")
    notes = "".join(f"<p class=\"note\">note: {escape(n)}</p>" for n in result.notes)
    state = "fail" if failed else "pass"
    return (f"<header><div class=\"banner {state}\"><span class=\"verdict\">"
            f"{'FAIL' if failed else 'PASS'}</span><p>{escape(summary)}</p></div>"
            f"<dl class=\"facts\"><dt>case</dt><dd><code>{escape(result.case)}</code></dd>"
            f"<dt>steps on its batch</dt><dd>{result.steps}</dd>"
            f"<dt>seconds</dt><dd>{result.seconds:.1f}</dd></dl>{notes}</header>")


def _table(result: HealthResult) -> str:
    frame = pd.DataFrame([{"check": c.name, "verdict": str(c.verdict), "site": c.site or "",
                           "step": "" if c.step is None else str(c.step),
                           "evidence": c.evidence} for c in result.checks])
    return ("<h2>Checks</h2>" + page.table(frame, list(frame.columns), row_class="verdict",
                                           texts=frozenset({"evidence"}))
            + "<p class=\"note\">Thresholds and why: docs/health.md.</p>")


def _loss(result: HealthResult) -> str:
    if not result.losses:
        return ""
    fig = Figure(figsize=(8, 3.2))
    ax = fig.add_subplot()
    ax.plot(range(len(result.losses)), result.losses, marker=".", color="#1f77b4")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    positive = all(v > 0 for v in result.losses)
    if positive and max(result.losses) > 20 * min(result.losses):
        ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    return "<h2>Loss on the one batch</h2>" + page.figure(
        page.png(fig), "loss curve", f"{len(result.losses)} steps on the case's batch")


def _layers(curves: dict[str, list[float]], named: set[str | None], title: str, label: str,
            guide: tuple[float, tuple[float, float]] | None) -> str:
    drawable = {layer: values for layer, values in curves.items()
                if any(math.isfinite(v) and v > 0 for v in values)}
    if not drawable:
        return ""
    fig = Figure(figsize=(8, 4))
    ax = fig.add_subplot()
    shown = [layer for layer in drawable if layer in named]
    for layer, values in drawable.items():
        if layer not in shown:
            ax.plot(range(len(values)), _positive(values), color=OTHERS, linewidth=0.8,
                    alpha=0.6)
    for layer in shown:
        values = drawable[layer]
        ax.plot(range(len(values)), _positive(values), color=HIGHLIGHT, linewidth=2,
                label=layer)
    if guide is not None:
        ideal, (low, high) = guide
        ax.axhline(ideal, color="#2e7d32", linestyle="--", linewidth=1, label=f"ideal {ideal:g}")
        ax.axhspan(low, high, color="#2e7d32", alpha=0.05)
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    if shown or guide is not None:
        ax.legend(fontsize=8, loc="best")
    fig.tight_layout()
    caption = (f"{len(drawable)} layers; grey: each layer, red: a layer a check names"
               if shown else f"{len(drawable)} layers, each a grey line")
    return f"<h2>{escape(title)}</h2>" + page.figure(page.png(fig), title, caption)


def _positive(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) and v > 0 else math.nan for v in values]
