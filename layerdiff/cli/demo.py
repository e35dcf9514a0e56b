"""``layerdiff demo`` and ``cases``: the bundled models, listed, and one of their planted bugs
found end to end (the workflow is :func:`layerdiff.demo.run_demo`)."""

from __future__ import annotations

import json
import textwrap
import time
from pathlib import Path

import click

from layerdiff import bundled
from layerdiff.demo import DEFAULT_DEMO_PORT
from layerdiff.report.emit import write_outputs


@click.command("cases")
@click.option("--json", "as_json", is_flag=True, help="A JSON list, for scripts.")
def cases_command(as_json: bool) -> None:
    """List the bundled cases: references, their ports, and ports with planted bugs."""
    catalog = bundled.import_module("reference_models.catalog")
    every = catalog.CATALOG + catalog.MULTI_RANK + catalog.FLAX
    if as_json:
        entries = every
        click.echo(json.dumps([info.as_json() for info in entries], indent=1))
        return
    for kind in ("reference", "port", "bug", "diagnostic"):
        entries = [info for info in every if info.kind == kind]
        if not entries:
            continue
        click.echo(f"{kind}s:")
        for info in entries:
            where = f"  [{info.pass_} at {info.site}]" if info.site else ""
            click.echo(f"  {info.spec}{where}")
            against = f" (against {info.reference})" if info.reference else ""
            if info.nproc > 1:
                against += (f"; capture with --nproc {info.nproc}, diff with --map "
                            f"{info.mapping_path}")
            click.echo(textwrap.fill(info.description + against, width=100,
                                     initial_indent=" " * 6, subsequent_indent=" " * 6))


@click.command("demo")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), default="layerdiff-demo",
              show_default=True, help="Where to write the traces and the report.")
@click.option("--port", "port_spec", default=DEFAULT_DEMO_PORT, show_default=True,
              help="The bundled port to check against its reference (see layerdiff cases).")
def demo_command(output_dir: str, port_spec: str) -> None:
    """Capture the bundled transformer and a port with a planted bug, diff them, report."""
    from layerdiff.demo import run_demo
    from layerdiff.report.terminal import format_diff

    start = time.perf_counter()
    demo = run_demo(port_spec, output_dir)
    info, result = demo.info, demo.diff
    report = write_outputs(result, html_path=str(demo.folder / "report.html"))
    click.echo(f"reference {info.reference}\n          -> {demo.reference}")
    click.echo(f"port      {port_spec}, with the reference's weights\n          -> {demo.port}")
    if info.site:
        click.echo(textwrap.fill(f"planted   {info.description}; in the {info.pass_} of "
                                 f"{info.site}", 100, subsequent_indent=" " * 10))
    click.echo()
    click.echo(format_diff(result))
    click.echo()
    click.echo(f"report    {report} (open it in a browser)")
    click.echo(f"took      {time.perf_counter() - start:.1f} s in all")
    if len(result.unmatched):
        click.echo(textwrap.fill(
            "unpaired  means a site or record one model has and the other does not, or "
            "whose names no mapping pairs (a fused or split layer); it is not compared and "
            "does not fail the diff; --verbose lists each with why", 100,
            subsequent_indent=" " * 10))
    click.echo()
    for comment, command in _demo_next(info, port_spec, demo.reference, demo.port,
                                       result.origin):
        click.echo(f"# {comment}\n{command}")


def _demo_next(info, port_spec: str, reference: Path, port: Path, origin) -> list[tuple[str, str]]:
    """The commands a user runs after the demo, with what each answers."""
    mapping = f" \\\n    --map {info.mapping_path}" if info.mapping_path else ""
    steps = [("every row, and every unpaired site with why",
              f"layerdiff diff {reference} {port}{mapping} --verbose")]
    if origin is not None:
        layer = origin.site.split("#")[0]
        steps += [("each port layer on the reference's recorded inputs: its own error, not "
                   "what it inherits",
                   f"layerdiff replay {reference} {port_spec}{mapping}"),
                  (f"the port's {layer} alone inside the reference: does it break training?",
                   f"layerdiff swap {info.reference} \\\n    {port_spec} --site {layer}{mapping}")]
    return steps


COMMANDS = (demo_command, cases_command)
