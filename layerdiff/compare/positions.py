"""The error along the sequence axis: per position, the worst ratio of a failing record.

Users of sequence models reason in positions (a mask off by one, a rotary offset, one
flipped token), not in batch elements. The sequence axis of a record is found from the case's
token ids (the root's integer input of shape (batch, length)): a record whose axes 0 and 1
are (batch, length) at the same place has its positions on axis 1. Where no such input
exists (a model fed embeddings), the caller declares the axis (``diff(seq_axis=...)``,
``--seq-axis``); a declared axis applies to every activation record that has it.

Only records out of tolerance are read again, after the diff: a passing diff pays nothing.
Plain numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pandas as pd

from layerdiff.compare import judge
from layerdiff.compare import result as R
from layerdiff.compare.judge import PASSING
from layerdiff.compare.pair import PairReader, RowKey, row_key
from layerdiff.compare.result import Column
from layerdiff.errors import LayerdiffError
from layerdiff.trace import Trace, schema

# Bounds on the extra reading: the first failing records in execution order (the heatmap's
# rows) and records up to this many elements (2^22 float64 values: 32 MiB per copy).
MAX_RECORDS = 256
MAX_ELEMENTS = 1 << 22
MAX_TOTAL = 1 << 27    # elements read again in all: a bound of ~2 GiB of float64 passes

# Growth with position: the error over the last quarter of the wrong positions at least this
# many times the first wrong position's, and ranked with the position (Spearman) at least
# this well. A rotation by position p x frequency off by dw errs by 2 sin(p dw / 2): about
# linear in p; a mask's boundary is a step, not a ramp.
GROWTH = 3.0
RANK_CORRELATION = 0.8
MIN_GROWING = 4        # wrong positions: fewer and no trend can be told


@dataclass(frozen=True)
class Tokens:
    """The case's token ids as the reference recorded them: (batch, length)."""

    batch: int
    length: int


def tokens(trace: Trace, step: int = 0) -> Tokens | None:
    """The root's first integer input of two axes, as (batch, length); None without one."""
    index = trace.index
    rows = index[(index["step"] == step) & (index["role"] == schema.Role.INPUT)]
    sites = rows["site"].astype(str)
    rows = rows[sites.str.startswith(schema.ROOT_MODULE + "#") & ~sites.str.contains("/")]
    for shape, dtype in zip(rows["shape"], rows["dtype"], strict=True):
        dims = _dims(shape)
        if len(dims) == 2 and str(dtype).startswith(("int", "uint")) and dims[1] > 1:
            return Tokens(*dims)
    return None


def sequence_axis(shape: tuple[int, ...], found: Tokens | None,
                  declared: int | None = None) -> int | None:
    """The axis of a record of ``shape`` that runs over positions, or None.

    Declared: that axis, where the record has it (and it is not the record's only axis). Found
    from the token ids: axis 1 when axes 0 and 1 are (batch, length), as the ids are. Else,
    behind the batch axis, the one axis of the length's size that is neither axis 1 nor the
    last (heads before positions: (B, H, T, D) per-head states, (B, H, T, T) attention
    probabilities, whose query positions come first); where two such axes could be it, or the
    length's size is the last axis only (a hidden size equal to the length), none is guessed."""
    if declared is not None:
        axis = declared if declared >= 0 else len(shape) + declared
        return axis if 0 < axis < len(shape) or (axis == 0 and len(shape) > 1) else None
    if found is None or len(shape) < 2 or shape[0] != found.batch:
        return None
    if shape[1] == found.length:
        return 1
    inner = [axis for axis in range(2, len(shape) - 1) if shape[axis] == found.length]
    return inner[0] if len(inner) == 1 else None


def record_ratios(row: pd.Series, reader: PairReader, found: Tokens | None,
                  declared: int | None = None, max_elements: int = MAX_ELEMENTS
                  ) -> tuple[int, np.ndarray] | None:
    """A failing record read again: (its sequence axis, the verdict's ratio per element,
    ``|port - ref| / (atol + rtol |ref|)`` with its NaN and Inf rules); None when it has no
    sequence axis, is too large to read again, was not compared element by element, or cannot
    be read back (a mapping's code that fails here)."""
    shape = _dims(row[Column.SHAPE])
    numel = int(np.prod(shape)) if shape else 0
    port_shape = _dims(row.get(Column.PORT_SHAPE))
    if not numel or numel > max_elements or (port_shape and int(np.prod(port_shape)) != numel):
        return None
    axis = sequence_axis(shape, found, declared)
    if axis is None:
        return None
    try:
        ref, port = reader.read(row, compared=True)
    except (LayerdiffError, OSError, ValueError, KeyError, IndexError, RuntimeError):
        return None
    if ref.shape != shape or port.shape != shape:
        return None
    rtol, atol = _tolerance(row)
    with np.errstate(all="ignore"):
        return axis, judge.element_ratios(ref, port, rtol, atol)


