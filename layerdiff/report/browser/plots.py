"""The trace browser's dense images: the error per batch element and record, and norms over
many steps (a layer × step map). Both are matrices that can hold tens of thousands of cells, too
many for hand-drawn SVG (browser_svg draws the light charts).

matplotlib ``Figure`` objects rendered by Agg, never pyplot's global state; each function
returns a base64 PNG.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd
from matplotlib.colors import TwoSlopeNorm
from matplotlib.figure import Figure
from matplotlib.patches import Rectangle

from layerdiff.report.browser.data import BatchErrors
from layerdiff.report.page import DPI, max_pool, png
from layerdiff.trace.schema import Pass

BAD = "#d62728"
LABEL_ROWS_UP_TO = 80      # name each row of the batch image when it has this few


# ---------------------------------------------------------------------------------------------
# Norms per layer, many steps


def norms_heatmap(series: Sequence[tuple[str, pd.DataFrame]], layers: Sequence[str],
                  steps: Sequence[int]) -> str:
    """For many steps: per trace, a layer × step map of log10 norm, weights and gradients."""
    count = len(layers)
    height = min(40.0, 1.6 + 0.16 * count) * len(series)
    fig = Figure(figsize=(10, height), dpi=DPI, layout="constrained")
    axes = fig.subplots(len(series), 2, squeeze=False)
    for row, (label, frame) in enumerate(series):
        for col, column in enumerate(("weight", "grad")):
            ax = axes[row, col]
            table = frame.pivot_table(index="module", columns="step", values=column,
                                      aggfunc="first").reindex(index=layers, columns=steps)
            values = table.to_numpy(float)
            with np.errstate(divide="ignore", invalid="ignore"):
                logs = np.log10(np.where(values > 0, values, np.nan))
            image = ax.imshow(logs, aspect="auto", interpolation="nearest", cmap="viridis")
            fig.colorbar(image, ax=ax, shrink=0.9, pad=0.01).set_label("log10 norm", fontsize=8)
            ax.set_title(f"{label}: {'weight' if column == 'weight' else 'gradient'} norm",
                         loc="left", fontsize=10)
            ax.set_xlabel("step", fontsize=8)
            ax.tick_params(labelsize=7)
            if count <= 60:
                ax.set_yticks(np.arange(count), list(layers) if col == 0 else [""] * count)
            ticks = [t for t in ax.get_xticks() if 0 <= t < len(steps) and t == int(t)]
            ax.set_xticks(ticks, [str(steps[int(t)]) for t in ticks])
    return png(fig)


# ---------------------------------------------------------------------------------------------
# Batch elements


def batch_image(errors: BatchErrors, max_rows: int, max_columns: int) -> tuple[str, int, int]:
    """Records (rows, in order) × batch elements (columns), coloured by log10 of the worst
    error over tolerance: red out, blue within, white at the tolerance. Rows and columns past
    the caps are max-pooled, so one bad element stays visible. Returns the PNG and the row and
    column pooling factors."""
    matrix = np.array([row.ratios for row in errors.rows], dtype=float)
    labels = [row.label() for row in errors.rows]
    passes = [row.pass_ for row in errors.rows]
    matrix, row_factor = _pool(matrix, 0, max_rows)
    matrix, col_factor = _pool(matrix, 1, max_columns)
    rows, cols = matrix.shape
    finite = matrix[np.isfinite(matrix) & (matrix > 0)]
    top = max(1.0, float(np.log10(finite.max())) if finite.size else 1.0)
    bottom = max(min(-3.0, float(np.log10(finite.min())) if finite.size else -3.0), -8.0)
    with np.errstate(divide="ignore"):
        logs = np.log10(matrix)
    logs = np.clip(np.where(np.isnan(logs) | np.isposinf(logs), top, logs), bottom, top)
    labelled = row_factor == 1 and rows <= LABEL_ROWS_UP_TO
    height = min(12.0, max(2.6, 0.13 * rows + 1.4)) if labelled else 6.0
    # A fixed layout (constrained layout costs a second on a tall image), with room on the
    # left for the longest row label at 7 points a character.
    longest = max((len(label) for label in labels), default=10) if labelled else 12
    left = min(0.45, (longest * 7 * 0.62 / 72 + 0.3) / 10)
    fig = Figure(figsize=(10, height), dpi=DPI)
    fig.subplots_adjust(left=left, right=0.93, top=1 - 0.15 / height, bottom=0.6 / height)
    ax = fig.subplots()
    image = ax.imshow(logs, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=TwoSlopeNorm(vmin=bottom, vcenter=0.0, vmax=top))
    bar = fig.colorbar(image, ax=ax, shrink=0.9, pad=0.015, fraction=0.04)
    bar.set_label("log10 (error / tolerance)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    ax.set_xlabel("batch element" if col_factor == 1 else f"batch element (÷{col_factor})",
                  fontsize=9)
    if cols <= 64:
        ax.set_xticks(np.arange(cols), [str(i * col_factor) for i in range(cols)], fontsize=7)
    if labelled:
        ax.set_yticks(np.arange(rows), labels, fontsize=7)
        switch = next((i for i, p in enumerate(passes) if p == Pass.BACKWARD), None)
        if switch not in (None, 0):
            ax.axhline(switch - 0.5, color="#222", linewidth=1.2)
    else:
        ax.set_ylabel(f"record in execution order (÷{row_factor})" if row_factor > 1
                      else "record in execution order", fontsize=9)
    # outline the row to read: the origin (red), else the first row out (black)
    outlined = errors.origin or errors.first
    if outlined is not None and row_factor == 1:
        ax.add_patch(Rectangle((-0.5, errors.rows.index(outlined) - 0.5), cols, 1.0,
                               fill=False, linewidth=2.0,
                               edgecolor=BAD if errors.origin is not None else "#222"))
    return png(fig), row_factor, col_factor


def _pool(matrix: np.ndarray, axis: int, limit: int) -> tuple[np.ndarray, int]:
    """Max-pool ``axis`` down to at most ``limit`` entries (NaN counted as the worst)."""
    return max_pool(np.where(np.isnan(matrix), np.inf, matrix), axis, limit)
