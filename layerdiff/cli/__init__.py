"""The ``layerdiff`` command: one click group. Each command, in the module of its family,
parses its arguments, calls one library function and emits the result
(:mod:`layerdiff.report.emit`).

    capture.py  capture                    diff.py     diff, show, gather
    replay.py   replay, swap, bisect, map-check, map-suggest
    session.py  session (the interactive shell)
    debug.py    nan, determinism, batch-independence, diverge
    health.py   health (the trainability checklist)
    ranks.py    ranks                      ci.py       golden, check
    demo.py     demo, cases

Nothing in the library imports this package.
"""

from __future__ import annotations

import os
import sys

try:
    import click

    from layerdiff.cli import capture, ci, debug, demo, diff, health, ranks, replay, session
    from layerdiff.errors import Interrupted, LayerdiffError, interrupt_inside
except KeyboardInterrupt:  # Ctrl-C while the command loads: the same line as a moment later
    sys.stderr.write("interrupted: nothing was published\n")
    raise SystemExit(130) from None


class _Group(click.Group):
    """Turns a LayerdiffError into one sentence on stderr and exit code 2 (unless --debug)."""

    def invoke(self, ctx: click.Context):
        try:
            # imported inside: these load h5py and numpy (half a second), and a Ctrl-C then
            # is the same interrupt as one a moment later, not click's "Aborted!" and exit 1
            from layerdiff.trace.printable import visible
            from layerdiff.trace.signals import interrupts_kept

            with interrupts_kept():
                return super().invoke(ctx)
        except (KeyboardInterrupt, Exception) as exc:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            if not isinstance(exc, Interrupted) and interrupt_inside(exc) is not None:
                # also an error raised over a Ctrl-C that a library caught (h5py's converters
                # raise TypeError) or that we wrapped as the model's: the user's interrupt
                click.echo("interrupted: nothing was published", err=True)
                ctx.exit(Interrupted.exit_code)
            if not isinstance(exc, LayerdiffError):
                raise
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


for _family in (capture, diff, replay, session, debug, health, ranks, ci, demo):
    for _command in _family.COMMANDS:
        main.add_command(_command)


def run() -> None:
    """The ``layerdiff`` process: the command, then an exit that a late Ctrl-C cannot turn into
    a traceback. Once the command has returned, its result is published and said; a Ctrl-C
    during the interpreter's teardown (torch's atexit handlers) would only print "Exception
    ignored" over it, so teardown ignores SIGINT."""
    import signal

    code: object = 0
    try:
        main(prog_name="layerdiff")
    except SystemExit as exc:
        code = exc.code
        raise
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        files = sys.modules.get("layerdiff.trace.h5file")
        if files is not None and files.unclosable():
            # libhdf5 refused to close a trace whose write failed (a full disk, a file size
            # limit): freeing its objects in teardown crashed the process in a segfault after
            # the sentence was said. The file is already removed; end without teardown.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code if isinstance(code, int) else 1)
