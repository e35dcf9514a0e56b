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
import sys
from collections.abc import Mapping
from types import ModuleType
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.trace import digest, schema, stats
from layerdiff.trace.digest import DIGEST_NAME
from layerdiff.trace.stats import as_float, bounds_and_counts, fold_sums, scale_of, scaled_sums

# Statistics are sums: the writer's order of summation and this check's differ by rounding
# only, at most 2 gamma_n (n 2**-52) relative, far below this (stats.py, "scaled sums", has
# the bound). A damaged value is off by far more. Traces written before the sum of squares was
# summed in blocks carry a float32 dot's error, up to ~n * 2**-30 relative.
_SUM_RTOL = 1e-3
_MAX = float(np.finfo(np.float64).max)
# sqrt of float64's largest value, less a rounding: squares of values at or above overflow
_ROOT_MAX = math.sqrt(_MAX) * (1 - 1e-9)


def _sum_rtol(count: int) -> float:
    return _SUM_RTOL + count * 2.0**-30


def _squares_floor(dtype: str) -> float:
    """Absolute error per element, unscaled, in a sum of squares that older writers made:
    they squared float64 values unscaled, where a square below 2**-1022 is subnormal and off
    by up to 2**-1075. (Their numpy path squared float32 in float32, but it ran only without
    numba, a required dependency, or for tensors over half the staging ring: not allowed for,
    so that an edited L2 norm of vanishing gradients is still seen.)"""
    return 2.0**-1074 if dtype == "float64" else 0.0


_CHECKED_KINDS = "f"  # statistics of float data are checked; other dtypes by digest alone

# The compiled statistics (trace/stats_kernel.py) are loaded by the first record of at least
# this many elements, as the diff's metric kernel is: numba's import and cache load (~0.5 s
# once per process) would cost more than numpy's passes over a few small records. Once
# loaded, they serve every record.
KERNEL_MIN_NUMEL = 1 << 20
_KERNEL_ITEMSIZE = {"float16": 2, "bfloat16": 2, "float32": 4, "float64": 8}


def _compiled(dtype: str, numel: int) -> ModuleType | None:
    """The compiled statistics module for a record of ``dtype`` and ``numel`` elements, or
    None for the numpy path (numba missing, LAYERDIFF_STATS=numpy, a dtype it lacks, or a
    small record in a process that has not loaded it)."""
    if dtype not in _KERNEL_ITEMSIZE:
        return None
    if numel < KERNEL_MIN_NUMEL and not stats.compiled_loaded():
        return None
    return stats.compiled()


def _digest_kernel(nbytes: int) -> ModuleType | None:
    """The compiled digest for a record of ``nbytes``: when the compiled statistics are
    loaded, or numba is (the diff's metric kernel loaded it: the statistics module then
    loads in milliseconds) and the record is large enough to pay for it; else numpy's."""
    if stats.compiled_loaded():
        return stats.compiled()
    if nbytes >= digest.KERNEL_MIN_BYTES and "numba" in sys.modules:
        return stats.compiled()
    return None


def describe(row: Mapping[str, Any]) -> str:
    """How an error names a record: ``site role arg (step N)``."""
    return f"{row['site']} {row['role']} {row['arg']} (step {int(row['step'])})"


