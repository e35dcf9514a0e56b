"""Weights the reference's code uses straight from a child it never calls (a Mamba mixer's
``F.conv1d(x, self.conv1d.weight, ...)`` and ``self.dt_proj.weight @ x``) are recorded at the
parent's site; the diff pairs them by the same resolution that loading weights and map-check
use (issue 39), so none goes unchecked behind "unpaired"."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, diff, load_weights, seed_everything
from layerdiff.capture import capture
from layerdiff.mapping import Mapping

WIDTH, LENGTH = 6, 10

MAPPING = """version = 1

[[site]]
reference = "mixer"
port = "ssm"

[[site]]
reference = "mixer.conv1d"
port = "ssm.conv"

[[site]]
reference = "mixer.dt_proj"
port = "ssm.dt"
"""


class RefMixer(nn.Module):
    """Uses its children's weights in its own code, never calling them."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(WIDTH, WIDTH, 3, groups=WIDTH, padding=2)
        self.dt_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (B, WIDTH, LENGTH)
        h = F.conv1d(x, self.conv1d.weight, self.conv1d.bias, padding=2,
                     groups=WIDTH)[..., :LENGTH]
        return torch.einsum("oi,bil->bol", self.dt_proj.weight, F.silu(h))


class PortMixer(nn.Module):
    """The same numbers, written with calls of its children (so they are sites)."""

    def __init__(self, dt_scale: float = 1.0) -> None:
        super().__init__()
        self.conv = nn.Conv1d(WIDTH, WIDTH, 3, groups=WIDTH, padding=2)
        self.dt = nn.Linear(WIDTH, WIDTH)
        self.dt_scale = dt_scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.silu(self.conv(x)[..., :LENGTH])
        weight = self.dt.weight * self.dt_scale
        return torch.einsum("oi,bil->bol", weight, h)


class Model(nn.Module):
    def __init__(self, mixer: nn.Module, name: str) -> None:
        super().__init__()
        self.add_module(name, mixer)
        self.head = nn.Linear(WIDTH, 3)
        self.name = name

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(getattr(self, self.name)(x).mean(-1))


def _case(model: nn.Module) -> Case:
    x = torch.randn(4, WIDTH, LENGTH, generator=torch.Generator().manual_seed(2))
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0)


def _pair(tmp_path, **bug):
    seed_everything(0)
    reference = capture(_case(Model(RefMixer(), "mixer")), tmp_path / "ref.h5", progress=False)
    mapping = tmp_path / "port.map.toml"
    mapping.write_text(MAPPING, encoding="utf-8")
    port = Model(PortMixer(**bug), "ssm")
    load_weights(port, reference, mapping)
    return diff(reference, capture(_case(port), tmp_path / "port.h5", progress=False),
                mapping=mapping)


def test_weights_used_by_the_parents_code_are_compared_on_the_faithful_port(tmp_path):
    result = _pair(tmp_path)
    assert result, result.failing()
    rows = result.rows
    params = rows[rows["role"].isin(["weight", "weight_grad"]) & (rows["site"] == "mixer#0")]
    compared = {(role, arg) for role, arg in zip(params["role"], params["arg"], strict=True)}
    every = {(role, f"{module}.{leaf}") for role in ("weight", "weight_grad")
             for module in ("conv1d", "dt_proj") for leaf in ("weight", "bias")}
    assert compared == every - {("weight_grad", "dt_proj.bias")}  # used by neither: no gradient
    unmatched = result.unmatched
    assert not unmatched["reason"].str.contains("does not record").any(), unmatched


def test_a_wrong_gradient_of_such_a_weight_is_out(tmp_path):
    """The port scales dt's weight in its own code: the forward and dt's weight gradient are
    out, and that gradient is a compared record, not one left unpaired."""
    result = _pair(tmp_path, dt_scale=1.5)
    assert not result
    failing = result.failing()
    grads = failing[(failing["role"] == "weight_grad") & (failing["arg"] == "dt_proj.weight")]
    assert len(grads) == 1


def test_loading_weights_and_the_diff_share_one_module_resolution():
    mapping = Mapping.from_text(MAPPING, "port.map.toml")
    partners = mapping.module_partners({"ssm", "ssm.conv", "ssm.dt", "head"},
                                       {"mixer", "mixer.conv1d", "mixer.dt_proj", "head"})
    assert partners == {"ssm": "mixer", "ssm.conv": "mixer.conv1d", "ssm.dt": "mixer.dt_proj",
                        "head": "head"}
