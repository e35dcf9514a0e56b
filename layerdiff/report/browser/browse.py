"""The trace browser: one self-contained HTML page to look at a trace, or a pair, before
reading tables (``layerdiff show TRACE --html F``).

Per site in execution order: the range of its output values and of the gradient arriving at
its output (min/max bars, as a debugger window shows them); weight and gradient norms per layer
(per step); histograms of values and gradients; NaN and Inf flagged wherever they are. With
``against`` (a port's trace) it diffs the pair and draws the error per batch element and
record: which batch elements are wrong.

Cost: ranges, norms and NaN flags come from the index alone (statistics every trace holds, a
summary trace included). Tensor data is read only for histograms (streamed in 1 MiB chunks) and,
in pair mode, by the diff itself (streamed, bounded memory). What is drawn is capped (see
browser.sections and browser.hist); the page lists what it left out. Inline CSS, SVG and base64
PNG only: nothing is fetched, so the page can be mailed or opened offline.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from layerdiff.compare import diff as diff_traces
from layerdiff.compare.result import Column
from layerdiff.errors import TraceError
from layerdiff.outputs import refuse_inputs, write_text
from layerdiff.report.browser import data, hist, sections
from layerdiff.report.browser.data import BatchErrors, NonFinite, Progress, spans
from layerdiff.report.browser.sections import Page
from layerdiff.report.findings.diff import describe_origin
from layerdiff.trace.reader import open_trace


@dataclass
class Browser:
    """What the browser page shows; ``html`` is the page itself (see :meth:`write`)."""

    trace: Path
    against: Path | None
    summary: bool                    # either trace holds statistics only
    steps: list[int]
    step: int                        # the step of the sites table, histograms, batch image
    sites: list[str]                 # the reference's sites at ``step``, in execution order
    nonfinite: list[NonFinite]       # every record with NaN or Inf, both traces, in order
    histograms: list[str]            # the sites with histograms
    batch: BatchErrors | None        # pair mode, full traces: errors per batch element
    verdict: str | None              # pair mode: the diff's pass | fail
    origin: str | None               # pair mode: the diff's first origin, described
    notes: list[str]                 # what the page leaves out, and why
    # the reference's norms per step and layer: step, module, weight, grad (÷ loss scale)
    norms: pd.DataFrame = field(default_factory=pd.DataFrame, repr=False)
    html: str = field(default="", repr=False)

    @property
    def found(self) -> bool:
        """A NaN or Inf anywhere, or (pair) a record out of tolerance."""
        return bool(self.nonfinite) or self.verdict == "fail"

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the page; never over one of the traces it shows."""
        refuse_inputs({"--html": path}, {"trace": self.trace, "--against trace": self.against})
        return write_text(path, self.html)

    def as_json(self) -> dict[str, Any]:
        return {
            "trace": str(self.trace), "against": str(self.against) if self.against else None,
            "summary": self.summary, "steps": self.steps, "step": self.step,
            "sites": self.sites, "found": self.found,
            "nonfinite": [n.as_json() for n in self.nonfinite],
            "histograms": self.histograms,
            "batch": self.batch.as_json() if self.batch else None,
            "verdict": self.verdict, "origin": self.origin, "notes": self.notes,
            "norms": [{"step": int(r.step), "module": str(r.module), "weight": _plain(r.weight),
                       "grad": _plain(r.grad)} for r in self.norms.itertuples(index=False)],
        }

    def format(self) -> str:
        """A few lines for the terminal: what the page holds and what it found."""
        lines = [f"{len(self.sites)} sites at step {self.step} of {len(self.steps)} step(s); "
                 f"histograms for {len(self.histograms)} site(s)"
                 + (" (a summary trace has no data for them)" if self.summary else "")]
        if self.nonfinite:
            first = self.nonfinite[0]
            lines.append(f"non-finite: {len(self.nonfinite)} record(s); first in the "
                         f"{first.trace}: {first.describe()}")
        else:
            lines.append("non-finite: none")
        if self.against is not None:
            lines.append(f"pair: {self.verdict}" + (f"; origin {self.origin}" if self.origin
                                                    else ""))
            row = self.batch.origin or self.batch.first if self.batch is not None else None
            if row is not None and self.batch is not None:
                lines.append(f"wrong batch elements at {row.label()}: {spans(row.wrong)} of "
                             f"0–{self.batch.batch - 1}")
        return "\n".join(line if len(line) <= 100 else line[:99] + "…" for line in lines)