class RecordCheck:
    """Digest and statistics of one record's bytes, fed in order; ``finish`` judges them."""

    def __init__(self, row: Mapping[str, Any], path: str, *, statistics: bool = True,
                 algorithm: str = DIGEST_NAME, digest_kernel: Any = None) -> None:
        self.row, self.path = row, path
        kernel = digest_kernel or _digest_kernel(int(row.get("nbytes", 0)))
        self._hash = digest.hasher(algorithm, kernel) if row["digest"] else None
        dtype = row["dtype"]
        self._stats = statistics and (dtype == "bfloat16"
                                      or schema.numpy_dtype(dtype).kind in _CHECKED_KINDS)
        self._min, self._max = math.inf, -math.inf
        self._sums = (0.0, 0.0, 0)  # (total, squares, k): stats.py's "scaled sums"
        self._nan = self._inf = self._finite = 0
        self._kernel = _compiled(dtype, int(row.get("numel", 0))) if self._stats else None
        self._table = (stats.half_table(dtype) if self._kernel is not None
                       and _KERNEL_ITEMSIZE[dtype] == 2 else None)

    def update(self, raw: np.ndarray) -> None:
        """The next bytes of the record (a whole number of elements, uint8)."""
        if self._hash is not None:
            self._hash.update(raw)
        if not (self._stats and raw.size):
            return
        if self._kernel is not None:
            item = _KERNEL_ITEMSIZE[self.row["dtype"]]
            self._fold(raw.size // item, *self._kernel.chunk_stats(
                np.ascontiguousarray(raw), item, self._table))
        else:
            self._add(as_float(raw.view(schema.numpy_dtype(self.row["dtype"])),
                               self.row["dtype"]))

    def _fold(self, count: int, lo: float, hi: float, total: float, squares: float, nan: int,
              inf: int, k: int) -> None:
        """One chunk's compiled statistics, folded as _add folds numpy's: min and max over
        the values that are not NaN, sums and the finite count over the finite ones."""
        self._nan += nan
        self._inf += inf
        if not math.isnan(lo):  # a chunk of nothing but NaN leaves the bounds alone
            self._min, self._max = min(self._min, lo), max(self._max, hi)
        finite = count - nan - inf
        if finite:
            self._finite += finite
            self._sums = fold_sums(self._sums, (total, squares, k))

    def _add(self, values: np.ndarray) -> None:
        """One chunk's statistics in numpy: the reference, and the path without numba."""
        lo, hi = values.min(), values.max()
        if not (math.isfinite(lo) and math.isfinite(hi)):
            lo, hi, nan, inf, values = bounds_and_counts(values)
            self._nan += nan
            self._inf += inf
        if not math.isnan(lo):  # a chunk of nothing but NaN leaves the bounds alone
            self._min, self._max = min(self._min, float(lo)), max(self._max, float(hi))
        if values.size:
            self._finite += values.size
            self._sums = fold_sums(self._sums, scaled_sums(values))

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
        """The first statistic the index gets wrong, as 'index says ..., data has ...'.

        Mean, std and l2 are compared in the scaled domain of the data's sums (the index's
        values times the same power of two, exact), so values near float64's largest or
        smallest compare as any other. The slack is the summations' own error (see
        _SUM_RTOL) plus, on squares, the absolute error of older writers' squares.
        """
        row = self.row
        counts = (("nan", self._nan), ("inf", self._inf))
        for name, value in counts:
            if int(row[name]) != value:
                return f"{name} count: index says {int(row[name])}, data has {value}"
        if not self._finite:
            return ""
        for name, value in (("min", self._min), ("max", self._max)):
            claimed = float(row[name])
            if claimed != value:  # NaN: never equal
                return f"{name}: index says {claimed:.9g}, data has {value:.9g}"
        total, squares, k = self._sums
        scale = scale_of(k)
        unscale = 1.0 / scale  # a power of two: exact
        count = self._finite
        mean = total / count
        mean_square = squares / count
        l2 = math.sqrt(squares)
        rtol = _sum_rtol(count + self._nan + self._inf)
        # the absolute error of squares: older writers' (unscaled, then scaled as these sums
        # are; left to right, so that 2**1200 is never formed), and scaled values' below 2**-1022
        floor = count * _squares_floor(row["dtype"]) * unscale * unscale + count * 2.0**-1074
        # Older writers summed float64 values unscaled: where the squares overflow (true L2
        # above sqrt(max)), their mean, std and l2 came out inf or NaN. Newer ones give a
        # finite mean and std, and an infinite l2 only where it is beyond float64's range.
        legacy_overflow = l2 * scale >= math.sqrt(_MAX) * (1 - rtol)
        # a mean's sums never lose digits to underflow (a sum of subnormals is exact), but
        # scaled values below 2**-1022 may: 2**-1075 each, at most that on the mean; and the
        # index's values were rounded onto float64's grid, 2**-1075 apart at the least
        grid = 2.0**-1074 * unscale
        claimed = float(row["mean"])
        if math.isfinite(claimed):
            slack = rtol * math.sqrt(mean_square) + 2.0**-1074 + grid
            if not abs(claimed * unscale - mean) <= slack:
                return f"mean: index says {claimed:.9g}, data has {mean * scale:.9g}"
        elif not legacy_overflow:
            return f"mean: index says {claimed:.9g}, data has {mean * scale:.9g}"
        # l2 and std compared as squares: a rounding of the sum of squares moves the variance
        # by the same amount whatever the spread, so the slack is a fraction of the squares
        std = math.sqrt(max(mean_square - mean * mean, 0.0))
        # (an l2 within rtol is a square within 2 rtol; a variance within rtol of the mean
        # square, as before)
        compared = [("std", std, count, 1, float(row["std"]))]
        if not (self._nan or self._inf):  # else the index's norm is NaN or Inf by definition
            compared.append(("l2", l2, 1, 2, float(row["l2"])))
        for name, value, per, times, claimed in compared:
            if math.isfinite(claimed):
                claimed_s = claimed * unscale
                slack = (times * rtol * squares + floor) / per + (2 * value + grid) * grid
                if abs(claimed_s * claimed_s - value * value) <= slack:
                    continue
            elif legacy_overflow or (name == "l2" and claimed == math.inf
                                     and l2 * (1 + rtol) * scale >= _MAX):
                continue  # an L2 norm beyond float64's range is stored as inf
            return f"{name}: index says {claimed:.9g}, data has {value * scale:.9g}"
        return ""


