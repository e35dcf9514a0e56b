"""Debugging techniques from practice as functions: where the first NaN or Inf came from
(:func:`find_nan`), whether two runs of a case agree bit for bit (:func:`check_determinism`),
whether samples of a batch mix (:func:`batch_independence`), and at which training step a port
drifts from its reference (:func:`diverge`)."""

from layerdiff.debug.batch import BatchResult, batch_independence
from layerdiff.debug.determinism import DeterminismResult, check_determinism
from layerdiff.debug.diverge import DivergeResult, diverge
from layerdiff.debug.nan import NanResult, find_nan

__all__ = ["BatchResult", "DeterminismResult", "DivergeResult", "NanResult",
           "batch_independence", "check_determinism", "diverge", "find_nan"]
