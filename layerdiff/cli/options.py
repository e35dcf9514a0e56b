"""Options and small helpers the command modules share, written once."""

from __future__ import annotations

import click

map_option = click.option(
    "--map", "mapping", type=click.Path(dir_okay=False), metavar="FILE",
    help="Mapping file (TOML or YAML) for names that differ between the two models.")
tolerances_option = click.option(
    "--tolerances", type=click.Path(dir_okay=False), metavar="FILE",
    help="Tolerance overrides (TOML or YAML) by site, role and dtype globs.")


def tolerance_flags(command):
    """--rtol and --atol: the default tolerance of every record (a tolerance file's rules still
    override them)."""
    command = click.option("--atol", type=click.FloatRange(min=0), default=None,
                           help="Absolute tolerance for every record (default: per dtype).")(
        command)
    return click.option("--rtol", type=click.FloatRange(min=0), default=None,
                        help="Relative tolerance for every record (default: per dtype).")(command)


def tolerances_from(path: str | None, rtol: float | None, atol: float | None):
    from layerdiff.compare.tolerances import Tolerances

    return Tolerances.build(path, rtol=rtol, atol=atol)


no_verify_option = click.option(
    "--no-verify", is_flag=True,
    help="Do not check tensor data against the index's digests and statistics (saves reading "
         "records whose digests agree; a damaged trace may then pass).")
force_option = click.option("--force", is_flag=True,
                            help="Replace the output file if it exists.")

json_option = click.option(
    "--json", "json_path", type=click.Path(dir_okay=False, allow_dash=True), metavar="FILE",
    help="Write the result as JSON ('-' for stdout).")


def case_factory(spec: str):
    """A function building the case afresh: swap and bisect train, so every run needs one."""
    from layerdiff.case import load_case

    load_case(spec)  # fail now, with the case's own message, if it does not load
    return lambda: load_case(spec)


workers_option = click.option(
    "--workers", type=click.IntRange(min=1), metavar="N",
    help="Processes that check a multi-rank port's rank files while they are gathered "
         "(default: every core but one).")
