"""A small MLP classifier: the quickest case to capture and read."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, IN, HIDDEN, CLASSES = 16, 32, 64, 10


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.act1 = nn.ReLU(inplace=True)  # in-place on purpose: capture must record its input
        self.drop = nn.Dropout(0.1)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.act2 = nn.GELU()
        self.head = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.act1(self.fc1(x)))
        return self.head(self.act2(self.fc2(h)))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs from a fixed random teacher, so the labels are learnable."""
    x = torch.randn(BATCH, IN)
    teacher = torch.randn(IN, CLASSES)
    return x, (x @ teacher).argmax(dim=1)


def reference() -> Case:
    seed_everything(SEED)
    model = MLP()
    x, y = make_data()
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                name="reference_models.mlp:reference")
