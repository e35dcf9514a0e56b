"""Kinds found by recomputing a decoder's attention with rotary position embeddings (RoPE) and
grouped key/value heads from the reference's own q, k, v (before rotation, as the q, k, v
projections record them).

First the attention that reproduces the reference is found: the head width, how many query
heads share a key/value head, the rotation (pairs split in halves, (x[i], x[i + d/2]), as
Hugging Face's ``rotate_half`` has them, or interleaved, (x[2i], x[2i+1]), as Meta's code and
complex multiplication have them; or none), its frequency base and the mask. Then variants are
fitted to the port:

- ``rotary``: the other pair layout (a checkpoint's q/k rows loaded without the row permutation
  that converts between them), the sine's sign flipped (rotating the other way), another
  frequency base, no rotation at all. Position 0 is never rotated, so a rotary mistake leaves
  it exact while every later position is off: a pattern that a boundary in the attention
  pattern (``mask``) also has, which only this recomputation tells apart;
- ``permutation``: key/value heads tiled (query head h reads key/value head h mod groups)
  where the reference repeats each (h div n_rep), or the other way round.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from layerdiff.trace.schema import Role

from ._common import Hint, Judge, Kind, Site, left_text, named, softmax

SCORES = 1 << 18          # recomputed on as many batch elements as keep scores below this
BASES = (10000.0, 500000.0, 1000000.0, 100000.0)  # frequency bases in use, tried when no
                                                   # cos/sin input gives the reference's
MASKED = -1e9
MIN_POSITIONS = 8


@dataclass(frozen=True)
class _Rope:
    layout: str               # "half" | "interleaved" | "none"
    base: float
    sign: float = 1.0         # -1: the sine negated (rotation the other way)
    bits: int | None = None   # the cos/sin tables rounded to this many significant bits

    def pairs(self) -> str:
        if self.layout == "none":
            return "no rotation"
        return ("half-split pairs (x[i], x[i+d/2])" if self.layout == "half"
                else "interleaved pairs (x[2i], x[2i+1])")


@dataclass(frozen=True)
class _Fit:
    head_dim: int
    heads: int
    kv_heads: int
    rope: _Rope
    tiled: bool               # query head h reads kv head h % kv_heads (else h // n_rep)
    mask: np.ndarray | None   # additive, broadcasting to (batch, heads, Lq, Lk)
    mask_text: str
    rotate: str = "qk"        # which of q and k are rotated (a port may forget one)
    scale: float | None = None  # the scores' scale; None: 1/sqrt(head_dim)


def rotary(judge: Judge, site: Site) -> Hint | None:
    parts = site.attention
    if parts is None or site.role != Role.OUTPUT or parts.output_heads is not None:
        return None
    q, k, v = (np.asarray(a, np.float64) for a in (parts.q, parts.k, parts.v))
    context = np.asarray(parts.context, np.float64)
    if q.ndim != 3 or k.shape != v.shape or context.shape != q.shape:
        return None
    project = _projection(parts, judge, context)
    if project is None:
        return None
    length = q.shape[1]
    if k.shape[1] != length or judge.ref.shape[:2] != q.shape[:2]:
        return None
    positions = _positions(site, length)
    trig = _cos_sin(site, length)
    masks = list(_masks(site, q.shape[0], length))
    # a causal attention's first positions read nothing later: the model is checked on as
    # many as keep the scores of the most heads tried below SCORES (a model that needs the
    # later keys fails the check on the reference and gives no hint)
    crop = min(length, max(MIN_POSITIONS, math.isqrt(SCORES // max(1, q.shape[-1] // 4))))
    if crop < length:
        q, k, v, context = (a[:, :crop] for a in (q, k, v, context))
        positions = positions[:crop]
        trig = None if trig is None else (trig[0][:crop], trig[1][:crop])
        masks = [(None if m is None else m[..., :crop, :crop], text) for m, text in masks]
        judge = Judge(judge.ref[:, :crop], judge.port[:, :crop], judge.rtol, judge.atol)
        length = crop
    keep = max(1, SCORES // (q.shape[2] * length * length))
    fit = _fit_reference(q[:1], k[:1], v[:1], context[:1], positions, trig, masks, judge)
    if fit is None:
        return None
    q, k, v = q[:keep], k[:keep], v[:keep]
    mask = fit.mask if fit.mask is None or fit.mask.shape[0] == 1 else fit.mask[:keep]
    fit = dataclasses.replace(fit, mask=mask)
    judge = Judge(judge.ref[:keep], judge.port[:keep], judge.rtol, judge.atol)
    for kind, text, variant in _variants(fit, site.full_precision or "full-precision"):
        left = judge.accepts(project(_attend(q, k, v, positions, variant)))
        if left is not None:
            return Hint(kind, f"{text}: this attention recomputed that way from the "
                        f"reference's q, k, v gives the port ({left_text(left)}; {fit.heads} "
                        f"heads of {fit.head_dim}, {fit.kv_heads} key/value heads, "
                        f"{fit.mask_text}, as checked on the reference)"
                        f"{_growth(judge) if kind == Kind.ROTARY else ''}")
    found = _fit_scale(q, k, v, positions, fit, project, judge)
    if found is not None:
        c, left = found
        d = 1 / math.sqrt(fit.head_dim)
        return Hint(Kind.SCALE, f"attention scores scaled by {c:.4g}{named(c)} where the "
                    f"reference scales by {d:.4g}{named(d)}: this attention recomputed that way "
                    f"from the reference's q, k, v gives the port ({left_text(left)}; "
                    f"{fit.heads} heads of {fit.head_dim}, {fit.kv_heads} key/value heads, "
                    f"{fit.rope.pairs()}, {fit.mask_text})")
    if fit.rope.layout != "none":
        found = _fit_base(q, k, v, positions, fit, project, judge)
        if found is not None:
            base, left = found
            return Hint(Kind.ROTARY, f"rotary frequency base {base:.4g} where the reference's "
                        f"is {fit.rope.base:.6g}: this attention recomputed that way gives the "
                        f"port ({left_text(left)}){_growth(judge)}")
    return None


def _growth(judge: Judge) -> str:
    """'; position 0 (never rotated) at 0.3x tolerance, error rms 0.01 at position 1 and 0.02
    at position 15': where the error is, as evidence beside the model."""
    if judge.ref.ndim < 3:
        return ""
    axes = tuple(a for a in range(judge.ref.ndim) if a != 1)
    worst = judge.ratio.max(axis=axes)
    rms = np.sqrt(np.mean(judge.error**2, axis=axes))
    return (f"; position 0 (never rotated) at {worst[0]:.2g}x tolerance, error rms "
            f"{rms[1]:.2g} at position 1 and {rms[-1]:.2g} at position {rms.size - 1}")