def write_browser(trace_path: str | os.PathLike[str], path: str | os.PathLike[str], *,
                  against: str | os.PathLike[str] | None = None, sites: Sequence[str] = (),
                  step: int | None = None, mapping: str | os.PathLike[str] | None = None,
                  tolerances: str | os.PathLike[str] | None = None,
                  progress: Progress | None = None, allow_incomplete: bool = False) -> Path:
    """Write the browser page of ``trace_path`` (and ``against``) to ``path``; see
    :func:`browse`. Returns the path."""
    refuse_inputs({"--html": path}, {"trace": trace_path, "--against trace": against})
    return browse(trace_path, against=against, sites=sites, step=step, mapping=mapping,
                  tolerances=tolerances, progress=progress,
                  allow_incomplete=allow_incomplete).write(path)


def browse(trace_path: str | os.PathLike[str], *,
           against: str | os.PathLike[str] | None = None, sites: Sequence[str] = (),
           step: int | None = None, mapping: str | os.PathLike[str] | None = None,
           tolerances: str | os.PathLike[str] | None = None,
           progress: Progress | None = None, allow_incomplete: bool = False) -> Browser:
    """The browser page of a trace, or of a pair: ``trace_path`` the reference and ``against``
    the port (paired and judged as ``layerdiff diff`` does, through ``mapping`` and
    ``tolerances``). ``sites``: globs over site or module names whose histograms to draw
    (every site's when the trace is small: browser_hist.HIST_BUDGET_BYTES). ``step``: the step
    of the sites table, histograms and batch image (default: the pair's first failing step,
    else the first with a NaN or Inf, else the first). ``progress(done, total)`` gets bytes
    read. ``allow_incomplete`` opens traces whose capture did not finish (what they hold).
    Raises TraceError (or the diff's DiffError) with one sentence on bad input."""
    with contextlib.ExitStack() as stack:
        ref = stack.enter_context(open_trace(trace_path, allow_incomplete=allow_incomplete))
        port = stack.enter_context(open_trace(against, allow_incomplete=allow_incomplete)) if (
            against is not None) else None
        diff = partner = None
        if port is not None:
            diff = diff_traces(ref, port, mapping=mapping, tolerances=tolerances,
                               progress=progress)
            rows = diff.rows.drop_duplicates(Column.PORT_SITE)
            partner = dict(zip(rows[Column.PORT_SITE], rows[Column.SITE], strict=True))
        steps = data.steps_of(ref)
        if not steps:
            raise TraceError(f"{ref.path} holds no records, so there is nothing to show; "
                             "capture the case again")
        nonfinite = data.nonfinite_records(ref, "reference") + (
            data.nonfinite_records(port, "port") if port is not None else [])
        page = Page(ref, port, diff, partner or {}, steps,
                    _step(step, steps, ref.path, diff, nonfinite), nonfinite, progress)
        return _build(page, list(sites))


def _step(given: int | None, steps: list[int], path: Path, diff: Any,
          nonfinite: list[NonFinite]) -> int:
    if given is not None:
        if given not in steps:
            raise TraceError(f"{path} has no step {given} (it holds steps {spans(steps)}); "
                             "pass one of those with --step")
        return given
    if diff is not None and diff.first_failing_step is not None:
        return int(diff.first_failing_step)
    if nonfinite:
        return min(n.step for n in nonfinite)
    return steps[0]


def _build(page: Page, globs: list[str]) -> Browser:
    ref, port, diff = page.ref, page.port, page.diff
    order = data.site_order(ref, page.step)["site"].tolist()
    batch = data.batch_errors(diff, page.step) if diff is not None else None
    summary = ref.summary or (port is not None and port.summary)
    hist_sites = hist.histogram_sites(page, order, globs, summary)
    origin = describe_origin(diff.origin) if diff is not None and diff.origin else None
    body = [
        sections.nonfinite_section(page),
        sections.batch_section(page, batch, summary),
        sections.ranges_section(page),
        sections.norms_section(page),
        sections.table_section(page, hist_sites, batch),
        hist.histogram_section(page, hist_sites, summary),
    ]
    body = [sections.header(page, origin), *body, sections.limits(page)]
    title = f"layerdiff browser: {ref.path.name}" + (f" vs {port.path.name}" if port else "")
    return Browser(ref.path, port.path if port else None, summary, page.steps, page.step,
                   order, page.nonfinite, hist_sites, batch,
                   diff.verdict if diff is not None else None, origin, page.notes, page.norms,
                   sections.document(title, body))


def _plain(value: Any) -> float | None:
    """A number for JSON: NaN and Inf (no norm: not finite) become None."""
    number = float(value)
    return number if math.isfinite(number) else None
