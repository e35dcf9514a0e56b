"""Error metrics of one tensor pair, accumulated chunk by chunk.

A tensor of any size is compared in chunks of its flat C-order elements, so memory does not
grow with the tensor. The verdict's measure is ``ratio``: the largest
``|port - ref| / (atol + rtol * |ref|)`` over the elements, with the NaN and Inf rules of
:mod:`layerdiff.compare.judge`, which decides; this module only accumulates.

Floating-point pairs go through one compiled pass (:mod:`layerdiff.compare.kernels`, numba);
everything else, and every platform where numba cannot be had, through the numpy blocks of
``_numpy_update_block``, which stay the reference the kernel is tested against. Both give the
same columns (the sums mean_abs, rms and cosine to their last bits: 1e-12 relative). Setting
``LAYERDIFF_NUMPY_METRICS=1`` forces the numpy path.
"""

from __future__ import annotations

import functools
import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerdiff.compare import judge

# Elements per block of work inside a chunk: 7 float64 work arrays of 512 KiB fit a 2 MiB L2.
BLOCK = 1 << 16

# The compiled kernel is loaded (numba's import and its cache, ~1.2 s once per process) by the
# first pair at least this large; once loaded it serves every pair. Below, the numpy path is
# quicker than the load: 4 MiB of float32 take it ~17 ms.
KERNEL_MIN_NUMEL = 1 << 20

# Signed integer views for ULP distance, by float width.
_ULP_INT = {2: np.int16, 4: np.int32, 8: np.int64}


def ordered_bits(values: np.ndarray) -> np.ndarray:
    """Floats as integers whose order and differences count representable values (ULPs):
    sign-magnitude bits to two's complement (-0.0 and +0.0 both 0), in the float's width."""
    bits = values.view(_ULP_INT[values.dtype.itemsize])
    width = 8 * values.dtype.itemsize
    sign = bits >> (width - 1)                      # 0, or -1 for negative floats
    magnitude = np.array((1 << (width - 1)) - 1, dtype=bits.dtype)
    return (bits ^ (sign & magnitude)) - sign


class Scratch:
    """Work arrays reused from chunk to chunk: fresh temporaries of a few MiB cost a page fault
    per 4 KiB page, which made the metrics several times slower (PERF-NOTES: memory already
    touched copies at 13.5 GB/s, fresh memory at 1-3 GB/s)."""

    def __init__(self, *, reuse: bool = True) -> None:
        self.reuse = reuse
        self._arrays: dict[tuple[str, str], np.ndarray] = {}

    def take(self, name: str, size: int, dtype: type = np.float64) -> np.ndarray:
        if not self.reuse:
            return np.empty(size, dtype)
        key = (name, np.dtype(dtype).str)
        array = self._arrays.get(key)
        if array is None or array.size < size:
            array = self._arrays[key] = np.empty(max(size, 1), dtype)
        return array[:size]


