"""Verdicts, outcomes, directions and tolerance kinds are enums whose values are the strings
they were: a notebook's ``diff.verdict == "pass"``, the JSON reports and the terminal's
tables read the same as before, and a wrong swap direction is refused in one sentence."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from layerdiff import DiffError
from layerdiff.compare import Diff, DiffVerdict, ToleranceKind, Tolerances
from layerdiff.compare.judge import Status
from layerdiff.compare.result import UNMATCHED_COLUMNS
from layerdiff.replay import LocalVerdict, SwapDirection, swap
from layerdiff.replay.replay import _local_table
from reference_models import mlp, mlp_port


def _diff(verdicts: list[str]) -> Diff:
    rows = pd.DataFrame({"verdict": verdicts})
    return Diff(Path("ref.h5"), Path("port.h5"), rows, [],
                pd.DataFrame(columns=UNMATCHED_COLUMNS), None)


def test_a_diffs_verdict_is_an_enum_that_reads_as_before() -> None:
    passing, failing = _diff(["within"]), _diff(["within", "out"])
    assert passing.verdict is DiffVerdict.PASS and failing.verdict is DiffVerdict.FAIL
    assert passing.verdict == "pass" and f"{failing.verdict}" == "fail"
    assert json.loads(json.dumps(failing.as_json()))["verdict"] == "fail"


def test_a_tolerance_says_where_it_came_from(tmp_path: Path) -> None:
    rules = tmp_path / "tolerances.toml"
    rules.write_text('[[rule]]\nsite = "fc1*"\nrtol = 1e-2\n')
    assert Tolerances().lookup("fc1#0", "output", "0", "float32").kind is ToleranceKind.DEFAULT
    flags = Tolerances(rtol=1e-3).lookup("fc2#0", "output", "0", "float32")
    assert flags.kind is ToleranceKind.FLAGS and flags.kind == "flags"
    ruled = Tolerances.build(rules, rtol=1e-3).lookup("fc1#0", "output", "0", "float32")
    assert ruled.kind is ToleranceKind.RULE and ruled.rtol == 1e-2


def test_the_local_tables_verdicts_keep_their_words() -> None:
    """report/terminal.py and the JSON read these values."""
    assert [v.value for v in LocalVerdict] == ["LOCAL ERROR", "exonerated", "holds one",
                                               "within"]
    keys = {"step": 0, "role": "output", "arg": "0", "pass": "forward"}
    rows = pd.DataFrame([
        {**keys, "site": "a#0", "port_site": "a#0", "seq": 1, "ratio": 5.0, "status": "",
         "verdict": "out"},
        {**keys, "site": "b#0", "port_site": "b#0", "seq": 2, "ratio": 3.0,
         "status": Status.HOLDS_ORIGIN, "verdict": "out"},
        {**keys, "site": "c#0", "port_site": "c#0", "seq": 3, "ratio": 0.5, "status": "",
         "verdict": "within"},
        {**keys, "site": "d#0", "port_site": "d#0", "seq": 4, "ratio": 0.5, "status": "",
         "verdict": "within"}])
    plain = _diff(["within"])
    plain.rows = rows[["step", "site", "role", "arg"]].assign(
        ratio=[9.0, 9.0, 4.0, 0.5], verdict=["out", "out", "out", "within"])
    table = _local_table(rows, plain).set_index("site")["verdict"]
    assert table.to_dict() == {"a#0": "LOCAL ERROR", "b#0": "holds one", "c#0": "exonerated",
                               "d#0": "within"}
    assert table["a#0"] == LocalVerdict.LOCAL_ERROR and isinstance(table["a#0"], str)
    assert np.asarray(table).dtype.kind in "UO"


def test_a_swap_direction_is_parsed_at_the_boundary() -> None:
    assert SwapDirection.parse("port") is SwapDirection.PORT
    assert SwapDirection.parse(SwapDirection.REFERENCE) is SwapDirection.REFERENCE
    with pytest.raises(DiffError, match="'sideways' is not a swap direction; give "
                                        "'reference' or 'port'"):
        SwapDirection.parse("sideways")


def test_a_swap_records_its_direction_as_the_enum() -> None:
    result = swap(mlp.reference, mlp_port.port, ["fc1"], into="port")
    assert result.into is SwapDirection.PORT and not result.breaks
    with pytest.raises(DiffError, match="not a swap direction"):
        swap(mlp.reference, mlp_port.port, ["fc1"], into="sideways")


def test_the_named_role_sets_say_what_their_names_say() -> None:
    """Code asks ``role in GRAD_ROLES`` where it once spelled the tuple out: each set must hold
    exactly the roles of its pass, and the passes must cover every role once."""
    from layerdiff.trace import schema
    from layerdiff.trace.schema import Pass, Role

    assert sorted(schema.FORWARD_ROLES + schema.GRAD_ROLES) == sorted(Role)
    assert all(schema.ROLE_PASS[r] is Pass.FORWARD for r in schema.FORWARD_ROLES)
    assert all(schema.ROLE_PASS[r] is Pass.BACKWARD for r in schema.GRAD_ROLES)
    assert set(schema.CALL_ROLES) == set(schema.FORWARD_ROLES) - set(schema.PARAM_ROLES)
    assert set(schema.COMPUTED_GRAD_ROLES) == set(schema.COMPUTED_ROLES) & set(schema.GRAD_ROLES)
    assert all(isinstance(r, Role) for r in schema.COMPUTED_GRAD_ROLES + schema.CALL_ROLES)
