"""``check_determinism``: runs of a case in fresh processes, compared bit for bit."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, open_trace, seed_everything
from layerdiff.debug import check_determinism
from layerdiff.debug.determinism import DifferenceKind, RecordKey, compare_runs
from layerdiff.errors import CaptureError, CaseError
from layerdiff.report.findings import render

BUG = "reference_models.numerics:convlstm_uninitialised_bias"


@pytest.mark.slow  # two fresh Pythons that import torch: ~5 s of CPU each
def test_an_accumulator_holding_garbage_is_found_at_its_first_gradient(tmp_path):
    result = check_determinism(BUG, runs=2, steps=1, keep=tmp_path, parallel=True)
    assert result.found and result.verdict == "nondeterministic"
    assert result.first == RecordKey("cell.conv#0", 0, "backward", "weight_grad", "bias")
    assert result.within_tolerance is False  # garbage, not the rounding of another order
    (run2,) = result.comparisons
    assert run2.how == DifferenceKind.VALUES and run2.first_out == result.first
    assert len(result.traces) == 2 and all(os.path.exists(p) for p in result.traces)
    data = json.loads(json.dumps(result.as_json()))
    assert data["verdict"] == "nondeterministic" and data["within_tolerance"] is False
    assert data["first"] == {"site": "cell.conv#0", "step": 0, "pass": "backward",
                             "role": "weight_grad", "arg": "bias"}
    text = render(result)
    assert "cell.conv#0" in text and "OUT OF tolerance" in text
    assert all(len(line) <= 100 for line in text.splitlines())


@pytest.mark.slow
def test_a_deterministic_case_is_reported_deterministic():
    result = check_determinism("reference_models.mlp:reference", runs=2, parallel=True)
    assert not result.found and result.verdict == "deterministic"
    assert result.first is None and result.within_tolerance is None
    assert result.records > 0 and result.traces == []
    assert result.as_json()["verdict"] == "deterministic"
    assert render(result).startswith("deterministic:")


# ---- our own models, compared in one process (each capture draws its own order)

class RandomOrderSum(nn.Module):
    """Sums rows into buckets in an order drawn from os.urandom, as GPU atomicAdd sums in
    whatever order the threads arrive: the same sum, rounded differently."""

    def __init__(self, buckets: int) -> None:
        super().__init__()
        self.buckets = buckets

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        order = torch.from_numpy(np.frombuffer(os.urandom(8 * len(x)), "<u8").argsort())
        out = x.new_zeros(self.buckets, x.shape[1])
        return out.index_add(0, index[order], x[order])


class Pooled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 32)
        self.pool = RandomOrderSum(4)
        self.head = nn.Linear(32, 1)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.proj(x), index))


def random_order_case() -> Case:
    seed_everything(0)
    model = Pooled()
    x, index = torch.randn(256, 8), torch.arange(256) % 4
    y = torch.randn(4, 1)
    return Case(model=model, inputs=(x, index), loss_fn=lambda out: F.mse_loss(out, y),
                name="random_order_sum")


def test_a_reduction_in_another_order_differs_within_tolerance(tmp_path):
    paths = [capture(random_order_case(), tmp_path / f"run{k}.h5") for k in (1, 2)]
    with open_trace(paths[0]) as first, open_trace(paths[1]) as other:
        comparison = compare_runs(first, other, 2)
    assert comparison.first == RecordKey("pool#0", 0, "forward", "output", "0")
    assert comparison.how == DifferenceKind.VALUES
    assert comparison.within_tolerance is True and comparison.verdict == "within"
    assert comparison.max_abs > 0 and comparison.ratio <= 1


class TwoBranches(nn.Module):
    def __init__(self, first: str) -> None:
        super().__init__()
        self.left, self.right = nn.Linear(4, 4), nn.Linear(4, 4)
        self.first = first  # the order the branches run in (a set's order, between processes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        order = ("left", "right") if self.first == "left" else ("right", "left")
        outputs = {name: getattr(self, name)(x) for name in order}
        return outputs["left"] * outputs["right"]


def branches(first: str) -> Case:
    seed_everything(0)
    return Case(model=TwoBranches(first), inputs=(torch.randn(3, 4),),
                loss_fn=lambda out: out.sum(), name="two_branches")


def test_calls_in_another_order_are_a_layout_difference(tmp_path):
    a = capture(branches("left"), tmp_path / "a.h5")
    b = capture(branches("right"), tmp_path / "b.h5")
    with open_trace(a) as first, open_trace(b) as other:
        comparison = compare_runs(first, other, 2)
    assert comparison.how == DifferenceKind.LAYOUT and comparison.within_tolerance is False
    assert comparison.first.site == "left#0" and comparison.first.pass_ == "forward"
    assert "right#0" in comparison.note


# ---- bad input

def test_bad_input_is_refused_before_any_run():
    with pytest.raises(CaptureError, match="at least 2"):
        check_determinism("reference_models.mlp:reference", runs=1)
    with pytest.raises(CaseError, match="does not import"):
        check_determinism("reference_models.nope:reference")
    with pytest.raises(CaseError, match="not of the form"):
        check_determinism("reference_models.mlp")
