"""The ``layerdiff`` command: one click group, each command a thin shell over the Python API."""

from __future__ import annotations

import json
import os
import sys
import textwrap
import time
from pathlib import Path

import click

from layerdiff.errors import LayerdiffError

DEFAULT_DEMO_CASE = "reference_models.transformer:reference"


class _Group(click.Group):
    """Turns a LayerdiffError into one sentence on stderr and exit code 2 (unless --debug)."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except LayerdiffError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {exc}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_Group)
@click.option("--debug", is_flag=True, help="Show tracebacks for errors.")
@click.version_option(package_name="layerdiff")
@click.pass_context
def main(ctx: click.Context, debug: bool) -> None:
    """Find the first layer where a port computes something different from its reference."""
    ctx.obj = {"debug": debug}


@main.command("capture")
@click.argument("case_spec", metavar="CASE")
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Trace file to write (HDF5).")
@click.option("--include", multiple=True, metavar="GLOB",
              help="Record only modules whose path matches (repeatable; '<root>' is the model).")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Do not record modules whose path matches (repeatable).")
@click.option("--loss-scale", type=float, default=1.0, show_default=True,
              help="Multiply the loss before backward so tiny gradients rise above rounding "
                   "noise; training is unaffected. Powers of two (2**20) unscale exactly.")
@click.option("--steps", type=int, default=None, help="Training steps (default: the case's).")
@click.option("--summary", is_flag=True, help="Record statistics only, no tensor data.")
@click.option("--no-weights", is_flag=True, help="Do not record weights and weight gradients.")
@click.option("--queue-mib", type=int, default=256, show_default=True,
              help="Memory cap for tensors waiting to be written.")
def capture_command(case_spec: str, output: str, include: tuple[str, ...],
                    exclude: tuple[str, ...], loss_scale: float, steps: int | None,
                    summary: bool, no_weights: bool, queue_mib: int) -> None:
    """Capture a trace of CASE (package.module:name) into OUTPUT."""
    from layerdiff.capture import capture
    from layerdiff.case import load_case

    case = load_case(case_spec)
    start = time.perf_counter()
    path = capture(case, output, include=include, exclude=exclude, loss_scale=loss_scale,
                   steps=steps, summary=summary, weights=not no_weights,
                   queue_bytes=queue_mib * 2**20, progress=True)
    _print_capture_result(path, time.perf_counter() - start)


@main.command("show")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--site", metavar="GLOB", help="Only sites matching this glob.")
@click.option("--role", type=click.Choice(["input", "output", "weight", "grad_output",
                                           "grad_input", "weight_grad"]))
@click.option("--step", type=int, help="Only this step.")
@click.option("--by-site", is_flag=True, help="One line per site (of --step, default 0).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@click.option("--allow-incomplete", is_flag=True,
              help="Open a trace whose capture did not finish, to see what it holds.")
def show_command(trace_path: str, site: str | None, role: str | None, step: int | None,
                 by_site: bool, as_json: bool, allow_incomplete: bool) -> None:
    """List what TRACE recorded, in execution order (reads the index only)."""
    from layerdiff import show
    from layerdiff.trace import open_trace

    with open_trace(trace_path, allow_incomplete=allow_incomplete) as trace:
        records = show.select_records(trace, site=site, role=role, step=step)
        if as_json:
            click.echo(json.dumps(show.records_json(trace, records), indent=1))
            return
        click.echo("\n".join(show.header_lines(trace)))
        click.echo()
        if by_site:
            click.echo(show.format_sites(show.site_summary(trace, step or 0)))
        elif records.empty:
            click.echo("no records match" + (f" --site {site!r}" if site else ""))
        else:
            click.echo(show.format_records(records))


@main.command("cases")
@click.option("--json", "as_json", is_flag=True, help="A JSON list, for scripts.")
def cases_command(as_json: bool) -> None:
    """List the bundled cases: references, their ports, and ports with planted bugs."""
    from reference_models.catalog import CATALOG

    if as_json:
        click.echo(json.dumps([info.as_json() for info in CATALOG], indent=1))
        return
    for kind in ("reference", "port", "bug"):
        entries = [info for info in CATALOG if info.kind == kind]
        if not entries:
            continue
        click.echo(f"{kind}s:")
        for info in entries:
            where = f"  [{info.pass_} at {info.site}]" if info.site else ""
            click.echo(f"  {info.spec}{where}")
            against = f" (against {info.reference})" if info.reference else ""
            click.echo(textwrap.fill(info.description + against, width=100,
                                     initial_indent=" " * 6, subsequent_indent=" " * 6))


@main.command("demo")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), default="layerdiff-demo",
              show_default=True, help="Where to write the demo's traces.")
@click.option("--case", "case_spec", default=DEFAULT_DEMO_CASE, show_default=True,
              help="The reference case to capture.")
def demo_command(output_dir: str, case_spec: str) -> None:
    """Capture the bundled transformer reference and show what was recorded."""
    from layerdiff import show
    from layerdiff.capture import capture
    from layerdiff.case import load_case
    from layerdiff.trace import open_trace

    Path(output_dir).mkdir(parents=True, exist_ok=True)
    case = load_case(case_spec)
    start = time.perf_counter()
    path = capture(case, Path(output_dir) / "reference.h5", progress=True)
    elapsed = time.perf_counter() - start
    with open_trace(path) as trace:
        click.echo("\n".join(show.header_lines(trace)))
        click.echo()
        click.echo(show.format_sites(show.site_summary(trace)))
    click.echo()
    _print_capture_result(path, elapsed)
    click.echo(f"next: layerdiff show {path} --site 'decoder.layers.0*'")


def _print_capture_result(path: Path, seconds: float) -> None:
    size = os.path.getsize(path)
    click.echo(f"wrote {path} ({size / 2**20:,.1f} MiB) in {seconds:.2f} s")


if __name__ == "__main__":
    sys.exit(main())
