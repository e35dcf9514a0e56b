"""Likely-cause hints for origins: each origin's tensors, read back as the diff compared
them (:mod:`layerdiff.compare.pair`), with the reference's tensors around it, and what they
suggest (:func:`layerdiff.compare.hints.hint`)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from layerdiff.compare import hints
from layerdiff.compare import result as R
from layerdiff.compare.hints.positions import mask_shaped
from layerdiff.compare.pair import PairReader, origin_row
from layerdiff.errors import TraceError
from layerdiff.trace import Trace, schema
from layerdiff.trace.schema import CALL_ROLES, PARAM_ROLES, Pass, Role

# An origin whose tensor is larger is examined on its first batch elements only (as many as
# fit); a weight larger than this gets no hint. 2^20 float64 values are 8 MiB per copy, and a
# hint makes a few dozen passes over them.
HINT_MAX_ELEMENTS = 1 << 20
# A replay judges every site on its own and can name hundreds of origins: the first ones (in
# the order the diff lists them) get hints, a bounded cost.
HINT_MAX_ORIGINS = 32


def attach_hints(origins: list[R.Origin], reader: PairReader, *,
                 max_elements: int = HINT_MAX_ELEMENTS,
                 max_origins: int = HINT_MAX_ORIGINS) -> None:
    """Set each origin's ``hint``: the kind of porting mistake its error looks like, with the
    numbers (see :mod:`layerdiff.compare.hints`), or None when nothing matches, when the traces
    hold no tensor data there (summary traces) or past the first ``max_origins``. The
    origin's tensors come from ``reader`` as the diff compared them (sliced, transposed, the
    port's gradients at the reference's loss scale)."""
    if reader.ref.summary or reader.port.summary:
        return
    full = _full_precision(reader.port)
    for origin in origins[:max_origins]:
        try:
            with np.errstate(all="ignore"):  # -inf from a mask in the inputs: no warnings
                found = _hint(origin, reader, max_elements, full)
        except (TraceError, ValueError, np.linalg.LinAlgError):
            # a record that cannot be read, or tensors no model fits the shapes of: a hint is
            # a help, never a reason for the diff to fail
            found = None
        origin.hint = None if found is None else found.as_json()


def _full_precision(port: Trace) -> str:
    """The port's dtype when it runs in full precision: captured without a lower --dtype or an
    autocast, and at least 90% of its floating-point records float32 or float64 ('' when
    not). A lower dtype found at one of its records is then that record's (a table or a
    constant cast), not the port's."""
    meta = port.meta
    if meta.get("autocast") or str(meta.get("dtype") or "") in ("bfloat16", "float16", "half"):
        return ""
    dtypes = port.index["dtype"].astype(str)
    floats = dtypes[dtypes.str.contains("float")]
    if len(floats) == 0 or float(floats.isin(["float32", "float64"]).mean()) < 0.9:
        return ""
    return str(floats.mode().iloc[0])


def _hint(origin: R.Origin, reader: PairReader, max_elements: int,
          full_precision: str = "") -> hints.Hint | None:
    row = origin_row(origin)
    ref_row, port_row = reader.records(row)
    if ref_row is None or port_row is None or min(int(ref_row["segment"]),
                                                  int(port_row["segment"])) < 0:
        return None
    ref, port = reader.ref, reader.port
    # compared element by element: checked by digest alone where the sealed index vouches
    ref_values, port_values = reader.read(row, stored=True, compared=True)
    where = f"at {origin.site}" + ("" if origin.arg in ("", "0") else f" '{origin.arg}'")
    found = _hint_at(origin, ref, ref_values, port_values, ref_row, max_elements,
                     full_precision=full_precision, where=where)
    if found is not None or origin.role != Role.OUTPUT or origin.pass_ != Pass.FORWARD:
        return found
    inner = _own_code_record(origin, ref, port, max_elements)
    if inner is not None:
        # the first value the site's own code made wrong, before its later children
        # reshaped it
        child, ref_values, port_values = inner
        found = _hint_at(origin, ref, ref_values, port_values, ref_row, max_elements,
                         children_only=True, full_precision=full_precision,
                         where="there")
        if found is not None:
            return hints.Hint(found.kind, f"at {child} (the first value the site's own code "
                              f"makes that is out): {found.evidence}")
    return _tables(origin, ref, port)


