"""Values as evidence: a port output that equals the reference's recorded one, and which port
argument equals which reference argument."""

from __future__ import annotations

import math
from collections import Counter, defaultdict

import numpy as np

from layerdiff.trace import Trace, schema

VALUE_RTOL = 1e-3       # a port value this close (relative Frobenius) to the reference's is it


def _output_error(ref: Trace, ref_out: dict, port_out: dict[str, np.ndarray]) -> float | None:
    gap = norm = 0.0
    for arg, row in ref_out.items():
        if arg not in port_out or schema.parse_shape(row["shape"]) != port_out[arg].shape:
            return None
        if not np.issubdtype(port_out[arg].dtype, np.floating):
            continue
        expected = np.asarray(ref.read(row), dtype=np.float64)
        gap += float(np.sum((port_out[arg] - expected) ** 2))
        norm += float(np.sum(expected ** 2))
    if not norm:
        return None
    return float(np.sqrt(gap / norm))


OTHER_QUANTITY = 0.5    # an output this far from the reference's is another quantity


def _other_outputs(ref: Trace, ref_out: dict, port_out: dict[str, np.ndarray]
                   ) -> dict[str, float]:
    """Outputs other than the first (arg -> relative error) that are another quantity than the
    reference's of the same path and shape, where the first output equals the reference's: the
    port computes the same thing with its inputs and weights, so the difference is what the
    output is (scores before a softmax against its weights), not an error upstream."""
    first = _output_error(ref, {a: r for a, r in ref_out.items() if a == "0"}, port_out)
    if first is None or first > VALUE_RTOL:
        return {}
    found = {}
    for arg, row in ref_out.items():
        if arg == "0":
            continue
        error = _output_error(ref, {arg: row}, port_out)
        if error is not None and error > OTHER_QUANTITY:
            found[arg] = error
    return found


def _equal_output(error: float) -> str:
    """Said by its power of ten, so that the blocks of a glob rule say it alike."""
    bound = 10.0 ** math.ceil(math.log10(max(error, 1e-12)))
    return f"output equals the reference's (relative error <= {bound:.0e})"


def _argument_map(ref: Trace, ref_in: dict, port_in: dict[str, np.ndarray], *,
                  upstream: bool = True) -> dict[str, tuple[str, int]]:
    """Reference argument -> (port argument, weight) for the top-level arguments this call
    decides: by equal value (weight 2), else, once some value agreed, by the one remaining
    port argument of the same shape and dtype (weight 1). Arguments it cannot decide (a port
    that computes something else upstream) are left out. Without ``upstream`` (the root: its
    arguments are the case's data, which nothing computes) only equal values decide: Hugging
    Face's ``labels`` are not the port's ``tokens`` (the labels shifted right) for sharing a
    shape."""
    names = [a for a in ref_in if "." not in a]
    port_names = [a for a in port_in if "." not in a]
    decided: dict[str, tuple[str, int]] = {}
    expected = {name: np.asarray(ref.read(ref_in[name])) for name in names}
    for name in names:
        equal = [p for p in port_names if _equal(expected[name], port_in[p])]
        if equal:
            decided[name] = (name if name in equal else equal[0], 2)
    if not decided:
        return {}
    if not upstream:
        return decided
    claimed = {target for target, _ in decided.values()}
    for name in names:
        if name in decided:
            continue
        fits = [p for p in port_names if p not in claimed
                and port_in[p].shape == expected[name].shape
                and port_in[p].dtype.kind == expected[name].dtype.kind]
        if len(fits) == 1:
            decided[name] = (fits[0], 1)
            claimed.add(fits[0])
    return decided


def _equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a.shape != b.shape:
        return False
    if np.issubdtype(a.dtype, np.floating) or np.issubdtype(b.dtype, np.floating):
        a, b = a.astype(np.float64), b.astype(np.float64)
        scale = float(np.sqrt(np.sum(a ** 2))) or 1.0
        return float(np.sqrt(np.sum((a - b) ** 2))) <= VALUE_RTOL * scale
    return bool(np.array_equal(a, b))


def _agreed_args(maps: list[dict[str, tuple[str, int]]]) -> tuple[dict[str, str], str]:
    """The argument map the calls vote for (each argument on its own; a call that could not
    decide one abstains), with a doubt said where they disagree."""
    votes: dict[str, Counter] = defaultdict(Counter)
    for decided in maps:
        for name, (target, weight) in decided.items():
            votes[name][target] += weight
    agreed, doubts = {}, []
    for name, counted in votes.items():
        target = counted.most_common(1)[0][0]
        if target != name:
            agreed[name] = target
        if len(counted) > 1:
            doubts.append(f"argument {name}: " + ", ".join(
                f"{t} ({n})" for t, n in counted.most_common()))
    doubt = ("UNSURE: the calls disagree on " + "; ".join(doubts)) if doubts else ""
    return agreed, doubt
