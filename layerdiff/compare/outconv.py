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
from layerdiff.compare.judge import Verdict
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
            if not _has_data(ref, port, item):
                new += _statistics_only(comparer, item)
                continue
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


def _has_data(ref: Trace, port: Trace, item: Conversion) -> bool:
    """Whether the reference's output and every port output the function takes hold tensor
    data (not a summary trace, nor statistics kept around a --full-around capture)."""
    ref_row = _by_arg(ref, item.step, item.pair.reference, Role.OUTPUT).get(
        item.conversion.gives)
    port_rows = _by_arg(port, item.step, item.pair.port, Role.OUTPUT)
    ref_inputs = _by_arg(ref, item.step, item.pair.reference, Role.INPUT)
    rows = [ref_row, *(port_rows.get(take) for take in item.conversion.takes),
            *(ref_inputs.get(path) for path in _reference_inputs(item.conversion))]
    return all(row is None or row["kind"] != "tensor" or int(row["segment"]) >= 0
               for row in rows)


def _statistics_only(comparer: Any, item: Conversion) -> list[dict[str, Any]]:
    """Rows for a side without tensor data: a function cannot be applied to statistics, so
    the output (and its gradient) is listed as not compared."""
    ref, port = comparer.ref, comparer.port
    found = []
    for role in (Role.OUTPUT, Role.GRAD_OUTPUT):
        r = _by_arg(ref, item.step, item.pair.reference, role).get(item.conversion.gives)
        p = _by_arg(port, item.step, item.pair.port, role).get(item.conversion.takes[0])
        if r is None or p is None:
            continue
        r, p = r.to_dict(), dict(p.to_dict(), shape=r["shape"], digest="")
        row = comparer._base_row(RecordPair(0, 0, MATCH, 1.0), r, p)
        for column in (Column.MAX_ABS, Column.REF_NAN, Column.REF_INF, Column.PORT_NAN,
                       Column.PORT_INF):
            row[column] = None
        row.update(verdict=Verdict.WITHIN, ratio=np.nan, match=MATCH, note=(
            f"statistics only: {item.conversion.describe()} cannot be applied to statistics; "
            "not compared"))
        found.append(row)
    return found


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
    values += _reference_values(ref, step, pair, conversion)
    function = conversion.resolve()
    made_forward = _call(function, values, conversion, pair, step)
    ref_row = ref_outputs[gives]
    first = int(port_outputs[conversion.takes[0]].name)
    taken = ", ".join(repr(t) for t in conversion.takes)
    if _reference_inputs(conversion):
        taken += " with the reference's input(s) " + ", ".join(
            repr(t) for t in _reference_inputs(conversion))
    found = [Made(step, Role.OUTPUT, gives, int(ref_row.name), first,
                  ref.read(ref_row), _numpy(made_forward),
                  f"{conversion.describe()} applied to the port's output(s) {taken}, compared "
                  f"with the reference's output {gives!r}")]
    ref_grads = _by_arg(ref, step, pair.reference, Role.GRAD_OUTPUT)
    port_grads = _by_arg(port, step, pair.port, Role.GRAD_OUTPUT)
    floats = [i for i, v in enumerate(values[:len(conversion.takes)])
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
                          f"the port's gradient at its output {take!r} compared with the "
                          f"reference's at {gives!r} pulled back through "
                          f"{conversion.describe()} (its vector-Jacobian product at the port's "
                          "outputs)"))
    return found


def _reference_inputs(conversion: Any) -> tuple[str, ...]:
    return tuple(getattr(conversion, "reference_inputs", ()))


def _reference_values(ref: Trace, step: int, pair: Any, conversion: Any) -> list:
    """The reference site's recorded inputs the function takes after the port's outputs
    (``reference_inputs``): held constant, so the gradients are pulled back to the port's
    outputs alone."""
    paths = _reference_inputs(conversion)
    if not paths:
        return []
    inputs = _by_arg(ref, step, pair.reference, Role.INPUT)
    missing = [path for path in paths if path not in inputs]
    if missing:
        raise MappingError(f"output conversion {conversion.spec} on {pair.reference}: the "
                           f"reference recorded no input {', '.join(repr(m) for m in missing)} "
                           f"(step {step}; it recorded "
                           f"{', '.join(repr(a) for a in inputs) or 'none'}); fix "
                           "reference_inputs")
    return [_value(ref, inputs[path]) for path in paths]


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
    """``function(*values)`` for the diff's rows: a tensor, or one sentence naming the rule."""
    return _applied(function, values, conversion,
                    f"the port's outputs of {pair.port} (step {step})", MappingError)


