"""Routers that choose one expert per token by argmax (Switch-style), found without a
declaration (layerdiff/trace/routers.py): their (T,) choice is compared as a decision, never
as numbers; a classifier's labels fed in beside its logits are data, not a router's choice."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerdiff import Case, capture, diff
from layerdiff.capture.port import capture_port
from layerdiff.mapping import Mapping
from layerdiff.trace import Trace
from layerdiff.trace.routers import routers

TOKENS, DIM, EXPERTS = 12, 8, 4


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * DIM ** -0.5)

    def forward(self, x: torch.Tensor, chosen: torch.Tensor) -> torch.Tensor:
        return torch.einsum("td,tde->te", x, self.w[chosen])


class Switch(nn.Module):
    """One expert per token, chosen by argmax of the router's probabilities."""

    def __init__(self, choose=None) -> None:
        super().__init__()
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = Experts()
        self.choose = choose or (lambda probs: probs.argmax(-1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        probs = F.softmax(self.gate(x), dim=-1)
        chosen = self.choose(probs)
        return self.experts(x, chosen) * probs.gather(-1, chosen[:, None])


def _case(choose=None, name: str = "switch") -> Case:
    torch.manual_seed(0)
    return Case(model=Switch(choose), inputs={"x": torch.randn(TOKENS, DIM)},
                loss_fn=lambda out: out.square().mean(), name=name)


def _second_on_token_3(probs: torch.Tensor) -> torch.Tensor:
    """The reference's choice, except token 3 goes to its second-best expert."""
    chosen = probs.argmax(-1)
    chosen[3] = probs[3].argsort(descending=True)[1]
    return chosen


def test_an_argmax_router_is_found_and_its_choice_judged_as_a_decision(tmp_path):
    reference = capture(_case(), tmp_path / "ref.h5", progress=False)
    assert routers(Trace(reference), Mapping()) == [(0, "gate#0", 1)]
    faithful = capture_port(_case(), tmp_path / "same.h5", weights_from=reference,
                            progress=False)
    assert diff(reference, faithful)
    port = capture_port(_case(_second_on_token_3, "switch_flip"), tmp_path / "port.h5",
                        weights_from=reference, progress=False)
    result = diff(reference, port)
    assert not result
    flips = result.meta["routing"]
    assert len(flips) == 1 and [f["token"] for f in flips[0]["flips"]] == [3], flips
    choice = result.rows[(result.rows["site"] == "experts#0") & (result.rows["arg"] == "1")]
    assert len(choice) == 1 and choice["ratio"].isna().all(), choice  # a decision, no ratio


class Classifier(nn.Module):
    """Logits beside the labels they are trained on, both passed to a loss module."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(DIM, EXPERTS)
        self.criterion = nn.CrossEntropyLoss()

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.criterion(self.head(x), labels)


def test_labels_the_logits_predict_are_data_not_a_routers_choice(tmp_path):
    torch.manual_seed(0)
    model, x = Classifier(), torch.randn(TOKENS, DIM)
    labels = model.head(x).argmax(-1).detach()  # a classifier that is right on every sample
    case = Case(model=model, inputs={"x": x, "labels": labels}, loss_fn=lambda loss: loss,
                name="classifier")
    assert routers(Trace(capture(case, tmp_path / "ref.h5", progress=False)), Mapping()) == []
