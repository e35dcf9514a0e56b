"""The pytest plugin (entry point ``pytest11``): a ``layerdiff_check`` fixture.

    def test_port_matches_golden(layerdiff_check):
        layerdiff_check("my_cases:port", "goldens/port.h5")

fails the test with the verdict and the origin when the case is out of tolerance against its
golden trace; ``pytest --layerdiff-update-golden`` records the goldens again, on purpose.
Importing this module imports neither torch nor the diff: pytest loads it in every session.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("layerdiff")
    group.addoption("--layerdiff-update-golden", action="store_true", default=False,
                    help="record the golden traces used by layerdiff_check again, instead of "
                         "checking against them")


@pytest.fixture
def layerdiff_check(request: pytest.FixtureRequest):
    """``layerdiff_check(case, golden, mapping=None, tolerances=None, summary=False)``:
    check ``case`` (a spec, a Case or a function returning one) against ``golden``."""
    from layerdiff.ci.check import update_or_check
    from layerdiff.errors import LayerdiffError

    update = request.config.getoption("--layerdiff-update-golden")

    def run(case: Any, golden: str | Path, *, summary: bool = False, **options: Any):
        try:
            result = update_or_check(case, golden, update=update, summary=summary, **options)
        except LayerdiffError as exc:
            refusal = str(exc)
        else:
            refusal = ""
        if refusal:
            pytest.fail(refusal, pytrace=False)
        if result is not None and not result.passed:
            from layerdiff.report.findings.diff import check_line

            pytest.fail(check_line(result) + "\n" + (result.diff.origin.reason
                                                if result.diff.origin else ""), pytrace=False)
        return result

    return run