def worst_per_position(ratios: np.ndarray, axis: int) -> np.ndarray:
    """Per position of ``axis``: the worst of ``ratios`` over the other axes."""
    return np.moveaxis(ratios, axis, 0).reshape(ratios.shape[axis], -1).max(axis=1)


def by_position(rows: pd.DataFrame, reader: PairReader, *, declared: int | None = None,
                max_records: int = MAX_RECORDS, max_elements: int = MAX_ELEMENTS,
                known: dict[RowKey, tuple[int, np.ndarray]] | None = None,
                ) -> dict[RowKey, tuple[int, np.ndarray]]:
    """For each failing activation record with a sequence axis: (axis, ratio per position).
    Records that cannot be read back (summary traces, shapes that differ) are left out:
    the per-position view is a help, never a reason for the diff to fail. ``known``: vectors
    already read (the padding check's), kept as they are and not read again."""
    known = dict(known or {})
    if rows.empty:
        return known
    out = ~rows[Column.VERDICT].isin(PASSING).to_numpy()
    if not out.any() or reader.ref.summary or reader.port.summary:
        return known  # a passing diff: one pass over the verdicts, nothing read
    # a record judged without a ratio (a router's top-k indices, compared as a decision)
    # has no error per position either
    failing = rows[out & ~rows[Column.ROLE].isin([str(role) for role in schema.PARAM_ROLES])
                   .to_numpy() & rows[Column.RATIO].notna().to_numpy()]
    found: dict[int, Tokens | None] = {}
    vectors: dict[RowKey, tuple[int, np.ndarray]] = {}
    budget = MAX_TOTAL
    for _, row in failing.iterrows():
        if len(vectors) >= max_records or budget <= 0:
            break
        if row_key(row) in known:
            vectors[row_key(row)] = known[row_key(row)]
            continue
        step = int(row[Column.STEP])
        if step not in found:
            found[step] = tokens(reader.ref, step)
        read = record_ratios(row, reader, found[step], declared, max_elements)
        if read is None:
            continue
        axis, ratios = read
        budget -= ratios.size
        vectors[row_key(row)] = (axis, worst_per_position(ratios, axis))
    # records re-judged as differing only at padding, after the failing ones (execution order
    # within each group)
    vectors.update({key: value for key, value in known.items() if key not in vectors})
    return vectors


def attach(origins: list[R.Origin], vectors: dict[RowKey, tuple[int, np.ndarray]]) -> None:
    """Set each origin's ``positions`` and ``position_axis`` from its record's vector."""
    for origin in origins:
        found = vectors.get((origin.step, origin.site, str(origin.role), origin.arg))
        if found is not None:
            origin.position_axis = found[0]
            origin.positions = [float(v) for v in found[1]]


@dataclass(frozen=True)
class Pattern:
    """Where along the positions the error is, in the terms people debug with."""

    out: list[int]             # positions out of tolerance, in order
    within: list[int]
    first: int | None          # the first wrong position
    worst: int                 # the worst position and its ratio
    worst_ratio: float
    run_to_end: bool           # the wrong positions are one run that reaches the last
    growing: bool              # ... and their error grows with the position


def pattern(ratios: np.ndarray | list[float]) -> Pattern:
    """The shape of a per-position error: first wrong position, one run or scattered, growth."""
    values = np.asarray(ratios, dtype=np.float64)
    bad = ~(values <= 1.0)  # NaN counts as out, as the verdict has it
    out = np.flatnonzero(bad).tolist()
    within = np.flatnonzero(~bad).tolist()
    shown = np.where(np.isnan(values), np.inf, values)
    worst = int(np.argmax(shown)) if values.size else 0
    run = bool(out) and out[-1] - out[0] + 1 == len(out) and out[-1] == values.size - 1
    return Pattern(out, within, out[0] if out else None, worst,
                   float(values[worst]) if values.size else 0.0, run,
                   run and _grows(values[out[0]:]))


def _grows(values: np.ndarray) -> bool:
    if values.size < MIN_GROWING or not np.all(np.isfinite(values)):
        return False
    tail = float(np.mean(values[-max(1, values.size // 4):]))
    if tail < GROWTH * float(values[0]):
        return False
    ranks = np.argsort(np.argsort(values))
    with np.errstate(all="ignore"):
        correlation = float(np.corrcoef(ranks, np.arange(values.size))[0, 1])
    return np.isfinite(correlation) and correlation >= RANK_CORRELATION


def _tolerance(row: pd.Series) -> tuple[float, float]:
    values = []
    for column in (Column.RTOL, Column.ATOL):
        value = row.get(column)
        values.append(float(value) if value is not None and np.isfinite(float(value)) else 0.0)
    return values[0], values[1]


def _dims(shape: object) -> tuple[int, ...]:
    """'6,10,32' (the index's and the rows' text), or a tuple, as a tuple of ints."""
    if shape is None or (isinstance(shape, float) and np.isnan(shape)):
        return ()
    if isinstance(shape, str):
        return tuple(int(part) for part in shape.strip("()").split(",") if part.strip())
    return tuple(int(part) for part in shape)  # type: ignore[union-attr]
