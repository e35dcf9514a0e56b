"""The debugging commands on the command line: each finds its bundled case's fault (exit 1,
the JSON naming it), passes a clean case (exit 0), and refuses bad input (exit 2)."""

from __future__ import annotations

import json

import pytest


def _json(path):
    return json.loads(path.read_text(encoding="utf-8"))


def test_nan_names_the_backward_only_nan_and_writes_json(run, tmp_path):
    result = run("nan", "reference_models.numerics:nan_sqrt_backward", "--json",
                 tmp_path / "nan.json")
    assert result.exit_code == 1, result.output
    first = _json(tmp_path / "nan.json")["first"]
    assert (first["site"], first["pass"], first["role"], first["step"], first["kind"]) == (
        "features.sqrt#0", "backward", "grad_input", 0, "nan")
    assert "features.sqrt#0" in result.output


def test_nan_finds_nothing_in_a_clean_case(run):
    result = run("nan", "reference_models.mlp:reference", "--json", "-")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["first"] is None


def test_nan_refuses_a_case_that_does_not_load(run):
    result = run("nan", "reference_models.numerics:nan_sqrt", "--steps", "2")
    assert result.exit_code == 2 and "did you mean nan_sqrt_backward" in result.output


@pytest.mark.slow
def test_determinism_finds_the_uninitialised_accumulator(run, tmp_path):
    result = run("determinism", "reference_models.numerics:convlstm_uninitialised_bias",
                 "--json", tmp_path / "det.json")
    assert result.exit_code == 1, result.output
    report = _json(tmp_path / "det.json")
    assert report["verdict"] == "nondeterministic"
    assert report["first"]["pass"] == "backward" and report["first"]["site"].startswith(
        "cell.conv#")


def test_batch_independence_names_the_reshape_that_mixes_samples(run, tmp_path):
    result = run("batch-independence", "reference_models.batch_mixing:bug_reshape_seq_first",
                 "--json", tmp_path / "batch.json")
    assert result.exit_code == 1, result.output
    report = _json(tmp_path / "batch.json")
    assert report["first"]["site"] == "blocks.0.attn#0"
    clean = run("batch-independence", "reference_models.batch_mixing:reference")
    assert clean.exit_code == 0, clean.output


def test_diverge_finds_the_early_schedule_switch_and_plots_the_losses(run, tmp_path):
    result = run("diverge", "reference_models.schedule_port:reference",
                 "reference_models.schedule_port:bug_schedule_early", "--steps", 5,
                 "-o", tmp_path / "traces", "--html", tmp_path / "diverge.html",
                 "--json", tmp_path / "diverge.json")
    assert result.exit_code == 1, result.output
    report = _json(tmp_path / "diverge.json")
    assert report["first_step"] == 3
    assert report["origin"]["role"] == "weight" and report["origin"]["step"] == 3
    page = (tmp_path / "diverge.html").read_text(encoding="utf-8")
    assert "<svg" in page or "data:image/png" in page
    assert max(len(line) for line in result.output.splitlines()  # paths may run longer
               if str(tmp_path) not in line) <= 100
