"""``health(case)``: the trainability checklist on one case, each check a verdict with its
site, step and evidence.

The training checks (initial-loss, overfit, gradient-flow, update-ratio, dead-units) share one
instrumented run (:mod:`layerdiff.health.record`); nonfinite, batch-independence and
determinism are the debug commands' own functions, which run the case themselves. A failure
that another check's finding explains (a batch that cannot be fit because its units are dead,
its loss went NaN, or its logits start saturated) is said as a warning naming that check, so
that each problem fails once, at its own check.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from layerdiff.case import Case, load_case
from layerdiff.errors import CaseError
from layerdiff.framework import framework_of
from layerdiff.health import loss, norms, reused, units
from layerdiff.health.record import record
from layerdiff.health.result import CHECKS, NEED_OPTIMIZER, Check, HealthResult, Verdict

DEFAULT_STEPS = 30
RECORDED = ("initial-loss", "overfit", "gradient-flow", "update-ratio", "dead-units")
# a failure of the first check that one of the others explains (their fail comes first)
EXPLAINED_BY = {"overfit": ("nonfinite", "dead-units", "initial-loss")}

Progress = Callable[[int, int], None]  # (runs done, runs in all): the training run, then each
# check that runs the case itself


def health(case: Case | str, steps: int = DEFAULT_STEPS, *, checks: Sequence[str] | None = None,
           expected_loss: float | None = None, allow_frozen: Sequence[str] = (),
           progress: Progress | None = None) -> HealthResult:
    """Run the checklist on ``case`` (a :class:`layerdiff.Case` or ``package.module:name``).

    ``steps``: optimizer steps on the case's batch (overfit, and the norms over them).
    ``checks``: which to run (default all, :data:`~layerdiff.health.result.CHECKS`).
    ``expected_loss``: the initial loss chance predicts, when it is not ln C of the logits'
    last axis (else the case's ``expected_initial_loss`` attribute, when it has one).
    ``allow_frozen``: globs over parameter names frozen on purpose (not a failure).
    The case's model, its buffers and the random state are left as they were.
    """
    started = time.perf_counter()
    chosen = _chosen(checks)
    if steps < 1:
        raise CaseError(f"--steps must be at least 1 (got {steps})")
    spec = case if isinstance(case, str) else None
    if isinstance(case, str):
        case = load_case(case)
    if not isinstance(case, Case) or framework_of(case).name != "torch":
        raise CaseError(f"case {getattr(case, 'name', '?')}: health runs a torch model's "
                        "training steps; give a torch Case")
    if expected_loss is None:
        expected_loss = getattr(case, "expected_initial_loss", None)
    notes = []
    if case.optimizer is None:
        needing = [c for c in chosen if c in NEED_OPTIMIZER]
        notes.append(f"case {case.name} has no optimizer: one forward and backward only"
                     + (f"; {', '.join(needing)} not judged (they train)" if needing else ""))
    results: dict[str, Check] = {}
    recorded = None
    runs = [c for c in chosen if c not in RECORDED]
    total = len(runs) + any(c in RECORDED for c in chosen)
    if any(c in RECORDED for c in chosen):
        recorded = record(case, steps)
        if progress:
            progress(1, total)
        judge = {"initial-loss": lambda: loss.initial_loss(recorded, expected_loss),
                 "overfit": lambda: loss.overfit(recorded, allow_frozen),
                 "gradient-flow": lambda: norms.gradient_flow(recorded),
                 "update-ratio": lambda: norms.update_ratio(recorded),
                 "dead-units": lambda: units.dead_units(recorded)}
        results.update({name: judge[name]() for name in RECORDED if name in chosen})
        if recorded.stopped:
            notes.append(f"the training run stopped early: {recorded.stopped}")
    others = {"nonfinite": lambda: reused.nonfinite(case, steps),
              "batch-independence": lambda: reused.batch_mixing(case),
              "determinism": lambda: reused.determinism(spec)}
    for name in runs:
        results[name] = others[name]()
        if progress:
            progress(total - len(runs) + runs.index(name) + 1, total)
    _explain(results)
    ordered = [results[name] for name in CHECKS if name in results]
    return HealthResult(case.name, recorded.steps if recorded else 0, ordered,
                        recorded.losses if recorded else [],
                        recorded.grad_norms if recorded else {},
                        recorded.update_ratios if recorded else {}, notes,
                        time.perf_counter() - started)


def _chosen(checks: Sequence[str] | None) -> list[str]:
    if checks is None:
        return list(CHECKS)
    unknown = [c for c in checks if c not in CHECKS]
    if unknown:
        raise CaseError(f"--checks: no check named {', '.join(map(repr, unknown))}; the checks "
                        f"are {', '.join(CHECKS)}")
    if not checks:
        raise CaseError(f"--checks names no check; choose from {', '.join(CHECKS)}")
    return [c for c in CHECKS if c in checks]


def _explain(results: dict[str, Check]) -> None:
    """A failure that another check's failure explains becomes a warning that names it; a
    blocked parameter (overfit's own finding) is never explained away."""
    for name, causes in EXPLAINED_BY.items():
        check = results.get(name)
        if check is None or not check.failed or any(
                check.details.get(key) for key in ("no_gradient", "frozen", "not_updated")):
            continue
        cause = next((c for c in causes if c in results and results[c].failed), None)
        if cause is not None:
            check.verdict = Verdict.WARN
            check.evidence += f" (explained by {cause}: {results[cause].site or 'see it'})"
