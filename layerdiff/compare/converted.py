"""Rows for port parameters made through a conversion function (``transform =
"pkg.module:function"`` in a ``[[param]]`` chain), which no slice of the port's tensor undoes.

- ``weight``: one row per port tensor, ``f(reference tensors)`` against the port's tensor, in
  the port's layout (at the first reference tensor's site and argument).
- ``weight_grad``: one row per reference tensor. The port's gradient is pulled back through
  the chain at the reference's weights (chain rule: ``p = f(w)`` gives ``dL/dw =
  J_f(w)^T dL/dp``, a vector-Jacobian product) and compared with the reference's gradient in
  the reference's layout, so a concat-then-convert chain says which part is off.

Rows carry the engine's columns, tolerances (per-dtype defaults, rules, loss scale, a
baseline), metrics and verdicts. This module is imported only when a mapping names a function,
and torch only inside its functions: a diff of a mapping without functions stays torch-free.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import result as R
from layerdiff.compare.judge import Verdict
from layerdiff.compare.records import ConvertedParam, RecordPair
from layerdiff.compare.result import Column
from layerdiff.compare.row_metrics import finish_row, new_metrics
from layerdiff.compare.tolerances import Tolerance
from layerdiff.trace import Trace, schema
from layerdiff.trace.schema import GRAD_ROLES, Role


def converted_rows(comparer: Any, rows: pd.DataFrame,
                   converted: list[ConvertedParam]) -> tuple[pd.DataFrame, list[str]]:
    """``rows`` with a row for each converted weight and (per reference tensor) weight
    gradient added, sorted as the engine sorts them; and warnings (a conversion whose source
    changed since the port trace was captured)."""
    ref, port = comparer.ref, comparer.port
    ref_by_key = _positions(ref)
    new: list[dict[str, Any]] = []
    for item in converted:
        p = port.index.iloc[item.port].to_dict()
        refs = [ref.index.iloc[pos].to_dict() for pos in item.refs]
        if not _has_data(refs, p):
            new.append(_statistics_only(comparer, item, refs[0], p))
            continue
        how = _how(item, "f(reference) compared with the port's tensor" if p["role"] == Role.WEIGHT
                   else "the port's gradient pulled back through the chain")
        for pos, values, back in converted_values(ref, port, item, ref_by_key):
            new.append(_row(comparer, RecordPair(pos, item.port, "converted", 1.0),
                            ref.index.iloc[pos].to_dict(), p, values, back, how))
    frame = pd.DataFrame(new, columns=R.ROW_COLUMNS)
    merged = frame if rows.empty else pd.concat([rows, frame], ignore_index=True)
    merged = merged.sort_values([Column.STEP, Column.SEQ], kind="stable", ignore_index=True)
    return merged, source_warnings(port, converted)


def converted_values(ref: Trace, port: Trace, item: ConvertedParam,
                     ref_by_key: dict | None = None) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """(reference position, reference side, port side) of each row a converted parameter
    gives, as compared (before any loss scale): a weight's one row, ``f(reference tensors)``
    against the port's tensor at the first reference tensor; a weight gradient's row per
    reference tensor, against the port's gradient pulled back through the chain."""
    from layerdiff.weights import combine, pull_back  # torch: a mapping names a function

    p = port.index.iloc[item.port]
    name = schema.param_name(p["site"], p["arg"])
    ref_values = [ref.read(pos) for pos in item.refs]
    if p["role"] == Role.WEIGHT:
        expected = combine(item.source, ref_values, port=name)
        return [(item.refs[0], expected, port.read(item.port))]
    refs = [ref.index.iloc[pos].to_dict() for pos in item.refs]
    at = _weights_at(ref, _positions(ref) if ref_by_key is None else ref_by_key, refs)
    pulled = pull_back(item.source, at, port.read(item.port), like=ref_values, port=name)
    return list(zip(item.refs, ref_values, pulled, strict=True))


def _positions(ref: Trace) -> dict[tuple, int]:
    return {(step, site, role, arg): pos for pos, (step, site, role, arg) in enumerate(
        zip(ref.index["step"], ref.index["site"], ref.index["role"], ref.index["arg"],
            strict=True))}


