"""Tiny models that exercise what capture must get right: in-place ops, keyword inputs,
nested outputs, a module called twice, dropout, and a model that fails inside a layer."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, ExternalCase, seed_everything


class Block(nn.Module):
    """Residual block with an in-place ReLU and an in-place add inside its forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(width, width)
        self.act = nn.ReLU(inplace=True)
        self.lin2 = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor, *, scale: float = 1.0,
                mask: torch.Tensor | None = None) -> torch.Tensor:
        h = self.act(self.lin1(x))
        h = self.drop(self.lin2(h))
        if mask is not None:
            h = h * mask
        h += x  # in-place add on a non-leaf
        return h * scale


class TwoHeads(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.a = nn.Linear(width, 3)
        self.b = nn.Linear(width, 2)

    def forward(self, x: torch.Tensor) -> dict:
        return {"logits": self.a(x), "aux": (self.b(x), x.shape[0])}


class TinyNet(nn.Module):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.embed = nn.Linear(4, width)
        self.block = Block(width)          # called twice: two sites
        self.norm = nn.LayerNorm(width)
        self.heads = TwoHeads(width)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> dict:
        h = self.embed(x)
        h = self.block(h, scale=0.5, mask=mask)
        h = self.block(h, mask=mask)
        return self.heads(self.norm(h))


def _targets(batch: int) -> torch.Tensor:
    return torch.arange(batch) % 3


def tiny(steps: int = 1, seed: int = 0) -> Case:
    seed_everything(seed)
    model = TinyNet()
    x = torch.randn(6, 4)
    mask = (torch.rand(6, 8) > 0.2).float()
    y = _targets(6)

    def loss_fn(out: dict) -> torch.Tensor:
        return F.cross_entropy(out["logits"], y) + 0.1 * out["aux"][0].pow(2).mean()

    return Case(model=model, inputs=(x, mask), loss_fn=loss_fn, seed=seed, steps=steps,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
                name="tests.tiny_cases:tiny")


def tiny_steps() -> Case:
    return tiny(steps=3)


def tiny_kwargs() -> Case:
    case = tiny()
    x, mask = case.inputs
    case.inputs = {"x": x, "mask": mask}
    return case


class Exploding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.bad = nn.Linear(5, 4)  # wrong input width: raises inside 'bad'

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bad(self.first(x))


def exploding() -> Case:
    seed_everything(0)
    return Case(model=Exploding(), inputs=(torch.randn(2, 4),), loss_fn=lambda o: o.sum(),
                name="tests.tiny_cases:exploding")


def big_tensor() -> Case:
    """One layer whose output is larger than a small writer queue."""
    seed_everything(0)
    model = nn.Sequential(nn.Linear(16, 4096), nn.Tanh())
    return Case(model=model, inputs=(torch.randn(32, 16),), loss_fn=lambda o: o.mean(),
                name="tests.tiny_cases:big_tensor")


not_a_case = 42


def numpy_port() -> ExternalCase:
    """A port that is not torch: two numpy 'layers' that record themselves."""
    import numpy as np

    def run(writer, steps: int, loss_scale: float) -> None:
        rng = np.random.default_rng(0)
        x = rng.standard_normal((4, 3)).astype(np.float32)
        w = rng.standard_normal((3, 2)).astype(np.float32)
        for step in range(steps):
            if step:
                writer.step()
            with writer.site("lin", "Linear") as site:
                writer.record(site, "input", x)
                writer.record(site, "weight", w, arg="weight")
                y = x @ w
                writer.record(site, "output", y)
            dy = np.full_like(y, loss_scale / y.size)
            writer.record(site, "grad_output", dy)
            writer.record(site, "weight_grad", x.T @ dy, arg="weight")

    return ExternalCase(run=run, seed=0, steps=2, name="tests.tiny_cases:numpy_port")


def failing_numpy_port() -> ExternalCase:
    def run(writer, steps: int, loss_scale: float) -> None:
        with writer.site("lin") as site:
            writer.record(site, "input", __import__("numpy").ones(3))
            raise FloatingPointError("overflow in lin")

    return ExternalCase(run=run, name="tests.tiny_cases:failing_numpy_port")


class _Jitter(nn.Module):
    """Adds noise from the operating system's entropy: a different result every run."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import numpy as np

        noise = np.random.default_rng().standard_normal(x.shape).astype(np.float32)
        return x + 1e-3 * torch.from_numpy(noise)


def nondeterministic() -> Case:
    """A deterministic layer, then one that is not: nondeterminism enters at 'jitter'."""
    seed_everything(0)
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 4))
    model.add_module("jitter", _Jitter())
    model.add_module("head", nn.Linear(4, 2))
    return Case(model=model, inputs=(torch.randn(3, 4),), loss_fn=lambda o: o.pow(2).mean(),
                name="tests.tiny_cases:nondeterministic")
