"""``layerdiff golden`` and ``check``: numerical parity as one CI step (a thin shell over
:mod:`layerdiff.ci`)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import click

from layerdiff.cli.capture import say_written
from layerdiff.cli.options import (
    force_option,
    json_option,
    map_option,
    no_verify_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
)
from layerdiff.outputs import refuse_existing, refuse_inputs
from layerdiff.report.emit import exit_code, say, write_outputs


def _finite_margin(value: float) -> float:
    """A margin the tolerance file can hold: nan or inf passed FloatRange and wrote a file of
    no tolerances, after the golden trace."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number; give a factor such as 10")
    return value


@click.command("golden")
@click.argument("case_spec", metavar="CASE")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="The golden trace to write.")
@click.option("--summary", is_flag=True,
              help="Statistics and digests only: small enough to commit.")
@click.option("--steps", type=int, default=None, help="Training steps (default: the case's).")
@click.option("--loss-scale", type=float, default=1.0, show_default=True,
              help="Multiply the loss before backward (recorded; checks use the same).")
@click.option("--calibrate", "runs", type=click.IntRange(min=2), default=None, metavar="K",
              help="Also run the case K times and once in float64, and write the measured "
                   "noise floor times --margin as a tolerance file beside the golden.")
@click.option("--margin", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, callback=lambda ctx, param, value: _finite_margin(value),
              help="Calibrated tolerance = margin x the noise seen at each site.")
@force_option
def golden_command(case_spec: str, output: str, summary: bool, steps: int | None,
                   loss_scale: float, runs: int | None, margin: float, force: bool) -> None:
    """Record the golden trace of CASE, to check against later with `layerdiff check`."""
    from layerdiff.ci import calibrate, golden

    refuse_existing(output, "-o", force)
    if runs is not None:
        refuse_existing(Path(output).with_suffix(".tolerances.toml"), "the tolerance file",
                        force)
    start = time.perf_counter()
    path = golden(case_spec, output, summary=summary, steps=steps, loss_scale=loss_scale)
    say_written(path, time.perf_counter() - start)
    if runs is not None:
        tolerances = path.with_suffix(".tolerances.toml")
        result = calibrate(case_spec, tolerances, runs=runs, margin=margin, steps=steps,
                           loss_scale=loss_scale)
        click.echo(f"calibrated over {runs} runs and float64: wrote {tolerances}"
                   + (f" (float64 run failed: {result.float64})" if result.float64 else ""))
        if result.nondeterministic:
            click.echo(f"not deterministic from run to run: {len(result.nondeterministic)} "
                       f"sites; nondeterminism enters at {result.first_nondeterministic}")
        else:
            click.echo("deterministic: every run recorded the same bits")
        click.echo(f"check with: layerdiff check {case_spec} {path} --tolerances {tolerances}")


@click.command("check")
@click.argument("case_spec", metavar="CASE")
@click.argument("golden_path", metavar="GOLDEN", type=click.Path(dir_okay=False))
@map_option
@tolerances_option
@tolerance_flags
@click.option("--junit", "junit_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write JUnit XML: one test case per site.")
@json_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write the HTML report.")
@no_verify_option
def check_command(case_spec: str, golden_path: str, mapping: str | None,
                  tolerances: str | None, rtol: float | None, atol: float | None,
                  junit_path: str | None, json_path: str | None, html_path: str | None,
                  no_verify: bool) -> None:
    """Capture CASE and diff it against GOLDEN: identical, drift within tolerance, or fail.

    Exit 0 identical or within tolerance, 1 out of tolerance, 2 bad input.
    """
    from layerdiff.ci import check
    from layerdiff.report.findings import render
    from layerdiff.report.terminal import format_diff

    refuse_inputs({"--junit": junit_path, "--json": json_path, "--html": html_path},
                  {"golden trace": golden_path, "mapping file": mapping,
                   "tolerance file": tolerances})
    result = check(case_spec, golden_path, mapping=mapping,
                   tolerances=tolerances_from(tolerances, rtol, atol), verify=not no_verify)
    write_outputs(result.diff, junit_path=junit_path, junit_suite=f"layerdiff check {case_spec}",
                  json_path=json_path, html_path=html_path)
    say(lambda: render(result) + ("" if result.passed else "\n\n" + format_diff(result.diff)),
        json_path)
    sys.exit(exit_code(result))


COMMANDS = (golden_command, check_command)
