"""Rows for gradients the port never sent: a reference gradient whose port record is absent
although the port recorded the value it belongs to (the input it took, the weight it holds).

Autograd leaves such a gradient None: a detached input (``x.detach()``, ``torch.no_grad()``
around a layer, a value that went through numpy), a parameter that never trains. What the port
sent there is zero, so each is compared with zeros from the reference's index statistics alone
(the worst element of ``|0 - r| / (atol + rtol |r|)`` is at the largest ``|r|``; the error's
rms is the reference's). A reference gradient that is zero itself is within: nothing was lost.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import judge
from layerdiff.compare import result as R
from layerdiff.compare.records import RecordPair
from layerdiff.compare.result import Column
from layerdiff.trace.schema import Role
from layerdiff.trace.stats import record_rms

NOTE = ("the port sent no gradient here ({what}): compared with zeros; look for a detach, "
        "torch.no_grad(), an in-place op on a leaf, or a value that left autograd")


def absent_rows(comparer: Any, rows: pd.DataFrame,
                absent: list[tuple[int, int]]) -> pd.DataFrame:
    """``rows`` with a row for each (reference gradient, port input or weight) in ``absent``,
    sorted as the engine sorts them."""
    if not absent:
        return rows
    ref_index = comparer.ref.index
    port_index = comparer.port.index
    new = []
    for ref_pos, port_pos in absent:
        r, p = ref_index.iloc[ref_pos].to_dict(), port_index.iloc[port_pos].to_dict()
        row = comparer._base_row(RecordPair(ref_pos, port_pos, "absent", 1.0), r, p)
        new.append(_against_zeros(row, r))
    frame = pd.DataFrame(new, columns=R.ROW_COLUMNS)
    return pd.concat([rows, frame], ignore_index=True).sort_values(
        [Column.STEP, Column.SEQ], kind="stable", ignore_index=True)


def _against_zeros(row: dict[str, Any], r: dict[str, Any]) -> dict[str, Any]:
    largest = max(abs(float(r["min"])), abs(float(r["max"])))
    rms = record_rms(r)
    limit = row[Column.ATOL] + row[Column.RTOL] * largest
    ratio = largest / limit if limit > 0 else (np.inf if largest > 0 else 0.0)
    rms_tol = row[Column.RMS_TOL]
    if rms_tol is not None:   # a baseline's second rule
        ratio = judge.worst([ratio, rms / rms_tol if rms_tol > 0 else np.inf])
    what = "its input gradient is None" if r["role"] == Role.GRAD_INPUT else \
        "its parameter's gradient is None"
    row.update(port_shape=row[Column.SHAPE], port_dtype=r["dtype"], max_abs=largest,
               max_rel=1.0 if largest > 0 else 0.0, mean_abs=np.nan, rms=rms,
               cosine=np.nan, max_ulp=np.nan, frac_out=np.nan, worst_index="", ratio=ratio,
               ref_nan=int(r["nan"]), ref_inf=int(r["inf"]), port_nan=0, port_inf=0,
               note=NOTE.format(what=what), batch_ratio=None)
    row[Column.VERDICT] = judge.verdict(ratio, ref_nan=row[Column.REF_NAN], port_nan=0, port_inf=0)
    return row
