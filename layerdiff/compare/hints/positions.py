"""Kinds told by *where* the error is rather than by a model of its values: ``mask`` (the error
exactly where the site's mask input masks, or at a run of whole positions from one end; or two
boolean mask tensors that differ), ``batch`` (the error only in some batch elements) and
``position-shift`` (the port's positions are the reference's moved by one or two).

A pattern counts only when it is clear-cut and could not come from scattered errors by chance
(see :func:`_separated`)."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator

import numpy as np

from layerdiff.compare.judge import element_ratios
from layerdiff.trace.schema import PARAM_ROLES, RESULT_ROLES

from ._common import NOISE, Hint, Judge, Kind, Site, shift_mask
from .rotary import pair_norms_kept

CHANCE = 1e-6          # a pattern of where the error is must be this unlikely by chance


# ---------------------------------------------------------------------------------------------
# Two boolean tensors (masks as buffers or inputs)


def boolean(ref: np.ndarray, port: np.ndarray) -> Hint | None:
    """Two boolean tensors (masks, as buffers or inputs) that differ: how."""
    if ref.shape != port.shape or np.array_equal(ref, port):
        return None
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
            if np.array_equal(port, shift_mask(ref, shift)):
                return Hint(Kind.MASK, f"the port's mask is the reference's shifted by {shift} "
                            "along its last axis: off by one")
    differ = int(np.sum(ref != port))
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
# Where the error is: positions a mask selects, batch elements, a run of positions


def _slices(judge: Judge, axes: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Per index of ``axes``: the worst ratio, and the fraction of values out of tolerance."""
    reduce = tuple(a for a in range(judge.ratio.ndim) if a not in axes)
    return judge.ratio.max(axis=reduce), (judge.ratio > 1).mean(axis=reduce)


def mask_input(judge: Judge, site: Site) -> Hint | None:
    ref = judge.ref
    if site.role not in RESULT_ROLES or ref.ndim < 2:
        return None
    for name, mask in site.masks():
        if not mask_shaped(name, mask):
            continue  # position ids, token ids: where they are 0 is no mask
        for pattern, what in _mask_patterns(mask, ref.shape):
            worst, _ = _slices(judge, tuple(range(pattern.ndim)))
            bad = worst > 1
            if not np.array_equal(bad, pattern) or not _separated(judge, worst, bad) \
                    or not _apart(judge, tuple(range(pattern.ndim)), bad):
                continue
            where = ("batch elements" if pattern.ndim == 1 else "(batch, position) rows")
            return Hint(Kind.MASK, f"the error is exactly at the {int(pattern.sum())} {where} "
                        f"{what} of input '{name}' and nowhere else (up to "
                        f"{_x(worst[pattern].max())} there, {_x(worst[~pattern].max())} "
                        "elsewhere)")
    return None


def mask_shaped(name: str, values: np.ndarray) -> bool:
    """Whether an integer or boolean input can be a mask: boolean, or integers that are all 0
    or 1, and not named as positions. Position ids (0, 1, 2, ... per row) are 0 at the first
    position only, and a position-dependent error there (a rotary embedding's, exact at
    position 0) would otherwise read as 'the error is where the mask is nonzero'."""
    if "position" in name.lower():
        return False
    values = np.asarray(values)
    return values.dtype == bool or bool(np.all((values == 0) | (values == 1)))


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


def zero_rows(judge: Judge, site: Site) -> Hint | None:
    """The error only in whole rows where the reference is exactly 0: positions the
    reference masks out (padding) or a parameter row it never updates (an embedding's
    padding_idx) that the port gives a value or a gradient. Rows are the first axis (a
    parameter's rows, a batch's elements) or the first two ((batch, position))."""
    ref = judge.ref
    if ref.ndim < 2:
        return None
    for lead in (2, 1) if ref.ndim >= 3 and site.role not in PARAM_ROLES else (1,):
        rest = tuple(range(lead, ref.ndim))
        zero = np.all(ref == 0, axis=rest)
        if not zero.any() or zero.all():
            continue
        worst = judge.ratio.max(axis=rest)
        bad = worst > 1
        if not bad.any() or np.any(bad & ~zero) or worst[bad].min() <= NOISE \
                or worst[~bad].max() > 1:
            continue
        # by chance: every value out of tolerance falling in the zero rows, were they
        # scattered at random, has probability (share of the zero rows) ^ (values out)
        out = int(np.sum(judge.ratio > 1))
        if out * math.log(float(np.mean(zero))) > math.log(CHANCE):
            continue
        rows = "rows" if lead == 1 else "(batch, position) rows"
        where = (f"row(s) {_ranges(np.flatnonzero(bad))}" if lead == 1
                 else f"{int(bad.sum())} (batch, position) rows")
        return Hint(Kind.MASK, f"the error is only at {where}, where the reference's value is "
                    f"exactly 0 ({int(zero.sum())} of {zero.size} {rows} are): masked or "
                    f"padding positions (a padding_idx) that get a value in the port (up to "
                    f"{_x(worst[bad].max())} there, {_x(worst[~bad].max())} elsewhere)")
    return None


