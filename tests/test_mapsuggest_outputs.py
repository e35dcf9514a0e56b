"""map-suggest on an encoder-decoder pair (HF Whisper against an OpenAI-layout port). It leaves
out an output that the port computes as another quantity: OpenAI's
Whisper attention returns its scores before the softmax as output 1 where Hugging Face's returns
the softmax weights (same shape). With output 0 equal to the reference's, output 1 far from it
is what the output is, not an error upstream: the draft declares it [[unmatched]] with that
evidence, instead of pairing it and failing the faithful port at that attention. And the root's
arguments, the case's data, pair by value only: Hugging Face's ``labels`` are not the port's
``tokens`` (the labels shifted right) for sharing a shape; the port's tokens need an adapter."""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case, capture, seed_everything
from layerdiff.mapping import Mapping
from layerdiff.mapsuggest import suggest_mapping

DIM = 8


class Attention(nn.Module):
    def __init__(self, scores: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.scores = scores

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.proj(x)
        logits = q @ x.transpose(-1, -2) / DIM ** 0.5
        weights = torch.softmax(logits, -1)
        return weights @ x, (logits.detach() if self.scores else weights)


class Model(nn.Module):
    def __init__(self, scores: bool) -> None:
        super().__init__()
        self.attn = Attention(scores)
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.attn(x)[0])


def _case(scores: bool) -> Case:
    seed_everything(0)
    model = Model(scores)
    x = torch.randn(2, 5, DIM)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0)


def test_an_output_that_is_another_quantity_is_declared_unmatched(tmp_path):
    ref = capture(_case(scores=False), tmp_path / "ref.h5")
    result = suggest_mapping(ref, _case(scores=True))
    entry = next(s for s in result.suggestions if s.kind == "unmatched-output")
    assert entry.reference == ["attn"] and entry.args == {"output": "1"}
    assert "returns another quantity as output 1" in entry.evidence[0], entry.evidence
    mapping = Mapping.from_text(result.text, "draft.toml")  # the draft reads as a mapping
    assert [(r.side, r.site, r.role, r.arg) for r in mapping.unmatched_records] == [
        ("reference", "attn", "output", "1")]


def test_the_same_quantity_is_paired(tmp_path):
    ref = capture(_case(scores=False), tmp_path / "ref.h5")
    result = suggest_mapping(ref, _case(scores=False))
    assert not [s for s in result.suggestions if s.kind == "unmatched-output"]


# ---- the root's arguments are the case's data: a shape in common does not pair them

class LabelsModel(nn.Module):
    """Hugging Face's way: takes the labels and shifts them right itself."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, DIM)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        tokens = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1)
        return self.embed(tokens) + x


class TokensModel(LabelsModel):
    """OpenAI's way: takes the tokens."""

    def forward(self, x: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens) + x


def _root_case(cls: type[nn.Module], shifted: bool) -> Case:
    seed_everything(0)
    model = cls()
    x, labels = torch.randn(2, 5, DIM), torch.randint(2, 10, (2, 5))
    tokens = torch.cat([torch.ones_like(labels[:, :1]), labels[:, :-1]], dim=1)
    return Case(model=model, inputs=(x, tokens if shifted else labels),
                loss_fn=lambda out: out.square().mean(), seed=0)


def test_a_root_input_no_reference_argument_equals_needs_an_adapter(tmp_path):
    ref = capture(_root_case(LabelsModel, shifted=False), tmp_path / "ref.h5")
    result = suggest_mapping(ref, _root_case(TokensModel, shifted=True))
    root = next(s for s in result.suggestions if s.kind == "site" and s.reference == ["<root>"])
    assert "labels" not in root.args, root.args  # same shape and dtype, other values
    assert root.adapter.startswith("the port's TokensModel.forward(x, tokens) gets tokens "
                                   "int64 (2,5)"), root.adapter
