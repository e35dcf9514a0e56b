"""``layerdiff replay``, ``swap``, ``bisect``: a port's layers judged on the reference's
recorded inputs, inside the reference, and the smallest set that breaks it; ``map-check`` and
``map-suggest``: the mapping those need, dry-run and drafted."""

from __future__ import annotations

from pathlib import Path

import click

from layerdiff.cli.options import (
    case_factory,
    force_option,
    json_option,
    map_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
)
from layerdiff.outputs import refuse_existing, refuse_inputs, write_text
from layerdiff.report.emit import STDOUT, exit_code, finish, write_outputs


@click.command("replay")
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
@click.option("--reference-case", "reference_spec", metavar="CASE",
              help="The reference's case (package.module:name): a weight the port's code also "
                   "uses outside its modules' calls (a tied head in the parent's code) is then "
                   "judged on what those calls alone make, on both sides; without it that "
                   "weight gradient is set aside (cannot judge alone).")
@click.option("--force-routing", is_flag=True,
              help="Mixture of experts: a replayed layer that holds a router sends each token "
                   "to the experts the reference chose, so its experts are judged apart from "
                   "routing (docs/moe.md).")
def replay_command(reference: str, port_spec: str, mapping: str | None, sites: tuple[str, ...],
                   tolerances: str | None, rtol: float | None, atol: float | None,
                   json_path: str | None, html_path: str | None, verbose: bool,
                   reference_spec: str | None, force_routing: bool) -> None:
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
                    tolerances=tolerances_from(tolerances, rtol, atol), output=kept,
                    reference_case=load_case(reference_spec) if reference_spec else None,
                    force_routing=force_routing)
    finish(result, lambda: format_replay(result, verbose=verbose), json_path=json_path,
           html_path=html_path)


_force_routing_option = click.option(
    "--force-routing", is_flag=True,
    help="Mixture of experts: every swapped run's routers send each token to the experts the "
         "pure reference chose, so experts are judged apart from routing (docs/moe.md).")

_swap_baseline_option = click.option(
    "--baseline", type=click.Path(exists=True, dir_okay=False), metavar="TRACE",
    help="A trace of REF_CASE run the port's way (its dtype, autocast or device): each "
         "comparison may have a few times the error this trace has there.")


@click.command("swap")
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
@_force_routing_option
@json_option
def swap_command(reference_spec: str, port_spec: str, sites: tuple[str, ...],
                 mapping: str | None, steps: int | None, into: str, tolerances: str | None,
                 rtol: float | None, atol: float | None, baseline: str | None,
                 force_routing: bool, json_path: str | None) -> None:
    """Run REF_CASE with PORT_CASE's layers at --site in place; compare with the reference.

    Exit 0 when loss, outputs and weight gradients stay within tolerance, 1 when they do not
    or when the swap cannot be judged (a swapped layer cannot be called, or the run raised),
    2 for bad input.
    """
    from layerdiff.replay import swap
    from layerdiff.report.terminal import format_swap

    refuse_inputs({"--json": json_path}, {"mapping file": mapping, "tolerance file": tolerances,
                                          "baseline trace": baseline})
    result = swap(case_factory(reference_spec), case_factory(port_spec), sites,
                  mapping=mapping, steps=steps, into=into,
                  tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline,
                  force_routing=force_routing)
    finish(result, lambda: format_swap(result), json_path=json_path)


@click.command("bisect")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
@click.option("--granularity", type=click.Choice(["auto", "leaves", "all"]), default="auto",
              show_default=True, help="auto: the port's leaf layers, then (when they find "
              "nothing) its containers; leaves: leaf layers only; all: every paired layer.")
@tolerances_option
@tolerance_flags
@_swap_baseline_option
@_force_routing_option
@json_option
def bisect_command(reference_spec: str, port_spec: str, mapping: str | None, granularity: str,
                   tolerances: str | None, rtol: float | None, atol: float | None,
                   baseline: str | None, force_routing: bool, json_path: str | None) -> None:
    """Find the smallest set of PORT_CASE's layers whose swap into REF_CASE breaks it.

    Exit 0 only when the whole port swapped in keeps the reference within tolerance (nothing
    to find, every layer judged); 1 when culprits are found or a layer could not be judged
    (listed apart: never a culprit); 2 for bad input.
    """
    from layerdiff.replay import Swapper, bisect
    from layerdiff.report.terminal import format_bisect, format_probe

    refuse_inputs({"--json": json_path}, {"mapping file": mapping, "tolerance file": tolerances,
                                          "baseline trace": baseline})
    quiet = json_path == STDOUT
    swapper = Swapper(case_factory(reference_spec), case_factory(port_spec), mapping,
                      tolerances=tolerances_from(tolerances, rtol, atol), baseline=baseline,
                      force_routing=force_routing)

    def show(number: int, probe) -> None:
        if not quiet:
            click.echo(format_probe(number, probe))

    result = bisect(swapper, granularity=granularity, on_probe=show)
    finish(result, lambda: "\n" + format_bisect(result), json_path=json_path)


@click.command("map-check")
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
    from layerdiff.replay.mapcheck import map_check

    refuse_inputs({"--json": json_path}, {"reference trace": reference, "mapping file": mapping})
    result = map_check(reference, load_case(port_spec), mapping)
    finish(result, json_path=json_path)


@click.command("map-suggest")
@click.argument("reference", metavar="REF_TRACE", type=click.Path(dir_okay=False))
@click.argument("port_spec", metavar="PORT_CASE")
@click.option("-o", "--output", type=click.Path(dir_okay=False), default=None, metavar="FILE",
              help="Write the draft mapping to FILE (refused when it exists, unless --force) "
                   "instead of printing it.")
@force_option
@json_option
def map_suggest_command(reference: str, port_spec: str, output: str | None, force: bool,
                        json_path: str | None) -> None:
    """Draft a mapping file pairing PORT_CASE's layers and tensors with REF_TRACE's.

    Every rule is commented with its evidence (type, shapes, call order, structure, names,
    values with the draft's weights loaded); doubtful ones are marked UNSURE. Prints the
    map-check command to run next. Exit 0 when every port tensor got a source, 1 when some
    did not, 2 for bad input.
    """
    from layerdiff.case import load_case
    from layerdiff.mapsuggest import suggest_mapping

    refuse_inputs({"-o": output, "--json": json_path}, {"reference trace": reference})
    if output:
        refuse_existing(output, "-o", force)
    result = suggest_mapping(reference, load_case(port_spec))
    write_outputs(result, json_path=json_path)
    if output:
        write_text(output, result.text)
    elif json_path != STDOUT:
        click.echo(result.text)
    if json_path != STDOUT:
        unsure = len(result.unsure)
        target = output or "DRAFT.map.toml"
        click.echo(f"# {len(result.suggestions)} rules drafted, {unsure} marked UNSURE"
                   + (f"; {len(result.without_source)} port tensors without a source"
                      if result.without_source else "")
                   + (f"; wrote {output}" if output else "; save it as a file") + ". Next:",
                   err=not output)
        click.echo(result.next_command(target, port_spec), err=not output)
    raise SystemExit(exit_code(result))


COMMANDS = (replay_command, swap_command, bisect_command, map_check_command,
            map_suggest_command)
