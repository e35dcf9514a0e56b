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


def gate_order(judge: Judge, site: Site) -> Hint | None:
    if site.role != "output":
        return None
    w = {name: np.asarray(site.weights.get(name), np.float64) for name in
         ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0")
         if site.weights.get(name) is not None}
    if "weight_ih_l0" not in w or "weight_hh_l0" not in w:
        return None
    w_ih, w_hh = w["weight_ih_l0"], w["weight_hh_l0"]
    hidden = w_hh.shape[1] if w_hh.ndim == 2 else 0
    if not hidden or w_ih.ndim != 2 or w_ih.shape[0] % hidden or w_hh.shape[0] != w_ih.shape[0]:
        return None
    order = ORDERS.get(w_ih.shape[0] // hidden)
    if order is None:
        return None
    zero = np.zeros(w_ih.shape[0])
    b_ih, b_hh = w.get("bias_ih_l0", zero), w.get("bias_hh_l0", zero)
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
