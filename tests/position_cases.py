"""Tiny sequence models whose port errs at a place along the sequence: the error by position
(layerdiff/compare/positions.py) must say where.

- ``padding_off_by_one``: causal attention over sequences padded from position 8; the port's
  key padding mask lets position 8 through (``<=`` for ``<``). Queries before 8 cannot see key
  8 whatever the mask: the error is out from position 8, within before.
- ``rotary_base``: a rotary embedding with base 500000 where the reference has 10000. The
  rotation is the identity at position 0 and turns position p by p dw too far: out from
  position 1, the error growing with the position.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

VOCAB, WIDTH, LENGTH, BATCH, PADDED_FROM = 16, 16, 12, 3, 8


class PaddedAttention(nn.Module):
    """One head of causal attention whose keys from ``PADDED_FROM`` on are padding."""

    def __init__(self, inclusive: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.inclusive = inclusive

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(WIDTH, dim=-1)
        length = x.size(1)
        where = torch.arange(length)
        keys = where <= PADDED_FROM if self.inclusive else where < PADDED_FROM  # BUG: <=
        allowed = (where[None, :] <= where[:, None]) & keys[None, :]
        scores = (q @ k.transpose(-2, -1)) / WIDTH ** 0.5
        return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


class Rotary(nn.Module):
    """Feature pairs (2i, 2i+1) turned by position x base^(-2i / width)."""

    def __init__(self, base: float = 10000.0) -> None:
        super().__init__()
        self.base = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = torch.arange(0, WIDTH, 2, dtype=torch.float32) / WIDTH
        angle = torch.arange(x.size(1), dtype=torch.float32)[:, None] * self.base ** -half
        cos, sin = angle.cos(), angle.sin()
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, even * sin + odd * cos], -1).flatten(-2)


class SequenceLM(nn.Module):
    def __init__(self, mixer: nn.Module) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.mixer = mixer
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.mixer(self.embed(tokens)))


def _case(name: str, mixer: type[nn.Module]) -> Case:
    seed_everything(0)
    model = SequenceLM(mixer())
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=0, steps=1,
                name=f"tests.position_cases:{name}")


def padding_reference() -> Case:
    return _case("padding_reference", PaddedAttention)


def padding_off_by_one() -> Case:
    case = padding_reference()
    port = SequenceLM(PaddedAttention(inclusive=True))
    port.load_state_dict(case.model.state_dict())
    return dataclasses.replace(case, model=port, name="tests.position_cases:padding_off_by_one")


def rotary_reference() -> Case:
    return _case("rotary_reference", Rotary)


def rotary_base() -> Case:
    case = rotary_reference()
    port = SequenceLM(Rotary(base=500000.0))
    port.load_state_dict(case.model.state_dict())
    return dataclasses.replace(case, model=port, name="tests.position_cases:rotary_base")
