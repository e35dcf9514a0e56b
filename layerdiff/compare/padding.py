"""Padding positions: a batch padded to one length, whose padded positions no loss reads.

At a padded position a model computes values nobody uses (a query that attends to nothing, a
label of -100), and a faithful port may compute other values there: a mask filled with -1e4
instead of the dtype's minimum, ``-inf`` instead of a large negative number. Judged like any
other position, such a port fails. Here a failing forward record is judged again with its
padding positions set apart, before origins are found:

- **The padding mask** is a root input (``<root>#0``, role input) of the token ids' shape
  (batch, length), integer or bool, every value 0 or 1, at least one 0, and not the token ids
  themselves; or the root argument the user names (``diff(padding_mask=...)``,
  ``--padding-mask``). 0 is padding.
- **Unused is shown by the numbers, never assumed.** A padded position (b, t) is unused only
  where the reference's gradient of the loss with respect to the root's output (its
  ``grad_output`` records; without those, the first gradient records of the backward that
  have positions) is exactly zero at every element of (b, t); and, where the record's own
  gradient was recorded (a forward output's ``grad_output``, an input's ``grad_input``), that
  one is zero there too. A gradient of exactly zero means the loss does not read the value,
  whatever the model does with it inside. Without a backward pass nothing shows it: padded
  positions are then not excluded, and the diff says why.
- **What is re-judged:** a failing forward record (input or output) whose out-of-tolerance
  elements all lie at unused padding positions gets the verdict ``padding-only`` (passing).
  Gradient records are not: a gradient at a padded position flows into the weight gradients
  (dW = x^T g sums over every position), so a port whose gradient differs there is wrong where
  it matters, and its first differing gradient is where to look. Weight gradients have no
  positions and are never excused.

Only failing records are read again, within the bounds of the error by position
(:mod:`layerdiff.compare.positions`): a passing diff pays nothing. Plain numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import judge
from layerdiff.compare import positions as P
from layerdiff.compare.judge import PASSING, Verdict
from layerdiff.compare.pair import PairReader, RowKey, row_key
from layerdiff.compare.result import Column
from layerdiff.errors import DiffError, LayerdiffError
from layerdiff.trace import Trace, schema

ROOT_SITE = f"{schema.ROOT_MODULE}#0"
FORWARD_ROLES = (str(schema.Role.INPUT), str(schema.Role.OUTPUT))
# what a record's own gradient is recorded as: the gradient of the loss with respect to it
OWN_GRADIENT = {str(schema.Role.OUTPUT): str(schema.Role.GRAD_OUTPUT),
                str(schema.Role.INPUT): str(schema.Role.GRAD_INPUT)}


@dataclass
class Mask:
    """One step's padding: where the root's mask is 0, and which of those the loss leaves
    unused (None: nothing shows it; ``why_not`` says why)."""

    arg: str
    padded: np.ndarray                 # (batch, length) bool
    unused: np.ndarray | None = None   # (batch, length) bool, a subset of padded
    read: list[str] = field(default_factory=list)  # the gradient records that show it
    why_not: str = ""


@dataclass
class Padding:
    """What the diff found of padding: per record read, its vectors; the records re-judged."""

    masks: dict[int, Mask] = field(default_factory=dict)
    declared: bool = False
    # per record read: (sequence axis, worst ratio per position over every element, per
    # position whether some batch row is padding there, worst ratio per position over the
    # padding elements (NaN where none), the same over the others)
    vectors: dict[RowKey, tuple[int, np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = field(
        default_factory=dict)
    excused: list[RowKey] = field(default_factory=list)
    # failing records out only at padded positions, kept failing: nothing showed them unused
    kept: list[RowKey] = field(default_factory=list)
    worst: float = 0.0                 # the worst ratio at padding among the excused (or kept)
    non_finite: int = 0                # excused records with NaN/Inf the reference has not

    def as_json(self) -> dict[str, Any] | None:
        if not self.masks:
            return None
        first = self.masks[min(self.masks)]
        why = next((mask.why_not for mask in self.masks.values() if mask.unused is None), "")
        return {
            "mask": first.arg, "declared": self.declared,
            "padded": {str(step): int(mask.padded.sum()) for step, mask in self.masks.items()},
            "positions": int(first.padded.size),
            # per position: whether some batch row is padding there (what the heatmap hatches)
            "padded_positions": {str(step): [bool(v) for v in mask.padded.any(axis=0)]
                                 for step, mask in self.masks.items()},
            "unused": {str(step): int(mask.unused.sum()) for step, mask in self.masks.items()
                       if mask.unused is not None},
            "shown_by": sorted({name for mask in self.masks.values() for name in mask.read}),
            "excluded": all(mask.unused is not None for mask in self.masks.values()),
            "why_not": why,
            "records": len(self.excused),
            "not_excluded": len(self.kept),
            "non_finite": self.non_finite,
            "worst": float(self.worst),
        }


def excuse_padding(rows: pd.DataFrame, reader: PairReader, *, declared: str | bool | None = None,
                   seq_axis: int | None = None) -> Padding:
    """Find the padding mask and re-judge the failing forward records that are out only at
    unused padding positions (their verdict becomes ``padding-only``, in ``rows``).
    ``declared``: a root argument's name, False for no padding, None to detect."""
    found = Padding(declared=isinstance(declared, str))
    ref = reader.ref
    if isinstance(declared, str):
        _root_input(ref, declared)  # a name that is not there is said even when all passes
    if declared is False or rows.empty:
        return found
    out = ~rows[Column.VERDICT].isin(PASSING).to_numpy()
    if not out.any():
        return found  # a passing diff: nothing read
    if ref.summary or reader.port.summary:
        if isinstance(declared, str):
            summary = ref.path if ref.summary else reader.port.path
            raise DiffError(f"--padding-mask {declared}: {summary} is a summary trace, whose "
                            "masks and tensors hold statistics only; capture without --summary "
                            "to set padding apart")
        return found
    candidates = rows[out & rows[Column.ROLE].isin(FORWARD_ROLES).to_numpy()
                      & rows[Column.RATIO].notna().to_numpy()]
    budget = P.MAX_TOTAL
    masks: dict[int, Mask | None] = {}  # per step, looked for once
    for position, row in candidates.iterrows():
        if len(found.vectors) >= P.MAX_RECORDS or budget <= 0:
            break
        step = int(row[Column.STEP])
        if step not in masks:
            masks[step] = find_mask(ref, step, declared if isinstance(declared, str) else None)
            if masks[step] is not None:
                found.masks[step] = masks[step]
        mask = masks[step]
        if mask is None:
            continue
        read = _record(row, reader, mask, seq_axis)
        if read is None:
            continue
        axis, ratios, own = read
        budget -= ratios.size
        # padding here: the unused positions where a gradient shows them, else the mask's
        where = mask.padded if mask.unused is None else (
            mask.unused if own is None else mask.unused & own)
        vector = _vectors(ratios, axis, where)
        key = row_key(row)
        found.vectors[key] = (axis, *vector)
        real, at_padding = vector[3], vector[2]
        padded_worst = judge.worst(at_padding[~np.isnan(at_padding)])
        if not np.all(real[~np.isnan(real)] <= 1.0) or padded_worst <= 1.0:
            continue  # out at a position that counts (or out for no element's sake)
        found.worst = max(found.worst, padded_worst)
        if mask.unused is None:
            found.kept.append(key)
            continue
        found.excused.append(key)
        counts = [row.get(column) for column in (Column.REF_NAN, Column.REF_INF,
                                                  Column.PORT_NAN, Column.PORT_INF)]
        ref_bad, port_bad = (sum(0 if v is None or v != v else int(v) for v in pair)
                             for pair in (counts[:2], counts[2:]))
        found.non_finite += port_bad > ref_bad
        rows.at[position, Column.VERDICT] = Verdict.PADDING
        elsewhere = judge.worst(real[~np.isnan(real)])
        rows.at[position, Column.NOTE] = "; ".join(filter(None, [
            rows.at[position, Column.NOTE],
            f"differs only at padding positions, which the loss does not use (the reference's "
            f"gradient is zero there): {padded_worst:.3g}x tolerance there, "
            f"{elsewhere:.3g}x elsewhere"]))
    return found


