"""The trace browser's histograms: which sites get them, and the section that draws them.

A site's histograms show its first output (values) and the first gradient arriving at its
outputs, streamed from the trace in 1 MiB chunks into 60 bins fixed by the index's min and
max (see :func:`layerdiff.report.browser.data.histogram`), so memory stays bounded. In pair
mode the port's tensor is counted on the same bins.
"""

from __future__ import annotations

from html import escape
from typing import Any

import pandas as pd

from layerdiff.compare.pair import PairReader
from layerdiff.compare.result import Column
from layerdiff.errors import TraceError
from layerdiff.report.browser import data, svg
from layerdiff.report.browser.sections import Page
from layerdiff.trace.reader import Trace
from layerdiff.trace.schema import GRAD_ROLES

# A trace is "small", and every site gets histograms, when the tensors they read (one output
# and one gradient per site at the step shown, both traces in pair mode) come to at most
# HIST_BUDGET_BYTES and the sites number at most MAX_HIST_SITES. Reading 64 MiB takes well
# under a second; each site adds about 10 KB of SVG to the page (2 MB at the cap).
HIST_BUDGET_BYTES = 64 << 20
MAX_HIST_SITES = 200


def histogram_sites(page: Page, order: list[str], globs: list[str], summary: bool) -> list[str]:
    """The sites to draw: those ``globs`` name (an error when they name none), else every
    site of a small trace, else none (with a note saying how to ask)."""
    if globs:
        chosen = data.match_sites(order, globs)
        if not chosen:
            raise TraceError(f"{page.ref.path}: no site at step {page.step} matches --site "
                             f"{' '.join(globs)}; `layerdiff show {page.ref.path} --by-site` "
                             "lists the sites")
        if summary:
            return []
        if len(chosen) > MAX_HIST_SITES:
            page.notes.append(f"Histograms are drawn for the first {MAX_HIST_SITES} of the "
                              f"{len(chosen)} sites --site names.")
        return chosen[:MAX_HIST_SITES]
    if summary:
        return []
    plan = data.histogram_plan(page.ref, page.step)
    nbytes = sum(int(r["nbytes"]) for site in order for r in plan.get(site, []))
    nbytes *= 2 if page.port is not None else 1
    if nbytes <= HIST_BUDGET_BYTES and len(order) <= MAX_HIST_SITES:
        return order
    page.notes.append(
        f"Histograms are drawn only for the sites --site names: every site's would read "
        f"{nbytes / 2**20:,.1f} MiB at {len(order)} sites, over a small trace's budget of "
        f"{HIST_BUDGET_BYTES / 2**20:g} MiB and {MAX_HIST_SITES} sites.")
    return []


def histogram_section(page: Page, sites: list[str], summary: bool) -> str:
    head = f"<h2 id=\"histograms\">Histograms (step {page.step})</h2>"
    if summary:
        which = [str(t.path) for t in (page.ref, page.port) if t is not None and t.summary]
        return head + ("<p class=\"note\">No histograms: " + escape(" and ".join(which))
                       + " is a summary trace (statistics only); histograms need a full trace: "
                       "capture without --summary.</p>")
    if not sites:
        return head + ("<p class=\"note\">No histograms drawn: pass --site GLOB (repeatable) to "
                       "choose the sites.</p>")
    streams = [data.TensorStream(page.ref)] + (
        [data.TensorStream(page.port)] if page.port is not None else [])
    plan = data.histogram_plan(page.ref, page.step)
    planned = [(site, plan.get(site, [])) for site in sites]
    total = sum(int(r["nbytes"]) for _, rows in planned for r in rows) * len(streams)
    done = 0
    parts = [head, "<p class=\"note\">Finite values only, counts on a log axis; the bins span "
             "the values' range from the index. Values: the site's first output; gradients: "
             "the first gradient arriving at its outputs"
             + (" (÷ loss scale)" if page.ref.loss_scale != 1.0 else "")
             + (". Reference filled blue, port as an orange line." if page.port else ".")
             + "</p>"]
    partners = _port_records(page) if page.port is not None else {}
    for n, (site, rows) in enumerate(planned):
        panels = []
        for row in rows:
            sides: list[tuple[str, Trace, pd.Series | None]] = [("reference", page.ref, row)]
            if page.port is not None:
                sides.append(("port", page.port,
                              partners.get((site, str(row["role"]), str(row["arg"])))))
            panels.append(_panel(row, sides, streams))
            done += int(row["nbytes"]) * len(streams)
            if page.progress is not None:
                page.progress(done, total)
        title = f"<h3 id=\"hist-{n}\">{escape(site)}</h3>"
        if not panels:
            parts.append(title + "<p class=\"note\">No output or gradient tensor recorded "
                         "here.</p>")
        else:
            parts.append(title + f"<figure class=\"chart\">{svg.histogram_svg(panels)}</figure>")
    return "\n".join(parts)


def _port_records(page: Page) -> dict[tuple[str, str, str], pd.Series]:
    """The port's tensor record paired with each reference (site, role, arg) at the step
    shown, as the diff paired them (read through :class:`PairReader`, whose by-name table is
    built once: a pandas filter per record costs 15 ms, seconds over a page of sites)."""
    assert page.port is not None and page.diff is not None
    reader = PairReader(page.ref, page.port, page.diff.pairs)
    rows = page.diff.rows
    rows = rows[rows[Column.STEP] == page.step]
    found: dict[tuple[str, str, str], pd.Series] = {}
    shown = [Column.STEP, Column.SITE, Column.ROLE, Column.ARG, Column.PORT_SITE, Column.PORT_ARG]
    for row in rows[shown].to_dict("records"):
        port = reader.records(row)[1]
        if port is not None:
            found[(row[Column.SITE], row[Column.ROLE], row[Column.ARG])] = port
    return found


def _panel(row: pd.Series, sides: list[tuple[str, Trace, pd.Series | None]],
           streams: list[data.TensorStream]) -> tuple[str, Any, list[tuple[str, Any]]]:
    """(title, bin edges, [(side, (counts, not finite) | why not)]) for one record."""
    grad = row["role"] in GRAD_ROLES
    title = (f"{'gradient' if grad else 'values'}: {row['role']}"
             + ("" if row["arg"] == "0" else f" '{row['arg']}'")
             + f" ({row['shape'] or 'scalar'}, {row['dtype']})")
    scales = [trace.loss_scale if grad else 1.0 for _, trace, _ in sides]
    present = [(r, s) for (_, _, r), s in zip(sides, scales, strict=True)
               if r is not None and data.readable(r)]
    edges = data.bin_edges(present) if present else None
    if edges is None and present:   # an Inf in the range: find the finite one in the data
        edges = data.finite_range(streams[0], row, scales[0]) if data.readable(row) else None
    counted: list[tuple[str, Any]] = []
    for (name, _, r), scale, stream in zip(sides, scales, streams, strict=True):
        if r is None:
            counted.append((name, "no partner record"))
        elif not data.readable(r):
            counted.append((name, f"{r['dtype']} data that cannot be read as numbers"))
        elif edges is None:
            counted.append((name, "no finite values"))
        else:
            counted.append((name, data.histogram(stream, r, edges, scale)))
    return title, edges, counted
