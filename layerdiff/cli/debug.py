"""The debugging commands: where a NaN came from, whether runs repeat, whether samples mix,
and at which training step a port drifts. Each is a thin shell over ``layerdiff.debug``.

Every command prints its result (or writes it as JSON with ``--json``) and exits 0 when it
found nothing, 1 when it found something, 2 for bad input.
"""

from __future__ import annotations

import click

from layerdiff.cli.options import (
    force_option,
    json_option,
    map_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
)
from layerdiff.outputs import refuse_existing, refuse_inputs
from layerdiff.report.emit import STDOUT, finish, write_outputs


@click.command("nan")
@click.argument("case_spec", metavar="CASE")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps to run at most (default: the case's).")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None,
              help="Also write a full trace of the step where the first NaN or Inf appears.")
@force_option
@json_option
def nan_command(case_spec: str, steps: int | None, output: str | None, force: bool,
                json_path: str | None) -> None:
    """Run CASE until the first NaN or Inf and name where it first appeared.

    Checks every forward value, gradient and weight (after each optimizer step) on the fly,
    without writing a trace. Exit 0 when every step stayed finite, 1 when a NaN or Inf
    appeared, 2 for bad input.
    """
    from layerdiff.debug.nan import find_nan
    from layerdiff.progress import CountProgress

    if output:
        refuse_inputs({"--json": json_path}, {"-o trace": output})
        refuse_existing(output, "-o", force)
    with CountProgress("nan", "steps", enabled=json_path != STDOUT) as bar:
        result = find_nan(case_spec, steps, output=output, progress=bar.progress)
    finish(result, json_path=json_path)


@click.command("determinism")
@click.argument("case_spec", metavar="CASE")
@click.option("--runs", type=click.IntRange(min=2), default=2, show_default=True,
              help="How many runs, each in a fresh process.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Training steps per run (default: the case's).")
@tolerances_option
@tolerance_flags
@click.option("--keep", type=click.Path(file_okay=False), default=None, metavar="DIR",
              help="Keep each run's trace in DIR (run1.h5, run2.h5, ...; refused where one "
                   "exists, unless --force).")
@force_option
@click.option("--parallel", is_flag=True,
              help="Start the runs at once instead of one after another (needs the cores).")
@json_option
def determinism_command(case_spec: str, runs: int, steps: int | None, tolerances: str | None,
                        rtol: float | None, atol: float | None, keep: str | None, force: bool,
                        parallel: bool, json_path: str | None) -> None:
    """Capture CASE --runs times, each in a fresh process, and compare the traces bit for bit.

    Exit 0 when every run recorded the same bits, 1 when a record differs (the first is named,
    with whether the difference stays within tolerance), 2 for bad input.
    """
    from layerdiff.debug.determinism import check_determinism, kept_paths
    from layerdiff.progress import CountProgress

    kept = kept_paths(keep, runs) if keep else []
    refuse_inputs({"--json": json_path}, {"tolerance file": tolerances, **{
        f"trace of run {number} kept in --keep": path for number, path in enumerate(kept, 1)}})
    with CountProgress("determinism", "runs", enabled=json_path != STDOUT) as bar:
        result = check_determinism(case_spec, runs=runs, steps=steps,
                                   tolerances=tolerances_from(tolerances, rtol, atol),
                                   progress=bar.progress, keep=keep, force=force,
                                   parallel=parallel)
    finish(result, json_path=json_path)


@click.command("batch-independence")
@click.argument("case_spec", metavar="CASE")
@click.option("--allow", multiple=True, metavar="GLOB",
              help="Sites or modules that mix samples by design (repeatable); BatchNorm in "
                   "training mode is allowed already.")
@click.option("--batch-axis", type=int, default=0, show_default=True,
              help="The batch axis of the case's inputs.")
@json_option
def batch_command(case_spec: str, allow: tuple[str, ...], batch_axis: int,
                  json_path: str | None) -> None:
    """Check, site by site, that no sample's outputs or gradients depend on another sample.

    Exit 0 when no site mixes samples (other than those allowed), 1 when one does (the first
    whose inputs had not mixed yet is named), 2 for bad input.
    """
    from layerdiff.debug.batch import batch_independence
    from layerdiff.progress import CountProgress

    with CountProgress("batch independence", "sites", enabled=json_path != STDOUT) as bar:
        result = batch_independence(case_spec, allow, batch_axis=batch_axis,
                                    progress=bar.progress)
    finish(result, json_path=json_path)


@click.command("diverge")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
@click.option("--steps", type=click.IntRange(min=1), required=True,
              help="Optimizer steps to run both for.")
@tolerances_option
@tolerance_flags
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), default=None,
              help="Keep the traces here (the per-step summaries and the first diverging "
                   "step in full); default: a new temporary folder, kept.")
@click.option("--no-golden", is_flag=True,
              help="Judge by the per-dtype tolerances alone, without the reference's float64 "
                   "run (half the cost; rounding that compounds over many steps may then be "
                   "reported as divergence).")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write an HTML report: both loss curves and the diverging step's diff.")
@json_option
def diverge_command(reference_spec: str, port_spec: str, mapping: str | None, steps: int,
                    tolerances: str | None, rtol: float | None, atol: float | None,
                    output_dir: str | None, no_golden: bool, html_path: str | None,
                    json_path: str | None) -> None:
    """Train REF_CASE and PORT_CASE from the same weights for --steps; find the first step
    where anything differs, capture that step in full and name its origin.

    Exit 0 when every step stays within tolerance, 1 when one does not, 2 for bad input.
    """
    from layerdiff.debug.diverge import diverge

    refuse_inputs({"--json": json_path, "--html": html_path},
                  {"mapping file": mapping, "tolerance file": tolerances})
    result = diverge(reference_spec, port_spec, mapping=mapping, steps=steps,
                     tolerances=tolerances_from(tolerances, rtol, atol), output_dir=output_dir,
                     golden=not no_golden, progress=json_path != STDOUT)
    write_outputs(result, html_path=html_path)  # the page first, then what it found
    finish(result, json_path=json_path)


COMMANDS = (nan_command, determinism_command, batch_command, diverge_command)
