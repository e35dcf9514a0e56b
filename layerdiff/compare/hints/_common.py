"""What every kind of hint shares: the vocabulary (:class:`Kind`, :class:`Hint`, the
:class:`Attention` pieces a caller may give), the acceptance rule every model is held to
(:class:`Judge`), what the reference recorded at the origin's site (:class:`Site`), and the few
numeric and text helpers more than one family uses."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np

from layerdiff.trace.schema import Role


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
    ROTARY = "rotary"                # q/k rotated otherwise: pair layout, sign, frequency base
    ACTIVATION = "activation"        # another activation function (silu for gelu, ...)
    WEIGHT_OFFSET = "weight-offset"  # a norm's weight used as w where it is (1 + w), or back
    ROUTING_WEIGHTS = "routing-weights"  # MoE top-k weights normalised otherwise (per token)
    SHIFT = "position-shift"         # port position p holds the reference's p + s (off by one)


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


class Judge:
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
        self.memo: dict[str, object] = {}  # answers of a test that several kinds ask

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
class Child:
    """What one sub-module of the origin's module recorded in the reference (in call order)."""

    name: str
    input: np.ndarray | None
    output: np.ndarray | None
    weight: np.ndarray | None = None
    bias: np.ndarray | None = None


@dataclass
class Site:
    """The reference's tensors at the origin's site, beside the origin's own."""

    role: str
    inputs: dict[str, np.ndarray]
    weights: dict[str, np.ndarray]
    grad_output: np.ndarray | None
    attention: Attention | None
    children: list[Child] = field(default_factory=list)
    full_precision: str = ""       # the port's dtype where it runs in float32/float64
    where: str = ""                # the origin's record, for people ('at attn#0')

    @property
    def backward(self) -> bool:
        return self.role == Role.GRAD_INPUT

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


# One kind's test: the hint it gives for this error at this site, or None.
Test = Callable[[Judge, Site], Hint | None]


def left_text(fraction: float) -> str:
    return f"leaves {fraction:.1g} of the error energy"


def named(c: float) -> str:
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


def softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    e = np.exp(shifted)
    return e / np.sum(e, axis=axis, keepdims=True)


def shift_mask(mask: np.ndarray, by: int) -> np.ndarray:
    """The mask moved ``by`` keys along its last axis, the edge column repeated."""
    out = np.roll(mask, by, axis=-1)
    if by > 0:
        out[..., :by] = mask[..., :1]
    else:
        out[..., by:] = mask[..., -1:]
    return out
