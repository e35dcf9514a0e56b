"""``check_determinism``: run a case several times, each in a fresh process, and compare the
traces bit for bit.

A fresh process per run, as between real runs: Python's hash seed (unless ``PYTHONHASHSEED`` is
set in the environment), the memory allocator's state, addresses and thread pools all start
anew, so an order that follows a ``set`` of strings, a buffer that is read before it is written,
or a reduction whose order follows thread timing shows up as a difference. Each run is captured
into its own trace (``layerdiff.capture`` in a child Python); the traces are then compared
record by record in recording order, by the digest every record carries in the index (tensor
data is read only where a record has no digest). The first record that differs is ``first``;
the whole diff of the two traces (:func:`layerdiff.diff`) then says whether that difference is
within tolerance (the rounding of another reduction order) or not, and where the runs first
differ by more than that.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

import layerdiff.errors as errors
from layerdiff.compare import Tolerances, diff
from layerdiff.compare import result as R
from layerdiff.compare.judge import PASSING
from layerdiff.compare.origins import Words
from layerdiff.compare.result import Column
from layerdiff.debug.origin import Record, find_origin, origin_json
from layerdiff.errors import CaptureError, CaseError, LayerdiffError
from layerdiff.outputs import make_folder, refuse_existing
from layerdiff.trace import Trace, open_trace

Progress = Callable[[int, int], None]  # (runs done, runs in all)
# What must agree for two records to be the same record (before their bytes are compared).
LAYOUT = ["step", "pass", "site", "role", "arg", "kind", "dtype", "shape"]
# Which record, whatever its place in the recording order.
KEY = ["step", "pass", "site", "role", "arg", "kind"]
DIFFERENT = Words(
    "different between runs", "the same in every run", "different",
    ("its initial weights differ between runs: the case's initialisation is not the same in "
     "every process (seed it)",
     "its weights differ between runs at the start of step {step} while every earlier step "
     "was the same: the optimizer step, gradient clipping or unscaling differs"))
_CHILD = ("import sys; from layerdiff.debug.determinism import run_child; "
          "sys.exit(run_child(sys.argv[1:]))")


class DeterminismVerdict(StrEnum):
    DETERMINISTIC = "deterministic"
    NONDETERMINISTIC = "nondeterministic"


class DifferenceKind(StrEnum):
    VALUES = "values"    # same record, other bytes
    LAYOUT = "layout"    # another record at that place: another site, shape or dtype, or none


@dataclass(frozen=True)
class RecordKey:
    """Which record: ``site``, ``step``, ``pass``, ``role`` (and the argument)."""

    site: str
    step: int
    pass_: str
    role: str
    arg: str

    @classmethod
    def of(cls, row: pd.Series | dict) -> RecordKey:
        return cls(str(row["site"]), int(row["step"]), str(row["pass"]), str(row["role"]),
                   str(row["arg"]))

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "step": self.step, "pass": self.pass_, "role": self.role,
                "arg": self.arg}

    def describe(self) -> str:
        arg = "" if self.arg == "0" else f" '{self.arg}'"
        return f"step {self.step}, {self.pass_} {self.role}{arg} of {self.site}"


@dataclass
class RunComparison:
    """One run against the first: where they first differ and by how much."""

    run: int                              # 2, 3, ... (the first run is 1)
    first: RecordKey | None
    position: int | None                  # the first's place in the first run's recording order
    how: str | None = None                # a DifferenceKind
    within_tolerance: bool | None = None  # of the first difference
    verdict: str | None = None            # the diff's verdict of that record
    max_abs: float | None = None
    ratio: float | None = None            # max |d| / (atol + rtol |ref|)
    tolerance: str = ""
    differing: int = 0                    # records whose bytes differ
    first_out: RecordKey | None = None    # the first record out of tolerance, if any
    note: str = ""
    # the site whose own code made the difference, by the diff's origin rule (None: the
    # case's inputs differ, or nothing does)
    origin: R.Origin | None = None

    def as_json(self) -> dict[str, Any]:
        return {"run": self.run, "first": self.first.as_json() if self.first else None,
                "how": self.how, "within_tolerance": self.within_tolerance,
                "verdict": self.verdict, "max_abs": _number(self.max_abs),
                "ratio": _number(self.ratio), "tolerance": self.tolerance,
                "differing": self.differing,
                "first_out": self.first_out.as_json() if self.first_out else None,
                "origin": origin_json(self.origin), "note": self.note}


@dataclass
class DeterminismResult:
    """Whether K runs of a case agree bit for bit; ``found`` when they do not."""

    case: str
    runs: int
    steps: int | None          # steps each run ran (the case's own unless asked)
    records: int               # records in the first run's trace
    comparisons: list[RunComparison]
    seconds: float
    hash_seed: str             # "random" (a new one per process) or the fixed value
    traces: list[str] = field(default_factory=list)   # kept traces, when a directory was given

    @property
    def _first(self) -> RunComparison | None:
        differing = [c for c in self.comparisons if c.first is not None]
        return min(differing, key=lambda c: c.position) if differing else None

    @property
    def found(self) -> bool:
        return self._first is not None

    @property
    def verdict(self) -> DeterminismVerdict:
        return (DeterminismVerdict.NONDETERMINISTIC if self.found
                else DeterminismVerdict.DETERMINISTIC)

    @property
    def first(self) -> RecordKey | None:
        first = self._first
        return first.first if first else None

    @property
    def within_tolerance(self) -> bool | None:
        first = self._first
        return first.within_tolerance if first else None

    @property
    def origin(self) -> R.Origin | None:
        """The origin of the run that differs first."""
        first = self._first
        return first.origin if first else None

    def as_json(self) -> dict[str, Any]:
        return {"case": self.case, "verdict": str(self.verdict), "found": self.found,
                "first": self.first.as_json() if self.first else None,
                "origin": origin_json(self.origin),
                "within_tolerance": self.within_tolerance, "runs": self.runs,
                "steps": self.steps, "records": self.records, "hash_seed": self.hash_seed,
                "comparisons": [c.as_json() for c in self.comparisons],
                "seconds": round(self.seconds, 3), "traces": list(self.traces)}


def check_determinism(case_spec: str, runs: int = 2, steps: int | None = None,
                      tolerances: str | os.PathLike | Tolerances | None = None,
                      progress: Progress | None = None, *,
                      keep: str | os.PathLike | None = None, force: bool = False,
                      parallel: bool = False) -> DeterminismResult:
    """Capture ``case_spec`` (``package.module:name``) ``runs`` times, each in a fresh Python
    process, and compare the traces bit for bit; see :class:`DeterminismResult`.

    ``steps`` overrides the case's step count; ``tolerances`` (a file or
    :class:`layerdiff.Tolerances`) judges whether a difference is within tolerance; ``progress``
    is called as ``progress(runs_done, runs)``. The traces go to a temporary directory, deleted
    afterwards, unless ``keep`` names a directory to write them to (:func:`kept_paths`); a run
    file already there raises :class:`OutputError` unless ``force`` (it may be what another
    check kept, and a failed run would leave runs of two checks side by side).
    ``parallel`` starts every run at once (faster for small cases; each run needs the case's
    memory, on the GPU too), instead of one after the other.
    """
    if runs < 2:
        raise CaptureError(f"--runs must be at least 2 to compare runs of {case_spec} "
                           f"(got {runs})")
    if steps is not None and steps < 1:
        raise CaptureError(f"--steps must be at least 1 (got {steps}) for case {case_spec}")
    tolerances = Tolerances.build(tolerances)  # a bad tolerance file fails before any run
    if keep is not None:
        for path in kept_paths(keep, runs):
            refuse_existing(path, "--keep", force)
    root = _import_root(case_spec)
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        if keep is None:
            directory = Path(stack.enter_context(
                tempfile.TemporaryDirectory(prefix="layerdiff-determinism-")))
        else:
            directory = make_folder(keep, "--keep")
        paths = kept_paths(directory, runs)
        if parallel:
            children = [_start(case_spec, path, steps, root) for path in paths]
            for run, child in enumerate(children):
                _finish(child, case_spec, run, runs)
                if progress is not None:
                    progress(run + 1, runs)
        else:
            for run, path in enumerate(paths):
                _finish(_start(case_spec, path, steps, root), case_spec, run, runs)
                if progress is not None:
                    progress(run + 1, runs)
        traces = [stack.enter_context(open_trace(path)) for path in paths]
        comparisons = [compare_runs(traces[0], trace, run + 2, tolerances)
                       for run, trace in enumerate(traces[1:])]
        records = len(traces[0].index)
        ran = traces[0].meta.get("steps", steps)
    return DeterminismResult(case_spec, runs, ran, records, comparisons,
                             time.perf_counter() - started,
                             os.environ.get("PYTHONHASHSEED", "random") or "random",
                             [str(p) for p in paths] if keep is not None else [])


def kept_paths(keep: str | os.PathLike, runs: int) -> list[Path]:
    """Where ``check_determinism(keep=...)`` keeps each run's trace: ``run1.h5``, ..."""
    return [Path(keep) / f"run{run + 1}.h5" for run in range(runs)]


