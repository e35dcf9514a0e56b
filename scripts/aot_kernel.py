#!/usr/bin/env python
"""Would an ahead-of-time compiled metric kernel remove numba's set-up from a diff? Measured.

A fresh process pays ~0.4 s before its first compiled metric: ``import numba`` and the first
cached load of ``compare/kernels.py``, during which numba's CPU target registers its
implementations and imports scipy. This script compiles the same ``fused`` kernel ahead of
time (``layerdiff.compare.aot.build``: numba.pycc, the host CPU, every argument-type
combination ``PairMetrics`` passes) into a plain extension module, then measures, each in a
fresh process:

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


def _aot():
    sys.path.insert(0, str(ROOT))
    from layerdiff.compare import aot
    return aot


def _arguments(np, ref, port, bits: str, batch: int):
    return _aot().arguments(ref, port, bits, batch)


def _module(directory: Path):
    """The built module, imported from ``directory`` by its file."""
    import importlib.util
    aot = _aot()
    path = Path(directory) / aot.module_file(aot.module_name())  # not its .sha256 beside it
    spec = importlib.util.spec_from_file_location(path.name.split(".")[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exported(module, args):
    """The export for these arguments' types (a compiled export does not check them)."""
    return getattr(module, _aot().export_name(
        (str(args[0].dtype), str(args[1].dtype), str(args[2].dtype))))


def build(directory: Path) -> float:
    """Compile the kernel for every combination into ``directory``; returns seconds."""
    start = time.perf_counter()
    _aot().build(directory)
    return time.perf_counter() - start


def _first_result(how: str, directory: str) -> None:
    """Child: nothing loaded to the first result of a 2**20-element float32 pair."""
    start = time.perf_counter()
    import numpy as np
    values = np.linspace(1, 2, 1 << 20, dtype=np.float32)
    port = values * np.float32(1 + 1e-6)
    args = (values, port, values.view(np.int32), port.view(np.int32), 32, 1.3e-6, 1e-5, 0, 0,
            np.zeros(0), -1.0, 0.0, 0.0)
    # what a diff has imported before its first pair: layerdiff.compare
    sys.path.insert(0, str(ROOT))
    import layerdiff.compare.aot
    import layerdiff.compare.engine  # noqa: F401
    begin = time.perf_counter()
    if how == "aot":
        module = _module(Path(directory))
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
    module = _module(directory)
    from layerdiff.compare import kernels
    rng = np.random.default_rng(1)
    special = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e-45, 5e-324, 3.4e38, 1.7e308, -1e-40]
    found = {}
    for ref_type, port_type, bits in _aot().COMBINATIONS:
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
    module = _module(directory)
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
        built = next(directory.glob("layerdiff_kernels_*"))
        print(f"compiled {len(_aot().COMBINATIONS)} combinations in {seconds:.1f} s: {built.name} "
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
