"""The command line: commands work end to end; bad input is one sentence and exit code 2."""

from __future__ import annotations

import json

import pytest

from layerdiff.trace import schema


def test_capture_then_show(run, tmp_path):
    out = tmp_path / "t.h5"
    result = run("capture", "tests.tiny_cases:tiny", "-o", out, "--steps", "1")
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output
    shown = run("show", out, "--site", "block.lin1*")
    assert shown.exit_code == 0
    lines = shown.output.splitlines()
    assert any("block.lin1#0" in line and "weight_grad" in line for line in lines)
    assert not any("heads" in line for line in lines[5:])
    assert max(len(line) for line in lines[5:]) <= 100


def test_show_json_is_machine_readable(run, tmp_path):
    out = tmp_path / "t.h5"
    assert run("capture", "tests.tiny_cases:tiny", "-o", out, "--summary").exit_code == 0
    result = run("show", out, "--json", "--role", "weight_grad")
    data = json.loads(result.output)
    assert data["summary"] is True and data["format_version"] == schema.FORMAT_VERSION
    assert {r["role"] for r in data["records"]} == {"weight_grad"}
    assert all(r["segment"] == -1 for r in data["records"])
    # the digests listed are said to be checksums, not proof that equal ones are equal bytes
    assert "layerdiff-wsum32 checksum" in data["digest"]
    assert "not against a deliberate one" in data["digest"]


def test_show_by_site_counts_roles(run, tmp_path):
    out = tmp_path / "t.h5"
    run("capture", "tests.tiny_cases:tiny", "-o", out)
    result = run("show", out, "--by-site")
    row = next(line for line in result.output.splitlines() if line.startswith("block.lin1#0"))
    assert row.split()[1:8] == ["Linear", "1", "1", "2", "1", "1", "2"]


@pytest.mark.parametrize("spec, message", [
    ("no_colon_here", "not of the form package.module:name"),
    ("tests.no_such_module:tiny", "does not import"),
    ("tests.tiny_cases:missing", "has no case 'missing'"),
    ("tests.tiny_cases:tinny", "did you mean tiny"),
    ("tests.tiny_casez:tiny", "did you mean tests.tiny_cases"),
    ("tests.tiny_cases:not_a_case", "not a layerdiff.Case"),
])
def test_bad_case_spec(run, tmp_path, spec, message):
    result = run("capture", spec, "-o", tmp_path / "t.h5")
    assert result.exit_code == 2
    assert message in result.output and "Traceback" not in result.output


def test_model_error_exits_2_with_the_site(run, tmp_path):
    result = run("capture", "tests.tiny_cases:exploding", "-o", tmp_path / "t.h5")
    assert result.exit_code == 2
    assert "bad#0" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "t.h5").exists()


def test_steps_zero_and_empty_include(run, tmp_path):
    assert run("capture", "tests.tiny_cases:tiny", "-o", tmp_path / "t.h5",
               "--steps", "0").exit_code == 2
    result = run("capture", "tests.tiny_cases:tiny", "-o", tmp_path / "t.h5",
                 "--include", "nothing.*")
    assert result.exit_code == 2 and "matches no module" in result.output


def test_show_refuses_a_broken_trace(run, tmp_path):
    bogus = tmp_path / "x.h5"
    bogus.write_text("not hdf5")
    result = run("show", bogus)
    assert result.exit_code == 2 and "not an HDF5 file" in result.output


def test_debug_shows_the_traceback(run, tmp_path):
    result = run("--debug", "show", tmp_path / "missing.h5")
    assert result.exit_code != 0 and result.exception is not None


def test_cases_lists_every_bundled_case_as_json(run):
    result = run("cases", "--json")
    assert result.exit_code == 0
    cases = json.loads(result.output)
    keys = {"spec", "model", "kind", "reference", "mapping", "site", "pass", "op_site",
            "description", "nproc"}
    assert cases and all(set(c) == keys for c in cases)
    specs = {c["spec"]: c for c in cases}
    assert "reference_models.transformer:reference" in specs
    assert specs["reference_models.tensor_parallel:port"]["nproc"] == 2
    for case in cases:
        if case["kind"] == "bug":
            assert case["site"] and case["pass"] in ("forward", "backward") and case["reference"]


def test_cases_text_names_each_bug_site_and_fits_100_columns(run):
    result = run("cases")
    assert result.exit_code == 0
    lines = result.output.splitlines()
    assert max(len(line) for line in lines) <= 100
    assert "  reference_models.cnn_port:bug_relu_backward_batch  [backward at block.act#0]" in lines
    assert {"references:", "ports:", "bugs:"} <= set(lines)


def test_demo_finds_the_planted_bug_and_writes_the_report(run, tmp_path):
    result = run("demo", "-o", tmp_path)
    assert result.exit_code == 0, result.output
    for name in ("reference.h5", "port.h5", "report.html"):
        assert (tmp_path / name).exists(), name
    verdict = next(line for line in result.output.splitlines() if line.startswith("FAIL"))
    assert "encoder.layers.0.self_attn#0, forward output" in verdict
    assert "in the port: enc.0.self_attn#0" in result.output
    table = [line for line in result.output.splitlines() if str(tmp_path) not in line]
    assert max(len(line) for line in table) <= 100
    # it ends with the next commands, aimed at the origin, and says what "unpaired" means
    assert "unpaired  means" in result.output
    lines = result.output.splitlines()
    replay = next(i for i, line in enumerate(lines) if line.startswith("layerdiff replay "))
    assert "transformer_port:bug_softmax_axis" in lines[replay]
    swap = " ".join(lines[next(i for i, line in enumerate(lines)
                               if line.startswith("layerdiff swap ")):])
    assert "--site encoder.layers.0.self_attn " in swap
