"""Likely-cause hints: what kind of porting mistake makes an origin's error look like it does.

Pure numpy. Each kind is a model of the port's tensor built from the reference's own tensors at
the origin (its output, inputs, weights, incoming gradient), with at most a few fitted numbers.
A model is accepted only when both hold (see :class:`~._common.Judge`):

- it removes at least 99% of the error energy: ``|port - model|^2 <= 0.01 |port - ref|^2``;
- what it leaves is noise at the tolerance's scale: ``|port - model| <= 4 (atol + rtol |ref|)``
  element by element (4: the fitted numbers and a float64 recomputation of the port's float32
  arithmetic have errors of their own).

Models with structure of their own (a linear layer, a softmax, attention, a normalization) are
first checked to reproduce the *reference* from the same tensors; only then is a variant of it
fitted to the port. Where no model passes, there is no hint: a random error gets none.

The kinds are tried in a fixed order (:data:`TESTS`), from the models with the fewest free
numbers to precision, then the structural descriptions (which positions or batch elements are
wrong), which an error of rounding's size must not be read as. One module per family:

- ``_common``: the vocabulary (Kind, Hint, Attention), the acceptance rule, the site's tensors;
- ``elementwise``: sign, scale, missing-term, approximation, precision;
- ``layout``: transpose (axes, reshapes, a weight applied transposed), permutation;
- ``normalization``: axis (a softmax over another axis; a norm backward over other axes),
  epsilon (fitted >= 0), weight-offset (a norm's weight as w where it is (1 + w), or back);
- ``attention``: attention recomputed from q, k, v (axis, mask, transpose, scale);
- ``positions``: position-shift (the port's positions the reference's moved by one or two,
  within tolerance); mask and batch, told by where the error is (rows where the reference is
  exactly 0 too; a mask input is boolean or 0/1, never position ids; position 0 alone exact
  with a growing error and each feature pair's norm kept: rotary); two boolean masks;
- ``rotary``: a decoder's attention with RoPE and grouped kv heads recomputed (rotary,
  permutation of kv heads, tables rounded to a lower dtype: precision); a rotation of each
  feature pair seen in the origin's own tensor (rotary);
- ``activation``: another activation function, at its site or inside a module;
- ``recurrent``: an LSTM's or GRU's gates in another order (permutation).
"""

from __future__ import annotations

import numpy as np

from . import (
    activation,
    attention,
    elementwise,
    layout,
    normalization,
    positions,
    recurrent,
    rotary,
)
from ._common import Attention, Child, Hint, Judge, Kind, Site, Test

__all__ = ["Attention", "Child", "Hint", "Kind", "hint"]

MIN_VALUES = 8         # fewer values than this: no hint

# The order the kinds are tried in: the first that accepts names the hint.
TESTS: list[Test] = [
    # no number fitted: a norm's weight as (1 + w) on one side, w on the other (before scale,
    # which a constant w would also satisfy, less precisely)
    elementwise.sign, normalization.weight_offset, elementwise.scale, elementwise.missing_term,
    # a sequence's positions moved by one or two, no number fitted: before permutation, which
    # a roll (positions reordered in a circle) also satisfies, less specifically
    layout.transpose, positions.shift, layout.permutation, layout.linear_transposed,
    recurrent.gate_order,
    normalization.axis, normalization.backward_axis, rotary.rotary, attention.attention,
    normalization.epsilon,
    elementwise.approximation, activation.activation,
    # rounding to a lower dtype before any pattern of *where* the error is: an error of
    # rounding's size can fall in some batch elements or positions more than others, and
    # where it falls is then no evidence of a mask or a batch mix
    elementwise.precision,
    # a rotation of each feature pair by an angle of the position and the pair alone: asked
    # before where the error is, as a rotary mistake leaves position 0 exact (a mask's look)
    rotary.rotation,
    positions.mask_input, positions.zero_rows, positions.batch, positions.positions,
]


def hint(ref: np.ndarray, port: np.ndarray, *, role: str, rtol: float, atol: float,
         inputs: dict[str, np.ndarray] | None = None,
         weights: dict[str, np.ndarray] | None = None,
         grad_output: np.ndarray | None = None,
         attention: Attention | None = None,
         children: list[Child] | None = None, full_precision: str = "",
         where: str = "") -> Hint | None:
    """The likely cause of the difference between ``ref`` and ``port`` at an origin, or None.

    ``role`` is the origin's (output, grad_input, weight_grad, weight); ``rtol`` and ``atol``
    its tolerance. The reference's tensors of the same site make more kinds testable:
    ``inputs`` (argument -> tensor, masks included), ``weights`` (parameter -> tensor),
    ``grad_output`` (for a backward origin), ``attention`` (see :class:`Attention`) and
    ``children`` (what the site's sub-modules recorded, in call order). ``full_precision``:
    the port's dtype when it runs in float32 or float64 everywhere else (a lower dtype's
    numbers at the origin are then one tensor's, not the port's); ``where`` names the
    origin's record.
    """
    if np.asarray(ref).dtype == bool and np.asarray(port).dtype == bool:
        return positions.boolean(np.asarray(ref), np.asarray(port))
    ref = np.asarray(ref, dtype=np.float64)
    port64 = np.asarray(port, dtype=np.float64)
    if ref.shape != port64.shape or ref.size < MIN_VALUES:
        return None  # a scalar (a loss) fits any one-number model: no evidence either way
    if not (np.isfinite(ref).all() and np.isfinite(port64).all()):
        return None  # a NaN origin: where the first non-finite came from is another question
    judge = Judge(ref, port64, rtol, atol)
    if judge.energy == 0 or float(np.max(judge.ratio)) <= 1:
        return None  # within tolerance: no error to explain
    site = Site(role, inputs or {}, weights or {}, grad_output, attention,
                children or [], full_precision, where)
    for test in TESTS:
        found = test(judge, site)
        if found is not None:
            return found
    return None
