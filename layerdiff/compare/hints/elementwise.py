"""Kinds where the port's value at each element is the reference's, changed element by element:
``sign`` (-ref), ``scale`` (c ref), ``missing-term`` (ref minus an input, a bias or the incoming
gradient), ``approximation`` (ref plus a small smooth function of the input) and ``precision``
(the reference's value rounded to a lower dtype)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from layerdiff.trace.schema import RESULT_ROLES, Role

from ._common import Hint, Judge, Kind, Site, left_text, named

SMALL = 0.05           # approximation: the error is at most this fraction of the output's rms
LOWER = (("bfloat16", 8), ("float16", 11))  # name, bits of significand (the leading 1 with them)


# ---------------------------------------------------------------------------------------------
# Kinds with at most one fitted number


def _sign_hint(left: float) -> Hint:
    return Hint(Kind.SIGN, f"a sign flipped: port = -1 x reference ({left_text(left)})")


def sign(judge: Judge, site: Site) -> Hint | None:
    left = judge.accepts(-judge.ref)
    return None if left is None else _sign_hint(left)


def scale(judge: Judge, site: Site) -> Hint | None:
    norm = float(np.sum(judge.ref**2))
    if norm == 0:
        return None
    c = float(np.sum(judge.ref * judge.port)) / norm
    left = judge.accepts(c * judge.ref)
    if left is None:
        return None
    if abs(c + 1) < 1e-3:
        return _sign_hint(left)
    if abs(c) < 1e-3:
        return Hint(Kind.SCALE, f"port = {c:.2g} x reference: the port's values are all about "
                    f"zero, a path cut off or never written ({left_text(left)})")
    return Hint(Kind.SCALE, f"port = {c:.4g}{named(c)} x reference ({left_text(left)})")


def missing_term(judge: Judge, site: Site) -> Hint | None:
    shape = judge.ref.shape
    for name, term in _terms(site, shape):
        norm = float(np.sum(term**2))
        if norm == 0:
            continue
        alpha = float(np.sum((judge.ref - judge.port) * term)) / norm
        for direction, text in ((1.0, "reference - {}: a term left out"),
                                (-1.0, "reference + {}: a term added twice")):
            if abs(alpha - direction) > 0.02:
                continue
            left = judge.accepts(judge.ref - direction * term)
            if left is not None:
                return Hint(Kind.MISSING_TERM, f"port = {text.format(name)} ({left_text(left)})")
    return None


def _terms(site: Site, shape: tuple[int, ...]) -> Iterator[tuple[str, np.ndarray]]:
    """What a port may leave out: an input of the output's shape (a residual), a bias along
    the axis its length matches, and backward, the incoming gradient (a skip path)."""
    if not site.backward:
        for name, value in site.float_inputs():
            if value.shape == shape:
                yield f"input '{name}'", value
        for child in site.children:  # a residual stream as the site's sub-modules saw it
            for what, value in (("input", child.input), ("output", child.output)):
                if value is not None and value.shape == shape:
                    yield f"the {what} of {child.name}", np.asarray(value, np.float64)
    elif site.grad_output is not None and np.shape(site.grad_output) == shape:
        yield "grad_output", np.asarray(site.grad_output, np.float64)
    if site.role != Role.OUTPUT:
        return
    for name, value in site.weights.items():
        value = np.asarray(value, np.float64)
        if value.ndim != 1 or not shape or not name.endswith("bias"):
            continue
        for axis in (len(shape) - 1, 1):  # a Linear's features are last, a conv's channels 1
            if axis < len(shape) and shape[axis] == value.size:
                view = [1] * len(shape)
                view[axis] = value.size
                yield f"the bias '{name}'", np.broadcast_to(value.reshape(view), shape)
                break


# ---------------------------------------------------------------------------------------------
# A smooth approximation of an element-wise function


def approximation(judge: Judge, site: Site) -> Hint | None:
    """Forward: error = s(x); backward: error = grad_output s(x), with s a cubic spline in the
    input with at most 64 coefficients (a fit with one free number per 16 values removes
    about 1/16 of a random error's energy, far from the 99% asked)."""
    shape = judge.ref.shape
    x = site.elementwise_input(shape) if site.role in RESULT_ROLES else None
    if x is None:
        return None
    error = judge.error.ravel()
    if _rms(error) > SMALL * _rms(judge.ref):
        return None
    weight = None
    if site.backward:
        if site.grad_output is None or np.shape(site.grad_output) != shape:
            return None
        weight = np.asarray(site.grad_output, np.float64).ravel()
    knots = min(64, error.size // 16)  # too few to follow noise: 1 per 16 values at most
    if knots < 8:
        return None
    smooth = _spline_fit(x.ravel(), error, knots, weight)
    if smooth is None:
        return None
    left = judge.accepts(judge.ref + smooth.reshape(shape))
    if left is None:
        return None
    worst = int(np.argmax(np.abs(error)))
    what = "error / grad_output" if site.backward else "the error"
    size = _rms(error) / _rms(judge.ref)
    return Hint(Kind.APPROXIMATION, f"another approximation of the same function: {what} is "
                f"a smooth function of the input (a {knots}-term spline {left_text(left)}), at "
                f"most {abs(error[worst]):.2g} (near input {x.ravel()[worst]:.3g}), {size:.1g} "
                "of the output's rms")


def _spline_fit(x: np.ndarray, y: np.ndarray, count: int,
                weight: np.ndarray | None) -> np.ndarray | None:
    """Least-squares y ~ w s(x), s a cubic B-spline with ``count`` coefficients on uniform
    knots over the central 99.8% of x (values beyond follow the end pieces)."""
    low, high = np.quantile(x, [0.001, 0.999])
    pieces = count - 3
    if not high > low or pieces < 1:
        return None
    t = (x - low) / ((high - low) / pieces)
    i = np.clip(np.floor(t).astype(np.int64), 0, pieces - 1)
    u = t - i
    w = np.ones_like(x) if weight is None else weight
    basis = [w * (1 - u) ** 3 / 6, w * (3 * u**3 - 6 * u**2 + 4) / 6,
             w * (-3 * u**3 + 3 * u**2 + 3 * u + 1) / 6, w * u**3 / 6]
    normal = np.zeros(count * count)
    rhs = np.zeros(count)
    for a in range(4):
        rhs += np.bincount(i + a, basis[a] * y, count)
        for b in range(4):
            normal += np.bincount((i + a) * count + i + b, basis[a] * basis[b], count * count)
    normal = normal.reshape(count, count)
    coef = np.linalg.lstsq(normal, rhs, rcond=None)[0]
    return sum(basis[a] * coef[i + a] for a in range(4))


# ---------------------------------------------------------------------------------------------
# Precision


def precision(judge: Judge, site: Site) -> Hint | None:
    """Nearly all the port's values are numbers of a lower dtype while the reference's are
    not, and its error is the size a few roundings to that dtype make. (An error of that size
    alone is no evidence: random noise of the same size has it too.)"""
    ref, error = judge.ref, judge.error
    for name, bits in LOWER:
        if not _mostly_representable(judge.port, bits, 0.99):
            continue  # the common case, a float32 error: decided on the first values
        port_in, ref_in = _representable(judge.port, bits), _representable(ref, bits)
        if port_in < 0.99 or ref_in >= 0.5:
            continue
        k = _rms(error) / max(_rms(_rounding(ref, bits)), 1e-300)
        if not 0.1 <= k <= 16:
            continue
        numbers = (f"{port_in:.0%} of the port's values are {name} numbers ({ref_in:.0%} of "
                   f"the reference's), its error {k:.2g}x what rounding the reference to "
                   f"{name} makes")
        if site.full_precision:
            # the port's records are float32 (or wider) everywhere else: this one tensor was
            # rounded, not the port's arithmetic
            where = f" {site.where}" if site.where else " here"
            return Hint(Kind.PRECISION, f"values{where} are rounded to {name} inside a "
                        f"{site.full_precision} port (a table, a constant or one layer cast to "
                        f"{name}?): " + numbers)
        return Hint(Kind.PRECISION, f"computed in {name}: " + numbers)
    return None


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values))))


