"""Outputs compared through an output conversion: what a port site returns, brought into the
reference's layout by a function before comparing.

A ``[[site]]`` (or ``[[pair]]``) rule with ``output_transform = "pkg.module:function"`` (or
``{ function = ..., takes = ["0", "1"], gives = "0" }``) says how the port's outputs become the
reference's: experts that return the routing weights and each chosen expert's unweighted
output ``(tokens, k, dim)`` against a reference whose experts block returns the weighted sum;
a q/k projection whose rows the port keeps in another order (derived by the diff itself from
the weight's conversion, see :func:`derived_conversions`).

- **forward**: ``f(*port outputs named by takes)`` against the reference's output ``gives``,
  in the reference's layout: one row, at the reference's output record.
- **backward**: the port's recorded outputs ``p`` make the reference's ``r = f(p)``, so a
  faithful port's gradients arriving at them are the chain rule's ``dL/dp = J_f(p)^T dL/dr``:
  the reference's ``grad_output`` pushed through the function's vector-Jacobian product (at
  the port's recorded outputs) is compared with each ``grad_output`` the port recorded at a
  floating-point output it takes, in the port's layout (one row each). This is exact for any
  differentiable function. For a permutation or a reshape ``J^T`` is the inverse permutation,
  so it is the same as applying ``f`` to the port's gradient; for any other linear map (a
  weighted sum, a scale) applying ``f`` to the gradient would compare ``J J^T dL/dr`` with
  ``dL/dr``, which is wrong: the adjoint is what holds.

The function runs only from a mapping the user passed (a trace's recorded mapping that names
code is refused when read). This module is imported only when there is an output conversion,
and torch only inside its functions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import result as R
from layerdiff.compare.converted import _row
from layerdiff.compare.records import RecordPair, RecordPairing
from layerdiff.compare.result import Column
from layerdiff.errors import MappingError
from layerdiff.trace import Trace
from layerdiff.trace.schema import Role

MATCH = "output-converted"  # the rows' match, which compare/pair.py reads them back by
RowKey = tuple[int, str, str, str]


@dataclass(frozen=True)
class Conversion:
    """One site pair's output conversion in one step, as the rows and the reader use it."""

    pair: Any             # the SitePair
    conversion: Any       # an OutputConversion (mapping) or a DerivedPermutation
    step: int


@dataclass(frozen=True)
class OutputConvertedPair(RecordPair):
    """How one output-converted row was made, for reading it back (:func:`read_back`)."""

    item: Conversion | None = None


def output_rows(comparer: Any, rows: pd.DataFrame, records: RecordPairing
                ) -> tuple[pd.DataFrame, dict[RowKey, RecordPair]]:
    """``rows`` with the rows of every output conversion added (sorted as the engine sorts
    them), and the pairing of each new row for reading it back (:class:`PairReader`)."""
    ref, port = comparer.ref, comparer.port
    new: list[dict[str, Any]] = []
    plans: dict[RowKey, RecordPair] = {}
    for pair, conversion in records.output_converted:
        steps = sorted(set(ref.records(site=pair.reference, role=Role.OUTPUT)["step"]))
        for step in steps:
            item = Conversion(pair, conversion, int(step))
            for made in converted_outputs(ref, port, item):
                key = (made.step, pair.reference, made.role, made.arg)
                r = dict(ref.index.iloc[made.ref_pos].to_dict(), arg=made.arg)
                p = dict(port.index.iloc[made.port_pos].to_dict())
                plan = OutputConvertedPair(made.ref_pos, made.port_pos, MATCH, 1.0, item=item)
                row = _row(comparer, plan, r, p, made.ref_values, made.port_values, made.how)
                row[Column.MATCH] = MATCH
                new.append(row)
                plans[key] = plan
                if made.role == Role.GRAD_OUTPUT:  # the compared reference side's norm
                    records.norms[key] = float(np.linalg.norm(
                        np.asarray(made.ref_values, dtype=np.float64).reshape(-1)))
    if not new:
        return rows, plans
    frame = pd.DataFrame(new, columns=R.ROW_COLUMNS)
    merged = frame if rows.empty else pd.concat([rows, frame], ignore_index=True)
    return merged.sort_values([Column.STEP, Column.SEQ], kind="stable", ignore_index=True), plans


@dataclass
class Made:
    """One compared pair an output conversion gives."""

    step: int
    role: str
    arg: str                  # the row's arg: the reference output, or which port output
    ref_pos: int              # the reference record the row stands at
    port_pos: int             # the port record compared
    ref_values: np.ndarray
    port_values: np.ndarray
    how: str


