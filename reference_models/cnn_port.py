"""An independent port of the CNN: batch norm written out by hand, global pooling as a mean,
and the residual block's ReLU as a custom autograd function (a hand-written kernel, as a port
to custom kernels would have). Module and parameter names follow the reference.

Planted bug: ``bug_relu_backward_batch`` — the custom ReLU's backward applies the first batch
element's mask to every element, so gradients are wrong only for batch elements after the first.
"""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case

from . import cnn
from .porting import copy_state, port_case


class BatchNorm(nn.Module):
    """Training-mode batch norm by hand: biased variance to normalize, unbiased to track."""

    def __init__(self, channels: int, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        self.eps, self.momentum = eps, momentum
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self.register_buffer("num_batches_tracked", torch.tensor(0, dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=(0, 2, 3))
        var = x.var(dim=(0, 2, 3), unbiased=False)
        if self.training:
            count = x.numel() // x.size(1)
            with torch.no_grad():
                self.running_mean.lerp_(mean, self.momentum)
                self.running_var.lerp_(var * count / (count - 1), self.momentum)
                self.num_batches_tracked += 1
        scale = self.weight * torch.rsqrt(var + self.eps)
        shift = self.bias - mean * scale
        return x * scale.view(1, -1, 1, 1) + shift.view(1, -1, 1, 1)


class ReLUFunction(torch.autograd.Function):
    """ReLU with a hand-written backward that keeps only the output's sign mask."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.clamp_min(0)
        ctx.save_for_backward(out > 0)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class BuggyReLUFunction(ReLUFunction):
    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask[:1]  # BUG: the first element's mask, broadcast over the batch


class CustomReLU(nn.Module):
    def __init__(self, function: type[torch.autograd.Function] = ReLUFunction) -> None:
        super().__init__()
        self.function = function

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.function.apply(x)


class ResidualBlock(nn.Module):
    def __init__(self, width: int, relu: type[torch.autograd.Function]) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = BatchNorm(width)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = BatchNorm(width)
        self.act = CustomReLU(relu)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act1(self.bn1(self.conv1(x)))
        return self.act(self.bn2(self.conv2(h)) + x)


class MeanPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(dim=(2, 3), keepdim=True)


class CNNPort(nn.Module):
    def __init__(self, relu: type[torch.autograd.Function] = ReLUFunction) -> None:
        super().__init__()
        width = cnn.WIDTH
        self.stem = nn.Conv2d(cnn.CHANNELS, width, 3, padding=1, bias=False)
        self.stem_bn = BatchNorm(width)
        self.stem_act = nn.ReLU()
        self.block = ResidualBlock(width, relu)
        self.pool = nn.MaxPool2d(2)
        self.conv = nn.Conv2d(width, 2 * width, 3, padding=1)
        self.act = nn.ReLU()
        self.gap = MeanPool()
        self.head = nn.Linear(2 * width, cnn.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.stem_act(self.stem_bn(self.stem(x))))
        h = self.gap(self.act(self.conv(self.pool(h))))
        return self.head(h.flatten(1))


def port() -> Case:
    return port_case(cnn.reference, lambda ref: copy_state(CNNPort(), ref),
                     "reference_models.cnn_port:port")


def bug_relu_backward_batch() -> Case:
    return port_case(cnn.reference, lambda ref: copy_state(CNNPort(BuggyReLUFunction), ref),
                     "reference_models.cnn_port:bug_relu_backward_batch")
