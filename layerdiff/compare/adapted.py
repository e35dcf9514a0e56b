"""Inputs of a site with a call adapter: the port's recorded inputs against what the adapter
makes of the reference's recorded arguments.

A ``[[site]]`` (or ``[[pair]]``) rule with ``call = "pkg.module:function"`` says how the
reference's call becomes the port's: Hugging Face passes ``position_embeddings=(cos, sin)`` of
shape (1, T, hd), a Meta-style port takes ``freqs_cos, freqs_sin`` of shape (T, hd/2). The
diff rebuilds the reference's call as it was passed (tensors as torch tensors, None and plain
values as recorded), runs the adapter, and compares each tensor it returns with what the port
recorded for the parameter it fills (bound by the port's recorded signature, as replay binds
it). So a port-only input (``freqs_cos``) is judged, not left without partner; the reference's
inputs at such a site are the adapter's to take, never listed as unmatched.

With a baseline (``--baseline``) an adapted input is judged like any record: a reference
tensor the adapter passes through unchanged by the baseline's limit at that argument's record
(its rms rule included); a tensor the adapter made as a view of one reference argument (a slice
of ``cos``) holds a subset of that argument's elements, so each element's baseline error is at
most the argument's worst: the worst-element rule with the argument's worst error (its rms says
nothing of a part's). Any other tensor the adapter made has no baseline record: it keeps the
compared dtype's tolerance, and its row says so.

Gradients: the port's ``grad_input`` is taken with respect to the port's arguments, which the
adapter made. Only a reference tensor the adapter passes through unchanged (the very object)
has the same gradient on both sides: those are compared; every other ``grad_input`` is listed
as not compared, saying why.

torch is imported only here, and only when a mapping names a call adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import judge
from layerdiff.compare import result as R
from layerdiff.compare.arguments import CallSignatures, head_of
from layerdiff.compare.baseline import Baseline, BaselineError, Limit
from layerdiff.compare.metrics import PairMetrics
from layerdiff.compare.records import RecordPair, RecordPairing
from layerdiff.compare.result import Column
from layerdiff.compare.row_metrics import rms_over
from layerdiff.compare.tolerances import Tolerance, ToleranceKind, Tolerances, looser_dtype
from layerdiff.errors import MappingError
from layerdiff.framework import Framework, framework_named
from layerdiff.mapping import Mapping
from layerdiff.signature import Signature
from layerdiff.trace import Trace, schema
from layerdiff.trace.arguments import rebuild_call
from layerdiff.trace.schema import Pass, Role


@dataclass
class AdaptedRows:
    """Rows (the engine's columns) of the inputs compared through call adapters."""

    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.rows

    def join(self, rows: pd.DataFrame) -> pd.DataFrame:
        """The engine's rows with these added, in recording order."""
        if not self.rows:
            return rows
        extra = pd.DataFrame(self.rows, columns=R.ROW_COLUMNS)
        joined = pd.concat([rows, extra], ignore_index=True) if len(rows) else extra
        return joined.sort_values([Column.STEP, Column.SEQ], kind="stable", ignore_index=True)


def adapt_calls(ref: Trace, port: Trace, records: RecordPairing, mapping: Mapping,
                tolerances: Tolerances, baseline: Baseline | None = None) -> AdaptedRows:
    """Compare the inputs of every site pair in ``records.adapted`` (by ``baseline``'s limits
    where it has them); marks what it compared as paired in ``records`` (grad_input pairs are
    added to ``records.pairs``, which the engine judges by the baseline itself)."""
    found = AdaptedRows()
    if not records.adapted:
        return found
    signatures = CallSignatures.of(ref, port)
    # the adapter gets what the port's framework takes: JAX arrays for a Flax port's trace
    framework = framework_named(port.meta.get("framework", "torch"))
    for pair in records.adapted:
        code = mapping.call_adapter(pair.reference)
        adapter = code.resolve()
        port_sig = signatures.signature("port", pair.port)
        for step in sorted(set(ref.records(site=pair.reference, role=Role.INPUT)["step"])):
            _Call(ref, port, records, tolerances, pair, int(step), code.spec, port_sig,
                  found, baseline, framework).compare(adapter)
    return found


class _Call:
    """One adapted call: one site pair in one step."""

    def __init__(self, ref: Trace, port: Trace, records: RecordPairing, tolerances: Tolerances,
                 pair, step: int, spec: str, port_sig: Signature | None,
                 found: AdaptedRows, baseline: Baseline | None = None,
                 framework: Framework | None = None) -> None:
        self.ref, self.port, self.records, self.tolerances = ref, port, records, tolerances
        self.framework = framework or framework_named("torch")
        self.pair, self.step, self.spec, self.port_sig = pair, step, spec, port_sig
        self.found, self.baseline = found, baseline
        self.ref_index: dict[str, dict] = {}  # reference path -> its index row

    def compare(self, adapter) -> None:
        ref_rows = self.ref.records(self.step, self.pair.reference, Role.INPUT)
        if ref_rows.empty:
            return
        port_rows = self.port.records(self.step, self.pair.port, Role.INPUT)
        missing = [side for side, rows in (("reference", ref_rows), ("port", port_rows))
                   if ((rows["kind"] == "tensor") & (rows["segment"] < 0)).any()]
        if missing:  # a summary trace, or a site a partial capture kept statistics of
            self._by_statistics(adapter, ref_rows, port_rows, missing)
            return
        values, origin = self._reference_call(ref_rows)
        self.ref_index = {str(row["arg"]): row for row in ref_rows.to_dict("records")}
        args, kwargs = rebuild_call(values)
        try:
            result = adapter(*args, **kwargs)
            new_args, new_kwargs = result
            new_args, new_kwargs = tuple(new_args), dict(new_kwargs)
        except Exception as exc:  # the user's code: say where, never a traceback
            raise MappingError(
                f"call adapter {self.spec} failed on the reference's call of "
                f"{self.pair.reference} (step {self.step}): {type(exc).__name__}: {exc}; it "
                "must take the reference's arguments as they were passed and return "
                "(args, kwargs) for the port layer") from None
        made = _flatten_call(new_args, new_kwargs)
        port_paths = {str(arg): row for (_, row), arg in zip(port_rows.iterrows(),
                                                              port_rows["arg"], strict=True)}
        paths = _bind(list(made), list(port_paths), self.port_sig)
        seq = int(ref_rows["seq"].min())
        passed: dict[str, str] = {}   # port path -> the reference path passed through unchanged
        for path, value in made.items():
            port_path = paths.get(path)
            if port_path is None or not hasattr(value, "shape"):
                continue
            row = port_paths[port_path]
            if row["kind"] != "tensor":
                continue
            source = origin.get(id(value))
            if source is not None:
                passed[port_path] = source
            self.found.rows.append(self._row(value, row, seq, source, port_path,
                                             _viewed(value, origin, values)))
            self._paired(port_path, Role.INPUT)
        self._gradients(passed)

    def _reference_call(self, rows: pd.DataFrame) -> tuple[list[tuple[str, Any]], dict]:
        """The reference's arguments as (path, value), tensors as torch tensors (JAX arrays
        for a Flax port, as replay gives them), and which reference path each tensor object
        came from."""
        import torch

        values: list[tuple[str, Any]] = []
        origin: dict[int, str] = {}
        for _, row in rows.iterrows():
            arg = str(row["arg"])
            if row["kind"] == "tensor":
                tensor = torch.from_numpy(np.ascontiguousarray(self.ref.read(row)))
                tensor = self.framework.as_array(tensor)
                origin[id(tensor)] = arg
                values.append((arg, tensor))
            else:
                values.append((arg, _plain(row["value"])))
        return values, origin

    def _row(self, value, port_row: pd.Series, seq: int, source: str | None,
             port_path: str, viewed: str | None = None) -> dict[str, Any]:
        ref_values, ref_dtype = _made_numpy(value)
        port_values = self.port.read(port_row)
        port_dtype = str(port_row["dtype"])
        arg = source if source is not None else _parameter_path(port_path, self.port_sig)
        dtype = looser_dtype(ref_dtype, port_dtype)
        tolerance = self.tolerances.lookup(self.pair.reference, Role.INPUT, arg, dtype)
        rms_tol = None
        if self.baseline is not None and tolerance.kind not in (ToleranceKind.RULE,
                                                                  ToleranceKind.FLAGS):
            # what the user said wins, as in the engine
            tolerance, rms_tol = self._baseline_limit(tolerance, ref_values, port_dtype,
                                                      source, viewed)
        how = (f"the reference's '{source}', passed through by call adapter {self.spec}"
               if source is not None else
               f"made by call adapter {self.spec} from the reference's arguments")
        row: dict[str, Any] = dict.fromkeys(R.ROW_COLUMNS)  # plain strings: the frame's labels
        row.update({
            Column.STEP: self.step, Column.PASS: Pass.FORWARD, Column.SEQ: seq,
            Column.SITE: self.pair.reference, Column.ROLE: Role.INPUT, Column.ARG: arg,
            Column.PORT_SITE: self.pair.port, Column.PORT_ARG: port_path,
            Column.MATCH: "adapted", Column.CONFIDENCE: 1.0,
            Column.SHAPE: schema.format_shape(tuple(ref_values.shape)),
            Column.PORT_SHAPE: schema.format_shape(tuple(port_values.shape)),
            Column.DTYPE: ref_dtype, Column.PORT_DTYPE: port_dtype,
            Column.NUMEL: int(ref_values.size), Column.RTOL: tolerance.rtol,
            Column.ATOL: tolerance.atol, Column.TOL_SOURCE: tolerance.source,
            Column.RMS_TOL: rms_tol, Column.VERDICT: "", Column.NOTE: how, Column.STATUS: "",
            Column.CAUSE: "",
        })
        if ref_values.shape != port_values.shape:
            row.update(verdict=judge.Verdict.SHAPE_MISMATCH, ratio=np.inf,
                       note=f"{how}; shapes differ: adapter gives ({row['shape']}), port has "
                            f"({row['port_shape']})")
            return row
        if ref_dtype != port_dtype:
            ref_values = ref_values.astype(np.float64)
            port_values = port_values.astype(np.float64)
        shape = tuple(ref_values.shape)
        self.records.norms[(self.step, self.pair.reference, Role.INPUT, arg)] = float(
            np.linalg.norm(ref_values.astype(np.float64).reshape(-1)))
        batch = shape[0] if len(shape) >= 2 else 0
        same_float = ref_dtype == port_dtype and np.dtype(ref_values.dtype).kind == "f"
        metrics = PairMetrics(tolerance.rtol, tolerance.atol, int(ref_values.size), batch,
                              1.0 if same_float and ref_dtype != "bfloat16" else None)
        metrics.update(np.ascontiguousarray(ref_values).reshape(-1),
                       np.ascontiguousarray(port_values).reshape(-1), 0)
        row.update(metrics.result(shape))
        if rms_tol is not None:  # the baseline's second rule, as the engine folds it in
            row[Column.RATIO] = judge.worst([row[Column.RATIO], rms_over(row[Column.RMS], rms_tol)])
        row[Column.VERDICT] = judge.verdict(row[Column.RATIO], ref_nan=row[Column.REF_NAN],
                                       port_nan=row[Column.PORT_NAN], port_inf=row[Column.PORT_INF],
                                       finite_ratio=row.get("finite_ratio"))
        return row

    def _baseline_limit(self, tolerance: Tolerance, ref_values: np.ndarray, port_dtype: str,
                        source: str | None, viewed: str | None) -> tuple[Tolerance, float | None]:
        """The baseline's (tolerance, rms limit) for one adapted input, or ``tolerance`` (the
        compared dtype's) with a tol_source saying why no baseline applies."""
        assert self.baseline is not None
        argument = source or viewed
        key = (self.step, self.pair.reference, Role.INPUT, argument)
        limit: Limit | None = None
        if source is not None:  # the very tensor: the argument's own record and rule
            limit = self.baseline.limit(key, self.ref_index[source], port_dtype, 1.0)
        elif viewed is not None and (error := self.baseline.errors.get(key)) is not None:
            # a view holds some of the argument's elements: each is off by at most the
            # argument's worst error; the whole's rms bounds no part's, so the worst element
            part = Baseline(self.baseline.name,
                            {key: BaselineError(error.max_abs, None, error.dtype)},
                            factor=self.baseline.factor)
            limit = part.limit(key, _statistics(ref_values), port_dtype, 1.0)
            if limit is not None:
                limit = Limit(Tolerance(limit.tolerance.rtol, limit.tolerance.atol,
                                        f"{limit.tolerance.source} (of '{viewed}', which "
                                        f"call adapter {self.spec} took a view of)",
                                        limit.tolerance.kind), None)
        if limit is not None:
            return limit.tolerance, limit.rms
        why = (f"no baseline record of '{argument}'" if argument is not None else
               f"no baseline: a tensor call adapter {self.spec} computed (not a reference "
               "argument or a view of one) has no baseline error to scale")
        return Tolerance(tolerance.rtol, tolerance.atol, f"{tolerance.source}; {why}",
                         tolerance.kind), None

    def _by_statistics(self, adapter, ref_rows: pd.DataFrame, port_rows: pd.DataFrame,
                       sides: list[str]) -> None:
        """A side holds statistics only for this call's inputs (a summary trace, or a site a
        partial capture kept statistics of): the adapter cannot make the port's inputs from
        the reference's values. It is run on stand-ins of the recorded shapes and dtypes
        (meta tensors: no memory, no values) to learn which reference tensors it passes to
        the port unchanged; those, and their input gradients, are paired and judged by their
        statistics like any record without data. What it makes from them cannot be judged
        without values: listed as not compared, saying why, never a reason for the diff to
        stop (the site's outputs are still judged)."""
        why = (f"not compared: {' and '.join(sides)} kept statistics only at this site, and "
               f"call adapter {self.spec} makes it from the reference's values")
        passed = self._passed_through(adapter, ref_rows, port_rows)
        for port_path, ref_pos in passed.items():
            self.records.pairs.append(RecordPair(ref_pos, int(port_rows.index[
                list(port_rows["arg"].astype(str)).index(port_path)]), "adapted", 1.0))
            self._paired(port_path, Role.INPUT)
        key = ("port", self.step, self.pair.port, Role.INPUT)
        self.records.unmatched = [(*e[:5], why) if e[:4] == key else e
                                  for e in self.records.unmatched]
        self.records.port_missing = [m for m in self.records.port_missing
                                     if m[:3] != (self.step, self.pair.reference,
                                                  self.pair.port)]
        arg_of = {pos: str(arg) for pos, arg in zip(ref_rows.index, ref_rows["arg"],
                                                    strict=True)}
        self._gradients({path: arg_of[pos] for path, pos in passed.items()})

    def _passed_through(self, adapter, ref_rows: pd.DataFrame,
                        port_rows: pd.DataFrame) -> dict[str, int]:
        """Port input path -> the reference record the adapter passes to it unchanged, found by
        running it on meta tensors; empty when it cannot run so."""
        import torch

        values: list[tuple[str, Any]] = []
        origin: dict[int, int] = {}
        try:
            for pos, row in ref_rows.iterrows():
                arg = str(row["arg"])
                if row["kind"] == "tensor":
                    tensor = torch.empty(schema.parse_shape(str(row["shape"])),
                                         dtype=getattr(torch, str(row["dtype"])), device="meta")
                    origin[id(tensor)] = int(pos)
                    values.append((arg, tensor))
                else:
                    values.append((arg, _plain(row["value"])))
            args, kwargs = rebuild_call(values)
            new_args, new_kwargs = adapter(*args, **kwargs)
            made = _flatten_call(tuple(new_args), dict(new_kwargs))
        except Exception:  # an adapter that needs values: nothing is known to pass through
            return {}
        recorded = {str(arg): kind for arg, kind in zip(port_rows["arg"], port_rows["kind"],
                                                        strict=True)}
        paths = _bind(list(made), list(recorded), self.port_sig)
        return {paths[path]: origin[id(value)] for path, value in made.items()
                if path in paths and id(value) in origin and recorded[paths[path]] == "tensor"}

    def _paired(self, port_path: str, role: str) -> None:
        """A port record the adapter's call paired: no longer without partner."""
        key = ("port", self.step, self.pair.port, role, port_path)
        self.records.unmatched = [e for e in self.records.unmatched if e[:5] != key]
        if role == Role.INPUT:
            self.records.port_missing = [
                m for m in self.records.port_missing
                if m[:4] != (self.step, self.pair.reference, self.pair.port, port_path)]

    def _gradients(self, passed: dict[str, str]) -> None:
        """grad_input pairs for the reference tensors passed through unchanged; the rest is
        listed as not compared."""
        ref_rows = self.ref.records(self.step, self.pair.reference, Role.GRAD_INPUT)
        port_rows = self.port.records(self.step, self.pair.port, Role.GRAD_INPUT)
        ref_at = {str(arg): int(pos) for pos, arg in zip(ref_rows.index, ref_rows["arg"],
                                                          strict=True)}
        compared = set()
        for pos, arg in zip(port_rows.index, port_rows["arg"], strict=True):
            source = passed.get(str(arg))
            if source is not None and source in ref_at:
                self.records.pairs.append(RecordPair(ref_at[source], int(pos), "adapted", 1.0))
                self._paired(str(arg), Role.GRAD_INPUT)
                compared.add(source)
                continue
            key = ("port", self.step, self.pair.port, Role.GRAD_INPUT, str(arg))
            self.records.unmatched = [
                (*e[:5], _NOT_COMPARED) if e[:5] == key else e for e in self.records.unmatched]
        for arg in ref_at:
            if arg not in compared:
                self.records.unmatched.append(("reference", self.step, self.pair.reference,
                                               Role.GRAD_INPUT, arg, _NOT_COMPARED))
        self.records.pairs.sort(key=lambda p: p.ref)


_NOT_COMPARED = ("not compared: at a site with a call adapter, a gradient is compared only for "
                 "a reference tensor the adapter passes to the port unchanged (the port's "
                 "grad_input is taken with respect to the arguments the adapter made)")


def _viewed(value, origin: dict[int, str], values: list[tuple[str, Any]]) -> str | None:
    """The reference path whose tensor ``value`` is a view of (same storage, same dtype),
    when it is not that very tensor. Each reference tensor was made here with storage of its
    own elements only, so a view's elements are among them."""
    if id(value) in origin or not hasattr(value, "untyped_storage"):
        return None
    for path, tensor in values:
        if (id(tensor) in origin and tensor.dtype == value.dtype
                and value.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()):
            return path
    return None


def _statistics(values: np.ndarray) -> dict[str, float]:
    """The index fields Baseline.limit reads, of values the adapter made."""
    flat = values.astype(np.float64).reshape(-1)
    return {"numel": int(flat.size), "min": float(flat.min(initial=0.0)),
            "max": float(flat.max(initial=0.0)), "l2": float(np.linalg.norm(flat))}


def _made_numpy(value: Any) -> tuple[np.ndarray, str]:
    """What an adapter made (a torch tensor, a JAX or numpy array) as numpy, and its dtype's
    name; bfloat16 widened to float32, which numpy stores."""
    if hasattr(value, "detach"):
        tensor = value.detach().cpu()
        dtype = str(tensor.dtype).removeprefix("torch.")
        if tensor.dtype.is_floating_point and tensor.dtype not in (
                _torch().float32, _torch().float64, _torch().float16):
            tensor = tensor.float()  # numpy has no bfloat16
        return tensor.numpy(), dtype
    array = np.asarray(value)
    dtype = str(array.dtype)
    if dtype == "bfloat16":
        array = array.astype(np.float32)
    return array, dtype


def _torch():
    import torch

    return torch


def _plain(text: str) -> Any:
    """A recorded non-tensor argument; what capture could keep only as a repr (a cache
    object) is None: there is nothing of it to rebuild."""
    import json

    value = json.loads(text) if text else None
    if isinstance(value, dict) and set(value) == {"repr", "type"}:
        return None
    return value




def _flatten_call(args: tuple, kwargs: dict[str, Any]) -> dict[str, Any]:
    """(argument path -> leaf) as capture records a call: ``f(x, (h, c), mask=m)`` gives
    ``0``, ``1.0``, ``1.1`` and ``mask``."""
    found: dict[str, Any] = {}

    def walk(value: Any, prefix: str) -> None:
        if isinstance(value, (tuple, list)) and not hasattr(value, "shape"):
            for number, item in enumerate(value):
                walk(item, f"{prefix}.{number}")
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, f"{prefix}.{key}")
        else:
            found[prefix] = value

    for number, value in enumerate(args):
        walk(value, str(number))
    for key, value in kwargs.items():
        walk(value, str(key))
    return found


def _bind(made: list[str], recorded: list[str], port: Signature | None) -> dict[str, str]:
    """Adapter path -> the port's recorded path for the same parameter (by the port's
    signature: the adapter may pass by position what the port's caller passed by keyword)."""
    if port is None:
        return {path: path for path in made if path in recorded}
    by_name: dict[str, str] = {}
    for path in recorded:
        head, rest = head_of(path)
        by_name[_name(head, port) + rest] = path
    return {path: by_name[key] for path in made
            if (key := _name(head_of(path)[0], port) + head_of(path)[1]) in by_name}


def _name(head: str, port: Signature) -> str:
    if head.isdigit() and int(head) < len(port.positional):
        return port.positional[int(head)].name
    return head


def _parameter_path(path: str, port: Signature | None) -> str:
    """A port path named by its parameter (``1`` -> ``freqs_cos``), for the row's ``arg``."""
    if port is None:
        return path
    head, rest = head_of(path)
    return _name(head, port) + rest
