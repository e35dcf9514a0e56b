"""Cases where a diagnostic's first bad record is made by a parent's own code, between its
children, so the origin is the parent and not the site the record belongs to.

- ``set_order_mix`` (``layerdiff determinism``): ``blocks.0.mix`` computes per-head outputs in
  its own code and concatenates them in the iteration order of a Python ``set`` of head names.
  A string's hash is salted per process (unless ``PYTHONHASHSEED`` is set), so each fresh run
  may concatenate in another order; the first record that differs is ``blocks.0.mix.proj#0``'s
  input, which ``blocks.0.mix``'s own code made.
- ``set_order_leaf`` (``determinism``): the same, with the heads concatenated inside a leaf
  module ``blocks.0.mix.concat``: the origin is that leaf.
- ``nan_between`` (``layerdiff nan``): ``block`` takes the log of ``block.fc``'s output (which
  has negatives) before ``block.out``: the first NaN is ``block.out#0``'s input, made by
  ``block``'s own code. ``nan_leaf``: the log in a leaf module, ``block.leaf``, the origin.
  ``nan_between_backward``: ``sqrt(h * (h > 0))`` between the two, finite forward, NaN
  gradient sent back to ``block.fc`` by ``block``'s backward (``block`` records no
  ``grad_input``: its input needs no gradient).
- ``mean_between`` (``layerdiff batch-independence``): ``block`` subtracts the batch mean,
  ``x - x.mean(0)``, between ``block.fc`` and ``block.out``: every sample's output depends on
  every other sample, and no child mixes on its own.
- ``mean_leaf`` (``batch-independence``): the same subtraction inside a leaf module,
  ``block.center``.
"""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case, seed_everything

SEED = 0
HEADS = 8  # a set of 8 strings has 32 slots: the order repeats in another process by chance only


class HeadConcat(nn.Module):
    """Concatenates the heads of ``x`` (batch, length, heads, width) in a set's order."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        names = {f"head{h}" for h in range(x.shape[2])}  # iteration order: the hash salt's
        return torch.cat([x[:, :, int(name[4:])] for name in names], dim=-1)


class SetOrderMix(nn.Module):
    """Per-head values from its own weight, concatenated in a set's order, then projected."""

    def __init__(self, width: int, heads: int, leaf: bool) -> None:
        super().__init__()
        self.heads, self.head_width = heads, width // heads
        self.value = nn.Parameter(torch.randn(width, width) / width ** 0.5)
        self.concat = HeadConcat() if leaf else None
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        heads = (x @ self.value).view(batch, length, self.heads, self.head_width)
        if self.concat is not None:
            merged = self.concat(heads)
        else:  # its own code between its children
            names = {f"head{h}" for h in range(self.heads)}
            merged = torch.cat([heads[:, :, int(name[4:])] for name in names], dim=-1)
        return self.proj(merged)


class Block(nn.Module):
    def __init__(self, width: int, heads: int, leaf: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.mix = SetOrderMix(width, heads, leaf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mix(self.norm(x))


class SetOrderNet(nn.Module):
    def __init__(self, width: int = 16, heads: int = HEADS, leaf: bool = False) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(width, heads, leaf)])
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x).squeeze(-1)


def _set_order_case(name: str, leaf: bool) -> Case:
    seed_everything(SEED)
    model = SetOrderNet(leaf=leaf)
    x = torch.randn(2, 3, 16)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.pow(2).mean(),
                name=f"reference_models.origin_cases:{name}", steps=1, seed=SEED)


def set_order_mix() -> Case:
    """Heads concatenated in a set's order by ``blocks.0.mix``'s own code."""
    return _set_order_case("set_order_mix", leaf=False)


def set_order_leaf() -> Case:
    """Heads concatenated in a set's order inside the leaf ``blocks.0.mix.concat``."""
    return _set_order_case("set_order_leaf", leaf=True)


# ---- a NaN and a batch mean made between children

class Log(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


class Center(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(0)


class Between(nn.Module):
    """``out(f(fc(x)))`` with ``f`` its own code, or a leaf module when ``leaf`` is given."""

    def __init__(self, between, leaf: nn.Module | None = None) -> None:
        super().__init__()
        self.fc, self.out = nn.Linear(4, 4), nn.Linear(4, 1)
        self.between = between
        self.leaf = leaf

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x)
        h = self.leaf(h) if self.leaf is not None else self.between(h)
        return self.out(h)


class BetweenNet(nn.Module):
    def __init__(self, between, leaf: nn.Module | None = None) -> None:
        super().__init__()
        self.block = Between(between, leaf)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).squeeze(-1)


def _between_case(name: str, between, leaf: nn.Module | None = None) -> Case:
    seed_everything(SEED)
    model = BetweenNet(between, leaf)
    x = torch.randn(6, 4)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.pow(2).mean(),
                name=f"reference_models.origin_cases:{name}", steps=1, seed=SEED)


def nan_between() -> Case:
    """log of fc's output (negatives in it) in ``block``'s own code: NaN into ``block.out``."""
    return _between_case("nan_between", torch.log)


def nan_leaf() -> Case:
    """The same log inside the leaf ``block.leaf``."""
    return _between_case("nan_leaf", None, Log())


def mean_between() -> Case:
    """``x - x.mean(0)`` in ``block``'s own code: every sample depends on the others."""
    return _between_case("mean_between", lambda h: h - h.mean(0))


def mean_leaf() -> Case:
    """The same centring inside the leaf ``block.leaf``."""
    return _between_case("mean_leaf", None, Center())


def nan_between_backward() -> Case:
    """``sqrt(h * (h > 0))`` in ``block``'s own code: a finite forward, and a NaN gradient
    (sqrt's infinite slope at 0 times the mask's 0) sent back to ``block.fc``."""
    return _between_case("nan_between_backward", lambda h: torch.sqrt(h * (h > 0)))
