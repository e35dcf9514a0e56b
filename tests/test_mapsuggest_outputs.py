"""map-suggest leaves out an output that the port computes as another quantity: OpenAI's
Whisper attention returns its scores before the softmax as output 1 where Hugging Face's returns
the softmax weights (same shape). With output 0 equal to the reference's, output 1 far from it
is what the output is, not an error upstream: the draft declares it [[unmatched]] with that
evidence, instead of pairing it and failing the faithful port at that attention."""

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
