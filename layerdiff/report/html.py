"""A diff as one self-contained HTML page: verdict, error plots, the origin's tensors, tables.

Everything is inline (CSS, and plots as base64 PNG data URIs drawn with matplotlib's Agg
renderer through ``Figure`` objects, never pyplot's global state), so the page can be mailed,
attached to a CI run or opened offline. All text from traces and diffs is HTML-escaped.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Sequence
from html import escape
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
from matplotlib import transforms
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import LogLocator, MaxNLocator, NullFormatter

from layerdiff.compare import judge
from layerdiff.compare.judge import PASSING, Status, Verdict
from layerdiff.compare.pair import PairReader, origin_row
from layerdiff.compare.result import Column, Diff, Origin
from layerdiff.errors import LayerdiffError
from layerdiff.outputs import write_text
from layerdiff.report import page
from layerdiff.report.findings.diff import (
    describe_origin,
    forced_routing,
    routing_line,
    said_by_flip,
)
from layerdiff.report.page import CSS, DPI, present
from layerdiff.report.positions_html import positions_section
from layerdiff.report.tree import TREE_CSS, module_tree_section
from layerdiff.trace.schema import Pass

MAX_HEATMAP_COLUMNS = 256
MAX_HEATMAP_ROWS = 256
MAX_HIST_VALUES = 4_000_000      # histograms of bigger tensors use an evenly strided sample
LABEL_TICKS_UP_TO = 30           # name each point on the x axis when a panel has this few

# One colour per kind of point, shared by the plot legend and the table rows.
COLOURS = {
    Status.ORIGIN: "#d62728",
    Status.HOLDS_ORIGIN: "#9467bd",
    Status.PROPAGATED: "#ff7f0e",
    "out": "#8c564b",            # out of tolerance but not attributed to an origin
    Verdict.REF_NAN: "#17becf",
    Verdict.WITHIN: "#2ca02c",
    Verdict.MODULE_WITHIN: "#98df8a",
    Verdict.PADDING: "#c5e0b4",
    Verdict.IDENTICAL: "#9a9a9a",
    Verdict.SAME_DIGEST: "#b4b4b4",
}
LABELS = {
    Status.ORIGIN: "origin",
    Status.HOLDS_ORIGIN: "holds an origin",
    Status.PROPAGATED: "propagated",
    "out": "out (no origin found)",
    Verdict.REF_NAN: "reference not finite",
    Verdict.WITHIN: "within tolerance",
    Verdict.MODULE_WITHIN: "op differs, its module within",
    Verdict.PADDING: "differs only at padding positions",
    Verdict.IDENTICAL: "identical",
    Verdict.SAME_DIGEST: "same digest (bytes not compared)",
}

FAILING_COLUMNS = [Column.SITE, Column.PASS, Column.ROLE, Column.ARG, Column.STEP, Column.RATIO,
                   Column.MAX_ABS, Column.MAX_REL, Column.COSINE, Column.VERDICT, Column.STATUS,
                   Column.CAUSE]



def write_html(diff: Diff, path: str | os.PathLike[str]) -> Path:
    """Write ``diff`` as one self-contained HTML file at ``path``; returns the path."""
    return write_text(path, render_html(diff))


def render_html(diff: Diff) -> str:
    """The report page as a string (for notebooks, or to embed elsewhere): from the diff's
    rows, and tensors read back through one :class:`PairReader` (each trace opened once)."""
    with PairReader.of(diff) as reader:
        sections = [
            _header(diff),
            module_tree_section(diff, reader),
            _ops_section(diff),
            error_section(diff),
            origin_section(diff, reader),
            positions_section(diff),
            failing_section(diff),
            origins_section(diff),
            _unmatched_section(diff),
            _not_taken_section(diff),
            _meta_section(diff),
        ]
    title = f"layerdiff {diff.verdict.upper()}: {Path(diff.port).name}"
    return page.document(title, sections, CSS + TREE_CSS)


# ---------------------------------------------------------------------------------------------
# Header


def _header(diff: Diff) -> str:
    verdict = diff.verdict
    origin, unjudged = diff.origin, diff.cannot_judge_first
    if unjudged is not None:
        summary = (f"Cannot judge {unjudged.site}, which holds the first record out "
                   f"({unjudged.record_site}, {unjudged.pass_} {unjudged.role}, "
                   f"{unjudged.ratio:.3g}x tolerance): {unjudged.why}." + (
                       f" A later origin, which may be its consequence: "
                       f"{describe_origin(origin)}." if origin is not None else ""))
    elif origin is not None:
        summary = f"First origin: {describe_origin(origin)}." + (
            f" Likely cause: {origin.hint['kind']}." if origin.hint else "")
    elif verdict == "fail":
        summary = "Rows are out of tolerance, but no origin was found."
    else:
        summary = "Every compared tensor is within tolerance."
    first = diff.first_failing_step
    facts = [
        ("reference", f"<code>{escape(str(diff.reference))}</code>"),
        ("port", f"<code>{escape(str(diff.port))}</code>"),
        ("first failing step", escape(str(first)) if first is not None else "none"),
    ]
    n_failing = len(diff.failing())
    counts = [
        (len(diff.rows), "rows compared", False),
        (n_failing, "rows out of tolerance", n_failing > 0),
        (len(diff.origins), "origins", len(diff.origins) > 0),
        (len(diff.unmatched), "unmatched records", len(diff.unmatched) > 0),
    ]
    return (
        "<header>"
        f"<div class=\"banner {verdict}\"><span class=\"verdict\">{verdict.upper()}</span>"
        f"<p>{escape(summary)}</p></div>"
        "<dl class=\"facts\">"
        + "".join(f"<dt>{name}</dt><dd>{value}</dd>" for name, value in facts)
        + "</dl><div class=\"counts\">"
        + "".join(f"<div class=\"count{' bad' if bad else ''}\"><b>{n:,}</b>"
                  f"<span>{escape(label)}</span></div>" for n, label, bad in counts)
        + "</div></header>")


# ---------------------------------------------------------------------------------------------
# Error per site, in execution order


def _plot_step(diff: Diff) -> int | None:
    """The step worth plotting: the first failing one, else step 0 (or the first present)."""
    if diff.rows.empty:
        return None
    steps = set(diff.rows[Column.STEP].tolist())
    for step in (diff.first_failing_step, 0):
        if step is not None and step in steps:
            return int(step)
    return int(min(steps))


def error_section(diff: Diff) -> str:
    step = _plot_step(diff)
    head = "<h2>Error per site, in execution order</h2>"
    if step is None:
        return head + "<p class=\"note\">No rows were compared.</p>"
    rows = diff.rows[diff.rows[Column.STEP] == step]
    panels = [(name, rows[rows[Column.PASS] == name].sort_values(Column.SEQ, kind="stable"))
              for name in Pass]
    panels = [(name, frame) for name, frame in panels if not frame.empty]
    if not panels:
        return head + f"<p class=\"note\">Step {step} has no forward or backward rows.</p>"
    png = page.png(_error_figure(panels, step))
    caption = (f"Step {step}. y: the largest error over its tolerance, "
               "max |port − ref| / (atol + rtol·|ref|), on a log scale; the dashed line is the "
               "tolerance (ratio 1). ▼ on the bottom edge: identical (ratio 0); ▲ on the top "
               "edge: not finite or shapes differ. The backward panel is in backward execution "
               "order.")
    digests = int((diff.rows[Column.VERDICT] == Verdict.SAME_DIGEST).sum())
    if digests:
        caption += (f" {digests:,} records agree by their digests alone (same digest: bytes not "
                    "compared, since a side holds no data or --no-verify read none): equal "
                    "against any accidental change, not against a deliberate one.")
    return head + page.figure(png, f"error over tolerance per site, step {step}", caption)


def _error_figure(panels: Sequence[tuple[str, pd.DataFrame]], step: int) -> Figure:
    ratios = np.concatenate([frame[Column.RATIO].to_numpy(dtype=float) for _, frame in panels])
    low, high = _ratio_limits(ratios)
    fig = Figure(figsize=(10, 0.6 + 3.3 * len(panels)), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(panels), 1, squeeze=False)[:, 0]
    for ax, (name, frame) in zip(axes, panels, strict=True):
        _error_panel(ax, frame, name, step, low, high)
    handles, labels = _legend_entries(axes)
    if handles:
        fig.legend(handles, labels, loc="outside upper center", ncols=min(len(labels), 7),
                   frameon=False, fontsize=9)
    return fig


def _ratio_limits(ratios: np.ndarray) -> tuple[float, float]:
    """Log-axis limits that hold every finite positive ratio and the tolerance line."""
    positive = ratios[np.isfinite(ratios) & (ratios > 0)]
    low = min(positive.min(), 1e-2) if positive.size else 1e-3
    high = max(positive.max(), 10.0) if positive.size else 10.0
    # Whole decades, one spare below and above for the clipped markers.
    return 10.0 ** (math.floor(math.log10(low)) - 1), 10.0 ** (math.ceil(math.log10(high)) + 1)


def _category(verdict: str, status: str) -> str:
    if status in (Status.ORIGIN, Status.HOLDS_ORIGIN, Status.PROPAGATED):
        return status
    if verdict in PASSING:
        return verdict
    return "out"


def _error_panel(ax: Any, frame: pd.DataFrame, name: str, step: int, low: float,
                 high: float) -> None:
    x = np.arange(len(frame))
    ratio = frame[Column.RATIO].to_numpy(dtype=float)
    # Zero cannot sit on a log axis and inf/NaN have no height: pin them to the edges.
    floor, ceiling = low * 1.6, high / 1.6
    y = np.where(np.isfinite(ratio), np.clip(ratio, floor, ceiling), ceiling)
    y = np.where(ratio == 0, floor, y)
    ax.plot(x, y, color="#c8ccd0", linewidth=0.8, zorder=1)
    cats = [_category(v, s) for v, s in zip(
        frame[Column.VERDICT], _text_column(frame, Column.STATUS), strict=True)]
    for cat in COLOURS:
        sel = np.array([c == cat for c in cats], dtype=bool)
        for mask, marker in ((sel & (ratio == 0), "v"), (sel & ~np.isfinite(ratio), "^"),
                             (sel & np.isfinite(ratio) & (ratio != 0), "o")):
            if mask.any():
                size = 60 if cat == Status.ORIGIN else 22
                ax.scatter(x[mask], y[mask], s=size, marker=marker, color=COLOURS[cat],
                           label=LABELS[cat], zorder=3 if cat == Status.ORIGIN else 2,
                           edgecolors="white", linewidths=0.4)
    ax.axhline(1.0, color="#444", linestyle="--", linewidth=1, zorder=0)
    ax.text(1.0, 1.0, " tolerance", transform=ax.get_yaxis_transform(), va="bottom",
            ha="right", fontsize=8, color="#444")
    _annotate_origins(ax, frame, x, y, cats)
    ax.set_yscale("log")
    ax.set_ylim(low, high)
    ax.set_xlim(-0.5, max(len(frame) - 0.5, 0.5))
    ax.set_ylabel("error / tolerance")
    ax.set_title(f"{name} pass, step {step} ({len(frame)} rows)", loc="left", fontsize=10)
    ax.grid(axis="y", which="major", color="#eceff1", linewidth=0.8)
    ax.spines[["top", "right"]].set_visible(False)
    _x_ticks(ax, frame, name)


def _annotate_origins(ax: Any, frame: pd.DataFrame, x: np.ndarray, y: np.ndarray,
                      cats: list[str]) -> None:
    """Name the origins on the plot: the points a reader must find. Labels stack down from
    the top of the panel, so two origins side by side do not cover each other."""
    picks = [i for i, c in enumerate(cats) if c == Status.ORIGIN][:5]
    sites = frame[Column.SITE].tolist()
    roles = frame[Column.ROLE].tolist()
    right_half = len(frame) / 2
    # x from the point's column, nudged sideways so the label never hides its own point;
    # y from the top of the panel.
    column = transforms.blended_transform_factory(ax.transData, ax.transAxes)
    for n, i in enumerate(picks):
        right = x[i] > right_half
        place = transforms.offset_copy(column, fig=ax.figure, x=-12 if right else 12,
                                       units="points")
        ax.annotate(f"{sites[i]} {roles[i]}", xy=(x[i], y[i]), xytext=(x[i], 0.97 - 0.11 * n),
                    textcoords=place, ha="right" if right else "left", va="top", fontsize=9,
                    fontweight="bold" if n == 0 else "normal", color=COLOURS[Status.ORIGIN],
                    arrowprops={"arrowstyle": "-", "color": COLOURS[Status.ORIGIN], "lw": 0.8,
                                "shrinkA": 0, "shrinkB": 4},
                    bbox={"boxstyle": "round,pad=0.2", "fc": "white", "ec": "none",
                          "alpha": 0.75}, zorder=4)


def _x_ticks(ax: Any, frame: pd.DataFrame, name: str) -> None:
    if 0 < len(frame) <= LABEL_TICKS_UP_TO:
        labels = [f"{s} {r}" if a in ("", "0") else f"{s} {r} {a}"
                  for s, r, a in zip(frame[Column.SITE], frame[Column.ROLE], frame[Column.ARG],
                                     strict=True)]
        ax.set_xticks(np.arange(len(frame)), labels, rotation=35, ha="right", fontsize=7,
                      rotation_mode="anchor")
    else:
        ax.set_xlabel(f"row in {name} execution order")


def _legend_entries(axes: Iterable[Any]) -> tuple[list[Any], list[str]]:
    """One round marker per category present, in the order of COLOURS (the panels may show a
    category only as an edge marker, which would make a misleading legend symbol)."""
    present = set()
    for ax in axes:
        present.update(ax.get_legend_handles_labels()[1])
    order = [c for c in COLOURS if LABELS[c] in present]
    handles = [Line2D([], [], linestyle="", marker="o", markersize=8 if c == Status.ORIGIN else 5,
                      color=COLOURS[c]) for c in order]
    return handles, [LABELS[c] for c in order]


# ---------------------------------------------------------------------------------------------
# The first origin's tensors


def _ops_section(diff: Diff) -> str:
    """The captures that would name the op inside an origin in a module's own code."""
    commands = diff.meta.get("ops_commands") or []
    if not commands:
        return ""
    return ("<h2 id=\"look-inside\">Look inside the module</h2><p>The fault is in a module's "
            "own code, whose ops were not captured. These commands capture them on both sides "
            "and name the op:</p><pre>" + escape("\n".join(commands)) + "</pre>")