def find_mask(trace: Trace, step: int, declared: str | None = None) -> Mask | None:
    """The step's padding mask (see the module's rules) and what shows it unused; None when
    the root records none (a declared one that is not there is refused)."""
    index = trace.index
    roots = index[(index["step"] == step) & (index["site"] == ROOT_SITE)
                  & (index["role"] == str(schema.Role.INPUT))]
    tokens = P.tokens(trace, step)
    if declared is not None:
        values = _mask_values(trace, _root_input(trace, declared, step))
        if values is None:
            raise DiffError(f"--padding-mask {declared}: input {declared!r} of {ROOT_SITE} in "
                            f"{trace.path} is no (batch, length) tensor of 0s and 1s with tensor "
                            "data; name the root's attention mask, or leave the option out")
        return _with_gradients(trace, step, Mask(declared, values == 0))
    if tokens is None:
        return None
    found = []
    for _, record in roots.iterrows():
        if P._dims(record["shape"]) != (tokens.batch, tokens.length):
            continue
        values = _mask_values(trace, record)
        if values is not None and (values == 0).any():
            found.append((str(record["arg"]), values))
    ids = _token_ids_arg(roots, tokens)
    if len(found) > 1:  # the token ids may be 0s and 1s too: they are not the mask
        found = [item for item in found if item[0] != ids]
    if len(found) != 1:
        return None  # none, or several that look alike: nothing is said
    return _with_gradients(trace, step, Mask(found[0][0], found[0][1] == 0))


