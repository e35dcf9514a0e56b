#!/usr/bin/env python
"""Would an ahead-of-time compiled metric kernel remove numba's set-up from a diff? Measured.

A fresh process pays ~0.4 s before its first compiled metric: ``import numba`` and the first
cached load of ``compare/kernels.py``, during which numba's CPU target registers its
implementations and imports scipy. This script compiles the same ``fused`` kernel ahead of
time with ``numba.pycc`` (the host CPU, every argument-type combination ``PairMetrics`` passes)
into a plain extension module, then measures, each in a fresh process:

- the time to the first result of a 2**20-element pair: through the JIT (numba's cache warm,
  layerdiff.compare already imported, as in a diff) and through the compiled module (which
  needs neither numba nor scipy at run time);
- that both give the same result, every element of the returned tuple and the per-batch
  ratios bit for bit, on random pairs with NaN, infinities, -0.0, subnormals and the largest
  floats, for each type combination;
- both kernels' rate on 64 MiB of float32.

    python scripts/aot_kernel.py --cases 300

Nothing here changes how the diff runs: it is the evidence for (or against) shipping the
kernel compiled (docs/benchmarks.md, "A diff's fixed cost").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# (ref, port, bits) after PairMetrics widens float16: what _kernel_update can pass
COMBINATIONS = [("float32", "float32", "int32"), ("float64", "float64", "int64"),
                ("float32", "float32", "int16"), ("float64", "float64", "int32"),
                ("float32", "float64", "int32"), ("float64", "float32", "int32")]
MODULE = "layerdiff_kernels_aot"


def _arguments(np, ref, port, bits: str, batch: int):
    """The kernel's arguments as PairMetrics builds them (bits of the stored values or none)."""
    if bits == "int16":  # float16 stored: bits of the stored values, values widened
        with np.errstate(over="ignore"):  # beyond float16's range: inf, as stored
            ref, port = ref.astype(np.float16), port.astype(np.float16)
        ref_bits, port_bits = ref.view(np.int16), port.view(np.int16)
        ref, port = ref.astype(np.float32), port.astype(np.float32)
        width = 16
    elif ref.dtype == port.dtype and np.dtype(bits).itemsize == ref.dtype.itemsize:
        ref_bits, port_bits, width = ref.view(bits), port.view(bits), 8 * ref.dtype.itemsize
    else:
        ref_bits = port_bits = np.zeros(0, np.int32)
        width = 0
    per = ref.size // batch if batch else 0
    ratios = np.zeros(batch) if batch else np.zeros(0)
    return (ref, port, ref_bits, port_bits, width, 1.3e-6, 1e-5, 0, per, ratios, -1.0, 0.0,
            0.0)


def _export_name(combination: tuple[str, str, str]) -> str:
    return "fused_" + "_".join(combination)


def _exported(module, args) -> object:
    """The compiled function for these arguments' types. A compiled export does not check
    the types it is given (a float64 array where it takes float32 crashes the process), so
    it is chosen here by the arrays' dtypes, as a dispatcher would."""
    ref, port, ref_bits = args[0], args[1], args[2]
    bits = str(ref_bits.dtype)
    return getattr(module, _export_name((str(ref.dtype), str(port.dtype), bits)))


def build(directory: Path) -> float:
    """Compile the kernel for every combination into ``directory``; returns seconds."""
    import numpy as np
    from numba.pycc import CC

    sys.path.insert(0, str(ROOT))
    import numba

    from layerdiff.compare import kernels
    cc = CC(MODULE)
    cc.output_dir = str(directory)
    cc.target_cpu = "host"
    for combination in COMBINATIONS:  # the JIT's own signature of each combination
        args = _arguments(np, np.ones(8, combination[0]), np.ones(8, combination[1]),
                          combination[2], 0)
        kernels.fused(*args)
        overload = kernels.fused.overloads[tuple(numba.typeof(a) for a in args)]
        cc.export(_export_name(combination), overload.signature)(kernels.fused.py_func)
    start = time.perf_counter()
    cc.compile()
    return time.perf_counter() - start


def _first_result(how: str, directory: str) -> None:
    """Child: nothing loaded to the first result of a 2**20-element float32 pair."""
    start = time.perf_counter()
    import numpy as np
    values = np.linspace(1, 2, 1 << 20, dtype=np.float32)
    args = _arguments(np, values, values * np.float32(1 + 1e-6), "int32", 0)
    if how == "jit":  # what a diff has imported before its first pair: layerdiff.compare
        sys.path.insert(0, str(ROOT))
        import layerdiff.compare.engine  # noqa: F401
    begin = time.perf_counter()
    if how == "aot":
        sys.path.insert(0, directory)
        module = __import__(MODULE)
        _exported(module, args)(*args)
    else:
        from layerdiff.compare import kernels
        kernels.fused(*args)
    print(json.dumps({"seconds": time.perf_counter() - begin,
                      "with_numpy": time.perf_counter() - start,
                      "numba": "numba" in sys.modules, "scipy": "scipy" in sys.modules}))


