"""``layerdiff ranks``: do the replicated records of a multi-rank capture agree on every rank?
A thin shell over :func:`layerdiff.compare.ranks.check_ranks`.

Prints the result (or writes it as JSON with ``--json``) and exits 0 when every rank agrees, 1
when a replica disagrees, 2 for bad input.
"""

from __future__ import annotations

import click

from layerdiff.cli.options import (
    json_option,
    tolerance_flags,
    tolerances_from,
    tolerances_option,
)
from layerdiff.outputs import refuse_inputs
from layerdiff.report.emit import STDOUT, finish


@click.command("ranks")
@click.argument("port", metavar="PORT", type=click.Path(dir_okay=False))
@click.option("--map", "mapping", type=click.Path(dir_okay=False), metavar="FILE",
              help="Mapping file whose [[shard]] rules say which tensors are cut across ranks "
                   "(default: the mapping the capture recorded, if any; without rules every "
                   "tensor counts as replicated).")
@click.option("--reference", type=click.Path(dir_okay=False), metavar="REF",
              help="The one-process reference trace: a record no rule or recorded layout "
                   "places, whose parts' lengths along one dim add up to the reference's shape "
                   "(a DTensor port's plain local parts), is taken as cut, as diff takes it.")
@click.option("--tolerance", is_flag=True,
              help="Read the records whose bits differ and judge them with the per-dtype "
                   "tolerances (default: bit for bit, by the index digests alone).")
@tolerances_option
@tolerance_flags
@json_option
def ranks_command(port: str, mapping: str | None, reference: str | None, tolerance: bool,
                  tolerances: str | None, rtol: float | None, atol: float | None,
                  json_path: str | None) -> None:
    """Check that every rank of the multi-rank capture PORT (its manifest) holds the same copy
    of each replicated tensor as rank 0.

    A tensor that no [[shard]] rule of the --map file covers is replicated. Compared bit for
    bit by the index digests (no tensor read), or with --tolerance within the per-dtype
    tolerances (--tolerances, --rtol and --atol imply it). Names the first record whose
    replicas disagree and the ranks that hold another copy. Exit 0 when every rank agrees, 1
    when one does not, 2 for bad input.
    """
    from layerdiff.compare.rank_parts import reference_shapes
    from layerdiff.compare.ranks import check_ranks
    from layerdiff.progress import CountProgress
    from layerdiff.trace import open_trace

    refuse_inputs({"--json": json_path}, {"manifest": port, "mapping file": mapping,
                                          "tolerance file": tolerances,
                                          "reference": reference}, gathers=False)
    shapes = None
    if reference is not None:
        with open_trace(reference) as trace:
            shapes = reference_shapes(trace)
    judged = tolerance or tolerances is not None or rtol is not None or atol is not None
    with CountProgress("ranks", "records", enabled=json_path != STDOUT) as bar:
        result = check_ranks(port, mapping=mapping,
                             tolerance=tolerances_from(tolerances, rtol, atol) if judged
                             else False, progress=bar.progress, reference_shapes=shapes)
    finish(result, json_path=json_path)


COMMANDS = (ranks_command,)
