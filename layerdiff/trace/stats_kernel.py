"""Fused one-pass span statistics, compiled with numba (imported lazily by stats.batch_stats).

One pass over each tensor's bytes gives its min, max, float64 sum and sum of squares; a second,
branchy pass runs only for a tensor that holds a NaN or an Inf (its sum comes out non-finite),
to count them and keep them out of the sums. Min and max are taken over the values' bits turned
into sortable integers, which the compiler vectorizes without being allowed to assume there are
no NaNs; sums are allowed to be reassociated (vectorized) and are added in blocks of
``BLOCK`` elements, so their rounding error stays near numpy's pairwise summation.

float64 values whose squares leave float64's range are summed scaled (a third pass, rare: see
"scaled sums" in stats.py): ``exps[j]`` says how, k = 1 for values times 2**-600, k = -1 for
values times 2**600, k = 0 unscaled (every other dtype: its float64 squares cannot overflow or
underflow).

The digest and the rare two-pass standard deviation stay in stats.py (xxh3, numpy).
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

# Elements summed into one float64 partial before it joins the total: keeps the error of the
# sums at about (BLOCK / vector lanes + n / BLOCK) roundings instead of n.
BLOCK = 4096
_FAST = {"reassoc", "contract"}  # never nnan/ninf: NaNs and Infs are what the sums detect

# Integer keys whose order is the floats' order: flip the magnitude bits of negative numbers.
# The map is its own inverse. NaN keys lie beyond the infinities (only the fast pass sees them,
# and its result is thrown away when there is a NaN).
_KEY_MASK = {2: 0x7FFF, 4: 0x7FFFFFFF, 8: 0x7FFFFFFFFFFFFFFF}
_KEY_INT = {2: np.int16, 4: np.int32, 8: np.int64}

# stats.py's SCALE_DOWN, SCALE_UP and TINY_SQUARES (not imported: this module must not import
# stats.py, which imports it lazily); tests/test_stats_range.py checks they are equal.
SCALE_DOWN = 2.0**-600
SCALE_UP = 2.0**600
TINY_SQUARES = 2.0**-960


# Two copies of one loop: float32 keys compared as int32 (8 lanes, vpminsd), measured 4.1 GB/s
# against 2.2 GB/s with int64 keys for both types.
@njit(cache=True, nogil=True, fastmath=_FAST)
def _fast_f32(values, keys, a, b):
    lo = np.int32(0x7FFFFFFF)
    hi = np.int32(-0x7FFFFFFF - 1)
    total = 0.0
    squares = 0.0
    for start in range(a, b, BLOCK):
        stop = min(start + BLOCK, b)
        part = 0.0
        part_sq = 0.0
        block = values[start:stop]
        block_keys = keys[start:stop]
        for i in range(block.size):
            x = np.float64(block[i])
            part += x
            part_sq += x * x
            k = block_keys[i]
            key = np.int32(k ^ ((k >> 31) & 0x7FFFFFFF))
            lo = min(lo, key)
            hi = max(hi, key)
        total += part
        squares += part_sq
    return np.int64(lo), np.int64(hi), total, squares


@njit(cache=True, nogil=True, fastmath=_FAST)
def _fast_f64(values, keys, a, b):
    lo = np.int64(0x7FFFFFFFFFFFFFFF)
    hi = np.int64(-0x7FFFFFFFFFFFFFFF - 1)
    total = 0.0
    squares = 0.0
    for start in range(a, b, BLOCK):
        stop = min(start + BLOCK, b)
        part = 0.0
        part_sq = 0.0
        block = values[start:stop]
        block_keys = keys[start:stop]
        for i in range(block.size):
            x = block[i]
            part += x
            part_sq += x * x
            k = block_keys[i]
            key = k ^ ((k >> 63) & 0x7FFFFFFFFFFFFFFF)
            lo = min(lo, key)
            hi = max(hi, key)
        total += part
        squares += part_sq
    return lo, hi, total, squares


@njit(cache=True, nogil=True, fastmath=_FAST)
def _fast_table(bits, keys, table, a, b):
    lo = np.int32(0x7FFF)
    hi = np.int32(-0x8000)
    total = 0.0
    squares = 0.0
    for start in range(a, b, BLOCK):
        stop = min(start + BLOCK, b)
        part = 0.0
        part_sq = 0.0
        block = bits[start:stop]
        block_keys = keys[start:stop]
        for i in range(block.size):
            x = np.float64(table[block[i]])
            part += x
            part_sq += x * x
            k = np.int32(block_keys[i])
            key = np.int32(k ^ ((k >> 15) & 0x7FFF))
            lo = min(lo, key)
            hi = max(hi, key)
        total += part
        squares += part_sq
    return np.int64(lo), np.int64(hi), total, squares


@njit(cache=True, nogil=True)
def _slow(values, keys, a, b, shift, mask, out, counts, j, factor):
    """The pass for a tensor holding NaN or Inf, or float64 values whose squares leave the
    range: counts NaN and Inf, sums the finite values times ``factor`` (a power of two) only,
    and takes min and max over everything but NaN (as numpy.nanmin does)."""
    lo = np.int64(0x7FFFFFFFFFFFFFFF)
    hi = np.int64(-0x7FFFFFFFFFFFFFFF - 1)
    total = 0.0
    squares = 0.0
    nan = 0
    inf = 0
    for start in range(a, b, BLOCK):
        stop = min(start + BLOCK, b)
        part = 0.0
        part_sq = 0.0
        for i in range(start, stop):
            x = np.float64(values[i])
            if x != x:
                nan += 1
                continue
            k = np.int64(keys[i])
            key = k ^ ((k >> shift) & mask)
            lo = min(lo, key)
            hi = max(hi, key)
            if math.isinf(x):
                inf += 1
                continue
            x *= factor
            part += x
            part_sq += x * x
        total += part
        squares += part_sq
    out[j, 0] = total
    out[j, 1] = squares
    counts[j, 0] = lo
    counts[j, 1] = hi
    counts[j, 2] = nan
    counts[j, 3] = inf


@njit(cache=True, nogil=True)
def float_spans(values, keys, starts, stops, shift, mask, out, counts, exps):
    """Per span [starts[j], stops[j]) of ``values`` (float32/float64; ``keys`` the same memory
    as signed integers): out[j] = (sum, sum of squares) of the finite values, scaled by
    2**(-600 exps[j]), counts[j] = (min key, max key, NaN count, Inf count)."""
    for j in range(starts.size):
        a = starts[j]
        b = stops[j]
        if shift == 31:
            lo, hi, total, squares = _fast_f32(values, keys, a, b)
        else:
            lo, hi, total, squares = _fast_f64(values, keys, a, b)
        exps[j] = 0
        if math.isfinite(total) and math.isfinite(squares):
            out[j, 0] = total
            out[j, 1] = squares
            counts[j, 0] = lo
            counts[j, 1] = hi
            counts[j, 2] = 0
            counts[j, 3] = 0
        else:  # a NaN or an Inf, or float64 squares past the range: count and sum again
            _slow(values, keys, a, b, shift, mask, out, counts, j, 1.0)
        if shift == 63:  # float64: squares may overflow or be subnormal (see stats.py)
            if not math.isfinite(out[j, 1]):
                _slow(values, keys, a, b, shift, mask, out, counts, j, SCALE_DOWN)
                exps[j] = 1
            elif out[j, 1] < TINY_SQUARES and not (counts[j, 0] >= -1 and counts[j, 1] <= 0):
                # not every value is +-0 (keys -1 and 0): sum them scaled up
                _slow(values, keys, a, b, shift, mask, out, counts, j, SCALE_UP)
                exps[j] = -1


@njit(cache=True, nogil=True)
def table_spans(bits, keys, table, starts, stops, out, counts):
    """float_spans for 16-bit floats (float16, bfloat16) given as their bits: ``table`` maps
    each bit pattern to its float32 value."""
    for j in range(starts.size):
        a = starts[j]
        b = stops[j]
        lo, hi, total, squares = _fast_table(bits, keys, table, a, b)
        if math.isfinite(total):
            out[j, 0] = total
            out[j, 1] = squares
            counts[j, 0] = lo
            counts[j, 1] = hi
            counts[j, 2] = 0
            counts[j, 3] = 0
        else:
            values = table[bits[a:b]]  # rare: decode the span once, then the float pass
            _slow(values, keys[a:b], 0, b - a, 15, 0x7FFF, out, counts, j, 1.0)


@njit(cache=True, nogil=True, fastmath=_FAST)
def int_spans(values, starts, stops, out, bounds):
    """Per span of an integer (or bool as uint8) array: out[j] = (sum, sum of squares) in
    float64, bounds[j] = (min, max) as float64 (conversion keeps the order, so these are the
    min and max of the converted values)."""
    for j in range(starts.size):
        a = starts[j]
        b = stops[j]
        lo = values[a]
        hi = values[a]
        total = 0.0
        squares = 0.0
        for start in range(a, b, BLOCK):
            stop = min(start + BLOCK, b)
            part = 0.0
            part_sq = 0.0
            block = values[start:stop]
            for i in range(block.size):
                v = block[i]
                x = np.float64(v)
                part += x
                part_sq += x * x
                lo = min(lo, v)
                hi = max(hi, v)
            total += part
            squares += part_sq
        out[j, 0] = total
        out[j, 1] = squares
        bounds[j, 0] = np.float64(lo)
        bounds[j, 1] = np.float64(hi)


def keys_to_floats(keys: np.ndarray, itemsize: int) -> np.ndarray:
    """The float64 values of sortable keys made from floats of ``itemsize`` bytes (4 or 8)."""
    small = keys.astype(_KEY_INT[itemsize])
    bits = small ^ ((small >> (8 * itemsize - 1)) & _KEY_INT[itemsize](_KEY_MASK[itemsize]))
    return bits.view(np.float32 if itemsize == 4 else np.float64).astype(np.float64)


def key_shift_mask(itemsize: int) -> tuple[int, int]:
    return 8 * itemsize - 1, _KEY_MASK[itemsize]


def keys_to_bits16(keys: np.ndarray) -> np.ndarray:
    """The uint16 bit patterns of sortable 16-bit keys (index into a 16-bit float table)."""
    small = keys.astype(np.int16)
    return (small ^ ((small >> 15) & np.int16(0x7FFF))).view(np.uint16)


def chunk_stats(raw: np.ndarray, itemsize: int, table: np.ndarray | None = None
                ) -> tuple[float, float, float, float, int, int, int]:
    """(min, max, sum, sum of squares, NaN count, Inf count, k) of one piece of a float tensor
    given as its bytes (uint8, a whole number of elements): float32 or float64 by ``itemsize``,
    or 16-bit floats whose ``table`` maps each bit pattern to its float32 value. Min and max
    are over the values that are not NaN (NaN when every value is), the sums over the finite
    ones, scaled by 2**(-600 k) (stats.py, "scaled sums"): what a reader checking a record
    chunk by chunk folds (trace/verify.py)."""
    starts = np.zeros(1, dtype=np.int64)
    stops = np.full(1, raw.size // itemsize, dtype=np.int64)
    sums = np.empty((1, 2), dtype=np.float64)
    counts = np.empty((1, 4), dtype=np.int64)
    exps = np.zeros(1, dtype=np.int64)
    keys = raw.view(_KEY_INT[itemsize])
    if table is not None:
        table_spans(raw.view(np.uint16), keys, table, starts, stops, sums, counts)
        lo, hi = table[keys_to_bits16(counts[0, :2])].tolist()
    else:
        shift, mask = key_shift_mask(itemsize)
        values = raw.view(np.float32 if itemsize == 4 else np.float64)
        float_spans(values, keys, starts, stops, shift, mask, sums, counts, exps)
        lo, hi = keys_to_floats(counts[0, :2], itemsize).tolist()
    nan, inf = int(counts[0, 2]), int(counts[0, 3])
    if nan == stops[0]:  # nothing but NaN: the bounds were never set
        lo = hi = math.nan
    return lo, hi, float(sums[0, 0]), float(sums[0, 1]), nan, inf, int(exps[0])


# ---------------------------------------------------------------------------- tensor digest
# digest.py's definition (4 KiB blocks of signed 32-bit words, two weight lanes, block sums
# folded modulo two primes) in one pass: the block sums are exact in int64, the products of
# 32-bit values vectorize (measured 15 GB/s on a loaded 2-core machine, xxh3 34).
_DIGEST_BLOCK = 1024
_PRIME_A = 2**32 - 5
_PRIME_B = 2**31 - 1


@njit(cache=True, nogil=True)
def _block_sums(words, wa, wb, out):
    """out[q] = (s_a, s_b) of each whole block of ``words`` (int32)."""
    for q in range(words.size // _DIGEST_BLOCK):
        sa = np.int64(0)
        sb = np.int64(0)
        base = q * _DIGEST_BLOCK
        for r in range(_DIGEST_BLOCK):  # a fixed trip count: the loop vectorizes
            u = np.int64(words[base + r])
            sa += u * wa[r]  # int64 weights: 2.5x faster than int32 ones widened here
            sb += u * wb[r]
        out[q, 0] = sa
        out[q, 1] = sb


@njit(cache=True, nogil=True)
def _fold_blocks(words, wa, wb, first_block, a, b):
    """Lanes (a, b) with the blocks of ``words`` (int32; the last may be short) added; the
    first of them is block number ``first_block`` of its tensor."""
    whole = words.size // _DIGEST_BLOCK
    sums = np.empty((whole + (words.size % _DIGEST_BLOCK > 0), 2), dtype=np.int64)
    _block_sums(words, wa, wb, sums)
    if words.size % _DIGEST_BLOCK:
        sa = np.int64(0)
        sb = np.int64(0)
        for r in range(words.size - whole * _DIGEST_BLOCK):
            u = np.int64(words[whole * _DIGEST_BLOCK + r])
            sa += u * wa[r]
            sb += u * wb[r]
        sums[whole, 0] = sa
        sums[whole, 1] = sb
    q = first_block
    for k in range(sums.shape[0]):
        q += 1
        qb = q % _PRIME_B
        a = (a + (sums[k, 0] % _PRIME_A) * q) % _PRIME_A
        b = (b + (sums[k, 1] % _PRIME_B) * (qb * qb % _PRIME_B)) % _PRIME_B
    return a, b


@njit(cache=True, nogil=True)
def _tail_word(data, start, count):
    """The last, short word of a span: ``count`` (1-3) bytes, zero-padded, little-endian."""
    word = np.int64(0)
    for i in range(count):
        word |= np.int64(data[start + i]) << (8 * i)
    return word  # below 2**24: the sign bit is a padding zero


@njit(cache=True, nogil=True)
def _digest_spans(data, words, starts, sizes, wa, wb, lanes):
    for j in range(starts.size):
        first = starts[j] // 4
        whole = sizes[j] // 4
        a, b = _fold_blocks(words[first:first + whole], wa, wb, 0, 0, 0)
        tail = sizes[j] % 4
        if tail:  # the short last word joins the last block (or opens a new one)
            r = whole % _DIGEST_BLOCK
            q = whole // _DIGEST_BLOCK + 1
            u = _tail_word(data, starts[j] + 4 * whole, tail)
            qb = q % _PRIME_B
            a = (a + ((u * wa[r]) % _PRIME_A) * q) % _PRIME_A
            b = (b + ((u * wb[r]) % _PRIME_B) * (qb * qb % _PRIME_B)) % _PRIME_B
        lanes[j, 0] = a
        lanes[j, 1] = b


def digest_spans(buffer: np.ndarray, starts: np.ndarray, sizes: np.ndarray,
                 weights: np.ndarray, lanes: np.ndarray) -> None:
    """lanes[j] = the digest lanes of bytes [starts[j], starts[j] + sizes[j]) of ``buffer``
    (uint8); every start a multiple of 4."""
    wa, wb = _lanes(weights)
    words = buffer[:buffer.size - buffer.size % 4].view(np.int32)
    _digest_spans(buffer, words, starts, sizes, wa, wb, lanes)


def _lanes(weights: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return (np.ascontiguousarray(weights[:, 0], dtype=np.int64),
            np.ascontiguousarray(weights[:, 1], dtype=np.int64))


def fold_lanes(data: np.ndarray, weights: np.ndarray, first_block: int, a: int, b: int
               ) -> tuple[int, int]:
    """digest.fold of the block sums of ``data`` (uint8, a whole number of words)."""
    wa, wb = _lanes(weights)
    a, b = _fold_blocks(data.view(np.int32), wa, wb, first_block, a, b)
    return int(a), int(b)


def digest_lanes(data: np.ndarray, weights: np.ndarray) -> tuple[int, int]:
    """The lanes of a whole tensor's bytes (uint8, any length), before digest.finish."""
    extra = -data.size % 4
    if extra:
        data = np.concatenate([data, np.zeros(extra, np.uint8)])
    return fold_lanes(data, weights, 0, 0, 0)
