"""A progress display for long captures: steps done and data recorded, on stderr only."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn


class StepProgress:
    """A transient bar over training steps; silent when disabled or not on a terminal."""

    def __init__(self, steps: int, *, enabled: bool, label: str) -> None:
        console = Console(stderr=True)
        self._progress = None
        if enabled and console.is_terminal:
            self._progress = Progress(
                SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                TextColumn("{task.fields[data]}"), TimeElapsedColumn(),
                console=console, transient=True)
            self._task = self._progress.add_task(label, total=steps, data="")

    def advance(self, bytes_recorded: int) -> None:
        if self._progress is not None:
            self._progress.update(self._task, advance=1,
                                  data=f"{bytes_recorded / 2**20:,.0f} MiB recorded")

    def __enter__(self) -> StepProgress:
        if self._progress is not None:
            self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._progress is not None:
            self._progress.stop()
