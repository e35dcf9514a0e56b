"""The text of a diff's results: an origin in one line, a diff for a notebook, a CI check's
verdict line. The diff's terminal table is :mod:`layerdiff.report.terminal`'s."""

from __future__ import annotations

from html import escape

import numpy as np

from layerdiff.ci.check import CheckOutcome, CheckResult
from layerdiff.compare.judge import UNCHANGED, Verdict
from layerdiff.compare.positions import pattern
from layerdiff.compare.result import Column, Diff, Origin
from layerdiff.report.text import ranges

NOTEBOOK_ROWS = 20     # failing rows a notebook shows (.failing() has them all)
NOTEBOOK_ORIGINS = 10


def describe_origin(origin: Origin, *, port_name: bool = True) -> str:
    """'decoder.norm1#0 (port dec.ln1#0), forward output, step 0: 77x tolerance'."""
    where = origin.site if not port_name or origin.port_site in ("", origin.site) else (
        f"{origin.site} (port {origin.port_site})")
    ratio = origin.metrics.get("ratio")
    note = str(origin.metrics.get("note") or "")
    size = (f": {ratio:.3g}x tolerance" if isinstance(ratio, (int, float))
            and np.isfinite(ratio) else f": {shapes_differ(origin)}" if shapes_differ(origin)
            # top-k indices: a decision, never a ratio (compare/routing.py)
            else f": {note.split(' (')[0]}" if note.startswith(DECISION_DIFFERS)
            else ": not finite" if ratio is not None else "")
    arg = "" if origin.arg == "0" else f" '{origin.arg}'"
    one, many = ("copy", "copies") if origin.shards.startswith("replicated") else (
        "part", "parts")
    ranks = "" if not origin.ranks else (
        f", rank {origin.ranks[0]}'s {one}" if len(origin.ranks) == 1
        else f", ranks {', '.join(map(str, origin.ranks))}' {many}")
    return f"{where}, {origin.pass_} {origin.role}{arg}, step {origin.step}{ranks}{size}"


def shapes_differ(origin: Origin) -> str:
    """'shapes differ (reference (20,32), port (20,2,32))' for an origin whose record was not
    compared element by element because its shapes differ and no rule relates them (its ratio
    is infinite, its errors NaN: not a value that is not finite); else ''."""
    note = str(origin.metrics.get("note") or "")
    if not note.startswith(SHAPES_DIFFER):
        return ""
    return "shapes differ (" + note[len(SHAPES_DIFFER):].split(";")[0].strip() + ")"


SHAPES_DIFFER = "shapes differ:"  # compare/engine.py's note on a shape-mismatch row
DECISION_DIFFERS = "decision differs:"  # compare/routing.py's note on a top-k index row

MAX_RANGES = 6  # runs of positions named before '...'