def _relative(site: str, child: str) -> str:
    """The child's module path below the site's ('mlp.down_proj' under 'mlp': 'down_proj')."""
    parent, module = schema.split_site(site)[0], schema.split_site(child)[0]
    if parent != schema.ROOT_MODULE and module.startswith(parent + "."):
        return module[len(parent) + 1:]
    return module


def _own_code_record(origin: R.Origin, ref: Trace, port: Trace, max_elements: int
                     ) -> tuple[str, np.ndarray, np.ndarray] | None:
    """(child, reference, port) for the first child of the origin's site, in call order, whose
    input is out of the origin's tolerance while the site's own output is the origin: the
    site's own code between its children made it. Port children are found by the same name
    under the port's site (a mapping that renames children leaves this out)."""
    rtol = float(origin.metrics.get("rtol") or 0.0)
    atol = float(origin.metrics.get("atol") or 0.0)
    sites = ref.sites
    rows = sites[(sites["step"] == origin.step) & (sites["parent"] == origin.site)]
    if rows.empty or len(rows) > MAX_CHILDREN:
        return None
    ref_module = schema.split_site(origin.site)[0]
    port_module = schema.split_site(origin.port_site or origin.site)[0]
    for child in rows.sort_values("enter_seq")["site"]:
        module, call = schema.split_site(child)
        if schema.is_op_site(child):
            continue
        suffix = module if ref_module == schema.ROOT_MODULE else module[len(ref_module) + 1:]
        if ref_module != schema.ROOT_MODULE and not module.startswith(ref_module + "."):
            continue
        port_child = (suffix if port_module == schema.ROOT_MODULE
                      else f"{port_module}.{suffix}") + f"#{call}"
        # its first input, then any other floating-point one (a table the site's code made)
        recorded = ref.records(origin.step, child, Role.INPUT, kind="tensor")
        args = ["0", *(str(arg) for arg, dtype in zip(recorded["arg"], recorded["dtype"],
                                                      strict=True)
                       if str(arg) != "0" and str(dtype).startswith(("float", "bfloat")))]
        for arg in args:
            ref_row = _tensor_row(ref, origin.step, child, Role.INPUT, arg)
            port_row = _tensor_row(port, origin.step, port_child, Role.INPUT, arg)
            if ref_row is None or port_row is None or int(ref_row["numel"]) > max_elements:
                continue
            a = np.asarray(ref.read(ref_row), np.float64)
            b = np.asarray(port.read(port_row), np.float64)
            if a.shape != b.shape:
                continue
            if np.any(np.abs(b - a) > atol + rtol * np.abs(a)):
                return suffix + "'s input" + ("" if arg == "0" else f" '{arg}'"), a, b
    return None


