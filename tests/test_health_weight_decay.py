"""update-ratio under AdamW: a layer whose gradient is zero at every step (behind dead units)
moves by weight decay alone; it is not compared with the layers that learn, so dead units fail
dead-units only, not update-ratio too (each problem fails once, at its own check). In this
CNN the second convolution's units are all dead: both convolutions get a zero gradient and
only the head's bias learns, which beside their decay looked ~100x too fast."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from layerdiff.health import Verdict, health


class CNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act1 = nn.ReLU()
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.act2 = nn.ReLU()
        self.head = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act2(self.conv2(self.act1(self.conv1(x))))
        return self.head(h.mean(dim=(2, 3)))


def _case(dead: bool) -> Case:
    seed_everything(0)
    model = CNN()
    if dead:
        with torch.no_grad():
            model.conv2.bias.fill_(-10.0)  # act2 never fires
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(out, y), seed=0,
                optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2))


def test_dead_units_under_adamw_fail_dead_units_only():
    result = health(_case(dead=True), 20, checks=["update-ratio", "dead-units"])
    assert result["dead-units"].verdict == Verdict.FAIL
    assert result["dead-units"].site == "act2#0"
    ratio = result["update-ratio"]
    assert ratio.verdict != Verdict.FAIL, ratio.evidence
    assert ratio.details["zero_gradient_layers"] == ["conv1", "conv2"]


def test_the_healthy_cnn_passes_both():
    result = health(_case(dead=False), 20, checks=["update-ratio", "dead-units"])
    assert [c.verdict for c in result.checks] == [Verdict.PASS, Verdict.PASS]
    assert result["update-ratio"].details["zero_gradient_layers"] == []
