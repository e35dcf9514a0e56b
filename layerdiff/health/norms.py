"""``gradient-flow`` and ``update-ratio``: each layer's gradient and update over the steps,
ranked against the median layer, so one layer that is far off is named wherever the model's
own scale lies. Thresholds, with why: docs/health.md.

A layer is a module holding parameters of its own, its parameters taken together. Layers with
no gradient at all are the ``overfit`` check's (learning blocked there), not judged here.
"""

from __future__ import annotations

import math
import warnings

import numpy as np

from layerdiff.health.record import Record
from layerdiff.health.result import Check, Verdict

# gradient-flow: a layer's gradient RMS (norm over sqrt(elements), so size does not count),
# its median over the steps, against the median of all layers. Healthy layers differ by a
# factor of ~10 (normalisation layers, embeddings read sparsely); vanishing or exploding
# through depth compounds a factor per layer, and a factor of 1000 is far beyond the spread
# of a healthy model.
FLOW_WARN = 100.0
FLOW_FAIL = 1000.0
SPIKE = 100.0      # one step's gradient norm that many times the layer's own median: a spike

# update-ratio: ||dtheta|| / ||theta|| per step. The rule of thumb is ~1e-3 a step; a layer
# at 1e-1 rewrites a tenth of itself each step, one at 1e-5 barely moves (the band, a warning:
# it is a rule of thumb, and tiny models train well above it). Relative, per step, to the
# median of the other layers: with Adam a layer's ratio is ~lr / (its weights' RMS), and
# standard initialisations put healthy layers within ~10x of each other (LayerNorm and
# embeddings at 1.0 below Linear layers at 1/sqrt(fan-in)); a layer 30x above the others at
# some step moves far faster than its weights' scale justifies (its learning rate, a missing
# weight decay, tiny weights). Taken at its worst step: under Adam a too-large learning rate
# shows fully at step 0 and then grows the weights, which hides it in later steps' ratios.
IDEAL_RATIO = 1e-3
BAND = (1e-5, 1e-1)
RELATIVE_FAIL = 30.0
RELATIVE_LOW = 1e-3   # a layer 1000x below the median barely learns (warn)


def _typical(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v) and v > 0]
    return float(np.median(finite)) if finite else math.nan


def gradient_flow(record: Record) -> Check:
    typical = {layer: _typical(rms) for layer, rms in record.grad_rms.items()}
    typical = {layer: v for layer, v in typical.items() if math.isfinite(v)}
    if len(typical) < 2:
        return Check("gradient-flow", Verdict.SKIP,
                     f"{len(typical)} layer(s) with a gradient: nothing to rank against")
    median = float(np.median(list(typical.values())))
    details = {"median_rms": median, "layers": typical}
    factor = {layer: v / median for layer, v in typical.items()}
    low = min(factor, key=factor.get)
    high = max(factor, key=factor.get)
    worst = low if 1 / factor[low] >= factor[high] else high
    off = factor[worst] if worst == high else 1 / factor[worst]
    # a layer far below the others has a vanishing gradient; one far above, an exploding
    # one (or, at the output end, the others' gradients vanish on their way back)
    kind = "exploding" if worst == high else "vanishing"
    step = _worst_step(record.grad_rms[worst], worst == high)
    said = (f"gradient RMS {typical[worst]:.3g}, {off:.3g}x "
            f"{'above' if kind == 'exploding' else 'below'} the median layer's {median:.3g}")
    if off >= FLOW_FAIL:
        return Check("gradient-flow", Verdict.FAIL, f"{kind}: {said} (> {FLOW_FAIL:g}x)",
                     worst, step, details)
    if off >= FLOW_WARN:
        return Check("gradient-flow", Verdict.WARN, f"{kind}? {said} (> {FLOW_WARN:g}x)",
                     worst, step, details)
    spikes = _spikes(record.grad_norms)
    details["spikes"] = spikes
    if spikes:
        layer, at, times = spikes[0]
        return Check("gradient-flow", Verdict.WARN,
                     f"gradient norm spikes to {times:.3g}x its median at step {at}",
                     layer, at, details)
    return Check("gradient-flow", Verdict.PASS,
                 f"{len(typical)} layers within {off:.3g}x of the median gradient RMS "
                 f"{median:.3g} (the site: the farthest)", worst, step, details)


def _worst_step(values: list[float], highest: bool) -> int | None:
    finite = [(v, i) for i, v in enumerate(values) if math.isfinite(v) and v > 0]
    if not finite:
        return None
    return (max(finite) if highest else min(finite))[1]


