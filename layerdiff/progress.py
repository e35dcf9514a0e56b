"""Progress bars for long work (captures, diffs), on stderr, only when stderr is a terminal.

A leaf module: it imports rich and nothing of layerdiff, so capture and report can both use it.
"""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
    TransferSpeedColumn,
)
from rich.text import Text


class TransientBar:
    """A bar that disappears when done; silent when disabled or not on a terminal."""

    def __init__(self, columns: list[ProgressColumn | str], label: str, *, enabled: bool,
                 total: float | None, **fields: str) -> None:
        console = Console(stderr=True)
        self._progress = None
        if enabled and console.is_terminal:
            self._progress = Progress(*columns, console=console, transient=True)
            self._task = self._progress.add_task(label, total=total, **fields)

    def update(self, **changes) -> None:
        if self._progress is not None:
            self._progress.update(self._task, **changes)

    def __enter__(self):
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()


class ByteProgress(TransientBar):
    """Use as ``with ByteProgress("diff") as bar: diff(..., progress=bar.progress)``."""

    def __init__(self, label: str, *, enabled: bool = True) -> None:
        super().__init__([TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn()], label,
                         enabled=enabled, total=None)

    def progress(self, done: int, total: int) -> None:
        self.update(completed=done, total=total)


class _Live(ProgressColumn):
    """Text read from a callable each time the bar is drawn (10 times a second, on rich's own
    thread): a counter the work keeps anyway shows progress within a step at no cost to it."""

    def __init__(self, read: Callable[[], str]) -> None:
        super().__init__()
        self._read = read

    def render(self, task) -> Text:
        return Text(self._read())


class StepProgress(TransientBar):
    """A transient bar over training steps; within a step, the records and MiB recorded so far
    (``recorded()`` gives them, read as the bar is drawn)."""

    def __init__(self, steps: int, *, enabled: bool, label: str,
                 recorded: Callable[[], tuple[int, int]] | None = None) -> None:
        def live() -> str:
            if recorded is None:
                return ""
            records, nbytes = recorded()
            return f"{records:,} records, {nbytes / 2**20:,.0f} MiB"

        super().__init__([SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                          _Live(live), TimeElapsedColumn()], label,
                         enabled=enabled, total=steps)

    def advance(self) -> None:
        self.update(advance=1)


class CountProgress(TransientBar):
    """A transient bar over counted work (steps, runs, sites): ``progress(done, total)``."""

    def __init__(self, label: str, unit: str, *, enabled: bool = True) -> None:
        super().__init__([SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed:.0f}/{task.total:.0f} " + unit),
                          TimeElapsedColumn(), TimeRemainingColumn()], label,
                         enabled=enabled, total=None)

    def progress(self, done: int, total: int) -> None:
        self.update(completed=done, total=total)
