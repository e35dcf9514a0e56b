"""Per-tensor summary statistics and digest.

``batch_stats`` computes min, max, sum and sum of squares of every tensor of a batch in one
compiled pass (stats_kernel.py, numba, imported on first use); without numba, or with
``LAYERDIFF_STATS=numpy`` in the environment, it falls back to the numpy code below, which
stays the reference: min, max, counts and digest are equal either way, mean, std and l2 equal
up to float64 summation order. The digest is digest.py's (the compiled pass, or numpy) in both.

Every path sums the same way (see "Scaled sums" below): values and their squares in float64,
and for float64 data whose squares would leave float64's range, values scaled by 2**-600 (or
2**600 when every square is below 2**-960), so that mean and std of finite data are finite
and the L2 norm is infinite only where it exceeds float64's largest value. A reader
verifying the statistics (verify.py) folds its chunks' sums with the same rules.
"""

from __future__ import annotations

import functools
import math
import os
from types import ModuleType
from typing import NamedTuple

import numpy as np
import xxhash

from layerdiff.trace import digest as tensor_digest
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
    """The tensor digest (digest.py) of the C-order bytes, as 16 hex digits."""
    return tensor_digest.digest_bytes(np.ascontiguousarray(raw).reshape(-1).view(np.uint8),
                                      compiled() if compiled_loaded() else None)


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
        lo, hi, nan, inf, finite = bounds_and_counts(values)
        if finite.size == 0:
            return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig)
    total, squares, k = scaled_sums(finite)
    mean, std, l2, cancelled = moments(finite.size, total, squares, k, lo, hi)
    if cancelled:
        std = two_pass_std(finite, k)
    l2 = math.nan if nan else (math.inf if inf else l2)
    return Stats(lo, hi, mean, std, l2, nan, inf, dig)


def bounds_and_counts(values: np.ndarray) -> tuple[float, float, int, int, np.ndarray]:
    """(min, max, NaN count, Inf count, finite values) of values holding a NaN or an Inf: min
    and max over the values that are not NaN (NaN if every value is), as the kernel takes
    them. Not numpy's nanmin: it returns NaN for a signaling NaN among subnormals."""
    nans = np.isnan(values)
    nan = int(np.count_nonzero(nans))
    finite = values[np.isfinite(values)]
    inf = values.size - nan - finite.size
    if nan == values.size:
        return math.nan, math.nan, nan, inf, finite
    kept = values[~nans] if nan else values
    return float(kept.min()), float(kept.max()), nan, inf, finite


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
            means = np.minimum(np.maximum(sums / counts, mins), maxs)
            stds = np.sqrt(np.maximum(squares / counts - means * means, 0.0))
            norms = np.sqrt(squares)
        # finite values whose float64 squares are in range (k = 0 in "scaled sums"); the
        # others are compute_stats' (float32 squares always are)
        finite = (np.isfinite(mins) & np.isfinite(maxs) & np.isfinite(squares)
                  & ((squares >= TINY_SQUARES) | ((mins == 0) & (maxs == 0))))
        for j, i in enumerate(chosen):
            if finite[j]:
                offset, nbytes, _ = spans[i]
                std = float(stds[j])
                if _cancelled(squares[j] / counts[j], means[j]):
                    std = float(buffer[offset:offset + nbytes].view(dtype).std(dtype=np.float64))
                results[i] = Stats(float(mins[j]), float(maxs[j]), float(means[j]), std,
                                   float(norms[j]), 0, 0, digest(buffer[offset:offset + nbytes]))
    return results


# Squares are summed in float64 blocks of this size (a float64 BLAS dot each), the partial
# sums added with fsum. A float32 dot would square in float32, where the square of a value
# below 2**-63 (a vanishing gradient) is subnormal or zero: the kernel squares in float64.
# Other dtypes are widened block by block into one buffer that stays in cache (64 KiB):
# measured 0.05 s for 16M float32 values, where a fresh 2 MiB array per block took 0.3-0.6 s.
_DOT_BLOCK = 1 << 13


def sum_squares(values: np.ndarray) -> float:
    """The float64 sum of squares of a flat array (squared in float64 whatever its dtype)."""
    widened = None if values.dtype == np.float64 else np.empty(min(values.size, _DOT_BLOCK))
    total = []
    with np.errstate(over="ignore", under="ignore"):
        for start in range(0, values.size, _DOT_BLOCK):
            block = values[start:start + _DOT_BLOCK]
            if widened is not None:
                np.copyto(widened[:block.size], block)
                block = widened[:block.size]
            total.append(float(np.dot(block, block)))
    return math.fsum(total) if all(map(math.isfinite, total)) else sum(total)