def _projection(parts, judge: Judge, context: np.ndarray
                ) -> Callable[[np.ndarray], np.ndarray] | None:
    if parts.out_weight is None:
        return (lambda c: c) if judge.close(context, judge.ref) else None
    weight = np.asarray(parts.out_weight, np.float64)
    bias = np.asarray(parts.out_bias if parts.out_bias is not None else 0.0, np.float64)
    if weight.ndim != 2:
        return None
    for w in (weight.T, weight):
        if w.shape[0] == context.shape[-1] and judge.close(context @ w + bias, judge.ref):
            return lambda c, w=w: c @ w + bias
    return None


def _positions(site: Site, length: int) -> np.ndarray:
    """The positions rotated: an integer input of shape (1 | batch, length) when the site took
    one (position ids), else 0..length-1."""
    for _, ids in site.masks():
        if (ids.ndim == 2 and ids.shape[1] == length and ids.dtype.kind in "iu"
                and length > 1 and np.all(ids[0] == ids) and ids.min() >= 0
                and np.all(np.diff(ids[0]) == 1)):  # consecutive: positions, not tokens
            return ids[0].astype(np.float64)
    return np.arange(length, dtype=np.float64)


def _cos_sin(site: Site, length: int) -> tuple[np.ndarray, np.ndarray] | None:
    """Two float inputs of one shape (..., length, w) with cos^2 + sin^2 = 1: the rotation's
    tables as the site took them."""
    floats = [v for _, v in site.float_inputs() if v.ndim >= 2 and v.shape[-2] == length]
    for i, a in enumerate(floats):
        for b in floats[i + 1:]:
            if a.shape == b.shape and np.allclose(a * a + b * b, 1.0, atol=1e-4):
                return a.reshape(-1, length, a.shape[-1])[0], b.reshape(-1, length,
                                                                        b.shape[-1])[0]
    return None


