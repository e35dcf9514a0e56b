"""How far apart the statistics' paths are, over the property tests' tensors (issue 28).

Draws tensors as tests/test_stats_range.py does (every dtype, magnitudes from the smallest
subnormal to the largest finite value, specials, the writer's packing, a reader's chunk cuts)
and prints, per path, the worst disagreement of mean (relative to the values' root mean
square) and l2 (relative) with compute_stats and with the exact value (rational arithmetic),
also as a multiple of n 2**-53 (stats.py's bound is 2 gamma_n, about 2 n 2**-53).

    PYTHONPATH=. python scripts/stats_agreement.py [EXAMPLES]
"""

from __future__ import annotations

import math
import os
import sys
from fractions import Fraction

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerdiff.trace import stats
from layerdiff.trace.verify import RecordCheck
from tests.test_stats_range import FLOATS, _finite_values, tensors, writer_paths

HALF_GRID = Fraction(1, 2**1075)  # a float64 result rounds by up to this however it is summed


def _verifier(raw: np.ndarray, row: dict, cuts: list[int], numpy_path: bool) -> tuple[float, float]:
    """(mean, l2) as a verifying reader folds them from ``raw`` cut at ``cuts``."""
    with_env = {"LAYERDIFF_STATS": "numpy"} if numpy_path else {}
    saved = os.environ.pop("LAYERDIFF_STATS", None)
    os.environ.update(with_env)
    stats.compiled.cache_clear()
    try:
        check = RecordCheck(row, "t.h5")
        for piece in np.split(raw.reshape(-1), cuts):
            check.update(piece.view(np.uint8))
    finally:
        os.environ.pop("LAYERDIFF_STATS", None)
        if saved is not None:
            os.environ["LAYERDIFF_STATS"] = saved
        stats.compiled.cache_clear()
    total, squares, k = check._sums
    return total / check._finite * stats.scale_of(k), math.sqrt(squares) * stats.scale_of(k)


def main(examples: int) -> None:
    worst: dict[tuple[str, str], tuple[float, float]] = {}

    def note(what: str, path: str, value: float, n: int) -> None:
        old = worst.get((what, path), (0.0, 0.0))
        worst[(what, path)] = (max(old[0], value), max(old[1], value / (n * 2.0**-53)))

    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(tensor=tensors(), cuts=st.lists(st.integers(0, 5000), max_size=4), data=st.data())
    def measure(tensor, cuts, data):
        dtype, raw = tensor
        found = writer_paths(raw, dtype, data.draw(tensors(dtypes=(dtype,)))[1])
        values = _finite_values(raw, dtype)
        largest = float(np.abs(values).max()) if values.size else 0.0
        if not largest:
            return
        n = raw.size
        exact = [Fraction(float(v)) for v in values]
        mean_exact = sum(exact) / len(exact)
        squares_exact = sum(f * f for f in exact) / Fraction(largest) ** 2
        l2_exact = math.sqrt(squares_exact) * largest
        rms = largest * math.sqrt(squares_exact / len(exact))
        paths = {name: (s.mean, s.l2) for name, s in found.items()}
        if dtype in FLOATS:  # a reader checks the statistics of float records only
            row = dict(found["compute_stats"]._asdict(), site="a#0", role="output", arg="0",
                       step=0, dtype=dtype, numel=n)
            cuts = sorted({c % n for c in cuts})
            paths["verify-kernel"] = _verifier(raw, row, cuts, numpy_path=False)
            paths["verify-numpy"] = _verifier(raw, row, cuts, numpy_path=True)
        ref_mean, ref_l2 = paths["compute_stats"]
        for path, (mean, l2) in paths.items():
            if math.isfinite(mean):
                off = max(Fraction(0), abs(Fraction(mean) - mean_exact) - HALF_GRID)
                note("mean/rms vs exact", path, float(off / Fraction(rms)), n)
                if path != "compute_stats" and math.isfinite(ref_mean):
                    note("mean/rms vs compute_stats", path, abs(mean - ref_mean) / rms, n)
            if math.isfinite(l2) and math.isfinite(l2_exact) and l2 > 0:
                note("l2 rel vs exact", path, abs(l2 / l2_exact - 1), n)
                if path != "compute_stats" and math.isfinite(ref_l2):
                    note("l2 rel vs compute_stats", path, abs(l2 / ref_l2 - 1), n)

    measure()
    for (what, path), (value, ratio) in sorted(worst.items()):
        print(f"{what:26s} {path:18s} worst {value:.3e} = {ratio:.3f} x n 2**-53")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 2000)
