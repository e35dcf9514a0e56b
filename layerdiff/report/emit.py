"""The tail every command shares, in one place: write a result's outputs (JSON, CSV, HTML,
JUnit), print its text unless the JSON took stdout, and choose the exit code.

Exit codes: 0 when the result says nothing is wrong, 1 when it found something or is out of
tolerance (2, bad input, comes from the errors, not from here). A diagnostic (first NaN,
determinism, batch independence, diverge, ranks, the trace browser) says ``found``; every
other result's truth value is its verdict.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

from layerdiff.outputs import write_text
from layerdiff.report.findings import render

STDOUT = "-"  # the --json path that means stdout


def echo_or_write(text: str, path: str) -> None:
    """``text`` on stdout for ``-``, else into the file (through a temporary name)."""
    if path == STDOUT:
        click.echo(text)
    else:
        write_text(path, text + "\n")


def write_outputs(result: Any, *, json_path: str | None = None, csv_path: str | None = None,
                  html_path: str | None = None, junit_path: str | None = None,
                  junit_suite: str = "layerdiff") -> Path | None:
    """Write what was asked for, in this order: JUnit XML, JSON (``-``: stdout), the rows as
    CSV, the HTML report; returns the HTML file's path (None without one). CSV and JUnit are a
    diff's (its rows); HTML is a diff's report, a replay's (of its diff), a diverge's page or
    a trace browser's page (rendered already)."""
    if junit_path:
        from layerdiff.report.junit import write_junit

        write_junit(result, junit_path, suite=junit_suite)
    if json_path:
        echo_or_write(json.dumps(result.as_json(), indent=1), json_path)
    if csv_path:
        from layerdiff.compare import save_rows_csv

        save_rows_csv(result, csv_path)
    return _write_html(result, html_path) if html_path else None


def _write_html(result: Any, path: str) -> Path:
    from layerdiff.compare.result import Diff
    from layerdiff.report.html import write_html

    if isinstance(result, Diff):
        return write_html(result, path)
    if hasattr(result, "write"):  # a page rendered when it was made (the trace browser's)
        return result.write(path)
    # only a result that ran a model is left: torch, which diverge's module needs, is loaded
    from layerdiff.debug.diverge import DivergeResult

    if isinstance(result, DivergeResult):
        from layerdiff.report.diverge_html import write_diverge_html

        return write_diverge_html(result, path)
    return write_html(result.diff, path)  # a replay's report is its diff's


def say(text: Callable[[], str], json_path: str | None) -> None:
    """Print the result's text, unless its JSON went to stdout (text would spoil it)."""
    if json_path != STDOUT:
        click.echo(text())


def exit_code(result: Any, *, strict: bool = False) -> int:
    """0 when nothing is wrong, 1 otherwise. ``strict`` (a diff's): a site with no partner
    that no mapping declares is wrong too."""
    found = getattr(result, "found", None)
    if found is not None:
        return 1 if found else 0
    if strict and len(result.undeclared_sites()):
        return 1
    return 0 if result else 1


def strict_line(diff: Any) -> str | None:
    """What ``--strict`` fails on, for stderr: the sites that have no partner and that no
    mapping declares (None when there are none)."""
    missing = diff.undeclared_sites()
    if not len(missing):
        return None
    names = ", ".join(f"{r.side} {r.site}" for r in missing.head(6).itertuples())
    return (f"strict: {len(missing)} site(s) have no partner and no mapping declares so "
            f"({names}); map them or declare them [[unmatched]] with why")


def finish(result: Any, text: Callable[[], str] | None = None, *, json_path: str | None = None,
           csv_path: str | None = None, html_path: str | None = None) -> NoReturn:
    """Write the outputs, print the text (the result's, :func:`~layerdiff.report.findings.render`,
    unless given), exit with the result's code."""
    write_outputs(result, json_path=json_path, csv_path=csv_path, html_path=html_path)
    say(text or (lambda: render(result)), json_path)
    sys.exit(exit_code(result))
