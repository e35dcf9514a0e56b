"""diverge: the first step where a port's training departs from the reference's, and why."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from layerdiff import CaseError, ExternalCase
from layerdiff.debug.diverge import Cause, diverge
from layerdiff.report.diverge_html import write_diverge_html
from layerdiff.report.findings import render
from layerdiff.trace import open_trace
from reference_models import mlp, mlp_port, schedule_port, transformer, transformer_port

pytestmark = pytest.mark.usefixtures("one_thread")


def _check_output(result) -> None:
    json.dumps(result.as_json(), allow_nan=False)
    assert all(len(line) <= 100 for line in render(result).splitlines())


def test_schedule_switching_one_step_early_is_found_at_the_switch_in_the_optimizer(tmp_path):
    result = diverge(schedule_port.reference(), schedule_port.bug_schedule_early(), steps=4,
                     output_dir=tmp_path)
    switch = schedule_port.MILESTONE
    assert result.found and result.first_step == switch
    assert result.cause == Cause.OPTIMIZER and result.optimizer_step == switch - 1
    assert result.origin.role == "weight" and result.origin.step == switch
    assert "normalizes each element" not in result.explanation  # most elements moved
    # rerun from the reference's inputs, the port's update of step 2 is a tenth of the length
    assert all(p.kind == "step size" and p.step_ratio == pytest.approx(0.1, rel=1e-3)
               for p in result.optimizer_update.params)
    assert [row.out for row in result.per_step[:switch]] == [0] * switch
    assert all(row.out > 0 for row in result.per_step[switch:])
    losses = result.losses
    assert losses["reference"][:switch] == pytest.approx(losses["port"][:switch], rel=1e-6)
    assert abs(losses["reference"][switch] - losses["port"][switch]) > 1e-3
    # only the first diverging step is recorded in full
    with open_trace(result.traces["port_step"]) as trace:
        assert set(trace.index["step"]) == {switch}
        assert trace.meta["recorded_steps"] == [switch]
    page = write_diverge_html(result, tmp_path / "diverge.html").read_text()
    assert "Loss curves" in page and f"Step {switch} in full" in page
    assert page.count("data:image/png;base64,") >= 2  # the curves and the step's errors
    _check_output(result)


def test_a_clean_port_does_not_diverge(tmp_path):
    result = diverge(schedule_port.reference(), schedule_port.port(), steps=4,
                     output_dir=tmp_path)
    assert not result.found and result.first_step is None and result.cause is None
    assert result.step_diff is None and "port_step" not in result.traces
    assert len(result.per_step) == 4 and all(row.out == 0 for row in result.per_step)
    page = write_diverge_html(result, tmp_path / "diverge.html").read_text()
    assert "AGREES" in page
    _check_output(result)


def test_rounding_drift_of_a_correct_port_over_many_steps_is_not_a_divergence(tmp_path):
    # Two correct float32 MLPs (F.linear against explicit matmuls, erf GELU) drift apart as
    # training compounds rounding; the float64 run of the reference shows how far rounding
    # alone moves it, and the port stays within 4x that (per-dtype tolerances alone flag it
    # near step 90 on this machine).
    steps = 100
    reference = dataclasses.replace(mlp.reference(), steps=steps)
    port = dataclasses.replace(mlp_port.port(), steps=steps)
    result = diverge(reference, port, steps=steps, output_dir=tmp_path)
    assert result.golden and not result.found
    assert len(result.losses["golden"]) == steps


def test_weight_decay_coupled_into_adam_is_an_optimizer_difference_after_step_0(tmp_path):
    # A port written against Keras/TF's habit: weight decay added to the gradient (Adam's L2),
    # where the reference decouples it (AdamW). Step 0's forward and backward agree.
    reference = dataclasses.replace(
        mlp.reference(), steps=3,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3, weight_decay=0.1))
    port = dataclasses.replace(
        mlp_port.port(), steps=3,
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-3, weight_decay=0.1))
    result = diverge(reference, port, steps=3, output_dir=tmp_path)
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    assert result.optimizer_step == 0
    # decay through Adam's normalization is no constant factor of the weight or of the update
    assert result.optimizer_update.differing
    assert all(p.kind == "direction" for p in result.optimizer_update.differing)


def test_a_forward_bug_diverges_at_step_0_at_its_site(tmp_path):
    reference = dataclasses.replace(mlp.reference(), steps=2)
    port = dataclasses.replace(mlp_port.bug_gelu_tanh(), steps=2)
    result = diverge(reference, port, steps=2, output_dir=tmp_path)
    assert result.first_step == 0 and result.cause == Cause.FORWARD
    assert result.origin.site == "act2#0" and result.origin.pass_ == "forward"
    assert result.origin.hint["kind"] == "approximation"  # diverge's origins carry hints too


def test_the_port_gets_the_reference_weights_through_the_mapping(tmp_path):
    small = transformer.Config(d_model=16, heads=2, d_ff=32, layers=1, batch=3, src_len=5,
                               tgt_len=4)
    reference = transformer.build(small, steps=2, name="small transformer")
    torch.manual_seed(1)  # a port with weights of its own until diverge loads the reference's
    port = dataclasses.replace(reference, model=transformer_port.TransformerPort(small),
                               name="small transformer port")
    mapping = transformer_port.__file__.replace(".py", ".map.toml")
    result = diverge(reference, port, mapping=mapping, steps=2, output_dir=tmp_path)
    assert not result.found


def test_bad_input_is_refused_with_a_sentence(tmp_path):
    with pytest.raises(CaseError, match="at least 1"):
        diverge(schedule_port.reference(), schedule_port.port(), steps=0, output_dir=tmp_path)
    with pytest.raises(CaseError, match="records itself"):
        diverge(ExternalCase(run=lambda *a, **k: None, name="numpy"), schedule_port.port(),
                steps=2, output_dir=tmp_path)
    with pytest.raises(CaseError, match="not of the form"):
        diverge("reference_models.mlp", schedule_port.port(), steps=2, output_dir=tmp_path)
    with pytest.raises(CaseError, match="specs"):
        diverge(object(), schedule_port.port(), steps=2)  # type: ignore[arg-type]
