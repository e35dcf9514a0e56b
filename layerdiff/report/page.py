"""The HTML kit: one self-contained page's shell, styles, inline images and tables.

Every HTML page layerdiff writes (the diff report, the diverge page, the trace browser) is
built from these: inline CSS, plots as base64 PNG data URIs drawn through matplotlib's
``Figure`` (never pyplot's global state), tables that escape every cell. Nothing is fetched,
so a page can be mailed, attached to a CI run or opened offline.
"""

from __future__ import annotations

import base64
import io
import math
from collections.abc import Iterable, Sequence
from html import escape
from typing import Any

import numpy as np
import pandas as pd
from matplotlib.figure import Figure

from layerdiff.report.text import number

DPI = 110
MAX_TABLE_ROWS = 200

# Columns that may be long wrap, so a table fits the page's width: module paths after a dot,
# sentences at spaces.
NAME_COLUMNS = frozenset({"site", "port_site", "cause"})
TEXT_COLUMNS = frozenset({"reason", "note"})

CSS = """
:root { --fail: #c62828; --pass: #2e7d32; --ink: #1f2328; --muted: #59636e;
        --line: #d8dee4; --soft: #f6f8fa; }
* { box-sizing: border-box; }
body { margin: 0; background: #fff; color: var(--ink);
       font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial,
             sans-serif; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 20px 48px; }
h2 { font-size: 18px; margin: 36px 0 8px; padding-bottom: 4px; border-bottom: 1px solid
     var(--line); font-weight: 600; }
h3 { font-size: 15px; margin: 20px 0 6px; font-weight: 600; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 13px; }
.banner { display: flex; align-items: center; gap: 20px; padding: 16px 20px;
          border-radius: 8px; color: #fff; }
.banner.fail { background: var(--fail); }
.banner.pass { background: var(--pass); }
.verdict { font-size: 40px; font-weight: 800; letter-spacing: 2px; line-height: 1; }
.banner p { margin: 0; font-size: 16px; }
.facts { display: grid; grid-template-columns: max-content 1fr; gap: 4px 16px;
         margin: 16px 0 0; }
.facts dt { color: var(--muted); }
.facts dd { margin: 0; overflow-wrap: anywhere; }
.counts { display: flex; flex-wrap: wrap; gap: 12px; margin-top: 16px; }
.count { border: 1px solid var(--line); border-radius: 6px; padding: 6px 14px;
         background: var(--soft); }
.count b { display: block; font-size: 20px; }
.count span { color: var(--muted); font-size: 13px; }
.count.bad b { color: var(--fail); }
figure { margin: 8px 0 0; }
figure img { display: block; max-width: 100%; height: auto; }
figcaption, .note { color: var(--muted); font-size: 13px; }
.note { margin: 6px 0; }
table { border-collapse: collapse; width: 100%; font-size: 13px; margin-top: 6px; }
th, td { text-align: left; padding: 4px 6px; border-bottom: 1px solid var(--line);
         vertical-align: top; white-space: nowrap; }
td.name, td.text { white-space: normal; overflow-wrap: break-word; min-width: 14ch; }
th { background: var(--soft); font-weight: 600; position: sticky; top: 0; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
.table-wrap { overflow: auto; max-height: 640px; border-bottom: 1px solid var(--line); }
tr.origin td:first-child { border-left: 4px solid #d62728; }
tr.propagated td:first-child { border-left: 4px solid #ff7f0e; }
tr.holds-origin td:first-child { border-left: 4px solid #9467bd; }
ol.origins li { margin-bottom: 6px; }
.hint { color: #1f4e79; }
details { margin-top: 8px; }
pre { background: var(--soft); padding: 10px; border-radius: 6px; overflow-x: auto;
      font-size: 12px; }
"""


def document(title: str, sections: Iterable[str], css: str = CSS) -> str:
    """A whole page: ``title`` (plain text, escaped here), ``css`` inline, and the non-empty
    ``sections`` (HTML) in order."""
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
            f"<title>{escape(title)}</title><style>{css}</style></head>\n<body><main>\n"
            + "\n".join(s for s in sections if s) + "\n</main></body></html>\n")


