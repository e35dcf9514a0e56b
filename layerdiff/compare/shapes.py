"""When two shapes hold the same tensor: the one rule the diff and replay share.

Two shapes that differ only by axes of size 1 (Hugging Face's position ids (1, T) against a
port's (T); a block's output (1, T, D) against (T, D)) put the same elements in the same
places in row-major order, so the diff compares them element by element and replay reshapes
a recorded gradient into the port's shape before its backward. No torch here.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def unit_axes_apart(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether two shapes differ, and only by axes of size 1."""
    a, b = tuple(a), tuple(b)
    return a != b and [n for n in a if n != 1] == [n for n in b if n != 1]


def same_elements(a: Sequence[int], b: Sequence[int]) -> bool:
    """Whether an array of shape ``a`` holds, in row-major order, what one of shape ``b``
    does: the same shape, or shapes apart only by axes of size 1."""
    return tuple(a) == tuple(b) or unit_axes_apart(a, b)


def as_shape(array: np.ndarray, shape: Sequence[int]) -> np.ndarray:
    """``array`` in ``shape`` when the two hold the same elements (:func:`same_elements`);
    else ``array`` as it is, for the caller to refuse."""
    shape = tuple(shape)
    return array.reshape(shape) if unit_axes_apart(array.shape, shape) else array