def _applied(function, values: list, conversion, where: str, error: type[Exception]):
    """``function(*values)``, checked: a tensor, or ``error`` in one sentence saying which
    rule's function failed on what (the user's code: never a traceback)."""
    import torch

    try:
        made = function(*values)
    except Exception as exc:
        first = str(exc).splitlines()[0] if str(exc) else ""
        raise error(f"{conversion.describe()} ({conversion.where}) failed on "
                    f"{where}: {type(exc).__name__}: {first}") from None
    if not torch.is_tensor(made):
        raise error(f"{conversion.describe()} ({conversion.where}) returned "
                    f"a {type(made).__name__} for {where}; it must return one tensor, in the "
                    f"layout of the reference's output {conversion.gives!r}")
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


def pull_back(conversion: Any, function: Any, outputs: list, grad: np.ndarray,
              where: str, reference_inputs: list = ()) -> list:
    """The gradients arriving at the port outputs ``outputs`` (those ``conversion`` takes, as
    torch tensors or plain values) when ``grad`` arrives at the reference's output it gives:
    ``J_f^T grad`` at ``outputs`` (float64), None for an output that is no floating-point
    tensor. ``reference_inputs`` (the reference site's inputs the conversion also takes) are
    held constant. What replay feeds a port layer in place of the reference's gradient."""
    import torch

    floats = [i for i, v in enumerate(outputs) if torch.is_tensor(v) and v.is_floating_point()]
    found: list = [None] * len(outputs)
    if not floats:
        return found
    constants = [torch.from_numpy(np.asarray(v)) if isinstance(v, np.ndarray) else v
                 for v in reference_inputs]
    values = [v.detach().cpu() if torch.is_tensor(v) else v for v in [*outputs, *constants]]
    pulled = _pull_back(function, values, floats, grad, conversion, _Named(where), 0)
    for i, value in zip(floats, pulled, strict=True):
        found[i] = value
    return found


@dataclass(frozen=True)
class _Named:
    port: str


def read_back(ref: Trace, port: Trace, plan: OutputConvertedPair,
              role: str, arg: str) -> tuple[np.ndarray, np.ndarray]:
    """The (reference, port) values one output-converted row compared."""
    for made in converted_outputs(ref, port, plan.item):
        if made.role == role and made.arg == arg:
            return np.asarray(made.ref_values), np.asarray(made.port_values)
    raise MappingError(f"output conversion {plan.item.conversion.spec} gives no {role} {arg}")


# ---------------------------------------------------------------- derived from the weights

@dataclass(frozen=True)
class DerivedPermutation:
    """An output conversion the diff derives itself: a site whose weights the mapping converts
    by one permutation of their rows (``hf_to_meta_qk`` on a q/k projection) returns its
    output features in that order, so the port's output, read along its last axis in the
    inverse order, is the reference's."""

    inverse: tuple[int, ...]      # reference feature j is the port's feature inverse[j]
    functions: tuple[str, ...]    # the conversion functions that make the permutation
    params: tuple[str, ...]       # the port parameters whose rows it permutes
    takes: tuple[str, ...] = ("0",)
    gives: str = "0"

    @property
    def spec(self) -> str:
        return ", ".join(self.functions)

    @property
    def where(self) -> str:
        return f"derived from the mapping's conversion of {', '.join(self.params)}"

    def resolve(self):
        import torch

        inverse = torch.tensor(self.inverse, dtype=torch.long)

        def unpermute(output):
            return output.index_select(-1, inverse.to(output.device))

        return unpermute

    def resolve_inverse(self):
        """The other way: the reference's output in the port's order (a reference layer
        swapped into the port)."""
        import torch

        forward = torch.tensor(np.argsort(np.asarray(self.inverse)), dtype=torch.long)

        def permute(output):
            return output.index_select(-1, forward.to(output.device))

        return permute

    def describe(self) -> str:
        return (f"the inverse of the row permutation {self.spec} makes of "
                f"{', '.join(self.params)} (derived: a layer whose weight rows are permuted "
                "gives its output features in that order)")