def origin_section(diff: Diff, reader: PairReader) -> str:
    origin = diff.origin
    if origin is None:
        return ""
    what = f"{origin.site}, {origin.pass_} {origin.role}" + (
        f" (arg {origin.arg})" if origin.arg not in ("", "0") else "")
    head = f"<h2 id=\"origin\">The origin's tensors: {escape(what)}</h2>"
    row = _origin_row(diff, origin)
    try:  # as the diff compared them: sliced, transposed, at one loss scale
        ref, port = reader.read(row if row is not None else origin_row(origin))
    except (LayerdiffError, OSError, ValueError) as exc:
        # The page is still worth having without the pictures; say why they are missing.
        return head + f"<p class=\"note\">No tensor plots: {escape(str(exc))}</p>"
    rtol, atol = _tolerance(row, origin)
    source = row.get(Column.TOL_SOURCE, "") if row is not None else ""
    tol_text = f"rtol={rtol:.3g}, atol={atol:.3g}" + (f" ({source})" if present(source) else "")
    parts = [head, f"<p class=\"note\">Tolerance used: {escape(tol_text)}.</p>"]
    if origin.routing:
        parts.append("<p class=\"hint\">" + "<br>".join(
            escape(line[0].upper() + line[1:]) for line in routing_line(origin)) + "</p>")
    if origin.hint and not said_by_flip(origin):
        parts.append(f"<p class=\"hint\">Likely cause: <b>{escape(origin.hint['kind'])}</b>: "
                     f"{escape(origin.hint['evidence'])}</p>")
    if ref.size == 0 or port.size == 0:
        return "\n".join([*parts, "<p class=\"note\">The tensor is empty: nothing to draw.</p>"])
    if ref.shape == port.shape:
        parts.append(_heatmap_html(ref, port, rtol, atol))
    else:
        parts.append(f"<p class=\"note\">No element-wise map: the reference's shape "
                     f"{escape(str(ref.shape))} differs from the port's "
                     f"{escape(str(port.shape))}.</p>")
    parts.append(_histograms_html(ref, port))
    return "\n".join(parts)


