"""Errors meant for people: one sentence naming the file, the site, what is wrong and what to do.

The CLI prints ``str(error)`` and exits with ``exit_code``; a traceback only with ``--debug``.
"""

from __future__ import annotations


class LayerdiffError(Exception):
    """Base for every error a user can cause and fix."""

    exit_code = 2


class CaseError(LayerdiffError):
    """A case spec that does not import, or that does not give a Case."""


class TraceError(LayerdiffError):
    """A trace file that is missing, not a trace, too new, or cut off."""


class CaptureError(LayerdiffError):
    """A capture that could not finish: the model raised, the writer failed, bad options."""


class MappingError(LayerdiffError):
    """A mapping file that does not parse or does not validate (names its line)."""


class ToleranceError(LayerdiffError):
    """A tolerance file that does not parse or does not validate (names its line)."""


class DiffError(LayerdiffError):
    """Two traces that cannot be compared: nothing in common, or no data where data is needed."""


class OutputError(LayerdiffError):
    """An output that would destroy an input, replace a file unasked, or cannot be written."""


class Interrupted(LayerdiffError):
    """Ctrl-C: the work stopped; the message says what was left and where."""

    exit_code = 130  # the shell's code for a process ended by SIGINT


def interrupt_inside(exc: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C an exception carries as its cause, or None. Python 3.11 wraps an interrupt
    that lands in a class body's ``__set_name__`` (torch defines classes lazily, mid-run) in a
    RuntimeError, and libraries re-raise as their own errors: still the user's Ctrl-C."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, KeyboardInterrupt):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None
