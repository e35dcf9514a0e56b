"""diverge names the optimizer as the cause, and how its update differs, when the weights part
after an update made from gradients that agreed: weight decay, the learning rate or its
schedule, Adam's betas or eps; and keeps `forward` for a forward that differs on weights that
agree. The cases (tests/optimizer_cases.py) are written for this: an independent port with its
own names and fused q/k/v, trained with AdamW and param groups split by name."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from layerdiff.debug.diverge import Cause, diverge
from layerdiff.debug.optimizer_update import (
    DECAY_AND_STEP,
    DIRECTION,
    STEP_SIZE,
    WEIGHT_DECAY,
)
from layerdiff.report.diverge_html import render_diverge_html
from layerdiff.report.findings import render
from reference_models import mlp, mlp_port
from tests import optimizer_cases as cases

pytestmark = pytest.mark.usefixtures("one_thread")


def _diverge(reference, port, tmp_path):
    result = diverge(reference, port, mapping=cases.MAPPING, steps=cases.STEPS,
                     output_dir=tmp_path)
    json.dumps(result.as_json(), allow_nan=False)
    assert all(len(line) <= 100 for line in render(result).splitlines())
    return result


def _flat(text: str) -> str:
    """The terminal text with its wrapping undone."""
    return " ".join(text.split())


def test_norm_weights_exempt_from_decay_in_the_port_only_is_weight_decay(tmp_path):
    # The case: lr x wd = 1e-5 keeps the norm weights within tolerance at step 1, so the
    # first record out is a forward output; it was reported as cause `forward`.
    result = _diverge(cases.reference(), cases.port_norm_exempt(), tmp_path)
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    # each norm weight is off by 1.0e-5 against a float32 tolerance of 1.13e-5 (0.89 of it;
    # rounding moves that by about 1%): the weights are within tolerance, their outputs not
    assert result.origin.role != "weight"
    update = result.optimizer_update
    assert update and update.step == 0 and update.state_given
    norms = {"h.0.ln_1.weight", "h.0.ln_2.weight", "h.1.ln_1.weight", "h.1.ln_2.weight",
             "ln_f.weight"}
    assert {p.port for p in update.differing} == norms
    for param in update.differing:
        assert param.kind == WEIGHT_DECAY
        # every element of the norm weights (near 1) is rounded to ~1 ulp (1.2e-7) of 1e-5:
        # 2% leaves room for the measured 0.14%
        assert param.decay == pytest.approx(cases.LR * cases.WEIGHT_DECAY, rel=0.02)
        assert param.residual < 1e-3
        assert (param.reference_group, param.port_group) == (0, 1)
    text = _flat(render(result))
    assert "cause: optimizer" in text and "weight decay: 5 parameters" in text
    assert "the reference decays them and the port does not" in text
    assert "scale" not in text  # the origin's hint (port = 1 x reference) says less
    output = result.as_json()
    assert output["cause"] == "optimizer"
    assert output["optimizer_update"]["differs"] is True
    assert any("weight decay" in finding for finding in output["optimizer_update"]["findings"])
    page = render_diverge_html(result)
    assert "Optimizer update of step 0" in page and "the reference decays them" in page


def test_a_warmup_read_one_update_ahead_is_a_step_size_of_the_schedule(tmp_path):
    result = _diverge(cases.reference_warmup(), cases.port_warmup_ahead(), tmp_path)
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    update = result.optimizer_update
    assert len(update.differing) == len(update.params)  # the rate acts on every parameter
    for param in update.differing:
        assert param.kind == STEP_SIZE
        assert param.step_ratio == pytest.approx(2.0, rel=1e-3)  # lr 2/4 against 1/4 of peak
    text = _flat(render(result))
    assert "0.00025 in the reference's group 0 and 0.0005 in the port's group 0" in text
    assert "the learning rate or its schedule differs" in text


def test_a_doubled_rate_and_undecayed_norms_are_told_apart_per_group(tmp_path):
    result = _diverge(cases.reference(), cases.port_lr_norm_exempt(), tmp_path)
    assert result.cause == Cause.OPTIMIZER and len(result.optimizer_update.differing) == 30
    update = result.optimizer_update
    norms = [p for p in update.params if ".ln_" in p.port or p.port == "ln_f.weight"]
    for param in update.params:
        assert param.step_ratio == pytest.approx(2.0, rel=1e-3)
        if param in norms and param.port.endswith("weight"):
            # with the step's length fitted apart: the port's lr x the difference of the decays
            assert param.kind == DECAY_AND_STEP
            assert param.decay == pytest.approx(2 * cases.LR * cases.WEIGHT_DECAY, rel=0.02)
        else:
            assert param.kind == STEP_SIZE
    assert "at the port's lr a difference of 2e-05 (as measured)" in _flat(render(result))


def test_other_adam_betas_change_the_update_direction_from_step_1(tmp_path):
    # Adam's first update is g/|g| whatever the betas (bias correction), so the weights part
    # after the second; the first record out is the model's output, not a weight.
    result = _diverge(cases.reference(), cases.port_betas(), tmp_path)
    assert result.first_step == 2 and result.per_step[1].out == 0
    assert result.cause == Cause.OPTIMIZER and result.optimizer_step == 1
    update = result.optimizer_update
    assert update.step == 1 and update.differing
    assert all(param.kind == DIRECTION for param in update.differing)
    assert "betas (reference (0.9, 0.999), port (0.9, 0.95))" in " ".join(update.findings())


def test_a_port_optimizer_with_state_of_its_own_reruns_from_it_and_says_so(tmp_path):
    # The port's own AdamW keeps m, v, t where torch's keeps exp_avg, exp_avg_sq, step: the
    # reference's state cannot be given to it, so its update of step 1 starts from its own.
    result = _diverge(cases.reference(), cases.port_own_adamw_betas(), tmp_path)
    assert result.first_step == 2 and result.cause == Cause.OPTIMIZER
    update = result.optimizer_update
    assert not update.state_given and "keeps other state" in " ".join(update.notes)
    assert update.port_optimizer == "OwnAdamW" and update.differing
    assert all(param.kind == DIRECTION for param in update.differing)
    assert "betas (reference (0.9, 0.999), port (0.9, 0.95))" in " ".join(update.findings())


def test_an_optimizer_that_cannot_be_rerun_leaves_the_cause_to_the_records(tmp_path):
    class Plain:  # steps like an optimizer, but is not torch's kind (no step hooks)
        def __init__(self, params):
            self.params = list(params)

        def zero_grad(self, set_to_none=True):
            for p in self.params:
                p.grad = None

        @torch.no_grad()
        def step(self):
            for p in self.params:
                p.add_(p.grad, alpha=-0.2)  # the reference's rate is 0.1

    reference = dataclasses.replace(mlp.reference(), steps=2,
                                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    port = dataclasses.replace(mlp_port.port(), steps=2, optimizer=Plain)
    result = diverge(reference, port, steps=2, output_dir=tmp_path)
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    assert result.optimizer_update is None and result.as_json()["optimizer_update"] is None
    assert any("could not be rerun" in warning for warning in result.warnings)


def test_another_adam_eps_changes_the_update_direction(tmp_path):
    result = _diverge(cases.reference(), cases.port_eps(), tmp_path)
    assert result.found and result.cause == Cause.OPTIMIZER
    update = result.optimizer_update
    assert update.step == result.first_step - 1 and update.differing
    assert all(param.kind == DIRECTION for param in update.differing)
    assert "eps (reference 1e-08, port 1e-07)" in " ".join(update.findings())


def test_a_forward_that_differs_only_from_step_1_on_stays_forward(tmp_path):
    # A cache filled on the first call (the attention scale, rounded to bfloat16): the update
    # of step 0 is the reference's, the forward of step 1 is not.
    result = _diverge(cases.reference(), cases.port_stale_scale(), tmp_path)
    assert result.first_step == 1 and result.cause == Cause.FORWARD
    assert result.optimizer_update is not None and not result.optimizer_update
    assert "every parameter (30) gets the reference's update" in _flat(render(result))


def test_the_port_trained_as_the_reference_is_does_not_diverge(tmp_path):
    result = _diverge(cases.reference(), cases.port(), tmp_path)
    assert not result.found and result.optimizer_update is None


def test_gradient_clipping_the_port_leaves_out_is_named_by_the_gradients_its_optimizer_got(
        tmp_path):
    reference = dataclasses.replace(mlp.reference(), steps=3, clip_grad_norm=0.1)
    port = dataclasses.replace(mlp_port.port(), steps=3)
    result = diverge(reference, port, steps=3, output_dir=tmp_path)
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    for param in result.optimizer_update.params:  # SGD: the step grows with the gradient
        assert param.kind == STEP_SIZE
        assert param.step_ratio == pytest.approx(param.fed_ratio, rel=1e-3)
        assert param.fed_ratio > 1.5
    assert ("(clip_grad_norm: reference 0.1, port None): the gradient clipping (or unscaling) "
            "differs") in _flat(render(result))


def _sgd_case(momentum: float):
    """An MLP trained with SGD, weight decay coupled into the gradient, with or without
    momentum: settings the step-size and decay sentences do not compare by themselves."""
    from layerdiff import Case

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 2))
    torch.manual_seed(1)
    return Case(model, (torch.randn(32, 8),), lambda y: y.square().mean(), steps=3,
                optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=momentum,
                                                    weight_decay=0.05))


def test_a_group_setting_that_differs_is_named_beside_the_fitted_step(tmp_path):
    """A port without the reference's momentum: the update from the same gradients is shorter
    (momentum's buffer is missing), and the sentence names the setting that makes it so."""
    result = diverge(_sgd_case(0.9), _sgd_case(0.0), steps=3, output_dir=tmp_path)
    assert result.cause == Cause.OPTIMIZER and result.optimizer_update
    findings = " ".join(result.optimizer_update.findings())
    assert "differ in momentum (reference 0.9, port 0)" in findings