class SiteConversions:
    """The output conversion of each site pair, declared or derived: the one place the diff,
    replay, swap and map-check find it, so all four compare a site's outputs the same way.

    ``ref_shapes``: the reference's weights' shapes by full name (text as a trace's index has
    them, or tuples). :meth:`find` gives the rule's ``output_transform``, else the row
    permutation the mapping's conversion of the port layer's own parameters makes
    (:func:`derive_permutation`; only for a mapping whose ``[[param]]`` rules name a function).
    Functions are imported once each (:meth:`function`)."""

    def __init__(self, mapping: Any, ref_shapes: dict[str, Any]) -> None:
        from layerdiff.mapping import is_code

        self.mapping, self.ref_shapes = mapping, ref_shapes
        self.derives = any(is_code(step) for rule in mapping.param_rules
                           for step in rule.transforms)
        self._seen: dict = {}
        self._functions: dict[Any, Any] = {}

    def find(self, ref_site: str, port_module: str, params: dict[str, tuple[int, ...]],
             features: int | None) -> Any:
        """The conversion of reference site ``ref_site`` paired with ``port_module``, whose own
        parameters and buffers are ``params`` (full name -> shape) and whose output ``0`` has
        ``features`` elements on its last axis (None: unknown, nothing derived); None where
        its outputs compare as they are."""
        from layerdiff.trace.schema import split_site

        declared = self.mapping.output_conversion(ref_site)
        if declared is not None or not self.derives or not params or not features:
            return declared
        return derive_permutation(params, self.ref_shapes, self.mapping,
                                  {port_module: split_site(ref_site)[0]}, features, self._seen)

    def function(self, conversion: Any) -> Any:
        """``conversion``'s function, imported once."""
        if conversion not in self._functions:
            self._functions[conversion] = conversion.resolve()
        return self._functions[conversion]


class CannotConvert(Exception):
    """An output conversion that cannot be applied to what a layer returned (an output it
    takes is missing, or the function raised): one line, said as "cannot judge"."""


def convert_outputs(conversion: Any, function: Any, outputs: list[tuple[str, Any]],
                    where: str, reference_inputs: dict[str, Any] | None = None
                    ) -> list[tuple[str, Any]]:
    """A layer's outputs (argument path, value) in the reference's layout: the outputs the
    conversion takes replaced by what ``function`` makes of them, at the output it gives;
    differentiable where the function is (torch operations), so gradients arriving at the
    result flow back to the layer's outputs through it. ``reference_inputs`` are the reference
    site's inputs at this call (path -> value), of which the conversion's ``reference_inputs``
    are passed after the outputs; a live tensor keeps its graph, so in a swap the gradient
    reaches them as it reaches the reference layer's input (the routing weights' router).
    Raises :class:`CannotConvert`."""

    values = dict(outputs)
    missing = [take for take in conversion.takes if take not in values]
    if missing:
        raise CannotConvert(
            f"{conversion.describe()} ({conversion.where}) takes the output(s) "
            f"{', '.join(repr(m) for m in missing)} that {where} does not return (it returns "
            f"{', '.join(repr(a) for a in values) or 'nothing'})")
    given = reference_inputs or {}
    absent = [path for path in _reference_inputs(conversion) if path not in given]
    if absent:
        raise CannotConvert(
            f"{conversion.describe()} ({conversion.where}) takes the reference's input(s) "
            f"{', '.join(repr(a) for a in absent)}, which the call at {where} does not have")
    constants = [_as_tensor(given[path]) for path in _reference_inputs(conversion)]
    made = _applied(function, [*(values[take] for take in conversion.takes), *constants],
                    conversion, f"the outputs of {where}", CannotConvert)
    # the result stands where the first output it takes stood; the others keep their places
    found, placed = [], False
    for arg, value in outputs:
        if arg in conversion.takes:
            if not placed:
                found.append((conversion.gives, made))
                placed = True
        elif arg != conversion.gives:
            found.append((arg, value))
    return found


def _as_tensor(value: Any) -> Any:
    """A recorded array as a tensor; anything else as it is."""
    import torch

    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(value))
    return value


def weight_shapes(trace: Trace) -> dict[str, str]:
    """The reference's weights' shapes by full name, as its index has them."""
    from layerdiff.trace.schema import param_name

    weights = trace.index[trace.index["role"] == Role.WEIGHT]
    return {param_name(site, arg): shape for site, arg, shape in zip(
        weights["site"], weights["arg"], weights["shape"], strict=True)}