# ---------------------------------------------------------------------------- scaled sums
#
# A chunk of finite values is summed as (total, squares, k): the true sum is total * 2**(600k)
# and the true sum of squares squares * 2**(1200k), k in {-1, 0, 1}. Values of every dtype but
# float64 have float64 squares between 2**-298 and 2**256 (float32's range; integers below
# 2**64): k = 0, nothing can over- or underflow. float64 values can: a square overflows above
# 2**512 (an HF causal mask of finfo(float64).min) and loses digits below 2**-511. So for
# float64: k = 1 (values times 2**-600) when the unscaled squares overflow, k = -1 (values
# times 2**600) when their sum is below TINY_SQUARES and some value is not zero.
#
# Error bound (Higham, Accuracy and Stability, 4.2): a float64 sum of n terms in any order is
# within gamma_n = n u / (1 - n u), u = 2**-53, of the exact sum relative to sum |x|; squares
# add one rounding each. Scaling by a power of two is exact except where a scaled value
# falls below 2**-1022: each such value or square is then off by at most 2**-1075 absolute, and
# only happens to terms at least 2**-115 smaller, relative to the total, than the largest.
# So any two summations (the writer's one span, a reader's chunks) agree to
#     |d mean| <= 2 gamma_n rms,   |d squares| <= 2 gamma_{n+1} squares + n 2**-1074 (scaled)
# and verify.py's tolerance (1e-3 relative) is far above that for any n a trace can hold.
SCALE_EXP = 600
SCALE_UP = 2.0**SCALE_EXP     # values times this for k = -1
SCALE_DOWN = 2.0**-SCALE_EXP  # values times this for k = 1
TINY_SQUARES = 2.0**-960  # below: float64 squares of the largest values may be subnormal


def scale_of(k: int) -> float:
    """The factor a k-scaled total or root-mean-square is multiplied by to be the true one."""
    return SCALE_UP if k > 0 else (SCALE_DOWN if k < 0 else 1.0)


def scaled_sums(values: np.ndarray) -> tuple[float, float, int]:
    """(total, squares, k) of a flat array of finite values: see "scaled sums" above."""
    with np.errstate(over="ignore"):  # float64 values near the range: summed scaled below
        total = float(values.sum(dtype=np.float64))
    squares = sum_squares(values)
    if values.dtype != np.float64:
        return total, squares, 0  # widened to float64: never out of range
    if not math.isfinite(squares):
        k, factor = 1, SCALE_DOWN
    elif squares < TINY_SQUARES and values.any():
        k, factor = -1, SCALE_UP
    else:
        return total, squares, 0
    with np.errstate(under="ignore"):
        scaled = values * factor
    return float(scaled.sum()), sum_squares(scaled), k


def fold_sums(a: tuple[float, float, int], b: tuple[float, float, int]
              ) -> tuple[float, float, int]:
    """Two chunks' scaled sums as one: the smaller-scaled brought to the larger's k (a chunk
    of zeros, squares 0, takes any k). What a reader folding chunks adds up."""
    if b[1] == 0.0:
        return (a[0] + b[0], a[1], a[2])
    if a[1] == 0.0:
        return (a[0] + b[0], b[1], b[2])
    k = max(a[2], b[2])
    return (_shrink(a[0], k - a[2]) + _shrink(b[0], k - b[2]),
            _shrink(a[1], 2 * (k - a[2])) + _shrink(b[1], 2 * (k - b[2])), k)


def _shrink(value: float, steps: int) -> float:
    for _ in range(steps):  # one multiplication at a time: 2**-1200 is not a float64
        value *= SCALE_DOWN
    return value


def moments(count: int, total: float, squares: float, k: int, lo: float, hi: float
            ) -> tuple[float, float, float, bool]:
    """(mean, one-pass std, l2, cancelled) of ``count`` finite values from their scaled sums;
    ``lo``, ``hi`` the values' bounds (the mean is clamped into them: rounding may not move a
    mean of values at float64's largest outside its range). ``cancelled``: the one-pass std
    lost its digits, take the two-pass one (two_pass_std)."""
    scale = scale_of(k)
    mean_s = total / count
    mean_square = squares / count
    mean = min(max(mean_s * scale, lo), hi)
    spread = mean_square - mean_s * mean_s
    std = math.sqrt(max(spread, 0.0)) * scale
    bound = max(abs(lo), abs(hi))
    if std > bound:  # a std is never above the largest magnitude (rounding near the range)
        std = bound
    return mean, std, math.sqrt(squares) * scale, _cancelled(mean_square, mean_s)


def record_rms(row) -> float:
    """The root mean square of a record from its index row (min, max, mean, std, l2, numel,
    nan, inf): l2 / sqrt(n), or, where the L2 norm overflowed float64 although every value is
    finite (a float64 tensor near the largest value), sqrt(mean^2 + std^2), which is the same
    quantity computed without the overflow."""
    l2 = float(row["l2"])
    if math.isinf(l2) and int(row["nan"]) == 0 and int(row["inf"]) == 0:
        return math.hypot(float(row["mean"]), float(row["std"]))
    return l2 / math.sqrt(max(int(row["numel"]), 1))


def two_pass_std(values: np.ndarray, k: int) -> float:
    """numpy's two-pass standard deviation of finite values, in the k-scaled domain."""
    if k:
        with np.errstate(under="ignore"):
            values = values * (SCALE_DOWN if k > 0 else SCALE_UP)
    return float(values.std(dtype=np.float64)) * scale_of(k)


