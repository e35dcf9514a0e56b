"""layerdiff health: a healthy model passes every check, and each planted problem fails exactly
its own check at its site (tests/health_cases.py); the command's exit codes, JSON and page."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from layerdiff.cli import main
from layerdiff.health import CHECKS, HealthResult, Verdict, health
from layerdiff.report.findings import render
from layerdiff.report.health_html import render_health_html
from layerdiff.report.text import WIDTH
from tests import health_cases as cases

STEPS = 20
FAST = [c for c in CHECKS if c != "determinism"]  # determinism starts fresh processes: slow


@pytest.fixture(scope="module")
def results() -> dict[str, HealthResult]:
    """Each case's health, run once for the module."""
    found: dict[str, HealthResult] = {}

    def get(name: str) -> HealthResult:
        if name not in found:
            found[name] = health(getattr(cases, name)(), STEPS, checks=FAST)
        return found[name]

    return get


def _failed(result: HealthResult) -> list[str]:
    return [c.name for c in result.checks if c.verdict == Verdict.FAIL]


def test_a_healthy_mlp_passes_every_check(results):
    result = results("healthy")
    assert [c.name for c in result.checks] == FAST
    assert {c.name: str(c.verdict) for c in result.checks} == dict.fromkeys(FAST, "pass")
    assert not result.found
    assert result.losses[-1] < 0.5 * result.losses[0]


def test_a_healthy_transformer_passes():
    """The bundled attention classifier: nothing fails or warns."""
    result = health("reference_models.batch_mixing:reference", STEPS, checks=FAST)
    assert {c.name: str(c.verdict) for c in result.checks} == dict.fromkeys(FAST, "pass")


@pytest.mark.parametrize("name", sorted(cases.PLANTED))
def test_a_planted_problem_fails_exactly_its_check_at_its_site(results, name):
    check, site = cases.PLANTED[name]
    result = results(name)
    assert _failed(result) == [check], render(result)
    assert result[check].site == site
    assert result.found


def test_overfit_names_the_blocked_parameters(results):
    detached = results("detached")["overfit"]
    assert detached.details["no_gradient"] == ["fc1.weight", "fc1.bias"]
    assert "detach" in detached.evidence
    frozen = results("frozen")["overfit"]
    assert frozen.details["frozen"] == ["fc2.weight", "fc2.bias"]
    assert "requires_grad False" in frozen.evidence


def test_a_cut_is_named_at_the_layer_just_before_it(results):
    check = results("detached_after_fc2")["overfit"]
    assert check.site == "fc2"
    assert check.details["no_gradient"] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def test_parameters_the_optimizer_never_moves_are_named(results):
    check = results("not_in_optimizer")["overfit"]
    assert check.details["not_updated"] == ["fc2.weight", "fc2.bias"]
    assert "param groups" in check.evidence


def test_the_nan_is_named_at_its_step(results):
    check = results("nan_from_step")["nonfinite"]
    assert check.step == cases.NAN_STEP
    # the training run stopped there, and the batch that cannot be fit is put down to it
    result = results("nan_from_step")
    assert len(result.losses) == cases.NAN_STEP
    assert any("stopped early" in note for note in result.notes)


def test_dead_units_counts_the_dead_layer_and_overfit_names_its_zero_gradients(results):
    result = results("dead_relu")
    module = result["dead-units"].details["modules"]["act1#0"]
    assert module["dead"] == module["units"] == cases.HIDDEN
    assert "fc1.weight" in result["overfit"].details["zero_gradient"]
    assert result["overfit"].verdict != Verdict.FAIL


def test_initial_loss_says_how_far_above_chance(results):
    check = results("head_too_large")["initial-loss"]
    assert check.details["expected"] == pytest.approx(torch.log(torch.tensor(5.0)).item())
    assert check.details["excess"] > 2
    assert results("healthy")["initial-loss"].details["excess"] < 0.5


def test_a_declared_expected_loss_is_used():
    case = cases.healthy()
    case.expected_initial_loss = 0.5  # a case may say what chance predicts for its loss
    check = health(case, 2, checks=["initial-loss"])["initial-loss"]
    assert check.details["expected"] == 0.5
    assert check.details["excess"] == pytest.approx(check.details["loss"] - 0.5)
    assert check.verdict == Verdict.WARN and "the declared 0.5" in check.evidence