def converted_outputs(ref: Trace, port: Trace, item: Conversion) -> list[Made]:
    """The rows one site pair's output conversion gives in one step: the forward output, then
    one gradient row per floating-point port output it takes that has a recorded gradient."""
    import torch

    pair, conversion, step = item.pair, item.conversion, item.step
    ref_outputs = _by_arg(ref, step, pair.reference, Role.OUTPUT)
    port_outputs = _by_arg(port, step, pair.port, Role.OUTPUT)
    gives = conversion.gives
    if gives not in ref_outputs:
        return []
    missing = [take for take in conversion.takes if take not in port_outputs]
    if missing:
        raise MappingError(f"output conversion {conversion.spec} on {pair.reference}: the "
                           f"port recorded no output {', '.join(repr(m) for m in missing)} at "
                           f"{pair.port} (step {step}; it recorded "
                           f"{', '.join(repr(a) for a in port_outputs) or 'none'}); fix takes")
    values = [_value(port, port_outputs[take]) for take in conversion.takes]
    function = conversion.resolve()
    made_forward = _call(function, values, conversion, pair, step)
    ref_row = ref_outputs[gives]
    first = int(port_outputs[conversion.takes[0]].name)
    taken = ", ".join(repr(t) for t in conversion.takes)
    found = [Made(step, Role.OUTPUT, gives, int(ref_row.name), first,
                  ref.read(ref_row), _numpy(made_forward),
                  f"{conversion.describe()} applied to the port's output(s) {taken}, compared "
                  "with the reference's")]
    ref_grads = _by_arg(ref, step, pair.reference, Role.GRAD_OUTPUT)
    port_grads = _by_arg(port, step, pair.port, Role.GRAD_OUTPUT)
    floats = [i for i, v in enumerate(values)
              if torch.is_tensor(v) and v.is_floating_point()
              and conversion.takes[i] in port_grads]
    if gives not in ref_grads or not floats:
        return found
    pulled = _pull_back(function, values, floats, ref.read(ref_grads[gives]), conversion, pair,
                        step)
    for number, (i, grad) in enumerate(zip(floats, pulled, strict=True)):
        take = conversion.takes[i]
        port_row = port_grads[take]
        # the first row stands for the reference's gradient record itself (what came into the
        # site, for the origins); the others name the port output they compare
        arg = gives if number == 0 else f"{gives} (port {take})"
        found.append(Made(step, Role.GRAD_OUTPUT, arg,
                          int(ref_grads[gives].name), int(port_row.name), grad,
                          port.read(port_row),
                          f"the reference's gradient pushed through {conversion.describe()}'s "
                          f"vector-Jacobian product at the port's outputs, compared with the "
                          f"port's gradient at its output {take!r}"))
    return found


def _by_arg(trace: Trace, step: int, site: str, role: str) -> dict[str, pd.Series]:
    rows = trace.records(step, site, role)
    return {str(arg): row for (_, row), arg in zip(rows.iterrows(), rows["arg"], strict=True)}


def _value(trace: Trace, row: pd.Series) -> Any:
    """A port output as the function receives it: a tensor as a torch tensor (bfloat16 as
    float32), anything else as recorded."""
    import torch

    if row["kind"] == "tensor":
        return torch.from_numpy(np.ascontiguousarray(trace.read(row)))
    value = json.loads(row["value"]) if row["value"] else None
    return None if isinstance(value, dict) and set(value) == {"repr", "type"} else value


def _numpy(value: Any) -> np.ndarray:
    return value.detach().cpu().numpy()


def _call(function, values: list, conversion, pair, step: int):
    """``function(*values)``, checked: a tensor, or one sentence naming the rule."""
    import torch

    try:
        made = function(*values)
    except Exception as exc:  # the user's code: say where, never a traceback
        raise MappingError(f"output conversion {conversion.spec} ({conversion.where}) failed on "
                           f"the port's outputs of {pair.port} (step {step}): "
                           f"{type(exc).__name__}: {exc}") from None
    if not torch.is_tensor(made):
        raise MappingError(f"output conversion {conversion.spec} ({conversion.where}) returned "
                           f"a {type(made).__name__} for {pair.port} (step {step}); it must "
                           "return one tensor, in the layout of the reference's output "
                           f"{conversion.gives!r}")
    return made


def _pull_back(function, values: list, floats: list[int], grad: np.ndarray, conversion, pair,
               step: int) -> list[np.ndarray]:
    """``J_f(p)^T grad`` for each floating-point taken output (float64, at the port's
    outputs)."""
    import torch
    from torch.func import vjp

    def partial(*primals):
        args = list(values)
        for i, primal in zip(floats, primals, strict=True):
            args[i] = primal
        return function(*args)

    primals = [values[i].to(torch.float64) for i in floats]
    try:
        out, pull = vjp(partial, *primals)
        cotangent = torch.from_numpy(np.asarray(grad, dtype=np.float64)).reshape(out.shape)
        pulled = pull(cotangent.to(out.dtype))
    except Exception as exc:
        raise MappingError(f"output conversion {conversion.spec} ({conversion.where}): its "
                           f"vector-Jacobian product at the port's outputs of {pair.port} (step "
                           f"{step}) failed ({type(exc).__name__}: {exc}); the gradients "
                           "arriving at them are compared through it, so it must be "
                           "differentiable (torch operations are)") from None
    return [t.detach().to(torch.float64).numpy() for t in pulled]


def read_back(ref: Trace, port: Trace, plan: OutputConvertedPair,
              role: str, arg: str) -> tuple[np.ndarray, np.ndarray]:
    """The (reference, port) values one output-converted row compared."""
    for made in converted_outputs(ref, port, plan.item):
        if made.role == role and made.arg == arg:
            return np.asarray(made.ref_values), np.asarray(made.port_values)
    raise MappingError(f"output conversion {plan.item.conversion.spec} gives no {role} {arg}")