def position_line(ratios: list[float] | np.ndarray | None) -> str:
    """'by position: within at 0-5, out from 6 (first 6, worst 11: 3.2e3x)': where along the
    sequence a record's error is (its worst ratio per position, compare/positions.py); ''
    when it has none."""
    if ratios is None or len(ratios) == 0:
        return ""
    found = pattern(ratios)
    count = len(ratios)
    out, within = found.out, found.within
    if not out:
        where = f"within at every position (0-{count - 1})"
    elif not within:
        where = f"out at every position (0-{count - 1})"
    elif len(out) == 1:
        where = f"out only at {out[0]}, within elsewhere"
    elif found.run_to_end:
        where = f"within at {_runs(within)}, out from {out[0]}"
    elif out[0] == 0 and out[-1] - out[0] + 1 == len(out):
        where = f"out at {_runs(out)}, within from {within[0]}"
    else:
        where = f"out at {_runs(out)}, within at {_runs(within)}"
    detail = "" if not out else (
        f" (first {found.first}, worst {found.worst}: {times(found.worst_ratio)})"
        if found.first != found.worst or len(out) > 1 else f" ({times(found.worst_ratio)})")
    if found.growing:
        middle = out[len(out) // 2]
        detail += (f"; the error grows with the position ({out[0]}: "
                   f"{times(float(ratios[out[0]]))}, {middle}: {times(float(ratios[middle]))},"
                   f" {out[-1]}: {times(float(ratios[out[-1]]))})")
    return f"by position: {where}{detail}"


def times(ratio: float) -> str:
    """A ratio to tolerance, short: '3.2e3x', '12x', 'infx' -> 'inf'."""
    if not np.isfinite(ratio):
        return "not finite" if np.isnan(ratio) else "inf"
    text = f"{ratio:.2g}"
    if "e" in text:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text + "x"


def _runs(indices: list[int]) -> str:
    parts = ranges(indices).split(", ")
    return ", ".join(parts[:MAX_RANGES]) + (" ..." if len(parts) > MAX_RANGES else "")


def notebook_html(diff: Diff) -> str:
    """What a notebook shows for a diff: the verdict, the origins (with their likely causes)
    and the first failing rows as a table. ``import layerdiff`` registers it with IPython's
    display for :class:`Diff`."""
    colour = "#1a7f37" if diff.passed else "#c62828"
    failing = diff.failing()
    parts = [f'<p><b style="color:{colour}">{diff.verdict.upper()}</b> '
             f"{escape(str(diff.port))} against {escape(str(diff.reference))}: "
             f"{len(diff.rows)} records compared, {len(failing)} out of tolerance</p>"]
    if diff.origins:
        items = "".join(
            f"<li>{escape(describe_origin(origin))}"
            + (f"<br><i>likely cause: {escape(origin.hint['kind'])}: "
               f"{escape(origin.hint['evidence'])}</i>" if origin.hint else "")
            + (f"<br>{escape(position_line(origin.positions))}" if origin.positions else "")
            + "</li>" for origin in diff.origins[:NOTEBOOK_ORIGINS])
        parts.append(f"<p>origins:</p><ol>{items}</ol>")
    if not failing.empty:
        columns = [Column.STEP, Column.PASS, Column.SITE, Column.ROLE, Column.ARG, Column.RATIO,
                   Column.MAX_ABS, Column.COSINE, Column.STATUS]
        table = failing[[c for c in columns if c in failing.columns]].head(NOTEBOOK_ROWS)
        parts.append(table.to_html(index=False, float_format=lambda v: f"{v:.3g}"))
        if len(failing) > NOTEBOOK_ROWS:
            parts.append(f"<p>... {len(failing) - NOTEBOOK_ROWS} more: <code>.failing()</code> "
                         "has them all, <code>.rows</code> every record</p>")
    return "\n".join(parts)


def check_line(result: CheckResult) -> str:
    """A CI check's one-line verdict: IDENTICAL, DRIFT (how much, where the most) or FAIL
    (the origin)."""
    rows = result.diff.rows
    if result.outcome == CheckOutcome.IDENTICAL:
        digests = int((rows[Column.VERDICT] == Verdict.SAME_DIGEST).sum())
        if not digests:
            return (f"IDENTICAL  {result.case}: all {len(rows):,} records bit for bit as in "
                    f"{result.golden.name}")
        how = "all" if digests == len(rows) else f"{digests:,} of the {len(rows):,}"
        return (f"IDENTICAL  {result.case}: all {len(rows):,} records unchanged from "
                f"{result.golden.name}; {how} by their digests alone (no data to compare "
                "bytes: a digest catches any accidental change, not a deliberate one)")
    if result.outcome == CheckOutcome.DRIFT:
        changed = rows[~rows[Column.VERDICT].isin(UNCHANGED)]
        worst = changed.loc[changed[Column.RATIO].fillna(0).idxmax()]
        return (f"DRIFT  {result.case}: {len(changed):,} of {len(rows):,} records changed, "
                f"within tolerance; the most at {worst['site']} {worst['role']} "
                f"({worst['ratio']:.3g}x tolerance)")
    origin = result.diff.origin
    if origin is None and result.diff.meta.get("structure"):
        return f"FAIL  {result.case}: {result.diff.meta['structure']}"
    where = describe_origin(origin, port_name=False) if origin else "no origin found"
    return f"FAIL  {result.case}: out of tolerance; origin {where}"


def routing_line(origin: Origin) -> list[str]:
    """'routing flip: layer 0, token (b=1, t=6): experts {3,5} -> {2,5}; ...' when the origin's
    worst element lies on a token its port routed elsewhere (compare/routing.py)."""
    if not origin.routing:
        return []
    lead = origin.routing.get("lead")
    command = origin.routing.get("baseline_command")
    return [*([lead] if lead else []), f"routing flip: {origin.routing['text']}",
            *([f"with the baseline: {command}"] if command else [])]


def said_by_flip(origin: Origin) -> bool:
    """A precision hint where a flip's tie already leads with the precision: one cause, said
    once (the hint stays in the JSON)."""
    return bool(origin.hint and origin.routing and origin.routing.get("tie")
                and origin.hint.get("kind") == "precision")


__all__ = ["check_line", "describe_origin", "notebook_html", "position_line", "routing_line",
           "said_by_flip"]


def forced_routing(diff: Diff) -> list[str]:
    """A sentence per side captured with another run's routes forced (capture
    --force-routing): what the verdict then measures and what it leaves out."""
    said = []
    for side, forced in (diff.meta.get("forced_routing") or {}).items():
        said.append(f"routing forced: the {side} ran with the routes recorded in "
                    f"{forced['from']} ({forced['routes']} router calls), so its experts and "
                    "everything after them are judged apart from routing; capture it without "
                    "--force-routing to judge the routing too")
    return said