def check_bytes(raw: np.ndarray, row: Mapping[str, Any], path: str, *,
                statistics: bool = True, algorithm: str = DIGEST_NAME,
                digest_kernel: Any = None) -> None:
    """Check one whole record's bytes against its index row (raises TraceError);
    ``digest_kernel``: a compiled digest to use (one with ``fold_lanes``), else the rule of
    :func:`_digest_kernel`."""
    check = RecordCheck(row, path, statistics=statistics, algorithm=algorithm,
                        digest_kernel=digest_kernel)
    check.update(raw.reshape(-1).view(np.uint8))
    check.finish()


# ---------------------------------------------------------------------------- the tables

def _first(frame: pd.DataFrame, bad: np.ndarray | pd.Series) -> pd.Series | None:
    bad = np.asarray(bad, dtype=bool)
    return frame.iloc[int(np.argmax(bad))] if bad.any() else None


def _where(row: pd.Series) -> str:
    return f"row {int(row.name)} ({str(row.get('site', '?'))[:60]})"


def check_index(index: pd.DataFrame, path: str) -> None:
    """Refuse an index whose rows cannot describe a tensor (raises TraceError): unknown kinds,
    roles, passes or dtypes; shapes and site names that do not parse; sizes that disagree
    with the shape or are absurd; negative counts; statistics that contradict each other.

    Every later reader (show, the diff, replay) trusts these: a row that passes here cannot
    make them allocate without bound, divide by zero or index out of range.
    """
    def refuse(row: pd.Series, what: str) -> None:
        raise TraceError(f"{path}: index {_where(row)} {what}; the file is damaged or was "
                         "not written by a layerdiff trace writer; capture it again")

    for column, allowed in (("kind", schema.KINDS), ("role", schema.ROLES),
                            ("pass", schema.PASSES)):
        row = _first(index, ~index[column].isin(allowed))
        if row is not None:
            refuse(row, f"has {column} {str(row[column])[:40]!r}, not one of "
                        f"{', '.join(map(str, allowed))}")
    expected_pass = index["role"].map(schema.ROLE_PASS).astype(str)
    row = _first(index, expected_pass.to_numpy() != index["pass"].to_numpy())
    if row is not None:
        refuse(row, f"puts role {row['role']} in the {row['pass']} pass")
    row = _first(index, ~index["site"].str.fullmatch(schema.SITE_PATTERN, na=False))
    if row is not None:
        refuse(row, f"has site {str(row['site'])[:40]!r}, not module#call")
    for column in ("seq", "step"):
        row = _first(index, index[column].to_numpy() < 0)
        if row is not None:
            refuse(row, f"has a negative {column} ({int(row[column])})")
    row = _first(index, index["seq"].duplicated().to_numpy())
    if row is not None:
        refuse(row, f"repeats seq {int(row['seq'])}")
    values = index[index["kind"] == "value"]  # a value's JSON text, never empty; no data
    row = _first(values, (values["value"].to_numpy() == "") | (values["segment"].to_numpy() != -1))
    if row is not None:
        refuse(row, "is a value record with no value text or with tensor data")
    tensors = index[index["kind"] == "tensor"]
    row = _first(tensors, tensors["value"].to_numpy() != "")
    if row is not None:
        refuse(row, "is a tensor with a value in the value column")
    if not tensors.empty:
        _check_tensor_rows(tensors, refuse)


