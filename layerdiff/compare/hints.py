"""Likely-cause hints: what kind of porting mistake makes an origin's error look like it does.

Pure numpy. Each kind is a model of the port's tensor built from the reference's own tensors at
the origin (its output, inputs, weights, incoming gradient), with at most a few fitted numbers.
A model is accepted only when both hold (see :class:`_Judge`):

- it removes at least 99% of the error energy: ``|port - model|^2 <= 0.01 |port - ref|^2``;
- what it leaves is noise at the tolerance's scale: ``|port - model| <= 4 (atol + rtol |ref|)``
  element by element (4: the fitted numbers and a float64 recomputation of the port's float32
  arithmetic have errors of their own).

Models with structure of their own (a linear layer, a softmax, attention, a normalization) are
first checked to reproduce the *reference* from the same tensors; only then is a variant of it
fitted to the port. Where no model passes, there is no hint: a random error gets none.

The kinds are tried in a fixed order, from the models with the fewest free numbers to the
structural descriptions (which positions or batch elements are wrong) and, last, precision.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from enum import StrEnum

import numpy as np


class Kind(StrEnum):
    """The kinds of porting mistake a hint names."""

    SCALE = "scale"                  # port = c ref for one constant c
    TRANSPOSE = "transpose"          # axes swapped, a weight applied transposed, reshape vs view
    AXIS = "axis"                    # a softmax (or attention's softmax) over another axis
    EPSILON = "epsilon"              # a normalization's epsilon: error where variance is small
    MASK = "mask"                    # error only at a structured set of positions
    BATCH = "batch"                  # error only in some batch elements
    PRECISION = "precision"          # error at the level of a lower dtype's rounding
    APPROXIMATION = "approximation"  # a small error that is a smooth function of the input
    MISSING_TERM = "missing-term"    # port = ref - an input or a bias
    PERMUTATION = "permutation"      # chunks of one axis reordered (gates, heads)
    SIGN = "sign"                    # port = -ref


@dataclass(frozen=True)
class Hint:
    kind: Kind
    evidence: str                    # one sentence, with the numbers

    def as_json(self) -> dict[str, str]:
        return {"kind": str(self.kind), "evidence": self.evidence}


@dataclass
class Attention:
    """The reference's own pieces of an attention site: a kernel's inputs, or what its
    sub-modules recorded.

    ``q`` (batch, Lq, D), ``k`` (batch, Lk, D) and ``v`` (batch, Lk, Dv) are the projections
    with heads not yet split; ``context`` (batch, Lq, Dv) is what went into the output
    projection (``out_weight`` (Dout, Dv), ``out_bias``), whose output is the site's; without
    one, the context is the site's output. ``mask``, when the site took one, is as recorded
    (bool or integer; which value means "attend" is found by reproducing the reference)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    context: np.ndarray
    out_weight: np.ndarray | None = None
    out_bias: np.ndarray | None = None
    mask: np.ndarray | None = None
    # a kernel whose output keeps heads apart, (batch, heads, Lq, d): their number (the
    # context above is then the output with heads merged)
    output_heads: int | None = None


EXPLAINED = 0.99       # the fraction of the error energy a model must remove
NOISE = 4.0            # what it leaves: at most this many tolerances, element by element
VERIFY = 1e-4          # a structural model must reproduce the reference to this relative rms
SMALL = 0.05           # approximation: the error is at most this fraction of the output's rms
MAX_PERMUTED_CHUNKS = 64
MIN_VALUES = 8         # fewer values than this: no hint
SCORES = 1 << 18       # attention recomputed on as many batch elements as keep scores below
CHANCE = 1e-6          # a pattern of where the error is must be this unlikely by chance


def hint(ref: np.ndarray, port: np.ndarray, *, role: str, rtol: float, atol: float,
         inputs: dict[str, np.ndarray] | None = None,
         weights: dict[str, np.ndarray] | None = None,
         grad_output: np.ndarray | None = None,
         attention: Attention | None = None) -> Hint | None:
    """The likely cause of the difference between ``ref`` and ``port`` at an origin, or None.

    ``role`` is the origin's (output, grad_input, weight_grad, weight); ``rtol`` and ``atol``
    its tolerance. The reference's tensors of the same site make more kinds testable:
    ``inputs`` (argument -> tensor, masks included), ``weights`` (parameter -> tensor),
    ``grad_output`` (for a backward origin) and ``attention`` (see :class:`Attention`).
    """
    if np.asarray(ref).dtype == bool and np.asarray(port).dtype == bool:
        return _boolean(np.asarray(ref), np.asarray(port))
    ref = np.asarray(ref, dtype=np.float64)
    port64 = np.asarray(port, dtype=np.float64)
    if ref.shape != port64.shape or ref.size < MIN_VALUES:
        return None  # a scalar (a loss) fits any one-number model: no evidence either way
    if not (np.isfinite(ref).all() and np.isfinite(port64).all()):
        return None  # a NaN origin: where the first non-finite came from is another question
    judge = _Judge(ref, port64, rtol, atol)
    if judge.energy == 0:
        return None
    site = _Site(role, inputs or {}, weights or {}, grad_output, attention)
    for test in _TESTS:
        found = test(judge, site)
        if found is not None:
            return found
    return None


