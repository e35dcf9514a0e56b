"""A session: a reference, a port and the port layers swapped into the reference; swap them
in and out, run, diff, replay and bisect from a notebook through :class:`Session`.

``layerdiff session REF_CASE PORT_CASE`` is the interactive shell around it
(:mod:`layerdiff.cli.session`).
"""

from __future__ import annotations

import fnmatch
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from layerdiff.case import load_case
from layerdiff.compare import diff as diff_traces
from layerdiff.compare.result import Diff
from layerdiff.errors import DiffError
from layerdiff.replay.bisect import BisectResult, bisect
from layerdiff.replay.replay import replay
from layerdiff.replay.swap import Swapper, SwapResult


class Session:
    """A reference, a port and the set of port layers currently swapped into the reference."""

    def __init__(self, reference: str, port: str, mapping: str | os.PathLike | None = None
                 ) -> None:
        self.reference_spec, self.port_spec = reference, port
        self.mapping = mapping
        self.swapper = Swapper(lambda: load_case(reference), lambda: load_case(port), mapping)
        self.swapped: list[str] = []        # reference module names
        self.last_diff: Diff | None = None
        self._directory = tempfile.TemporaryDirectory(prefix="layerdiff-session-")
        self._reference_trace: Path | None = None

    def sites(self, pattern: str = "*") -> list[tuple[str, str]]:
        """(reference module, port module) pairs, in execution order, matching ``pattern`` on
        either name."""
        order = [m for m in self.swapper.execution_order() if m in self.swapper.pairs]
        pairs = [(m, self.swapper.pairs[m][0]) for m in order]
        return [(r, p) for r, p in pairs
                if fnmatch.fnmatchcase(r, pattern) or fnmatch.fnmatchcase(p, pattern)]

    def swap(self, *names: str) -> list[str]:
        for name in names:
            module = self.swapper.resolve(name)
            if module not in self.swapped:
                self.swapped.append(module)
        return self.swapped

    def unswap(self, *names: str) -> list[str]:
        """Put the reference's own layers back (all of them without names)."""
        if not names:
            self.swapped.clear()
        for name in names:
            module = self.swapper.resolve(name)
            if module not in self.swapped:
                raise DiffError(f"{name} is not swapped in; swapped: "
                                f"{', '.join(self.swapped) or 'nothing'}")
            self.swapped.remove(module)
        return self.swapped

    def run(self, steps: int | None = None) -> SwapResult:
        """The reference with the swapped layers, against the pure reference."""
        return self.swapper.run(self.swapped, steps=steps)

    def reference_trace(self) -> Path:
        if self._reference_trace is None:
            from layerdiff.capture import capture

            self._reference_trace = capture(load_case(self.reference_spec),
                                            Path(self._directory.name) / "reference.h5")
        return self._reference_trace

    def diff(self) -> Diff:
        """The whole port (with the reference's weights) against the reference."""
        from layerdiff.capture import capture
        from layerdiff.framework import framework_of

        port = load_case(self.port_spec)
        if getattr(port, "model", None) is not None:  # one that records itself has its own
            framework_of(port).load_weights(port, self.reference_trace(), self.mapping)
        path = capture(port, Path(self._directory.name) / "port.h5")
        self.last_diff = diff_traces(self.reference_trace(), path, mapping=self.mapping)
        return self.last_diff

    def replay(self, *sites: str) -> Diff:
        return replay(self.reference_trace(), load_case(self.port_spec), mapping=self.mapping,
                      sites=sites, reference_case=load_case(self.reference_spec))

    def bisect(self, on_probe: Callable | None = None) -> BisectResult:
        return bisect(self.swapper, on_probe=on_probe)

    def show(self, name: str) -> Any:
        """The last diff's rows of one layer (runs the diff first if there is none)."""
        result = self.last_diff if self.last_diff is not None else self.diff()
        module = self.swapper.resolve(name)
        rows = result.rows[result.rows["site"].str.rpartition("#")[0] == module]
        if rows.empty:
            raise DiffError(f"the diff compared no record of {name}")
        return rows

    def close(self) -> None:
        self._directory.cleanup()
