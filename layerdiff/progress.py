"""Progress bars for long work (captures, diffs), on stderr, only when stderr is a terminal.

A leaf module: it imports rich and nothing of layerdiff, so capture and report can both use it.
"""

from __future__ import annotations

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


class StepProgress(TransientBar):
    """A transient bar over training steps, with the data recorded so far."""

    def __init__(self, steps: int, *, enabled: bool, label: str) -> None:
        super().__init__([SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                          TextColumn("{task.fields[data]}"), TimeElapsedColumn()], label,
                         enabled=enabled, total=steps, data="")

    def advance(self, bytes_recorded: int) -> None:
        self.update(advance=1, data=f"{bytes_recorded / 2**20:,.0f} MiB recorded")


class CountProgress(TransientBar):
    """A transient bar over counted work (steps, runs, sites): ``progress(done, total)``."""

    def __init__(self, label: str, unit: str, *, enabled: bool = True) -> None:
        super().__init__([SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("{task.completed:.0f}/{task.total:.0f} " + unit),
                          TimeElapsedColumn(), TimeRemainingColumn()], label,
                         enabled=enabled, total=None)

    def progress(self, done: int, total: int) -> None:
        self.update(completed=done, total=total)