def derived_conversions(ref: Trace, port: Trace, sites: Any, mapping: Any,
                        given: set[str]) -> dict[str, DerivedPermutation]:
    """Reference site -> the output permutation its weights' conversion makes, for each site
    pair without an output conversion of its own (``given``) whose port parameters the mapping
    makes from one reference tensor each through a chain with a conversion function that
    permutes rows, the same permutation for every parameter of the module (a bias copied
    unpermuted under a permuted weight gives none). Found exactly, by running each chain on a
    tensor whose elements are their own indices. Only where the output's last axis has as many
    features as the weight has rows."""
    from layerdiff.trace.schema import param_name, split_site

    conversions = SiteConversions(mapping, weight_shapes(ref))
    port_weights = port.index[port.index["role"] == Role.WEIGHT]
    by_site: dict[str, dict[str, str]] = {}
    for site, arg, shape in zip(port_weights["site"], port_weights["arg"],
                                port_weights["shape"], strict=True):
        by_site.setdefault(site, {}).setdefault(str(arg), shape)
    port_outputs = port.index[(port.index["role"] == Role.OUTPUT)
                              & (port.index["arg"] == "0") & (port.index["kind"] == "tensor")]
    output_shape = dict(zip(port_outputs["site"], port_outputs["shape"], strict=True))
    found: dict[str, DerivedPermutation] = {}
    for pair in sites.pairs:
        params = by_site.get(pair.port)
        if pair.reference in given or not params or pair.port not in output_shape:
            continue
        derived = conversions.find(
            pair.reference, split_site(pair.port)[0],
            {param_name(pair.port, arg): _shape(shape) for arg, shape in params.items()},
            (_shape(output_shape[pair.port]) or (0,))[-1])
        if isinstance(derived, DerivedPermutation):
            found[pair.reference] = derived
    return found


def derive_permutation(params: dict[str, tuple[int, ...]], ref_shapes: dict[str, Any],
                       mapping: Any, partner: dict[str, str], features: int,
                       seen: dict | None = None) -> DerivedPermutation | None:
    """The output permutation of one port layer (see :func:`derived_conversions`): its
    parameters by full name with their shapes, the reference's weights' shapes by name (text or
    tuples), its module's partner (port module -> reference module) and the number of features
    on its output's last axis; None where none is derived exactly. ``seen`` caches the
    permutation of each chain and shapes across layers."""
    from layerdiff.mapping import ParamSource

    seen = {} if seen is None else seen
    perms, functions = [], []
    for name, shape in params.items():
        source = mapping.param_source(name, partner) or ParamSource([name])
        if len(source.reference) != 1 or source.reshapes or source.reference[0] not in \
                ref_shapes:
            return None
        ref_shape = ref_shapes[source.reference[0]]
        shapes = (_shape(ref_shape) if isinstance(ref_shape, str) else tuple(ref_shape),
                  tuple(shape))
        key = (source.transforms, *shapes)
        if key not in seen:
            seen[key] = _row_permutation(source, *shapes, name)
        if seen[key] is None:
            return None
        perms.append(seen[key])
        functions += [f for f in source.functions if f not in functions]
    if not perms or not functions or any(p != perms[0] for p in perms):
        return None
    perm = perms[0]
    if perm == tuple(range(len(perm))) or features != len(perm):
        return None  # rows kept in place, or an output that is not the rows' features
    inverse = tuple(int(i) for i in np.argsort(np.asarray(perm)))
    return DerivedPermutation(inverse, tuple(functions), tuple(params))


def _shape(text: str) -> tuple[int, ...]:
    from layerdiff.trace.schema import parse_shape

    return tuple(parse_shape(text))


def _row_permutation(source: Any, ref_shape: tuple[int, ...], port_shape: tuple[int, ...],
                     name: str) -> tuple[int, ...] | None:
    """The permutation ``perm`` with ``chain(w) == w[perm]`` for every ``w`` of the
    reference's shape, or None when the chain is no permutation of rows (a transpose, a
    reshape across rows, arithmetic). Copies are the identity. Found by running the chain once
    on a tensor whose elements are their own flat indices (float64 holds them exactly)."""
    from layerdiff.weights import combine  # torch: a mapping names a function

    if not ref_shape or tuple(ref_shape) != tuple(port_shape):
        return None
    size = int(np.prod(ref_shape))
    if size == 0 or size >= 2 ** 53:
        return None
    index = np.arange(size, dtype=np.float64).reshape(ref_shape)
    try:
        made = np.asarray(combine(source, [index], port=name))
    except Exception:  # the chain refuses this: not for deriving (the diff's rows say why)
        return None
    if made.shape != tuple(ref_shape):
        return None
    rows = ref_shape[0]
    row_size = size // rows
    first = made.reshape(rows, -1)[:, 0]
    if not np.all(first == np.round(first)) or not np.all(first % row_size == 0):
        return None
    perm = (first // row_size).astype(np.int64)
    if sorted(perm.tolist()) != list(range(rows)) or not np.array_equal(made, index[perm]):
        return None
    return tuple(int(i) for i in perm)