def _origin_row(diff: Diff, origin: Origin) -> pd.Series | None:
    """The origin's row of the diff table: it holds the port's arg name and the tolerance."""
    rows = diff.rows
    if rows.empty:
        return None
    hit = rows[(rows[Column.STEP] == origin.step) & (rows[Column.PASS] == origin.pass_)
               & (rows[Column.SITE] == origin.site) & (rows[Column.ROLE] == origin.role)
               & (rows[Column.ARG] == origin.arg)]
    return None if hit.empty else hit.iloc[0]


def _tolerance(row: pd.Series | None, origin: Origin) -> tuple[float, float]:
    source: Any = row if row is not None else origin.metrics
    rtol, atol = source.get(Column.RTOL), source.get(Column.ATOL)
    rtol = float(rtol) if present(rtol) else 0.0
    atol = float(atol) if present(atol) else 0.0
    return rtol, atol


def _batch_matrix(values: np.ndarray) -> np.ndarray:
    """Rows are batch elements (axis 0); a tensor with fewer than two axes is one row."""
    if values.ndim < 2:
        return values.reshape(1, -1)
    return values.reshape(values.shape[0], -1)


def _heatmap_html(ref: np.ndarray, port: np.ndarray, rtol: float, atol: float) -> str:
    errors = _batch_matrix(judge.element_ratios(ref, port, rtol, atol))
    batch, width = errors.shape
    per_row = errors.max(axis=1) if errors.size else np.zeros(batch)
    pooled, col_factor = page.max_pool(errors, 1, MAX_HEATMAP_COLUMNS)
    pooled, row_factor = page.max_pool(pooled, 0, MAX_HEATMAP_ROWS)
    per_row_pooled, _ = page.max_pool(per_row[:, None], 0, MAX_HEATMAP_ROWS)
    png = page.png(_heatmap(pooled, per_row_pooled[:, 0], row_factor))
    bad = int(np.count_nonzero(per_row > 1))
    notes = [f"Tensor shape {tuple(ref.shape)}: {batch} batch element(s) × {width} value(s) "
             f"each; {bad} of {batch} batch element(s) have an element out of tolerance."]
    if col_factor > 1 or row_factor > 1:
        notes.append(f"Each cell is the maximum over {row_factor} × {col_factor} elements, so "
                     "a single bad element stays visible.")
    notes.append("Red is over tolerance, blue within, white exactly at it; the bars on the "
                 "right are each batch element's worst ratio.")
    return ("<h3>Error per batch element</h3>"
            + page.figure(png, "per-batch-element error heatmap", " ".join(notes),
                      element_id="heatmap"))


