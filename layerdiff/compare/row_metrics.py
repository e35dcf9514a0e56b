"""One diff row's metrics: made for a pair of records, and folded into the row's verdict.

Shared by the engine's streamed rows and the rows added beside them (parameters compared
through a conversion, inputs a call adapter makes), below all of them, so that none imports
another's internals.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from layerdiff.compare import judge
from layerdiff.compare.metrics import PairMetrics
from layerdiff.compare.result import Column
from layerdiff.compare.tolerances import Tolerance
from layerdiff.trace import schema
from layerdiff.trace.schema import PARAM_ROLES


def new_metrics(tolerance: Tolerance, r: Any, p: Any, shape: tuple[int, ...],
                role: str) -> PairMetrics:
    """Metrics of the pair of index records ``r`` and ``p`` compared at ``shape``: per batch
    element when the leading axis is a batch (not a parameter's), in ULPs when both sides
    have the same floating dtype."""
    numel = int(np.prod(shape))
    batch = shape[0] if len(shape) >= 2 and role not in PARAM_ROLES else 0
    same_float = r["dtype"] == p["dtype"] and schema.numpy_dtype(r["dtype"]).kind == "f"
    ulp_scale = (2.0**16 if r["dtype"] == "bfloat16" else 1.0) if same_float else None
    return PairMetrics(tolerance.rtol, tolerance.atol, numel, batch, ulp_scale)


def rms_over(value: float, limit: float) -> float:
    """How far an rms error is over its limit (a baseline's second rule)."""
    if value == 0:
        return 0.0
    return value / limit if limit > 0 else np.inf


def finish_row(row: dict[str, Any], metrics: PairMetrics, shape: tuple[int, ...]) -> None:
    """The row's metrics, ratio (a baseline's rms rule folded in) and verdict."""
    row.update(metrics.result(shape))
    if row[Column.RMS_TOL] is not None:  # a baseline's second rule
        row[Column.RATIO] = judge.worst([row[Column.RATIO],
                                         rms_over(row[Column.RMS], row[Column.RMS_TOL])])
    row[Column.VERDICT] = judge.verdict(row[Column.RATIO], ref_nan=row[Column.REF_NAN],
                                        port_nan=row[Column.PORT_NAN],
                                        port_inf=row[Column.PORT_INF],
                                        finite_ratio=row["finite_ratio"])