def _boolean(ref: np.ndarray, port: np.ndarray) -> Hint | None:
    """Two boolean tensors (masks, as buffers or inputs) that differ: how."""
    if ref.shape != port.shape or np.array_equal(ref, port):
        return None
    differ = int(np.sum(ref != port))
    if np.array_equal(port, ~ref):
        return Hint(Kind.MASK, "the port's mask is the reference's inverted")
    if ref.ndim >= 2:
        ref_diagonal, port_diagonal = _triangle(ref), _triangle(port)
        if ref_diagonal is not None and port_diagonal is not None:
            side, ref_k = ref_diagonal
            return Hint(Kind.MASK, f"the port's mask is {port_diagonal[0]}(diagonal="
                        f"{port_diagonal[1]}) where the reference's is {side}(diagonal={ref_k})"
                        f": a causal mask off by {abs(port_diagonal[1] - ref_k)}")
        for shift in (1, -1):
            if np.array_equal(port, _shift(ref, shift)):
                return Hint(Kind.MASK, f"the port's mask is the reference's shifted by {shift} "
                            "along its last axis: off by one")
    return Hint(Kind.MASK, f"the port's mask differs from the reference's at {differ} of "
                f"{ref.size} positions")


def _triangle(mask: np.ndarray) -> tuple[str, int] | None:
    """('tril' | 'triu', k) when every matrix of the mask is that triangle."""
    rows, cols = mask.shape[-2:]
    for side, make in (("tril", np.tril), ("triu", np.triu)):
        for k in range(-rows, cols + 1):
            if np.array_equal(mask, np.broadcast_to(make(np.ones((rows, cols), bool), k),
                                                    mask.shape)):
                return side, k
    return None


# ---------------------------------------------------------------------------------------------
# Judging a model


class _Judge:
    """The error at one origin, and the acceptance rule every model is held to."""

    def __init__(self, ref: np.ndarray, port: np.ndarray, rtol: float, atol: float) -> None:
        self.ref, self.port = ref, port
        self.rtol, self.atol = float(rtol), float(atol)
        self.error = port - ref
        self.energy = float(np.sum(self.error**2))
        bound = self.atol + self.rtol * np.abs(ref)
        floor = np.finfo(np.float64).tiny if not np.any(bound > 0) else np.min(bound[bound > 0])
        self.bound = np.maximum(bound, floor)
        self.ratio = np.abs(self.error) / self.bound

    def accepts(self, model: np.ndarray) -> float | None:
        """The fraction of the error energy the model leaves, when it is accepted."""
        if model.shape != self.port.shape:
            model = np.broadcast_to(model, self.port.shape)
        residual = self.port - model
        if not np.isfinite(residual).all():
            return None
        left = float(np.sum(residual**2)) / self.energy
        if left > 1 - EXPLAINED:
            return None
        return left if float(np.max(np.abs(residual) / self.bound)) <= NOISE else None

    def close(self, a: np.ndarray, b: np.ndarray) -> bool:
        """Whether a recomputation reproduces a recorded tensor: relative rms within VERIFY."""
        if a.shape != b.shape:
            return False
        scale = float(np.sqrt(np.mean(b**2)))
        gap = float(np.sqrt(np.mean((a - b) ** 2)))
        return np.isfinite(gap) and gap <= VERIFY * scale + self.atol


@dataclass
class _Site:
    role: str
    inputs: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    grad_output: np.ndarray | None
    attention: Attention | None

    @property
    def backward(self) -> bool:
        return self.role == "grad_input"

    def float_inputs(self) -> list[tuple[str, np.ndarray]]:
        return [(name, np.asarray(v, np.float64)) for name, v in self.inputs.items()
                if np.asarray(v).dtype.kind == "f"]

    def masks(self) -> list[tuple[str, np.ndarray]]:
        return [(name, np.asarray(v)) for name, v in self.inputs.items()
                if np.asarray(v).dtype.kind in "biu"]

    def elementwise_input(self, shape: tuple[int, ...]) -> np.ndarray | None:
        """The one float input of the output's shape, at a site with no matrix weight."""
        same = [v for _, v in self.float_inputs() if v.shape == shape]
        matrices = [w for w in self.weights.values() if np.ndim(w) >= 2]
        return same[0] if len(same) == 1 and not matrices else None


def _left(fraction: float) -> str:
    return f"leaves {fraction:.1g} of the error energy"


# ---------------------------------------------------------------------------------------------
# Kinds with at most one fitted number


def _sign(judge: _Judge, site: _Site) -> Hint | None:
    left = judge.accepts(-judge.ref)
    if left is None:
        return None
    return Hint(Kind.SIGN, f"a sign flipped: port = -1 x reference ({_left(left)})")


def _scale(judge: _Judge, site: _Site) -> Hint | None:
    norm = float(np.sum(judge.ref**2))
    if norm == 0:
        return None
    c = float(np.sum(judge.ref * judge.port)) / norm
    left = judge.accepts(c * judge.ref)
    if left is None:
        return None
    if abs(c + 1) < 1e-3:
        return Hint(Kind.SIGN, f"a sign flipped: port = -1 x reference ({_left(left)})")
    if abs(c) < 1e-3:
        return Hint(Kind.SCALE, f"port = {c:.2g} x reference: the port's values are all about "
                    f"zero, a path cut off or never written ({_left(left)})")
    return Hint(Kind.SCALE, f"port = {c:.4g}{_named(c)} x reference ({_left(left)})")