def _heatmap(pooled: np.ndarray, per_row: np.ndarray, row_factor: int) -> Figure:
    batch = pooled.shape[0]
    height = min(max(2.2, 0.28 * batch + 1.2), 6.5)
    fig = Figure(figsize=(10, height), dpi=DPI, layout="constrained")
    grid = fig.add_gridspec(1, 2, width_ratios=[6, 1])
    ax = fig.add_subplot(grid[0, 0])
    side = fig.add_subplot(grid[0, 1], sharey=ax)
    logs, norm = _log_ratio(pooled)
    image = ax.imshow(logs, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm)
    ax.set_ylabel("batch element" if row_factor == 1 else f"batch element (÷{row_factor})")
    ax.set_xlabel("element within the batch element (flattened, max-pooled)")
    if batch <= 32:
        ax.set_yticks(np.arange(batch))
    bar = fig.colorbar(image, ax=side, location="right", shrink=0.95, pad=0.02,
                       ticks=_decade_ticks(norm.vmin, norm.vmax))
    bar.ax.set_yticklabels([f"$10^{{{k}}}$" for k in _decade_ticks(norm.vmin, norm.vmax)],
                           fontsize=8)
    bar.set_label("error / tolerance", fontsize=9)
    _per_row_bars(side, per_row)
    return fig


