"""``layerdiff map-suggest``: a thin shell over :func:`layerdiff.mapsuggest.suggest_mapping`."""

from __future__ import annotations

import json

import click

from layerdiff.cli_options import echo_or_write, force_option, json_option
from layerdiff.outputs import refuse_existing, refuse_inputs, write_text


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
    if json_path:
        echo_or_write(json.dumps(result.as_json(), indent=1), json_path)
    if output:
        write_text(output, result.text)
    elif json_path != "-":
        click.echo(result.text)
    if json_path != "-":
        unsure = len(result.unsure)
        target = output or "DRAFT.map.toml"
        click.echo(f"# {len(result.suggestions)} rules drafted, {unsure} marked UNSURE"
                   + (f"; {len(result.without_source)} port tensors without a source"
                      if result.without_source else "")
                   + (f"; wrote {output}" if output else "; save it as a file") + ". Next:",
                   err=not output)
        click.echo(result.next_command(target, port_spec), err=not output)
    raise SystemExit(0 if result else 1)


COMMANDS = (map_suggest_command,)
