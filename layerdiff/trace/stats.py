"""Per-tensor summary statistics and digest.

``batch_stats`` computes min, max, sum and sum of squares of every tensor of a batch in one
compiled pass (stats_kernel.py, numba, imported on first use); without numba, or with
``LAYERDIFF_STATS=numpy`` in the environment, it falls back to the numpy code below, which
stays the reference: min, max, counts and digest are equal either way, mean, std and l2 equal
up to float64 summation order (to ~1e-12 of the values' root mean square), except that the
kernel sums float32 squares in float64 where compute_stats' BLAS dot sums them in float32
(~n * 2**-30 relative). The digest is xxh3 (xxhash, ~20 GB/s) in both.
"""

from __future__ import annotations

import functools
import math
import os
from types import ModuleType
from typing import NamedTuple

import numpy as np
import xxhash

from layerdiff.trace import schema


class Stats(NamedTuple):
    min: float
    max: float
    mean: float
    std: float
    l2: float
    nan: int
    inf: int
    digest: str


EMPTY_STATS = Stats(math.nan, math.nan, math.nan, math.nan, 0.0, 0, 0, "")


def digest(raw: np.ndarray) -> str:
    """xxh3-64 of the C-order bytes, as 16 hex digits."""
    return xxhash.xxh3_64_hexdigest(np.ascontiguousarray(raw).data)


def text_digest(text: str) -> str:
    """xxh3-64 of a text's UTF-8 bytes (the meta attribute's digest)."""
    return xxhash.xxh3_64_hexdigest(text.encode("utf-8", "surrogateescape"))


def table_digest(columns: dict[str, np.ndarray], kinds: dict[str, object]) -> str:
    """xxh3-64 of a table's values, column by column in ``kinds``' order: numbers as their
    format dtype's bytes, text as length-prefixed UTF-8. It covers what the values are, not how
    HDF5 stores them, so a reader checks an edited column whatever its chunks or compression."""
    hasher = xxhash.xxh3_64()
    for name, kind in kinds.items():
        values = columns[name]
        if kind == schema.STR:
            for text in values:
                data = str(text).encode("utf-8", "surrogateescape")
                hasher.update(len(data).to_bytes(8, "little"))
                hasher.update(data)
        else:
            hasher.update(np.ascontiguousarray(np.asarray(values, dtype=kind)).data)
    return hasher.hexdigest()


def as_float(raw: np.ndarray, dtype_name: str) -> np.ndarray | None:
    """A numpy view (or, for bfloat16 and ints, a copy) of the values in a float type."""
    if dtype_name == "bfloat16":
        return schema.bfloat16_to_float32(raw)
    kind = raw.dtype.kind
    if kind == "f":
        return raw if raw.dtype.itemsize >= 4 else raw.astype(np.float32)
    if kind == "c":
        return np.abs(raw)  # complex: statistics of the magnitude
    if kind in "iub" and dtype_name in ("bool", "uint8", "int8", "int16", "int32", "int64",
                                         "uint16", "uint32", "uint64"):
        return raw.astype(np.float64)
    return None  # raw bytes of a type numpy cannot read (float8 ...): digest only


def compute_stats(raw: np.ndarray, dtype_name: str) -> Stats:
    """Statistics of one tensor given as its stored numpy array (raw bits for bfloat16)."""
    flat = raw.reshape(-1)
    dig = digest(flat)
    n = flat.size
    values = as_float(flat, dtype_name) if n else None
    if values is None:
        return EMPTY_STATS._replace(digest=dig)
    lo = float(values.min())
    hi = float(values.max())
    nan = inf = 0
    finite = values
    if not (math.isfinite(lo) and math.isfinite(hi)):
        nan = int(np.count_nonzero(np.isnan(values)))
        inf = int(np.count_nonzero(np.isinf(values)))
        finite = values[np.isfinite(values)]
        if finite.size == 0:
            return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig)
        lo = float(np.nanmin(values)) if nan < n else math.nan
        hi = float(np.nanmax(values)) if nan < n else math.nan
    total = float(finite.sum(dtype=np.float64))
    squares = sum_squares(finite)
    count = finite.size
    mean = total / count
    std = _std(squares / count, mean, finite)
    l2 = math.nan if nan else (math.inf if inf else math.sqrt(squares))
    return Stats(lo, hi, mean, std, l2, nan, inf, dig)