def _log_ratio(ratio: np.ndarray) -> tuple[np.ndarray, TwoSlopeNorm]:
    """log10 of the ratio, clipped, with a colour scale whose centre is the tolerance."""
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    top = max(1.0, float(np.log10(finite.max())) if finite.size else 1.0)
    bottom = min(-3.0, float(np.log10(finite.min())) if finite.size else -3.0)
    bottom = max(bottom, -8.0)  # below 1e-8 of the tolerance is rounding noise: all one colour
    with np.errstate(divide="ignore"):
        logs = np.log10(ratio)
    logs = np.clip(np.where(np.isposinf(logs), top, logs), bottom, top)
    return logs, TwoSlopeNorm(vmin=bottom, vcenter=0.0, vmax=top)


def _decade_ticks(bottom: float, top: float) -> list[int]:
    """A few whole decades for the colour bar: its ends, the middle of the cool half, and 0
    (the tolerance). The two halves have different scales, so every decade would crowd."""
    low, high = math.ceil(bottom), math.floor(top)
    return sorted({low, round(low / 2), 0, high} - ({0} if low == 0 == high else set()))


def _per_row_bars(ax: Any, per_row: np.ndarray) -> None:
    """Beside the map: each batch element's worst ratio, to read the count of bad ones."""
    rows = np.arange(len(per_row))
    finite = per_row[np.isfinite(per_row) & (per_row > 0)]
    # Bars grow from a floor below the smallest ratio; 0 sits on the floor, inf at the top.
    floor = min(1e-3, float(finite.min()) / 10) if finite.size else 1e-3
    top = max(10.0, float(finite.max()) * 10) if finite.size else 10.0
    shown = np.clip(np.where(np.isfinite(per_row), per_row, top), floor, top)
    colours = [COLOURS[Status.ORIGIN] if v > 1 else COLOURS[Verdict.WITHIN] for v in per_row]
    ax.set_xscale("log")
    ax.barh(rows, shown - floor, left=floor, color=colours, height=0.7)
    ax.set_xlim(floor, top)
    ax.axvline(1.0, color="#444", linestyle="--", linewidth=1)
    ax.xaxis.set_major_locator(LogLocator(numticks=3))
    ax.set_xlabel("worst ratio", fontsize=9)
    ax.tick_params(axis="y", labelleft=False)
    ax.tick_params(axis="x", labelsize=8)
    ax.spines[["top", "right"]].set_visible(False)


