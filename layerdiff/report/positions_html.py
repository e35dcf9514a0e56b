"""The HTML report's error by position: failing records x positions, the relative error
(worst ratio to tolerance per position, compare/positions.py) on a log colour scale whose
centre is the tolerance (ratio 1), rows in execution order, the first origin's row marked.
Padding positions (compare/padding.py) are hatched, and a record that differs only there is
labelled so.

The numbers behind the picture are in the page too (a JSON script element, id
``position-errors``), so a reader or a test can take them without the pixels.
"""

from __future__ import annotations

import json
import math
from html import escape

import numpy as np
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Patch, Rectangle

from layerdiff.compare.judge import Verdict
from layerdiff.compare.result import Column, Diff
from layerdiff.report import page
from layerdiff.report.findings.diff import position_line
from layerdiff.report.page import DPI

MAX_ROWS = 64          # records drawn (the first failing ones, in execution order)
MAX_POSITIONS = 256    # positions drawn; more are max-pooled
LABEL_CHARS = 48


def positions_section(diff: Diff) -> str:
    """The section, or '' when no failing record has a sequence axis."""
    if not diff.positions:
        return ""
    keys = list(diff.positions)[:MAX_ROWS]
    origin = diff.origin
    origin_key = None if origin is None else (origin.step, origin.site, str(origin.role),
                                              origin.arg)
    length = max(diff.positions[key][1].size for key in keys)
    matrix = np.full((len(keys), length), np.nan)
    for i, key in enumerate(keys):
        ratios = diff.positions[key][1]
        matrix[i, :ratios.size] = ratios
    padding = np.zeros(matrix.shape, dtype=bool)  # some batch row is padding at that position
    by_step = (diff.meta.get("padding") or {}).get("padded_positions", {})
    for i, key in enumerate(keys):
        flags = np.asarray(diff.padding[key][0] if key in diff.padding
                           else by_step.get(str(key[0]), []), dtype=bool)
        if flags.size == diff.positions[key][1].size:
            padding[i, :flags.size] = flags
    only = _padding_only(diff)
    labels = [_label(key) + (" (padding only)" if key in only else "") for key in keys]
    highlight = keys.index(origin_key) if origin_key in keys else None
    pooled, factor = page.max_pool(np.nan_to_num(matrix, nan=0.0), 1, MAX_POSITIONS)
    hatched = page.max_pool(padding.astype(np.float64), 1, MAX_POSITIONS)[0] > 0
    png = page.png(_figure(pooled, labels, highlight, factor, hatched))
    shown_only = sum(key in only for key in keys)
    failing = len(keys) - shown_only
    notes = [", ".join(filter(None, [
        f"{failing} failing record(s)" if failing or not shown_only else "",
        f"{shown_only} that differ only at padding positions" if shown_only else ""]))
             + f" with a sequence axis of {length} positions, in execution order"
             + (f" (the first {MAX_ROWS} of {len(diff.positions)})"
                if len(diff.positions) > MAX_ROWS else "")
             + ". Each cell is the worst ratio of error to tolerance at that position; red is "
             "over tolerance, blue within, white exactly at it (ratio 1, the black line on the "
             "colour bar)."]
    if highlight is not None:
        notes.append("The first origin's row is framed.")
    if padding.any():
        notes.append("Hatched cells are padding positions (0 in the padding mask) of some batch "
                     "row; a row marked 'padding only' differs only there, where the reference's "
                     "gradient shows the loss does not read it, and passes.")
    if factor > 1:
        notes.append(f"Each cell is the maximum over {factor} positions.")
    data = {"records": labels, "origin_row": highlight,
            "ratios": [[_plain(v) for v in row] for row in matrix.tolist()],
            "padding": padding.tolist(),
            "padding_only_rows": [i for i, key in enumerate(keys) if key in only]}
    line = "" if origin is None or not origin.positions else (
        f"<p class=\"hint\">The origin, {escape(position_line(origin.positions))}</p>")
    return ("<h2 id=\"positions\">Error by position</h2>" + line
            + page.figure(png, "failing records by position heatmap", " ".join(notes),
                          element_id="position-heatmap")
            + "<script type=\"application/json\" id=\"position-errors\">"
            + json.dumps(data).replace("</", "<\\/") + "</script>")


