"""``layerdiff session``: an interactive shell around :class:`layerdiff.replay.session.Session`:
swap port layers in and out of the reference, run, diff, replay and bisect, with history and
tab completion of layer names.

    layerdiff session reference_models.mlp:reference reference_models.mlp_port:port
    layerdiff> swap fc2
    layerdiff> run
"""

from __future__ import annotations

import cmd
import os
import shlex
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import click

from layerdiff.cli.options import case_factory, map_option
from layerdiff.errors import DiffError, LayerdiffError

if TYPE_CHECKING:  # imported when the command runs: it brings torch, too slow for --help
    from layerdiff.replay.session import Session

HISTORY = Path(os.environ.get("LAYERDIFF_HISTORY", Path.home() / ".layerdiff_history"))


@click.command("session")
@click.argument("reference_spec", metavar="REF_CASE")
@click.argument("port_spec", metavar="PORT_CASE")
@map_option
def session_command(reference_spec: str, port_spec: str, mapping: str | None) -> None:
    """An interactive shell: swap port layers into REF_CASE, run, diff, replay, bisect."""
    from layerdiff.replay.session import Session

    case_factory(reference_spec), case_factory(port_spec)  # both load, or a clear error now
    interact(Session(reference_spec, port_spec, mapping), echo=click.echo)


class SessionShell(cmd.Cmd):
    """The shell around a Session; every error is printed and the session goes on."""

    intro = ("layerdiff session: swap port layers into the reference and see what breaks.\n"
             "Type help for the commands, Tab completes layer names.")
    prompt = "layerdiff> "

    def __init__(self, session: Session, echo: Callable[[str], None] = print) -> None:
        super().__init__()
        self.session, self.echo = session, echo

    # ---- commands
    def do_sites(self, arg: str) -> None:
        """sites [GLOB]: the layers both models have (reference <- port), * marks swapped."""
        for ref, port in self.session.sites(arg.strip() or "*"):
            mark = "*" if ref in self.session.swapped else " "
            self.echo(f" {mark} {ref}" + ("" if port == ref else f" <- {port}"))

    def do_swap(self, arg: str) -> None:
        """swap NAME [NAME ...]: put the port's layers in place of the reference's."""
        self._need(arg, "swap NAME")
        self.echo("swapped: " + ", ".join(self.session.swap(*shlex.split(arg))))

    def do_unswap(self, arg: str) -> None:
        """unswap [NAME ...]: put the reference's own layers back (all without names)."""
        swapped = self.session.unswap(*shlex.split(arg))
        self.echo("swapped: " + (", ".join(swapped) or "nothing"))

    def do_run(self, arg: str) -> None:
        """run [STEPS]: run the reference with the swapped layers against the pure reference."""
        from layerdiff.report.terminal import format_swap

        if arg.strip() and not arg.strip().isdigit():
            raise DiffError(f"usage: run [STEPS], with STEPS a whole number (got {arg.strip()!r})")
        self.echo(format_swap(self.session.run(int(arg) if arg.strip() else None)))

    def do_diff(self, arg: str) -> None:
        """diff: capture the whole port and diff it against the reference."""
        from layerdiff.report.terminal import format_diff

        self.echo(format_diff(self.session.diff()))

    def do_show(self, arg: str) -> None:
        """show NAME: the last diff's metrics for one layer."""
        from layerdiff.report.terminal import format_rows

        self._need(arg, "show NAME")
        self.echo(format_rows(self.session.show(arg.strip())))

    def do_replay(self, arg: str) -> None:
        """replay [GLOB ...]: run port layers on the reference's recorded inputs."""
        from layerdiff.report.terminal import format_replay

        self.echo(format_replay(self.session.replay(*shlex.split(arg))))

    def do_bisect(self, arg: str) -> None:
        """bisect: find the smallest set of port layers that breaks the reference."""
        from layerdiff.report.terminal import format_bisect, format_probe

        result = self.session.bisect(lambda n, p: self.echo(format_probe(n, p)))
        self.echo(format_bisect(result))

    def do_quit(self, arg: str) -> bool:
        """quit: leave the session."""
        return True

    do_exit = do_quit

    def do_EOF(self, arg: str) -> bool:
        """Ctrl-D: leave the session."""
        self.echo("")
        return True

    def get_names(self) -> list[str]:
        """What ``help`` lists and Tab completes: not EOF (Ctrl-D, not a command to type)."""
        return [name for name in super().get_names() if name != "do_EOF"]

    # ---- completion and errors
    def completenames_for_layers(self, text: str) -> list[str]:
        names = {n for pair in self.session.sites() for n in pair}
        return sorted(n for n in names if n.startswith(text))

    def complete_swap(self, text, line, begidx, endidx):
        return self.completenames_for_layers(text)

    complete_unswap = complete_show = complete_replay = complete_sites = complete_swap

    def onecmd(self, line: str) -> bool:
        try:
            return super().onecmd(line)
        except LayerdiffError as exc:
            self.echo(f"error: {exc}")
        except Exception as exc:  # a port layer that raises: named, and the session goes on
            self.echo(f"error: {type(exc).__name__}: {exc}")
        return False

    def default(self, line: str) -> None:
        self.echo(f"unknown command {line.split()[0]!r}; type help for the commands")

    def emptyline(self) -> None:
        pass

    def _need(self, arg: str, usage: str) -> None:
        if not arg.strip():
            raise DiffError(f"usage: {usage}")


def interact(session: Session, echo: Callable[[str], None] = print) -> None:
    """Run the shell, with readline history when on a terminal."""
    shell = SessionShell(session, echo)
    history = _load_history(echo) if sys.stdin.isatty() else None
    try:
        shell.cmdloop()
    finally:
        session.close()
        if history is not None:
            try:
                history.write_history_file(str(HISTORY))
            except OSError as exc:
                echo(f"warning: history not saved to {HISTORY} ({exc})")


def _load_history(echo: Callable[[str], None]):
    try:
        import readline
    except ImportError:  # pragma: no cover - no readline on this platform
        return None
    try:
        if HISTORY.exists():
            readline.read_history_file(str(HISTORY))
    except OSError as exc:
        echo(f"warning: history not read from {HISTORY} ({exc})")
    return readline


COMMANDS = (session_command,)
