"""The text of a health result: one row per check (check, verdict, site, step, evidence),
fitted to the terminal's 100 columns, the evidence wrapped in its column."""

from __future__ import annotations

from layerdiff.health.result import Check, HealthResult, Verdict
from layerdiff.report.text import WIDTH, clip_left, wrap, wrap_lines

_COLUMNS = (("check", 18), ("verdict", 7), ("site", 26), ("step", 5))
_EVIDENCE = WIDTH - sum(width + 1 for _, width in _COLUMNS)


def health_text(result: HealthResult) -> str:
    failed = [c.name for c in result.checks if c.verdict == Verdict.FAIL]
    head = (f"health of {result.case}: "
            + (f"FAIL ({', '.join(failed)})" if failed else "every check passes or warns")
            + f", {result.steps} step(s) on its batch, {result.seconds:.1f} s")
    lines = [*wrap(head), ""]
    lines.append(" ".join(name.ljust(width) for name, width in _COLUMNS) + " evidence")
    lines.append(" ".join("-" * width for _, width in _COLUMNS) + " " + "-" * _EVIDENCE)
    for check in result.checks:
        lines.extend(_row(check))
    if result.notes:
        lines.append("")
        lines.extend(wrap_lines(f"note: {note}" for note in result.notes))
    return "\n".join(lines)


def _row(check: Check) -> list[str]:
    step = check.details.get("span") if check.step is None else str(check.step)
    cells = [check.name, str(check.verdict).upper() if check.failed else str(check.verdict),
             clip_left(check.site or "-", _COLUMNS[2][1]), step or "-"]
    lead = " ".join(cell.ljust(width) for cell, (_, width) in zip(cells, _COLUMNS, strict=True))
    evidence = wrap(check.evidence, _EVIDENCE, hanging="") or [""]
    pad = " " * (len(lead) + 1)
    return [f"{lead} {evidence[0]}", *(pad + line for line in evidence[1:])]
