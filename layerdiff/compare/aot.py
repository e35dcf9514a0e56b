"""The metric kernel compiled ahead of time: a diff's first pair without numba's set-up.

A process's first compiled metric costs ~0.4 s before it reads a byte: ``import numba``, then
numba's CPU target registering its implementations (scipy's import among them) on the first
cached load of :mod:`layerdiff.compare.kernels`. The same ``fused`` kernel compiled ahead of
time with ``numba.pycc`` is a plain extension module: importing it takes ~1 ms and needs
neither numba nor scipy, and it runs the same LLVM code, so its results are the JIT's bit for
bit (``scripts/aot_kernel.py`` and tests/test_aot_kernel.py check that).

``python -m layerdiff.compare.aot`` builds it (~13 s, once; numba and a C compiler needed
then) into the kernel cache (``$LAYERDIFF_KERNEL_CACHE``, else ``~/.cache/layerdiff/kernels``)
under a name keyed by the kernel's source, numba's and numpy's versions, the Python ABI and
this machine's CPU (it is compiled for the host CPU's instructions), so an edit, an upgrade or
another machine sharing the directory never loads a stale or foreign build. :func:`load`
finds it; where there is none, or for arguments it was not built for, the diff takes the JIT
as before. ``LAYERDIFF_AOT=0`` ignores it.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.machinery
import importlib.util
import os
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# (reference, port, bits) as PairMetrics passes them after widening float16: the bits of the
# stored values when ULPs are wanted (int16 for float16), else an empty int32 array
COMBINATIONS = (("float32", "float32", "int32"), ("float64", "float64", "int64"),
                ("float32", "float32", "int16"), ("float64", "float64", "int32"),
                ("float32", "float64", "int32"), ("float64", "float32", "int32"))
_KERNEL_SOURCE = Path(__file__).with_name("kernels.py")
# the tensor digest's block sums (trace/stats_kernel.py) are built into the same module: a diff
# verifies every byte it reads against its digest, which numpy computes at ~2.4 GB/s
_DIGEST_SOURCE = Path(__file__).parent.parent / "trace" / "stats_kernel.py"
DIGEST_EXPORT = "digest_block_sums"


def cache_dir() -> Path:
    """Where built kernels are kept."""
    given = os.environ.get("LAYERDIFF_KERNEL_CACHE")
    if given:
        return Path(given)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "layerdiff" / "kernels"


def module_name() -> str | None:
    """The built module's name for this source, these versions and this CPU; None where the
    CPU cannot be told (not Linux) or numba is not installed."""
    numba_spec = importlib.util.find_spec("numba")
    if numba_spec is None or numba_spec.origin is None:
        return None
    cpu = _cpu()
    if cpu is None:
        return None
    digest = hashlib.sha256(_KERNEL_SOURCE.read_bytes() + _DIGEST_SOURCE.read_bytes())
    version = Path(numba_spec.origin).with_name("_version.py")
    digest.update(version.read_bytes() if version.is_file() else b"?")
    for part in (np.__version__, sys.implementation.cache_tag, sys.platform, cpu):
        digest.update(b"\0" + part.encode())
    return "layerdiff_kernels_" + digest.hexdigest()[:20]


def _cpu() -> str | None:
    """The first processor's model and instruction-set flags (the code uses the host's)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    first = text.split("\n\n", 1)[0]
    keep = [line for line in first.splitlines()
            if line.split(":")[0].strip() in ("vendor_id", "model name", "flags", "Features",
                                               "CPU implementer", "CPU part")]
    return "\n".join(keep) or None


class Compiled:
    """The built kernel's functions by argument types. An exported function does not check
    what it is given (a float64 array where it takes float32 would crash the process), so
    :meth:`lookup` answers only for arrays exactly of the types it was built for."""

    def __init__(self, functions: dict[tuple[str, str, str], Callable[..., Any]],
                 digest_sums: Callable[..., Any] | None = None) -> None:
        self.functions = functions
        self.digest = _DigestSums(digest_sums) if digest_sums is not None else None

    def lookup(self, ref: np.ndarray, port: np.ndarray, ref_bits: np.ndarray,
               port_bits: np.ndarray, batch_ratio: np.ndarray) -> Callable[..., Any] | None:
        arrays = (ref, port, ref_bits, port_bits, batch_ratio)
        if not all(isinstance(a, np.ndarray) and a.ndim == 1 and a.flags.c_contiguous
                   and a.flags.aligned and a.dtype.isnative for a in arrays):
            return None
        if ref_bits.dtype != port_bits.dtype or batch_ratio.dtype != np.float64:
            return None
        return self.functions.get((ref.dtype.name, port.dtype.name, ref_bits.dtype.name))