def _hint_at(origin: R.Origin, ref: Trace, ref_values: np.ndarray, port_values: np.ndarray,
             ref_row: pd.Series, max_elements: int, children_only: bool = False,
             full_precision: str = "", where: str = "") -> hints.Hint | None:
    step, role = origin.step, origin.role
    port_values = _as_compared(ref_values, port_values, None if children_only
                               else origin.metrics.get("max_abs"))
    if port_values is None:
        return None
    keep = _batch_kept(ref_values, role, max_elements)
    if keep == 0:
        return None
    batch = ref_values.shape[0] if ref_values.ndim else 0

    def cut(values: np.ndarray) -> np.ndarray:
        return values[:keep] if values.ndim and values.shape[0] == batch else values

    params = role in PARAM_ROLES
    inputs = {} if params else _site_tensors(ref, step, origin.site, Role.INPUT, max_elements)
    weights = _module_weights(ref, step, origin.site, max_elements)
    grad_output = None
    if role == Role.GRAD_INPUT:
        grads = _site_tensors(ref, step, origin.site, Role.GRAD_OUTPUT, max_elements)
        grad_output = cut(grads["0"]) if "0" in grads else None
    attention = (_attention_parts(ref, step, origin.site, ref_row, max_elements)
                 if role == Role.OUTPUT and origin.pass_ == Pass.FORWARD and not children_only
                 else None)
    if attention is not None:
        attention = hints.Attention(
            cut(attention.q), cut(attention.k), cut(attention.v), cut(attention.context),
            attention.out_weight, attention.out_bias,
            None if attention.mask is None else cut(attention.mask), attention.output_heads)
    children = (_children(ref, step, origin.site, max_elements, cut)
                if role == Role.OUTPUT and origin.pass_ == Pass.FORWARD else [])
    rtol, atol = origin.metrics.get("rtol"), origin.metrics.get("atol")
    return hints.hint(cut(ref_values), cut(port_values), role=role,
                      rtol=float(rtol or 0.0), atol=float(atol or 0.0),
                      inputs={k: cut(v) for k, v in inputs.items()}, weights=weights,
                      grad_output=grad_output, attention=attention, children=children,
                      full_precision=full_precision, where=where)


MAX_CHILDREN = 16      # a module with more sub-modules than this is not looked inside


def _children(trace: Trace, step: int, site: str, max_elements: int, cut) -> list[hints.Child]:
    """What the site's sub-modules recorded (first input, first output, weight and bias), in
    call order: the pieces a hint may rebuild the site's own code from."""
    sites = trace.sites
    rows = sites[(sites["step"] == step) & (sites["parent"] == site)].sort_values("enter_seq")
    if len(rows) > MAX_CHILDREN:
        return []
    out = []
    for child in rows["site"]:
        tensors = []
        for role in CALL_ROLES:
            row = _tensor_row(trace, step, child, role, "0")
            small = row is not None and int(row["numel"]) <= max_elements
            tensors.append(cut(trace.read(row)) if small else None)
        params = []
        for arg in ("weight", "bias"):
            row = _module_param(trace, step, child, arg)
            small = row is not None and int(row["numel"]) <= max_elements
            params.append(np.asarray(trace.read(row)) if small else None)
        out.append(hints.Child(_relative(site, child), *tensors, *params))
    return out


def _as_compared(ref_values: np.ndarray, port_values: np.ndarray,
                 max_abs: float | None) -> np.ndarray | None:
    """The port's tensor as the diff compared it with the reference's: as read, or
    transposed, whichever gives the diff's own largest difference; None when neither does (a
    row read by its names whose parameter the mapping transforms otherwise, say through a
    conversion): a hint of the stored tensors would describe the mapping's layout, not the
    port's mistake."""
    candidates = [port_values] if port_values.shape == ref_values.shape else []
    if port_values.ndim == 2 and port_values.shape[::-1] == ref_values.shape:
        candidates.append(port_values.T)
    if max_abs is None or not np.isfinite(max_abs):
        return candidates[0] if candidates else None
    for values in candidates:
        with np.errstate(all="ignore"):
            gap = float(np.max(np.abs(np.asarray(values, np.float64) - ref_values), initial=0.0))
        if abs(gap - max_abs) <= 1e-3 * max(gap, max_abs) + 1e-30:
            return values
    return None


def _batch_kept(values: np.ndarray, role: str, max_elements: int) -> int:
    """How many leading batch elements a hint examines (all when small enough; 0: none)."""
    if values.size <= max_elements:
        return values.shape[0] if values.ndim else 1
    if role in PARAM_ROLES or values.ndim < 2:
        return 0
    per_element = values.size // values.shape[0]
    return max_elements // per_element