def _how(item: ConvertedParam, what: str) -> str:
    return f"{what} ({item.source.transform})"


def _has_data(refs: list[dict], p: dict) -> bool:
    return all(r["kind"] == "tensor" and r["segment"] >= 0 for r in refs) and \
        p["kind"] == "tensor" and p["segment"] >= 0


def _weights_at(ref: Trace, ref_by_key: dict, grads: list[dict]) -> list[np.ndarray] | None:
    """The reference's weights at the gradients' step (the point the chain is pulled back
    at), or None when the trace lacks one (a linear chain needs none)."""
    positions = [ref_by_key.get((g["step"], g["site"], Role.WEIGHT, g["arg"])) for g in grads]
    if any(pos is None for pos in positions):
        return None
    rows = [ref.index.iloc[pos] for pos in positions]
    if any(row["segment"] < 0 for row in rows):
        return None
    return [ref.read(row) for row in rows]


def _row(comparer: Any, pair: RecordPair, r: dict, p: dict, ref_values: np.ndarray,
         port_values: np.ndarray, how: str) -> dict[str, Any]:
    """One row as the engine makes it (tolerance, loss scale, baseline, notes), of two whole
    tensors in the same layout."""
    shape = tuple(np.shape(ref_values))
    seen_r = dict(r, shape=schema.format_shape(shape), digest="")
    seen_p = dict(p, shape=schema.format_shape(tuple(np.shape(port_values))), digest="")
    row = comparer._base_row(pair, seen_r, seen_p)
    row[Column.NOTE] = "; ".join(filter(None, [how, row[Column.NOTE]]))
    if row[Column.VERDICT]:  # shapes differ
        return row
    tolerance = Tolerance(row[Column.RTOL], row[Column.ATOL], row[Column.TOL_SOURCE])
    metrics = new_metrics(tolerance, seen_r, seen_p, shape, row[Column.ROLE])
    metrics.scratch = comparer.scratch
    port_flat = np.ascontiguousarray(port_values).ravel()
    if row[Column.ROLE] in GRAD_ROLES and comparer.grad_factor != 1.0:
        metrics.ulp_scale = None  # rescaled values: ULPs of neither side
        port_flat = port_flat.astype(np.float64) * comparer.grad_factor
    metrics.update(np.ascontiguousarray(ref_values).ravel(), port_flat, 0)
    finish_row(row, metrics, shape)
    return row


def _statistics_only(comparer: Any, item: ConvertedParam, r: dict, p: dict) -> dict[str, Any]:
    """A side without tensor data (a summary trace): a conversion cannot be undone on
    statistics, so the record is listed, not compared."""
    seen_p = dict(p, shape=r["shape"], digest="")
    row = comparer._base_row(RecordPair(item.refs[0], item.port, "converted", 1.0), r, seen_p)
    for column in (Column.MAX_ABS, Column.REF_NAN, Column.REF_INF, Column.PORT_NAN,
                   Column.PORT_INF):
        row[column] = None
    row.update(verdict=Verdict.WITHIN, ratio=np.nan, note=(
        f"statistics only: a parameter made through a conversion ({item.source.transform}) "
        "cannot be judged from statistics; not compared"))
    return row


def source_warnings(port: Trace, converted: list[ConvertedParam]) -> list[str]:
    """A warning for each conversion whose module's source differs from the digest the port
    trace recorded when its weights were loaded through it."""
    weights = port.meta.get("weights")
    recorded = {entry.get("function"): entry.get("source_sha256")
                for entry in (weights.get("conversions") or [] if isinstance(weights, dict)
                              else []) if isinstance(entry, dict)}
    said, seen = [], set()
    for item in converted:
        for ref in item.source.code_refs():
            if ref.spec in seen or not recorded.get(ref.spec):
                continue
            seen.add(ref.spec)
            now = ref.source_digest()
            if now != recorded[ref.spec]:
                said.append(f"conversion {ref.spec}: its module's source is not the one "
                            f"{port.path.name} was captured with (sha256 "
                            f"{recorded[ref.spec][:12]} then, {now[:12] or 'none'} now): the "
                            "port's weights were made by other code than the diff compares "
                            "through")
    return said