def _bases(trig: tuple[np.ndarray, np.ndarray] | None, head_dim: int) -> list[float]:
    """The base the tables were made with (from the angle of the second frequency at
    position 1), then the common ones."""
    found: list[float] = []
    if trig is not None and trig[0].shape[0] > 1:
        cos, sin = trig
        angles = np.arctan2(sin[1], cos[1])
        half = head_dim // 2
        if angles.size in (half, head_dim) and half > 1 and angles[1] > 0:
            found.append(float(angles[1] ** (-head_dim / 2)))
    return found + [b for b in BASES if not any(abs(b / f - 1) < 1e-3 for f in found)]


def _masks(site: Site, batch: int, length: int) -> Iterator[tuple[np.ndarray | None, str]]:
    """Additive masks to try: the site's own 4-d mask input (float, additive; or boolean),
    then causal, then none."""
    for name, value in site.inputs.items():
        value = np.asarray(value)
        if value.ndim != 4 or value.shape[-2:] != (length, length) or value.shape[0] not in (
                1, batch):
            continue
        if value.dtype.kind == "f":
            yield np.maximum(value.astype(np.float64), MASKED), f"its additive mask '{name}'"
        elif value.dtype.kind in "biu":
            yield np.where(value != 0, 0.0, MASKED)[:, :, :, :], f"its mask '{name}'"
    causal = np.where(np.tril(np.ones((length, length), bool)), 0.0, MASKED)[None, None]
    yield causal, "a causal mask"
    yield None, "no mask"


