"""The trace browser's light charts as inline SVG drawn by hand: ranges per site, norms per
layer, histograms.

Why not matplotlib here: a matplotlib figure costs 0.4-1 s to lay out and render, an SVG of the
same chart a few milliseconds, so a page can hold every site's histograms; and each bar carries
a tooltip (``<title>``) with its numbers, as a debugger window shows them on hover. Inline SVG
needs no namespace in HTML5, so the page names no URL at all. All text is escaped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from html import escape
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.report.page import number_cell
from layerdiff.report.text import clip_left

REF, PORT, BAD = "#1f77b4", "#ff7f0e", "#d62728"
SERIES = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#17becf"]
WIDTH = 1080
LABEL_TICKS_UP_TO = 40      # name each site under the x axis when a panel has this few


def _svg(width: float, height: float, body: list[str], css: str = "chart") -> str:
    return (f'<svg viewBox="0 0 {width:.0f} {height:.0f}" width="{width:.0f}" '
            f'height="{height:.0f}" role="img" class="{css}">' + "".join(body) + "</svg>")


def _decade_label(k: int, negative: bool = False) -> str:
    return f"{'−' if negative else ''}1e{k}"


# ---------------------------------------------------------------------------------------------
# Symmetric-log scale


class SymLog:
    """y = sign(v)·(1 + log10(|v|/t)) beyond the threshold t, linear (v/t) inside it: values
    from 1e-6 gradients to 1e3 activations keep their shape, and 0 and signs stay visible."""

    def __init__(self, values: np.ndarray) -> None:
        finite = np.abs(values[np.isfinite(values)])
        positive = finite[finite > 0]
        self.threshold = float(max(np.quantile(positive, 0.1) / 10, positive.max() * 1e-12,
                                   1e-30)) if positive.size else 1.0
        top = float(positive.max()) if positive.size else 1.0
        self.top = self.warp(max(top, self.threshold)) * 1.04   # headroom over the largest
        self.negative = bool(np.isfinite(values).any() and np.nanmin(
            np.where(np.isfinite(values), values, np.nan)) < 0)

    def warp(self, value: float) -> float:
        magnitude = abs(value)
        if magnitude <= self.threshold:
            return value / self.threshold
        return math.copysign(1 + math.log10(magnitude / self.threshold), value)

    def ticks(self) -> list[tuple[float, str]]:
        """0 and at most four whole decades a side."""
        high = math.floor(math.log10(self.threshold) + self.top - 1 + 1e-9)  # under the max
        low = math.floor(math.log10(self.threshold)) + 1
        decades = list(range(high, low - 1, -max(1, math.ceil((high - low + 1) / 4))))
        found = [(0.0, "0")] + [(10.0**k, _decade_label(k)) for k in decades]
        if self.negative:
            found += [(-(10.0**k), _decade_label(k, True)) for k in decades]
        return [(v, t) for v, t in found if abs(self.warp(v)) <= self.top * 1.0001]


# ---------------------------------------------------------------------------------------------
# Ranges per site


def ranges_svg(frames: Sequence[pd.DataFrame], step: int, grad_note: str) -> str:
    """Two panels, sites in forward execution order on x: each site's output range (a bar from
    min to max, a tick at the mean) and the range of the gradient arriving at its output; red
    columns where a tensor holds NaN or Inf. ``frames``: the reference's ranges, then the port's
    on the same rows (pair mode)."""
    names = frames[0]["site"].tolist()
    count = max(len(names), 1)
    labelled = len(names) <= LABEL_TICKS_UP_TO
    left, right, panel, gap = 64, 12, 230, 34
    longest = max((len(n) for n in names), default=0)
    bottom = 24 + int(0.64 * 6.2 * min(longest, 40)) if labelled else 34  # sin 40° of the text
    slot = (WIDTH - left - right) / count
    body: list[str] = []
    for n, (prefix, title) in enumerate((("out", "forward: output values"),
                                         ("grad", "backward: gradient at the output"
                                          + grad_note))):
        top = 8 + n * (panel + gap)
        body.append(f'<text x="{left}" y="{top + 12}" class="t">{escape(title)}</text>')
        body += _range_panel(frames, prefix, left, top + 20, slot, panel - 20)
    axis_y = 8 + 2 * panel + gap
    if labelled:
        for i, name in enumerate(names):
            x = left + (i + 0.5) * slot
            body.append(f'<text transform="translate({x:.1f},{axis_y + 10}) rotate(-40)" '
                        f'class="n" text-anchor="end">{escape(name)}</text>')
    else:
        body.append(f'<text x="{left + (WIDTH - left - right) / 2:.0f}" y="{axis_y + 22}" '
                    f'class="n" text-anchor="middle">site in forward execution order '
                    f'(step {step}, {len(names):,} sites)</text>')
    if len(frames) > 1:
        body.append(f'<text x="{WIDTH - right}" y="20" class="n" text-anchor="end">'
                    f'<tspan fill="{REF}">■ reference</tspan>  '
                    f'<tspan fill="{PORT}">■ port</tspan></text>')
    return _svg(WIDTH, axis_y + bottom, body)


def _range_panel(frames: Sequence[pd.DataFrame], prefix: str, left: float, top: float,
                 slot: float, height: float) -> list[str]:
    columns = [f"{prefix}_{c}" for c in ("min", "max", "mean", "nan", "inf")]
    extremes = np.concatenate([f[columns[:2]].to_numpy(float).ravel() for f in frames])
    scale = SymLog(extremes)
    span = scale.top if not scale.negative else 2 * scale.top
    base = top + (height / 2 if scale.negative else height)

    def y_of(value: float) -> float:
        return base - scale.warp(value) / span * height

    width = slot * len(frames[0])
    parts = [f'<rect x="{left}" y="{top}" width="{width:.1f}" height="{height}" class="bg"/>']
    for value, label in scale.ticks():
        y = y_of(value)
        parts.append(f'<line x1="{left}" x2="{left + width:.1f}" y1="{y:.1f}" y2="{y:.1f}" '
                     f'class="{"z" if value == 0 else "g"}"/><text x="{left - 5}" '
                     f'y="{y + 3:.1f}" class="n" text-anchor="end">{label}</text>')
    bar = max(min(slot * 0.7 / len(frames), 12.0), 0.8)
    for i in range(len(frames[0])):
        flags = []
        for k, frame in enumerate(frames):
            lo, hi, mean, nan, inf = (float(frame[c].iat[i]) for c in columns)
            nan, inf = _count(nan), _count(inf)   # NaN here: a port with no such site
            if nan or inf:
                flags.append("/".join(w for w, c in (("NaN", nan), ("Inf", inf)) if c))
            if not (math.isfinite(lo) and math.isfinite(hi)):
                continue
            x = left + (i + 0.5) * slot + (k - (len(frames) - 1) / 2) * bar
            y_hi, y_lo = y_of(hi), y_of(lo)
            tip = (f"{frame['site'].iat[i]} ({('reference', 'port')[k]}): min {number_cell(lo)}, "
                   f"max {number_cell(hi)}, mean {number_cell(mean)}")
            parts.append(f'<rect x="{x - bar / 2:.1f}" y="{y_hi:.1f}" width="{bar:.1f}" '
                         f'height="{max(y_lo - y_hi, 1.5):.1f}" fill="{(REF, PORT)[k]}">'
                         f"<title>{escape(tip)}</title></rect>")
            if math.isfinite(mean) and bar >= 3:
                y = y_of(mean)
                parts.append(f'<line x1="{x - bar / 2:.1f}" x2="{x + bar / 2:.1f}" '
                             f'y1="{y:.1f}" y2="{y:.1f}" class="m"/>')
        if flags:
            x = left + i * slot
            parts.append(f'<rect x="{x:.1f}" y="{top}" width="{max(slot, 2):.1f}" '
                         f'height="{height}" fill="{BAD}" fill-opacity="0.18"><title>'
                         f"{escape(frames[0]['site'].iat[i])}: {escape(', '.join(flags))}"
                         "</title></rect>")
            if slot >= 14:
                parts.append(f'<text x="{x + slot / 2:.1f}" y="{top + 11}" class="bad" '
                             f'text-anchor="middle">{escape(flags[0])}</text>')
    return parts


# ---------------------------------------------------------------------------------------------
# Norms per layer


def norms_svg(series: Sequence[tuple[str, pd.DataFrame]], layers: Sequence[str]) -> str:
    """Horizontal bars on log axes, one group per layer (execution order, top down), one bar
    per series (a step, or a trace at a step): weight norms left, gradient norms right. A norm
    that is not finite is written in red instead of a bar."""
    label_width = min(260, 14 + 6.2 * max((len(layer) for layer in layers), default=4))
    rows = max(len(layers), 1)
    bar = 5.0 if len(series) > 2 else 7.0
    row = max(14.0, bar * len(series) + 5)
    top = 40 if len(series) > 1 else 22
    height = top + row * rows + 26
    panel = (WIDTH - label_width - 24) / 2
    body = []
    for i, layer in enumerate(layers):
        y = top + (i + 0.5) * row
        body.append(f'<text x="{label_width - 6:.0f}" y="{y + 3:.1f}" class="n" '
                    f'text-anchor="end">{escape(clip_left(layer, int(label_width / 6.2)))}'
                    "</text>")
    for p, (column, title) in enumerate((("weight", "weight norm"),
                                         ("grad", "gradient norm"))):
        x0 = label_width + p * (panel + 24)
        body.append(f'<text x="{x0:.0f}" y="14" class="t">{title}</text>')
        body += _norm_panel(series, layers, column, x0, top, panel, row, bar)
    if len(series) > 1:
        x = label_width
        legend = []
        for k, (label, _) in enumerate(series):
            legend.append(f'<tspan fill="{SERIES[k % len(SERIES)]}">■ {escape(label)}</tspan>')
        body.append(f'<text x="{x:.0f}" y="30" class="n">' + "  ".join(legend) + "</text>")
    return _svg(WIDTH, height, body)


def _norm_panel(series: Sequence[tuple[str, pd.DataFrame]], layers: Sequence[str],
                column: str, x0: float, top: float, width: float, row: float,
                bar: float) -> list[str]:
    tables = [frame.drop_duplicates("module").set_index("module").reindex(layers)
              for _, frame in series]
    values = np.concatenate([t[column].to_numpy(float) for t in tables]) if tables else (
        np.array([]))
    positive = values[np.isfinite(values) & (values > 0)]
    parts = [f'<rect x="{x0:.1f}" y="{top}" width="{width:.1f}" height="{row * len(layers):.1f}"'
             ' class="bg"/>']
    # a log axis over whole decades holding every finite positive norm (any, if none is)
    lo = math.floor(math.log10(positive.min()) - 0.3) if positive.size else 0
    hi = max(math.ceil(math.log10(positive.max()) + 0.1) if positive.size else 1, lo + 1)

    def x_of(value: float) -> float:
        return x0 + width * (math.log10(value) - lo) / (hi - lo)

    every = max(1, math.ceil((hi - lo) / 6))
    for k in range(lo, hi + 1, every) if positive.size else ():
        x = x_of(10.0**k)
        # the end labels inside the panel, so two panels' labels never meet
        anchor = "start" if k == lo else "end" if k + every > hi else "middle"
        parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top}" '
                     f'y2="{top + row * len(layers):.1f}" class="g"/><text x="{x:.1f}" '
                     f'y="{top + row * len(layers) + 14:.1f}" class="n" '
                     f'text-anchor="{anchor}">1e{k}</text>')
    for i, layer in enumerate(layers):
        for k, table in enumerate(tables):
            value = float(table[column].iat[i])
            # a layer the port lacks has NaN here, and bool(NaN) is True
            flag = table[f"{column}_bad"].iat[i] if f"{column}_bad" in table else False
            bad = isinstance(flag, (bool, np.bool_)) and bool(flag)
            y = top + i * row + 2.5 + k * bar
            if bad or (not math.isnan(value) and not math.isfinite(value)):
                parts.append(f'<text x="{x0 + 4:.1f}" y="{y + bar:.1f}" class="bad">'
                             "not finite</text>")
            elif math.isfinite(value) and value > 0:
                tip = f"{layer} ({series[k][0]}): {column} norm {number_cell(value)}"
                parts.append(f'<rect x="{x0:.1f}" y="{y:.1f}" '
                             f'width="{max(x_of(value) - x0, 1):.1f}" height="{bar - 1:.1f}" '
                             f'fill="{SERIES[k % len(SERIES)]}"><title>{escape(tip)}</title>'
                             "</rect>")
    return parts


def _count(value: float) -> int:
    return int(value) if math.isfinite(value) else 0


# ---------------------------------------------------------------------------------------------
# Histograms


def histogram_svg(panels: Sequence[tuple[str, np.ndarray | None, list[tuple[str, Any]]]]
                  ) -> str:
    """One panel per (title, bin edges, [(side, (counts, not finite) | reason)]): the reference
    as filled bars, the port as a step line on the same bins; counts on a log axis."""
    width, height = 520, 170
    body = [f'<g transform="translate({n * width},0)">{_histogram_panel(*panel, width, height)}'
            "</g>" for n, panel in enumerate(panels)]
    return _svg(width * max(len(panels), 1), height, body, "chart hist")


def _histogram_panel(title: str, edges: np.ndarray | None, sides: list[tuple[str, Any]],
                     width: int, height: int) -> str:
    left, right, top, bottom = 46, 14, 22, 30
    plot_w, plot_h = width - left - right, height - top - bottom
    parts = [f'<text x="{left}" y="14" class="t">{escape(title)}</text>']
    drawn = [(side, d) for side, d in sides if not isinstance(d, str) and edges is not None]
    notes = [f"{side}: {d}" for side, d in sides if isinstance(d, str)]
    notes += [f"{side}: {d[1]:,} not finite" for side, d in drawn if d[1]]
    peak = max((int(d[0].max()) for _, d in drawn if d[0].size), default=0)
    if edges is not None and peak > 0:
        scale = math.log10(peak + 1)

        def y_of(count: float) -> float:
            return top + plot_h * (1 - math.log10(count + 1) / scale)

        parts += _histogram_bars(drawn, edges, left, plot_w, top + plot_h, y_of)
        for count in _decades(peak):
            y = y_of(count)
            label = f"{count:,}" if count < 10**4 else f"1e{round(math.log10(count))}"
            parts.append(f'<line x1="{left - 3}" x2="{left}" y1="{y:.1f}" y2="{y:.1f}" '
                         f'class="a"/><text x="{left - 5}" y="{y + 3:.1f}" class="n" '
                         f'text-anchor="end">{label}</text>')
        lo, hi = float(edges[0]), float(edges[-1])
        ticks = [(lo, "start"), (hi, "end")] + ([(0.0, "middle")] if lo < 0 < hi else [])
        for value, anchor in ticks:
            x = left + plot_w * (value - lo) / (hi - lo)
            parts.append(f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{top + plot_h}" '
                         f'y2="{top + plot_h + 4}" class="a"/><text x="{x:.1f}" '
                         f'y="{top + plot_h + 15}" class="n" text-anchor="{anchor}">'
                         f"{'0' if value == 0 else f'{value:.3g}'}</text>")
        if len(drawn) > 1:
            parts.append(f'<text x="{width - right}" y="14" class="n" text-anchor="end">'
                         f'<tspan fill="{REF}">■ reference</tspan> '
                         f'<tspan fill="{PORT}">— port</tspan></text>')
    elif not notes:
        notes.append("no finite values")
    parts.append(f'<line x1="{left}" x2="{left + plot_w}" y1="{top + plot_h}" '
                 f'y2="{top + plot_h}" class="a"/><line x1="{left}" x2="{left}" y1="{top}" '
                 f'y2="{top + plot_h}" class="a"/>')
    for i, note in enumerate(notes):
        css = "bad" if "not finite" in note else "n"
        parts.append(f'<text x="{left + 6}" y="{top + 12 + 12 * i}" class="{css}">'
                     f"{escape(note)}</text>")
    return "".join(parts)


def _histogram_bars(drawn: list[tuple[str, Any]], edges: np.ndarray, left: float,
                    plot_w: float, floor: float, y_of: Callable[[float], float]) -> list[str]:
    step = plot_w / (len(edges) - 1)
    lo, hi = float(edges[0]), float(edges[-1])
    parts = []
    for k, (side, (counts, _)) in enumerate(drawn):
        if k == 0:
            for i, count in enumerate(counts):
                if count:
                    y = y_of(count)
                    a = lo + (hi - lo) * i / len(counts)
                    b = lo + (hi - lo) * (i + 1) / len(counts)
                    parts.append(f'<rect x="{left + i * step:.1f}" y="{y:.1f}" '
                                 f'width="{max(step - 0.6, 0.6):.1f}" height="{floor - y:.1f}" '
                                 f'fill="{REF}" fill-opacity="0.8"><title>{escape(side)}: '
                                 f"{count:,} in [{a:.4g}, {b:.4g})</title></rect>")
        else:
            points = []
            for i, count in enumerate(counts):
                y = y_of(count)
                points += [f"{left + i * step:.1f},{y:.1f}", f"{left + (i + 1) * step:.1f},{y:.1f}"]
            parts.append(f'<polyline points="{" ".join(points)}" fill="none" stroke="{PORT}" '
                         'stroke-width="1.6"/>')
    return parts


def _decades(peak: int) -> list[int]:
    top = math.floor(math.log10(peak)) if peak else 0
    every = max(1, math.ceil((top + 1) / 4))
    return [10**k for k in range(0, top + 1, every)]


CSS = """
svg.chart { display: block; max-width: 100%; height: auto;
            font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; }
svg.chart .t { font-size: 12px; fill: #1f2328; font-weight: 600; }
svg.chart .n { font-size: 10px; fill: #59636e; }
svg.chart .bad { font-size: 10px; fill: #d62728; font-weight: 700; }
svg.chart .a { stroke: #8c959f; stroke-width: 1; }
svg.chart .g { stroke: #eceff1; stroke-width: 1; }
svg.chart .z { stroke: #8c959f; stroke-width: 0.8; }
svg.chart .m { stroke: #1f2328; stroke-width: 1.4; }
svg.chart .bg { fill: #fff; stroke: #d8dee4; }
"""