def compare_runs(first: Trace, other: Trace, run: int,
                 tolerances: Tolerances | None = None) -> RunComparison:
    """Where ``other`` first differs from ``first``, in recording order, and by how much."""
    a, b = first.index, other.index
    common = min(len(a), len(b))
    layout = np.ones(common, dtype=bool)
    for column in LAYOUT:
        layout &= a[column].to_numpy()[:common] == b[column].to_numpy()[:common]
    layout_at = _first_false(layout)
    if layout_at is None and len(a) != len(b):
        layout_at = common
    same = _same_bytes(first, other, a.iloc[:common], b.iloc[:common]) & layout
    differing = int((~same).sum()) + abs(len(a) - len(b))
    values_at = _first_false(same)
    if layout_at is not None and (values_at is None or layout_at <= values_at):
        row = a.iloc[layout_at] if layout_at < len(a) else b.iloc[layout_at]
        other_row = b.iloc[layout_at] if layout_at < len(b) else None
        note = ("run 1 has no record there" if layout_at >= len(a) else
                f"run {run} has no record there" if other_row is None else
                f"run {run} records {RecordKey.of(other_row).describe()} "
                f"({other_row['dtype']} {other_row['shape']}) there")
        return RunComparison(run, RecordKey.of(row), layout_at, DifferenceKind.LAYOUT, False,
                             "layout", differing=differing, note=note,
                             origin=run_origin(first, other))
    if values_at is None:
        return RunComparison(run, None, None)
    key = RecordKey.of(a.iloc[values_at])
    comparison = RunComparison(run, key, values_at, DifferenceKind.VALUES,
                               differing=differing, origin=run_origin(first, other))
    _judge(comparison, first, other, key, tolerances)
    return comparison


