"""``find_nan``: the first NaN or Inf of a run, found at its site, pass, role, step and kind."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, ExternalCase, open_trace, seed_everything
from layerdiff.debug import find_nan
from layerdiff.errors import CaptureError, CaseError
from layerdiff.report.findings import render

LOG_SOFTMAX = "reference_models.numerics:nan_log_softmax"
SQRT = "reference_models.numerics:nan_sqrt_backward"


def test_log_of_softmax_underflow_is_a_forward_inf_at_the_log_softmax_module():
    result = find_nan(LOG_SOFTMAX)
    assert result.found
    first = result.first
    assert (first.site, first.pass_, first.role, first.step, first.kind) == (
        "log_probs#0", "forward", "output", 0, "inf")
    assert first.min == -math.inf  # log(0): the underflowed probabilities
    producer = result.producer
    assert producer.site == "log_probs#0" and producer.type == "NaiveLogSoftmax"
    (logits,) = producer.inputs  # made from finite logits, far enough apart to underflow
    assert logits.role == "input" and math.isfinite(logits.min) and math.isfinite(logits.max)
    assert logits.max - logits.min > -math.log(np.finfo(np.float32).smallest_subnormal)
    data = json.loads(json.dumps(result.as_json()))  # JSON-safe: no NaN, no numpy scalars
    assert {key: data["first"][key] for key in ("site", "pass", "role", "step", "kind")} == {
        "site": "log_probs#0", "pass": "forward", "role": "output", "step": 0, "kind": "inf"}
    assert data["first"]["min"] == "-inf" and data["found"] is True
    assert all(len(line) <= 100 for line in render(result).splitlines())


def test_where_sqrt_has_a_finite_forward_and_a_nan_gradient_leaving_it():
    result = find_nan(SQRT)
    first = result.first
    assert (first.site, first.pass_, first.role, first.step, first.kind) == (
        "features.sqrt#0", "backward", "grad_input", 0, "nan")
    assert result.producer.site == "features.sqrt#0" and result.producer.pass_ == "backward"
    inputs = {value.role: value for value in result.producer.inputs}
    assert inputs["input"].min <= 0 < inputs["input"].max  # where sqrt has no finite gradient
    assert math.isfinite(inputs["grad_output"].min) and math.isfinite(inputs["grad_output"].max)
    assert "features.sqrt#0" in render(result) and "nan" in render(result)


def test_a_clean_case_reports_nothing():
    result = find_nan("reference_models.mlp:reference", steps=3)
    assert not result.found and result.first is None and result.producer is None
    assert result.steps_run == 3 and result.records_per_step > 0
    assert result.as_json()["first"] is None and "no NaN or Inf" in render(result)


# ---- a NaN that appears only after some optimizer steps (a model of our own)

class WarmupRsqrtSGD(torch.optim.SGD):
    """Linear warmup, then lr = base / sqrt(t - warmup + 1), ported with the + 1 lost: at
    t == warmup the learning rate is inf. The schedule lives in param_groups (saved state)."""

    def __init__(self, params, lr: float, warmup: int) -> None:
        super().__init__(params, lr=lr, momentum=0.9)
        for group in self.param_groups:
            group.update(base_lr=lr, warmup=warmup, count=0)

    def step(self, closure=None):
        for group in self.param_groups:
            t, warmup, base = group["count"], group["warmup"], group["base_lr"]
            with np.errstate(divide="ignore"):
                group["lr"] = (base * (t + 1) / warmup if t < warmup
                               else float(base / np.sqrt(np.float64(t - warmup))))  # BUG
            group["count"] = t + 1
        return super().step(closure)


def schedule_bug() -> Case:
    seed_everything(1)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 16))
    model.add_module("act", nn.ReLU())
    model.add_module("fc2", nn.Linear(16, 1))
    x = torch.randn(32, 8)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.mse_loss(out, y), seed=1,
                steps=6, optimizer=lambda params: WarmupRsqrtSGD(params, lr=0.05, warmup=3),
                name="tests.test_nan:schedule_bug")


def exploding_regression() -> Case:
    """Unscaled features and a learning rate far above 2/curvature: the weights grow ~20x a
    step, and the squares in the loss overflow long before anything else."""
    seed_everything(2)
    model = nn.Linear(4, 1)
    x = torch.randn(64, 4) * 10
    y = x @ torch.randn(4, 1)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.mse_loss(out, y), seed=2,
                steps=40, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name="tests.test_nan:exploding_regression")


def first_non_finite_by_hand(case: Case, steps: int):
    """The oracle: a plain training loop that looks at output, loss, gradients and weights."""
    seed_everything(case.seed)
    named = list(case.model.named_parameters())
    optimizer = case.optimizer([p for _, p in named])
    bad = lambda t: not bool(torch.isfinite(t).all())  # noqa: E731
    kind = lambda t: "nan" if bool(torch.isnan(t).any()) else "inf"  # noqa: E731
    for step in range(steps):
        optimizer.zero_grad()
        output = case.call_model()
        if bad(output):
            return step, "forward", "output", None, kind(output)
        loss = case.loss_fn(output)
        if bad(loss):
            return step, "forward", "loss", None, kind(loss)
        loss.backward()
        for name, param in named:
            if bad(param.grad):
                return step, "backward", "weight_grad", name, kind(param.grad)
        optimizer.step()
        for name, param in named:
            if bad(param):
                return step, "optimizer", "weight", name, kind(param)
    return None


def test_a_nan_made_by_the_optimizer_step_is_found_at_that_step():
    truth = first_non_finite_by_hand(schedule_bug(), 6)
    assert truth is not None and truth[:3] == (3, "optimizer", "weight")
    result = find_nan(schedule_bug())
    first = result.first
    assert (first.step, first.pass_, first.role, first.kind) == (3, "optimizer", "weight",
                                                                 truth[4])
    assert (first.site, first.arg) == ("fc1#0", "weight") and truth[3] == "fc1.weight"
    assert result.steps_run == 4  # stopped at the failing step
    producer = result.producer
    assert producer.pass_ == "optimizer" and producer.type == "WarmupRsqrtSGD"
    assert "(lr inf)" in producer.why
    roles = {value.role for value in producer.inputs}
    assert roles == {"weight", "weight_grad"}  # the finite weight and gradient it started from
    assert all(math.isfinite(v.min) and math.isfinite(v.max) for v in producer.inputs)


def test_divergence_is_found_where_it_first_overflows_the_loss():
    truth = first_non_finite_by_hand(exploding_regression(), 40)
    assert truth is not None and truth[1:3] == ("forward", "loss") and truth[0] > 3
    result = find_nan(exploding_regression())
    first = result.first
    assert (first.step, first.site, first.pass_, first.role, first.kind) == (
        truth[0], "<loss>#0", "forward", "output", truth[4])
    assert result.producer.site == "<loss>#0"
    (output,) = result.producer.inputs  # the model's output: finite, huge
    assert output.site == "<root>#0" and math.isfinite(output.max)
    assert max(abs(output.min), abs(output.max)) > 1e15


def test_with_output_the_failing_step_alone_is_captured_from_its_true_state(tmp_path):
    path = tmp_path / "failing.h5"
    result = find_nan(schedule_bug(), output=path)
    assert result.trace == str(path) and result.first.step == 3
    reference = schedule_bug()  # the weights at the start of step 3, by a plain run
    optimizer = reference.optimizer(list(reference.model.parameters()))
    seed_everything(reference.seed)
    for _ in range(3):
        optimizer.zero_grad()
        reference.loss_fn(reference.call_model()).backward()
        optimizer.step()
    with open_trace(path) as trace:
        assert trace.meta["nan"]["step"] == 3 and set(trace.index["step"]) == {0}
        row = trace.find(0, "fc1#0", "weight", "weight")
        np.testing.assert_array_equal(trace.read(row), reference.model.fc1.weight.detach())


def test_with_output_a_forward_nan_at_step_0_is_in_the_trace(tmp_path):
    result = find_nan(SQRT, output=tmp_path / "sqrt.h5")
    with open_trace(result.trace) as trace:
        row = trace.find(0, "features.sqrt#0", "grad_input", "0")
        assert row["nan"] > 0


# ---- made by a container's own code, between its submodules

class InlineBlock(nn.Module):
    def __init__(self, between) -> None:
        super().__init__()
        self.fc, self.out, self.between = nn.Linear(4, 4), nn.Linear(4, 1), between

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.between(self.fc(x)))  # `between` is code, not a module


class Net(nn.Module):
    def __init__(self, between) -> None:
        super().__init__()
        self.block = InlineBlock(between)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x).sum()


@pytest.mark.parametrize("between, first, pass_", [
    (torch.log, "block.out#0 input", "forward"),                  # log of negatives: NaN
    # sqrt's gradient is inf at 0, and the mask's backward multiplies it by 0: NaN
    (lambda h: torch.sqrt(h * (h > 0)), "block.fc#0 grad_output", "backward"),
])
def test_a_nan_made_between_submodules_is_blamed_on_their_container(between, first, pass_):
    seed_everything(0)
    case = Case(model=Net(between), inputs=(torch.randn(8, 4),), loss_fn=lambda out: out,
                name="inline")
    result = find_nan(case)
    assert f"{result.first.site} {result.first.role}" == first
    assert result.first.pass_ == pass_ and result.first.kind == "nan"
    assert result.producer.site == "block#0" and result.producer.type == "InlineBlock"
    assert "own code" in result.producer.why
    if pass_ == "forward":  # what its code worked on: fc's output, negatives included
        fc = next(v for v in result.producer.inputs if v.site == "block.fc#0")
        assert fc.role == "output" and fc.min < 0


# ---- a port that records itself

class _NumpyRegression:
    """A numpy linear regression recording itself, with the same schedule bug at step 2."""

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        self.x = rng.standard_normal((16, 3)).astype(np.float32)
        self.y = self.x @ np.array([1.0, -2.0, 0.5], np.float32)
        self.w = np.zeros(3, np.float32)

    def run(self, writer, steps: int, loss_scale: float) -> None:
        for step in range(steps):
            if step:
                writer.step()
            with writer.site("lin", "Linear") as site:
                writer.record(site, "input", self.x)
                writer.record(site, "weight", self.w, arg="weight")
                out = self.x @ self.w
                writer.record(site, "output", out)
            grad_out = 2 * (out - self.y) / len(out)
            writer.record("lin#0", "grad_output", grad_out)
            grad = self.x.T @ grad_out
            writer.record("lin#0", "weight_grad", grad, arg="weight")
            with np.errstate(divide="ignore"):
                lr = np.float32(0.1) / np.float32(step - 2) if step >= 2 else 0.1  # BUG at 2
            self.w = self.w - lr * grad


def test_a_port_that_records_itself_is_checked_and_its_optimizer_blamed():
    port = _NumpyRegression()
    result = find_nan(ExternalCase(run=port.run, steps=5, name="numpy_regression"))
    first = result.first
    assert (first.site, first.pass_, first.role, first.arg, first.step) == (
        "lin#0", "optimizer", "weight", "weight", 2)
    assert {v.role for v in result.producer.inputs} == {"weight", "weight_grad"}


def test_a_clean_port_that_records_itself_reports_nothing():
    result = find_nan("reference_models.convlstm_numpy:port")
    assert not result.found and result.steps_run == 3


# ---- bad input

def test_bad_input_gives_one_sentence():
    with pytest.raises(CaptureError, match="at least 1"):
        find_nan("reference_models.mlp:reference", steps=0)
    with pytest.raises(CaptureError, match="no optimizer"):
        find_nan(Case(model=nn.Linear(2, 1), inputs=(torch.ones(1, 2),),
                      loss_fn=lambda out: out.sum(), name="no_optimizer"), steps=5)
    with pytest.raises(CaseError, match="does not import"):
        find_nan("reference_models.nope:reference")


class _Raises(nn.Module):
    def forward(self, x):
        raise ValueError("shapes do not fit")


def test_a_model_that_raises_before_any_nan_is_a_capture_error():
    case = Case(model=_Raises(), inputs=(torch.ones(2),), loss_fn=lambda out: out,
                name="raises")
    with pytest.raises(CaptureError, match="raised ValueError: shapes do not fit during the "
                                           "forward of step 0, before any NaN"):
        find_nan(case)


def test_a_nan_in_a_weight_of_a_module_never_called_is_caught_after_the_step():
    """nn.MultiheadAttention uses out_proj's weight without calling out_proj: the weight is
    still checked after the optimizer step, under the attention's site."""

    class Attend(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mha = torch.nn.MultiheadAttention(8, 2)

        def forward(self, x):
            return self.mha(x, x, x, need_weights=False)[0]

    model = Attend()

    class Spoiling(torch.optim.SGD):
        def step(self, closure=None):
            super().step(closure)
            with torch.no_grad():
                model.mha.out_proj.weight[0, 0] = float("nan")

    case = Case(model, (torch.randn(5, 3, 8),), lambda out: out.square().mean(),
                          steps=2, optimizer=lambda params: Spoiling(params, lr=0.1))
    first = find_nan(case).first
    assert (first.site, first.pass_, first.role, first.arg, first.step) == (
        "mha#0", "optimizer", "weight", "out_proj.weight", 0)