def _spikes(norms: dict[str, list[float]]) -> list[tuple[str, int, float]]:
    found = []
    for layer, values in norms.items():
        typical = _typical(values)
        if not math.isfinite(typical):
            continue
        for step, value in enumerate(values):
            if math.isfinite(value) and value > SPIKE * typical:
                found.append((layer, step, value / typical))
                break
    return sorted(found, key=lambda f: f[1])


def relative_factors(ratios: dict[str, list[float]]) -> dict[str, tuple[float, int]]:
    """Each layer's largest factor over the steps, and its step, of its update ratio over the
    median of the other layers' ratios at that step (the others', so that with two layers
    one far off is not hidden in the median it makes)."""
    names = list(ratios)
    table = np.array([ratios[n] for n in names], dtype=np.float64).reshape(len(names), -1)
    table = np.where(np.isfinite(table) & (table > 0), table, np.nan)
    found: dict[str, tuple[float, int]] = {}
    for i, name in enumerate(names):
        others = np.delete(table, i, axis=0)
        if not len(others) or np.isnan(table[i]).all():
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a step no other layer moved
            factor = table[i] / np.nanmedian(others, axis=0)
        if np.isnan(factor).all():
            continue
        step = int(np.nanargmax(factor))
        found[name] = (float(factor[step]), step)
    return found


def update_ratio(record: Record) -> Check:
    if not record.trained:
        return Check("update-ratio", Verdict.SKIP, "the case has no optimizer, so no update "
                     "to measure; give the Case an optimizer")
    # a layer whose gradient is zero at every step (dead units, a zero mask after it) moves by
    # weight decay alone (AdamW: lr x decay of itself a step): not learning, so no yardstick
    # for the others' rates (beside it any layer that learns looks ~100x too fast); it is
    # overfit's and dead-units' finding
    still = {layer for layer, rms in record.grad_rms.items()
             if not math.isfinite(_typical(rms))}
    typical = {layer: _typical(r) for layer, r in record.update_ratios.items()
               if layer not in still}
    typical = {layer: v for layer, v in typical.items() if math.isfinite(v)}
    if not typical:
        return Check("update-ratio", Verdict.SKIP, "no layer was updated: see overfit")
    median = float(np.median(list(typical.values())))
    factors = relative_factors({layer: record.update_ratios[layer] for layer in typical})
    details = {"median": median, "layers": typical, "band": list(BAND),
               "ideal": IDEAL_RATIO,
               "relative": {layer: f for layer, (f, _) in factors.items()},
               "zero_gradient_layers": sorted(still & set(record.update_ratios))}
    if factors:
        fastest = max(factors, key=lambda layer: factors[layer][0])
        factor, step = factors[fastest]
        if factor >= RELATIVE_FAIL:
            value = record.update_ratios[fastest][step]
            return Check("update-ratio", Verdict.FAIL,
                         f"updates {value:.3g} of its norm at step {step}, "
                         f"{factor:.3g}x the other layers' median (> {RELATIVE_FAIL:g}x): its "
                         "learning rate or scale is off", fastest, step, details)
    high = max(typical, key=typical.get)
    low = min(typical, key=typical.get)
    outside = {layer: v for layer, v in typical.items() if not BAND[0] <= v <= BAND[1]}
    if outside:
        layer = max(outside, key=lambda name: abs(math.log10(outside[name] / IDEAL_RATIO)))
        return Check("update-ratio", Verdict.WARN,
                     f"updates {outside[layer]:.3g} of its norm a step (median over "
                     f"steps), outside [{BAND[0]:g}, {BAND[1]:g}] (ideal ~{IDEAL_RATIO:g}); "
                     f"{len(outside)} of {len(typical)} layers outside",
                     layer, _worst_step(record.update_ratios[layer],
                                        outside[layer] > BAND[1]), details)
    if len(typical) >= 3 and typical[low] <= RELATIVE_LOW * median:
        return Check("update-ratio", Verdict.WARN,
                     f"updates {typical[low]:.3g} of its norm a step, "
                     f"{median / typical[low]:.3g}x below the median layer's {median:.3g}",
                     low, _worst_step(record.update_ratios[low], False), details)
    return Check("update-ratio", Verdict.PASS,
                 f"median {median:.3g} a step over {len(typical)} layers, within "
                 f"[{BAND[0]:g}, {BAND[1]:g}]; the highest (the site) {typical[high]:.3g}",
                 high, _worst_step(record.update_ratios[high], True), details)
