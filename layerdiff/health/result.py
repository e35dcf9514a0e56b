"""What ``health`` returns: one verdict per check, with the site and step it applies to and its
evidence in numbers, and the curves the checks were judged on (for the HTML page)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Verdict(StrEnum):
    PASS = "pass"
    WARN = "warn"   # worth a look, not a failure (outside the ideal band, or explained)
    FAIL = "fail"
    SKIP = "skip"   # not judged: the case lacks what the check needs (said in ``evidence``)


# The checks, in the order they are run and reported.
CHECKS = ("initial-loss", "overfit", "gradient-flow", "update-ratio", "dead-units",
          "nonfinite", "batch-independence", "determinism")
# Checks that train: they need the case's optimizer for more than one step.
NEED_OPTIMIZER = ("overfit", "update-ratio")


@dataclass
class Check:
    """One check's verdict. ``site`` is a site (``head#0``) or a module/parameter path, ``step``
    the training step it applies to (None where it is not one step); ``evidence`` one sentence
    with the numbers; ``details`` the numbers in full (JSON)."""

    name: str
    verdict: Verdict
    evidence: str
    site: str | None = None
    step: int | None = None
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.verdict == Verdict.FAIL

    def as_json(self) -> dict[str, Any]:
        return {"check": self.name, "verdict": str(self.verdict), "site": self.site,
                "step": self.step, "evidence": self.evidence,
                "details": _plain(self.details)}


@dataclass
class HealthResult:
    """Every check's verdict on one case; ``found`` is true when any check failed.

    ``losses`` is the loss at each step of the one-batch run; ``grad_norms`` and
    ``update_ratios`` map a layer (a module holding parameters) to its value per step (NaN
    where it had none), for the page's plots."""

    case: str
    steps: int
    checks: list[Check]
    losses: list[float] = field(default_factory=list)
    grad_norms: dict[str, list[float]] = field(default_factory=dict)
    update_ratios: dict[str, list[float]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return any(check.failed for check in self.checks)

    def __getitem__(self, name: str) -> Check:
        for check in self.checks:
            if check.name == name:
                return check
        raise KeyError(f"no check {name!r} was run; the checks run: "
                       f"{', '.join(c.name for c in self.checks)}")

    def as_json(self) -> dict[str, Any]:
        return {"case": self.case, "found": self.found, "steps": self.steps,
                "checks": [check.as_json() for check in self.checks],
                "losses": _plain(self.losses), "grad_norms": _plain(self.grad_norms),
                "update_ratios": _plain(self.update_ratios), "notes": list(self.notes),
                "seconds": round(self.seconds, 3)}


def _plain(value: Any) -> Any:
    """JSON has no NaN or Inf: None for NaN, the strings 'inf'/'-inf' for infinities."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value
