"""The commands a diff prints for the next step carry every option they need, and run as
printed (the issue: a printed diff without the --map its mapping needs was refused). The ops,
--full-around and diverge commands through call adapters are run in
tests/test_diverge_adapters.py; here `diff_options` and the precision hint."""

from __future__ import annotations

import shlex

import pytest

from layerdiff import diff, load_weights
from layerdiff.capture import capture
from layerdiff.case import load_case
from layerdiff.compare.suggest import diff_options
from layerdiff.compare.tolerances import Tolerances
from layerdiff.mapping import Mapping

pytestmark = pytest.mark.usefixtures("one_thread")


def test_diff_options_name_the_users_files_and_flags(tmp_path):
    rules = tmp_path / "t.toml"
    rules.write_text('version = 1\n[[rule]]\nsite = "fc1#0"\natol = 1e-4\n')
    mapping = tmp_path / "m.toml"
    mapping.write_text("version = 1\n")
    assert diff_options(None, None) == []
    assert diff_options(str(mapping), str(rules)) == ["--map", str(mapping),
                                                      "--tolerances", str(rules)]
    given = Tolerances.build(rules, rtol=1e-3)
    assert diff_options(Mapping.load(mapping), given) == [
        "--map", str(mapping), "--tolerances", str(rules), "--rtol", "0.001"]
    recorded = Mapping.from_text("version = 1\n", "m.toml")
    recorded.origin = "recorded in port.h5 at capture"
    assert diff_options(recorded, Tolerances()) == []  # the diff reads it from the trace again


def test_the_precision_hint_captures_the_same_records_and_diffs_with_the_same_rules(run,
                                                                                     tmp_path):
    spec = "reference_models.mlp:reference"
    reference = capture(load_case(spec), tmp_path / "ref.h5", include=["fc*", "head"])
    case = load_case("reference_models.mlp_port:port")
    load_weights(case.model, reference)
    port = capture(case, tmp_path / "port16.h5", dtype="float16", include=["fc*", "head"])
    rules = tmp_path / "t.toml"
    rules.write_text('version = 1\n[[rule]]\nsite = "head#0"\nrole = "output"\natol = 1e-2\n')
    hint = diff(reference, port, tolerances=rules).meta["precision"]
    capture_words, diff_words = shlex.split(hint["capture"]), shlex.split(hint["diff"])
    assert capture_words.count("--include") == 2  # else the baseline shares too few records
    assert diff_words[diff_words.index("--tolerances") + 1] == str(rules)
    made = run(*capture_words[1:])
    assert made.exit_code == 0, made.output
    judged = run(*diff_words[1:])
    assert judged.exit_code in (0, 1), judged.output  # judged, not refused