def _named(c: float) -> str:
    """' (1/sqrt(8))' when c is a recognizable constant, else ''."""
    if c == 0:
        return ""
    sign, a = ("-" if c < 0 else ""), abs(c)
    for n in range(2, 4097):
        root = math.isqrt(n) ** 2 == n
        for value, text in ((n, None), (1 / n, f"1/{n}"),
                            (math.sqrt(n), None if root else f"sqrt({n})"),
                            (1 / math.sqrt(n), None if root else f"1/sqrt({n})")):
            if abs(a - value) <= 1e-4 * value:
                return f" ({sign}{text})" if text else ""
    return ""


def _missing_term(judge: _Judge, site: _Site) -> Hint | None:
    shape = judge.ref.shape
    for name, term in _terms(site, shape):
        norm = float(np.sum(term**2))
        if norm == 0:
            continue
        alpha = float(np.sum((judge.ref - judge.port) * term)) / norm
        for sign, text in ((1.0, "reference - {}: a term left out"),
                           (-1.0, "reference + {}: a term added twice")):
            if abs(alpha - sign) > 0.02:
                continue
            left = judge.accepts(judge.ref - sign * term)
            if left is not None:
                return Hint(Kind.MISSING_TERM, f"port = {text.format(name)} ({_left(left)})")
    return None


def _terms(site: _Site, shape: tuple[int, ...]) -> Iterator[tuple[str, np.ndarray]]:
    """What a port may leave out: an input of the output's shape (a residual), a bias along
    the axis its length matches, and backward, the incoming gradient (a skip path)."""
    if not site.backward:
        for name, value in site.float_inputs():
            if value.shape == shape:
                yield f"input '{name}'", value
    elif site.grad_output is not None and np.shape(site.grad_output) == shape:
        yield "grad_output", np.asarray(site.grad_output, np.float64)
    if site.role != "output":
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
# Rearrangements: transposed axes, reordered chunks, a weight applied transposed


def _same_values(judge: _Judge) -> bool:
    """A rearrangement keeps the values: the sorted tensors agree (a cheap first test)."""
    ref, port = np.sort(judge.ref, axis=None), np.sort(judge.port, axis=None)
    bound = judge.atol + judge.rtol * np.abs(ref)
    return bool(np.all(np.abs(port - ref) <= NOISE * np.maximum(bound, 1e-300)))


def _transpose(judge: _Judge, site: _Site) -> Hint | None:
    ref, shape = judge.ref, judge.ref.shape
    if ref.ndim < 2 or not _same_values(judge):
        return None
    ndim = ref.ndim
    swaps = _swaps(ndim)
    others = [p for p in itertools.permutations(range(ndim)) if ndim <= 4 and p not in swaps]
    for perm in swaps + others:
        if list(perm) == list(range(ndim)) or _only_unit_moves(perm, shape):
            continue
        moved = ref.transpose(perm)
        left = judge.accepts(moved.reshape(shape))
        if left is None:
            continue
        if moved.shape == shape:
            axes = [i for i in range(ndim) if perm[i] != i]
            what = (f"axes {axes[0]} and {axes[1]} swapped" if len(axes) == 2
                    else f"its axes permuted to {tuple(perm)}")
            return Hint(Kind.TRANSPOSE, f"port = reference with {what} ({_left(left)})")
        return Hint(Kind.TRANSPOSE, f"a reshape or view where a transpose belonged: port = "
                    f"reference transposed to axes {tuple(perm)} {_shape(moved.shape)} and read "
                    f"as {_shape(shape)} ({_left(left)})")
    return None


def _swaps(ndim: int) -> list[tuple[int, ...]]:
    out = []
    for i, j in itertools.combinations(range(ndim), 2):
        perm = list(range(ndim))
        perm[i], perm[j] = j, i
        out.append(tuple(perm))
    return out