@functools.cache
def load() -> Compiled | None:
    """The built kernel for this machine and source, or None (not built, LAYERDIFF_AOT=0, or
    it cannot be loaded: the JIT then serves, as without it)."""
    if os.environ.get("LAYERDIFF_AOT") == "0":
        return None
    try:
        name = module_name()
        if name is None:
            return None
        path = cache_dir() / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
        if not path.is_file():
            return None
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    except Exception:  # a damaged or foreign build: the JIT instead
        return None
    functions = {combination: getattr(module, export_name(combination))
                 for combination in COMBINATIONS if hasattr(module, export_name(combination))}
    return Compiled(functions, getattr(module, DIGEST_EXPORT, None)) if functions else None


class _DigestSums:
    """The built digest block sums with the compiled statistics module's ``fold_lanes``
    (what trace/digest.py's Digester calls), for whole blocks of bytes."""

    def __init__(self, sums: Callable[..., Any]) -> None:
        self._sums = sums

    def fold_lanes(self, data: np.ndarray, weights: np.ndarray, first_block: int, a: int,
                   b: int) -> tuple[int, int]:
        from layerdiff.trace import digest

        words = np.ascontiguousarray(data).view(np.int32)
        out = np.empty((words.size // digest.BLOCK, 2), dtype=np.int64)
        self._sums(words, *digest.lanes(), out)
        return digest.fold(out, first_block, (a, b))


def export_name(combination: tuple[str, str, str]) -> str:
    return "fused_" + "_".join(combination)


def arguments(ref: np.ndarray, port: np.ndarray, bits: str, batch: int = 0) -> tuple:
    """The kernel's arguments for one pair as PairMetrics builds them (for the build and the
    tests): the stored values' bits when ``bits`` matches their width (int16: stored as
    float16, then widened), else none."""
    if bits == "int16":
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as it would be stored
            ref, port = ref.astype(np.float16), port.astype(np.float16)
        ref_bits, port_bits = ref.view(np.int16), port.view(np.int16)
        ref, port, width = ref.astype(np.float32), port.astype(np.float32), 16
    elif ref.dtype == port.dtype and np.dtype(bits).itemsize == ref.dtype.itemsize:
        ref_bits, port_bits, width = ref.view(bits), port.view(bits), 8 * ref.dtype.itemsize
    else:
        ref_bits = port_bits = np.zeros(0, np.int32)
        width = 0
    per_element = ref.size // batch if batch else 0
    ratios = np.zeros(batch) if batch else np.zeros(0)
    return (ref, port, ref_bits, port_bits, width, 1.3e-6, 1e-5, 0, per_element, ratios, -1.0,
            0.0, 0.0)


def build(directory: Path | None = None,
          combinations: tuple[tuple[str, str, str], ...] = COMBINATIONS) -> Path:
    """Compile the kernel for ``combinations`` into ``directory`` (default: the cache) and
    return the module's path; written under a temporary name and renamed, so a reader never
    finds half a module."""
    import numba
    from numba.pycc import CC

    from layerdiff.compare import kernels
    name = module_name()
    if name is None:
        raise RuntimeError("the kernel cannot be compiled ahead of time here: its build is "
                           "keyed by /proc/cpuinfo (Linux) and needs numba")
    directory = Path(directory) if directory is not None else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=directory, prefix=".build-") as scratch:
        compiler = CC(name)
        compiler.output_dir = scratch
        compiler.target_cpu = "host"
        compiler.verbose = False
        for combination in combinations:  # the JIT's own signature of each combination
            args = arguments(np.ones(8, combination[0]), np.ones(8, combination[1]),
                             combination[2])
            kernels.fused(*args)
            overload = kernels.fused.overloads[tuple(numba.typeof(a) for a in args)]
            compiler.export(export_name(combination), overload.signature)(
                kernels.fused.py_func)
        from layerdiff.trace import digest, stats_kernel
        sums_args = (np.zeros(digest.BLOCK, np.int32), *digest.lanes(),
                     np.zeros((1, 2), np.int64))
        stats_kernel._block_sums(*sums_args)
        overload = stats_kernel._block_sums.overloads[tuple(numba.typeof(a) for a in sums_args)]
        compiler.export(DIGEST_EXPORT, overload.signature)(stats_kernel._block_sums.py_func)
        with _as_jitted():
            compiler.compile()
        built = next(Path(scratch).glob(name + "*"))
        target = directory / (name + importlib.machinery.EXTENSION_SUFFIXES[0])
        os.replace(built, target)
    return target


@contextlib.contextmanager
def _as_jitted():
    """numba.pycc compiles an export with default flags; give it the JIT's own for ``fused``
    (kernels._JIT): the numpy error model, and the GIL released while it runs, so that the
    diff's reading thread keeps going during the metrics."""
    from numba.pycc import compiler

    plain = compiler.Flags

    def flags():
        made = plain()
        made.release_gil = True
        made.error_model = "numpy"
        return made

    compiler.Flags = flags
    try:
        yield
    finally:
        compiler.Flags = plain


if __name__ == "__main__":
    import warnings

    warnings.simplefilter("ignore")  # numba.pycc's pending deprecation, once per build
    print(f"built {build()}")
