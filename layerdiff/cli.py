"""The ``layerdiff`` command: one click group, each command a thin shell over the Python API."""

from __future__ import annotations

import json
import math
import os
import sys
import textwrap
import time
from pathlib import Path

import click

from layerdiff.cli_debug import COMMANDS as DEBUG_COMMANDS
from layerdiff.cli_mapsuggest import COMMANDS as MAPSUGGEST_COMMANDS
from layerdiff.cli_options import (
    case_factory,
    echo_or_write,
    force_option,
    json_option,
    map_option,
    no_verify_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
    workers_option,
)
from layerdiff.cli_ranks import COMMANDS as RANKS_COMMANDS
from layerdiff.errors import Interrupted, LayerdiffError
from layerdiff.outputs import make_folder, refuse_existing, refuse_inputs

DEFAULT_DEMO_PORT = "reference_models.transformer_port:bug_softmax_axis"


class _Group(click.Group):
    """Turns a LayerdiffError into one sentence on stderr and exit code 2 (unless --debug)."""

    def invoke(self, ctx: click.Context):
        from layerdiff.trace.signals import interrupts_kept

        try:
            with interrupts_kept():
                return super().invoke(ctx)
        except KeyboardInterrupt:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo("interrupted: nothing was published", err=True)
            ctx.exit(Interrupted.exit_code)
        except LayerdiffError as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            from layerdiff.trace.printable import visible

            message = visible(str(exc))  # one line, which may quote a name from a trace
            click.echo(f"{'' if isinstance(exc, Interrupted) else 'error: '}{message}", err=True)
            ctx.exit(exc.exit_code)


@click.group(cls=_Group, context_settings={"max_content_width": 100, "terminal_width": 100})
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
@click.option("--queue-mib", type=click.IntRange(min=1), default=256, show_default=True,
              help="Memory cap for tensors waiting to be written.")
@click.option("--weights-from", type=click.Path(dir_okay=False), metavar="TRACE",
              help="Load the model's weights from this reference trace first.")
@click.option("--map", "mapping", type=click.Path(dir_okay=False), metavar="FILE",
              help="Mapping file for --weights-from when names differ (recorded in the trace, "
                   "so that diff finds it).")
@click.option("--dtype", type=click.Choice(["float64", "float32", "bfloat16", "float16"]),
              help="Cast the model's floating parameters and buffers and the inputs first "
                   "(a baseline: the reference in the port's precision).")
@click.option("--autocast", type=click.Choice(["bfloat16", "float16"]),
              help="Run the forward and the loss under torch.autocast in this dtype.")
@click.option("--ops", multiple=True, metavar="GLOB",
              help="Also record each tensor op that the own code of modules matching GLOB "
                   "runs, as sites <module site>/<op>#<k> (repeatable; '*' for every module).")
@click.option("--ops-all", is_flag=True,
              help="With --ops, keep the views and metadata ops (view, transpose, indexing) "
                   "that are skipped by default.")
@click.option("--full-around", multiple=True, metavar="SITE",
              help="Keep tensor data only for this module (a site, path or glob; repeatable), "
                   "what is inside it and --radius siblings each side; statistics elsewhere. "
                   "The second phase after a --summary diff of a model too big to capture.")
@click.option("--radius", type=click.IntRange(min=0), default=1, show_default=True,
              help="With --full-around: how many sibling modules on each side keep data too.")
@click.option("--nproc", type=click.IntRange(min=1), default=None, metavar="N",
              help="Spawn N local processes on the gloo backend, one per rank; each writes "
                   "OUTPUT.rank<r>.h5 and OUTPUT becomes their manifest (under torchrun the "
                   "ranks are torchrun's).")