def run_origin(first: Trace, other: Trace) -> R.Origin | None:
    """The site whose own code made ``other`` differ from ``first``, by the diff's origin rule
    over the records of ``first``, each off when ``other`` has no record of that name with the
    same dtype, shape and bytes."""
    a, b = first.index, other.index
    where = {key: j for j, key in enumerate(zip(*(b[c] for c in KEY), strict=True))}
    at = np.array([where.get(key, -1) for key in zip(*(a[c] for c in KEY), strict=True)],
                  dtype=np.int64)
    found = np.flatnonzero(at >= 0)
    same = np.zeros(len(a), dtype=bool)
    ours, theirs = a.iloc[found], b.iloc[at[found]]
    agree = ((ours["dtype"].to_numpy() == theirs["dtype"].to_numpy())
             & (ours["shape"].to_numpy() == theirs["shape"].to_numpy()))
    same[found] = _same_bytes(first, other, ours, theirs) & agree
    records = [Record(int(step), str(pass_), int(seq), str(site), str(role), str(arg),
                      not ok, str(dtype))
               for step, pass_, seq, site, role, arg, dtype, ok in zip(
                   a["step"], a["pass"], a["seq"], a["site"], a["role"], a["arg"], a["dtype"],
                   same, strict=True)]
    return find_origin(records, first.sites, DIFFERENT)


def _judge(comparison: RunComparison, first: Trace, other: Trace, key: RecordKey,
           tolerances: Tolerances | None) -> None:
    """The diff of the two runs: the verdict of the first difference, the first out."""
    rows = diff(first, other, tolerances=tolerances).rows
    match = rows[(rows[Column.STEP] == key.step) & (rows[Column.SITE] == key.site)
                 & (rows[Column.ROLE] == key.role) & (rows[Column.ARG] == key.arg)
                 & (rows[Column.PASS] == key.pass_)]
    if not match.empty:
        row = match.iloc[0]
        comparison.verdict = str(row[Column.VERDICT])
        comparison.within_tolerance = row[Column.VERDICT] in PASSING
        comparison.max_abs = _float(row[Column.MAX_ABS])
        comparison.ratio = _float(row[Column.RATIO])
        comparison.tolerance = f"rtol={row['rtol']:g} atol={row['atol']:g}, {row['tol_source']}"
    out = rows[~rows[Column.VERDICT].isin(PASSING)]
    if not out.empty:
        comparison.first_out = RecordKey.of(out.iloc[0])


