"""A small residual CNN classifier: convolution, batch norm (training mode), pooling and a
residual connection, on generated images whose class is the quadrant of a bright blob."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, CHANNELS, SIZE, WIDTH, CLASSES = 8, 3, 16, 16, 4


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.act = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(x)))))
        return self.act(out + x)


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(CHANNELS, WIDTH, 3, padding=1, bias=False)
        self.stem_bn = nn.BatchNorm2d(WIDTH)
        self.stem_act = nn.ReLU()
        self.block = ResidualBlock(WIDTH)
        self.pool = nn.MaxPool2d(2)
        self.conv = nn.Conv2d(WIDTH, 2 * WIDTH, 3, padding=1)
        self.act = nn.ReLU()
        self.gap = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(2 * WIDTH, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(self.stem_act(self.stem_bn(self.stem(x))))
        h = self.gap(self.act(self.conv(self.pool(h))))
        return self.head(h.flatten(1))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Noisy images with one bright blob; the label is the quadrant it sits in."""
    y = torch.arange(BATCH) % CLASSES
    half = SIZE // 2
    rows = torch.randint(0, half, (BATCH,)) + (y // 2) * half
    cols = torch.randint(0, half, (BATCH,)) + (y % 2) * half
    grid = torch.arange(SIZE, dtype=torch.float32)
    blob = torch.exp(-((grid.view(1, -1, 1) - rows.view(-1, 1, 1)) ** 2
                       + (grid.view(1, 1, -1) - cols.view(-1, 1, 1)) ** 2) / 4.0)
    x = 0.3 * torch.randn(BATCH, CHANNELS, SIZE, SIZE) + blob.unsqueeze(1)
    return x, y


def build(model: nn.Module, *, name: str, steps: int = 1) -> Case:
    """A case around ``model`` (built after seeding) with the reference's data and optimizer."""
    x, y = make_data()
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=steps,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
                name=name)


def reference() -> Case:
    seed_everything(SEED)
    return build(CNN(), name="reference_models.cnn:reference")