@force_option
def capture_command(case_spec: str, output: str, include: tuple[str, ...],
                    exclude: tuple[str, ...], loss_scale: float, steps: int | None,
                    summary: bool, no_weights: bool, queue_mib: int, weights_from: str | None,
                    mapping: str | None, dtype: str | None, autocast: str | None,
                    ops: tuple[str, ...], ops_all: bool, full_around: tuple[str, ...],
                    radius: int, nproc: int | None, force: bool) -> None:
    """Capture a trace of CASE (package.module:name) into OUTPUT.

    Under torchrun, or with --nproc N, each rank writes OUTPUT's name with .rank<r> and rank 0
    publishes OUTPUT last: a manifest naming them (see docs/distributed.md).
    """
    from layerdiff.capture.distributed import capture_ranks, launched_world
    from layerdiff.capture.port import capture_port
    from layerdiff.trace.manifest import rank_path

    refuse_inputs({"-o": output}, {"--weights-from trace": weights_from,
                                   "mapping file": mapping})
    if mapping and not weights_from:
        raise click.UsageError("--map is used with --weights-from when capturing")
    if ops_all and not ops:
        raise click.UsageError("--ops-all keeps more of the ops that --ops records; give --ops "
                               "GLOB too")
    options = dict(include=include, exclude=exclude, loss_scale=loss_scale, steps=steps,
                   summary=summary, weights=not no_weights, queue_bytes=queue_mib * 2**20,
                   weights_from=weights_from, mapping=mapping, dtype=dtype, autocast=autocast,
                   ops=ops, ops_all=ops_all, full_around=full_around, radius=radius,
                   on_weights=say_weights, on_written=say_written)
    launched = launched_world()
    if nproc is None and launched is None:
        refuse_existing(output, "-o", force)
        capture_port(case_spec, output, **options)
        return
    world = nproc or launched[1]
    refuse_inputs({f"-o's rank {r} file": rank_path(output, r) for r in range(world)},
                  {"--weights-from trace": weights_from, "mapping file": mapping})
    if launched is None or launched[0] == 0:
        for path in [output, *(rank_path(output, r) for r in range(world))]:
            refuse_existing(str(path), "-o", force)
    start = time.perf_counter()
    published = capture_ranks(case_spec, output, nproc=nproc, **options)
    if published is not None:
        click.echo(f"wrote manifest {published} naming {world} rank files in "
                   f"{time.perf_counter() - start:.2f} s")


def say_weights(trace: str | os.PathLike, report) -> None:
    """What loading the reference's weights did (every rank says it)."""
    click.echo(f"weights from {trace}: {report.summary()}")


def say_written(path: Path, seconds: float) -> None:
    size = os.path.getsize(path)
    click.echo(f"wrote {path} ({size / 2**20:,.1f} MiB) in {seconds:.2f} s")


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
            click.echo(show.format_sites(show.site_summary(trace, step or 0)))
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
    written = page.write(html_path)
    click.echo(json.dumps(page.as_json(), indent=1) if as_json
               else f"{page.format()}\npage      {written} (open it in a browser)")
    sys.exit(1 if page.found else 0)


@main.command("diff")
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
@no_verify_option
@workers_option
def diff_command(reference: str, port: str, mapping: str | None, tolerances: str | None,
                 rtol: float | None, atol: float | None, baseline: str | None,
                 json_path: str | None, csv_path: str | None, html_path: str | None,
                 verbose: bool, strict: bool, no_verify: bool, workers: int | None) -> None:
    """Compare PORT's trace with REFERENCE's; exit 0 within tolerance, 1 out, 2 bad input."""
    from layerdiff.compare import diff
    from layerdiff.progress import ByteProgress
    from layerdiff.report.terminal import format_diff

    refuse_inputs({"--json": json_path, "--csv": csv_path, "--html": html_path},
                  {"reference trace": reference, "port trace": port, "mapping file": mapping,
                   "tolerance file": tolerances, "baseline trace": baseline})
    with ByteProgress("diff") as bar:
        result = diff(reference, port, mapping=mapping,
                      tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline,
                      progress=bar.progress, verify=not no_verify, workers=workers)
    _write_reports(result, json_path, csv_path, html_path)
    if json_path != "-":
        click.echo(format_diff(result, verbose=verbose))
    missing = result.undeclared_sites() if strict else result.undeclared_sites().iloc[:0]
    if len(missing):
        names = ", ".join(f"{r.side} {r.site}" for r in missing.head(6).itertuples())
        click.echo(f"strict: {len(missing)} site(s) have no partner and no mapping declares "
                   f"so ({names}); map them or declare them [[unmatched]] with why", err=True)
    sys.exit(0 if result.passed and not len(missing) else 1)