def _histograms_html(ref: np.ndarray, port: np.ndarray) -> str:
    png = page.png(_histograms(ref, port))
    caption = ("Finite values only. Counts are on a log axis, so tails and a few large "
               "differences among many small ones stay visible.")
    return ("<h3>Values and differences</h3>"
            + page.figure(png, "histograms of reference values, port values and differences",
                      caption))


def _histograms(ref: np.ndarray, port: np.ndarray) -> Figure:
    fig = Figure(figsize=(10, 2.8), dpi=DPI, layout="constrained")
    axes = fig.subplots(1, 3)
    panels: list[tuple[str, np.ndarray | None, str]] = [
        ("reference values", ref, "#1f77b4"),
        ("port values", port, "#ff7f0e"),
        ("difference (port − reference)", port - ref if ref.shape == port.shape else None,
         "#d62728"),
    ]
    for ax, (title, values, colour) in zip(axes, panels, strict=True):
        _histogram(ax, title, values, colour)
    return fig


def _histogram(ax: Any, title: str, values: np.ndarray | None, colour: str) -> None:
    ax.set_title(title, fontsize=10, loc="left")
    ax.spines[["top", "right"]].set_visible(False)
    ax.tick_params(labelsize=8)
    # Gradients and differences are tiny: a shared 1e-4 offset keeps the tick labels short.
    ax.xaxis.set_major_locator(MaxNLocator(5))
    ax.ticklabel_format(axis="x", style="sci", scilimits=(-2, 4), useMathText=True)
    if values is None:
        ax.text(0.5, 0.5, "shapes differ", ha="center", va="center", transform=ax.transAxes)
        return
    flat = values.reshape(-1)
    if flat.size > MAX_HIST_VALUES:
        flat = flat[:: math.ceil(flat.size / MAX_HIST_VALUES)]
    with np.errstate(invalid="ignore", over="ignore"):
        finite = flat[np.isfinite(flat)]
    if finite.size == 0:
        ax.text(0.5, 0.5, "no finite values", ha="center", va="center", transform=ax.transAxes)
        return
    ax.hist(finite, bins=60, color=colour, alpha=0.85, log=True)
    ax.yaxis.set_minor_formatter(NullFormatter())  # "2×10¹" minor labels are noise
    hidden = flat.size - finite.size
    if hidden:
        ax.text(0.98, 0.95, f"{hidden:,} not finite", ha="right", va="top", fontsize=8,
                transform=ax.transAxes, color="#59636e")