def tensor_stats(raw: np.ndarray, dtype_name: str) -> Stats:
    """compute_stats through the compiled kernel where it handles the dtype (one tensor)."""
    flat = np.ascontiguousarray(raw.reshape(-1))
    fused = batch_stats(flat.view(np.uint8), [(0, flat.nbytes, dtype_name)])[0]
    return fused if fused is not None else compute_stats(flat, dtype_name)


# Tensors up to this many elements get their statistics computed together with the other small
# tensors of their batch: one numpy call per statistic for the whole batch instead of five per
# tensor, which matters for models that record thousands of small tensors a step.
SMALL_NUMEL = 1 << 16
_VECTOR_DTYPES = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}


def batch_stats(buffer: np.ndarray, spans: list[tuple[int, int, str]], *,
                fused: bool = True) -> list[Stats | None]:
    """Statistics of many tensors lying in ``buffer`` at (byte offset, nbytes, dtype).

    Spans must be in increasing offset order and not overlap. Returns None for a span it does
    not handle: compute those with compute_stats. The compiled kernel handles every non-empty
    span of a float, integer or bool dtype; the numpy fallback (``fused=False``, or numba
    missing) only finite float32/float64 tensors of up to SMALL_NUMEL elements.
    """
    kernel = compiled() if fused else None
    if kernel is not None:
        return _fused_batch_stats(kernel, buffer, spans)
    return numpy_batch_stats(buffer, spans)


def numpy_batch_stats(buffer: np.ndarray,
                      spans: list[tuple[int, int, str]]) -> list[Stats | None]:
    """batch_stats in numpy: a few ``reduceat`` calls for all small finite float tensors."""
    results: list[Stats | None] = [None] * len(spans)
    for name, dtype in _VECTOR_DTYPES.items():
        chosen = [i for i, (_, nbytes, d) in enumerate(spans)
                  if d == name and 0 < nbytes <= SMALL_NUMEL * dtype.itemsize]
        if len(chosen) < 2:
            continue
        lo = spans[chosen[0]][0]
        hi = spans[chosen[-1]][0] + spans[chosen[-1]][1]
        values = buffer[lo:hi].view(dtype)
        item = dtype.itemsize
        bounds = np.empty(2 * len(chosen), dtype=np.intp)
        bounds[0::2] = [(spans[i][0] - lo) // item for i in chosen]
        bounds[1::2] = [(spans[i][0] + spans[i][1] - lo) // item for i in chosen]
        starts = bounds[:-1]  # the last tensor runs to the end of `values`
        counts = (bounds[1::2] - bounds[0::2]).astype(np.float64)
        with np.errstate(all="ignore"):  # the gaps between tensors hold arbitrary bytes
            mins = np.minimum.reduceat(values, starts)[0::2]
            maxs = np.maximum.reduceat(values, starts)[0::2]
            sums = np.add.reduceat(values, starts, dtype=np.float64)[0::2]
            squares = np.add.reduceat(np.square(values, dtype=np.float64), starts)[0::2]
            means = sums / counts
            stds = np.sqrt(np.maximum(squares / counts - means * means, 0.0))
            norms = np.sqrt(squares)
        finite = np.isfinite(mins) & np.isfinite(maxs)
        for j, i in enumerate(chosen):
            if finite[j]:
                offset, nbytes, _ = spans[i]
                std = float(stds[j])
                if _cancelled(squares[j] / counts[j], means[j]):
                    std = float(buffer[offset:offset + nbytes].view(dtype).std(dtype=np.float64))
                results[i] = Stats(float(mins[j]), float(maxs[j]), float(means[j]), std,
                                   float(norms[j]), 0, 0, digest(buffer[offset:offset + nbytes]))
    return results


# A float32 BLAS dot accumulates in float32: over 3e7 elements its sum is 2e-4 off. Blocks of
# this size keep each partial sum accurate to ~1e-7 and add them in float64, at the same speed.
_DOT_BLOCK = 1 << 18


def sum_squares(values: np.ndarray) -> float:
    """The sum of squares of a flat array, accurate to about 1e-7 whatever its length."""
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    total = []
    for start in range(0, values.size, _DOT_BLOCK):
        block = values[start:start + _DOT_BLOCK]
        with np.errstate(over="ignore"):
            part = float(np.dot(block, block))
        if math.isinf(part) and block.dtype.itemsize < 8:  # squares past float32's range
            part = float(np.dot(block.astype(np.float64), block.astype(np.float64)))
        total.append(part)
    return math.fsum(total)


def _cancelled(mean_square: float, mean: float) -> bool:
    """Whether E[x^2] - E[x]^2 lost its digits: the spread is tiny next to the mean."""
    return mean_square - mean * mean < 1e-4 * mean_square


def _std(mean_square: float, mean: float, values: np.ndarray) -> float:
    """The one-pass standard deviation, or the two-pass one where one pass cancels out
    (values far from zero with a small spread: [1000.0, 1000.001])."""
    if _cancelled(mean_square, mean):
        return float(values.std(dtype=np.float64))
    return math.sqrt(max(mean_square - mean * mean, 0.0))


@functools.cache
def compiled() -> ModuleType | None:
    """The compiled statistics module, or None without numba (or with LAYERDIFF_STATS=numpy).
    Imported on first use: numba takes 0.4-0.8 s to import, which ``import layerdiff`` must not
    pay (the first batch pays it, on the statistics thread).
    """
    if os.environ.get("LAYERDIFF_STATS", "").lower() == "numpy":
        return None
    try:
        from layerdiff.trace import stats_kernel
    except ImportError:
        return None
    return stats_kernel


def compiled_loaded() -> bool:
    """Whether :func:`compiled` has already been answered in this process (so that calling it
    costs nothing): a caller that must not wait for numba's import asks this first."""
    return compiled.cache_info().currsize > 0


_FLOAT_DTYPES = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64)}
_HALF_DTYPES = ("float16", "bfloat16")
_INT_DTYPES = {name: np.dtype(name) for name in
               ("uint8", "int8", "int16", "int32", "int64", "uint16", "uint32", "uint64")}