def _write_reports(result, json_path: str | None, csv_path: str | None,
                   html_path: str | None) -> None:
    from layerdiff.compare import save_rows_csv

    if json_path:
        text = json.dumps(result.as_json(), indent=1)
        echo_or_write(text, json_path)
    if csv_path:
        save_rows_csv(result, csv_path)
    if html_path:
        from layerdiff.report.html import write_html

        write_html(result, html_path)


@main.command("gather")
@click.argument("manifest", type=click.Path(dir_okay=False))
@map_option
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False),
              help="Where to write the gathered one-process trace.")
@workers_option
@force_option
def gather_command(manifest: str, mapping: str | None, output: str,
                   workers: int | None, force: bool) -> None:
    """Join a multi-rank capture's rank files into one trace by the mapping's [[shard]] rules,
    as if one process had run the whole model (the diff does this by itself)."""
    from layerdiff.mapping import Mapping
    from layerdiff.progress import CountProgress
    from layerdiff.trace.gather import gather

    refuse_inputs({"-o": output}, {"manifest": manifest, "mapping file": mapping},
                  gathers=False)
    refuse_existing(output, "-o", force)
    rules = Mapping.load(mapping) if mapping else Mapping()
    with CountProgress("gather", "records") as bar:
        done = gather(manifest, rules, output, progress=bar.progress, workers=workers)
    for warning in done.unused_rules:
        click.echo(f"warning: {warning}", err=True)
    click.echo(f"wrote {done.path}: {done.records:,} records of {done.world_size} ranks, "
               f"{done.sharded:,} joined by shard rules")


@main.command("replay")
@click.argument("reference", type=click.Path(dir_okay=False))
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
@click.option("--site", "sites", multiple=True, metavar="GLOB",
              help="Replay only these reference sites or modules (repeatable).")
@tolerances_option
@tolerance_flags
@json_option
@click.option("--html", "html_path", type=click.Path(dir_okay=False), metavar="FILE",
              help="Write a self-contained HTML report.")
@click.option("-v", "--verbose", is_flag=True, help="Every site, not only the notable ones.")
def replay_command(reference: str, port_spec: str, mapping: str | None, sites: tuple[str, ...],
                   tolerances: str | None, rtol: float | None, atol: float | None,
                   json_path: str | None, html_path: str | None, verbose: bool) -> None:
    """Run each layer of PORT_CASE on REFERENCE's recorded inputs: its own error, alone.

    Exit 0 when no layer has a local error, 1 when one does or a layer cannot be called
    (cannot judge), 2 for bad input.
    """
    from layerdiff.case import load_case
    from layerdiff.replay import replay
    from layerdiff.report.terminal import format_replay

    # the HTML report reads the replayed tensors: keep the replay trace beside it
    kept = Path(html_path).with_suffix(".replay.h5") if html_path else None
    refuse_inputs({"--json": json_path, "--html": html_path, "the kept replay trace": kept},
                  {"reference trace": reference, "mapping file": mapping,
                   "tolerance file": tolerances})
    result = replay(reference, load_case(port_spec), mapping=mapping, sites=sites,
                    tolerances=tolerances_from(tolerances, rtol, atol), output=kept)
    _write_reports(result, json_path, None, None)
    if html_path:
        from layerdiff.report.html import write_html

        write_html(result.diff, html_path)
    if json_path != "-":
        click.echo(format_replay(result, verbose=verbose))
    sys.exit(0 if result else 1)




_swap_baseline_option = click.option(
    "--baseline", type=click.Path(exists=True, dir_okay=False), metavar="TRACE",
    help="A trace of REF_CASE run the port's way (its dtype, autocast or device): each "
         "comparison may have a few times the error this trace has there.")


@main.command("swap")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@click.option("--site", "sites", multiple=True, required=True, metavar="NAME",
              help="A layer to swap, by module or site name in either model (repeatable).")