def _check_tensor_rows(tensors: pd.DataFrame, refuse) -> None:
    row = _first(tensors, ~tensors["dtype"].map(schema.known_dtype).astype(bool))
    if row is not None:
        refuse(row, f"has dtype {str(row['dtype'])[:40]!r}, which no tensor has")
    row = _first(tensors, ~tensors["shape"].str.fullmatch(schema.SHAPE_PATTERN, na=False))
    if row is not None:
        refuse(row, f"has shape {str(row['shape'])[:40]!r}, not comma-separated sizes")
    # sizes in Python integers: a product of 64 sizes overflows int64 silently
    numel = [math.prod(schema.parse_shape(s)) for s in tensors["shape"]]
    too_big = np.array([n > schema.MAX_NUMEL for n in numel], dtype=bool)
    row = _first(tensors, too_big)
    if row is not None:
        refuse(row, f"claims shape ({row['shape']}), {numel[int(np.argmax(too_big))]:.3g} "
                    "elements, more than any tensor a trace can hold")
    numel = np.array(numel, dtype=np.int64)
    row = _first(tensors, tensors["numel"].to_numpy() != numel)
    if row is not None:
        refuse(row, f"says numel {int(row['numel'])} for shape ({row['shape']})")
    sizes = np.array([schema.numpy_dtype(d).itemsize for d in tensors["dtype"]], np.int64)
    stored = tensors["segment"].to_numpy() >= 0
    wrong = stored & (tensors["nbytes"].to_numpy() != numel * sizes)
    row = _first(tensors, wrong)
    if row is not None:
        refuse(row, f"says {int(row['nbytes'])} bytes for {int(row['numel'])} "
                    f"{row['dtype']} elements")
    row = _first(tensors, (tensors["segment"].to_numpy() < -1)
                 | (stored & (tensors["offset"].to_numpy() < 0)))
    if row is not None:
        refuse(row, f"points at segment {int(row['segment'])} offset {int(row['offset'])}")
    for column in ("nan", "inf"):
        counts = tensors[column].to_numpy()
        row = _first(tensors, (counts < 0) | (counts > numel))
        if row is not None:
            refuse(row, f"counts {int(row[column])} {column} values in {int(row['numel'])} "
                        "elements")
    digests = tensors["digest"]
    row = _first(tensors, ~(digests.eq("") | digests.str.fullmatch("[0-9a-f]{16}", na=False)))
    if row is not None:
        refuse(row, f"has digest {str(row['digest'])[:20]!r}, not 16 hex digits")
    _check_statistics(tensors, refuse)