# ---------------------------------------------------------------------------------------------
# Tables


def failing_section(diff: Diff) -> str:
    failing = diff.failing()
    head = "<h2>Rows out of tolerance</h2>"
    if failing.empty:
        return head + "<p class=\"note\">None.</p>"
    return head + page.table(failing, FAILING_COLUMNS, row_class=Column.STATUS)


def origins_section(diff: Diff) -> str:
    head = "<h2>Origins</h2>"
    flips = [f"<li>{escape(flip['text'])}</li>" for router in diff.meta.get("routing") or []
             for flip in router["flips"]]
    routing = ("<h3>Routing decisions that differ</h3><ul>" + "".join(flips) + "</ul>"
               if flips else "")  # top-k experts per token (compare/routing.py)
    routing += "".join(f"<p class=\"note\">{escape(text)}</p>" for text in forced_routing(diff))
    if not diff.origins:
        return head + "<p class=\"note\">None.</p>" + routing
    items = []
    for origin in diff.origins:
        holders = (f"<br><span class=\"note\">inside: {escape(', '.join(origin.holders))}"
                   "</span>" if origin.holders else "")
        hint = None if said_by_flip(origin) else origin.hint
        cause = (f"<br><span class=\"hint\">likely cause: <b>{escape(hint['kind'])}</b>: "
                 f"{escape(hint['evidence'])}</span>" if hint else "")
        pairing = (f"<br><span class=\"note\">{escape(origin.pairing)}</span>"
                   if origin.pairing else "")
        flip = "".join(f"<span class=\"hint\">{escape(line)}</span><br>"
                       for line in routing_line(origin))  # a flip leads: it says why first
        items.append(f"<li><b>{escape(describe_origin(origin))}</b>{pairing}<br>"
                     f"{flip}{escape(origin.reason)}{cause}{holders}</li>")
    return head + "<ol class=\"origins\">" + "".join(items) + "</ol>" + routing


def _unmatched_section(diff: Diff) -> str:
    head = "<h2>Records without a partner</h2>"
    if diff.unmatched.empty:
        return head + "<p class=\"note\">None: every record found its partner.</p>"
    return head + page.table(diff.unmatched, list(diff.unmatched.columns))


def _not_taken_section(diff: Diff) -> str:
    """Reference arguments the port's layers have no parameter for: left out of the input
    check, never a reason not to judge (the port computed its output from what it took)."""
    if diff.not_taken.empty:
        return ""
    return ("<h2>Not taken by the port</h2><p class=\"note\">Reference arguments the port's "
            "layer has no parameter for: left out of the input check; the port layer computed "
            "its output from what it took.</p>"
            + page.table(diff.not_taken, list(diff.not_taken.columns)))


def _meta_section(diff: Diff) -> str:
    if not diff.meta:
        return ""
    text = json.dumps(diff.meta, indent=2, sort_keys=True, default=str)
    return ("<details><summary>Options and provenance</summary>"
            f"<pre>{escape(text)}</pre></details>")


def _text_column(frame: pd.DataFrame, column: str) -> list[str]:
    return [str(v) if present(v) else "" for v in frame[column]]
