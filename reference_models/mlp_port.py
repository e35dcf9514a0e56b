"""An independent port of the MLP: dense layers as explicit matrix products, ReLU as a clamp,
GELU from its erf formula. Module and parameter names follow the reference; dropout is drawn at
the same point of the random stream, so its mask is the reference's.

Planted bug: ``bug_weight_not_transposed`` — ``fc2`` multiplies by its (square) weight without
the transpose, a classic slip when porting between (in, out) and (out, in) weight layouts.
``bug_gelu_tanh`` — GELU from its tanh approximation where the reference uses the exact erf
form (PyTorch's default against GPT-2's and JAX's ``approximate=True``): at most ~5e-4 apart,
small enough to hide in bfloat16 rounding and far outside float32's.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case

from . import mlp
from .porting import copy_state, port_case


class Dense(nn.Module):
    """y = x W^T + b with W stored (out, in), as torch.nn.Linear stores it."""

    def __init__(self, fan_in: int, fan_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(fan_out, fan_in))
        self.bias = nn.Parameter(torch.empty(fan_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.t() + self.bias


class UntransposedDense(Dense):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight + self.bias  # BUG: W used as (in, out); shapes fit, values don't


class ClampReLU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.clamp_min(0.0)


class ErfGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class TanhGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3)))


class Dropout(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(x, self.p, self.training)


class MLPPort(nn.Module):
    def __init__(self, fc2: type[Dense] = Dense, act2: type[nn.Module] = ErfGELU) -> None:
        super().__init__()
        self.fc1 = Dense(mlp.IN, mlp.HIDDEN)
        self.act1 = ClampReLU()
        self.drop = Dropout(0.1)
        self.fc2 = fc2(mlp.HIDDEN, mlp.HIDDEN)
        self.act2 = act2()
        self.head = Dense(mlp.HIDDEN, mlp.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act1(self.fc1(x)))
        return self.head(self.act2(self.fc2(h)))


def port() -> Case:
    return port_case(mlp.reference, lambda ref: copy_state(MLPPort(), ref),
                     "reference_models.mlp_port:port")


def bug_weight_not_transposed() -> Case:
    return port_case(mlp.reference, lambda ref: copy_state(MLPPort(UntransposedDense), ref),
                     "reference_models.mlp_port:bug_weight_not_transposed")


def bug_gelu_tanh() -> Case:
    return port_case(mlp.reference, lambda ref: copy_state(MLPPort(act2=TanhGELU), ref),
                     "reference_models.mlp_port:bug_gelu_tanh")
