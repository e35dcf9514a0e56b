"""When two shapes hold the same tensor: the one rule the diff and replay share.

Two shapes hold the same elements in the same row-major order when one is the other with runs
of adjacent axes merged (or split), axes of size 1 aside: Hugging Face's position ids (1, T)
against a port's (T); a block's output (1, T, D) against (T, D); a projection's (B, T, N*H)
against a port's (B, T, N, H). The diff compares such a pair as flat views, with a note, and
replay reshapes a recorded gradient into the port's shape before its backward. A transpose
never passes. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from layerdiff.trace import schema


def unit_axes_apart(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two shapes differ, and only by axes of size 1."""
    a, b = tuple(a), tuple(b)
    return a != b and [n for n in a if n != 1] == [n for n in b if n != 1]


def same_order(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two different shapes hold the same elements in the same row-major order by
    their shapes alone: one is the other with runs of adjacent axes merged, axes of size 1
    aside (tokens (B*T, D) against (B, T, D)). Each axis of the coarser shape then ends where
    an axis of the finer one ends: the products of the coarser's leading axes are among the
    finer's. A transpose never passes ((B, N, T, H) against (B, T, N, H): B*N is no product of
    (B, T, N, H)'s leading axes unless N is T, and then the shapes are equal and no reshape is
    assumed), nor does a merge on one side with a split elsewhere on the other."""
    a, b = tuple(a), tuple(b)
    size = int(np.prod(a, dtype=np.int64))
    if a == b or size != int(np.prod(b, dtype=np.int64)):
        return False
    if size == 0:  # every product is 0: axes of size 1 only
        return unit_axes_apart(a, b)
    ends_a, ends_b = _leading_products(a), _leading_products(b)
    return ends_a <= ends_b or ends_b <= ends_a


def _leading_products(shape: tuple[int, ...]) -> set[int]:
    products, running = set(), 1
    for n in shape:
        if n != 1:  # an axis of size 1 ends nowhere new
            running *= int(n)
            products.add(running)
    return products


def same_elements(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether an array of shape ``a`` holds, in row-major order, what one of shape ``b``
    does: the same shape, or :func:`same_order`."""
    return tuple(a) == tuple(b) or same_order(a, b)


def as_shape(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``array`` in ``shape`` when the two hold the same elements (:func:`same_elements`);
    else ``array`` as it is, for the caller to refuse."""
    shape = tuple(shape)
    return array.reshape(shape) if same_order(array.shape, shape) else array


def reshape_note(ref_shape: tuple[int, ...], port_shape: tuple[int, ...]) -> str:
    """The note on a row whose shapes differ only by a reshape (see :func:`same_order`)."""
    ref, port = schema.format_shape(ref_shape), schema.format_shape(port_shape)
    if unit_axes_apart(ref_shape, port_shape):
        return (f"shapes differ by axes of size 1 (reference ({ref}), port ({port})): the "
                "same elements in the same order, compared")
    return (f"the same elements in the same order, shapes ({ref}) and ({port}) (adjacent axes "
            "merged on one side): compared as flat views, no rule needed")
