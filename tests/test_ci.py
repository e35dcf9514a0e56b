"""Numerical parity in CI: goldens, the three outcomes of a check, JUnit, calibration and the
pytest plugin's update flow."""

from __future__ import annotations

import dataclasses
import xml.etree.ElementTree as ET

import h5py
import pytest
import torch

from layerdiff import DiffError, TraceError
from layerdiff.ci import CheckOutcome, calibrate, check, golden
from layerdiff.report.findings.diff import check_line
from layerdiff.report.junit import write_junit
from reference_models import mlp, mlp_port

PORT = "reference_models.mlp_port:port"


def _as(factory, name):
    """The case a factory builds, under another case's name: a change to the code behind it."""
    return lambda: dataclasses.replace(factory(), name=name)


@pytest.fixture
def mlp_golden(tmp_path):
    return golden(PORT, tmp_path / "golden.h5")


def test_unchanged_code_is_identical(mlp_golden):
    result = check(PORT, mlp_golden)
    assert result.outcome == "identical" and result.passed
    assert result.outcome is CheckOutcome.IDENTICAL
    assert check_line(result).startswith("IDENTICAL  reference_models.mlp_port:port: all")
    assert "bit for bit" in check_line(result)  # a full golden's bytes were compared


def test_a_change_within_tolerance_is_drift_and_says_where(mlp_golden):
    """The reference MLP computes what the port does, to rounding: drift, not failure."""
    result = check(_as(mlp.reference, PORT), mlp_golden)
    assert result.outcome == "drift" and result.passed
    assert "within tolerance; the most at" in check_line(result)


def test_a_planted_change_fails_with_its_origin(mlp_golden, tmp_path):
    result = check(_as(mlp_port.bug_weight_not_transposed, PORT), mlp_golden)
    assert result.outcome == "fail" and not result.passed
    assert "origin fc2#0, forward output" in check_line(result)
    junit = ET.parse(write_junit(result.diff, tmp_path / "j.xml")).getroot()
    cases = {c.get("name"): c for c in junit.iter("testcase")}
    assert len(cases) == result.diff.rows["site"].nunique()  # one test case per site
    assert cases["fc2#0"].find("failure").get("message").startswith("origin: fc2#0")
    assert "propagated from fc2#0" in cases["head#0"].find("failure").get("message")
    failing = {c for c, case in cases.items() if case.find("failure") is not None}
    assert failing == set(result.diff.failing()["site"])


def test_a_summary_golden_is_small_and_checks_by_statistics(tmp_path):
    path = golden(PORT, tmp_path / "g.h5", summary=True)
    assert path.stat().st_size < 200_000
    unchanged = check(PORT, path)
    assert unchanged.outcome == "identical"
    # a summary golden holds no tensors: it can only ever know that the digests agree
    assert set(unchanged.diff.rows["verdict"]) == {"same-digest"}
    assert "by their digests alone (no data to compare bytes" in check_line(unchanged)
    assert not check(_as(mlp_port.bug_weight_not_transposed, PORT), path).passed


def test_a_golden_of_another_case_is_refused(mlp_golden):
    with pytest.raises(DiffError, match=r"was recorded from case reference_models\.mlp_port:port"):
        check("reference_models.mlp:reference", mlp_golden)


def test_a_golden_of_another_format_version_is_refused(mlp_golden):
    with h5py.File(mlp_golden, "r+") as f:
        f.attrs["layerdiff_version"] = 0
    with pytest.raises(TraceError, match="version"):
        check(PORT, mlp_golden)


def test_calibration_finds_where_nondeterminism_enters(tmp_path):
    result = calibrate("tests.tiny_cases:nondeterministic", tmp_path / "tol.toml", runs=3)
    assert result.first_nondeterministic == "jitter#0"  # lin#0's forward is deterministic
    text = (tmp_path / "tol.toml").read_text()
    assert 'site = "jitter#0"' in text and "x 10" in text


def test_calibration_of_a_deterministic_case_writes_loaded_tolerances(tmp_path):
    from layerdiff.compare import Tolerances

    result = calibrate(PORT, tmp_path / "tol.toml", runs=2)
    assert result.nondeterministic == [] and result.float64 == ""
    tolerances = Tolerances.load(tmp_path / "tol.toml")
    looser = tolerances.lookup("fc2#0", "output", "0", "float32")
    assert looser.rtol >= 1.3e-6 and "noise" in looser.source


PLUGIN_TEST = """
def test_parity(layerdiff_check, tmp_path_factory):
    layerdiff_check("reference_models.mlp_port:port", GOLDEN)
"""


def test_pytest_plugin_update_flow(pytester, tmp_path):
    golden_path = tmp_path / "goldens" / "port.h5"
    pytester.makepyfile(PLUGIN_TEST.replace("GOLDEN", repr(str(golden_path))))
    missing = pytester.runpytest("-p", "no:cacheprovider")
    missing.assert_outcomes(failed=1)
    assert "--layerdiff-update-golden" in missing.stdout.str()
    pytester.runpytest("--layerdiff-update-golden").assert_outcomes(passed=1)
    assert golden_path.exists()
    pytester.runpytest().assert_outcomes(passed=1)


def test_cli_golden_and_check(run, tmp_path):
    out = tmp_path / "g.h5"
    assert run("golden", PORT, "-o", out, "--summary").exit_code == 0
    result = run("check", PORT, out, "--junit", tmp_path / "j.xml")
    assert result.exit_code == 0 and result.output.startswith("IDENTICAL")
    assert (tmp_path / "j.xml").exists()
    other = run("check", "reference_models.mlp:reference", out)
    assert other.exit_code == 2 and "was recorded from case" in other.output


def test_a_changed_structure_fails_even_when_the_numbers_agree(mlp_golden):
    """act2 wrapped in a Sequential: same numbers, one more site: not 'identical'."""

    def wrapped():
        case = mlp_port.port()
        case.model.act2 = torch.nn.Sequential(case.model.act2)
        return dataclasses.replace(case, name=PORT)

    result = check(wrapped, mlp_golden)
    assert result.outcome == "fail"
    assert "new in this run: act2.0#0" in check_line(result)
