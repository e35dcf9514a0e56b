"""``permutation`` of a recurrent cell's gates: an LSTM or GRU written by hand (or loaded from
another framework's layout) that splits its gate pre-activations in another order than the
reference's weights hold them (torch: LSTM (i, f, g, o), GRU (r, z, n)).

The site is torch's own ``nn.LSTM`` / ``nn.GRU`` layout, one layer, one direction: its weights
``weight_ih_l0`` (G hidden, input), ``weight_hh_l0`` (G hidden, hidden) and biases. The cell is
first run over the reference's input with torch's order and checked to give the reference's
recorded tensor (the sequence of outputs, or the last hidden or cell state); then every other
order of the gates is run and fitted to the port."""

from __future__ import annotations

import itertools

import numpy as np

from layerdiff.trace.schema import Role

from ._common import Hint, Judge, Kind, Site, left_text

ORDERS = {4: "ifgo", 3: "rzn"}   # torch's order of the chunks, LSTM and GRU


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * x))


def _run(x: np.ndarray, w_ih, w_hh, b_ih, b_hh, order: str) -> list[np.ndarray]:
    """x (batch, length, input): [outputs (batch, length, hidden), h_n (1, batch, hidden)] and
    c_n for an LSTM; ``order`` names what each chunk of the weights' rows is read as."""
    batch, length, _ = x.shape
    hidden = w_hh.shape[1]
    h = np.zeros((batch, hidden))
    c = np.zeros((batch, hidden))
    gi_all = x @ w_ih.T + b_ih
    outputs = []
    for t in range(length):
        gi = dict(zip(order, np.split(gi_all[:, t], len(order), axis=1), strict=True))
        gh = dict(zip(order, np.split(h @ w_hh.T + b_hh, len(order), axis=1), strict=True))
        if len(order) == 4:
            g = {k: gi[k] + gh[k] for k in order}
            c = _sigmoid(g["f"]) * c + _sigmoid(g["i"]) * np.tanh(g["g"])
            h = _sigmoid(g["o"]) * np.tanh(c)
        else:
            r = _sigmoid(gi["r"] + gh["r"])
            z = _sigmoid(gi["z"] + gh["z"])
            n = np.tanh(gi["n"] + r * gh["n"])
            h = (1 - z) * n + z * h
        outputs.append(h)
    out = [np.stack(outputs, 1), h[None]]
    return [*out, c[None]] if len(order) == 4 else out


def _recurrent_shape(matrix: np.ndarray) -> bool:
    """(G hidden, hidden) for G gates."""
    return any(matrix.shape[0] == g * matrix.shape[1] for g in ORDERS)


def _cell_weights(weights: dict) -> tuple | None:
    """(w_ih, w_hh, b_ih, b_hh, torch's order) from the site's parameters: torch's names
    (``weight_ih_l0`` ...: nn.LSTM, nn.GRU; ``weight_ih`` ...: the cells), or else by shape: two
    matrices of G x hidden rows, one of them (G hidden, hidden), G = 4 (LSTM) or 3 (GRU), and
    biases of G hidden values (named with 'ih' / 'hh', or one bias)."""
    matrices = {n: np.asarray(v, np.float64) for n, v in weights.items() if np.ndim(v) == 2}
    vectors = {n: np.asarray(v, np.float64) for n, v in weights.items() if np.ndim(v) == 1}
    for suffix in ("_l0", ""):
        if f"weight_ih{suffix}" in matrices and f"weight_hh{suffix}" in matrices:
            w_ih, w_hh = matrices[f"weight_ih{suffix}"], matrices[f"weight_hh{suffix}"]
            b_ih, b_hh = vectors.get(f"bias_ih{suffix}"), vectors.get(f"bias_hh{suffix}")
            break
    else:
        if len(matrices) != 2:
            return None
        (_, a), (_, b) = sorted(matrices.items(), key=lambda kv: "hh" in kv[0].lower())
        if not _recurrent_shape(b) and _recurrent_shape(a):
            a, b = b, a
        w_ih, w_hh = a, b
        named = sorted(vectors.items(), key=lambda kv: "hh" in kv[0].lower())
        if len(named) == 1:
            b_ih, b_hh = named[0][1], None
        elif len(named) == 2:
            b_ih, b_hh = named[0][1], named[1][1]
        else:
            b_ih = b_hh = None
    hidden = w_hh.shape[1] if w_hh.ndim == 2 else 0
    if not hidden or w_ih.shape[0] != w_hh.shape[0] or w_hh.shape[0] % hidden:
        return None
    order = ORDERS.get(w_hh.shape[0] // hidden)
    if order is None:
        return None
    zero = np.zeros(w_ih.shape[0])
    b_ih = zero if b_ih is None or b_ih.shape != zero.shape else b_ih
    b_hh = zero if b_hh is None or b_hh.shape != zero.shape else b_hh
    return w_ih, w_hh, b_ih, b_hh, order


def gate_order(judge: Judge, site: Site) -> Hint | None:
    if site.role != Role.OUTPUT:
        return None
    found = _cell_weights(site.weights)
    if found is None:
        return None
    w_ih, w_hh, b_ih, b_hh, order = found
    xs = [v for _, v in site.float_inputs() if v.ndim == 3 and v.shape[-1] == w_ih.shape[1]]
    if not xs:
        return None
    for batch_first in (True, False):
        x = xs[0] if batch_first else xs[0].transpose(1, 0, 2)

        def shaped(values: np.ndarray, batch_first=batch_first) -> np.ndarray:
            return values if batch_first or values.shape[0] == 1 else values.transpose(1, 0, 2)

        reference = [shaped(v) for v in _run(x, w_ih, w_hh, b_ih, b_hh, order)]
        which = next((i for i, v in enumerate(reference) if judge.close(v, judge.ref)), None)
        if which is None:
            continue
        for other in itertools.permutations(order):
            other = "".join(other)
            if other == order:
                continue
            left = judge.accepts(shaped(_run(x, w_ih, w_hh, b_ih, b_hh, other)[which]))
            if left is not None:
                cell = "LSTM" if len(order) == 4 else "GRU"
                return Hint(Kind.PERMUTATION, f"gates in another order: the {cell}'s weight "
                            f"chunks read as ({', '.join(other)}) where the reference's hold "
                            f"({', '.join(order)}); this cell run that way over the reference's "
                            f"input and weights gives the port ({left_text(left)})")
        return None
    return None