def _tensor_row(trace: Trace, step: int, site: str, role: str, arg: str) -> pd.Series | None:
    """The record of one tensor with data; a parameter compared through a mapping is named by
    its full name (``module.param``), whichever call recorded it."""
    row = trace.find(step, site, role, arg, kind="tensor")
    if row is None and role in PARAM_ROLES:
        rows = trace.records(step, role=role, kind="tensor")
        named = [i for i, (s, a) in enumerate(zip(rows["site"], rows["arg"], strict=True))
                 if schema.param_name(s, a) == arg]
        row = rows.iloc[named[0]] if named else None
    return None if row is None or int(row["segment"]) < 0 else row


def _site_tensors(trace: Trace, step: int, site: str, role: str,
                  max_elements: int) -> dict[str, np.ndarray]:
    rows = trace.records(step, site, role, kind="tensor")
    return {str(row["arg"]): trace.read(row) for _, row in rows.iterrows()
            if int(row["segment"]) >= 0 and int(row["numel"]) <= max_elements}


def _module_weights(trace: Trace, step: int, site: str,
                    max_elements: int) -> dict[str, np.ndarray]:
    """The site's own parameters, as whichever call of its module recorded them."""
    weights: dict[str, np.ndarray] = {}
    for _, row in _module_params(trace, step, site).iterrows():
        if row["arg"] not in weights and int(row["numel"]) <= max_elements:
            weights[str(row["arg"])] = trace.read(row)
    return weights


def _module_params(trace: Trace, step: int, site: str) -> pd.DataFrame:
    """The weight records, with data, of the module ``site`` is a call of (any call)."""
    rows = trace.records(step, role=Role.WEIGHT, kind="tensor")
    module = schema.split_site(site)[0]
    same = [schema.split_site(s)[0] == module for s in rows["site"]]
    rows = rows[np.asarray(same, dtype=bool)] if len(rows) else rows
    return rows[rows["segment"] >= 0]


def _module_param(trace: Trace, step: int, site: str, arg: str) -> pd.Series | None:
    rows = _module_params(trace, step, site)
    rows = rows[rows["arg"] == arg]
    return None if rows.empty else rows.iloc[0]


def _attention_parts(trace: Trace, step: int, site: str, output_row: pd.Series,
                     max_elements: int) -> hints.Attention | None:
    """The reference's q, k, v and context at ``site`` when it is attention: a module built
    as attention usually is (see :func:`_projected_attention`), or else a kernel whose inputs
    are q, k and v and whose output is the context."""
    inputs = trace.records(step, site, Role.INPUT, kind="tensor")
    floats = [row for _, row in inputs.iterrows()
              if str(row["dtype"]).startswith(("float", "bfloat")) and int(row["segment"]) >= 0]
    masks = [row for _, row in inputs.iterrows()
             if not str(row["dtype"]).startswith(("float", "bfloat", "complex"))
             and int(row["segment"]) >= 0]
    # boolean or 0/1 only: position ids (HF attention takes them beside its mask) are none
    mask = next((values for values, row in ((trace.read(row), row) for row in masks)
                 if mask_shaped(str(row["arg"]), values)), None)
    projected = _projected_attention(trace, step, site, output_row, max_elements, mask)
    if projected is not None:
        return projected
    out_shape = schema.parse_shape(output_row["shape"])
    if len(floats) >= 3:
        shapes = [schema.parse_shape(row["shape"]) for row in floats[:3]]
        if _kernel_shapes(*shapes, out_shape) and all(
                int(row["numel"]) <= max_elements for row in floats[:3]):
            q, k, v = (trace.read(row) for row in floats[:3])
            context = trace.read(output_row)
            heads = None
            if q.ndim == 4:  # heads apart, (batch, heads, length, d): merged, and split back
                heads = q.shape[1]
                q, k, v, context = (_merge_heads(a) for a in (q, k, v, context))
            return hints.Attention(q, k, v, context, mask=mask, output_heads=heads)
    return None


def _kernel_shapes(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...],
                   out: tuple[int, ...]) -> bool:
    """q (b, [h,] Lq, d), k (b, [h,] Lk, d), v (b, [h,] Lk, dv) -> out (b, [h,] Lq, dv)."""
    if not (len(q) == len(k) == len(v) == len(out) and len(q) in (3, 4)):
        return False
    lead = q[:-2]
    return (k[:-2] == lead and v[:-2] == lead and out[:-2] == lead and q[-1] == k[-1]
            and k[-2] == v[-2] and out[-2] == q[-2] and out[-1] == v[-1])