def batch(judge: Judge, site: Site) -> Hint | None:
    if site.role in PARAM_ROLES or judge.ref.ndim < 2 or judge.ref.shape[0] < 2:
        return None
    worst, _ = _slices(judge, (0,))
    bad = worst > 1
    if not _separated(judge, worst, bad) or not _apart(judge, (0,), bad):
        return None
    within = np.flatnonzero(~bad)
    return Hint(Kind.BATCH, f"the error is only in batch elements {_ranges(np.flatnonzero(bad))}"
                f" ({int(bad.sum())} of {bad.size}, {worst[bad].min():.3g}x to "
                f"{_x(worst[bad].max())}); element(s) {_ranges(within)} within tolerance (at "
                f"most {_x(worst[within].max())})")


def positions(judge: Judge, site: Site) -> Hint | None:
    """Whole positions of one axis (not the batch axis nor the last, feature axis) wrong, in
    one run from either end, the rest within tolerance: a mask or a boundary off by one."""
    ref = judge.ref
    if site.role in PARAM_ROLES or ref.ndim < 3:
        return None
    for axis in range(1, ref.ndim - 1):
        worst, out = _slices(judge, (axis,))
        bad = worst > 1
        if not _separated(judge, worst, bad) or out[bad].min() < 0.25 \
                or not _apart(judge, (axis,), bad):
            continue
        where = np.flatnonzero(bad)
        contiguous = where[-1] - where[0] + 1 == where.size
        if not contiguous or (where[0] != 0 and where[-1] != bad.size - 1):
            continue
        within = np.flatnonzero(~bad)
        if _all_zero(judge, axis, within):
            continue  # zero on both sides (a gradient that never reaches them): no boundary
        if within.tolist() == [0]:
            # not a mask's boundary; a rotary frequency when the error grows with position,
            # else nothing (a causal softmax is exact at position 0 whatever its scores)
            return _rotary_signature(judge, axis, worst)
        return Hint(Kind.MASK, f"a mask or a boundary off: the error is only at positions "
                    f"{_ranges(where)} of axis {axis} (of {bad.size}), whole; positions "
                    f"{_ranges(within)} within tolerance")
    return None


def _all_zero(judge: Judge, axis: int, positions: np.ndarray) -> bool:
    """Whether both sides are exactly zero at every one of ``positions`` of ``axis``: a loss
    that leaves the last position without a target sends it no gradient, so it is "within"
    whatever the code computes, and says nothing of where a mask's boundary is."""
    ref = np.take(judge.ref, positions, axis=axis)
    port = np.take(judge.port, positions, axis=axis)
    return bool(positions.size) and not np.any(ref) and not np.any(port)


MIN_ROTATED = 4        # positions: fewer and "only position 0 exact" is no pattern


GROWTH = 3.0           # rotary frequency: the error at the last positions over position 1's
RANK_CORRELATION = 0.8  # and the error's rank correlation with the position, at least