def _only_unit_moves(perm: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """Whether the permutation moves only size-1 axes (the same memory order)."""
    kept = [axis for axis in perm if shape[axis] != 1]
    return kept == sorted(kept)


def _shape(shape: tuple[int, ...]) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def _permutation(judge: _Judge, site: _Site) -> Hint | None:
    ref, port = judge.ref, judge.port
    if not _same_values(judge):
        return None
    for axis, size in enumerate(ref.shape):
        r_axis = np.moveaxis(ref, axis, 0)
        p_axis = np.moveaxis(port, axis, 0)
        for count in (k for k in range(2, min(size, MAX_PERMUTED_CHUNKS) + 1) if size % k == 0):
            r_chunks, p_chunks = r_axis.reshape(count, -1), p_axis.reshape(count, -1)
            distance = (np.sum(p_chunks**2, 1)[:, None] + np.sum(r_chunks**2, 1)[None, :]
                        - 2 * p_chunks @ r_chunks.T)
            order = np.argmin(distance, axis=1)
            if sorted(order.tolist()) != list(range(count)) or (order == np.arange(count)).all():
                continue
            model = np.moveaxis(r_chunks[order].reshape(r_axis.shape), 0, axis)
            left = judge.accepts(model)
            if left is not None:
                return Hint(Kind.PERMUTATION, f"chunks reordered (gates, heads, channels): "
                            f"port = reference with the {count} chunks of axis {axis} "
                            f"({size // count} each) in the order {order.tolist()} "
                            f"({_left(left)})")
    return None


def _linear_transposed(judge: _Judge, site: _Site) -> Hint | None:
    """A square weight applied transposed: forward x W + b for x W^T + b; backward g W^T for
    g W. The linear model is first checked to give the reference."""
    weight = site.weights.get("weight")
    if weight is None or np.ndim(weight) != 2 or weight.shape[0] != weight.shape[1]:
        return None
    weight = np.asarray(weight, np.float64)
    bias = np.asarray(site.weights.get("bias", 0.0), np.float64)
    if site.backward:
        grad = site.grad_output
        if grad is None or np.shape(grad)[-1:] != weight.shape[:1]:
            return None
        grad = np.asarray(grad, np.float64)
        if not judge.close(grad @ weight, judge.ref):
            return None
        left = judge.accepts(grad @ weight.T)
        what = "grad_output @ weight.T where the reference has grad_output @ weight"
    else:
        xs = [v for _, v in site.float_inputs() if v.shape[-1:] == weight.shape[1:]]
        if len(xs) != 1 or not judge.close(xs[0] @ weight.T + bias, judge.ref):
            return None
        left = judge.accepts(xs[0] @ weight + bias)
        what = "input @ weight + bias where the reference has input @ weight.T + bias"
    if left is None:
        return None
    return Hint(Kind.TRANSPOSE, f"the weight is applied transposed: port = {what} "
                f"({_left(left)})")


# ---------------------------------------------------------------------------------------------
# A softmax over another axis; attention recomputed from the reference's q, k, v


def _softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


NORMALIZERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "softmax": _softmax, "log_softmax": _log_softmax}


def _axis(judge: _Judge, site: _Site) -> Hint | None:
    if site.role != "output":
        return None
    x = site.elementwise_input(judge.ref.shape)
    if x is None or x.ndim < 2:
        return None
    for name, function in NORMALIZERS.items():
        axis = next((a for a in range(x.ndim) if x.shape[a] > 1
                     and judge.close(function(x, a), judge.ref)), None)
        if axis is None:
            continue
        for other in range(x.ndim):
            if other == axis or x.shape[other] == 1:
                continue
            left = judge.accepts(function(x, other))
            if left is not None:
                return Hint(Kind.AXIS, f"port = {name}(input) over axis {other} where the "
                            f"reference takes axis {axis} ({_left(left)})")
        return None
    return None


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    batch, length, width = x.shape
    return np.ascontiguousarray(
        x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3))


def _merge(x: np.ndarray) -> np.ndarray:
    batch, heads, length, width = x.shape
    return x.transpose(0, 2, 1, 3).reshape(batch, length, heads * width)


def _attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray | None,
            scale: float, axis: int = -1) -> np.ndarray:
    """softmax(scale q k^T, masked with -1e9 where ``mask`` is False) v, per head."""
    scores = scale * (q @ np.swapaxes(k, -1, -2))
    if mask is not None:
        scores = np.where(mask, scores, -1e9)
    return _softmax(scores, axis) @ v


@dataclass
class _AttentionFit:
    heads: int
    scale: float
    mask: np.ndarray | None       # bool, True = attend, (batch | 1, 1, Lq | 1, Lk)
    given: np.ndarray | None      # the part of ``mask`` the site's input gave (no causal part)
    causal: bool
    mask_text: str