def _check_statistics(tensors: pd.DataFrame, refuse) -> None:
    """Statistics that contradict each other (min above max, a negative norm, a non-finite
    value where every element is finite and none could overflow, a NaN where none is): checked
    here because a summary trace has no data to check them against.

    Where every element is finite, min and max are finite; mean, std and l2 may be non-finite
    only where float64 sums of the values could overflow: an L2 norm beyond float64's largest value
    is stored as inf, and writers before the scaled sums (stats.py) stored inf or NaN for mean,
    std and l2 wherever the squares overflowed, sum(x**2) > max, which needs
    max|x| * sqrt(numel) > sqrt(max). Below that bound a non-finite statistic is damage.
    """
    lo, hi = tensors["min"].to_numpy(), tensors["max"].to_numpy()
    mean, std, l2 = (tensors[c].to_numpy() for c in ("mean", "std", "l2"))
    numel = tensors["numel"].to_numpy()
    finite_data = ((tensors["nan"].to_numpy() == 0) & (tensors["inf"].to_numpy() == 0)
                   & (numel > 0))
    floating = tensors["dtype"].map(_is_float).to_numpy(dtype=bool)
    judged = finite_data & floating
    with np.errstate(invalid="ignore", over="ignore"):
        magnitude = np.maximum(np.abs(lo), np.abs(hi))
        may_overflow = magnitude * np.sqrt(numel.astype(np.float64)) >= _ROOT_MAX
        overflowed = ~(np.isfinite(mean) & np.isfinite(std) & np.isfinite(l2))
        broken = judged & (~(np.isfinite(lo) & np.isfinite(hi)) | np.isnan(l2)
                           | (overflowed & ~may_overflow))
        row = _first(tensors, broken)
        if row is not None:
            refuse(row, "has a non-finite statistic although it counts no NaN or Inf")
        slack = 1e-6 * magnitude + 1e-30
        outside = np.isfinite(mean) & ((mean < lo - slack) | (mean > hi + slack))
        wrong = judged & ((lo > hi) | outside | (std < 0) | (l2 < 0))
    row = _first(tensors, wrong)
    if row is not None:
        refuse(row, f"has statistics that contradict each other (min {row['min']:.6g}, max "
                    f"{row['max']:.6g}, mean {row['mean']:.6g}, std {row['std']:.6g})")


def _is_float(name: str) -> bool:
    return name == "bfloat16" or schema.numpy_dtype(name).kind == "f"


def check_sites(sites: pd.DataFrame, path: str) -> None:
    """Refuse a sites table whose rows do not parse (raises TraceError)."""
    def refuse(row: pd.Series, what: str) -> None:
        raise TraceError(f"{path}: sites {_where(row)} {what}; the file is damaged or was "
                         "not written by a layerdiff trace writer; capture it again")

    row = _first(sites, ~sites["site"].str.fullmatch(schema.SITE_PATTERN, na=False))
    if row is not None:
        refuse(row, f"has site {str(row['site'])[:40]!r}, not module#call")
    named = sites["module"] + "#" + sites["call"].astype(str)
    row = _first(sites, (named != sites["site"]).to_numpy())
    if row is not None:
        refuse(row, f"names site {row['site']} but module {str(row['module'])[:40]!r} call "
                    f"{int(row['call'])}")
    for column in ("step", "call", "enter_seq"):
        row = _first(sites, sites[column].to_numpy() < 0)
        if row is not None:
            refuse(row, f"has a negative {column} ({int(row[column])})")
    exits = sites["exit_seq"].to_numpy()
    row = _first(sites, (exits < -1) | ((exits >= 0) & (exits < sites["enter_seq"].to_numpy())))
    if row is not None:
        refuse(row, f"has exit_seq {int(row['exit_seq'])} for enter_seq "
                    f"{int(row['enter_seq'])}")
    # enter_seq may repeat: a site that records nothing before the next one enters
    row = _first(sites, sites.duplicated(["step", "site"]).to_numpy())
    if row is not None:
        refuse(row, f"repeats site {row['site']} in step {int(row['step'])}")
