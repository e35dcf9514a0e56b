"""Cases with numerical bugs for ``layerdiff nan`` and ``layerdiff determinism``.

- ``nan_log_softmax``: a classifier fed raw 0-255 pixel values ends in ``log(softmax(x))``. Its
  logits lie hundreds apart, so softmax underflows to exactly 0 for the unlikely classes and the
  log makes ``-inf`` in the forward, at ``log_probs#0``. ``F.log_softmax`` (``x - logsumexp(x)``)
  would stay finite.
- ``nan_sqrt_backward``: a "safe" square root, ``where(x > 0, sqrt(x), 0)``, at
  ``features.sqrt#0``. Its forward is finite, but its backward is NaN: autograd takes sqrt's
  gradient ``0.5 / sqrt(x)`` for every element (NaN where x < 0, inf at 0) and multiplies the
  unselected ones by the zero that ``where`` sends back, and NaN * 0 = NaN.
- ``convlstm_uninitialised_bias``: the numpy ConvLSTM port with the bias gradient of its gate
  convolution summed into an accumulator that is never zeroed (``np.empty``). What such memory
  holds differs from run to run; here the accumulator's first contents come from
  ``os.urandom``, standing in for the leftovers ``np.empty`` hands back, so that two runs differ
  for sure (they agree with probability 2**-32 per element). The first record that differs
  between two runs is ``cell.conv#0``'s ``weight_grad`` ``bias`` at step 0 (the backward).
"""

from __future__ import annotations

import os

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, ExternalCase, seed_everything

from . import convlstm_numpy

SEED = 0


# ---- a forward -inf: log(softmax(x)) underflows

class NaiveLogSoftmax(nn.Module):
    """``log(softmax(x))``: exact in real numbers, -inf in float32 once x spans ~104."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(torch.softmax(x, dim=-1))


class PixelClassifier(nn.Module):
    def __init__(self, pixels: int = 64, hidden: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(pixels, hidden)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, classes)
        self.log_probs = NaiveLogSoftmax()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.log_probs(self.fc2(self.act(self.fc1(x))))


def nan_log_softmax() -> Case:
    """Raw pixel values (0-255, not normalised) into log(softmax): -inf at log_probs#0."""
    seed_everything(SEED)
    model = PixelClassifier()
    pixels = torch.randint(0, 256, (16, 64)).float()
    labels = torch.randint(0, 10, (16,))
    return Case(model=model, inputs=(pixels,),
                loss_fn=lambda log_probs: F.nll_loss(log_probs, labels), seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                name="reference_models.numerics:nan_log_softmax")


# ---- a backward-only NaN: where(x > 0, sqrt(x), 0)

class SafeSqrt(nn.Module):
    """sqrt of the positive part, 0 elsewhere: finite forward, NaN gradient for x <= 0."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x > 0, torch.sqrt(x), torch.zeros_like(x))


class SqrtFeatures(nn.Module):
    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.proj = nn.Linear(inputs, hidden)
        self.sqrt = SafeSqrt()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.sqrt(self.proj(x))


class SqrtRegressor(nn.Module):
    def __init__(self, inputs: int = 16, hidden: int = 32) -> None:
        super().__init__()
        self.features = SqrtFeatures(inputs, hidden)
        self.head = nn.Linear(hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x)).squeeze(-1)


def nan_sqrt_backward() -> Case:
    """A finite forward and a NaN gradient leaving features.sqrt#0."""
    seed_everything(SEED)
    model = SqrtRegressor()
    x = torch.randn(32, 16)
    y = x[:, :4].sum(dim=1)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.mse_loss(out, y), seed=SEED,
                steps=1, optimizer=lambda params: torch.optim.SGD(params, lr=0.01),
                name="reference_models.numerics:nan_sqrt_backward")


# ---- run-to-run differences: an accumulator that is never zeroed

def leftover(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """What ``np.empty`` might hand back: values another computation left. Drawn from
    ``os.urandom`` (in [-0.5, 0.5), 32 random bits each), so every process gets its own."""
    count = int(np.prod(shape))
    bits = np.frombuffer(os.urandom(4 * count), dtype="<u4")
    return (bits / 2.0**32 - 0.5).astype(dtype).reshape(shape)


class NumpyConvLSTMUninitialisedBias(convlstm_numpy.NumpyConvLSTM):
    """The gate convolution's bias gradient is summed over the batch and the pixels into a
    buffer kept between calls and never zeroed: garbage on the first call, the previous
    frame's sum after that."""

    def __init__(self, params: dict[str, np.ndarray], dtype: type = np.float32) -> None:
        super().__init__(params, dtype)
        self._bias_sums: dict[tuple[int, ...], np.ndarray] = {}

    def _conv_backward(self, grad: np.ndarray, cols: np.ndarray, weight: np.ndarray,
                       need_input: bool) -> tuple[np.ndarray | None, np.ndarray, np.ndarray]:
        d_input, d_weight, _ = super()._conv_backward(grad, cols, weight, need_input)
        shape = (grad.shape[1],)
        if shape not in self._bias_sums:
            self._bias_sums[shape] = leftover(shape, self.dtype)  # BUG: np.empty, not zeros
        total = self._bias_sums[shape]
        total += grad.sum(axis=(0, 2, 3))
        return d_input, d_weight, total.copy()


def convlstm_uninitialised_bias() -> ExternalCase:
    """The numpy ConvLSTM whose bias-gradient accumulator holds garbage that differs between
    runs: not deterministic from cell.conv#0's bias gradient at step 0 on."""
    return convlstm_numpy.external_case(NumpyConvLSTMUninitialisedBias,
                                        "reference_models.numerics:convlstm_uninitialised_bias")
