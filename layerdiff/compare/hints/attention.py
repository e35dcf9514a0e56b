"""Kinds found by recomputing an attention site from the reference's own q, k and v.

First the standard attention that reproduces the reference is found (the number of heads, the
score scale, which reading of the mask, the output projection); then variants of it are fitted
to the port: the softmax over the query axis (``axis``), the mask inverted, ignored, shifted or
off by one (``mask``), heads split or merged with a reshape (``transpose``), and last another
score scale (``scale``)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from layerdiff.trace.schema import Role

from ._common import Attention, Hint, Judge, Kind, Site, left_text, named, shift_mask, softmax

SCORES = 1 << 18       # attention recomputed on as many batch elements as keep scores below


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
    return softmax(scores, axis) @ v


@dataclass
class _AttentionFit:
    heads: int
    scale: float
    mask: np.ndarray | None       # bool, True = attend, (batch | 1, 1, Lq | 1, Lk)
    given: np.ndarray | None      # the part of ``mask`` the site's input gave (no causal part)
    causal: bool
    mask_text: str


def attention(judge: Judge, site: Site) -> Hint | None:
    parts = site.attention
    if parts is None or site.role != Role.OUTPUT:
        return None
    q, k, v = (np.asarray(a, np.float64) for a in (parts.q, parts.k, parts.v))
    context = np.asarray(parts.context, np.float64)
    if q.ndim != 3 or k.ndim != 3 or v.ndim != 3 or context.shape != q.shape[:2] + v.shape[2:]:
        return None
    if q.shape[-1] != k.shape[-1] or k.shape[:2] != v.shape[:2]:
        return None  # grouped key/value heads: see rotary
    project = next((p for p in _projections(parts) if judge.close(p(context), judge.ref)), None)
    if project is None:
        return None
    fitted = _fit_attention(q[:1], k[:1], v[:1], context[:1], _first(parts.mask, q), judge)
    if fitted is None:
        return None
    heads, scale, reading = fitted
    keep = max(1, SCORES // (heads * q.shape[1] * k.shape[1]))
    q, k, v, mask = q[:keep], k[:keep], v[:keep], _first(parts.mask, q, keep)
    judge = Judge(judge.ref[:keep], judge.port[:keep], judge.rtol, judge.atol)
    attend, given, causal, text = list(_mask_candidates(mask, q.shape[1], k.shape[1]))[reading]
    fit = _split_causal(_AttentionFit(heads, scale, attend, given, causal, text))
    for kind, text, variant in _attention_variants(q, k, v, fit):
        left = judge.accepts(project(variant()))
        if left is not None:
            return Hint(kind, f"{text}: this attention recomputed that way from the "
                        f"reference's q, k, v gives the port ({left_text(left)}; {fit.heads} "
                        f"heads, {fit.mask_text}, as checked on the reference)")
    scale = _fit_scale(q, k, v, fit, project, judge)
    if scale is not None:
        c, left = scale
        return Hint(Kind.SCALE, f"attention scores scaled by {c:.4g}{named(c)} where the "
                    f"reference scales by {fit.scale:.4g}{named(fit.scale)}: this attention "
                    f"recomputed that way from the reference's q, k, v gives the port "
                    f"({left_text(left)}; {fit.heads} heads, {fit.mask_text})")
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


def _fit_attention(q, k, v, context, mask, judge: Judge) -> tuple[int, float, int] | None:
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
            moved = shift_mask(given, shift)
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


def _fit_scale(q, k, v, fit: _AttentionFit, project, judge: Judge
               ) -> tuple[float, float] | None:
    """The one score scale that reproduces the port, searched over a factor of e^5 each way."""
    qh, kh, vh = _heads(q, fit.heads), _heads(k, fit.heads), _heads(v, fit.heads)
    products = qh @ np.swapaxes(kh, -1, -2)  # the scores before scaling, once

    def attend(c: float) -> np.ndarray:
        scores = c * products
        if fit.mask is not None:
            scores = np.where(fit.mask, scores, -1e9)
        return project(_merge(softmax(scores, -1) @ vh))

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