@map_option
@click.option("--steps", type=int, default=None, help="Training steps (default: the case's).")
@click.option("--into", type=click.Choice(["reference", "port"]), default="reference",
              show_default=True, help="Port layers into the reference, or reference layers "
              "into the port (to confirm a fix).")
@tolerances_option
@tolerance_flags
@_swap_baseline_option
@json_option
def swap_command(reference_spec: str, port_spec: str, sites: tuple[str, ...],
                 mapping: str | None, steps: int | None, into: str, tolerances: str | None,
                 rtol: float | None, atol: float | None, baseline: str | None,
                 json_path: str | None) -> None:
    """Run REF_CASE with PORT_CASE's layers at --site in place; compare with the reference.

    Exit 0 when loss, outputs and weight gradients stay within tolerance, 1 when they do not
    or when a swapped layer cannot be called (cannot judge), 2 for bad input.
    """
    from layerdiff.replay import swap
    from layerdiff.report.terminal import format_swap

    refuse_inputs({"--json": json_path}, {"mapping file": mapping, "tolerance file": tolerances,
                                          "baseline trace": baseline})
    result = swap(case_factory(reference_spec), case_factory(port_spec), sites,
                  mapping=mapping, steps=steps, into=into,
                  tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline)
    if json_path:
        echo_or_write(json.dumps(result.as_json(), indent=1), json_path)
    if json_path != "-":
        click.echo(format_swap(result))
    sys.exit(0 if result else 1)


@main.command("bisect")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
@click.option("--granularity", type=click.Choice(["auto", "leaves", "all"]), default="auto",
              show_default=True, help="auto: the port's leaf layers, then (when they find "
              "nothing) its containers; leaves: leaf layers only; all: every paired layer.")
@tolerances_option
@tolerance_flags
@_swap_baseline_option
@json_option
def bisect_command(reference_spec: str, port_spec: str, mapping: str | None, granularity: str,
                   tolerances: str | None, rtol: float | None, atol: float | None,
                   baseline: str | None, json_path: str | None) -> None:
    """Find the smallest set of PORT_CASE's layers whose swap into REF_CASE breaks it.

    Exit 0 only when the whole port swapped in keeps the reference within tolerance (nothing
    to find); 1 when culprits are found or a layer could not be tried; 2 for bad input.
    """
    from layerdiff.replay import Swapper, bisect
    from layerdiff.report.terminal import format_bisect

    refuse_inputs({"--json": json_path}, {"mapping file": mapping, "tolerance file": tolerances,
                                          "baseline trace": baseline})
    quiet = json_path == "-"
    swapper = Swapper(case_factory(reference_spec), case_factory(port_spec), mapping,
                      tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline)

    def show(number: int, probe) -> None:
        if not quiet:
            names = ", ".join(probe.swapped)
            line = f"probe {number:>3}  {probe.outcome:<12}  {names}"
            click.echo(line if len(line) <= 100 else line[:96] + " ...")

    result = bisect(swapper, granularity=granularity, on_probe=show)
    if json_path:
        echo_or_write(json.dumps(result.as_json(), indent=1), json_path)
    if not quiet:
        click.echo()
        click.echo(format_bisect(result))
    sys.exit(0 if result else 1)




@main.command("session")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
def session_command(reference_spec: str, port_spec: str, mapping: str | None) -> None:
    """An interactive shell: swap port layers into REF_CASE, run, diff, replay, bisect."""
    from layerdiff.replay.session import Session, interact

    case_factory(reference_spec), case_factory(port_spec)  # both load, or a clear error now
    interact(Session(reference_spec, port_spec, mapping), echo=click.echo)


@main.command("map-check")
@click.argument("reference", metavar="REF_TRACE", type=click.Path(dir_okay=False))
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
@json_option
def map_check_command(reference: str, port_spec: str, mapping: str | None,
                      json_path: str | None) -> None:
    """Dry-run a mapping: what each tensor of PORT_CASE would get from REF_TRACE's weights.

    Exit 0 when every port tensor has a source that fits and none looks transposed, 1 when
    one does not, 2 for bad input.
    """
    from layerdiff.case import load_case
    from layerdiff.mapcheck import map_check

    refuse_inputs({"--json": json_path}, {"reference trace": reference, "mapping file": mapping})
    result = map_check(reference, load_case(port_spec), mapping)
    if json_path:
        echo_or_write(json.dumps(result.as_json(), indent=1), json_path)
    if json_path != "-":
        click.echo(result.format())
    sys.exit(0 if result.passed else 1)