def _root_input(trace: Trace, name: str, step: int | None = None) -> pd.Series:
    """The index row of the root's input ``name`` (the first step's unless ``step``); a name
    the root does not record is refused."""
    index = trace.index
    roots = index[(index["site"] == ROOT_SITE) & (index["role"] == str(schema.Role.INPUT))]
    if step is not None:
        roots = roots[roots["step"] == step]
    chosen = roots[roots["arg"] == name]
    if chosen.empty:
        names = ", ".join(dict.fromkeys(map(str, roots["arg"]))) or "none"
        raise DiffError(f"--padding-mask {name}: the reference trace {trace.path} records no "
                        f"input {name!r} of {ROOT_SITE} (its inputs: {names}); name one of those")
    return chosen.iloc[0]


def _token_ids_arg(roots: pd.DataFrame, tokens: P.Tokens) -> str | None:
    """The argument positions.tokens read as the token ids (the root's first 2-D integer one)."""
    for arg, shape, dtype in zip(roots["arg"], roots["shape"], roots["dtype"], strict=True):
        if P._dims(shape) == (tokens.batch, tokens.length) and str(dtype).startswith(
                ("int", "uint")):
            return str(arg)
    return None


def _mask_values(trace: Trace, record: pd.Series) -> np.ndarray | None:
    """A record's values when it can be a padding mask: 2-D, integer or bool, only 0 and 1."""
    dtype = str(record["dtype"])
    if (record["kind"] != "tensor" or int(record["segment"]) < 0
            or len(P._dims(record["shape"])) != 2
            or not (dtype == "bool" or dtype.startswith(("int", "uint")))):
        return None
    try:
        values = np.asarray(trace.read(record))
    except (LayerdiffError, OSError, ValueError):
        return None
    return values if np.isin(values, (0, 1)).all() else None