@dataclass
class PairMetrics:
    """Metrics of one (reference, port) tensor pair, fed chunk by chunk with :meth:`update`.

    ``batch`` is the size of the batch axis (axis 0) when per-batch-element errors are wanted,
    else 0. ``ulp_scale`` divides float32 ULPs for tensors stored narrower (bfloat16: 2**16);
    ``None`` when ULPs do not apply (integers, mixed dtypes).
    """

    rtol: float
    atol: float
    numel: int
    batch: int = 0
    ulp_scale: float | None = 1.0
    max_abs: float = 0.0
    max_rel: float = 0.0
    sum_abs: float = 0.0
    sum_sq: float = 0.0
    dot: float = 0.0
    ref_sq: float = 0.0
    port_sq: float = 0.0
    max_ulp: float = 0.0
    out: int = 0
    ratio: float = 0.0
    finite_ratio: float = 0.0    # the ratio over the elements where the reference is finite
    worst: int = -1
    ref_nan: int = 0
    ref_inf: int = 0
    port_nan: int = 0
    port_inf: int = 0
    batch_ratio: np.ndarray | None = field(default=None, repr=False)
    scratch: Scratch | None = field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.batch:
            self.batch_ratio = np.zeros(self.batch)

    def update(self, ref: np.ndarray, port: np.ndarray, start: int) -> None:
        """Add flat elements ``start .. start + len(ref)`` of both tensors."""
        if ref.size and self._kernel_update(ref, port, start):
            return
        # in blocks whose float64 work arrays stay in a core's L2 cache: 1.6x faster than
        # whole 1 MiB chunks (measured with the diff benchmark)
        for begin in range(0, ref.size, BLOCK):
            self._numpy_update_block(ref[begin:begin + BLOCK], port[begin:begin + BLOCK],
                                     start + begin)

    def _kernel_update(self, ref: np.ndarray, port: np.ndarray, start: int) -> bool:
        """The compiled pass over the chunk; False (nothing changed) where it does not apply:
        no numba, not two real floating-point arrays, or a tolerance that is not finite."""
        if not (ref.dtype.kind == port.dtype.kind == "f" and ref.dtype.itemsize in _ULP_INT
                and port.dtype.itemsize in _ULP_INT and math.isfinite(self.rtol)
                and math.isfinite(self.atol) and self.rtol >= 0 and self.atol >= 0
                and not os.environ.get("LAYERDIFF_NUMPY_METRICS")):
            return False
        ref, port = np.ascontiguousarray(ref), np.ascontiguousarray(port)
        ulp = self.ulp_scale is not None and ref.dtype == port.dtype
        width = 8 * ref.dtype.itemsize if ulp else 0
        bits = _ULP_INT[ref.dtype.itemsize]
        ref_bits = ref.view(bits) if ulp else _NO_BITS
        port_bits = port.view(bits) if ulp else _NO_BITS
        ref, port = _widened(ref, self.scratch, "ref"), _widened(port, self.scratch, "port")
        per_element = self.numel // self.batch if self.batch_ratio is not None else 0
        batch_ratio = self.batch_ratio if self.batch_ratio is not None else _NO_BATCH
        if self.numel < KERNEL_MIN_NUMEL and _kernel.cache_info().currsize == 0:
            return False
        kernel = _kernel()
        if kernel is None or _KERNEL_FAILED:
            return False
        try:
            found = kernel(ref, port, ref_bits, port_bits, width, float(self.rtol),
                           float(self.atol), start, per_element, batch_ratio,
                           self.ratio if self.worst >= 0 else -1.0, self.finite_ratio,
                           self.max_rel)
        except Exception:  # failed to compile here: nothing ran, the numpy path from now on
            _KERNEL_FAILED.append(True)
            return False
        (max_abs, max_rel, sum_abs, sum_sq, dot, ref_sq, port_sq, ratio, worst, finite_ratio,
         out, ulp_max, ref_nan, ref_inf, port_nan, port_inf) = found
        # merged as the numpy path merges its blocks
        if ratio > self.ratio or self.worst < 0:
            self.ratio, self.worst = ratio, worst
        self.finite_ratio = max(self.finite_ratio, finite_ratio)
        self.out += out
        self.max_abs = max(self.max_abs, max_abs)
        self.max_rel = max(self.max_rel, max_rel)
        self.sum_abs += sum_abs
        self.sum_sq += sum_sq
        self.dot += dot
        self.ref_sq += ref_sq
        self.port_sq += port_sq
        if ulp:
            self.max_ulp = max(self.max_ulp, float(ulp_max) / self.ulp_scale)
        self.ref_nan += ref_nan
        self.ref_inf += ref_inf
        self.port_nan += port_nan
        self.port_inf += port_inf
        return True

    def _numpy_update_block(self, ref: np.ndarray, port: np.ndarray, start: int) -> None:
        """The reference implementation: numpy, about 25 float64 passes per element."""
        wide = np.complex128 if np.iscomplexobj(ref) or np.iscomplexobj(port) else np.float64
        work = self.scratch if self.scratch is not None and wide is np.float64 else Scratch(
            reuse=False)
        n = ref.size
        a, b = work.take("a", n, wide), work.take("b", n, wide)
        np.copyto(a, ref, casting="unsafe")
        np.copyto(b, port, casting="unsafe")
        diff, all_finite = judge.differences(a, b, work.take("diff", n),
                                             work.take("sub", n, wide))
        if not all_finite:
            self._count_non_finite(a, b)
        magnitude = np.abs(a, out=work.take("magnitude", n))
        ratio = judge.ratios(diff, magnitude, self.rtol, self.atol, work.take("ratio", n),
                             all_finite=all_finite)
        rel = work.take("rel", n)
        with np.errstate(divide="ignore", invalid="ignore", over="ignore"):  # x / tiny: inf
            np.maximum(magnitude, self.atol or np.finfo(np.float64).tiny, out=rel)
            np.divide(diff, rel, out=rel)
        if not all_finite:
            rel[np.isinf(diff)] = np.inf
            finite_ref = np.isfinite(a)
            if finite_ref.any():
                self.finite_ratio = max(self.finite_ratio, float(ratio[finite_ref].max()))
        worst = int(np.argmax(ratio))
        if all_finite:
            self.finite_ratio = max(self.finite_ratio, float(ratio[worst]))
        if ratio[worst] > self.ratio or self.worst < 0:
            self.ratio, self.worst = float(ratio[worst]), start + worst
        self.out += int(np.count_nonzero(ratio > 1.0))
        self.max_abs = max(self.max_abs, float(diff.max()))
        self.max_rel = max(self.max_rel, float(np.nanmax(rel)))
        if not all_finite:
            keep = np.isfinite(a) & np.isfinite(b)
            a, b = a[keep], b[keep]
        # sums of values near float64's largest (an additive mask of finfo.min in a float64
        # run) overflow to inf: that is their sum, and the cosine then says it cannot be had
        with np.errstate(over="ignore", invalid="ignore"):
            self.sum_abs += float(diff.sum())
            # einsum, not BLAS dot: BLAS threads fight the reader thread for 2 cores (8 ms a MiB)
            self.sum_sq += float(np.einsum("i,i->", diff, diff))
            self.dot += float(np.einsum("i,i->", a.conj(), b).real)
            self.ref_sq += float(np.einsum("i,i->", a.conj(), a).real)
            self.port_sq += float(np.einsum("i,i->", b.conj(), b).real)
        if self.ulp_scale is not None and ref.dtype.kind == "f" and ref.dtype == port.dtype:
            ulp = np.abs(ordered_bits(ref).astype(np.int64) - ordered_bits(port))
            if not all_finite:
                ulp = np.where(keep, ulp, 0)
            self.max_ulp = max(self.max_ulp, float(ulp.max()) / self.ulp_scale)
        if self.batch_ratio is not None:
            self._update_batches(ratio, start)

    def _count_non_finite(self, a: np.ndarray, b: np.ndarray) -> None:
        self.ref_nan += int(np.count_nonzero(np.isnan(a)))
        self.ref_inf += int(np.count_nonzero(np.isinf(a)))
        self.port_nan += int(np.count_nonzero(np.isnan(b)))
        self.port_inf += int(np.count_nonzero(np.isinf(b)))

    def _update_batches(self, ratio: np.ndarray, start: int) -> None:
        per_element = self.numel // self.batch
        first = start // per_element
        last = (start + ratio.size - 1) // per_element
        edges = np.arange(first + 1, last + 1) * per_element - start
        maxima = np.maximum.reduceat(ratio, np.concatenate([[0], edges]))
        current = self.batch_ratio[first:last + 1]
        np.maximum(current, maxima, out=current)

    def result(self, shape: tuple[int, ...]) -> dict[str, Any]:
        """The row's metric columns."""
        count = max(self.numel, 1)
        with np.errstate(over="ignore", invalid="ignore"):
            norms = np.sqrt(self.ref_sq * self.port_sq)
        if not (np.isfinite(norms) and np.isfinite(self.dot)):
            cosine = np.nan  # the sums overflowed: no cosine to give
        else:
            cosine = self.dot / norms if norms > 0 else (
                1.0 if self.ref_sq == self.port_sq else 0.0)
        return {
            "max_abs": self.max_abs,
            "max_rel": self.max_rel,
            "mean_abs": self.sum_abs / count,
            "rms": float(np.sqrt(self.sum_sq / count)),
            "cosine": float(cosine),
            "max_ulp": self.max_ulp if self.ulp_scale is not None else np.nan,
            "frac_out": self.out / count,
            "worst_index": _index_text(self.worst, shape),
            "ratio": self.ratio,
            "finite_ratio": self.finite_ratio,
            "ref_nan": self.ref_nan,
            "ref_inf": self.ref_inf,
            "port_nan": self.port_nan,
            "port_inf": self.port_inf,
            "batch_ratio": self.batch_ratio,
        }