def test_frozen_on_purpose_is_allowed():
    result = health(cases.frozen(), STEPS, checks=["overfit"], allow_frozen=["fc2.*"])
    assert result["overfit"].verdict != Verdict.FAIL  # judged by its loss alone
    assert result["overfit"].evidence.startswith("loss ")
    assert result["overfit"].details["allowed_frozen"] == ["fc2.bias", "fc2.weight"]


def test_a_case_without_optimizer_skips_the_checks_that_train():
    result = health(cases.no_optimizer(), STEPS, checks=FAST)
    skipped = {c.name for c in result.checks if c.verdict == Verdict.SKIP}
    assert skipped == {"overfit", "update-ratio"}
    assert "no optimizer" in result["overfit"].evidence
    assert any("overfit, update-ratio not judged" in note for note in result.notes)
    assert not result.found


def test_the_model_is_left_as_it_was():
    case = cases.healthy()
    before = {k: v.clone() for k, v in case.model.state_dict().items()}
    state = torch.get_rng_state()
    health(case, 3, checks=["overfit", "nonfinite"])
    after = case.model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert torch.equal(state, torch.get_rng_state())


def test_the_table_fits_the_terminal_and_the_page_draws_the_curves(results):
    result = results("fast_layer")
    text = render(result)
    assert max(map(len, text.splitlines())) <= WIDTH
    assert "update-ratio       FAIL" in text
    page = render_health_html(result)
    assert page.count("data:image/png;base64") == 3  # loss, gradient norms, update ratios
    assert "fc2" in page


def test_bad_check_names_are_refused_in_one_sentence():
    with pytest.raises(Exception, match="no check named 'speed'; the checks are initial-loss"):
        health(cases.healthy(), checks=["speed"])


# ---- the command


def _run(*args: str):
    return CliRunner().invoke(main, ["health", *args], catch_exceptions=False)


def test_the_command_exits_0_when_healthy_and_1_on_a_failure(tmp_path):
    checks = "initial-loss,overfit,update-ratio"
    ok = _run("tests.health_cases:healthy", "--steps", str(STEPS), "--checks", checks,
              "--json", str(tmp_path / "ok.json"))
    assert ok.exit_code == 0, ok.output
    data = json.loads((tmp_path / "ok.json").read_text())
    assert data["found"] is False
    assert [c["check"] for c in data["checks"]] == checks.split(",")
    assert len(data["losses"]) == STEPS
    bad = _run("tests.health_cases:fast_layer", "--steps", str(STEPS), "--checks", checks,
               "--json", "-", "--html", str(tmp_path / "page.html"))
    assert bad.exit_code == 1
    data = json.loads(bad.output)
    failed = [c for c in data["checks"] if c["verdict"] == "fail"]
    assert [(c["check"], c["site"], c["step"]) for c in failed] == [("update-ratio", "fc2", 0)]
    assert failed[0]["details"]["relative"]["fc2"] > 30
    assert (tmp_path / "page.html").read_text().startswith("<!DOCTYPE html>")


def test_the_command_refuses_bad_input_in_one_line():
    missing = _run("tests.health_cases:nothing_here")
    assert missing.exit_code == 2
    assert missing.output.count("\n") == 1 and "has no case 'nothing_here'" in missing.output
    unknown = _run("tests.health_cases:healthy", "--checks", "overfit,speed")
    assert unknown.exit_code == 2 and "no check named 'speed'" in unknown.output


def test_the_help_lists_every_check():
    text = _run("--help").output.replace("\n", " ")
    assert all(name in " ".join(text.split()) for name in CHECKS)


@pytest.mark.slow
def test_determinism_runs_the_case_twice_in_fresh_processes():
    result = health("tests.health_cases:healthy", 2, checks=["determinism"])
    assert result["determinism"].verdict == Verdict.PASS
    assert result["determinism"].details["runs"] == 2
    skipped = health(cases.healthy(), 2, checks=["determinism"])["determinism"]
    assert skipped.verdict == Verdict.SKIP and "package.module:name" in skipped.evidence
