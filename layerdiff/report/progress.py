"""Progress bars for long work, on stderr, only when stderr is a terminal."""

from __future__ import annotations

from rich.console import Console
from rich.progress import (
    BarColumn,
    DownloadColumn,
    Progress,
    ProgressColumn,
    TextColumn,
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
