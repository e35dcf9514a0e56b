"""The PyTorch reference of the bundled Flax NNX port (``reference_models.flax_mlp``): a
pre-norm residual MLP classifier, the layer kinds a JAX port of a transformer trips on.

``proj_in`` (Linear, GPT-2's N(0, 0.02) init) -> ``block`` (``ln`` LayerNorm, ``fc1`` Linear,
``act`` GELU (erf), ``fc2`` Linear, added back to the residual) -> ``ln_f`` -> ``head``; cross
entropy on labels from a fixed random teacher. No dropout: a JAX port draws other random numbers.

The sizes are chosen so the classic torch -> Flax slips are visible in float32:
- ``proj_in``'s small init gives ``block.ln`` an input of variance ~0.01 per row, as GPT-2's
  0.02-std embeddings give its first LayerNorm: there epsilon 1e-6 against 1e-5 moves the
  output by ~9e-6 / (2 * 0.01) ~ 5e-4 relative, far outside float32's tolerance (at variance
  ~1 it would be ~5e-6, inside it);
- ``block.fc1`` is square (64 -> 64), so a kernel loaded without its transpose fits its shape;
- ``block.act`` sees values of order 1, where the tanh GELU is ~1e-4 off the erf one.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, IN, WIDTH, CLASSES = 16, 32, 64, 10
NAME = "reference_models.flax_mlp_reference:reference"


class Block(nn.Module):
    """Pre-norm residual MLP: x + fc2(gelu(fc1(ln(x))))."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class PreNormMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = nn.Linear(IN, WIDTH)
        self.block = Block()
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, CLASSES)
        nn.init.normal_(self.proj_in.weight, std=0.02)  # GPT-2's init
        nn.init.zeros_(self.proj_in.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.ln_f(self.block(self.proj_in(x))))


def make_data() -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and labels from a fixed random teacher, so the labels are learnable."""
    x = torch.randn(BATCH, IN)
    teacher = torch.randn(IN, CLASSES)
    return x, (x @ teacher).argmax(dim=1)


def build() -> tuple[PreNormMLP, torch.Tensor, torch.Tensor]:
    """The seeded model, inputs and labels (the Flax port takes the same, as numpy)."""
    seed_everything(SEED)
    model = PreNormMLP()
    return model, *make_data()


def reference() -> Case:
    model, x, y = build()
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                name=NAME)
