"""A progress display for long captures: steps done and data recorded, on stderr only."""

from __future__ import annotations

from rich.progress import BarColumn, SpinnerColumn, TextColumn, TimeElapsedColumn

from layerdiff.report.progress import TransientBar


class StepProgress(TransientBar):
    """A transient bar over training steps."""

    def __init__(self, steps: int, *, enabled: bool, label: str) -> None:
        super().__init__([SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
                          TextColumn("step {task.completed:.0f}/{task.total:.0f}"),
                          TextColumn("{task.fields[data]}"), TimeElapsedColumn()], label,
                         enabled=enabled, total=steps, data="")

    def advance(self, bytes_recorded: int) -> None:
        self.update(advance=1, data=f"{bytes_recorded / 2**20:,.0f} MiB recorded")
