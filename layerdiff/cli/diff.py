"""``layerdiff diff``, ``show`` and ``gather``: comparing two traces, looking at one, and joining
a multi-rank capture's rank files."""

from __future__ import annotations

import json
import sys

import click

from layerdiff.cli.options import (
    force_option,
    json_option,
    map_option,
    no_verify_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
    workers_option,
)
from layerdiff.outputs import refuse_existing, refuse_inputs
from layerdiff.report.emit import STDOUT, exit_code, say, strict_line, write_outputs


@click.command("show")
@click.argument("trace_path", metavar="TRACE", type=click.Path(dir_okay=False))
@click.option("--site", metavar="GLOB", help="Only sites matching this glob.")
@click.option("--role", type=click.Choice(["input", "output", "weight", "grad_output",
                                           "grad_input", "weight_grad"]))
@click.option("--step", type=int, help="Only this step.")
@click.option("--by-site", is_flag=True,
              help="One line per site (of --step, default the first step recorded).")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output on stdout.")
@click.option("--allow-incomplete", is_flag=True,
              help="Open a trace whose capture did not finish, to see what it holds.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a browser page instead: value and gradient ranges per site, norms, "
                   "histograms (for --site, or every site of a small trace), NaN/Inf.")
@click.option("--against", type=click.Path(dir_okay=False), metavar="PORT",
              help="With --html: a port trace to diff against TRACE; the page shows which "
                   "batch elements are wrong.")
@map_option
@tolerances_option
def show_command(trace_path: str, site: str | None, role: str | None, step: int | None,
                 by_site: bool, as_json: bool, allow_incomplete: bool, html_path: str | None,
                 against: str | None, mapping: str | None, tolerances: str | None) -> None:
    """List what TRACE recorded, in execution order (reads the index only).

    With --html, write a page to look at instead; its exit code is 1 when a NaN or Inf was
    recorded or the pair is out of tolerance, 0 otherwise.
    """
    from layerdiff import show
    from layerdiff.trace import open_trace

    if html_path:
        _show_html(trace_path, html_path, against=against, site=site, step=step,
                   mapping=mapping, tolerances=tolerances, allow_incomplete=allow_incomplete,
                   as_json=as_json)
    if against or mapping or tolerances:
        raise click.UsageError("--against, --map and --tolerances go with --html")
    with open_trace(trace_path, allow_incomplete=allow_incomplete) as trace:
        records = show.select_records(trace, site=site, role=role, step=step)
        trace.sites  # noqa: B018 - both tables read, so what a cut left out is said first
        for note in trace.notes:
            click.echo(f"warning: {note}", err=True)
        if as_json:
            click.echo(json.dumps(show.records_json(trace, records), indent=1))
            return
        click.echo("\n".join(show.header_lines(trace)))
        click.echo()
        if by_site:
            shown = show.first_step(trace) if step is None else step
            click.echo(show.format_sites(show.site_summary(trace, shown)))
        elif records.empty:
            click.echo("no records yet: the capture stopped before the end of its first step, "
                       "when the tables are first written" if trace.index.empty
                       and not trace.complete else
                       "no records match" + (f" --site {site!r}" if site else ""))
        else:
            click.echo(show.format_records(records))


def _show_html(trace_path: str, html_path: str, *, against: str | None, site: str | None,
               step: int | None, mapping: str | None, tolerances: str | None,
               allow_incomplete: bool, as_json: bool) -> None:
    from layerdiff.progress import ByteProgress
    from layerdiff.report.browser import browse

    refuse_inputs({"--html": html_path}, {"trace": trace_path, "--against trace": against,
                                          "mapping file": mapping, "tolerance file": tolerances})
    with ByteProgress("browse", enabled=not as_json) as bar:
        page = browse(trace_path, against=against, sites=[site] if site else [], step=step,
                      mapping=mapping, tolerances=tolerances, progress=bar.progress,
                      allow_incomplete=allow_incomplete)
    written = write_outputs(page, html_path=html_path)  # the page first, then what it found
    on_stdout = STDOUT if as_json else None
    write_outputs(page, json_path=on_stdout)
    say(lambda: f"{page.format()}\npage      {written} (open it in a browser)", on_stdout)
    sys.exit(exit_code(page))


