"""Calibration: measure a case's noise floor per site and write tolerances with a margin.

The case runs K times as it is and once in float64. Records that differ between the float32
runs are not deterministic (the first in execution order is where nondeterminism enters); the
float32 runs' distance from the float64 run is the rounding noise each site has accumulated.
Each site gets ``margin`` times the larger of the two as its tolerance, never less than the
dtype default, in a tolerance file that says where every number came from.
"""

from __future__ import annotations

import math
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from layerdiff.compare import diff
from layerdiff.compare.judge import UNCHANGED
from layerdiff.compare.result import Column
from layerdiff.compare.tolerances import default_tolerance
from layerdiff.outputs import write_text


@dataclass
class Calibration:
    runs: int
    margin: float
    nondeterministic: list[str] = field(default_factory=list)  # sites, in execution order
    float64: str = ""            # why the float64 run is missing, when it is
    floor: pd.DataFrame = field(default_factory=pd.DataFrame)  # site, role, abs, rel noise

    @property
    def first_nondeterministic(self) -> str | None:
        return self.nondeterministic[0] if self.nondeterministic else None


def calibrate(case_spec: str, output: str | os.PathLike, *, runs: int = 3,
              margin: float = 10.0, steps: int | None = None,
              loss_scale: float = 1.0) -> Calibration:
    """Run ``case_spec`` ``runs`` times and once in float64 (with the golden's ``steps`` and
    ``loss_scale``); write the tolerance file."""
    from layerdiff.capture import capture as capture_trace
    from layerdiff.case import load_case
    from layerdiff.errors import CaptureError

    if runs < 2:
        raise CaptureError(f"--calibrate needs at least 2 runs to see run-to-run noise "
                           f"(got {runs})")
    if not (isinstance(margin, (int, float)) and math.isfinite(margin) and margin > 0):
        raise CaptureError(f"--margin must be a finite number above 0, such as 10 (got "
                           f"{margin!r}): it multiplies the noise into each tolerance")

    def capture(case, path):
        return capture_trace(case, path, steps=steps, loss_scale=loss_scale)

    result = Calibration(runs, margin)
    frames = []
    with tempfile.TemporaryDirectory(prefix="layerdiff-calibrate-") as tmp:
        paths = [capture(load_case(case_spec), Path(tmp) / f"run{i}.h5") for i in range(runs)]
        for other in paths[1:]:
            rows = diff(paths[0], other).rows
            frames.append(rows)
            changed = rows[~rows[Column.VERDICT].isin(UNCHANGED)].sort_values(Column.SEQ)
            for site in changed[Column.SITE]:
                if site not in result.nondeterministic:
                    result.nondeterministic.append(site)
        try:
            case64 = _in_float64(load_case(case_spec))
            frames.append(diff(capture(case64, Path(tmp) / "float64.h5"), paths[0]).rows)
        except Exception as exc:  # calibration goes on with the run-to-run noise alone
            result.float64 = f"{type(exc).__name__}: {exc}"
    noise = pd.concat(frames, ignore_index=True)
    noise = noise[noise[Column.DTYPE].str.startswith("float")
                  | noise[Column.PORT_DTYPE].str.startswith("float")]
    result.floor = noise.groupby([Column.SITE, Column.ROLE], sort=False).agg(
        abs_noise=(Column.MAX_ABS, "max"), rel_noise=(Column.MAX_REL, "max"),
        dtype=(Column.PORT_DTYPE, "first")).reset_index()
    _write(result, Path(output), case_spec)
    return result


def _in_float64(case):
    """The case with its model and floating inputs in float64."""
    import torch

    case.model.double()

    def convert(value):
        if torch.is_tensor(value) and value.is_floating_point():
            return value.double()
        return value

    if isinstance(case.inputs, dict):
        case.inputs = {k: convert(v) for k, v in case.inputs.items()}
    else:
        case.inputs = tuple(convert(v) for v in case.inputs)
    loss_fn = case.loss_fn
    case.loss_fn = lambda output: loss_fn(output).double()
    return case


def _write(result: Calibration, path: Path, case_spec: str) -> None:
    lines = [f"# Calibrated for {case_spec}: {result.runs} runs and one in float64; every",
             f"# tolerance is {result.margin:g}x the noise seen at its site, at least the",
             "# dtype default. Regenerate with layerdiff golden --calibrate.",
             "version = 1", ""]
    if result.float64:
        lines.insert(3, f"# The float64 run failed ({result.float64}): run-to-run noise only.")
    for row in result.floor.itertuples(index=False):
        default = default_tolerance(row.dtype)
        atol = max(default.atol, result.margin * float(np.nan_to_num(row.abs_noise)))
        rtol = max(default.rtol, result.margin * min(float(np.nan_to_num(row.rel_noise)), 1.0))
        if (rtol, atol) == (default.rtol, default.atol):
            continue
        lines += ["[[rule]]", f'site = "{row.site}"', f'role = "{row.role}"',
                  f"rtol = {rtol:.3g}", f"atol = {atol:.3g}",
                  f'why = "noise {row.abs_noise:.2g} abs, {row.rel_noise:.2g} rel, x '
                  f'{result.margin:g}"', ""]
    write_text(path, "\n".join(lines) + "\n")