def _rounding(values: np.ndarray, bits: int) -> np.ndarray:
    """What rounding to ``bits`` significant bits (round to nearest) changes."""
    mantissa, exponent = np.frexp(values)
    rounded = np.ldexp(np.round(mantissa * 2.0**bits) / 2.0**bits, exponent)
    return rounded - values


# Values looked at before the whole tensor: enough that a float32 tensor's share of values
# that are no lower-dtype numbers (nearly all) decides at once.
FIRST_VALUES = 1 << 14


def _mostly_representable(values: np.ndarray, bits: int, share: float) -> bool:
    """Whether ``_representable(values, bits) >= share`` could hold: False as soon as the
    first FIRST_VALUES values hold too many that are not such numbers (the whole tensor holds at
    least those); else the whole test. The same answer, without rounding 2^20 values twice."""
    flat = np.asarray(values, np.float64).ravel()
    first = flat[:FIRST_VALUES]
    first = first[first != 0]
    count = int(np.count_nonzero(flat))
    if count == 0:
        return share <= 0.0
    missed = int(np.count_nonzero(_rounding(first, bits) != 0))
    # at most count - missed of the nonzero values are representable; the share is the
    # rounded quotient, which cannot rise as its numerator falls
    if (count - missed) / count < share:
        return False
    return _representable(flat, bits) >= share


def _representable(values: np.ndarray, bits: int) -> float:
    """The fraction of the nonzero values that have at most ``bits`` significant bits."""
    values = np.asarray(values, np.float64).ravel()
    values = values[values != 0]
    if values.size == 0:
        return 0.0
    return float(np.mean(_rounding(values, bits) == 0))
