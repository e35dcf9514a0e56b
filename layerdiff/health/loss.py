"""``initial-loss`` and ``overfit``: the loss at step 0 against what chance predicts, and
whether the loss falls when the model is trained on its one batch (and where learning is
blocked when it cannot). Thresholds, with why: docs/health.md."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Sequence

from layerdiff.health.record import Record
from layerdiff.health.result import Check, Verdict

# initial-loss. Logits z of standard deviation s over C classes, unrelated to the labels, give
# a cross-entropy of E[logsumexp z] - E[z_y] ~ ln C + s^2 / 2 (s small), so the loss's excess
# over ln C says how large the logits start: s ~ sqrt(2 * excess). An output layer initialised
# k times too large multiplies s by k.
WARN_EXCESS = 0.5   # nats: logits start with s > 1, more confident than chance allows
FAIL_EXCESS = 2.0   # nats: s > 2, the softmax saturated at step 0 (confidently wrong)
LOW_RATIO = 0.5     # a loss under half of ln C at step 0: the labels leak, or it is not CE
PROBE_AGREES = 0.01  # the case's loss of uniform logits within 1% of ln C: a CE over C classes

# overfit. On one batch the loss of a trainable model falls; by how much in N steps depends on
# the optimizer, so the rule is relative to the first loss.
FIT_FRACTION = 0.5    # the best loss at most half the first: it is learning the batch
STUCK_FRACTION = 0.99  # the best loss within 1% of the first: learning is blocked


def initial_loss(record: Record, expected: float | None = None) -> Check:
    """Step 0's loss against ln C (C from the logits' last axis), or against ``expected``."""
    if record.initial is None:
        return Check("initial-loss", Verdict.SKIP, f"no finite loss at step 0 "
                     f"({record.stopped}); the nonfinite check says where it came from", step=0)
    measured = record.initial
    logits = record.logits
    site = logits.site if logits else None
    if expected is None:
        if logits is None or logits.classes < 2:
            return Check("initial-loss", Verdict.SKIP,
                         f"loss {measured:.4g} at step 0; the output has no class axis to "
                         "predict a chance loss from; declare the case's "
                         "expected_initial_loss (or --expected-loss)", site, 0,
                         {"loss": measured})
        chance = math.log(logits.classes)
        if logits.loss_reads_logits and math.isfinite(logits.uniform_loss) and (
                abs(logits.uniform_loss - chance) > PROBE_AGREES * chance):
            return Check("initial-loss", Verdict.SKIP,
                         f"loss {measured:.4g} at step 0; uniform logits give "
                         f"{logits.uniform_loss:.4g}, not ln {logits.classes} = {chance:.4g}, so "
                         "the loss is not a cross-entropy over the last axis; declare the "
                         "case's expected_initial_loss (or --expected-loss)", site, 0,
                         {"loss": measured, "uniform_logits_loss": logits.uniform_loss})
        basis = f"ln {logits.classes} = {chance:.4g}"
    else:
        chance, basis = float(expected), f"the declared {float(expected):.4g}"
    excess = measured - chance
    spread = math.sqrt(2 * excess) if excess > 0 else 0.0
    details = {"loss": measured, "expected": chance, "excess": excess,
               "ratio": measured / chance if chance else math.nan,
               "logit_std_implied": spread,
               "classes": logits.classes if logits else None}
    said = f"loss {measured:.4g} vs {basis} ({excess:+.3g} nats"
    if excess > FAIL_EXCESS:
        return Check("initial-loss", Verdict.FAIL,
                     f"{said}, > {FAIL_EXCESS:g}): the logits start with a spread of "
                     f"~{spread:.3g} (softmax saturated): the output layer's initial scale is "
                     "too large, or the final layer is wrong", site, 0, details)
    if excess > WARN_EXCESS:
        return Check("initial-loss", Verdict.WARN,
                     f"{said}, > {WARN_EXCESS:g}): the logits start more confident than "
                     f"chance (spread ~{spread:.3g})", site, 0, details)
    if chance > 0 and measured < LOW_RATIO * chance:
        return Check("initial-loss", Verdict.WARN,
                     f"{said}): below {LOW_RATIO:g}x the chance loss before any training: "
                     "the labels may leak into the inputs", site, 0, details)
    return Check("initial-loss", Verdict.PASS, f"{said}): as chance predicts", site, 0, details)


def overfit(record: Record, allow_frozen: Sequence[str] = ()) -> Check:
    """Whether the loss falls on the one batch, and the parameters that cannot learn:
    frozen (requires_grad False, unless ``allow_frozen`` globs name them), or with no gradient
    at any step (the graph is cut: a detach, a layer whose output is not used)."""
    if not record.trained:
        return Check("overfit", Verdict.SKIP, "the case has no optimizer, so it cannot be "
                     "trained on its batch; give the Case an optimizer")
    losses = record.losses
    frozen = [n for n in record.frozen if not any(fnmatch.fnmatchcase(n, g)
                                                  for g in allow_frozen)]
    details = {"losses": losses, "frozen": frozen, "no_gradient": record.absent,
               "zero_gradient": record.zero, "allowed_frozen": sorted(set(record.frozen)
                                                                      - set(frozen))}
    details["not_updated"] = record.unmoved
    if record.absent or frozen or record.unmoved:
        kinds = []
        if record.absent:
            kinds.append(f"{len(record.absent)} with no gradient at any step "
                         f"({_names(record.absent)}: the graph is cut after them, a detach)")
        if frozen:
            kinds.append(f"{len(frozen)} frozen, requires_grad False ({_names(frozen)})")
        if record.unmoved:
            kinds.append(f"{len(record.unmoved)} with a gradient that the optimizer never "
                         f"moves ({_names(record.unmoved)}: not in its param groups, or lr 0)")
        return Check("overfit", Verdict.FAIL, "learning is blocked: parameters "
                     + "; ".join(kinds), _blocked_site(record, frozen), None, details)
    if len(losses) < 2:
        return Check("overfit", Verdict.SKIP, f"only {len(losses)} finite step "
                     f"({record.stopped or 'one step asked'}): nothing to fit", None, None,
                     details)
    first, best = losses[0], min(losses[1:])
    at = losses.index(best)
    fell = f"loss {first:.4g} -> best {best:.4g} at step {at} of {len(losses)}"
    details.update({"first": first, "best": best, "best_step": at})
    zero = (f"; {len(record.zero)} parameter(s) get an exactly zero gradient "
            f"({_names(record.zero)})" if record.zero else "")
    if best > STUCK_FRACTION * first if first > 0 else best >= first:
        return Check("overfit", Verdict.FAIL, f"{fell}: it does not learn its one batch"
                     + zero, record.zero[0] if record.zero else None, at, details)
    if best > FIT_FRACTION * first if first > 0 else False:
        return Check("overfit", Verdict.WARN, f"{fell}: falls, but not to half in "
                     f"{len(losses)} steps (--steps more to see it fit)" + zero,
                     record.zero[0] if record.zero else None, at, details)
    if record.zero:
        return Check("overfit", Verdict.WARN, f"{fell}" + zero + ": they do not learn",
                     record.zero[0], at, details)
    return Check("overfit", Verdict.PASS, f"{fell}: it fits its batch", None, at, details)


def _blocked_site(record: Record, frozen: list[str]) -> str:
    """Where learning is blocked: for a cut graph, the layer called last among those with no
    gradient (the cut lies just after it: everything before it is cut off too); else the first
    frozen or unmoved parameter's layer."""
    if record.absent:
        layers = [record.layer_of(name) for name in record.absent]
        return max(layers, key=lambda layer: record.order.get(layer, -1))
    return record.layer_of((frozen or record.unmoved)[0])


def _names(names: Sequence[str], shown: int = 3) -> str:
    return ", ".join(names[:shown]) + (f" and {len(names) - shown} more"
                                       if len(names) > shown else "")