def _padding_only(diff: Diff) -> set[tuple[int, str, str, str]]:
    rows = diff.rows
    if rows.empty:
        return set()
    rows = rows[rows[Column.VERDICT] == Verdict.PADDING]
    return {(int(step), str(site), str(role), str(arg)) for step, site, role, arg in zip(
        rows[Column.STEP], rows[Column.SITE], rows[Column.ROLE], rows[Column.ARG], strict=True)}


def _figure(ratios: np.ndarray, labels: list[str], highlight: int | None,
            factor: int, hatched: np.ndarray | None = None) -> Figure:
    rows, columns = ratios.shape
    height = min(max(2.4, 0.26 * rows + 1.4), 12.0)
    fig = Figure(figsize=(10, height), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    logs, norm = _log_ratio(ratios)
    image = ax.imshow(logs, aspect="auto", interpolation="nearest", cmap="RdBu_r", norm=norm)
    ax.set_yticks(np.arange(rows))
    ax.set_yticklabels(labels, fontsize=7 if rows > 24 else 8)
    ax.set_xlabel("position" if factor == 1 else f"position (÷{factor})")
    if columns <= 32:
        ax.set_xticks(np.arange(columns))
    if highlight is not None:
        ax.add_patch(Rectangle((-0.5, highlight - 0.5), columns, 1, fill=False,
                               edgecolor="black", linewidth=2))
        ax.get_yticklabels()[highlight].set_fontweight("bold")
    if hatched is not None and hatched.any():
        for row, column in zip(*np.nonzero(hatched), strict=True):
            ax.add_patch(Rectangle((column - 0.5, row - 0.5), 1, 1, fill=False, hatch="///",
                                   edgecolor="0.55", linewidth=0))
        ax.legend(handles=[Patch(facecolor="white", edgecolor="0.55", hatch="///",
                                 label="padding position (0 in the mask, some batch row)")],
                  loc="lower left", bbox_to_anchor=(0.0, 1.0), fontsize=8, frameon=False)
    ticks = _decade_ticks(norm.vmin, norm.vmax)
    bar = fig.colorbar(image, ax=ax, location="right", shrink=0.95, pad=0.02, ticks=ticks)
    bar.ax.set_yticklabels([f"$10^{{{k}}}$" for k in ticks], fontsize=8)
    bar.ax.axhline(0.0, color="black", linewidth=2)  # ratio 1: the tolerance
    bar.set_label("error / tolerance (log)", fontsize=9)
    return fig


def _log_ratio(ratio: np.ndarray) -> tuple[np.ndarray, TwoSlopeNorm]:
    """log10 of the ratio, clipped to [1e-8, its largest], centred at the tolerance."""
    finite = ratio[np.isfinite(ratio) & (ratio > 0)]
    top = max(1.0, float(np.log10(finite.max())) if finite.size else 1.0)
    bottom = max(min(-3.0, float(np.log10(finite.min())) if finite.size else -3.0), -8.0)
    with np.errstate(divide="ignore"):
        logs = np.log10(ratio)
    logs = np.clip(np.where(np.isposinf(logs), top, logs), bottom, top)
    return logs, TwoSlopeNorm(vmin=bottom, vcenter=0.0, vmax=top)


def _decade_ticks(bottom: float, top: float) -> list[int]:
    low, high = math.ceil(bottom), math.floor(top)
    return sorted({low, round(low / 2), 0, high} - ({0} if low == 0 == high else set()))


def _label(key: tuple[int, str, str, str]) -> str:
    step, site, role, arg = key
    text = f"{site} {role}" + ("" if arg in ("", "0") else f" '{arg}'") + (
        f" (step {step})" if step else "")
    return text if len(text) <= LABEL_CHARS else "…" + text[-(LABEL_CHARS - 1):]


def _plain(value: float) -> float | str | None:
    if math.isnan(value):
        return None
    return value if math.isfinite(value) else "inf"