def _rotate(x: np.ndarray, positions: np.ndarray, rope: _Rope) -> np.ndarray:
    """x (batch, heads, length, d) rotated pair by pair by position x frequency."""
    if rope.layout == "none":
        return x
    d = x.shape[-1]
    inv = rope.base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    angles = positions[:, None] * inv[None, :]          # (length, d/2)
    cos, sin = np.cos(angles), rope.sign * np.sin(angles)
    if rope.bits is not None:
        cos, sin = _rounded(cos, rope.bits), _rounded(sin, rope.bits)
    if rope.layout == "half":
        a, b = x[..., : d // 2], x[..., d // 2:]
        return np.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    a, b = x[..., 0::2], x[..., 1::2]
    out = np.empty_like(x)
    out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
    return out


def _rounded(values: np.ndarray, bits: int) -> np.ndarray:
    """Values rounded to ``bits`` significant bits, to nearest (a cast to a lower dtype)."""
    mantissa, exponent = np.frexp(values)
    return np.ldexp(np.round(mantissa * 2.0**bits) / 2.0**bits, exponent)


LOWER = (("bfloat16", 8), ("float16", 11))  # name, significant bits


def _heads(x: np.ndarray, heads: int) -> np.ndarray:
    batch, length, width = x.shape
    return x.reshape(batch, length, heads, width // heads).transpose(0, 2, 1, 3)


def _attend(q, k, v, positions, fit: _Fit) -> np.ndarray:
    qh, kh = _heads(q, fit.heads), _heads(k, fit.kv_heads)
    if "q" in fit.rotate:
        qh = _rotate(qh, positions, fit.rope)
    if "k" in fit.rotate:
        kh = _rotate(kh, positions, fit.rope)
    vh = _heads(v, fit.kv_heads)
    rep = fit.heads // fit.kv_heads
    index = (np.arange(fit.heads) % fit.kv_heads if fit.tiled
             else np.arange(fit.heads) // rep)
    kh, vh = kh[:, index], vh[:, index]
    scale = 1 / math.sqrt(fit.head_dim) if fit.scale is None else fit.scale
    scores = scale * (qh @ np.swapaxes(kh, -1, -2))
    if fit.mask is not None:
        scores = scores + fit.mask
    out = softmax(scores, -1) @ vh
    batch, heads, length, d = out.shape
    return out.transpose(0, 2, 1, 3).reshape(batch, length, heads * d)


def _fit_reference(q, k, v, context, positions, trig, masks, judge: Judge) -> _Fit | None:
    """The attention that gives the reference's context (checked on its first element)."""
    width, kv_width = q.shape[-1], k.shape[-1]
    for head_dim in range(4, math.gcd(width, kv_width) + 1, 2):
        heads, kv_heads = width // head_dim, kv_width // head_dim
        if width % head_dim or kv_width % head_dim or heads % kv_heads:
            continue
        ropes = [_Rope(layout, base) for base in _bases(trig, head_dim)
                 for layout in ("half", "interleaved")] + [_Rope("none", 0.0)]
        tilings = (False, True) if kv_heads not in (1, heads) else (False,)
        for rope in ropes:
            for tiled in tilings:
                for mask, text in masks:
                    fit = _Fit(head_dim, heads, kv_heads, rope, tiled,
                               None if mask is None else mask[:1], text)
                    if judge.close(_attend(q, k, v, positions, fit), context):
                        return _Fit(head_dim, heads, kv_heads, rope, tiled, mask, text)
    return None


def _variants(fit: _Fit, port: str = "full-precision") -> Iterator[tuple[Kind, str, _Fit]]:
    rope = fit.rope

    def with_(**changes) -> _Fit:
        return dataclasses.replace(fit, **changes)

    if rope.layout != "none":
        other = "interleaved" if rope.layout == "half" else "half"
        yield Kind.ROTARY, (
            f"rotary embedding applied to {_Rope(other, rope.base).pairs()} where the "
            f"reference rotates {rope.pairs()} (q/k projection rows not permuted between the "
            "two layouts)"), with_(rope=_Rope(other, rope.base, rope.sign))
        yield Kind.ROTARY, "the rotation's sine negated (q and k rotated the other way)", \
            with_(rope=_Rope(rope.layout, rope.base, -rope.sign))
        yield Kind.ROTARY, (f"both: pairs {other}-split and the sine negated"), \
            with_(rope=_Rope(other, rope.base, -rope.sign))
        yield Kind.ROTARY, "no rotary embedding applied to q and k", with_(
            rope=_Rope("none", 0.0))
        yield Kind.ROTARY, "the rotary embedding applied to q only (k left unrotated)", \
            with_(rotate="q")
        yield Kind.ROTARY, "the rotary embedding applied to k only (q left unrotated)", \
            with_(rotate="k")
        for name, bits in LOWER:
            yield Kind.PRECISION, (
                f"the rotary tables (cos, sin) rounded to {name} inside a {port} port (a "
                f"table or constant cast to {name}?)"), \
                with_(rope=dataclasses.replace(rope, bits=bits))
    if fit.kv_heads not in (1, fit.heads):
        rep = fit.heads // fit.kv_heads
        if fit.tiled:
            what = (f"each of the {fit.kv_heads} key/value heads repeated {rep} times in a "
                    "row (h // n_rep) where the reference tiles them (h % kv_heads)")
        else:
            what = (f"the {fit.kv_heads} key/value heads tiled (query head h reads kv head "
                    f"h % {fit.kv_heads}) where the reference repeats each {rep} times "
                    f"(h // {rep})")
        yield Kind.PERMUTATION, what, with_(tiled=not fit.tiled)


def _fit_base(q, k, v, positions, fit: _Fit, project, judge: Judge
              ) -> tuple[float, float] | None:
    """The one frequency base that reproduces the port, searched over 10^1.5 .. 10^8."""
    def with_base(base: float) -> _Fit:
        return dataclasses.replace(fit, rope=_Rope(fit.rope.layout, base, fit.rope.sign))

    def energy(log_base: float) -> float:
        trial = with_base(10.0**log_base)
        return float(np.sum((judge.port - project(_attend(q, k, v, positions, trial))) ** 2))

    base = 10.0 ** _search(energy, 1.5, 8.0, 27)
    if abs(base / fit.rope.base - 1) < 1e-2:
        return None
    left = judge.accepts(project(_attend(q, k, v, positions, with_base(base))))
    return None if left is None else (base, left)


def _fit_scale(q, k, v, positions, fit: _Fit, project, judge: Judge
               ) -> tuple[float, float] | None:
    """The one score scale that reproduces the port, searched over a factor of e^5 each way
    of 1/sqrt(head_dim)."""
    def output(c: float) -> np.ndarray:
        return project(_attend(q, k, v, positions, dataclasses.replace(fit, scale=c)))

    centre = -0.5 * math.log(fit.head_dim)
    found = _search(lambda x: float(np.sum((judge.port - output(math.exp(x))) ** 2)),
                    centre - 5, centre + 5, 21)
    c = math.exp(found)
    if abs(c * math.sqrt(fit.head_dim) - 1) < 1e-3:
        return None
    left = judge.accepts(output(c))
    return None if left is None else (c, left)


def _search(energy, low: float, high: float, points: int) -> float:
    """A grid, then a golden-section search inside the best cell."""
    grid = np.linspace(low, high, points)
    best = int(np.argmin([energy(g) for g in grid]))
    low, high = grid[max(best - 1, 0)], grid[min(best + 1, points - 1)]
    golden = (math.sqrt(5) - 1) / 2
    for _ in range(30):
        a, b = high - golden * (high - low), low + golden * (high - low)
        if energy(a) < energy(b):
            high = b
        else:
            low = a
    return (low + high) / 2


# ---------------------------------------------------------------------------------------------
# A rotation between feature pairs, seen in the origin's own tensor


PAIR_GAP = 0.1         # pair norms must agree this many times better than the values do


def _pairings(width: int) -> Iterator[tuple[str, np.ndarray, np.ndarray]]:
    """The pairs a rotary embedding rotates in a last axis of ``width``: interleaved
    (x[2i], x[2i+1]), which needs no head width, then half-split (x[i], x[i+d/2]) within each
    head for every even head width d that divides the axis (d = 2 is the interleaved one)."""
    if width < 2 or width % 2:
        return
    yield ("interleaved pairs (x[2i], x[2i+1])", np.arange(0, width, 2),
           np.arange(1, width, 2))
    for d in range(4, width + 1, 2):
        if width % d:
            continue
        starts = (np.arange(width // d) * d)[:, None]
        first = (starts + np.arange(d // 2)[None, :]).ravel()
        yield f"half-split pairs (x[i], x[i+d/2]) of d = {d}", first, first + d // 2


def _pair_norms(values: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return np.sqrt(values[..., a] ** 2 + values[..., b] ** 2)


def _rms(values: np.ndarray) -> float:
    return float(np.sqrt(np.mean(np.square(values))))


def pair_norms_kept(judge: Judge) -> tuple[str, float, float] | None:
    """(pairing, pair norms' error rms, values' error rms) when, for one pairing of the last
    axis, the port's pairs have the reference's norms PAIR_GAP times more closely than its
    values have the reference's: what a rotation of each pair does (a rotary embedding's
    sign, base, positions), and no other error. A random error changes each pair's norm by
    about 1/sqrt(2) of its size; a recurrence or any other change of the values, by as much."""
    ref, port = judge.ref, judge.port
    if ref.ndim < 2:
        return None
    error = _rms(judge.error)
    if error == 0:
        return None
    for text, a, b in _pairings(ref.shape[-1]):
        gap = _rms(_pair_norms(port, a, b) - _pair_norms(ref, a, b))
        if gap <= PAIR_GAP * error:
            return text, gap, error
    return None


def rotation(judge: Judge, site: Site) -> Hint | None:
    """The port's tensor is the reference's with each feature pair turned by an angle that
    depends on its position and its pair only: the same turn in every batch element (and
    head), as a rotary embedding done otherwise makes (the sine's sign, another base, other
    positions). Asked of the origin's own tensor, where the rotated q or k is recorded (a
    rotary module, an op site): the pairs' norms agree with the reference's far better than
    the values do, and one angle per (position, pair), fitted over at least two samples each,
    leaves the error at the tolerance's scale. A recurrence from a zero state, whose error
    also starts at 0 and grows with the position, keeps no pair's norm."""
    ref = judge.ref
    if site.role != Role.OUTPUT or ref.ndim < 3:
        return None
    kept = pair_norms_kept(judge)
    if kept is None:
        return None
    pairing, gap, error = kept
    a, b = next((a, b) for text, a, b in _pairings(ref.shape[-1]) if text == pairing)
    zr = ref[..., a] + 1j * ref[..., b]
    zp = judge.port[..., a] + 1j * judge.port[..., b]
    for axis in range(1, ref.ndim - 1):
        samples = tuple(i for i in range(ref.ndim - 1) if i != axis)
        count = int(np.prod([ref.shape[i] for i in samples]))
        if count < 2:
            continue
        turn = np.sum(zp * np.conj(zr), axis=samples, keepdims=True)
        unit = np.where(np.abs(turn) > 0, turn / np.where(np.abs(turn) > 0, np.abs(turn), 1), 1)
        model_z = zr * unit
        model = np.empty_like(ref)
        model[..., a], model[..., b] = model_z.real, model_z.imag
        left = judge.accepts(model)
        if left is None:
            continue
        angles = np.angle(unit).reshape(ref.shape[axis], -1)   # (positions, pairs)
        what = (_against_input(judge, site, zr, zp, a, b, samples)
                or _turns(angles, _positions(site, ref.shape[axis])))
        return Hint(Kind.ROTARY, f"each feature pair, {pairing}, keeps its norm (pair norms "
                    f"differ by rms {gap:.2g}, the values by {error:.2g}) and is turned by an "
                    f"angle that depends on its position (axis {axis}) and its pair only, the "
                    f"same in all {count} batch elements and heads: a rotary embedding done "
                    f"otherwise, {what} ({left_text(left)})")
    return None


def _against_input(judge: Judge, site: Site, zr: np.ndarray, zp: np.ndarray, a: np.ndarray,
                   b: np.ndarray, samples: tuple[int, ...]) -> str | None:
    """When the site took the unrotated tensor (an input of the output's shape that the
    reference is a rotation of, one angle per (position, pair)): how the port's turn compares
    with the reference's, 'the sine negated' when it is the reference's turned back."""
    x = next((v for _, v in site.float_inputs() if v.shape == judge.ref.shape), None)
    if x is None:
        return None
    zx = x[..., a] + 1j * x[..., b]

    def turn(z: np.ndarray) -> np.ndarray:
        t = np.sum(z * np.conj(zx), axis=samples, keepdims=True)
        return np.where(np.abs(t) > 0, t / np.where(np.abs(t) > 0, np.abs(t), 1), 1)

    ref_turn, port_turn = turn(zr), turn(zp)
    if not judge.close(np.concatenate([(zx * ref_turn).real, (zx * ref_turn).imag], -1),
                       np.concatenate([zr.real, zr.imag], -1)):
        return None  # the reference is no rotation of this input
    theta_ref, theta_port = np.angle(ref_turn), np.angle(port_turn)
    size = float(np.max(np.abs(theta_ref)))
    if size > 0 and float(np.max(np.abs(np.angle(np.exp(1j * (theta_port + theta_ref)))))) \
            <= 1e-3 * size:
        return ("the sine negated: the port turns each pair of its input by -theta where "
                "the reference turns it by theta")
    return None


def _turns(angles: np.ndarray, positions: np.ndarray) -> str:
    """What the turn per (position, pair) looks like: growing with the position from none at
    position 0 (a frequency: the sine's sign, the base), or the same at every position (the
    positions offset)."""
    wrapped = np.angle(np.exp(1j * angles))
    size = float(np.max(np.abs(wrapped)))
    if size == 0:
        return "by no angle"
    at_zero = np.flatnonzero(positions == 0)
    if at_zero.size and float(np.max(np.abs(wrapped[at_zero[0]]))) <= 1e-3 * size:
        return ("no turn at position 0 and one that changes with the position (the "
                "rotation's sign or its frequencies: the sine negated, another base)")
    if float(np.max(np.abs(wrapped - wrapped[:1]))) <= 1e-3 * size:
        return "the same turn at every position (positions offset by a constant)"
    return "a turn at position 0 too (positions other than the reference's)"
