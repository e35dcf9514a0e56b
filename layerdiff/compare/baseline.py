"""Baselines: judge a port by the error its precision actually makes, record by record.

A *baseline* is the reference run the way the port runs (its dtype, autocast or device). Its
error against the reference at a record is what that precision does there, accumulated through
every layer before it. A faithful port in that precision makes an error of the same size but
not the same bits (other kernels, other summation orders, another CPU's vector width), so the
port's error may be at most ``FACTOR`` times the baseline's, plus a floor of a few roundings in
the compared dtype. The error is measured over the whole record, as a root mean square:

    allowed rms (port - ref) = FACTOR * c(n) * rms (base - ref) + rtol * rms(ref)

that is, the port's relative L2 error at most ``FACTOR`` times the baseline's, plus ``rtol``
(the record-level gate of the AWS Neuron accuracy tooling, which holds module outputs to 1.5x
the relative L2 error of a same-dtype CPU run, with a factor measured here for other kernels).
``c(n)`` (:func:`sampling_factor`) is how far apart two rms estimates of one error level fall
by chance from ``n`` elements: a scalar loss is one draw of its error, and its two runs' draws
were 34x apart across kernel paths; 64 elements of a cancelled bias gradient, 1.48.

Why not the worst element (this module's rule before, ``max |port - ref| <= FACTOR * max |base
- ref| + ...``): two faithful runs do not round the same elements the same way, and the worst
element is where that shows most. Measured across kernel paths of one CPU
(docs/tolerances.md, scripts/precision_study.py): a ReLU whose input rounds across zero in one
run and not the other moves that one gradient element by its whole value (11x the baseline's
worst element in a faithful bfloat16 MLP after one step); a key projection's bias gradient,
which softmax makes zero so that its value is cancellation noise, has a worst element 4.8x the
baseline's. Both are one element, or one noise draw, against another; the rms over the record
averages them (the same records are 2.2x and 2.9x in rms), ``c(n)`` allows for the draws that
remain, and the planted bugs, which move many elements, stay out by as much.

``rtol`` is the relative part of the compared dtype's ``torch.testing`` tolerance (float32
1.3e-6, about 22 roundings; bfloat16 1.6e-2, about 4; float16 1e-3, about 2): what a kernel
written another way in the same precision may differ by. It covers records the baseline
computes exactly like the reference (autocast leaves layer norms in float32, so the baseline's
error there is 0) while a port with its own kernel cannot. There is no absolute term:
``torch.testing``'s atol of 1e-5 is 10% of an unscaled gradient of 1e-4, and hid a bfloat16
ReLU backward bug behind it; only the dtype's smallest normal number stands in for it, so that
zeros compare. This is the dual-golden standard of practice: the port's error against the
golden may be at most K times the trusted run's error against the same golden.

The row's element-wise tolerance (``rtol = 0``, ``atol``) is the rms allowance times the square
root of the record's size: the most one element may be off while the record's rms is within its
allowance, so the element rule never decides alone (the rms rule, ``rms_tol``, does) and an
element over it is out by itself. A baseline without an rms (not finite) keeps the worst-element
rule.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import pandas as pd

from layerdiff.compare.result import Column
from layerdiff.compare.tolerances import DEFAULTS, Tolerance, ToleranceKind
from layerdiff.trace.stats import record_rms

# Measured (docs/tolerances.md, scripts/precision_study.py: 8 kernel paths of one CPU, and
# baselines from one path judging ports from another): faithful ports pass for K >= 2.75;
# the weakest planted bug bfloat16 can resolve is lost past K = 5.3.
FACTOR = 4.0

# Unit roundoff (half the machine epsilon): which of two dtypes is the coarser.
UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8,
                 "float16": 2.0**-11}

Key = tuple[int, str, str, str]  # step, site, role, arg (the reference's names)

# How rarely two runs with the same error level may be told apart by chance, record by record.
CHANCE = 1e-3


@functools.lru_cache(maxsize=4096)
def sampling_factor(n: int, chance: float = CHANCE) -> float:
    """How far apart the rms of two samples of ``n`` elements of the same noise may fall:
    the ``1 - chance`` quantile of their ratio, ``sqrt(F(n, n))``.

    A record's rms error is an estimate of its error level from ``n`` elements; one element
    (a loss) is one draw, and the ratio of two draws of one normal distribution is Cauchy's,
    past 600 once in a thousand. With ``X/(X+Y) = sin^2 t`` for ``X, Y ~ chi^2_n`` the density
    of ``t`` is proportional to ``sin(2t)^(n-1)`` on ``[0, pi/2]``, and the ratio is ``tan t``:
    integrated on a grid; past 1000 elements, ``log`` of the ratio is normal with variance
    ``1/n``."""
    if n <= 0:
        return 1.0
    if n > 1000:  # within 1e-4 of the exact quantile there
        return math.exp(3.090232306167813 / math.sqrt(n))  # the normal's 0.999 quantile
    t = np.linspace(0.0, np.pi / 2, 50_001)[1:-1]
    log_density = (n - 1) * np.log(np.sin(2 * t))
    density = np.exp(log_density - log_density.max())
    tail = np.cumsum(density[::-1])[::-1] / density.sum()
    return float(np.tan(t[np.searchsorted(-tail, -chance)]))


@dataclass(frozen=True)
class BaselineError:
    """The baseline's error against the reference at one record."""

    max_abs: float
    rms: float | None      # None for statistics-only (summary) comparisons
    dtype: str             # the baseline record's dtype


