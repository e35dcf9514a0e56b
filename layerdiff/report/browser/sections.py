"""The trace browser page's sections as HTML: header, NaN/Inf, batch elements, ranges, norms,
the sites table. Histograms are in browser_hist. Every text from a trace is escaped.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape

import pandas as pd

from layerdiff.compare.result import Column, Diff
from layerdiff.report import page as kit
from layerdiff.report.browser import data, plots, svg
from layerdiff.report.browser.data import BatchErrors, NonFinite, Progress, spans
from layerdiff.report.page import CSS as REPORT_CSS
from layerdiff.trace import schema
from layerdiff.trace.reader import Trace
from layerdiff.trace.schema import Role

MAX_RANGE_SITES = 1000     # sites per range panel
MAX_RANGE_STEPS = 3        # steps with range panels: the first, the one shown, the last
MAX_TABLE_SITES = 500
MAX_NORM_LAYERS = 80
MAX_BAR_SERIES = 6         # more (trace × step) series than this: a layer × step heat map
MAX_IMAGE_ROWS = 240       # records in the batch image before rows are max-pooled
MAX_IMAGE_COLUMNS = 256    # batch elements before columns are max-pooled
MAX_NONFINITE_ROWS = 50

CSS = REPORT_CSS + svg.CSS + """
.banner.look { background: #24292f; }
nav { margin: 14px 0 0; font-size: 14px; }
nav a { margin-right: 14px; }
.flag { border-left: 4px solid var(--fail); background: #fdecea; padding: 8px 12px;
        margin: 10px 0; border-radius: 4px; }
tr.nonfinite td { background: #fdecea; }
tr.nonfinite td:first-child { border-left: 4px solid var(--fail); }
tr.out td:first-child { border-left: 4px solid #ff7f0e; }
span.badge { display: inline-block; padding: 0 6px; border-radius: 8px; font-size: 11px;
             font-weight: 700; color: #fff; background: var(--fail); }
ul.limits li { color: var(--muted); font-size: 13px; }
figure.chart { overflow-x: auto; }
"""


@dataclass
class Page:
    """What every section reads; sections add to ``notes`` what they leave out."""

    ref: Trace
    port: Trace | None
    diff: Diff | None
    partner: dict[str, str]          # port site -> reference site
    steps: list[int]
    step: int
    nonfinite: list[NonFinite]
    progress: Progress | None = None
    notes: list[str] = field(default_factory=list)
    norms: pd.DataFrame = field(default_factory=pd.DataFrame)


def document(title: str, body: list[str]) -> str:
    return kit.document(title, body, CSS)


# ---------------------------------------------------------------------------------------------
# Header


def header(page: Page, origin: str | None) -> str:
    ref, diff = page.ref, page.diff
    if diff is not None:
        css, word = diff.verdict, diff.verdict.upper()
        text = (f"First origin: {origin}." if origin else
                "Every compared tensor is within tolerance." if diff.passed else
                "Rows are out of tolerance, but no origin was found.")
    else:
        css, word = ("fail", "NaN/Inf") if page.nonfinite else ("look", "TRACE")
        text = (f"First non-finite value: {page.nonfinite[0].describe()}." if page.nonfinite
                else "No NaN or Inf in any record.")
    facts = [("trace", f"<code>{escape(str(ref.path))}</code>"
              + (" (summary: statistics only)" if ref.summary else ""))]
    if page.port is not None:
        facts.append(("against", f"<code>{escape(str(page.port.path))}</code>"
                      + (" (summary: statistics only)" if page.port.summary else "")))
    facts += [("case", escape(str(ref.meta.get("case", "?")))),
              ("steps", f"{escape(spans(page.steps))}; step {page.step} is shown in detail"),
              ("loss scale", f"{ref.loss_scale:g}")]
    tensors = ref.index[ref.index["kind"] == "tensor"]
    counts = [(f"{ref.sites['site'].nunique():,}", "sites", False),
              (f"{len(ref.index):,}", "records", False),
              (_bytes(int(tensors["nbytes"].sum())), "of tensors"
               + (" (not stored)" if ref.summary else ""), False),
              (f"{len(page.nonfinite):,}", "records with NaN/Inf", bool(page.nonfinite))]
    if diff is not None:
        counts.append((f"{len(diff.failing()):,}", "rows out of tolerance", not diff.passed))
    links = [("ranges", "ranges"), ("norms", "norms"), ("sites", "sites"),
             ("histograms", "histograms")]
    if page.nonfinite:
        links.insert(0, ("nonfinite", "NaN/Inf"))
    if diff is not None:
        links.insert(0, ("batch", "batch elements"))
    return ("<header>"
            f"<div class=\"banner {css}\"><span class=\"verdict\">{escape(word)}</span>"
            f"<p>{escape(text)}</p></div><dl class=\"facts\">"
            + "".join(f"<dt>{k}</dt><dd>{v}</dd>" for k, v in facts)
            + "</dl><div class=\"counts\">"
            + "".join(f"<div class=\"count{' bad' if bad else ''}\"><b>{n}</b>"
                      f"<span>{escape(label)}</span></div>" for n, label, bad in counts)
            + "</div><nav>" + "".join(f"<a href=\"#{a}\">{t}</a>" for a, t in links)
            + "</nav></header>")


# ---------------------------------------------------------------------------------------------
# NaN and Inf


def nonfinite_section(page: Page) -> str:
    if not page.nonfinite:
        return ""
    first = page.nonfinite[0]
    flag = (f"<p class=\"flag\"><span class=\"badge\">{'NaN' if first.nan else 'Inf'}</span> "
            f"First non-finite record in the {escape(first.trace)}: "
            f"<b>{escape(first.describe())}</b>. Records are listed in execution order: "
            "nothing recorded before the first holds NaN or Inf, so it is where to look.</p>")
    shown = page.nonfinite[:MAX_NONFINITE_ROWS]
    rows = "".join(
        f"<tr class=\"nonfinite\"><td>{escape(n.trace)}</td><td class=\"num\">{n.step}</td>"
        f"<td>{escape(n.pass_)}</td><td class=\"name\">{kit.breakable(escape(n.site))}</td>"
        f"<td>{escape(n.role)}</td><td>{escape(n.arg)}</td>"
        f"<td class=\"num\">{n.nan:,}</td><td class=\"num\">{n.inf:,}</td></tr>" for n in shown)
    if len(page.nonfinite) > len(shown):
        page.notes.append(f"The NaN/Inf table lists the first {len(shown)} of "
                          f"{len(page.nonfinite):,} records; the --json result has them all.")
    return ("<h2 id=\"nonfinite\">NaN and Inf</h2>" + flag
            + "<div class=\"table-wrap\"><table><thead><tr><th>trace</th><th>step</th>"
            "<th>pass</th><th>site</th><th>role</th><th>arg</th><th>NaN</th><th>Inf</th>"
            f"</tr></thead><tbody>{rows}</tbody></table></div>")


# ---------------------------------------------------------------------------------------------
# Batch elements


def batch_section(page: Page, batch: BatchErrors | None, summary: bool) -> str:
    if page.diff is None:
        return ""
    head = f"<h2 id=\"batch\">Which batch elements are wrong (step {page.step})</h2>"
    if batch is None:
        why = ("a summary trace holds statistics only, so there is no element-wise error; "
               "capture without --summary to see which batch elements are wrong" if summary
               else "no compared record has a batch axis at this step")
        return head + f"<p class=\"note\">No per-batch-element image: {escape(why)}.</p>"
    parts = [head]
    row = batch.origin or batch.first
    if row is None:
        parts.append(f"<p>Every batch element (0–{batch.batch - 1}) is within tolerance in "
                     "every record with a batch axis.</p>")
    else:
        what = "the diff's origin" if batch.origin is not None else "the first record out"
        right = [i for i in range(batch.batch) if i not in row.wrong]
        parts.append(f"<p class=\"flag\">At {what}, <b>{escape(row.label())}</b> ({row.pass_}):"
                     f" batch element(s) <b>{escape(spans(row.wrong))}</b> of "
                     f"0–{batch.batch - 1} are out of tolerance"
                     + (f"; {escape(spans(right))} within." if right else ".") + "</p>")
        if batch.wrong_anywhere != row.wrong:
            parts.append("<p class=\"note\">Further on, batch element(s) "
                         f"{escape(spans(batch.wrong_anywhere))} are out somewhere: errors "
                         "spread through layers that mix the batch (batch norm, attention "
                         "over the batch), so read the outlined row first.</p>")
    image, row_factor, col_factor = plots.batch_image(batch, MAX_IMAGE_ROWS, MAX_IMAGE_COLUMNS)
    caption = ("Rows: forward outputs in execution order, then (below the line) the gradient "
               "each site sends back, in backward order. Columns: batch elements. Colour: each "
               "batch element's worst error over its tolerance, log scale; red is out, blue "
               "within, white at the tolerance. Outlined: the origin (red) or the first row "
               "out (black).")
    if row_factor > 1 or col_factor > 1:
        caption += (f" Each cell is the maximum over {row_factor} record(s) × {col_factor} "
                    "batch element(s), so a single bad one stays visible.")
        page.notes.append(f"The batch image max-pools {len(batch.rows):,} records and "
                          f"{batch.batch:,} batch elements to at most {MAX_IMAGE_ROWS} × "
                          f"{MAX_IMAGE_COLUMNS} cells.")
    if batch.skipped:
        caption += (f" {batch.skipped} record(s) whose leading axis is not the batch of "
                    f"{batch.batch} are not drawn.")
    parts.append(kit.figure(image, "error per batch element and record", caption, "batch-image"))
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Ranges


def ranges_section(page: Page) -> str:
    head = ("<h2 id=\"ranges\">Value and gradient ranges per site</h2>"
            "<p class=\"note\">From the index's statistics (summary traces too). Each bar runs "
            "from a site's smallest to its largest value, the tick is the mean; hover a bar for "
            "its numbers. The y axis is symmetric-log so tiny gradients and large activations "
            "both keep their shape. Both panels put sites in forward execution order so a "
            "site's values and gradients line up (the backward pass runs right to left). A "
            "red column marks a site with NaN or Inf.</p>")
    steps = sorted({page.steps[0], page.step, page.steps[-1]})[:MAX_RANGE_STEPS]
    if len(page.steps) > len(steps):
        page.notes.append(f"Ranges are drawn for steps {spans(steps)} of {len(page.steps)}; "
                          "pass --step to draw another.")
    grad_note = " (÷ loss scale)" if page.ref.loss_scale != 1.0 else ""
    parts = [head]
    for step in steps:
        frames = [data.site_ranges(page.ref, step)]
        if page.port is not None:
            port = data.site_ranges(page.port, step, rename=page.partner)
            port = port.drop_duplicates("site").set_index("site")
            frames.append(port.reindex(frames[0]["site"]).reset_index())
        count = len(frames[0])
        if count > MAX_RANGE_SITES:
            frames = [f.head(MAX_RANGE_SITES) for f in frames]
            page.notes.append(f"Range panels of step {step} show the first {MAX_RANGE_SITES} "
                              f"of {count:,} sites.")
        caption = f"Step {step}" + (": reference (blue) and port (orange) side by side."
                                    if page.port is not None else ".")
        parts.append(f"<figure class=\"chart\" id=\"ranges-{step}\">"
                     f"{svg.ranges_svg(frames, step, grad_note)}"
                     f"<figcaption>{escape(caption)}</figcaption></figure>")
    return "\n".join(parts)


# ---------------------------------------------------------------------------------------------
# Norms


def norms_section(page: Page) -> str:
    head = "<h2 id=\"norms\">Weight and gradient norms per layer</h2>"
    traces: list[tuple[str, Trace, dict[str, str] | None]] = [("reference", page.ref, None)]
    if page.port is not None:
        modules = {schema.split_site(p)[0]: schema.split_site(r)[0]
                   for p, r in page.partner.items()}
        traces.append(("port", page.port, modules))
    tables = [(label, data.layer_norms(trace, rename)) for label, trace, rename in traces]
    page.norms = tables[0][1]
    if page.norms.empty:
        return head + "<p class=\"note\">The trace records no floating-point weights.</p>"
    layers = list(dict.fromkeys(page.norms["module"]))
    if len(layers) > MAX_NORM_LAYERS:
        page.notes.append(f"Norm charts show the first {MAX_NORM_LAYERS} of {len(layers)} "
                          "layers in execution order.")
        layers = layers[:MAX_NORM_LAYERS]
    steps = sorted(int(s) for s in page.norms["step"].unique())
    if len(steps) == 1:
        series = list(tables)
    else:
        series = [(f"{label} step {s}" if len(tables) > 1 else f"step {s}",
                   frame[frame["step"] == s]) for s in steps for label, frame in tables]
    if len(series) <= MAX_BAR_SERIES:
        chart = svg.norms_svg(series, layers)
        how = "One bar per layer" + (" and step" if len(steps) > 1 else "") + (
            ", reference and port side by side" if len(tables) > 1 else "") + "; hover a bar"
    else:
        png = plots.norms_heatmap(tables, layers, steps)
        chart = f"<img src=\"data:image/png;base64,{png}\" alt=\"norms per layer and step\">"
        how = (f"{len(steps)} steps: a layer × step map of log10 norm per trace (bars for up "
               f"to {MAX_BAR_SERIES} series)")
    caption = (f"{how}. A layer's norm is the L2 norm of all its parameters together (the "
               "weights with a gradient record: buffers such as running statistics are left "
               "out), from the index; gradients are divided by the loss scale "
               f"({page.ref.loss_scale:g}). Red 'not finite': a NaN or Inf in it.")
    return (head + f"<figure class=\"chart\" id=\"norms\">{chart}"
            f"<figcaption>{escape(caption)}</figcaption></figure>")


# ---------------------------------------------------------------------------------------------
# Sites table


def table_section(page: Page, hist_sites: list[str], batch: BatchErrors | None) -> str:
    """The debugger window: one row per site at the step shown, in execution order."""
    frame = data.site_ranges(page.ref, page.step)
    pair = page.diff is not None
    head = (f"<h2 id=\"sites\">Sites at step {page.step}, in execution order</h2>"
            "<p class=\"note\">Output values and the gradient arriving at the output"
            + (" (÷ loss scale)" if page.ref.loss_scale != 1.0 else "")
            + "; a site with several outputs shows the range over all of them and the first "
            "one's shape and mean."
            + (" Worst ratio: the site's largest error over tolerance in its output and "
               "gradients; wrong batch: the batch elements out of tolerance in its output or "
               "the gradient it sends back." if pair else "") + "</p>")
    worst, wrong = _pair_columns(page, batch)
    columns = ["#", "site", "type", "shape", "min", "max", "mean", "grad min", "grad max",
               "NaN/Inf"] + (["worst ratio", "wrong batch"] if pair else []) + ["hist."]
    body = []
    for n, r in enumerate(frame.head(MAX_TABLE_SITES).itertuples(index=False)):
        bad = r.out_nan + r.out_inf + r.grad_nan + r.grad_inf
        ratio = worst.get(r.site)
        css = "nonfinite" if bad else "out" if ratio is not None and ratio > 1 else ""
        flags = ", ".join(f"{k} {v:,}" for k, v in (
            ("out NaN", r.out_nan), ("out Inf", r.out_inf), ("grad NaN", r.grad_nan),
            ("grad Inf", r.grad_inf)) if v)
        cells = [f"<td class=\"num\">{n}</td>",
                 f"<td class=\"name\">{kit.breakable(escape(r.site))}</td>",
                 f"<td>{escape(str(r.type))}</td>", f"<td>{escape(str(r.out_shape))}</td>"]
        cells += [f"<td class=\"num\">{kit.number_cell(v)}</td>" for v in (
            r.out_min, r.out_max, r.out_mean, r.grad_min, r.grad_max)]
        badge = "<span class=\"badge\">!</span> " if bad else ""
        cells.append(f"<td>{badge}{escape(flags)}</td>")
        if pair:
            cells.append(f"<td class=\"num\">{kit.number_cell(ratio)}</td>")
            cells.append(f"<td>{escape(wrong.get(r.site, ''))}</td>")
        link = (f"<a href=\"#hist-{hist_sites.index(r.site)}\">show</a>"
                if r.site in hist_sites else "")
        cells.append(f"<td>{link}</td>")
        attr = f" class=\"{css}\"" if css else ""
        body.append(f"<tr{attr}>{''.join(cells)}</tr>")
    if len(frame) > MAX_TABLE_SITES:
        page.notes.append(f"The sites table lists the first {MAX_TABLE_SITES} of "
                          f"{len(frame):,} sites.")
    return (head + "<div class=\"table-wrap\"><table><thead><tr>"
            + "".join(f"<th>{escape(c)}</th>" for c in columns)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></div>")


def _pair_columns(page: Page, batch: BatchErrors | None) -> tuple[dict[str, float],
                                                                 dict[str, str]]:
    """Per reference site at the step shown: the worst ratio over its output and gradient
    records, and the batch elements wrong in them."""
    if page.diff is None:
        return {}, {}
    rows = page.diff.rows
    rows = rows[(rows[Column.STEP] == page.step)
                & rows[Column.ROLE].isin([Role.OUTPUT, Role.GRAD_OUTPUT, Role.GRAD_INPUT])]
    worst = rows.groupby(Column.SITE)[Column.RATIO].max().to_dict()
    wrong: dict[str, set[int]] = {}
    for row in batch.rows if batch is not None else []:
        wrong.setdefault(row.site, set()).update(row.wrong)
    return worst, {s: spans(sorted(w)) for s, w in wrong.items() if w}


def limits(page: Page) -> str:
    if not page.notes:
        return ""
    return ("<h2>What this page leaves out</h2><ul class=\"limits\">"
            + "".join(f"<li>{escape(n)}</li>" for n in page.notes) + "</ul>")


# ---------------------------------------------------------------------------------------------


def _bytes(count: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if count >= size:
            return f"{count / size:,.1f} {unit}"
    return f"{count} B"
