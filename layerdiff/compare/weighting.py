"""Routing weights applied otherwise than the reference's, named at the origin with the
router's own numbers.

A router reaches the loss two ways: its choice of experts (a decision, compared in
:mod:`layerdiff.compare.routing`) and the weights it gives the chosen experts' outputs (the only
way its scores get a gradient). So a port that chooses the same experts but weights them
otherwise shows in two places, each checked here against the numbers, never guessed:

- weights normalised otherwise: each token's output is the reference's times one factor per
  token, the sum of its top-k probabilities or one over it;
- no weights at all (the chosen experts' outputs summed, or the weights detached): the port's
  router gets no gradient while the reference's does, since nothing else carries one back to
  its scores; where the port records its experts' per-expert outputs (tokens, k, dim), its
  output is also their plain sum.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layerdiff.compare.hints._common import Kind
from layerdiff.compare.judge import element_ratios
from layerdiff.compare.pair import origin_row
from layerdiff.compare.result import Origin
from layerdiff.compare.routing import RouterReport, call_spans
from layerdiff.errors import LayerdiffError
from layerdiff.trace import Trace, schema
from layerdiff.trace.routers import read_side

_GRADIENT_ROLES = ("grad_output", "grad_input", "weight_grad")


def explain_weighting(origins: list[Origin], reports: list[RouterReport], ref: Trace,
                      reader: Any) -> None:
    """Name the routing weights as the cause at an origin they explain (``origin.hint``).

    Forward, at the router's own weights output: the port's are the reference's times one
    factor per token (normalised otherwise). Forward, at an origin whose call holds a router or
    takes its choice (HF's experts, which weight their outputs themselves): the port's output is
    the reference's times a per-token factor its router probabilities make, or the port's
    router gets no gradient (unweighted). Backward, at the router itself: its gradient is
    missing in the port. Read for origins no flip explains; any other hint it replaces, since
    this one is matched to the router's own numbers."""
    if not origins or not reports or reader is None:
        return
    enter, leave = call_spans(ref)
    for origin in origins:
        if origin.routing:
            continue
        key = (origin.step, origin.site)
        for report in reports:
            router = (report.step, report.site)
            if report.step != origin.step or router not in enter or key not in enter:
                continue
            evidence = None
            if origin.pass_ == "backward" and origin.site == report.site:
                evidence = _detached(origin, report, ref, reader.port)
            elif origin.pass_ == "forward" and origin.site == report.site:
                evidence = _proportional(origin, report, reader)
            elif origin.pass_ == "forward" and origin.role == "output" and (
                    (enter[key] <= enter[router] and leave[router] <= leave[key])
                    or _takes_the_choice(origin.site, report)):
                evidence = _weighting(origin, report, ref, reader) \
                    or _unweighted(origin, report, ref, reader)
            if evidence is not None:
                origin.hint = {"kind": str(Kind.ROUTING_WEIGHTS), "evidence": evidence}
                break


def _takes_the_choice(site: str, report: RouterReport) -> bool:
    """Whether ``site`` takes the router's recorded choice as an input (the experts)."""
    return any(record[0] == site and record[1] == "input" for record in report.records)


def _weighting(origin: Origin, report: RouterReport, ref: Trace, reader: Any) -> str | None:
    """The sentence when the port's output is, token by token, the reference's times the sum
    of its top-k router probabilities (or divided by it); None otherwise."""
    pair = _outputs(origin, report, reader)
    if pair is None:
        return None
    side = read_side(ref, report.step, report.site, report.k)
    if side is None:
        return None
    probs = side.scores
    if not (np.all(probs >= 0) and np.allclose(probs.sum(-1), 1.0, atol=1e-3)):
        probs = np.exp(probs - probs.max(-1, keepdims=True))  # logits: the router's softmax
        probs /= probs.sum(-1, keepdims=True)
    kept = np.take_along_axis(probs, side.chosen, axis=-1).sum(-1)  # (T,)
    ref_rows, port_rows = pair
    rtol, atol = _tolerance(origin)
    span = f"{kept.min():.3g}–{kept.max():.3g} over the {report.tokens} tokens"
    for factor, said in (
            (kept, f"times the sum of its top-{report.k} router probabilities ({span}): the port "
                   f"does not renormalise its top-{report.k} routing weights, which the "
                   "reference divides by their sum"),
            (1 / kept, f"divided by the sum of its top-{report.k} router probabilities "
                       f"({span}): the port renormalises its top-{report.k} routing weights "
                       "(or takes the softmax over the top k only) where the reference keeps "
                       "the full softmax's")):
        if np.allclose(factor, 1.0, rtol=0, atol=1e-6):
            continue  # every token keeps all its probability: nothing to tell apart
        model = ref_rows * factor[:, None]
        if float(np.nanmax(element_ratios(model, port_rows, rtol, atol), initial=0.0)) <= 1.0:
            return (f"each token's output is the reference's {said}; with that factor every "
                    "element is within tolerance")
    return None


def _proportional(origin: Origin, report: RouterReport, reader: Any) -> str | None:
    """At a router whose output is the chosen experts' weights (T, k): the sentence when the
    port's are the reference's times one factor per token, not all 1 (the same experts in the
    same proportions, normalised otherwise), with what each side's weights sum to."""
    if origin.role != "output":
        return None
    try:
        ref_w, port_w = reader.read(origin_row(origin), compared=True)
    except (LayerdiffError, OSError, ValueError):
        return None
    if ref_w.shape != port_w.shape or ref_w.size != report.tokens * report.k \
            or ref_w.shape[-1] != report.k or "float" not in str(ref_w.dtype):
        return None
    ref_rows = np.asarray(ref_w, np.float64).reshape(report.tokens, report.k)
    port_rows = np.asarray(port_w, np.float64).reshape(report.tokens, report.k)
    with np.errstate(all="ignore"):
        factor = (ref_rows * port_rows).sum(-1) / (ref_rows * ref_rows).sum(-1)
    if not np.all(np.isfinite(factor)) or np.allclose(factor, 1.0, rtol=0, atol=1e-6):
        return None
    rtol, atol = _tolerance(origin)
    model = ref_rows * factor[:, None]
    if float(np.nanmax(element_ratios(model, port_rows, rtol, atol), initial=0.0)) > 1.0:
        return None
    return (f"each token's top-{report.k} routing weights are the reference's times one factor "
            f"per token ({_span(factor)} over the {report.tokens} tokens): the same experts "
            "weighted in the same proportions, normalised otherwise (a renormalisation of the "
            "top k added or left out, or another scale); the reference's weights sum to "
            f"{_span(ref_rows.sum(-1))} per token, the port's to {_span(port_rows.sum(-1))}")


def _span(values: np.ndarray) -> str:
    low, high = float(values.min()), float(values.max())
    return f"{low:.3g}" if f"{low:.3g}" == f"{high:.3g}" else f"{low:.3g}–{high:.3g}"


def _unweighted(origin: Origin, report: RouterReport, ref: Trace, reader: Any) -> str | None:
    """The sentence when the port's router gets no gradient where the reference's does, while
    the backward ran through the port's block: its experts' outputs reach the loss without the
    routing weights. The per-expert outputs' plain sum, where recorded, is checked too."""
    port = reader.port
    ours = _largest_gradient(ref, report.step, report.site)
    theirs = _largest_gradient(port, report.step, report.port_site)
    through = _largest_gradient(port, report.step, origin.port_site)
    if not ours or theirs or not through:  # no backward recorded, or the router got one
        return None
    summed = _plain_sum(origin, report, reader)
    lead = (f"the port sums its experts' outputs without their routing weights (its output is "
            f"the plain sum of {summed}'s top-{report.k} per-expert outputs, within tolerance)"
            if summed else "the port's routing weights do not reach its output (the chosen "
            "experts' outputs summed without them, or the weights detached)")
    return (f"{lead}: its router {report.port_site} gets {_none(theirs)} gradient where the "
            f"reference's reaches {ours:.3g}, and only the routing weights carry one back to a "
            "router's scores")


def _detached(origin: Origin, report: RouterReport, ref: Trace, port: Trace) -> str | None:
    """At the router's own backward: the port's router got no gradient where the
    reference's did."""
    ours = _largest_gradient(ref, report.step, report.site)
    theirs = _largest_gradient(port, report.step, report.port_site)
    if not ours or theirs:
        return None
    return (f"the port's router {report.port_site} gets {_none(theirs)} gradient where the "
            f"reference's reaches {ours:.3g}: its routing weights do not reach the loss (the "
            "chosen experts' outputs summed without them, or the weights detached), and only "
            "they carry a gradient back to a router's scores")


def _none(largest: float | None) -> str:
    return "no" if largest is None else "an all-zero"


def _largest_gradient(trace: Trace, step: int, site: str) -> float | None:
    """The largest magnitude among a call's gradient records (from the index's statistics,
    so a summary trace answers too); None when the call recorded no gradient at all."""
    rows = trace.records(step, site, pass_="backward")
    rows = rows[rows["role"].isin(_GRADIENT_ROLES) & (rows["kind"] == "tensor")]
    if rows.empty:
        return None
    values = np.abs(rows[["min", "max"]].to_numpy(dtype=np.float64))
    return float(np.nanmax(values)) if np.isfinite(values).any() else float("inf")


def _plain_sum(origin: Origin, report: RouterReport, reader: Any) -> str | None:
    """The port call inside the origin whose output 0 holds each token's k per-expert outputs
    ((T, k, D) or (k, T, D)) and whose plain sum over k is the port's output; None if none."""
    port = reader.port
    try:
        port_out = np.asarray(port.read(port.find(origin.step, origin.port_site, "output", "0",
                                                  pass_="forward", kind="tensor"),
                                        compared=True), dtype=np.float64)
    except (LayerdiffError, OSError, ValueError, TypeError, KeyError):
        return None
    tokens, k = report.tokens, report.k
    if port_out.size % tokens:
        return None
    width = port_out.size // tokens
    sites = port.sites
    inside = sites.loc[(sites["step"] == origin.step) & (sites["parent"] == origin.port_site),
                       "site"]
    rtol, atol = _tolerance(origin)
    for site in inside:
        row = port.find(origin.step, site, "output", "0", pass_="forward", kind="tensor")
        if row is None or row["segment"] < 0 \
                or np.prod(schema.parse_shape(row["shape"])) != tokens * k * width:
            continue
        outs = np.asarray(port.read(row, compared=True), dtype=np.float64)
        for shape, axis in (((tokens, k, width), 1), ((k, tokens, width), 0)):
            total = outs.reshape(shape).sum(axis=axis)
            if float(np.nanmax(element_ratios(total, port_out.reshape(tokens, width), rtol,
                                              atol), initial=0.0)) <= 1.0:
                return str(site)
    return None


def _outputs(origin: Origin, report: RouterReport,
             reader: Any) -> tuple[np.ndarray, np.ndarray] | None:
    """The origin's two outputs as (tokens, features) float64 rows, or None when they cannot
    be read or are not one row per routed token."""
    try:
        ref_out, port_out = reader.read(origin_row(origin), compared=True)
    except (LayerdiffError, OSError, ValueError):
        return None
    if ref_out.shape != port_out.shape or ref_out.size % report.tokens \
            or not (ref_out.shape[0] == report.tokens or (
                ref_out.ndim >= 2 and ref_out.shape[0] * ref_out.shape[1] == report.tokens)):
        return None
    return (np.asarray(ref_out, np.float64).reshape(report.tokens, -1),
            np.asarray(port_out, np.float64).reshape(report.tokens, -1))


def _tolerance(origin: Origin) -> tuple[float, float]:
    return float(origin.metrics.get("rtol") or 0), float(origin.metrics.get("atol") or 0)
