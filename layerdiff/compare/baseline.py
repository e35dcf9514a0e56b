"""Baselines: judge a port by the error its precision actually makes, record by record.

A *baseline* is the reference run the way the port runs (its dtype, autocast or device). Its
error against the reference at a record is what that precision does there, accumulated through
every layer before it. A faithful port in that precision makes an error of the same size but
not the same bits (other kernels, other summation orders), so the port may have at most
``FACTOR`` times the baseline's error, plus a floor of one rounding in the compared dtype:

    allowed max |port - ref| = FACTOR * max |base - ref|  + u * max |ref| + atol
    allowed rms (port - ref) = FACTOR * rms (base - ref)  + u * rms(ref)  + atol

``u`` is the dtype's unit roundoff (half its machine epsilon) and ``atol`` its
``torch.testing`` absolute tolerance (times the loss scale for gradients). The floor covers
records where the baseline happens to round exactly (its error 0) while a port with other
kernels cannot. This is the dual-golden standard of practice: the port's error against the
golden may be at most K times the trusted run's error against the same golden.

The max rule is an element-wise test with one absolute tolerance for the whole tensor
(``rtol = 0``), so the ratio, the worst element, the fraction out and the per-batch-element
errors of a row keep their meaning; the rms rule is checked on top of it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from layerdiff.compare.tolerances import DEFAULTS, Tolerance

# Measured (docs/tolerances.md): faithful ports with other kernels reach 2.x times the
# baseline's error at single records; planted bugs are 10x and more.
FACTOR = 4.0

UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "bfloat16": 2.0**-8,
                 "float16": 2.0**-11}

Key = tuple[int, str, str, str]  # step, site, role, arg (the reference's names)


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
        for step, site, role, arg, max_abs, rms, dtype in zip(
                rows["step"], rows["site"], rows["role"], rows["arg"], rows["max_abs"],
                rows["rms"], rows["port_dtype"], strict=True):
            if max_abs is None or not np.isfinite(max_abs):
                continue  # not comparable (shapes, values) or not finite: no limit from it
            rms_value = None if rms is None or not np.isfinite(rms) else float(rms)
            errors[(int(step), site, role, arg)] = BaselineError(float(max_abs), rms_value,
                                                                 str(dtype))
        return cls(name, errors, factor=factor)

    def limit(self, key: Key, ref: dict, port_dtype: str, scale: float) -> Limit | None:
        """The port's limits at one record (``ref``: the reference's index row; ``scale``:
        the loss scale for gradient roles, else 1), or None without a baseline record."""
        error = self.errors.get(key)
        if error is None:
            return None
        dtype = _looser(error.dtype, port_dtype)
        u = UNIT_ROUNDOFF.get(dtype, 0.0)
        atol = DEFAULTS.get(dtype, (0.0, 0.0))[1] * scale
        largest = max(abs(float(ref["min"])), abs(float(ref["max"])))
        ref_rms = float(ref["l2"]) / np.sqrt(max(int(ref["numel"]), 1))
        allowed_max = self.factor * error.max_abs + u * largest + atol
        allowed_rms = (None if error.rms is None
                       else self.factor * error.rms + u * ref_rms + atol)
        rms_text = "" if error.rms is None else f", rms {error.rms:.3g}"
        source = (f"baseline {self.name}: {self.factor:g} x its error here (max "
                  f"{error.max_abs:.3g}{rms_text}) + one {dtype} rounding of the largest "
                  f"element + atol")
        if allowed_rms is not None:
            source += f"; rms <= {allowed_rms:.3g}"
        return Limit(Tolerance(0.0, allowed_max, source, "baseline"), allowed_rms)


def _looser(a: str, b: str) -> str:
    return max((a, b), key=lambda d: UNIT_ROUNDOFF.get(d, 0.0))
