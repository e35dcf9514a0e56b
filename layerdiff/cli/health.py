"""``layerdiff health CASE``: the trainability checklist on one case (a thin shell over
:func:`layerdiff.health`). Exit 0 when no check fails, 1 when one does, 2 for bad input."""

from __future__ import annotations

import click

from layerdiff.cli.options import json_option
from layerdiff.outputs import refuse_inputs
from layerdiff.report.emit import STDOUT, finish


@click.command("health")
@click.argument("case_spec", metavar="CASE")
@click.option("--steps", type=click.IntRange(min=1), default=30, show_default=True,
              help="Optimizer steps on the case's batch (overfit, and the norms over them).")
@click.option("--checks", "checks", metavar="A,B", default=None,
              help="The checks to run, comma-separated (default all: initial-loss, overfit, "
                   "gradient-flow, update-ratio, dead-units, nonfinite, batch-independence, "
                   "determinism).")
@click.option("--expected-loss", type=float, default=None,
              help="The initial loss chance predicts, when it is not ln C of the logits' last "
                   "axis.")
@click.option("--allow-frozen", multiple=True, metavar="GLOB",
              help="Parameters frozen on purpose (repeatable): not a failure of overfit.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write an HTML report: the verdicts, the loss curve and per-layer plots.")
@json_option
def health_command(case_spec: str, steps: int, checks: str | None, expected_loss: float | None,
                   allow_frozen: tuple[str, ...], html_path: str | None,
                   json_path: str | None) -> None:
    """Check that CASE is trainable: initial loss, overfitting one batch, gradient flow,
    update ratios, dead units, NaN/Inf, batch independence and determinism.

    Each check says pass, warn, fail or skip, with the site and step it applies to and its
    evidence in numbers (thresholds: docs/health.md). Exit 0 when no check fails, 1 when one
    does, 2 for bad input.
    """
    from layerdiff.health import health
    from layerdiff.progress import CountProgress

    refuse_inputs({"--json": json_path, "--html": html_path}, {})
    chosen = None if checks is None else [c.strip() for c in checks.split(",") if c.strip()]
    with CountProgress("health", "runs", enabled=json_path != STDOUT) as bar:
        result = health(case_spec, steps, checks=chosen, expected_loss=expected_loss,
                        allow_frozen=allow_frozen, progress=bar.progress)
    if html_path:
        from layerdiff.report.health_html import write_health_html

        write_health_html(result, html_path)
    finish(result, json_path=json_path)


COMMANDS = (health_command,)
