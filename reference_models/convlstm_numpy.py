"""The ConvLSTM ported to pure numpy, forward and backward by hand, recording itself.

A port that is not torch writes its own trace with :class:`layerdiff.TraceWriter`, under the
reference's site names (``cell#t``, ``cell.conv#t``, ``head#t``) and in the order torch capture
records them, so the two traces line up record for record. Convolutions are im2col products;
the input gradient of a convolution is summed back (col2im) into an accumulator taken from a
workspace that keeps buffers between calls, as hand-written kernels do to avoid allocating in
the time loop.

Planted bug: ``bug_accumulator_not_zeroed`` — the col2im accumulator is taken as it was left
(``np.empty`` semantics) instead of zeroed. The first call happens to get fresh zeroed memory and
is right; from the second call of the backward on (``cell.conv#4``, the second frame back) it
adds the previous frame's gradient to this one's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerdiff import ExternalCase

PARAMS = ("cell.conv.weight", "cell.conv.bias", "head.weight", "head.bias")


class Workspace:
    """Buffers kept between calls. ``empty`` hands a buffer back as its last user left it;
    ``zeros`` clears it first. New buffers start zeroed (fresh pages from the OS are)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple, np.ndarray] = {}

    def empty(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        key = (name, shape, np.dtype(dtype).str)
        if key not in self._buffers:
            self._buffers[key] = np.zeros(shape, dtype)
        return self._buffers[key]

    def zeros(self, name: str, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        buffer = self.empty(name, shape, dtype)
        buffer.fill(0)
        return buffer


class _NoWriter:
    """Stands in for a TraceWriter when the port runs without recording."""

    @contextmanager
    def site(self, module: str, type_name: str = "") -> Iterator[str]:
        yield module

    def record(self, *args: Any, **kwargs: Any) -> None:
        pass


def sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def im2col(x: np.ndarray, kernel: int) -> np.ndarray:
    """(batch, channels, h, w) -> (batch, channels * kernel * kernel, h * w), 'same' padding."""
    batch, channels, height, width = x.shape
    pad = kernel // 2
    padded = np.pad(x, ((0, 0), (0, 0), (pad, pad), (pad, pad)))
    cols = np.empty((batch, channels, kernel, kernel, height, width), x.dtype)
    for i in range(kernel):
        for j in range(kernel):
            cols[:, :, i, j] = padded[:, :, i:i + height, j:j + width]
    return cols.reshape(batch, channels * kernel * kernel, height * width)


@dataclass
class _Frame:
    """What the backward needs from one time step."""

    cols: np.ndarray
    c_prev: np.ndarray
    gates: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # sigmoid i, f, o; tanh g
    tanh_c: np.ndarray
    h: np.ndarray


@dataclass
class _Tape:
    frames: list[_Frame] = field(default_factory=list)


class NumpyConvLSTM:
    """The reference's ConvLSTM in numpy. ``params`` uses the reference's parameter names."""

    def __init__(self, params: dict[str, np.ndarray], dtype: type = np.float32) -> None:
        self.params = {name: np.array(params[name], dtype=dtype) for name in PARAMS}
        self.dtype = np.dtype(dtype)
        self.workspace = Workspace()

    # ---- convolutions
    def _conv(self, cols: np.ndarray, weight: np.ndarray, bias: np.ndarray,
              height: int, width: int) -> np.ndarray:
        out = weight.reshape(weight.shape[0], -1) @ cols + bias[:, None]
        return out.reshape(cols.shape[0], weight.shape[0], height, width)

    def _accumulator(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.workspace.zeros("col2im", shape, self.dtype)

    def _conv_backward(self, grad: np.ndarray, cols: np.ndarray, weight: np.ndarray,
                       need_input: bool) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        """Gradients of input (or None), weight and bias from the output gradient."""
        batch, out_channels, height, width = grad.shape
        grad = grad.reshape(batch, out_channels, height * width)
        d_weight = np.tensordot(grad, cols, axes=([0, 2], [0, 2])).reshape(weight.shape)
        d_bias = grad.sum(axis=(0, 2))
        if not need_input:
            return None, d_weight, d_bias
        kernel = weight.shape[-1]
        channels = weight.shape[1]
        d_cols = (weight.reshape(out_channels, -1).T @ grad).reshape(
            batch, channels, kernel, kernel, height, width)
        pad = kernel // 2
        total = self._accumulator((batch, channels, height + 2 * pad, width + 2 * pad))
        for i in range(kernel):
            for j in range(kernel):
                total[:, :, i:i + height, j:j + width] += d_cols[:, :, i, j]
        return total[:, :, pad:pad + height, pad:pad + width].copy(), d_weight, d_bias

    # ---- forward and backward
    def forward(self, frames: np.ndarray, writer: Any = None) -> tuple[np.ndarray, _Tape]:
        """(batch, time, channels, h, w) -> predictions of the same shape, and the tape."""
        rec = writer or _NoWriter()
        p = self.params
        batch, time, _, height, width = frames.shape
        hidden = p["head.weight"].shape[1]
        kernel = p["cell.conv.weight"].shape[-1]
        h = np.zeros((batch, hidden, height, width), self.dtype)
        c = np.zeros_like(h)
        tape = _Tape()
        predictions = []
        with rec.site("<root>", "ConvLSTM") as root:
            rec.record(root, "input", frames)
            for t in range(time):
                x = frames[:, t]
                with rec.site("cell", "ConvLSTMCell") as cell:
                    for arg, value in enumerate((x, h, c)):
                        rec.record(cell, "input", value, arg=str(arg))
                    z = np.concatenate([x, h], axis=1)
                    with rec.site("cell.conv", "Conv2d") as conv:
                        rec.record(conv, "input", z)
                        if t == 0:
                            rec.record(conv, "weight", p["cell.conv.weight"], arg="weight")
                            rec.record(conv, "weight", p["cell.conv.bias"], arg="bias")
                        cols = im2col(z, kernel)
                        pre = self._conv(cols, p["cell.conv.weight"], p["cell.conv.bias"],
                                         height, width)
                        rec.record(conv, "output", pre)
                    i, f, g, o = np.split(pre, 4, axis=1)
                    gates = (sigmoid(i), sigmoid(f), sigmoid(o), np.tanh(g))
                    c_prev = c
                    c = gates[1] * c_prev + gates[0] * gates[3]
                    tanh_c = np.tanh(c)
                    h = gates[2] * tanh_c
                    rec.record(cell, "output", h, arg="0")
                    rec.record(cell, "output", c, arg="1")
                tape.frames.append(_Frame(cols, c_prev, gates, tanh_c, h))
                with rec.site("head", "Conv2d") as head:
                    rec.record(head, "input", h)
                    if t == 0:
                        rec.record(head, "weight", p["head.weight"], arg="weight")
                        rec.record(head, "weight", p["head.bias"], arg="bias")
                    out = self._conv(h.reshape(batch, hidden, -1), p["head.weight"],
                                     p["head.bias"], height, width)
                    rec.record(head, "output", out)
                predictions.append(out)
            result = np.stack(predictions, axis=1)
            rec.record(root, "output", result)
        return result, tape

    def backward(self, tape: _Tape, grad: np.ndarray,
                 writer: Any = None) -> dict[str, np.ndarray]:
        """Parameter gradients from the gradient of the predictions, frame by frame backward."""
        rec = writer or _NoWriter()
        p = self.params
        hidden = p["head.weight"].shape[1]
        grads = {name: np.zeros_like(value) for name, value in p.items()}
        site = "{}#{}".format  # backward records name the forward's sites: module#call
        rec.record("<root>#0", "grad_output", grad)
        # what arrives at each frame's head from outside it: all at once, from the stacking
        for t in range(len(tape.frames)):
            rec.record(site("head", t), "grad_output", np.ascontiguousarray(grad[:, t]))
        d_h_next = d_c_next = None
        for t in range(len(tape.frames) - 1, -1, -1):
            frame = tape.frames[t]
            s_i, s_f, s_o, tanh_g = frame.gates
            d_out = np.ascontiguousarray(grad[:, t])
            batch, _, height, width = d_out.shape
            flat = d_out.reshape(batch, -1, height * width)
            d_h = (p["head.weight"].reshape(-1, hidden).T @ flat).reshape(frame.h.shape)
            rec.record(site("head", t), "grad_input", d_h)
            grads["head.weight"] += np.tensordot(flat, frame.h.reshape(batch, hidden, -1),
                                                 axes=([0, 2], [0, 2])).reshape(
                                                     p["head.weight"].shape)
            grads["head.bias"] += flat.sum(axis=(0, 2))
            if d_h_next is not None:
                d_h = d_h + d_h_next
            d_c = d_h * s_o * (1 - frame.tanh_c**2)
            if d_c_next is not None:
                d_c = d_c + d_c_next
            rec.record(site("cell", t), "grad_output", d_h, arg="0")
            if t > 0:  # the first frame's state is a constant: no gradient to send
                d_c_next = d_c * s_f
                rec.record(site("cell", t), "grad_input", d_c_next, arg="2")
                # grad_output is what arrives from outside the call: the earlier frame's c
                # gets the next cell's gradient alone (its own h's use of c is inside it)
                rec.record(site("cell", t - 1), "grad_output", d_c_next, arg="1")
            d_pre = np.concatenate([
                d_c * tanh_g * s_i * (1 - s_i),            # input gate
                d_c * frame.c_prev * s_f * (1 - s_f),      # forget gate
                d_c * s_i * (1 - tanh_g**2),               # candidate
                d_h * frame.tanh_c * s_o * (1 - s_o),      # output gate
            ], axis=1)
            rec.record(site("cell.conv", t), "grad_output", d_pre)
            d_z, d_w, d_b = self._conv_backward(d_pre, frame.cols, p["cell.conv.weight"],
                                                need_input=t > 0)
            grads["cell.conv.weight"] += d_w
            grads["cell.conv.bias"] += d_b
            if d_z is not None:
                rec.record(site("cell.conv", t), "grad_input", d_z)
                channels = d_z.shape[1] - hidden
                d_h_next = np.ascontiguousarray(d_z[:, channels:])
                rec.record(site("cell", t), "grad_input", d_h_next, arg="1")
        for module in ("head", "cell.conv"):  # torch records them in reverse order of first call
            for name in ("weight", "bias"):
                rec.record(site(module, 0), "weight_grad", grads[f"{module}.{name}"], arg=name)
        return grads


class NumpyConvLSTMAccumulatorBug(NumpyConvLSTM):
    def _accumulator(self, shape: tuple[int, ...]) -> np.ndarray:
        return self.workspace.empty("col2im", shape, self.dtype)  # BUG: not zeroed


def mse(predicted: np.ndarray, target: np.ndarray, loss_scale: float = 1.0
        ) -> tuple[np.ndarray, np.ndarray]:
    """Mean squared error and its gradient (times ``loss_scale``) with respect to predicted."""
    diff = predicted - target
    loss = np.mean(diff * diff, dtype=diff.dtype)
    return np.asarray(loss), diff * np.asarray(2 * loss_scale / diff.size, diff.dtype)


def clip_and_step(model: NumpyConvLSTM, grads: dict[str, np.ndarray], max_norm: float,
                  lr: float) -> None:
    """torch.nn.utils.clip_grad_norm_ then SGD, as the reference case trains."""
    norms = np.array([np.linalg.norm(g.ravel()) for g in grads.values()], model.dtype)
    total = np.linalg.norm(norms)
    scale = min(max_norm / (total + 1e-6), 1.0)
    for name, grad in grads.items():
        model.params[name] -= lr * (grad * model.dtype.type(scale))


def train(model: NumpyConvLSTM, frames: np.ndarray, targets: np.ndarray, *, steps: int,
          loss_scale: float, clip: float, lr: float, writer: Any = None) -> list[float]:
    """``steps`` training steps, recording each into ``writer`` when one is given."""
    losses = []
    for step in range(steps):
        if step and writer is not None:
            writer.step()
        predicted, tape = model.forward(frames, writer)
        loss, grad = mse(predicted, targets, loss_scale)
        if writer is not None:
            with writer.site("<loss>", "loss") as site:
                writer.record(site, "output", loss)
        grads = model.backward(tape, grad, writer)
        for value in grads.values():
            value /= model.dtype.type(loss_scale)
        clip_and_step(model, grads, clip, lr)
        losses.append(float(loss))
    return losses


class _ConvLayer:
    """``cell.conv`` for replay: the gate convolution and its backward (col2im included)."""

    type_name = "Conv2d"

    def __init__(self, model: NumpyConvLSTM) -> None:
        self.model = model

    def forward(self, inputs: dict, weights: dict) -> tuple[dict, Any]:
        z, weight = inputs["0"].astype(self.model.dtype), weights["weight"]
        cols = im2col(z, weight.shape[-1])
        return {"0": self.model._conv(cols, weight, weights["bias"], *z.shape[2:])}, (
            cols, weight)

    def backward(self, context: Any, grads: dict) -> tuple[dict, dict]:
        cols, weight = context
        d_z, d_w, d_b = self.model._conv_backward(grads["0"], cols, weight, need_input=True)
        return {"0": d_z}, {"weight": d_w, "bias": d_b}


class _HeadLayer:
    """``head`` for replay: the 1x1 read-out convolution."""

    type_name = "Conv2d"

    def forward(self, inputs: dict, weights: dict) -> tuple[dict, Any]:
        h, weight = inputs["0"], weights["weight"]
        batch, hidden, height, width = h.shape
        flat = h.reshape(batch, hidden, -1)
        out = weight.reshape(weight.shape[0], -1) @ flat + weights["bias"][:, None]
        return {"0": out.reshape(batch, -1, height, width)}, (flat, weight, h.shape)

    def backward(self, context: Any, grads: dict) -> tuple[dict, dict]:
        flat, weight, shape = context
        d_out = grads["0"].reshape(shape[0], weight.shape[0], -1)
        d_h = (weight.reshape(weight.shape[0], -1).T @ d_out).reshape(shape)
        d_w = np.tensordot(d_out, flat, axes=([0, 2], [0, 2])).reshape(weight.shape)
        return {"0": d_h}, {"weight": d_w, "bias": d_out.sum(axis=(0, 2))}


class _CellLayer:
    """``cell`` for replay: one time step of the cell, its convolution inside (the port's own
    weights: the cell module has none of its own)."""

    type_name = "ConvLSTMCell"

    def __init__(self, model: NumpyConvLSTM) -> None:
        self.model = model

    def forward(self, inputs: dict, weights: dict) -> tuple[dict, Any]:
        p = self.model.params
        x, h, c = inputs["0"], inputs["1"], inputs["2"]
        cols = im2col(np.concatenate([x, h], axis=1), p["cell.conv.weight"].shape[-1])
        pre = self.model._conv(cols, p["cell.conv.weight"], p["cell.conv.bias"], *x.shape[2:])
        i, f, g, o = np.split(pre, 4, axis=1)
        gates = (sigmoid(i), sigmoid(f), sigmoid(o), np.tanh(g))
        c_new = gates[1] * c + gates[0] * gates[3]
        tanh_c = np.tanh(c_new)
        return {"0": gates[2] * tanh_c, "1": c_new}, (cols, c, gates, tanh_c, x.shape[1])

    def backward(self, context: Any, grads: dict) -> tuple[dict, dict]:
        cols, c_prev, (s_i, s_f, s_o, tanh_g), tanh_c, channels = context
        d_h = grads.get("0", np.zeros_like(tanh_c))
        d_c = d_h * s_o * (1 - tanh_c**2)   # c feeds this call's own h
        if "1" in grads:  # plus what arrived at c from outside the call (the next frame's)
            d_c = d_c + grads["1"]
        d_pre = np.concatenate([d_c * tanh_g * s_i * (1 - s_i),
                                d_c * c_prev * s_f * (1 - s_f),
                                d_c * s_i * (1 - tanh_g**2),
                                d_h * tanh_c * s_o * (1 - s_o)], axis=1)
        d_z, _, _ = self.model._conv_backward(d_pre, cols, self.model.params["cell.conv.weight"],
                                              need_input=True)
        return {"1": np.ascontiguousarray(d_z[:, channels:]), "2": d_c * s_f}, {}


def layers(model: NumpyConvLSTM) -> dict[str, Any]:
    """The port's layers one by one, for ``layerdiff replay``: module path -> callables."""
    return {"cell": _CellLayer(model), "cell.conv": _ConvLayer(model), "head": _HeadLayer()}


def external_case(model_class: type[NumpyConvLSTM], spec: str) -> ExternalCase:
    """The case of a numpy ConvLSTM (this port or a variant of it) on the torch reference's
    weights and data, named ``spec``."""
    from . import convlstm  # torch, only to take the reference's weights and data

    cfg = convlstm.Config()
    model, frames, targets = convlstm.setup(cfg)
    params = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    frames, targets = frames.numpy(), targets.numpy()

    def run(writer, steps: int, loss_scale: float) -> None:
        train(model_class(params), frames, targets, steps=steps, loss_scale=loss_scale,
              clip=cfg.clip, lr=cfg.lr, writer=writer)

    return ExternalCase(run=run, seed=convlstm.SEED, steps=cfg.steps,
                        name=spec,
                        layers=layers(model_class(params)))


def port() -> ExternalCase:
    return external_case(NumpyConvLSTM, "reference_models.convlstm_numpy:port")


def bug_accumulator_not_zeroed() -> ExternalCase:
    return external_case(NumpyConvLSTMAccumulatorBug,
                         "reference_models.convlstm_numpy:bug_accumulator_not_zeroed")

