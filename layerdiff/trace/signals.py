"""Signals around writing a trace: Ctrl-C held back while the writer stops, never lost in a
finalizer; SIGXFSZ ignored.

Both act only in the main thread (the only one Python lets set a handler) and leave the
process as they found it afterwards.
"""

from __future__ import annotations

import _thread
import contextlib
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


class FileSizeSignalIgnored:
    """While held, a write past ``ulimit -f`` fails with EFBIG (which the writer reports)
    instead of SIGXFSZ killing the process. Python ignores it at startup; an embedding
    program may not. ``restore`` (or leaving the ``with``) puts the old action back."""

    def __init__(self) -> None:
        self._previous = None
        number = getattr(signal, "SIGXFSZ", None)
        if number is None or not _in_main_thread():
            return
        previous = signal.getsignal(number)
        if previous is not signal.SIG_IGN and previous is not None:
            signal.signal(number, signal.SIG_IGN)
            self._previous = previous

    def restore(self) -> None:
        if self._previous is not None and _in_main_thread():
            signal.signal(signal.SIGXFSZ, self._previous)
        self._previous = None

    def __enter__(self) -> FileSizeSignalIgnored:
        return self

    def __exit__(self, *exc: object) -> None:
        self.restore()


@dataclass
class Deferred:
    """Whether a Ctrl-C arrived while interrupts were deferred."""

    pending: bool = False


@contextlib.contextmanager
def interrupts_deferred(on_interrupt: Callable[[], None]) -> Iterator[Deferred]:
    """Inside, Ctrl-C does not raise: it calls ``on_interrupt`` (which should make the work
    inside finish soon) and sets ``pending``; the caller decides what to raise after. Where
    Python's own SIGINT handler is not the one installed, or off the main thread, nothing is
    deferred."""
    state = Deferred()
    if not _in_main_thread() or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        yield state
        return

    def note(signum: int, frame: object) -> None:
        state.pending = True
        on_interrupt()

    previous = signal.signal(signal.SIGINT, note)
    try:
        yield state
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def interrupts_kept() -> Iterator[None]:
    """Inside, a Ctrl-C that lands in a finalizer (a weakref callback, a ``__del__``) is
    delivered again to the main thread. Python cannot raise out of a finalizer: it prints the
    KeyboardInterrupt as "Exception ignored in ..." with a traceback and carries on as if no
    Ctrl-C had come (seen once in 8 tries when the capture had just created its file)."""
    previous = sys.unraisablehook

    def redeliver(unraisable: sys.UnraisableHookArgs) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            # a moment later, from another thread: tripped now, the signal would be handled
            # before this hook returns, inside the finalizer again, and ignored again
            timer = threading.Timer(0.01, _thread.interrupt_main)
            timer.daemon = True
            timer.start()
            return
        previous(unraisable)

    sys.unraisablehook = redeliver
    try:
        yield
    finally:
        sys.unraisablehook = previous