@dataclass(frozen=True)
class Limit:
    tolerance: Tolerance   # rtol 0, atol = the allowed max |error|
    rms: float | None      # the allowed rms error, or None


class Baseline:
    """The baseline's measured error at each record, and the limits it gives the port."""

    def __init__(self, name: str, errors: dict[Key, BaselineError], *,
                 factor: float = FACTOR) -> None:
        self.name = name
        self.errors = errors
        self.factor = factor
        self.warnings: list[str] = []  # said with the diff's result

    @classmethod
    def from_rows(cls, name: str, rows: pd.DataFrame, *, factor: float = FACTOR) -> Baseline:
        """From the rows of the reference-against-baseline diff."""
        errors: dict[Key, BaselineError] = {}
        not_finite = []
        for step, site, role, arg, max_abs, rms, dtype in zip(
                *(rows[c] for c in (Column.STEP, Column.SITE, Column.ROLE, Column.ARG,
                                    Column.MAX_ABS, Column.RMS, Column.PORT_DTYPE)),
                strict=True):
            if str(dtype) not in UNIT_ROUNDOFF:
                continue  # integers and booleans stay exact: no error is "allowed" there
            if max_abs is None or not np.isfinite(max_abs):
                not_finite.append(site)  # shapes or values differ, or NaN/Inf: no limit
                continue
            rms_value = None if rms is None or not np.isfinite(rms) else float(rms)
            errors[(int(step), site, role, arg)] = BaselineError(float(max_abs), rms_value,
                                                                 str(dtype))
        baseline = cls(name, errors, factor=factor)
        if not_finite:
            sites = sorted(set(not_finite))
            baseline.warnings.append(
                f"the baseline is not finite or not comparable against the reference at "
                f"{len(sites)} site(s) ({', '.join(sites[:4])}{' ...' if len(sites) > 4 else ''})"
                ": those records keep the default tolerance")
        return baseline

    def limit(self, key: Key, ref: dict, port_dtype: str, scale: float) -> Limit | None:
        """The port's limits at one record (``ref``: the reference's index row; ``scale``:
        the loss scale for gradient roles, else 1), or None without a baseline record."""
        error = self.errors.get(key)
        if error is None:
            return None
        dtype = _looser(error.dtype, port_dtype)
        u = DEFAULTS.get(dtype, (0.0, 0.0))[0]  # the dtype's rtol: a few roundings
        tiny = float(np.finfo(np.float32 if dtype == "bfloat16" else dtype).tiny) * scale \
            if dtype in UNIT_ROUNDOFF else 0.0
        numel = max(int(ref["numel"]), 1)
        if error.rms is None:  # no rms to judge by: the worst element, as before
            largest = max(abs(float(ref["min"])), abs(float(ref["max"])))
            allowed_max = self.factor * error.max_abs + u * largest + tiny
            source = (f"baseline {self.name}: {self.factor:g} x its worst error here "
                      f"({error.max_abs:.3g}) + {dtype} rtol {u:g} x the largest element")
            return Limit(Tolerance(0.0, allowed_max, source, ToleranceKind.BASELINE), None)
        ref_rms = record_rms(ref)
        chance = sampling_factor(numel)
        allowed_rms = self.factor * chance * error.rms + u * ref_rms + tiny
        # max |d| <= rms(d) * sqrt(n): an element over this is over the record's allowance alone
        element = allowed_rms * np.sqrt(numel)
        sampled = "" if chance < 1.0005 else f" x {chance:.3g} for {numel} element(s)"
        source = (f"baseline {self.name}: rms <= {self.factor:g} x its rms error here "
                  f"({error.rms:.3g}){sampled} + {dtype} rtol {u:g} x rms(ref) = "
                  f"{allowed_rms:.3g}")
        return Limit(Tolerance(0.0, float(element), source, ToleranceKind.BASELINE),
                     float(allowed_rms))


def _looser(a: str, b: str) -> str:
    return max((a, b), key=lambda d: UNIT_ROUNDOFF.get(d, 0.0))