def _rotary_signature(judge: Judge, axis: int, worst: np.ndarray) -> Hint | None:
    """Position 0 exact and every later one wrong, the error growing with the position: a
    rotary frequency (base, scaling) done otherwise. Rotation by position x frequency is the
    identity at position 0, and a frequency off by dw turns position p by p dw too far, an
    error 2 sin(p dw / 2) that grows about linearly from position 1. A mask's boundary shows
    elsewhere (a causal mask off leaves the last position, which sees every key either way,
    exact). Position 0 exact with an error that does not grow is told by nothing here: any
    change to a causal softmax's scores (scale, a rotation's sign) leaves position 0, which
    attends to itself alone, exact. And growth alone is no rotation: a recurrence from a zero
    state grows its error with every step too; the rotation's own evidence, each feature
    pair's norm kept (:func:`~.rotary.pair_norms_kept`), is asked as well."""
    reduce = tuple(a for a in range(judge.error.ndim) if a != axis)
    rms = np.sqrt(np.mean(judge.error**2, axis=reduce))[1:]
    if rms.size < MIN_ROTATED:
        return None
    kept = pair_norms_kept(judge)
    if kept is None:
        # growth with the position alone is no rotation: a recurrence from a zero state (a
        # selective scan, an RNN with another decay) is exact at position 0 and drifts more
        # with every step; a rotation keeps each feature pair's norm, and nothing else does
        return None
    tail = float(np.mean(rms[-max(1, rms.size // 4):]))
    ranks = np.argsort(np.argsort(rms))
    correlation = float(np.corrcoef(ranks, np.arange(rms.size))[0, 1])
    if not (tail >= GROWTH * rms[0] and correlation >= RANK_CORRELATION):
        return None
    last, middle = rms.size, rms.size // 2 + 1
    return Hint(Kind.ROTARY, f"position 0 exact ({worst[0]:.2g}x tolerance) and every later "
                f"position of axis {axis} wrong, the error growing with the position (rms "
                f"{rms[0]:.2g} at position 1, {rms[middle - 1]:.2g} at {middle}, "
                f"{rms[-1]:.2g} at {last}; rank correlation {correlation:.2f}), each "
                f"feature pair ({kept[0]}) keeping its norm (pair norms differ by rms "
                f"{kept[1]:.2g}, the values by {kept[2]:.2g}): a rotary frequency (its base or "
                "scaling) other than the reference's, not a mask boundary")


# ---------------------------------------------------------------------------------------------
# The port's positions moved: port position p holds the reference's position p + s


SHIFTS = (1, -1, 2, -2)  # the moves tried, one position first (what off-by-one bugs make)
MIN_SHIFTED = 4        # positions a shift must explain (out unshifted, within shifted), at least


def shift(judge: Judge, site: Site) -> Hint | None:
    """Port position p equal, within the record's own tolerance, to the reference's position
    p + s at every position both have, along one axis, while unshifted most positions are far
    out: positions or labels counted from 1, a roll with the wrong sign, a causal convolution
    or cache padded on the wrong side, a position embedding indexed one off.

    Evidence, each part of which chance or another cause cannot give:
    - shifted, every value of the overlap within tolerance (ratio <= 1, the verdict's own
      test: nothing is recomputed, the port's values are compared with the reference's as
      recorded, so no allowance for a recomputation's error is due);
    - unshifted, at least MIN_SHIFTED positions and half the overlap beyond NOISE tolerances:
      the shift is what explains the error, not a few positions (a value within 1 of its
      neighbour and beyond 4 of its own position's has neighbours 3 tolerances apart, so a
      sequence constant along the axis, whose shift matches trivially, cannot pass; it is
      skipped outright all the same);
    - not by chance: each value the shift brings within tolerance could land there by
      coincidence with probability q, how often a port value is within tolerance of a
      reference value drawn at random (discrete values, a ReLU's zeros, coincide often); all
      m of them doing so, q^m, times the (axis, shift) pairs tried, must be under CHANCE.
    The batch axis (axis 0 of 3 or more) is not shifted; every batch element must show the
    same shift along the axis, since the positions are moved inside each one."""
    ref = judge.ref
    if site.role in PARAM_ROLES or ref.ndim < 1:
        return None
    axes = [a for a in (range(1, ref.ndim) if ref.ndim >= 3 else range(ref.ndim))
            if ref.shape[a] > MIN_SHIFTED]
    tried = len(axes) * len(SHIFTS)
    for axis in axes:
        worst, _ = _slices(judge, (axis,))
        if int(np.sum(worst > NOISE)) < MIN_SHIFTED or _constant_along(judge, axis):
            continue
        for by in SHIFTS:
            found = _shifted(judge, axis, by, worst, tried)
            if found is not None:
                return found
    return None


def _constant_along(judge: Judge, axis: int) -> bool:
    """Every position of ``axis`` within tolerance of the first: any shift matches."""
    first = np.take(judge.ref, [0], axis=axis)
    ratio = element_ratios(np.broadcast_to(first, judge.ref.shape), judge.ref,
                           judge.rtol, judge.atol)
    return bool(np.max(ratio, initial=0.0) <= 1)


def _shifted(judge: Judge, axis: int, by: int, worst: np.ndarray, tried: int) -> Hint | None:
    size = judge.ref.shape[axis]
    ours = np.arange(max(0, -by), size - max(0, by))  # port positions with a partner
    explained = worst[ours] > NOISE
    if int(explained.sum()) < max(MIN_SHIFTED, math.ceil(ours.size / 2)):
        return None
    first = int(ours[np.argmax(explained)])  # one position first: most candidates fail there
    if not float(np.max(element_ratios(np.take(judge.ref, [first + by], axis=axis),
                                       np.take(judge.port, [first], axis=axis),
                                       judge.rtol, judge.atol))) <= 1:
        return None
    port = np.take(judge.port, ours, axis=axis)
    partner = np.take(judge.ref, ours + by, axis=axis)
    moved = element_ratios(partner, port, judge.rtol, judge.atol)
    if not float(np.max(moved)) <= 1:
        return None
    fixed = np.take(judge.ratio, ours, axis=axis) > 1  # the values the shift brings within
    if not _not_chance(judge, int(fixed.sum()), tried):
        return None
    return Hint(Kind.SHIFT, _shift_text(judge, axis, by, ours, worst, float(np.max(moved))))


COINCIDENCE_SAMPLE = 1 << 16  # port values q is measured on, at most about (evenly spread)


def _not_chance(judge: Judge, fixed: int, tried: int) -> bool:
    """Whether ``fixed`` values all landing within tolerance of their shifted partners is
    beyond coincidence: q^fixed * tried < CHANCE, q the probability that one of the port's
    values is within tolerance of a reference value drawn at random (every port value against
    every reference value, counted on the sorted reference; the tolerance taken at the port's
    value, which differs from the reference's by rtol x a tolerance). Discrete values (ids,
    a ReLU's zeros) coincide often and need more evidence; continuous ones almost never."""
    ref = np.sort(judge.ref.ravel())
    port = np.sort(judge.port.ravel()[:: max(1, judge.port.size // COINCIDENCE_SAMPLE)])
    width = judge.atol + judge.rtol * np.abs(port)
    hits = (np.searchsorted(ref, port + width, side="right")
            - np.searchsorted(ref, port - width, side="left"))
    rate = float(np.mean(hits)) / ref.size
    if rate == 0:
        return True
    return fixed * math.log(rate) + math.log(tried) <= math.log(CHANCE)


WORDS = {1: "one", 2: "two"}


def _shift_text(judge: Judge, axis: int, by: int, ours: np.ndarray, worst: np.ndarray,
                moved: float) -> str:
    size, step = judge.ref.shape[axis], abs(by)
    plus = f"p{'+' if by > 0 else '-'}{step}"
    edges = np.setdiff1d(np.arange(size), ours)
    words = WORDS.get(step, str(step))
    how = (f"runs {words} position{'s' if step > 1 else ''} ahead (positions or labels "
           "counted from one more, a roll toward the start, a pad or cache on the wrong side)"
           if by > 0 else
           f"lags {words} position{'s' if step > 1 else ''} behind (a causal shift applied "
           "twice, a roll toward the end, a pad or cache on the wrong side)")
    where = " in every batch element" if judge.ref.ndim >= 3 else ""
    edge = _edge_text(judge, axis, by, edges)
    return (f"port position p of axis {axis} holds the reference's position {plus} for every "
            f"p in {_ranges(ours)}{where} (every value within tolerance, the worst at "
            f"{moved:.2g}x), where unshifted {int(np.sum(worst[ours] > 1))} of {ours.size} "
            f"positions are out (up to {_x(float(worst.max()))}): the port's sequence {how}; "
            f"position{'s' if edges.size > 1 else ''} {_ranges(edges)} "
            f"{'have' if edges.size > 1 else 'has'} no partner ({edge})")


def _edge_text(judge: Judge, axis: int, by: int, edges: np.ndarray) -> str:
    """What the port holds at the positions without a partner: zeros (a pad), the
    reference's other end (a roll), or values out or within as they are."""
    port = np.take(judge.port, edges, axis=axis)
    if not np.any(port):
        return "the port's values there are 0: a pad"
    wrapped = np.take(judge.ref, (edges + by) % judge.ref.shape[axis], axis=axis)
    if float(np.max(element_ratios(wrapped, port, judge.rtol, judge.atol))) <= 1:
        return (f"the port holds the reference's position{'s' if edges.size > 1 else ''} "
                f"{_ranges((edges + by) % judge.ref.shape[axis])} there: a roll")
    ratio = float(np.max(np.take(judge.ratio, edges, axis=axis)))
    return f"{_x(ratio)} there unshifted"


GAP = 10.0             # wrong slices' relative error over the clean slices' largest, at least


def _apart(judge: Judge, axes: tuple[int, ...], bad: np.ndarray) -> bool:
    """The wrong slices' error, relative to their size, at least GAP times every clean
    slice's: a bug changes the wrong slices' values while the others keep theirs, whereas
    rounding (a lower-precision port) is in every slice at a size that differs between
    slices by a few times, and crosses the tolerance in some of them only."""
    reduce = tuple(a for a in range(judge.error.ndim) if a not in axes)
    error = np.sqrt(np.mean(judge.error**2, axis=reduce))
    size = np.sqrt(np.mean(judge.ref**2, axis=reduce))
    with np.errstate(divide="ignore", invalid="ignore"):
        relative = np.where(size > 0, error / np.where(size > 0, size, 1),
                            np.where(error > 0, np.inf, 0.0))
    return bool(relative[bad].min() >= GAP * relative[~bad].max())


def _separated(judge: Judge, worst: np.ndarray, bad: np.ndarray) -> bool:
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
