"""The one judge: whether a pair of values is within tolerance, and what a row's verdict is.

Every comparison in layerdiff decides here (the tensor diff, the statistics-only diff of
summary traces, replay, swap, bisect, the HTML heatmap), so NaN and Inf mean the same thing
everywhere. Pure numpy.

Element rule, ``torch.testing.assert_close``'s: ``|port - ref| <= atol + rtol * |ref|``. Each
element's *ratio* is ``|port - ref| / (atol + rtol * |ref|)`` (0 where the two are equal), so an
element is within tolerance exactly when its ratio is at most 1. Non-finite values:

- NaN at the same place on both sides is a match (ratio 0);
- Inf of the same sign at the same place on both sides is a match (ratio 0);
- NaN or Inf on one side only, or Infs of opposite signs, are out (ratio inf). A NaN in the
  port where the reference is finite is always out, whatever the tolerance.

A ratio is *within* when it is at most 1: a NaN ratio never is. The worst of several ratios
counts a NaN as inf (Python's ``max([0.5, nan])`` is 0.5 and would hide it).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from enum import StrEnum

import numpy as np


class Verdict(StrEnum):
    """A diff row's verdict."""

    IDENTICAL = "identical"        # same bytes: both records' bytes compared equal
    # same digest, bytes not compared (a side without data: a summary trace; or not read:
    # --no-verify). Equal against accidental change (a chance near 2**-63 of a collision),
    # not against a deliberate one: the digest is linear, and a crafted change can keep it
    SAME_DIGEST = "same-digest"
    WITHIN = "within"              # every element within tolerance
    OUT = "out"
    SHAPE_MISMATCH = "shape-mismatch"
    REF_NAN = "ref-nan"            # the reference has NaN where the port is finite: reported,
                                   # not the port's fault, when the rest is within
    # an op site's record is out, but every record of the module call that runs it is within
    # in that pass: the port reaches the module's values through other intermediate ones
    # (scaling q before q @ k^T rather than after), so the difference is not an error
    MODULE_WITHIN = "module-within"
    # out only at padding positions that the reference's gradient shows the loss leaves
    # unused (compare/padding.py): what a model computes there is read by nothing
    PADDING = "padding-only"


PASSING = frozenset({Verdict.IDENTICAL, Verdict.SAME_DIGEST, Verdict.WITHIN, Verdict.REF_NAN,
                     Verdict.MODULE_WITHIN, Verdict.PADDING})
UNCHANGED = frozenset({Verdict.IDENTICAL, Verdict.SAME_DIGEST})  # no difference seen


class Status(StrEnum):
    """What origin finding says of an out-of-tolerance row ("" for none)."""

    NONE = ""
    ORIGIN = "origin"              # its own error, while what came in was within
    HOLDS_ORIGIN = "holds-origin"  # a container around an origin
    PROPAGATED = "propagated"      # explained by an earlier origin (see the row's cause)
    CANNOT_JUDGE = "cannot-judge"  # what comes into it has no partner in the port


def within(ratio: float) -> bool:
    """A ratio is within tolerance when it is at most 1; NaN never is."""
    return bool(ratio <= 1.0)


def worst(ratios: Iterable[float]) -> float:
    """The largest ratio, NaN counted as inf; 0 for none."""
    found = 0.0
    for ratio in ratios:
        ratio = float(ratio)
        if math.isnan(ratio):
            return math.inf
        found = max(found, ratio)
    return found


def differences(ref: np.ndarray, port: np.ndarray, out: np.ndarray,
                work: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
    """``|port - ref|`` with the non-finite rules applied (0 for a match, inf for a mismatch),
    and whether every difference was finite to begin with. ``out`` (float64) and ``work`` (the
    inputs' type) are reusable scratch arrays of the inputs' size."""
    with np.errstate(invalid="ignore", over="ignore"):
        np.abs(np.subtract(ref, port, out=work), out=out)
    finite = np.isfinite(out)
    if finite.all():
        return out, True
    same = (ref == port) | (np.isnan(ref) & np.isnan(port))
    return np.where(finite, out, np.where(same, 0.0, np.inf)), False


def ratios(diff: np.ndarray, ref_magnitude: np.ndarray, rtol: float, atol: float,
           out: np.ndarray, *, all_finite: bool) -> np.ndarray:
    """Each element's error over its tolerance, from :func:`differences` and ``|ref|``."""
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        np.multiply(ref_magnitude, rtol, out=out)
        out += atol
        np.divide(diff, out, out=out)
    if atol == 0 or not all_finite:  # 0/0, or 0 over an infinite tolerance
        out[diff == 0] = 0.0
    if not all_finite:  # a mismatch at an infinite reference is inf/inf: still out
        out[np.isinf(diff)] = np.inf
    return out


def element_ratios(ref: np.ndarray, port: np.ndarray, rtol: float, atol: float) -> np.ndarray:
    """Each element's ratio, for whole arrays in memory (plots, swap)."""
    ref = np.asarray(ref, dtype=np.float64)
    port = np.asarray(port, dtype=np.float64)
    diff, all_finite = differences(ref, port, np.empty(ref.shape))
    return ratios(diff, np.abs(ref), rtol, atol, np.empty(ref.shape), all_finite=all_finite)


def verdict(ratio: float, *, ref_nan: int = 0, port_nan: int = 0, port_inf: int = 0,
            finite_ratio: float = math.inf) -> Verdict:
    """A compared row's verdict from its worst ratio. NaN in the reference where the port is
    finite is not the port's fault, but only where the rest (``finite_ratio``: the worst
    ratio over the elements where the reference is finite) is within."""
    if within(ratio):
        return Verdict.WITHIN
    if ref_nan and not port_nan and not port_inf and within(finite_ratio):
        return Verdict.REF_NAN
    return Verdict.OUT


def statistics_ratio(ref_stats: np.ndarray, port_stats: np.ndarray, rtol: float, atol: float,
                     *, ref_counts: tuple[int, int], port_counts: tuple[int, int]) -> float:
    """The worst ratio of per-element statistics (min, max, mean, std, rms) of a summary
    trace, each held to the element tolerance. ``*_counts`` are (NaN, Inf) counts: more
    non-finite values in the port than in the reference means one where the reference is
    finite, which is out."""
    if port_counts[0] > ref_counts[0] or port_counts[1] > ref_counts[1]:
        return math.inf
    found = element_ratios(ref_stats, port_stats, rtol, atol)
    return worst(found.tolist())
