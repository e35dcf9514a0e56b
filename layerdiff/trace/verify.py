"""Checking what is read against what the index says of it: the digest and the statistics.

The index carries, per tensor, an xxh3 digest of its bytes and its statistics (min, max, mean,
std, L2 norm, NaN and Inf counts). A reader that trusts the data without checking passes a file
whose bytes were flipped on disk or edited; one that trusts the statistics without checking
judges summaries that describe other numbers. :class:`RecordCheck` is fed a record's bytes in
order (whole, or chunk by chunk as the diff streams them) and raises :class:`TraceError` naming
the file, the record and what disagrees.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np
import xxhash

from layerdiff.errors import TraceError
from layerdiff.trace import schema
from layerdiff.trace.stats import as_float, sum_squares

# Statistics are sums: the writer's order of summation and this check's differ by rounding
# only, far below this. A damaged value is off by far more. Traces written before the sum of
# squares was summed in blocks carry a float32 dot's error, up to ~n * 2**-30 relative.
_SUM_RTOL = 1e-3


def _sum_rtol(count: int) -> float:
    return _SUM_RTOL + count * 2.0**-30
_CHECKED_KINDS = "f"  # statistics of float data are checked; other dtypes by digest alone


def describe(row: Mapping[str, Any]) -> str:
    """How an error names a record: ``site role arg (step N)``."""
    return f"{row['site']} {row['role']} {row['arg']} (step {int(row['step'])})"


class RecordCheck:
    """Digest and statistics of one record's bytes, fed in order; ``finish`` judges them."""

    def __init__(self, row: Mapping[str, Any], path: str, *, statistics: bool = True) -> None:
        self.row, self.path = row, path
        self._hash = xxhash.xxh3_64() if row["digest"] else None
        dtype = row["dtype"]
        self._stats = statistics and (dtype == "bfloat16"
                                      or schema.numpy_dtype(dtype).kind in _CHECKED_KINDS)
        self._min, self._max = math.inf, -math.inf
        self._sum = self._squares = 0.0
        self._nan = self._inf = self._finite = 0

    def update(self, raw: np.ndarray) -> None:
        """The next bytes of the record (a whole number of elements, uint8)."""
        if self._hash is not None:
            self._hash.update(raw.data if raw.flags.c_contiguous else raw.tobytes())
        if self._stats and raw.size:
            self._add(as_float(raw.view(schema.numpy_dtype(self.row["dtype"])),
                               self.row["dtype"]))

    def _add(self, values: np.ndarray) -> None:
        lo, hi = values.min(), values.max()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            nan = np.isnan(values)
            inf = np.isinf(values)
            nans = int(np.count_nonzero(nan))
            self._nan += nans
            self._inf += int(np.count_nonzero(inf))
            if nans < values.size:
                lo, hi = np.nanmin(values), np.nanmax(values)
            values = values[~(nan | inf)]
        self._min, self._max = min(self._min, float(lo)), max(self._max, float(hi))
        if values.size:
            self._finite += values.size
            self._sum += float(values.sum(dtype=np.float64))
            self._squares += sum_squares(values)

    def finish(self) -> None:
        """Raise TraceError when the bytes fed do not match the index row."""
        if self._hash is not None and self._hash.hexdigest() != self.row["digest"]:
            raise TraceError(f"{self.path}: the data of {describe(self.row)} does not match its "
                             "digest in the index: the file was damaged or edited after "
                             "capture; capture it again (--no-verify reads it anyway)")
        if self._stats:
            wrong = self._disagreement()
            if wrong:
                raise TraceError(f"{self.path}: the index statistics of {describe(self.row)} do "
                                 f"not describe its data ({wrong}): the index was damaged or "
                                 "edited; capture it again (--no-verify reads it anyway)")

    def _disagreement(self) -> str:
        """The first statistic the index gets wrong, as 'index says ..., data has ...'."""
        row = self.row
        counts = (("nan", self._nan), ("inf", self._inf))
        for name, value in counts:
            if int(row[name]) != value:
                return f"{name} count: index says {int(row[name])}, data has {value}"
        if not self._finite:
            return ""
        mean = self._sum / self._finite
        mean_square = self._squares / self._finite
        rms = math.sqrt(mean_square)
        std = math.sqrt(max(mean_square - mean * mean, 0.0))
        rtol = _sum_rtol(self._finite + self._nan + self._inf)
        loose = rtol * rms + 1e-30  # mean and std: relative to the values' size
        checks = [("min", self._min, 0.0), ("max", self._max, 0.0), ("mean", mean, loose)]
        if not (self._nan or self._inf):  # else the index's norm is NaN or Inf by definition
            l2 = math.sqrt(self._squares)
            checks.append(("l2", l2, rtol * l2 + 1e-30))
        for name, value, slack in checks:
            claimed = float(row[name])
            if not (claimed == value or abs(claimed - value) <= slack):  # NaN: never within
                return f"{name}: index says {claimed:.9g}, data has {value:.9g}"
        claimed = float(row["std"])
        # compared as variances: a rounding of the sum of squares moves the variance by the
        # same amount whatever the spread, so the slack is a fraction of the mean square
        if not abs(claimed * claimed - std * std) <= rtol * mean_square + 1e-30:
            return f"std: index says {claimed:.9g}, data has {std:.9g}"
        return ""


def check_bytes(raw: np.ndarray, row: Mapping[str, Any], path: str) -> None:
    """Check one whole record's bytes against its index row (raises TraceError)."""
    check = RecordCheck(row, path)
    check.update(raw.reshape(-1).view(np.uint8))
    check.finish()
