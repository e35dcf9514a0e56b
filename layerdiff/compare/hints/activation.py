"""``activation``: the port applies another activation function than the reference (GELU where
SiLU belonged, ReLU for GELU, none at all, ...).

Two places the activation is found:

- the origin is the activation itself: forward, output = act(input); backward, grad_input =
  grad_output act'(input);
- the activation is inside the origin's module: the module's last child with a matrix weight
  (a down projection) reads ``act(a)`` or a gated ``act(a) * b``, where ``a`` and ``b`` are
  tensors its other children recorded (an up projection, a gate projection). The reference's
  own activation is first identified by reproducing that child's recorded input; then every
  other known activation is put in its place and the module's output recomputed.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from layerdiff.trace.schema import RESULT_ROLES, Role

from ._common import Hint, Judge, Kind, Site, left_text


def _erf(x: np.ndarray) -> np.ndarray:
    """erf to 1.2e-7 everywhere (Numerical Recipes' erfc by Chebyshev fit), vectorized: numpy
    has none and math.erf one value at a time is slow on a large tensor."""
    z = np.abs(x)
    t = 1 / (1 + 0.5 * z)
    poly = -z * z - 1.26551223 + t * (1.00002368 + t * (0.37409196 + t * (
        0.09678418 + t * (-0.18628806 + t * (0.27886807 + t * (-1.13520398 + t * (
            1.48851587 + t * (-0.82215223 + t * 0.17087277))))))))
    return np.sign(x) * (1 - t * np.exp(poly))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1 + np.tanh(0.5 * x))


def _softplus(x: np.ndarray) -> np.ndarray:
    return np.logaddexp(0.0, x)


ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu": lambda x: 0.5 * x * (1 + _erf(x / math.sqrt(2))),
    "gelu_tanh": lambda x: 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi)
                                                     * (x + 0.044715 * x**3))),
    "silu": lambda x: x * _sigmoid(x),
    "quick_gelu": lambda x: x * _sigmoid(1.702 * x),
    "sigmoid": _sigmoid,
    "tanh": np.tanh,
    "leaky_relu(0.01)": lambda x: np.where(x > 0, x, 0.01 * x),
    "elu": lambda x: np.where(x > 0, x, np.expm1(np.minimum(x, 0.0))),
    "softplus": _softplus,
    "mish": lambda x: x * np.tanh(_softplus(x)),
    "hardswish": lambda x: x * np.clip(x + 3, 0, 6) / 6,
    "relu6": lambda x: np.clip(x, 0.0, 6.0),
    "identity": lambda x: x,
}
SAMPLE = 4096         # values a pairing of the children's outputs is screened on
STEP = 1e-5            # central differences for the derivatives (error ~1e-10 relative)


def _derivative(function: Callable[[np.ndarray], np.ndarray], x: np.ndarray) -> np.ndarray:
    return (function(x + STEP) - function(x - STEP)) / (2 * STEP)


def activation(judge: Judge, site: Site) -> Hint | None:
    direct = _direct(judge, site)
    return direct if direct is not None else _inside(judge, site)


def _identify(judge: Judge, make: Callable[[Callable], np.ndarray], target: np.ndarray
              ) -> str | None:
    """The known activation that reproduces ``target`` best, among those that do."""
    best, best_gap = None, math.inf
    scale = float(np.sqrt(np.mean(target**2)))
    for name, function in ACTIVATIONS.items():
        value = make(function)
        if judge.close(value, target):
            gap = float(np.sqrt(np.mean((value - target) ** 2)))
            if gap < best_gap:
                best, best_gap = name, gap
    return best if scale > 0 else None


def _swap(judge: Judge, used: str, make: Callable[[Callable], np.ndarray], where: str
          ) -> Hint | None:
    for name, function in ACTIVATIONS.items():
        if name == used:
            continue
        left = judge.accepts(make(function))
        if left is not None:
            return Hint(Kind.ACTIVATION, f"another activation function: port = "
                        f"{where.format(name)} where the reference has {where.format(used)} "
                        f"({left_text(left)})")
    return None


def _direct(judge: Judge, site: Site) -> Hint | None:
    x = site.elementwise_input(judge.ref.shape) if site.role in RESULT_ROLES \
        else None
    if x is None:
        return None
    if site.backward:
        g = site.grad_output
        if g is None or np.shape(g) != judge.ref.shape:
            return None
        g = np.asarray(g, np.float64)

        def make(function):
            return g * _derivative(function, x)
        where = "grad_output x {}'(input)"
    else:
        def make(function):
            return function(x)
        where = "{}(input)"
    used = _identify(judge, make, judge.ref)
    return None if used is None else _swap(judge, used, make, where)


def _inside(judge: Judge, site: Site) -> Hint | None:
    if site.role != Role.OUTPUT or not site.children:
        return None
    readers = [c for c in site.children if c.weight is not None and c.weight.ndim == 2
               and c.input is not None and c.output is not None]
    if not readers:
        return None
    last = readers[-1]
    weight = np.asarray(last.weight, np.float64)
    bias = np.asarray(last.bias if last.bias is not None else 0.0, np.float64)
    hidden = np.asarray(last.input, np.float64)
    readout = next((lambda h, w=w: h @ w + bias for w in (weight.T, weight)
                    if w.shape[0] == hidden.shape[-1]
                    and judge.close(hidden @ w + bias, judge.ref)), None)
    if readout is None:
        return None
    candidates = [(c.name, np.asarray(c.output, np.float64)) for c in site.children
                  if c is not last and c.output is not None and c.output.shape == hidden.shape]
    sample = slice(0, SAMPLE)  # pairs and functions screened on a few values first
    for a_name, a in candidates:
        others = [(None, None)] + [(n, b) for n, b in candidates if n != a_name]
        for b_name, b in others:
            def make(function, a=a, b=b):
                return function(a) if b is None else function(a) * b

            a_few = a.reshape(-1)[sample]
            b_few = None if b is None else b.reshape(-1)[sample]

            def make_sample(function, a=a_few, b=b_few):
                return function(a) if b is None else function(a) * b

            if _identify(judge, make_sample, hidden.reshape(-1)[sample]) is None:
                continue
            used = _identify(judge, make, hidden)
            if used is None:
                continue
            gated = "" if b_name is None else f" x {b_name}"
            found = _swap(judge, used, lambda f: readout(make(f)),
                          f"{last.name}({{}}({a_name}){gated})")
            if found is not None:
                return found
    return None
