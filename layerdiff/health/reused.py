"""``nonfinite``, ``batch-independence`` and ``determinism``: the debug commands' own
functions (:func:`~layerdiff.debug.find_nan`, :func:`~layerdiff.debug.batch_independence`,
:func:`~layerdiff.debug.check_determinism`) and their origin rule, each result told as one
check. Their full results are kept in the check's details (their JSON)."""

from __future__ import annotations

from typing import Any

import torch

import layerdiff.rng as rng
from layerdiff.case import Case
from layerdiff.debug.batch import batch_independence
from layerdiff.debug.determinism import check_determinism
from layerdiff.debug.nan import find_nan
from layerdiff.errors import LayerdiffError
from layerdiff.health.result import Check, Verdict


def nonfinite(case: Case, steps: int) -> Check:
    """The first NaN or Inf over ``steps`` training steps (one without an optimizer). The
    model is put back as it was: find_nan trains it in place."""
    steps = steps if case.optimizer is not None else 1
    with _kept(case.model):
        try:
            result = find_nan(case, steps)
        except LayerdiffError as exc:
            return Check("nonfinite", Verdict.SKIP, f"not run: {exc}")
    details = result.as_json()
    if not result.found:
        return Check("nonfinite", Verdict.PASS, f"every forward value, gradient and weight "
                     f"finite over {result.steps_run} step(s)", None, None, details)
    first, origin = result.first, result.origin
    site = origin.site if origin else (result.producer.site if result.producer else first.site)
    step = origin.step if origin else first.step
    made = (f"; made by {site}, {origin.pass_} {origin.role}" if origin else
            f"; made by {result.producer.site or 'the case itself'}" if result.producer else "")
    return Check("nonfinite", Verdict.FAIL,
                 f"first {first.kind} at step {first.step}: {first.pass_} {first.role} of "
                 f"{first.site}{made}", site, step, details)


def batch_mixing(case: Case) -> Check:
    try:
        result = batch_independence(case)
    except LayerdiffError as exc:
        return Check("batch-independence", Verdict.SKIP, f"not run: {exc}")
    details = result.as_json()
    if not result.found:
        allowed = f", {len(result.allowed)} mixing by design" if result.allowed else ""
        return Check("batch-independence", Verdict.PASS,
                     f"no sample's output or gradient depends on another's "
                     f"({result.sites} sites, batch {result.batch_size}{allowed})",
                     None, 0, details)
    origin, first = result.origin, result.first
    site = origin.site if origin else first.site
    pass_ = origin.pass_ if origin else str(first.pass_)
    return Check("batch-independence", Verdict.FAIL,
                 f"{site} mixes samples in its {pass_} ({len(result.mixing)} site(s) mix, "
                 f"tests: {', '.join(str(e.test) for e in first.evidence)})",
                 site, 0, details)


def determinism(spec: str | None) -> Check:
    """Two runs of the case in fresh processes, compared bit for bit: it needs the case's
    ``package.module:name`` (a Case object cannot be rebuilt in another process)."""
    if not spec:
        return Check("determinism", Verdict.SKIP, "needs the case as package.module:name "
                     "(it runs the case in fresh processes); pass the spec, not a Case object")
    try:
        result = check_determinism(spec, runs=2)
    except LayerdiffError as exc:
        return Check("determinism", Verdict.SKIP, f"not run: {exc}")
    details = result.as_json()
    if not result.found:
        return Check("determinism", Verdict.PASS, f"2 runs in fresh processes agree bit for "
                     f"bit ({result.records} records, {result.steps} step(s))", None, None,
                     details)
    first, origin = result.first, result.origin
    within = result.within_tolerance
    verdict = Verdict.WARN if within else Verdict.FAIL
    site = origin.site if origin else first.site
    return Check("determinism", verdict,
                 f"runs differ first at {first.describe()}"
                 + (" (within tolerance)" if within else " (beyond tolerance)"),
                 site, origin.step if origin else first.step, details)


class _kept:
    """The model's parameters, buffers and the random state, put back on leaving."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.tensors = [*model.parameters(), *model.buffers()]
        self.model = model

    def __enter__(self) -> Any:
        self.saved = [t.detach().clone() for t in self.tensors]
        self.random = rng.preserved(rng.cuda_devices(self.tensors))
        self.random.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        with torch.no_grad():
            for tensor, value in zip(self.tensors, self.saved, strict=True):
                tensor.copy_(value)
        self.model.zero_grad(set_to_none=True)
        self.random.__exit__(*exc)
