"""Kinds of a normalization done differently: ``axis`` (a softmax or log-softmax site taken over
another axis) and ``epsilon`` (a layer, RMS or batch norm whose epsilon differs: each group of
the output rescaled by sqrt((var + eps_ref) / (var + eps_port)), most where the variance is
small)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from layerdiff.trace.schema import Role

from ._common import Hint, Judge, Kind, Site, left_text, softmax


def _log_softmax(x: np.ndarray, axis: int) -> np.ndarray:
    shifted = x - np.max(x, axis=axis, keepdims=True)
    return shifted - np.log(np.sum(np.exp(shifted), axis=axis, keepdims=True))


NORMALIZERS: dict[str, Callable[[np.ndarray, int], np.ndarray]] = {
    "softmax": softmax, "log_softmax": _log_softmax}


def axis(judge: Judge, site: Site) -> Hint | None:
    if site.role != Role.OUTPUT:
        return None
    x = site.elementwise_input(judge.ref.shape)
    if x is None or x.ndim < 2:
        return None
    for name, function in NORMALIZERS.items():
        used = next((a for a in range(x.ndim) if x.shape[a] > 1
                     and judge.close(function(x, a), judge.ref)), None)
        if used is None:
            continue
        # the site is this normalizer over axis ``used``: only its other axes are tried
        for other in range(x.ndim):
            if other == used or x.shape[other] == 1:
                continue
            left = judge.accepts(function(x, other))
            if left is not None:
                return Hint(Kind.AXIS, f"port = {name}(input) over axis {other} where the "
                            f"reference takes axis {used} ({left_text(left)})")
        return None
    return None


def epsilon(judge: Judge, site: Site) -> Hint | None:
    if site.role != Role.OUTPUT:
        return None
    x = next((v for _, v in site.float_inputs() if v.shape == judge.ref.shape), None)
    if x is None or x.ndim < 1:
        return None
    gamma = site.weights.get("weight")
    beta = np.asarray(site.weights.get("bias", 0.0), np.float64)
    for groups, text in _norm_groups(x.shape, gamma):
        shift = np.broadcast_to(_along(beta, x.shape, groups), x.shape) if beta.ndim else beta
        y = _groups_of(judge.ref - shift, groups)
        z = _groups_of(judge.port - shift, groups)
        xs = _groups_of(x, groups)
        yy = np.sum(y * y, axis=1)
        if xs.shape[0] < 2 or xs.shape[1] < 4 or np.any(yy == 0):
            continue  # a rescaling of each group needs groups, and members to rescale
        c = np.sum(y * z, axis=1) / yy
        for variance, what in ((np.var(xs, axis=1), "variance"),
                               (np.mean(xs * xs, axis=1), "mean square")):
            fitted = _fit_epsilons(c, variance, yy)
            if fitted is None:
                continue
            eps_ref, eps_port = fitted
            factor = np.sqrt((variance + eps_ref) / (variance + eps_port))
            model = _ungroup(factor[:, None] * y, groups, x.shape) + shift
            left = judge.accepts(model)
            if left is None:
                continue
            small = np.argsort(variance)[: max(1, len(variance) // 10)]
            share = float(np.sum((1 - factor[small]) ** 2 * yy[small])
                          / max(np.sum((1 - factor) ** 2 * yy), 1e-300))
            reference = (f"{eps_ref:.2g}" if eps_ref > 0
                         else "one too small to measure")
            port = f"{eps_port:.2g}" if eps_port > 0 else "one too small to measure"
            return Hint(Kind.EPSILON, f"a normalization's epsilon: {port} where the "
                        f"reference's is {reference}, fitted from each {text}'s {what} of the "
                        f"input ({left_text(left)}); the 10% of {text}s with the smallest {what} "
                        f"hold {share:.0%} of the error")
    return None


def _norm_groups(shape: tuple[int, ...], gamma) -> Iterator[tuple[tuple[int, ...], str]]:
    """The axes a normalization reduces over: its trailing axes (layer and RMS norms, sized
    by the weight), or all but axis 1 (batch norm)."""
    trailing = max(np.ndim(gamma), 1) if gamma is not None else 1
    if trailing <= len(shape):
        yield tuple(range(len(shape) - trailing, len(shape))), "row"
    if len(shape) >= 2 and (gamma is None or np.size(gamma) == shape[1]):
        yield tuple(a for a in range(len(shape)) if a != 1), "channel"


def _along(beta: np.ndarray, shape: tuple[int, ...], reduced: tuple[int, ...]) -> np.ndarray:
    """A per-feature parameter broadcast to ``shape``: along the reduced trailing axes, or
    along axis 1 when axis 1 is the one kept."""
    if 1 not in reduced and len(shape) >= 2 and beta.size == shape[1]:
        view = [1] * len(shape)
        view[1] = shape[1]
        return beta.reshape(view)
    return beta


def _groups_of(values: np.ndarray, reduced: tuple[int, ...]) -> np.ndarray:
    """(groups, members): the reduced axes last, flattened."""
    kept = [a for a in range(values.ndim) if a not in reduced]
    moved = np.transpose(values, kept + list(reduced))
    size = int(np.prod([values.shape[a] for a in reduced]))
    return moved.reshape(-1, size)


def _ungroup(values: np.ndarray, reduced: tuple[int, ...], shape: tuple[int, ...]) -> np.ndarray:
    kept = [a for a in range(len(shape)) if a not in reduced]
    order = kept + list(reduced)
    moved = values.reshape([shape[a] for a in order])
    return np.transpose(moved, np.argsort(order))


EPSILONS = np.concatenate([[0.0], 10.0 ** np.arange(-14.0, 1.01, 0.5)])  # the first grid
FIT_GROUPS = 4096      # groups the search uses, spread over the variances (the model is then
                       # judged on all of them)


def _fit_epsilons(c: np.ndarray, variance: np.ndarray,
                  weight: np.ndarray | None = None) -> tuple[float, float] | None:
    """(eps_ref, eps_port), both >= 0, that make sqrt((v + eps_ref) / (v + eps_port)) closest
    to the per-group factors c, each group weighted by its energy (``weight``): the model's
    own residual energy, so the least-squares sense is the acceptance rule's. An epsilon is a
    physical quantity, never negative: searched over 0 and 10^-14 .. 10 on a log grid, then
    refined around the best. (Solving the linearized c^2 (v + eps_port) = v + eps_ref by
    least squares returned a negative epsilon, -8e-7 for 1e-6, where every variance is far
    above both: only their difference is determined there.)"""
    weight = np.ones_like(c) if weight is None else weight
    if c.size > FIT_GROUPS:
        pick = np.argsort(variance)[np.linspace(0, c.size - 1, FIT_GROUPS).astype(np.int64)]
        sample = (c[pick], variance[pick], weight[pick])
    else:
        sample = (c, variance, weight)

    def energies(eps_ref: np.ndarray, eps_port: float, groups) -> np.ndarray:
        cc, v, w = groups
        with np.errstate(divide="ignore", invalid="ignore"):
            f = np.sqrt((v[None, :] + eps_ref[:, None]) / (v[None, :] + eps_port))
        return np.where(np.isfinite(f), w * (cc - f) ** 2, np.inf).sum(axis=1)

    def search(refs: np.ndarray, ports: np.ndarray, best: tuple[float, float, float]
               ) -> tuple[float, float, float]:
        """(energy, eps_ref, eps_port) of the best pair on this grid, or ``best``."""
        for p in ports:
            e = energies(refs, float(p), sample)
            i = int(np.argmin(e))
            if e[i] < best[0]:
                best = (float(e[i]), float(refs[i]), float(p))
        return best

    best = search(EPSILONS, EPSILONS, (np.inf, 0.0, 0.0))
    _, eps_ref, eps_port = best
    step = 0.5
    for _ in range(9):  # refine on log grids around the best, to 1e-3 decades at the end
        step /= 2.5
        best = search(_around(eps_ref, step), _around(eps_port, step), best)
        _, eps_ref, eps_port = best
    if not (np.isfinite(best[0]) and eps_ref >= 0 and eps_port >= 0) or abs(
            eps_port - eps_ref) <= 1e-3 * max(eps_port, eps_ref):
        return None
    return eps_ref, eps_port


def _around(eps: float, step: float) -> np.ndarray:
    """eps and its neighbours on a log grid of ``step`` decades (0 stays 0)."""
    if eps == 0:
        return np.array([0.0])
    return eps * 10.0 ** (step * np.arange(-2, 3))


# ---------------------------------------------------------------------------------------------
# A normalization's backward that reduces over other axes


def backward_axis(judge: Judge, site: Site) -> Hint | None:
    """A hand-written layer or RMS norm backward whose means are taken over other axes (the
    batch too, or all of them): the reference's gradient is first rebuilt from its input, its
    weight and the incoming gradient, dx = rstd (g w - mean(g w) - x^ mean(g w x^)) (an RMS
    norm without the first mean), the means over the axes the forward normalizes; then the
    same with the means over other axes is fitted to the port."""
    if not site.backward or site.grad_output is None:
        return None
    shape = judge.ref.shape
    x = next((v for _, v in site.float_inputs() if v.shape == shape), None)
    if x is None or x.ndim < 2 or np.shape(site.grad_output) != shape:
        return None
    g = np.asarray(site.grad_output, np.float64)
    gamma = site.weights.get("weight")
    for groups, _ in _norm_groups(shape, gamma):
        scale = np.asarray(1.0 if gamma is None else gamma, np.float64)
        if scale.ndim:
            scale = np.broadcast_to(_along(scale, shape, groups), shape)
        gw = g * scale
        for centred, what in ((True, "layer"), (False, "RMS")):
            centre = x - x.mean(groups, keepdims=True) if centred else x
            rstd = 1 / np.sqrt(np.mean(centre**2, groups, keepdims=True) + _EPS_GUESS)

            def grad(axes: tuple[int, ...], centre=centre, rstd=rstd, centred=centred, gw=gw):
                xhat = centre * rstd
                out = gw - xhat * np.mean(gw * xhat, axes, keepdims=True)
                if centred:
                    out = out - np.mean(gw, axes, keepdims=True)
                return rstd * out

            if not _close_loose(grad(groups), judge.ref):
                continue
            for axes in _other_axes(x.ndim, groups):
                left = judge.accepts(grad(axes))
                if left is not None:
                    return Hint(Kind.AXIS, f"a {what} norm's backward takes its means over axes "
                                f"{axes} where the reference's takes them over {groups} (the "
                                f"axes its forward normalizes): rebuilt that way from the "
                                f"reference's input, weight and grad_output it gives the port "
                                f"({left_text(left)})")
    return None


_EPS_GUESS = 1e-5      # the epsilon is unknown here; a wrong guess only moves rows whose
                       # variance is near it, and the reference check below says if it fits


def _close_loose(a: np.ndarray, b: np.ndarray) -> bool:
    """The rebuilt gradient reproduces the reference to 1e-3 relative rms (the epsilon is a
    guess)."""
    scale = float(np.sqrt(np.mean(b**2)))
    return scale > 0 and float(np.sqrt(np.mean((a - b) ** 2))) <= 1e-3 * scale


def _other_axes(ndim: int, used: tuple[int, ...]) -> Iterator[tuple[int, ...]]:
    seen = {tuple(sorted(used))}
    candidates = [tuple(range(ndim)), tuple(sorted({0, *used}))]
    candidates += [tuple(sorted({a, *used})) for a in range(ndim)]
    candidates += [(a,) for a in range(ndim)]
    for axes in candidates:
        if axes not in seen:
            seen.add(axes)
            yield axes


# ---------------------------------------------------------------------------------------------
# A norm's weight stored as an offset from 1 (Gemma's RMS norm: x_hat (1 + w))


def weight_offset(judge: Judge, site: Site) -> Hint | None:
    """A layer or RMS norm whose weight w is used as (1 + w) on one side and as w on the
    other: Gemma's RMS norm stores its scale as an offset from 1, and a port that multiplies
    by w alone (or adds 1 to a weight stored whole) gives port = ref w / (1 + w) feature by
    feature (or (1 + w) / w). The reference is first rebuilt from the site's input as a
    row-wise normalization times its multiplier (one scale per row, fitted, so the epsilon
    need not be known); then the port is the same rows times the other multiplier, with the
    recorded w and no number fitted."""
    if site.role != Role.OUTPUT:
        return None
    shape = judge.ref.shape
    x = next((v for _, v in site.float_inputs() if v.shape == shape), None)
    w = site.weights.get("weight")
    if x is None or w is None or np.ndim(w) != 1 or x.ndim < 1 or np.size(w) != shape[-1] \
            or shape[-1] < 4:
        return None
    w = np.asarray(w, np.float64)
    bias = np.asarray(site.weights.get("bias", 0.0), np.float64)
    if bias.ndim and bias.shape != w.shape:
        return None
    for centred in (False, True):
        xc = x - x.mean(-1, keepdims=True) if centred else x
        for ref_mult, port_mult, text in (
                (1 + w, w, "the port multiplies by w where the reference multiplies by (1 + w)"),
                (w, 1 + w, "the port multiplies by (1 + w) where the reference multiplies by w")):
            base = xc * ref_mult
            norm = np.sum(base * base, axis=-1, keepdims=True)
            scale = np.sum((judge.ref - bias) * base, axis=-1, keepdims=True) / np.where(
                norm > 0, norm, 1)
            if not judge.close(scale * base + bias, judge.ref):
                continue  # the reference is no normalization times this multiplier
            left = judge.accepts(scale * xc * port_mult + bias)
            if left is not None:
                what = "a layer" if centred else "an RMS"
                ratio = "w / (1 + w)" if port_mult is w else "(1 + w) / w"
                return Hint(Kind.WEIGHT_OFFSET, f"norm weight offset: {text} (Gemma's RMS norm "
                            f"stores its scale as an offset from 1): port = reference x "
                            f"{ratio} feature by feature with the recorded weight, the "
                            f"reference rebuilt as {what} norm of the input "
                            f"({left_text(left)})")
    return None
