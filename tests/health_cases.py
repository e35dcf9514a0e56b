"""Tiny cases for ``layerdiff health``: a healthy MLP, and the same MLP with one planted
problem each, which health must fail at its own check and site (tests/test_health.py)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, IN, HIDDEN, CLASSES = 32, 12, 24, 5
NAN_STEP = 3


class NanFrom(nn.Module):
    """Passes its input through, until its ``NAN_STEP``-th training call: from then on it
    multiplies by NaN. The count is a buffer, so it restarts whenever the model's state is
    put back (as health does between its runs)."""

    def __init__(self, step: int) -> None:
        super().__init__()
        self.step = step
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        calls = int(self.calls)
        self.calls += 1
        return x * float("nan") if calls >= self.step else x


class BatchCentre(nn.Module):
    """Subtracts the batch's mean: every sample's output depends on the others' (a mean over
    the wrong axis)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(dim=0, keepdim=True)


class MLP(nn.Module):
    def __init__(self, *, detach: bool = False, nan: bool = False, mix: bool = False,
                 detach_after: str = "fc1", functional: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(IN, HIDDEN)
        self.act1 = nn.ReLU()
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)
        self.act2 = nn.ReLU()
        self.extra = NanFrom(NAN_STEP) if nan else (BatchCentre() if mix else nn.Identity())
        self.head = nn.Linear(HIDDEN, CLASSES)
        self.detach = detach_after if detach else ""
        self.functional = functional

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        h = F.relu(h) if self.functional else self.act1(h)
        if self.detach == "fc1":  # BUG: cuts the graph, so fc1 never learns
            h = h.detach()
        h = self.fc2(h)
        if self.detach == "fc2":  # BUG: cuts the graph after fc2: fc1 and fc2 never learn
            h = h.detach()
        return self.head(self.extra(self.act2(h)))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(BATCH, IN)
    teacher = torch.randn(IN, CLASSES)
    return x, (x @ teacher).argmax(dim=1)


LR = 1e-2


def _adam(params):
    return torch.optim.Adam(params, lr=LR)


def _case(name: str, model: MLP | None = None, optimizer=_adam, **kwargs) -> Case:
    seed_everything(SEED)
    model = model if model is not None else MLP(**kwargs)
    x, y = _data()
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=2, optimizer=optimizer, name=f"tests.health_cases:{name}")


def healthy() -> Case:
    return _case("healthy")


def head_too_large() -> Case:
    """The output layer initialised 100x too large: the logits start saturated."""
    case = _case("head_too_large")
    with torch.no_grad():
        case.model.head.weight.mul_(100.0)
    return case


def detached() -> Case:
    return _case("detached", detach=True)


def detached_after_fc2() -> Case:
    return _case("detached_after_fc2", detach=True, detach_after="fc2")


def not_in_optimizer() -> Case:
    """fc2 left out of the optimizer: it gets gradients, and never moves."""
    seed_everything(SEED)
    model = MLP()
    left_out = {id(p) for p in model.fc2.parameters()}
    return _case("not_in_optimizer", model,
                 lambda params: _adam([p for p in params if id(p) not in left_out]))


def functional_dead_relu() -> Case:
    """Dead ReLUs applied with F.relu in the model's own code: seen at the call that reads
    them, fc2's."""
    case = _case("functional_dead_relu", functional=True)
    with torch.no_grad():
        case.model.fc1.bias.fill_(-100.0)
    return case


def frozen() -> Case:
    case = _case("frozen")
    case.model.fc2.requires_grad_(False)
    return case


def fast_layer() -> Case:
    """fc2 in a param group of its own with 100x the learning rate."""
    seed_everything(SEED)
    model = MLP()
    mine = {id(p) for p in model.fc2.parameters()}

    def optimizer(params):
        params = list(params)
        return torch.optim.Adam([
            {"params": [p for p in params if id(p) not in mine]},
            {"params": [p for p in params if id(p) in mine], "lr": 100 * LR}], lr=LR)

    return _case("fast_layer", model, optimizer)


def dead_relu() -> Case:
    """fc1's bias so negative that act1 never fires."""
    case = _case("dead_relu")
    with torch.no_grad():
        case.model.fc1.bias.fill_(-100.0)
    return case


def nan_from_step() -> Case:
    return _case("nan_from_step", nan=True)


def batch_mixing() -> Case:
    return _case("batch_mixing", mix=True)


def no_optimizer() -> Case:
    return _case("no_optimizer", optimizer=None)


PLANTED = {  # case -> (the check that must fail, the site it must name)
    "head_too_large": ("initial-loss", "head#0"),
    "detached": ("overfit", "fc1"),
    "detached_after_fc2": ("overfit", "fc2"),
    "frozen": ("overfit", "fc2"),
    "not_in_optimizer": ("overfit", "fc2"),
    "functional_dead_relu": ("dead-units", "fc2#0 input"),
    "fast_layer": ("update-ratio", "fc2"),
    "dead_relu": ("dead-units", "act1#0"),
    "nan_from_step": ("nonfinite", "extra#0"),
    "batch_mixing": ("batch-independence", "extra#0"),
}
