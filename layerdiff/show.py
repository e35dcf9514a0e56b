"""What a trace holds, from its index alone: tables for people and JSON for scripts."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import pandas as pd

from layerdiff.report.text import WIDTH, clip, clip_left, number
from layerdiff.trace.printable import printable, visible
from layerdiff.trace.reader import Trace
from layerdiff.trace.schema import FORWARD_ROLES, GRAD_ROLES, Pass


def select_records(trace: Trace, site: str | None = None, role: str | None = None,
                   step: int | None = None) -> pd.DataFrame:
    """Index rows in recording order, narrowed by a site glob, a role and a step."""
    index = trace.index
    keep = pd.Series(True, index=index.index)
    if site:
        keep &= index["site"].map(lambda s: fnmatch.fnmatchcase(s, site))
    if role:
        keep &= index["role"] == role
    if step is not None:
        keep &= index["step"] == step
    return index[keep]


def first_step(trace: Trace) -> int:
    """The first step the trace holds: 0, unless it keeps a window of later steps (a monitor's)
    or none at all."""
    steps = trace.sites["step"]
    return int(steps.min()) if len(steps) else 0


def recorded_steps(trace: Trace) -> str | None:
    """The steps recorded, said compactly, when they are not simply every step from 0."""
    steps = sorted({int(step) for step in trace.sites["step"]})
    if not steps or steps == list(range(len(steps))):
        return None
    shown = ", ".join(str(step) for step in steps[:8]) + (" ..." if len(steps) > 8 else "")
    return f"{len(steps)} steps recorded: {shown}"


def site_summary(trace: Trace, step: int = 0) -> pd.DataFrame:
    """One row per site of a step, in call order: type, what was recorded, bytes."""
    sites = trace.sites[trace.sites["step"] == step]
    records = trace.index[trace.index["step"] == step]
    counts = records.pivot_table(index="site", columns="role", values="seq", aggfunc="count",
                                 fill_value=0)
    nbytes = records.groupby("site")["nbytes"].sum()
    rows = []
    for site in sites.itertuples():
        row = {"site": site.site, "type": site.type}
        for role in (*FORWARD_ROLES, *GRAD_ROLES):
            row[str(role)] = int(counts.at[site.site, role]) if (
                site.site in counts.index and role in counts.columns) else 0
        row["bytes"] = int(nbytes.get(site.site, 0))
        rows.append(row)
    return pd.DataFrame(rows)


def header_lines(trace: Trace) -> list[str]:
    """What the trace is, from its meta (a crafted one's control characters made visible)."""
    return [visible(line) for line in _header_lines(trace)]


def _header_lines(trace: Trace) -> list[str]:
    meta, index = trace.meta, trace.index
    tensors = index[index["kind"] == "tensor"]
    versions = ", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items())
    lines = [
        f"trace    {trace.path}  (format v{trace.version}"
        + (", summary only" if trace.summary else "")
        + ("" if trace.complete else ", INCOMPLETE") + ")",
        f"case     {meta.get('case', '?')}  seed {meta.get('seed', '?')}  steps "
        f"{meta.get('steps', '?')}  loss scale {meta.get('loss_scale', 1.0):g}  device "
        f"{meta.get('device', '?')}",
        f"records  {len(index):,} ({len(tensors):,} tensors, "
        f"{tensors['nbytes'].sum() / 2**20:,.1f} MiB) at "
        f"{trace.sites['site'].nunique():,} sites",
        f"producer {meta.get('producer', '?')}; {versions}",
    ]
    steps = recorded_steps(trace)
    if steps:
        lines.append(f"steps    {steps}")
    if trace.rank_paths:
        names = ", ".join(path.name for path in trace.rank_paths[:4])
        more = " ..." if len(trace.rank_paths) > 4 else ""
        lines.append(f"ranks    {len(trace.rank_paths)} rank files ({names}{more}), checked; "
                     "the records shown are rank 0's")
    return lines


@printable
def format_records(records: pd.DataFrame, width: int = WIDTH) -> str:
    """A fixed-width table of index rows that fits ``width`` columns."""
    columns = [("step", 4, "r"), ("pass", 4, "l"), ("site", 0, "l"), ("role", 11, "l"),
               ("arg", 10, "l"), ("shape", 12, "l"), ("dtype", 8, "l"), ("min", 9, "r"),
               ("max", 9, "r"), ("std", 9, "r")]
    fixed = sum(w for _, w, _ in columns) + len(columns) - 1
    site_width = max(12, width - fixed)
    out = [_row([(c, site_width if w == 0 else w, a) for c, w, a in columns],
                {c: c for c, _, _ in columns})]
    for rec in records.rename(columns={"pass": "pass_"}).itertuples(index=False):
        values = {
            "step": str(rec.step), "pass": "fwd" if rec.pass_ == Pass.FORWARD else "bwd",
            "site": rec.site, "role": rec.role, "arg": rec.arg,
            "shape": rec.shape if rec.kind == "tensor" else "value",
            "dtype": rec.dtype if rec.kind == "tensor" else "",
            "min": _num(rec.min), "max": _num(rec.max), "std": _num(rec.std),
        }
        if rec.kind == "value":
            values.update(min="", max="", std="", shape=clip(rec.value, 13))
        if rec.nan or rec.inf:
            values["std"] = f"{rec.nan}nan/{rec.inf}inf"[:9]
        out.append(_row([(c, site_width if w == 0 else w, a) for c, w, a in columns], values))
    return "\n".join(out)


@printable
def format_sites(summary: pd.DataFrame, width: int = WIDTH) -> str:
    columns = [("site", 0, "l"), ("type", 14, "l"), ("input", 3, "r"), ("output", 3, "r"),
               ("weight", 6, "r"), ("grad_output", 8, "r"), ("grad_input", 7, "r"),
               ("weight_grad", 6, "r"), ("bytes", 8, "r")]
    titles = {"site": "site", "type": "type", "input": "in", "output": "out", "weight": "weight",
              "grad_output": "grad_out", "grad_input": "grad_in", "weight_grad": "w_grad",
              "bytes": "KiB"}
    fixed = sum(w for _, w, _ in columns) + len(columns) - 1
    layout = [(c, max(12, width - fixed) if w == 0 else w, a) for c, w, a in columns]
    out = [_row(layout, titles)]
    for row in summary.to_dict("records"):
        values = {k: str(v) for k, v in row.items()}
        values["bytes"] = f"{row['bytes'] / 1024:,.1f}"
        out.append(_row(layout, values))
    return "\n".join(out)


def records_json(trace: Trace, records: pd.DataFrame) -> dict[str, Any]:
    rows = [{k: _jsonable(v) for k, v in row.items()} for row in records.to_dict("records")]
    return {"path": str(trace.path), "format_version": trace.version,
            "complete": trace.complete, "summary": trace.summary, "meta": trace.meta,
            "digest": DIGEST_MEANING.format(name=trace.digest_algorithm), "records": rows}


# what the records' digest column is, said beside it: equal digests are no proof of equal bytes
DIGEST_MEANING = ("each record's digest is its tensor's {name} checksum "
                  "(docs/trace-format.md#tensor-digest): different digests mean different "
                  "bytes; equal digests mean equal bytes against any accidental change, not "
                  "against a deliberate one (the checksum is linear: a crafted change can keep "
                  "it); '' where the writer computed none")


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _num(value: float) -> str:
    """A statistic in a 9-column cell: four digits, else the exponent form; NaN left blank."""
    text = number(value, 4, nan="")
    return text if len(text) <= 9 else f"{value:.2e}"


def _row(layout: list[tuple[str, int, str]], values: dict[str, str]) -> str:
    cells = []
    for name, width, align in layout:
        text = values.get(name, "")
        # a site's end is its specific part; any other cell's start
        text = clip_left(text, width) if name == "site" else clip(text, width)
        cells.append(text.rjust(width) if align == "r" else text.ljust(width))
    return " ".join(cells).rstrip()