def _attention(judge: _Judge, site: _Site) -> Hint | None:
    parts = site.attention
    if parts is None or site.role != "output":
        return None
    q, k, v = (np.asarray(a, np.float64) for a in (parts.q, parts.k, parts.v))
    context = np.asarray(parts.context, np.float64)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or context.shape != q.shape[:2] + v.shape[2:]:
        return None
    project = next((p for p in _projections(parts) if judge.close(p(context), judge.ref)), None)
    if project is None:
        return None
    fitted = _fit_attention(q[:1], k[:1], v[:1], context[:1], _first(parts.mask, q), judge)
    if fitted is None:
        return None
    heads, scale, reading = fitted
    keep = max(1, SCORES // (heads * q.shape[1] * k.shape[1]))
    q, k, v, mask = q[:keep], k[:keep], v[:keep], _first(parts.mask, q, keep)
    judge = _Judge(judge.ref[:keep], judge.port[:keep], judge.rtol, judge.atol)
    attend, given, causal, text = list(_mask_candidates(mask, q.shape[1], k.shape[1]))[reading]
    fit = _split_causal(_AttentionFit(heads, scale, attend, given, causal, text))
    for kind, text, variant in _attention_variants(q, k, v, fit):
        left = judge.accepts(project(variant()))
        if left is not None:
            return Hint(kind, f"{text}: this attention recomputed that way from the "
                        f"reference's q, k, v gives the port ({_left(left)}; {fit.heads} "
                        f"heads, {fit.mask_text}, as checked on the reference)")
    scale = _fit_scale(q, k, v, fit, project, judge)
    if scale is not None:
        c, left = scale
        return Hint(Kind.SCALE, f"attention scores scaled by {c:.4g}{_named(c)} where the "
                    f"reference scales by {fit.scale:.4g}{_named(fit.scale)}: this attention "
                    f"recomputed that way from the reference's q, k, v gives the port "
                    f"({_left(left)}; {fit.heads} heads, {fit.mask_text})")
    return None


def _projections(parts: Attention) -> list[Callable[[np.ndarray], np.ndarray]]:
    """The output projection, its weight stored (out, in) as torch.nn.Linear stores it or
    (in, out) as GPT-2's Conv1D does: the one that gives the reference is used."""
    if parts.output_heads is not None:
        return [lambda context: _heads(context, parts.output_heads)]
    if parts.out_weight is None:
        return [lambda context: context]
    weight = np.asarray(parts.out_weight, np.float64)
    bias = np.asarray(parts.out_bias if parts.out_bias is not None else 0.0, np.float64)
    if weight.ndim != 2:
        return []
    return [lambda context, w=w: context @ w + bias for w in (weight.T, weight)]


def _mask_candidates(mask: np.ndarray | None, lq: int, lk: int
                     ) -> Iterator[tuple[np.ndarray | None, np.ndarray | None, bool, str]]:
    """(mask, given part, causal, text): the readings of the site's mask to try."""
    causal = np.tril(np.ones((lq, lk), bool)) if lq == lk else None
    given = None if mask is None else _as_4d(np.asarray(mask))
    if given is not None:
        for attend, text in ((given != 0, "its mask input: nonzero = attend"),
                             (given == 0, "its mask input: nonzero = masked")):
            yield attend, attend, False, text
            if causal is not None:
                yield attend & causal, attend, True, text + ", and causal"
    yield None, None, False, "no mask"
    if causal is not None:
        yield causal, None, True, "a causal mask"


def _as_4d(mask: np.ndarray) -> np.ndarray | None:
    if mask.ndim == 2:   # (batch, Lk): key padding
        return mask[:, None, None, :]
    if mask.ndim == 3:   # (batch, Lq, Lk)
        return mask[:, None]
    return mask if mask.ndim == 4 else None


def _first(mask: np.ndarray | None, q: np.ndarray, count: int = 1) -> np.ndarray | None:
    """The mask of the first ``count`` batch elements (a mask without a batch axis whole)."""
    if mask is None or np.ndim(mask) < 2 or np.shape(mask)[0] != q.shape[0]:
        return mask
    return np.asarray(mask)[:count]


def _fit_attention(q, k, v, context, mask, judge: _Judge) -> tuple[int, float, int] | None:
    """(heads, scale, which reading of the mask) with which standard attention gives the
    reference's context (checked on the batch elements given: the first)."""
    width = q.shape[-1]
    for heads in range(1, width // 4 + 1):  # head widths from 4 up
        if width % heads or v.shape[-1] % heads or heads * q.shape[1] * k.shape[1] > SCORES:
            continue
        d_k = width // heads
        qh, kh, vh = _heads(q, heads), _heads(k, heads), _heads(v, heads)
        for scale in (1 / math.sqrt(d_k), 1.0):
            readings = _mask_candidates(mask, q.shape[1], k.shape[1])
            for reading, (attend, _, _, _) in enumerate(readings):
                try:
                    out = _merge(_attend(qh, kh, vh, attend, scale))
                except ValueError:  # the mask does not broadcast
                    continue
                if judge.close(out, context):
                    return heads, scale, reading
    return None


def _split_causal(fit: _AttentionFit) -> _AttentionFit:
    """A given mask that is (padding of the keys) & causal, as a decoder's often is: keep the
    two parts apart, so that the causal part alone can be shifted."""
    mask = fit.mask
    if fit.causal or mask is None or mask.shape[-1] != mask.shape[-2]:
        return fit
    causal = np.tril(np.ones(mask.shape[-2:], bool))
    keys = mask[..., -1:, :]  # the last query sees every key the causal part allows
    if not np.array_equal(mask, np.broadcast_to(keys & causal, mask.shape)):
        return fit
    return _AttentionFit(fit.heads, fit.scale, mask, keys, True, fit.mask_text + " (causal)")


def _attention_variants(q, k, v, fit: _AttentionFit
                        ) -> Iterator[tuple[Kind, str, Callable[[], np.ndarray]]]:
    heads, scale, mask = fit.heads, fit.scale, fit.mask
    qh, kh, vh = _heads(q, heads), _heads(k, heads), _heads(v, heads)

    def run(attend=mask, axis=-1, qkv=(qh, kh, vh), merge=_merge):
        return lambda: merge(_attend(*qkv, attend, scale, axis))

    yield Kind.AXIS, "softmax over the query axis instead of the key axis", run(axis=-2)
    lq, lk = q.shape[1], k.shape[1]
    causal = np.tril(np.ones((lq, lk), bool)) if lq == lk else None
    given = fit.given
    if mask is not None:
        yield Kind.MASK, "the mask inverted (attending where the reference masks)", run(~mask)
        if given is not None or not fit.causal:
            yield Kind.MASK, "the mask ignored", run(None)
    if fit.causal:
        for shift, what in ((1, "each query also sees the next key"),
                            (-1, "each query misses its own key")):
            shifted = np.tril(np.ones((lq, lk), bool), shift)
            yield Kind.MASK, f"the causal mask off by one ({what})", run(
                shifted if given is None else given & shifted)
        yield Kind.MASK, "no causal mask", run(given)
    elif causal is not None:
        yield Kind.MASK, "a causal mask added", run(causal if mask is None else mask & causal)
    if given is not None:
        for shift, what in ((1, "one key later"), (-1, "one key earlier")):
            moved = _shift(given, shift)
            yield Kind.MASK, f"the mask shifted by {what} (off by one)", run(
                moved & causal if fit.causal else moved)
    batch = q.shape[0]
    d_k, d_v = q.shape[-1] // heads, v.shape[-1] // heads

    def reshaped(x, width):
        return x.reshape(batch, heads, x.shape[1], width)

    yield Kind.TRANSPOSE, "heads split with a reshape where view + transpose belonged", run(
        qkv=(reshaped(q, d_k), reshaped(k, d_k), reshaped(v, d_v)))
    yield Kind.TRANSPOSE, "heads merged with a reshape where transpose + reshape belonged", run(
        merge=lambda c: c.reshape(batch, c.shape[2], -1))
    if q.shape == k.shape == v.shape:
        fused = np.concatenate([q, k, v], axis=-1)
        parts = fused.reshape(3, batch, heads, lq, d_k)
        yield Kind.TRANSPOSE, ("the fused q, k, v projection split with a reshape to "
                               "(3, batch, heads, length, d_k) where a permute belonged"), run(
            qkv=(parts[0], parts[1], parts[2]))


def _shift(mask: np.ndarray, by: int) -> np.ndarray:
    """The mask moved ``by`` keys along its last axis, the edge column repeated."""
    out = np.roll(mask, by, axis=-1)
    if by > 0:
        out[..., :by] = mask[..., :1]
    else:
        out[..., by:] = mask[..., -1:]
    return out


def _fit_scale(q, k, v, fit: _AttentionFit, project, judge: _Judge
               ) -> tuple[float, float] | None:
    """The one score scale that reproduces the port, searched over a factor of e^5 each way."""
    qh, kh, vh = _heads(q, fit.heads), _heads(k, fit.heads), _heads(v, fit.heads)
    products = qh @ np.swapaxes(kh, -1, -2)  # the scores before scaling, once

    def attend(c: float) -> np.ndarray:
        scores = c * products
        if fit.mask is not None:
            scores = np.where(fit.mask, scores, -1e9)
        return project(_merge(_softmax(scores, -1) @ vh))

    def energy(log_c: float) -> float:
        return float(np.sum((judge.port - attend(math.exp(log_c))) ** 2))

    centre = math.log(fit.scale)
    grid = np.linspace(centre - 5, centre + 5, 21)
    values = [energy(g) for g in grid]
    best = int(np.argmin(values))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, len(grid) - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(24):  # golden-section search inside the best grid cell: to 1e-5
        a, b = high - golden * (high - low), low + golden * (high - low)
        if energy(a) < energy(b):
            high = b
        else:
            low = a
    c = math.exp((low + high) / 2)
    if abs(c / fit.scale - 1) < 1e-3:
        return None
    left = judge.accepts(attend(c))
    return None if left is None else (c, left)


# ---------------------------------------------------------------------------------------------
# Normalization epsilon; a smooth approximation of an element-wise function


def _epsilon(judge: _Judge, site: _Site) -> Hint | None:
    if site.role != "output":
        return None
    x = next((v for _, v in site.float_inputs() if v.shape == judge.ref.shape), None)
    if x is None or x.ndim < 1:
        return None
    gamma = site.weights.get("weight")
    beta = np.asarray(site.weights.get("bias", 0.0), np.float64)
    for groups, text in _norm_groups(x.shape, gamma):
        shift = np.broadcast_to(_along(beta, x.shape, groups), x.shape) if beta.ndim else beta
        y = _groups_of(judge.ref - shift, groups)
        z = _groups_of(judge.port - shift, groups)
        xs = _groups_of(x, groups)
        yy = np.sum(y * y, axis=1)
        if xs.shape[0] < 2 or xs.shape[1] < 4 or np.any(yy == 0):
            continue  # a rescaling of each group needs groups, and members to rescale
        c = np.sum(y * z, axis=1) / yy
        for variance, what in ((np.var(xs, axis=1), "variance"),
                               (np.mean(xs * xs, axis=1), "mean square")):
            fitted = _fit_epsilons(c, variance)
            if fitted is None:
                continue
            eps_ref, eps_port = fitted
            factor = np.sqrt((variance + eps_ref) / (variance + eps_port))
            model = _ungroup(factor[:, None] * y, groups, x.shape) + shift
            left = judge.accepts(model)
            if left is None:
                continue
            small = np.argsort(variance)[: max(1, len(variance) // 10)]
            share = float(np.sum((1 - factor[small]) ** 2 * yy[small])
                          / max(np.sum((1 - factor) ** 2 * yy), 1e-300))
            reference = (f"{eps_ref:.2g}" if eps_ref > 0
                         else "one too small to measure")
            return Hint(Kind.EPSILON, f"a normalization's epsilon: {eps_port:.2g} where the "
                        f"reference's is {reference}, fitted from each {text}'s {what} of the "
                        f"input ({_left(left)}); the 10% of {text}s with the smallest {what} "
                        f"hold {share:.0%} of the error")
    return None


def _norm_groups(shape: tuple[int, ...], gamma) -> Iterator[tuple[tuple[int, ...], str]]:
    """The axes a normalization reduces over: its trailing axes (layer and RMS norms, sized
    by the weight), or all but axis 1 (batch norm)."""
    trailing = max(np.ndim(gamma), 1) if gamma is not None else 1
    if trailing <= len(shape):
        yield tuple(range(len(shape) - trailing, len(shape))), "row"
    if len(shape) >= 2 and (gamma is None or np.size(gamma) == shape[1]):
        yield tuple(a for a in range(len(shape)) if a != 1), "channel"


def _along(beta: np.ndarray, shape: tuple[int, ...], reduced: tuple[int, ...]) -> np.ndarray:
    """A per-feature parameter broadcast to ``shape``: along the reduced trailing axes, or
    along axis 1 when axis 1 is the one kept."""
    if 1 not in reduced and len(shape) >= 2 and beta.size == shape[1]:
        view = [1] * len(shape)
        view[1] = shape[1]
        return beta.reshape(view)
    return beta


def _groups_of(values: np.ndarray, reduced: tuple[int, ...]) -> np.ndarray:
    """(groups, members): the reduced axes last, flattened."""
    kept = [a for a in range(values.ndim) if a not in reduced]
    moved = np.transpose(values, kept + list(reduced))
    size = int(np.prod([values.shape[a] for a in reduced]))
    return moved.reshape(-1, size)


def _ungroup(values: np.ndarray, reduced: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    kept = [a for a in range(len(shape)) if a not in reduced]
    order = kept + list(reduced)
    moved = values.reshape([shape[a] for a in order])
    return np.transpose(moved, np.argsort(order))


def _fit_epsilons(c: np.ndarray, variance: np.ndarray) -> tuple[float, float] | None:
    """(eps_ref, eps_port) from the per-group factors: c^2 (v + eps_port) = v + eps_ref is
    linear in both, fitted by least squares; eps_ref is clipped at 0 (it is the poorly
    determined one when it is much smaller than every variance)."""
    c2 = c * c
    a = np.stack([c2, -np.ones_like(c2)], axis=1)
    b = variance * (1 - c2)
    (eps_port, eps_ref), *_ = np.linalg.lstsq(a, b, rcond=None)
    if eps_ref < 0:
        eps_ref = 0.0
        eps_port = float(np.sum(c2 * b) / np.sum(c2 * c2))
    if not (eps_port > 0 and np.isfinite(eps_port)) or abs(eps_port - eps_ref) <= 1e-3 * max(
            eps_port, eps_ref):
        return None
    return float(eps_ref), float(eps_port)


def _approximation(judge: _Judge, site: _Site) -> Hint | None:
    """Forward: error = s(x); backward: error = grad_output s(x), with s a cubic spline in the
    input with at most 64 coefficients (a fit with one free number per 16 values removes
    about 1/16 of a random error's energy, far from the 99% asked)."""
    shape = judge.ref.shape
    x = site.elementwise_input(shape) if site.role in ("output", "grad_input") else None
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
                f"a smooth function of the input (a {knots}-term spline {_left(left)}), at "
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
# Where the error is: positions a mask selects, batch elements, a run of positions


def _slices(judge: _Judge, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per index of ``axes``: the worst ratio, and the fraction of values out of tolerance."""
    reduce = tuple(a for a in range(judge.ratio.ndim) if a not in axes)
    return judge.ratio.max(axis=reduce), (judge.ratio > 1).mean(axis=reduce)


def _mask_input(judge: _Judge, site: _Site) -> Hint | None:
    ref = judge.ref
    if site.role not in ("output", "grad_input") or ref.ndim < 2:
        return None
    for name, mask in site.masks():
        for pattern, what in _mask_patterns(mask, ref.shape):
            axes = tuple(range(pattern.ndim))
            worst, _ = _slices(judge, axes)
            bad = worst > 1
            if not np.array_equal(bad, pattern) or not _separated(judge, worst, bad):
                continue
            where = ("batch elements" if pattern.ndim == 1 else "(batch, position) rows")
            return Hint(Kind.MASK, f"the error is exactly at the {int(pattern.sum())} {where} "
                        f"{what} of input '{name}' and nowhere else (up to "
                        f"{_x(worst[pattern].max())} there, {_x(worst[~pattern].max())} "
                        "elsewhere)")
    return None


def _mask_patterns(mask: np.ndarray, shape: tuple[int, ...]
                   ) -> Iterator[tuple[np.ndarray, str]]:
    """Per (batch, position) and per batch element: where the mask masks something."""
    batch = shape[0]
    if mask.ndim < 2 or mask.shape[0] != batch:
        return
    squeezed = mask.reshape(batch, *[s for s in mask.shape[1:] if s != 1])
    masked = squeezed == 0
    if masked.ndim == 3:  # (batch, Lq, Lk): a query row with some key masked
        masked = masked.any(axis=-1)
    if masked.ndim != 2:
        return
    if len(shape) >= 2 and masked.shape[1] == shape[1]:
        yield from ((masked, "where the mask is 0 (masked)"),
                    (~masked, "where the mask is nonzero"))
    per_batch = masked.any(axis=1)
    yield per_batch, "whose mask masks some position"


def _batch(judge: _Judge, site: _Site) -> Hint | None:
    if site.role in ("weight", "weight_grad") or judge.ref.ndim < 2 or judge.ref.shape[0] < 2:
        return None
    worst, _ = _slices(judge, (0,))
    bad = worst > 1
    if not _separated(judge, worst, bad):
        return None
    within = np.flatnonzero(~bad)
    return Hint(Kind.BATCH, f"the error is only in batch elements {_ranges(np.flatnonzero(bad))}"
                f" ({int(bad.sum())} of {bad.size}, {worst[bad].min():.3g}x to "
                f"{_x(worst[bad].max())}); element(s) {_ranges(within)} within tolerance (at "
                f"most {_x(worst[within].max())})")


def _positions(judge: _Judge, site: _Site) -> Hint | None:
    """Whole positions of one axis (not the batch axis nor the last, feature axis) wrong, in
    one run from either end, the rest within tolerance: a mask or a boundary off by one."""
    ref = judge.ref
    if site.role in ("weight", "weight_grad") or ref.ndim < 3:
        return None
    for axis in range(1, ref.ndim - 1):
        worst, out = _slices(judge, (axis,))
        bad = worst > 1
        if not _separated(judge, worst, bad) or out[bad].min() < 0.25:
            continue
        where = np.flatnonzero(bad)
        contiguous = where[-1] - where[0] + 1 == where.size
        if not contiguous or (where[0] != 0 and where[-1] != bad.size - 1):
            continue
        within = np.flatnonzero(~bad)
        return Hint(Kind.MASK, f"a mask or a boundary off: the error is only at positions "
                    f"{_ranges(where)} of axis {axis} (of {bad.size}), whole; positions "
                    f"{_ranges(within)} within tolerance")
    return None


def _separated(judge: _Judge, worst: np.ndarray, bad: np.ndarray) -> bool:
    """Some slices within tolerance and the others clearly out, and not by chance:
    - each bad slice beyond what tolerance-scale noise reaches (NOISE, as a model's residual
      must stay within it): an error that hovers about the tolerance falls either side;
    - were the out values scattered at random at the rate seen, the clean slices would all
      miss them with probability under 1e-6: a few wrong values among many are not a pattern.
    """
    if not bad.any() or bad.all() or worst[bad].min() <= NOISE:
        return False
    rate = float(np.mean(judge.ratio > 1))
    clean_values = judge.ratio.size * float(np.mean(~bad))
    return rate >= 1 or clean_values * math.log1p(-rate) <= math.log(CHANCE)


def _ranges(indices: np.ndarray) -> str:
    """'0, 2-5, 9'."""
    parts: list[str] = []
    for _, run in itertools.groupby(enumerate(indices.tolist()), lambda p: p[1] - p[0]):
        run = [v for _, v in run]
        parts.append(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}")
    text = ", ".join(parts[:8])
    return text + (" ..." if len(parts) > 8 else "")


def _x(ratio: float) -> str:
    return f"{ratio:.3g}x tolerance"


# ---------------------------------------------------------------------------------------------
# Precision


LOWER = (("bfloat16", 8), ("float16", 11))  # name, bits of significand (the leading 1 with them)


def _precision(judge: _Judge, site: _Site) -> Hint | None:
    """Nearly all the port's values are numbers of a lower dtype while the reference's are
    not, and its error is the size a few roundings to that dtype make. (An error of that size
    alone is no evidence: random noise of the same size has it too.)"""
    ref, error = judge.ref, judge.error
    for name, bits in LOWER:
        port_in, ref_in = _representable(judge.port, bits), _representable(ref, bits)
        if port_in < 0.99 or ref_in >= 0.5:
            continue
        k = _rms(error) / max(_rms(_rounding(ref, bits)), 1e-300)
        if 0.1 <= k <= 16:
            return Hint(Kind.PRECISION, f"computed in {name}: {port_in:.0%} of the port's "
                        f"values are {name} numbers ({ref_in:.0%} of the reference's), its "
                        f"error {k:.2g}x what rounding the reference to {name} makes")
    return None


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values))))


def _rounding(values: np.ndarray, bits: int) -> np.ndarray:
    """What rounding to ``bits`` significant bits (round to nearest) changes."""
    mantissa, exponent = np.frexp(values)
    rounded = np.ldexp(np.round(mantissa * 2.0**bits) / 2.0**bits, exponent)
    return rounded - values


def _representable(values: np.ndarray, bits: int) -> float:
    """The fraction of the nonzero values that have at most ``bits`` significant bits."""
    values = np.asarray(values, np.float64).ravel()
    values = values[values != 0]
    if values.size == 0:
        return 0.0
    return float(np.mean(_rounding(values, bits) == 0))


_TESTS: list[Callable[[_Judge, _Site], Hint | None]] = [
    _sign, _scale, _missing_term, _transpose, _permutation, _linear_transposed, _axis,
    _attention, _epsilon, _approximation, _mask_input, _batch, _positions, _precision,
]
