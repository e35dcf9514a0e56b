"""Debugging techniques from practice as functions: where the first NaN or Inf came from
(:func:`find_nan`), whether two runs of a case agree bit for bit (:func:`check_determinism`)."""

from layerdiff.debug.determinism import DeterminismResult, check_determinism
from layerdiff.debug.nan import NanResult, find_nan

__all__ = ["DeterminismResult", "NanResult", "check_determinism", "find_nan"]