def _same_bytes(first: Trace, other: Trace, a: pd.DataFrame, b: pd.DataFrame) -> np.ndarray:
    """Per record: the same digest (or, for a plain value, the same JSON). A record without a
    digest on either side is compared by its data."""
    digest_a, digest_b = a["digest"].to_numpy(), b["digest"].to_numpy()
    if first.digest_algorithm != other.digest_algorithm:  # two definitions: read the bytes
        digest_a = digest_b = np.full(len(a), "", dtype=object)
    same = (digest_a == digest_b) & (a["value"].to_numpy() == b["value"].to_numpy())
    tensor = (a["kind"] == "tensor").to_numpy() & (b["kind"] == "tensor").to_numpy()
    for i in np.flatnonzero(tensor & ((digest_a == "") | (digest_b == ""))):
        same[i] = _read_bytes(first, a.iloc[i]) == _read_bytes(other, b.iloc[i])
    return same


def _read_bytes(trace: Trace, row: pd.Series) -> bytes:
    if row["segment"] < 0:  # no data (a summary trace): its statistics are all there is
        return repr([row[c] for c in ("min", "max", "mean", "std", "l2", "nan", "inf")]).encode()
    return trace.read(row, raw=True).tobytes()


def _first_false(flags: np.ndarray) -> int | None:
    where = np.flatnonzero(~flags)
    return int(where[0]) if where.size else None


# ---- the runs ----

def _import_root(spec: str) -> str | None:
    """The directory the child must import the case's module from, found without running it;
    a spec that cannot import is refused here, before any run."""
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise CaseError(f"case spec {spec!r} is not of the form package.module:name; for "
                        "example reference_models.transformer:reference")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # as load_case does
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        found, reason = None, f" ({exc})"
    else:
        reason = ""
    if found is None or found.origin is None:
        raise CaseError(f"case spec {spec!r}: module {module!r} does not import{reason}; check "
                        "the spelling and that it is on PYTHONPATH")
    origin = Path(found.origin).resolve()
    depth = module.count(".") + (1 if origin.name == "__init__.py" else 0)
    return str(origin.parents[depth])


def _start(spec: str, path: Path, steps: int | None, root: str | None) -> subprocess.Popen:
    """A fresh Python that captures the case into ``path``."""
    env = dict(os.environ)
    if root:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    command = [sys.executable, "-c", _CHILD, spec, str(path), "" if steps is None else str(steps)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)


def _finish(child: subprocess.Popen, spec: str, run: int, runs: int) -> None:
    """Wait for a run; its error, if any, as the error it was (a CaseError stays one)."""
    _, stderr = child.communicate()
    if child.returncode == 0:
        return
    lines = stderr.strip().splitlines()
    try:
        error = json.loads(lines[-1]) if lines else {}
    except json.JSONDecodeError:
        error = {}
    if isinstance(error, dict) and "message" in error:
        kind = getattr(errors, str(error.get("error")), CaptureError)
        kind = kind if isinstance(kind, type) and issubclass(kind, LayerdiffError) else (
            CaptureError)
        raise kind(f"run {run + 1} of {runs} (a fresh process): {error['message']}")
    last = lines[-1] if lines else "no message"
    raise CaptureError(f"case {spec}: run {run + 1} of {runs} (a fresh Python process) "
                       f"failed with exit code {child.returncode}: {last}; run `layerdiff "
                       f"capture {spec} -o run.h5` to see the whole error")


def run_child(argv: list[str]) -> int:
    """The fresh process: capture the case; a LayerdiffError comes back as one JSON line."""
    spec, output, steps = argv
    try:
        from layerdiff.capture import capture
        from layerdiff.case import load_case

        capture(load_case(spec), output, steps=int(steps) if steps else None)
    except LayerdiffError as exc:
        print(json.dumps({"error": type(exc).__name__, "message": str(exc)}), file=sys.stderr)
        return 2
    return 0


def _float(value: Any) -> float | None:
    if value is None:
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _number(value: float | None) -> float | str | None:
    if value is None or math.isnan(value):
        return None
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return value


__all__ = ["DeterminismResult", "DeterminismVerdict", "DifferenceKind", "RecordKey",
           "RunComparison", "check_determinism", "compare_runs"]