@click.command("diff")
@click.argument("reference", type=click.Path(dir_okay=False))
@click.argument("port", type=click.Path(dir_okay=False))
@map_option
@tolerances_option
@tolerance_flags
@click.option("--baseline", type=click.Path(dir_okay=False), metavar="TRACE",
              help="The reference run the way the port runs (its dtype, autocast or device): "
                   "the port may have a few times the error this trace has against REFERENCE.")
@json_option
@click.option("--csv", "csv_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write every compared row as CSV.")
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a self-contained HTML report with plots.")
@click.option("-v", "--verbose", is_flag=True, help="Every row, and what has no partner.")
@click.option("--strict", is_flag=True,
              help="Also fail (exit 1) when a site has no partner and no mapping declares so.")
@click.option("--seq-axis", type=int, metavar="AXIS",
              help="The axis of positions in activation records, for the error by position "
                   "(found from the inputs' token ids when not given).")
@click.option("--padding-mask", metavar="ARG",
              help="The root's argument that is 0 at padding positions (found from the "
                   "inputs when not given): records that differ only at padding positions "
                   "the reference's gradient shows unused pass, and are listed apart.")
@click.option("--no-padding-mask", is_flag=True,
              help="Judge padding positions like any other (no mask is looked for).")
@no_verify_option
@workers_option
def diff_command(reference: str, port: str, mapping: str | None, tolerances: str | None,
                 rtol: float | None, atol: float | None, baseline: str | None,
                 json_path: str | None, csv_path: str | None, html_path: str | None,
                 verbose: bool, strict: bool, seq_axis: int | None,
                 padding_mask: str | None, no_padding_mask: bool, no_verify: bool,
                 workers: int | None) -> None:
    """Compare PORT's trace with REFERENCE's; exit 0 within tolerance, 1 out, 2 bad input."""
    from layerdiff.compare import diff
    from layerdiff.progress import ByteProgress
    from layerdiff.report.terminal import format_diff

    if padding_mask and no_padding_mask:
        raise click.UsageError("--padding-mask names the mask, --no-padding-mask says there is "
                               "none: give one of them")
    refuse_inputs({"--json": json_path, "--csv": csv_path, "--html": html_path},
                  {"reference trace": reference, "port trace": port, "mapping file": mapping,
                   "tolerance file": tolerances, "baseline trace": baseline})
    with ByteProgress("diff") as bar:
        result = diff(reference, port, mapping=mapping,
                      tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline,
                      progress=bar.progress, verify=not no_verify, workers=workers,
                      seq_axis=seq_axis,
                      padding_mask=False if no_padding_mask else padding_mask)
    write_outputs(result, json_path=json_path, csv_path=csv_path, html_path=html_path)
    say(lambda: format_diff(result, verbose=verbose), json_path)
    missing = strict_line(result) if strict else None
    if missing:
        click.echo(missing, err=True)
    sys.exit(exit_code(result, strict=strict))


@click.command("gather")
@click.argument("manifest", type=click.Path(dir_okay=False))
@map_option
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the gathered one-process trace.")
@workers_option
@force_option
def gather_command(manifest: str, mapping: str | None, output: str,
                   workers: int | None, force: bool) -> None:
    """Join a multi-rank capture's rank files into one trace by the mapping's [[shard]] rules,
    as if one process had run the whole model (the diff does this by itself).

    Without --map, the mapping the capture recorded (--weights-from --map). A record that
    differs across ranks while no rule cuts it is refused, naming the rule to write."""
    from layerdiff.mapping import Mapping
    from layerdiff.progress import CountProgress
    from layerdiff.trace.gather import gather

    refuse_inputs({"-o": output}, {"manifest": manifest, "mapping file": mapping},
                  gathers=False)
    refuse_existing(output, "-o", force)
    rules = Mapping.load(mapping) if mapping else None  # None: the one the capture recorded
    with CountProgress("gather", "records") as bar:
        done = gather(manifest, rules, output, progress=bar.progress, workers=workers)
    for warning in done.unused_rules:
        click.echo(f"warning: {warning}", err=True)
    for note in done.notes:
        click.echo(f"note: {note}", err=True)
    joined = ", ".join(f"{count:,} by {what}" for what, count in done.by.items()) or "none"
    click.echo(f"wrote {done.path}: {done.records:,} records of {done.world_size} ranks, "
               f"{done.sharded:,} joined ({joined})")


COMMANDS = (diff_command, show_command, gather_command)
