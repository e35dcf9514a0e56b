"""A port layer whose first output is another quantity than the layer it replaces (a decoder
that ends in its tied head returns logits where the reference's decoder returns hidden states,
and the reference's own code applies the head) cannot stand in for it: swap says so in one
line naming both shapes, never "breaks" from a broadcast nor a raw matmul error."""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case, seed_everything
from layerdiff.mapping.rules import Mapping
from layerdiff.replay import Swapper, bisect
from layerdiff.replay.swap import SwapOutcome

DIM, VOCAB = 4, 1  # a vocabulary of one: (B, T, 1) logits broadcast against (B, T, DIM)


class RefDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x)


class Reference(nn.Module):
    """The head is applied by the root's code to what the decoder returns; the root adds the
    decoder's output to its input, which a (B, T, 1) tensor broadcasts into without error."""

    def __init__(self) -> None:
        super().__init__()
        self.decoder = RefDecoder()
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.decoder(x))


class PortDecoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.proj(x))  # the logits: the head is the decoder's own code


class Port(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.decoder = PortDecoder()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decoder(x)


def _case(model_cls: type[nn.Module]) -> Case:
    seed_everything(0)
    model = model_cls()
    x = torch.randn(2, 3, DIM)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0)


def reference() -> Case:
    return _case(Reference)


def port() -> Case:
    return _case(Port)


MAPPING = """version = 1
[[param]]
port = "decoder.head.weight"
reference = "head.weight"
"""


def _swapper() -> Swapper:
    return Swapper(reference, port, Mapping.from_text(MAPPING, "head.map.toml"))


def test_a_layer_returning_another_quantity_cannot_stand_in():
    result = _swapper().run(["decoder"])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result.breaks, result.describe()
    (layer, why), = result.not_swapped
    assert layer == "decoder" and "\n" not in why
    assert "returns a first output of shape (2, 3, 1) where the layer it replaces returns " \
           "(2, 3, 4): another quantity" in why, why


def test_bisect_never_names_it_a_culprit():
    result = bisect(_swapper())
    assert not result.culprits, result.probes
    assert [c.layers for c in result.cannot_judge] == [["decoder"]]