def _merge_heads(values: np.ndarray) -> np.ndarray:
    batch, heads, length, width = values.shape
    return values.transpose(0, 2, 1, 3).reshape(batch, length, heads * width)


def _projected_attention(trace: Trace, step: int, site: str, output_row: pd.Series,
                         max_elements: int, mask: np.ndarray | None) -> hints.Attention | None:
    """Sub-modules with matrix weights project q, k, v (three, one fused, or q and a fused
    k-v), and the last one, the output projection, gives the site's output."""
    sites = trace.sites
    children = sites[(sites["step"] == step) & (sites["parent"] == site)].sort_values(
        "enter_seq")
    linear = []
    for child in children["site"]:
        weight = _module_param(trace, step, child, "weight")
        if weight is not None and len(schema.parse_shape(weight["shape"])) == 2:
            linear.append((child, weight))
    if len(linear) < 2:
        return None
    out_site, out_weight = linear[-1]
    out = _tensor_row(trace, step, out_site, Role.OUTPUT, "0")
    context = _tensor_row(trace, step, out_site, Role.INPUT, "0")
    if out is None or context is None or not output_row["digest"] \
            or out["digest"] != output_row["digest"]:
        return None  # the last projection's output is not the site's: not this structure
    projected = [_tensor_row(trace, step, child, Role.OUTPUT, "0") for child, _ in linear[:-1]]
    if any(p is None or int(p["numel"]) > max_elements for p in projected):
        return None
    values = [trace.read(p) for p in projected]
    if len(values) == 1 and values[0].shape[-1] % 3 == 0:
        q, k, v = np.split(values[0], 3, axis=-1)
    elif len(values) == 2 and values[1].shape[-1] % 2 == 0:
        q, (k, v) = values[0], np.split(values[1], 2, axis=-1)
    elif len(values) == 3:
        q, k, v = values
    else:
        return None
    bias = _module_param(trace, step, out_site, "bias")
    return hints.Attention(q, k, v, trace.read(context), trace.read(out_weight),
                           None if bias is None else trace.read(bias), mask)


# ---- rotary tables made by the site's own code

TABLE_VALUES = 1 << 16  # a rotary table larger than this is not looked for
ROTATION = 2e-2         # cos^2 + sin^2 = 1 to this (a bfloat16 table's is about 8e-3 off)


def _tables(origin: R.Origin, ref: Trace, port: Trace) -> hints.Hint | None:
    """At an origin whose own code is at fault and no value it makes tells how: the rotary
    tables inside it, when both sides record them (as a module's output or a layer's input).
    Both are rotations (cos^2 + sin^2 = 1, column by column a frequency); a port whose angles
    differ from the reference's made its rotation otherwise (another base, the sine's sign).
    The tables' layouts may differ (Meta's (L, d/2), Hugging Face's (L, d)): compared by
    frequency, not element by element."""
    found = []
    for trace, site in ((ref, origin.site), (port, origin.port_site or origin.site)):
        table = _rotation_table(trace, origin.step, schema.split_site(site)[0])
        if table is None:
            return None
        found.append(table)
    (ref_where, theta_ref, ref_bits), (port_where, theta_port, port_bits) = found
    length = min(theta_ref.shape[0], theta_port.shape[0])  # a table made for longer inputs
    theta_ref, theta_port = theta_ref[:length], theta_port[:length]
    if theta_ref.shape != theta_port.shape or length < 2:
        return None
    gap = np.abs(np.angle(np.exp(1j * (theta_port - theta_ref))))
    # tables held in a lower dtype turn each angle by up to about 2^-bits: no evidence
    bits = min(b for b in (ref_bits, port_bits, 24) if b)
    if float(gap.max()) <= max(1e-4, 4 * 2.0**-bits):
        return None  # the same rotation (up to rounding): the fault is elsewhere
    worst = np.unravel_index(int(np.argmax(gap)), gap.shape)
    size = float(np.max(np.abs(theta_ref)))
    if float(np.max(np.abs(np.angle(np.exp(1j * (theta_port + theta_ref)))))) <= 1e-4 * max(
            size, 1.0):
        what = "the port's angles are the reference's negated: the rotation's sine negated"
    else:
        bases = [_base(theta) for theta in (theta_ref, theta_port)]
        what = ("the port's frequency base is {1:.4g} where the reference's is {0:.4g}"
                .format(*bases) if all(bases) and abs(bases[1] / bases[0] - 1) > 1e-3 else
                "other frequencies or positions")
    return hints.Hint(hints.Kind.ROTARY, f"the rotary tables inside the site differ: "
                      f"the port's ({port_where}) and the reference's ({ref_where}) are both "
                      f"rotations (cos^2 + sin^2 = 1) whose angles differ, by up to "
                      f"{float(gap.max()):.2g} rad (position {int(worst[0])}): {what}")