def _finite_margin(value: float) -> float:
    """A margin the tolerance file can hold: nan or inf passed FloatRange and wrote a file of
    no tolerances, after the golden trace."""
    if not math.isfinite(value):
        raise click.BadParameter(f"{value} is not a finite number; give a factor such as 10")
    return value


@main.command("golden")
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


@main.command("check")
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
    from layerdiff.ci import check, write_junit
    from layerdiff.report.terminal import format_diff

    refuse_inputs({"--junit": junit_path, "--json": json_path, "--html": html_path},
                  {"golden trace": golden_path, "mapping file": mapping,
                   "tolerance file": tolerances})
    result = check(case_spec, golden_path, mapping=mapping,
                   tolerances=tolerances_from(tolerances, rtol, atol), verify=not no_verify)
    if junit_path:
        write_junit(result.diff, junit_path, suite=f"layerdiff check {case_spec}")
    _write_reports(result.diff, json_path, None, html_path)
    if json_path != "-":
        click.echo(result.line())
        if not result.passed:
            click.echo()
            click.echo(format_diff(result.diff))
    sys.exit(0 if result.passed else 1)


@main.command("cases")
@click.option("--json", "as_json", is_flag=True, help="A JSON list, for scripts.")
def cases_command(as_json: bool) -> None:
    """List the bundled cases: references, their ports, and ports with planted bugs."""
    from reference_models.catalog import CATALOG, MULTI_RANK

    if as_json:
        click.echo(json.dumps([info.as_json() for info in CATALOG + MULTI_RANK], indent=1))
        return
    for kind in ("reference", "port", "bug", "diagnostic"):
        entries = [info for info in CATALOG + MULTI_RANK if info.kind == kind]
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


@main.command("demo")
@click.option("-o", "--output-dir", type=click.Path(file_okay=False), default="layerdiff-demo",
              show_default=True, help="Where to write the traces and the report.")
@click.option("--port", "port_spec", default=DEFAULT_DEMO_PORT, show_default=True,
              help="The bundled port to check against its reference (see layerdiff cases).")
def demo_command(output_dir: str, port_spec: str) -> None:
    """Capture the bundled transformer and a port with a planted bug, diff them, report."""
    from layerdiff.capture import capture
    from layerdiff.case import ExternalCase, load_case
    from layerdiff.compare import diff
    from layerdiff.errors import CaseError
    from layerdiff.report.html import write_html
    from layerdiff.report.terminal import format_diff
    from layerdiff.weights import load_weights
    from reference_models.catalog import find

    info = find(port_spec)
    if info is None or info.reference is None:
        raise CaseError(f"{port_spec} is not a bundled port; `layerdiff cases` lists them")
    out = make_folder(output_dir, "-o")
    start = time.perf_counter()
    reference = capture(load_case(info.reference), out / "reference.h5", progress=True)
    click.echo(f"reference {info.reference}\n          -> {reference}")
    port_case = load_case(port_spec)
    if not isinstance(port_case, ExternalCase):  # a port that records itself has its own
        load_weights(port_case.model, reference, info.mapping_path)
    port = capture(port_case, out / "port.h5", progress=True)
    click.echo(f"port      {port_spec}, with the reference's weights\n          -> {port}")
    if info.site:
        click.echo(textwrap.fill(f"planted   {info.description}; in the {info.pass_} of "
                                 f"{info.site}", 100, subsequent_indent=" " * 10))
    result = diff(reference, port, mapping=info.mapping_path)
    report = write_html(result, out / "report.html")
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
    for comment, command in _demo_next(info, port_spec, reference, port, result.origin):
        click.echo(f"# {comment}\n{command}")


for _command in (*DEBUG_COMMANDS, *RANKS_COMMANDS, *MAPSUGGEST_COMMANDS):
    main.add_command(_command)


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


if __name__ == "__main__":
    sys.exit(main())