@functools.cache
def _kernel() -> Any:
    """The compiled kernel (:func:`layerdiff.compare.kernels.fused`): built ahead of time where
    this user's layerdiff built it for this machine (compare/aot.py; no numba at run time: the
    ~0.4 s of numba's set-up gone), else numba's JIT, for arguments the build does not
    cover too; None where neither can be had. Loaded on first use: CLI start-up does not pay
    for it."""
    from layerdiff.compare import aot
    compiled = aot.load()
    if compiled is None:
        return _jitted()

    def kernel(*args):
        found = compiled.fused(*args)  # checks every argument; None: not what it was built for
        if found is not None:
            return found
        function = _jitted()
        if function is None:
            raise RuntimeError("no compiled kernel for these argument types")
        return function(*args)
    return kernel


@functools.cache
def _jitted() -> Any:
    """numba's JIT of the kernel, or None where numba cannot be imported."""
    try:
        from layerdiff.compare import kernels
    except Exception:  # not installed, or broken on this platform: the numpy path
        return None
    return kernels.fused


_KERNEL_FAILED: list[bool] = []  # not empty once the kernel failed to compile in this process
_NO_BITS = np.zeros(0, np.int32)      # placeholders of the kernel's unused arguments
_NO_BATCH = np.zeros(0, np.float64)


def _widened(values: np.ndarray, scratch: Scratch | None, name: str) -> np.ndarray:
    """float16 as float32 (exact; numba has no float16 arithmetic), other floats as they are."""
    if values.dtype.itemsize != 2:
        return values
    work = scratch if scratch is not None else Scratch(reuse=False)
    wide = work.take(name, values.size, np.float32)
    np.copyto(wide, values)
    return wide


def _index_text(flat: int, shape: tuple[int, ...]) -> str:
    if flat < 0:
        return ""
    if not shape:
        return "()"
    return ",".join(str(int(i)) for i in np.unravel_index(flat, shape))