def _base(theta: np.ndarray) -> float | None:
    """The base of a table's frequencies base^(-2j/d), j < d/2, from the angle of the
    second one at position 1."""
    half = theta.shape[1]
    if half < 2 or not 0 < theta[1, 1] < 1:
        return None
    return float(theta[1, 1] ** (-half))


def _significant_bits(values: np.ndarray) -> int | None:
    """8 or 11 when every value is a bfloat16 or float16 number, else None."""
    for bits in (8, 11):
        mantissa, exponent = np.frexp(values)
        if np.array_equal(np.ldexp(np.round(mantissa * 2.0**bits) / 2.0**bits, exponent),
                          values):
            return bits
    return None


def _rotation_table(trace: Trace, step: int, module: str
                    ) -> tuple[str, np.ndarray, int | None] | None:
    """(where, angles (positions, frequencies)) of the first two records of one call and role
    inside ``module``, of one shape (..., L, w), with cos^2 + sin^2 = 1; columns repeated in
    halves (Hugging Face's cat(freqs, freqs)) or in pairs are taken once."""
    rows = trace.records(step, pass_=Pass.FORWARD, kind="tensor")
    rows = rows[(rows["segment"] >= 0) & (rows["numel"] <= TABLE_VALUES)
                & (rows["numel"] >= 8)
                & rows["dtype"].astype(str).str.startswith(("float", "bfloat")).to_numpy()]
    if module != schema.ROOT_MODULE:
        inside = [schema.split_site(s)[0] == module or schema.split_site(s)[0].startswith(
            module + ".") for s in rows["site"]]
        rows = rows[np.asarray(inside, dtype=bool)] if len(rows) else rows
    for (site, role), group in rows.groupby(["site", "role"], sort=False):
        group = group.sort_values("seq")
        listed = list(group.iterrows())
        for i, (_, first) in enumerate(listed):
            for _, second in listed[i + 1:i + 2]:
                if first["shape"] != second["shape"]:
                    continue
                shape = schema.parse_shape(first["shape"])
                if len(shape) < 2 or shape[-2] < 2:
                    continue
                cos = np.asarray(trace.read(first), np.float64)
                sin = np.asarray(trace.read(second), np.float64)
                if not np.allclose(cos * cos + sin * sin, 1.0, atol=ROTATION, rtol=0):
                    continue
                theta = np.arctan2(sin, cos).reshape(-1, *shape[-2:])[0]
                width = theta.shape[1]
                if width % 2 == 0 and np.allclose(theta[:, : width // 2], theta[:, width // 2:]):
                    theta = theta[:, : width // 2]
                elif width % 2 == 0 and np.allclose(theta[:, 0::2], theta[:, 1::2]):
                    theta = theta[:, 0::2]
                args = f"'{first['arg']}', '{second['arg']}'"
                bits = _significant_bits(np.concatenate([cos.ravel(), sin.ravel()]))
                return f"{site} {role} {args}", theta, bits
    return None