def compare(directory: Path, cases: int) -> dict[str, int]:
    """Mismatches per combination between the JIT and the compiled module."""
    import numpy as np
    sys.path.insert(0, str(directory))
    sys.path.insert(0, str(ROOT))
    module = __import__(MODULE)
    from layerdiff.compare import kernels
    rng = np.random.default_rng(1)
    special = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, 5e-324, 3.4e38, 1.7e308, -1e-40]
    found = {}
    for ref_type, port_type, bits in COMBINATIONS:
        wrong = 0
        for _ in range(cases):
            n = int(rng.integers(1, 20_000))
            scale = 10.0 ** int(rng.integers(-30, 30))
            ref = (rng.standard_normal(n) * scale).astype(ref_type)
            noise = rng.choice([1e-9, 1e-7, 1e-5, 1e-2], n) * rng.standard_normal(n)
            port = (ref.astype(np.float64) * (1 + noise)).astype(port_type)
            with np.errstate(over="ignore"):
                for values in (ref, port):
                    count = int(rng.integers(0, 5))
                    values[rng.integers(0, n, count)] = rng.choice(special, count)
            batch = int(rng.choice([0, 1, 4])) if n % 4 == 0 else 0
            jit_args = _arguments(np, ref, port, bits, batch)
            aot_args = _arguments(np, ref, port, bits, batch)
            expected = kernels.fused(*jit_args)
            got = _exported(module, aot_args)(*aot_args)
            same = all(
                x == y or (x != x and y != y) for x, y in zip(expected, got, strict=True))
            wrong += not (same and np.array_equal(jit_args[9], aot_args[9]))
        found["/".join((ref_type, port_type, bits))] = wrong
    return found


def rates(directory: Path) -> dict[str, float]:
    import numpy as np
    sys.path.insert(0, str(directory))
    module = __import__(MODULE)
    from layerdiff.compare import kernels
    values = np.random.default_rng(2).standard_normal(1 << 24).astype(np.float32)
    args = _arguments(np, values, values * np.float32(1 + 1e-7), "int32", 0)
    aot = _exported(module, args)
    best = {"jit": float("inf"), "aot": float("inf")}
    for _ in range(5):
        for name, function in (("jit", kernels.fused), ("aot", aot)):
            start = time.perf_counter()
            function(*args)
            best[name] = min(best[name], time.perf_counter() - start)
    return {name: values.nbytes / seconds / 1e9 for name, seconds in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", type=int, default=300, help="random pairs per combination")
    parser.add_argument("--repeats", type=int, default=5, help="fresh processes per way")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="aot-kernel-") as scratch:
        directory = Path(scratch)
        seconds = build(directory)
        built = next(directory.glob(f"{MODULE}*"))
        print(f"compiled {len(COMBINATIONS)} combinations in {seconds:.1f} s: {built.name} "
              f"({built.stat().st_size / 1024:.0f} KiB)")
        firsts: dict[str, list[dict]] = {"jit": [], "aot": []}
        for _ in range(args.repeats):
            for how in firsts:
                out = subprocess.run([sys.executable, __file__, "--child", how, scratch],
                                     capture_output=True, text=True, check=True)
                firsts[how].append(json.loads(out.stdout.strip().splitlines()[-1]))
        for how, runs in firsts.items():
            times = sorted(r["seconds"] for r in runs)
            print(f"first result through {how}: median {times[len(times) // 2]:.3f} s "
                  f"(runs {', '.join(f'{t:.3f}' for t in times)}), numba imported: "
                  f"{runs[0]['numba']}, scipy imported: {runs[0]['scipy']}")
        print("mismatches per combination (JIT against compiled, of "
              f"{args.cases} pairs): {compare(directory, args.cases)}")
        print("rate, 64 MiB float32 in memory, best of 5: " + ", ".join(
            f"{k} {v:.2f} GB/s" for k, v in rates(directory).items()))


if __name__ == "__main__":
    if len(sys.argv) > 3 and sys.argv[1] == "--child":
        _first_result(sys.argv[2], sys.argv[3])
    else:
        main()
