"""Kinds where the port holds the reference's values in another arrangement: ``transpose``
(axes swapped or permuted, a reshape or view where a transpose belonged, a square weight applied
transposed) and ``permutation`` (the chunks of one axis reordered: gates, heads, channels)."""

from __future__ import annotations

import itertools

import numpy as np

from ._common import NOISE, Hint, Judge, Kind, Site, left_text

MAX_PERMUTED_CHUNKS = 64


# Sorted values compared first at this many of each end: a partition finds them in one pass,
# where the full sort of a 2^20-element origin cost 50-80 ms a side (measured, bench_diff).
TAIL = 64
SAMPLE = 4096  # values whose TAIL-th smallest bounds the candidates for the smallest TAIL


def _same_values(judge: Judge) -> bool:
    """A rearrangement keeps the values: the sorted tensors agree (a cheap first test). Asked by
    both layout kinds of one origin, so answered once per judge. The smallest and largest
    ``TAIL`` values are compared first: they are the sorted tensors' first and last elements,
    so a gap there is the full test's answer, and errors that are not rearrangements (noise,
    a scale) show there first; only tensors whose ends agree are sorted whole."""
    known = judge.memo.get("same_values")
    if known is None:
        known = judge.memo["same_values"] = (
            _sorted_agree(*_ends(judge.ref), *_ends(judge.port), judge)
            and _sorted_agree(np.sort(judge.ref, axis=None), None,
                              np.sort(judge.port, axis=None), None, judge))
    return known


def _ends(values: np.ndarray) -> tuple[np.ndarray, np.ndarray | None]:
    """(smallest TAIL values, largest TAIL values), each sorted; the whole tensor sorted and
    None when it is not larger than both ends."""
    flat = values.ravel()
    if flat.size <= 2 * TAIL:
        return np.sort(flat), None
    return _smallest(flat), -_smallest(-flat)[::-1]


def _smallest(flat: np.ndarray) -> np.ndarray:
    """The TAIL smallest values, sorted. A sample's TAIL-th smallest is at least the whole
    tensor's (the tensor holds the sample), so the values up to it hold the answer: one
    comparison pass, then a partition of a few thousand values instead of the tensor."""
    sample = flat[::max(1, flat.size // SAMPLE)]
    limit = np.partition(sample, TAIL - 1)[TAIL - 1]
    candidates = flat[flat <= limit]
    return np.sort(np.partition(candidates, TAIL - 1)[:TAIL])


def _sorted_agree(ref_low: np.ndarray, ref_high: np.ndarray | None, port_low: np.ndarray,
                  port_high: np.ndarray | None, judge: Judge) -> bool:
    """Whether sorted values agree element by element within NOISE tolerances."""
    for ref, port in ((ref_low, port_low), (ref_high, port_high)):
        if ref is None or port is None:
            continue
        bound = judge.atol + judge.rtol * np.abs(ref)
        if not np.all(np.abs(port - ref) <= NOISE * np.maximum(bound, 1e-300)):
            return False
    return True


def transpose(judge: Judge, site: Site) -> Hint | None:
    ref, shape = judge.ref, judge.ref.shape
    if ref.ndim < 2 or not _same_values(judge):
        return None
    ndim = ref.ndim
    swaps = _swaps(ndim)
    # every other order of the axes, read as the shape too (a reshape for a transpose), while
    # there are few (24 for 4 axes)
    others = [p for p in (itertools.permutations(range(ndim)) if ndim <= 4 else ())
              if p not in swaps]
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
            return Hint(Kind.TRANSPOSE, f"port = reference with {what} ({left_text(left)})")
        return Hint(Kind.TRANSPOSE, f"a reshape or view where a transpose belonged: port = "
                    f"reference transposed to axes {tuple(perm)} {_shape(moved.shape)} and read "
                    f"as {_shape(shape)} ({left_text(left)})")
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


def permutation(judge: Judge, site: Site) -> Hint | None:
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
                            f"({left_text(left)})")
    return None


def linear_transposed(judge: Judge, site: Site) -> Hint | None:
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
                f"({left_text(left)})")
