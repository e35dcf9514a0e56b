"""Routing weights normalised otherwise, named at the router that returns them
(layerdiff/compare/weighting.py): a router that gives its chosen experts' weights as an output
(HF's and DeepSeek-V3's routers return logits, weights and indices) and a port that does not
renormalise them."""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case, capture, diff
from layerdiff.capture.port import capture_port

TOKENS, DIM, EXPERTS, K = 10, 8, 6, 2


class Router(nn.Module):
    def __init__(self, renormalise: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM) * DIM ** -0.5)
        self.renormalise = renormalise

    def forward(self, x: torch.Tensor):
        logits = x @ self.weight.T
        scores = logits.sigmoid()
        chosen = torch.topk(scores, K, dim=-1).indices
        weights = scores.gather(-1, chosen)
        if self.renormalise:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, weights * 2.5, chosen


class Experts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, DIM, DIM) * DIM ** -0.5)

    def forward(self, x, chosen, weights):
        return torch.einsum("td,tkde,tk->te", x, self.w[chosen], weights)


class Moe(nn.Module):
    def __init__(self, renormalise: bool = True) -> None:
        super().__init__()
        self.gate, self.experts = Router(renormalise), Experts()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, weights, chosen = self.gate(x)
        return self.experts(x, chosen, weights)


def _case(renormalise: bool = True) -> Case:
    torch.manual_seed(0)
    return Case(model=Moe(renormalise), inputs={"x": torch.randn(TOKENS, DIM)},
                loss_fn=lambda out: out.square().mean(), name=f"moe_{renormalise}")


def test_weights_not_renormalised_are_named_at_the_router_with_each_sides_sums(tmp_path):
    reference = capture(_case(), tmp_path / "ref.h5", progress=False)
    assert diff(reference, capture_port(_case(), tmp_path / "same.h5", weights_from=reference,
                                        progress=False))
    port = capture_port(_case(renormalise=False), tmp_path / "port.h5", weights_from=reference,
                        progress=False)
    result = diff(reference, port)
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role, origin.arg) == ("gate#0", "forward",
                                                                    "output", "1")
    assert origin.hint["kind"] == "routing-weights", origin.hint
    evidence = origin.hint["evidence"]
    assert "times one factor per token" in evidence and "the same experts" in evidence
    assert "the reference's weights sum to 2.5 per token" in evidence, evidence