def _with_gradients(trace: Trace, step: int, mask: Mask) -> Mask:
    """Which padded positions the reference's gradient shows unused (module docstring)."""
    batch, length = mask.padded.shape
    index = trace.index
    grads = index[(index["step"] == step) & (index["role"] == str(schema.Role.GRAD_OUTPUT))]
    if index[(index["step"] == step) & index["role"].isin(
            [str(role) for role in schema.GRAD_ROLES])].empty:
        mask.why_not = ("the reference trace has no backward pass, so nothing shows that the "
                        "loss leaves the padded positions unused; capture it with its loss "
                        "and backward to set them apart")
        return mask
    positional = grads[[P._dims(shape)[:2] == (batch, length) and int(segment) >= 0
                        for shape, segment in zip(grads["shape"], grads["segment"],
                                                  strict=True)]]
    chosen = positional[positional["site"] == ROOT_SITE]
    if chosen.empty and not positional.empty:  # the gradient nearest the loss that has positions
        first = positional.sort_values("seq").iloc[0]["site"]
        chosen = positional[positional["site"] == first]
    zero = np.ones((batch, length), dtype=bool)
    for _, record in chosen.iterrows():
        try:
            values = np.asarray(trace.read(record), dtype=np.float64)
        except (LayerdiffError, OSError, ValueError):
            chosen = chosen.iloc[:0]
            break
        zero &= (values.reshape(batch, length, -1) == 0).all(axis=2)
    if chosen.empty:
        mask.why_not = ("the reference trace records no gradient with positions (batch, "
                        f"length) = ({batch}, {length}) at the root's output, so nothing shows "
                        "that the loss leaves the padded positions unused")
        return mask
    mask.unused = mask.padded & zero
    mask.read = [f"{site} {role} {arg}" for site, role, arg in
                 zip(chosen["site"], chosen["role"], chosen["arg"], strict=True)]
    return mask


def _record(row: pd.Series, reader: PairReader, mask: Mask, seq_axis: int | None
            ) -> tuple[int, np.ndarray, np.ndarray | None] | None:
    """A failing record's element ratios with the batch on axis 0 and positions on ``axis``,
    and where its own recorded gradient is zero per (batch, position) (None: not recorded)."""
    batch, length = mask.padded.shape
    read = P.record_ratios(row, reader, P.Tokens(batch, length), seq_axis)
    if read is None:
        return None
    axis, ratios = read
    if ratios.shape[0] != batch or axis == 0 or ratios.shape[axis] != length:
        return None
    return axis, ratios, _own_gradient_zero(reader.ref, row, ratios.shape, axis)


def _own_gradient_zero(trace: Trace, row: pd.Series, shape: tuple[int, ...],
                       axis: int) -> np.ndarray | None:
    """(batch, length): where the reference's gradient of the loss with respect to this very
    record is zero; None when it was not recorded with the record's shape."""
    role = OWN_GRADIENT.get(str(row[Column.ROLE]))
    record = None if role is None else trace.find(int(row[Column.STEP]), str(row[Column.SITE]),
                                                  role, str(row[Column.ARG]))
    if record is None or P._dims(record["shape"]) != shape or int(record["segment"]) < 0:
        return None
    try:
        values = np.asarray(trace.read(record), dtype=np.float64)
    except (LayerdiffError, OSError, ValueError):
        return None
    return _per_row(values == 0, axis, np.all)


def _per_row(values: np.ndarray, axis: int, reduce) -> np.ndarray:
    """(batch, length) from a (batch, ..., length at ``axis``, ...) array, reduced over the rest."""
    moved = np.moveaxis(values, axis, 1)
    return reduce(moved.reshape(moved.shape[0], moved.shape[1], -1), axis=2)


def _vectors(ratios: np.ndarray, axis: int, padding: np.ndarray
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Per position: the worst ratio over all elements; whether some batch row is padding
    there; the worst over padding (b, t); the worst over the rest (NaN where none)."""
    per_row = _per_row(np.where(np.isnan(ratios), np.inf, ratios), axis, np.max)  # (B, T)
    every = per_row.max(axis=0)
    with np.errstate(all="ignore"):
        at_padding = np.where(padding, per_row, -np.inf).max(axis=0)
        elsewhere = np.where(~padding, per_row, -np.inf).max(axis=0)
    at_padding[~padding.any(axis=0)] = np.nan
    elsewhere[padding.all(axis=0)] = np.nan
    return every, padding.any(axis=0), at_padding, elsewhere


def padding_vectors(found: Padding) -> dict[RowKey, tuple[int, np.ndarray]]:
    """The records read here as the error by position has them (axis, worst per position)."""
    return {key: (axis, every) for key, (axis, every, *_) in found.vectors.items()}


def position_marks(found: Padding, keys) -> dict[RowKey, tuple[np.ndarray, np.ndarray]]:
    """For the records among ``keys`` read here: per position, whether some batch row is
    padding there, and the worst ratio over the padding elements (what the report marks)."""
    return {key: (flags, at_padding) for key, (_, _, flags, at_padding, _)
            in found.vectors.items() if key in keys}
