"""The two tensors a diff row compared, read back as the diff compared them.

One reader for everything that looks at a row's tensors after the diff (the HTML report's
plots, the likely-cause hints, the rank of a sharded error, the trace browser): the reference's
record cut to its slice; the port's cut to its slice, then transposed, as the mapping says
(:class:`layerdiff.compare.records.RecordPair`, which the diff keeps per row in
``Diff.pairs``), or a parameter made through a conversion function recomputed through it; a
gradient of the port brought to the reference's loss scale; every byte checked against its
index digest (the trace reader does that). A row the diff has no pairing
for (a diff built elsewhere, a call adapter's product) is read by the names in the row.

Each trace is opened once per reader, when first needed, so a report opens each at most once.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import result as R
from layerdiff.compare.reading import as_compared
from layerdiff.compare.records import ConvertedParam, RecordPair
from layerdiff.compare.result import Column
from layerdiff.errors import TraceError
from layerdiff.trace import Trace, open_trace, schema

RowKey = tuple[int, str, str, str]  # step, reference site, role, arg: one diff row
# a row of outputs compared through an output conversion (compare/outconv.py): read back
# through it
OUTPUT_CONVERTED = "output-converted"


@dataclass(frozen=True)
class ConvertedPair(RecordPair):
    """A row of a parameter the mapping makes through a conversion function: read back
    through it (:func:`layerdiff.compare.converted.converted_values`, torch)."""

    item: ConvertedParam | None = None


def row_key(row: Mapping[str, Any] | pd.Series) -> RowKey:
    """The key of a diff row (or of an origin's fields, see :func:`origin_row`)."""
    return int(row[Column.STEP]), str(row[Column.SITE]), str(row[Column.ROLE]), str(row[Column.ARG])


def origin_row(origin: R.Origin) -> dict[str, Any]:
    """An origin's names as the columns of its diff row."""
    return {Column.STEP: origin.step, Column.PASS: origin.pass_, Column.SITE: origin.site,
            Column.ROLE: origin.role, Column.ARG: origin.arg,
            Column.PORT_SITE: origin.port_site or origin.site, Column.PORT_ARG: origin.port_arg}


class PairReader:
    """Reads diff rows' tensor pairs from two traces, opened once (lazily, when given paths).

    ``pairs``: the diff's pairing per row (``Diff.pairs``); rows without one are found by the
    names the row holds (reference site and arg, port site and arg).
    """

    def __init__(self, reference: Trace | str | os.PathLike, port: Trace | str | os.PathLike,
                 pairs: Mapping[RowKey, RecordPair] | None = None) -> None:
        self._given = [reference, port]
        self._opened: list[Trace] = []
        self.pairs = pairs or {}
        self._by_name: list[dict | None] = [None, None]

    @classmethod
    def of(cls, diff: R.Diff) -> PairReader:
        """A reader of ``diff``'s rows, from the traces it names (close it after use)."""
        return cls(diff.reference, diff.port, diff.pairs)

    @property
    def ref(self) -> Trace:
        return self._trace(0)

    @property
    def port(self) -> Trace:
        return self._trace(1)

    def _trace(self, side: int) -> Trace:
        given = self._given[side]
        if not isinstance(given, Trace):
            given = open_trace(Path(given))  # raises with one sentence; tried again next time
            self._opened.append(given)
            self._given[side] = given
        return given

    @property
    def grad_factor(self) -> float:
        """What the port's gradients are multiplied by to be at the reference's loss scale."""
        return self.ref.loss_scale / self.port.loss_scale

    def close(self) -> None:
        for trace in self._opened:
            trace.close()
        self._opened.clear()

    def __enter__(self) -> PairReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def plan(self, row: Mapping[str, Any] | pd.Series) -> RecordPair | None:
        """How the diff paired the row's records, when it says."""
        return self.pairs.get(row_key(row))

    def records(self, row: Mapping[str, Any] | pd.Series
                ) -> tuple[pd.Series | None, pd.Series | None]:
        """The index rows of the row's reference and port records (None: no such record on
        that side; the port's None too for a gradient the port never sent). A record may
        hold statistics only (``segment`` < 0): :meth:`read` refuses those."""
        plan = self.plan(row)
        if plan is not None:
            ref = self.ref.index.iloc[plan.ref]
            port = None if plan.match == "absent" else self.port.index.iloc[plan.port]
            return ref, port
        step, site, role, arg = row_key(row)
        port_site = _text(row.get(Column.PORT_SITE)) or site
        port_arg = _text(row.get(Column.PORT_ARG)) or arg
        return (self._named(0, step, site, role, arg),
                self._named(1, step, port_site, role, port_arg))

    def read(self, row: Mapping[str, Any] | pd.Series, *, stored: bool = False,
             compared: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """The row's (reference, port) tensors as float64, as the diff compared them: sliced,
        the port's transposed as the mapping says, the port's gradients at the reference's
        loss scale. ``stored`` keeps the stored dtypes (bfloat16 widened to float32; a
        rescaled gradient is float64), for readers that tell masks from numbers. ``compared``
        (the values are compared element by element, as the hints do): see
        :meth:`Trace.read`. Raises TraceError (one sentence) when a side holds no data for
        it."""
        for trace in (self.ref, self.port):
            if trace.summary:
                raise TraceError(f"{trace.path} is a summary trace (statistics only, no tensor "
                                 "data); capture without --summary to see which elements "
                                 "differ")
        ref_row, port_row = (_with_data(record) for record in self.records(row))
        plan = self.plan(row)
        step, site, role, arg = row_key(row)
        if isinstance(plan, ConvertedPair) and ref_row is not None and port_row is not None:
            return self._converted(plan, role, stored)
        if (plan is not None and plan.match == OUTPUT_CONVERTED and ref_row is not None
                and port_row is not None):
            from layerdiff.compare.outconv import read_back  # torch, as the diff did

            ref, port = read_back(self.ref, self.port, plan, role, arg)
            if not stored:
                ref, port = ref.astype(np.float64), port.astype(np.float64)
            if port.shape != ref.shape and port.size == ref.size:
                port = port.reshape(ref.shape)
            if role in schema.GRAD_ROLES and self.grad_factor != 1.0:
                port = port.astype(np.float64) * self.grad_factor
            return ref, port
        if ref_row is None:
            raise TraceError(f"{self.ref.path} has no tensor data for {site} {role} {arg} at "
                             f"step {step}")
        ref = as_compared(self.ref.read(ref_row, compared=compared), plan and plan.ref_slice,
                          False)
        ref = ref if stored else np.asarray(ref, dtype=np.float64)
        if plan is not None and plan.match == "absent":
            return ref, np.zeros_like(ref)  # the port sent no gradient: the diff's zeros
        if port_row is None:
            where = (f"{_text(row.get(Column.PORT_SITE)) or site} {role} "
                     f"{_text(row.get(Column.PORT_ARG))}")
            raise TraceError(f"{self.port.path} has no tensor data for {where.strip()} at "
                             f"step {step}")
        port = as_compared(self.port.read(port_row, compared=compared), plan and plan.port_slice,
                           plan.transpose_port if plan is not None else False)
        port = port if stored else np.asarray(port, dtype=np.float64)
        if port.shape != ref.shape and port.size == ref.size:
            port = port.reshape(ref.shape)  # a reshape apart: compared as flat views
        if role in schema.GRAD_ROLES and self.grad_factor != 1.0:
            port = port.astype(np.float64) * self.grad_factor  # as the diff compared them
        return ref, port

    def _converted(self, plan: ConvertedPair, role: str,
                   stored: bool) -> tuple[np.ndarray, np.ndarray]:
        from layerdiff.compare.converted import converted_values  # torch, as the diff did

        for position, ref, port in converted_values(self.ref, self.port, plan.item):
            if position == plan.ref:
                ref, port = np.asarray(ref), np.asarray(port)
                if not stored:
                    ref, port = ref.astype(np.float64), port.astype(np.float64)
                if role in schema.GRAD_ROLES and self.grad_factor != 1.0:
                    port = port.astype(np.float64) * self.grad_factor
                return ref, port
        raise TraceError(f"{self.port.path}: the conversion {plan.item.source.transform} "
                         "gives no tensor for this row")

    def _named(self, side: int, step: int, site: str, role: str, arg: str) -> pd.Series | None:
        """A tensor record by names, through a table built once per trace (a pandas filter
        per record costs milliseconds, seconds over a page of rows)."""
        trace = self._trace(side)
        if self._by_name[side] is None:
            index = trace.index
            tensors = index["kind"].to_numpy() == "tensor"
            table: dict[tuple, int] = {}
            for pos, key in enumerate(zip(index["step"], index["site"], index["role"],
                                          index["arg"], strict=True)):
                if tensors[pos]:
                    table.setdefault((int(key[0]), *key[1:]), pos)
            self._by_name[side] = table
        pos = self._by_name[side].get((step, site, role, arg))
        return None if pos is None else trace.index.iloc[pos]


def read_pair(diff: R.Diff, row: Mapping[str, Any] | pd.Series) -> tuple[np.ndarray, np.ndarray]:
    """The reference and port tensors one diff row compared (whole, in memory, float64): see
    :meth:`PairReader.read`. Opens both traces; to read many rows, use one :class:`PairReader`."""
    with PairReader.of(diff) as reader:
        return reader.read(row)


def _with_data(record: pd.Series | None) -> pd.Series | None:
    if record is None or record["kind"] != "tensor" or int(record["segment"]) < 0:
        return None
    return record


def _text(value: Any) -> str:
    return "" if value is None or (isinstance(value, float) and np.isnan(value)) else str(value)
