"""Benchmark-only cases: shapes that stress capture rather than models worth porting."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything


def deep_narrow(depth: int = 120, width: int = 64, batch: int = 16) -> Case:
    """Thousands of small tensors per step: 120 blocks of Linear+ReLU on 4 KiB activations."""
    seed_everything(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(width, 10))
    x = torch.randn(batch, width)
    y = torch.randint(0, 10, (batch,))
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y),
                optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                name="reference_models.bench:deep_narrow")
