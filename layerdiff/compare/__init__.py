"""Comparing two traces: metrics, tolerances, site matching, the streaming diff and origins.

Needs numpy, pandas and h5py only, never torch: a CI job that compares stored traces, or a
port in another framework, can use it without torch installed.
"""

from layerdiff.compare.engine import diff, save_rows_csv
from layerdiff.compare.pair import read_pair
from layerdiff.compare.result import Diff, DiffVerdict, Origin
from layerdiff.compare.tolerances import Tolerance, ToleranceKind, Tolerances
from layerdiff.mapping import Mapping

__all__ = ["Diff", "DiffVerdict", "Mapping", "Origin", "Tolerance", "ToleranceKind", "Tolerances",
           "diff", "read_pair", "save_rows_csv"]
