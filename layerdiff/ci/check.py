"""Golden traces and checks against them: numerical parity as one CI step.

``golden`` records a trace of a case; ``check`` captures the case again the same way (steps,
loss scale, summary or full) and diffs it against the golden, with three outcomes:

- ``identical``: no record changed: every record's bytes compared equal to the golden's, or,
  where the golden holds no data (a summary golden), its digest equal (equal against any
  accidental change, not against a deliberate one: see docs/trace-format.md#tensor-digest);
- ``drift``: something changed, within tolerance (how much, and where the most);
- ``fail``: out of tolerance, with the origin.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from layerdiff.compare import diff
from layerdiff.compare.judge import UNCHANGED
from layerdiff.compare.result import Column, Diff
from layerdiff.errors import DiffError, TraceError
from layerdiff.trace import open_trace, schema


class CheckOutcome(StrEnum):
    """:attr:`CheckResult.outcome`."""

    IDENTICAL = "identical"   # every record the same bytes, or the same digest (summary)
    DRIFT = "drift"           # something changed, within tolerance
    FAIL = "fail"             # out of tolerance, or the model's records changed

CaseLike = Any  # a spec 'package.module:name', a Case, or a function returning one


@dataclass
class CheckResult:
    outcome: CheckOutcome
    diff: Diff
    golden: Path
    case: str

    @property
    def passed(self) -> bool:
        return self.outcome != CheckOutcome.FAIL

    def __bool__(self) -> bool:
        return self.passed


def _load(case: CaseLike):
    from layerdiff.case import load_case

    if isinstance(case, str):
        return load_case(case)
    return case() if callable(case) else case


def golden(case: CaseLike, path: str | os.PathLike, *, summary: bool = False,
           steps: int | None = None, loss_scale: float = 1.0) -> Path:
    """Record the golden trace of ``case`` at ``path`` (summary: statistics only, small)."""
    from layerdiff.capture import capture

    return capture(_load(case), path, summary=summary, steps=steps, loss_scale=loss_scale)


def check(case: CaseLike, golden_path: str | os.PathLike, *, mapping: Any = None,
          tolerances: Any = None, directory: str | os.PathLike | None = None,
          verify: bool = True) -> CheckResult:
    """Capture ``case`` as its golden was captured and diff the two (``verify``: check what is
    read against its digests; see :func:`layerdiff.diff`).

    Refuses, with a sentence saying what to do, a golden of an older format version or of
    another case.
    """
    from layerdiff.capture import capture

    golden_path = Path(golden_path)
    loaded = _load(case)
    settings = _golden_settings(golden_path, loaded.name)
    with tempfile.TemporaryDirectory(prefix="layerdiff-check-", dir=directory) as tmp:
        fresh = capture(loaded, Path(tmp) / "check.h5", **settings)
        result = diff(golden_path, fresh, mapping=mapping, tolerances=tolerances,
                      verify=verify)
    structural = _structural_changes(result)
    if structural:
        result.meta["structure"] = structural
    if not result.passed or structural:
        outcome = CheckOutcome.FAIL
    elif result.rows[Column.VERDICT].isin(UNCHANGED).all():
        outcome = CheckOutcome.IDENTICAL
    else:
        outcome = CheckOutcome.DRIFT
    return CheckResult(outcome, result, golden_path, loaded.name)


def _structural_changes(result: Diff) -> str:
    """What the golden recorded and this run did not, or the reverse: a changed model."""
    unmatched = result.unmatched
    if unmatched.empty:
        return ""
    parts = []
    for side, label in (("reference", "missing from this run"), ("port", "new in this run")):
        names = list(dict.fromkeys(
            unmatched.loc[unmatched["side"] == side, "site"] + unmatched.loc[
                unmatched["side"] == side, "role"].map(lambda r: f" {r}" if r else "")))
        if names:
            shown = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4
                                           else "")
            parts.append(f"{label}: {shown}")
    return "the recorded structure changed (" + "; ".join(parts) + ")"


def _golden_settings(path: Path, case_name: str) -> dict[str, Any]:
    with open_trace(path) as trace:
        if trace.version < schema.FORMAT_VERSION:
            raise TraceError(f"golden {path} is trace format v{trace.version}, older than the "
                             f"v{schema.FORMAT_VERSION} this layerdiff writes; record it again "
                             "with `layerdiff golden` (or pytest --layerdiff-update-golden)")
        recorded = trace.meta.get("case", "")
        if recorded and recorded != case_name:
            raise DiffError(f"golden {path} was recorded from case {recorded}, not {case_name}; "
                            "pass the golden of this case, or record one with "
                            f"`layerdiff golden {case_name} -o GOLDEN.h5`")
        return {"summary": trace.summary, "steps": int(trace.meta.get("steps", 1)),
                "loss_scale": float(trace.meta.get("loss_scale", 1.0))}


def update_or_check(case: CaseLike, golden_path: str | os.PathLike, *, update: bool,
                    summary: bool = False, on_update: Callable[[Path], None] | None = None,
                    **options: Any) -> CheckResult | None:
    """The pytest plugin's step: rewrite the golden when asked, otherwise check against it."""
    golden_path = Path(golden_path)
    if update:
        golden_path.parent.mkdir(parents=True, exist_ok=True)
        if golden_path.exists():  # keep what the committed golden was: summary or full
            with open_trace(golden_path, allow_incomplete=True) as existing:
                summary = summary or existing.summary
        golden(case, golden_path, summary=summary)
        if on_update:
            on_update(golden_path)
        return None
    if not golden_path.exists():
        raise DiffError(f"golden {golden_path} does not exist; record it with "
                        "pytest --layerdiff-update-golden (or `layerdiff golden`)")
    return check(case, golden_path, **options)