def png(fig: Figure, dpi: int = DPI) -> str:
    """The figure as base64 PNG. Figure.savefig renders with Agg; no pyplot, no display."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi, facecolor="white")
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def figure(image: str, alt: str, caption: str, element_id: str | None = None) -> str:
    """An inline PNG (base64, see :func:`png`) with its caption; ``caption`` is plain text
    and is escaped here."""
    ident = f" id=\"{escape(element_id)}\"" if element_id else ""
    return (f"<figure{ident}><img src=\"data:image/png;base64,{image}\" alt=\"{escape(alt)}\">"
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def max_pool(matrix: np.ndarray, axis: int, limit: int) -> tuple[np.ndarray, int]:
    """Max-pool ``axis`` down to at most ``limit`` entries: a single bad element stays visible."""
    n = matrix.shape[axis]
    if n <= limit:
        return matrix, 1
    factor = math.ceil(n / limit)
    pad = [(0, 0), (0, 0)]
    pad[axis] = (0, factor * math.ceil(n / factor) - n)
    padded = np.pad(matrix, pad, constant_values=0.0)
    if axis == 1:
        return padded.reshape(padded.shape[0], -1, factor).max(axis=2), factor
    return padded.reshape(-1, factor, padded.shape[1]).max(axis=1), factor


def table(frame: pd.DataFrame, columns: Sequence[str], row_class: str | None = None, *,
          limit: int = MAX_TABLE_ROWS, names: frozenset[str] = NAME_COLUMNS,
          texts: frozenset[str] = TEXT_COLUMNS) -> str:
    """An HTML table of at most ``limit`` rows, with a note of how many were left out.
    ``row_class``: the column whose value is each row's CSS class; ``names`` and ``texts``:
    the columns that wrap (module paths after a dot, sentences at spaces)."""
    columns = [c for c in columns if c in frame.columns]
    shown = frame.head(limit)
    head = "".join(f"<th>{escape(c)}</th>" for c in columns)
    body = []
    for record in shown.to_dict(orient="records"):
        css = record.get(row_class) if row_class else None
        attr = f" class=\"{escape(str(css))}\"" if present(css) else ""
        cells = "".join(cell(record.get(c), c, names=names, texts=texts) for c in columns)
        body.append(f"<tr{attr}>{cells}</tr>")
    more = len(frame) - len(shown)
    note = (f"<p class=\"note\">{more:,} more row(s) not shown; the JSON or CSV report has "
            "them all.</p>" if more > 0 else "")
    return (f"<div class=\"table-wrap\"><table><thead><tr>{head}</tr></thead><tbody>"
            + "".join(body) + "</tbody></table></div>" + note)


def cell(value: Any, column: str, *, names: frozenset[str] = NAME_COLUMNS,
         texts: frozenset[str] = TEXT_COLUMNS) -> str:
    """One ``<td>``: numbers right-aligned (a blank for NaN), names and sentences wrapping."""
    if isinstance(value, (bool, np.bool_)):
        return f"<td>{escape(str(bool(value)))}</td>"
    if isinstance(value, (int, np.integer)):
        return f"<td class=\"num\">{int(value)}</td>"
    if isinstance(value, (float, np.floating)):
        return f"<td class=\"num\">{escape(number_cell(value))}</td>"
    text = escape(str(value)) if present(value) else ""
    if column in names:
        return f"<td class=\"name\">{breakable(text)}</td>"
    if column in texts:
        return f"<td class=\"text\">{text}</td>"
    return f"<td>{text}</td>"


def number_cell(value: Any) -> str:
    """A number as a table cell shows it: the text kit's format, blank for None and NaN."""
    return number(value, missing="")


def breakable(escaped: str) -> str:
    """A module path (HTML, already escaped) with a break opportunity after each dot."""
    return escaped.replace(".", ".<wbr>")


def present(value: Any) -> bool:
    """False for None, NaN and the empty string: cells pandas leaves blank."""
    if value is None:
        return False
    if isinstance(value, str):
        return value != ""
    if isinstance(value, (float, np.floating)):
        return not math.isnan(value)
    return True