_INT_DTYPES["bool"] = np.dtype(np.uint8)  # numpy bools are bytes 0/1, summed as such
_ITEMSIZE = {**{name: 2 for name in _HALF_DTYPES},
             **{name: dtype.itemsize for name, dtype in {**_FLOAT_DTYPES, **_INT_DTYPES}.items()}}
_KEY_DTYPES = {2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


@functools.cache
def half_table(name: str) -> np.ndarray:
    """float32 value of every 16-bit pattern of float16 or bfloat16 (256 KiB)."""
    bits = np.arange(1 << 16, dtype=np.uint16)
    if name == "bfloat16":
        return schema.bfloat16_to_float32(bits)
    return bits.view(np.float16).astype(np.float32)


def span_stats(raw: np.ndarray, dtype_name: str) -> Stats | None:
    """``batch_stats(raw, [(0, raw.size, dtype_name)])[0]``, equal to it bit for bit, with a
    tenth of its Python: for one large tensor at a time (a capture takes them as they are made).
    """
    kernel = compiled()
    item = _ITEMSIZE.get(dtype_name) if dtype_name not in _INT_DTYPES else None
    if kernel is None or item is None or not raw.size or raw.size % item:
        return batch_stats(raw, [(0, raw.size, dtype_name)])[0]
    table = half_table(dtype_name) if dtype_name in _HALF_DTYPES else None
    lo, hi, total, squares, nan, inf = kernel.chunk_stats(raw, item, table)
    dig = xxhash.xxh3_64_hexdigest(raw)
    count = raw.size // item - nan - inf
    if not count:  # nothing finite (as _from_sums)
        if nan:
            lo = hi = math.nan
        return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig)
    mean = total / count
    mean_square = squares / count
    if _cancelled(mean_square, mean):
        std = _two_pass_std(raw, dtype_name, nan or inf)
    else:
        std = math.sqrt(max(mean_square - mean * mean, 0.0))
    l2 = math.nan if nan else (math.inf if inf else math.sqrt(squares))
    return Stats(lo, hi, mean, std, l2, nan, inf, dig)


def _two_pass_std(raw: np.ndarray, dtype_name: str, nonfinite: bool) -> float:
    """numpy's two-pass standard deviation of the finite values of a tensor's bytes, as
    compute_stats takes it where one pass cancels out (rare: layer-norm weights)."""
    values = as_float(raw.view(schema.numpy_dtype(dtype_name)), dtype_name)
    if nonfinite:
        values = values[np.isfinite(values)]
    return float(values.std(dtype=np.float64))