def _cancelled(mean_square: float, mean: float) -> bool:
    """Whether E[x^2] - E[x]^2 lost its digits: the spread is tiny next to the mean (values
    far from zero with a small spread: [1000.0, 1000.001]); the two-pass std keeps them."""
    return mean_square - mean * mean < 1e-4 * mean_square


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
    info = getattr(compiled, "cache_info", None)  # absent where a test stubs compiled()
    return info is None or info().currsize > 0


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
    lo, hi, total, squares, nan, inf, k = kernel.chunk_stats(raw, item, table)
    dig = tensor_digest.finish(kernel.digest_lanes(raw, tensor_digest.weights()), raw.size)
    count = raw.size // item - nan - inf
    if not count:  # nothing finite (as _from_sums): min and max of the infinities, if any
        if nan == raw.size // item:
            lo = hi = math.nan
        return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig)
    mean, std, l2, cancelled = moments(count, total, squares, k, lo, hi)
    if cancelled:
        std = _two_pass_std(raw, dtype_name, nan or inf, k)
    l2 = math.nan if nan else (math.inf if inf else l2)
    return Stats(lo, hi, mean, std, l2, nan, inf, dig)


def _two_pass_std(raw: np.ndarray, dtype_name: str, nonfinite: bool, k: int) -> float:
    """numpy's two-pass standard deviation of the finite values of a tensor's bytes, as
    compute_stats takes it where one pass cancels out (rare: layer-norm weights)."""
    values = as_float(raw.view(schema.numpy_dtype(dtype_name)), dtype_name)
    if nonfinite:
        values = values[np.isfinite(values)]
    return two_pass_std(values, k)


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
        exps = np.zeros(len(chosen), dtype=np.int64)  # k of each span's sums: float64 only
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
                                   shift, mask, sums, counts, exps)
                lows = kernel.keys_to_floats(counts[:, 0], item)
                highs = kernel.keys_to_floats(counts[:, 1], item)
            nans, infs = counts[:, 2], counts[:, 3]
        results_for = _from_sums(buffer, spans, chosen, name, stops - starts, lows, highs,
                                 sums, exps, nans, infs)
        for i, stat in zip(chosen, results_for, strict=True):
            results[i] = stat
    return results


def _from_sums(buffer: np.ndarray, spans: list[tuple[int, int, str]], chosen: list[int],
               name: str, numel: np.ndarray, lows: np.ndarray, highs: np.ndarray,
               sums: np.ndarray, exps: np.ndarray, nans: np.ndarray, infs: np.ndarray
               ) -> list[Stats]:
    """Stats from one pass's sums over the finite values, with compute_stats' rules and its
    float64 operations (moments, as arrays: per-tensor Python is what costs on small
    tensors)."""
    count = (numel - nans - infs).astype(np.float64)
    scale = np.where(exps > 0, SCALE_UP, np.where(exps < 0, SCALE_DOWN, 1.0))
    with np.errstate(all="ignore"):  # tensors with nothing finite give NaN, as they should
        scaled_means = sums[:, 0] / count
        mean_squares = sums[:, 1] / count
        means = np.minimum(np.maximum(scaled_means * scale, lows), highs)
        spread = mean_squares - scaled_means * scaled_means
        cancelled = spread < 1e-4 * mean_squares  # _cancelled, for every tensor at once
        stds = np.minimum(np.sqrt(np.maximum(spread, 0.0)) * scale,
                          np.maximum(np.abs(lows), np.abs(highs)))
        norms = np.where(nans > 0, np.nan,
                         np.where(infs > 0, np.inf, np.sqrt(sums[:, 1]) * scale))
    digests = _span_digests(buffer, [spans[i] for i in chosen])
    out = []
    for j, (lo, hi, mean, std, l2, nan, inf, finite, redo) in enumerate(zip(
            lows.tolist(), highs.tolist(), means.tolist(), stds.tolist(), norms.tolist(),
            nans.tolist(), infs.tolist(), count.tolist(), cancelled.tolist(), strict=True)):
        offset, nbytes, _ = spans[chosen[j]]
        dig = digests[j]
        if not finite:  # nothing finite: min and max of the infinities (NaN if none)
            if nan == nbytes // _ITEMSIZE[name]:
                lo = hi = math.nan
            out.append(Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, dig))
            continue
        if redo:
            std = _two_pass_std(buffer[offset:offset + nbytes], name, nan or inf, exps[j])
        out.append(Stats(lo, hi, mean, std, l2, nan, inf, dig))
    return out


def _span_digests(buffer: np.ndarray, spans: list[tuple[int, int, str]]) -> list[str]:
    """The digests of many spans of ``buffer`` in one compiled call (per-tensor calls cost
    more than small tensors' digests)."""
    starts = np.array([offset for offset, _, _ in spans], dtype=np.int64)
    sizes = np.array([nbytes for _, nbytes, _ in spans], dtype=np.int64)
    lanes = np.empty((len(spans), 2), dtype=np.int64)
    compiled().digest_spans(buffer, starts, sizes, tensor_digest.weights(), lanes)
    return [tensor_digest.finish((a, b), n)
            for (a, b), n in zip(lanes.tolist(), sizes.tolist(), strict=True)]