def _fused_batch_stats(kernel: ModuleType, buffer: np.ndarray,
                       spans: list[tuple[int, int, str]]) -> list[Stats | None]:
    results: list[Stats | None] = [None] * len(spans)
    groups: dict[str, list[int]] = {}
    for i, (_, nbytes, name) in enumerate(spans):
        if nbytes > 0 and name in _ITEMSIZE:
            groups.setdefault(name, []).append(i)
    for name, chosen in groups.items():
        item = _ITEMSIZE[name]
        chosen = [i for i in chosen if spans[i][0] % item == 0 and spans[i][1] % item == 0]
        if not chosen:
            continue
        whole = buffer[:buffer.size - buffer.size % item]
        starts = np.array([spans[i][0] // item for i in chosen], dtype=np.int64)
        stops = starts + np.array([spans[i][1] // item for i in chosen], dtype=np.int64)
        sums = np.empty((len(chosen), 2), dtype=np.float64)
        if name in _INT_DTYPES:
            bounds = np.empty((len(chosen), 2), dtype=np.float64)
            kernel.int_spans(whole.view(_INT_DTYPES[name]), starts, stops, sums, bounds)
            nans = infs = np.zeros(len(chosen), dtype=np.int64)
            lows, highs = bounds[:, 0], bounds[:, 1]
        else:
            counts = np.empty((len(chosen), 4), dtype=np.int64)
            keys = whole.view(_KEY_DTYPES[item])
            if name in _HALF_DTYPES:
                table = half_table(name)
                kernel.table_spans(whole.view(np.uint16), keys, table, starts, stops, sums,
                                   counts)
                lows = table[kernel.keys_to_bits16(counts[:, 0])].astype(np.float64)
                highs = table[kernel.keys_to_bits16(counts[:, 1])].astype(np.float64)
            else:
                shift, mask = kernel.key_shift_mask(item)
                kernel.float_spans(whole.view(_FLOAT_DTYPES[name]), keys, starts, stops,
                                   shift, mask, sums, counts)
                lows = kernel.keys_to_floats(counts[:, 0], item)
                highs = kernel.keys_to_floats(counts[:, 1], item)
            nans, infs = counts[:, 2], counts[:, 3]
        results_for = _from_sums(buffer, spans, chosen, name, stops - starts, lows, highs,
                                 sums, nans, infs)
        for i, stat in zip(chosen, results_for, strict=True):
            results[i] = stat
    return results


def _from_sums(buffer: np.ndarray, spans: list[tuple[int, int, str]], chosen: list[int],
               name: str, numel: np.ndarray, lows: np.ndarray, highs: np.ndarray,
               sums: np.ndarray, nans: np.ndarray, infs: np.ndarray) -> list[Stats]:
    """Stats from one pass's sums over the finite values, with compute_stats' rules and its
    float64 operations (as arrays: per-tensor Python is what costs on small tensors)."""
    count = (numel - nans - infs).astype(np.float64)
    with np.errstate(all="ignore"):  # tensors with nothing finite give NaN, as they should
        means = sums[:, 0] / count
        mean_squares = sums[:, 1] / count
        spread = mean_squares - means * means
        cancelled = spread < 1e-4 * mean_squares  # _cancelled, for every tensor at once
        stds = np.sqrt(np.maximum(spread, 0.0))
        norms = np.where(nans > 0, np.nan, np.where(infs > 0, np.inf, np.sqrt(sums[:, 1])))
    view = memoryview(buffer)  # slicing a memoryview costs less than slicing an array
    out = []
    for j, (lo, hi, mean, std, l2, nan, inf, finite, redo) in enumerate(zip(
            lows.tolist(), highs.tolist(), means.tolist(), stds.tolist(), norms.tolist(),
            nans.tolist(), infs.tolist(), count.tolist(), cancelled.tolist(), strict=True)):
        offset, nbytes, _ = spans[chosen[j]]
        dig = xxhash.xxh3_64_hexdigest(view[offset:offset + nbytes])
        if not finite:  # nothing finite: numpy's min of an array with a NaN is NaN
            if nan:
                lo = hi = math.nan
            out.append(Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig))
            continue
        if redo:
            std = _two_pass_std(buffer[offset:offset + nbytes], name, nan or inf)
        out.append(Stats(lo, hi, mean, std, l2, nan, inf, dig))
    return out
