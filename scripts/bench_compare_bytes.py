#!/usr/bin/env python
"""What comparing the bytes of pairs whose digests agree costs a diff, in one process.

A reference trace and its copy (``bench_diff.generate``): every pair's digests agree, so the
diff reads each record only to check it. Before issue 38 each side was read and checked on its
own (``verify_tensors``, one side after the other); now both sides are read together, each
checked, and their bytes compared (``compare_tensors``), so that ``identical`` means equal
bytes. Both ways run interleaved on the same open traces; CPU and wall medians over repeats.

    python scripts/bench_compare_bytes.py --size 0.3 --repeats 7
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_diff import generate

from layerdiff import open_trace
from layerdiff.compare.engine import _tensor
from layerdiff.compare.reading import compare_tensors, same_bytes, verify_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.3, help="GB per trace")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="layerdiff-compare-bytes-"))
    try:
        ref, port, copy = (directory / name for name in ("ref.h5", "port.h5", "copy.h5"))
        tensors, nbytes = generate(ref, port, int(args.size * 1e9))
        shutil.copyfile(ref, copy)
        with open_trace(ref) as a, open_trace(copy) as b:
            sides = [[_tensor(trace, row, None, False, compared=False)
                      for row in trace.index.to_dict("records") if row["segment"] >= 0]
                     for trace in (a, b)]

            def each_side() -> None:
                verify_tensors(a.segments(), sides[0])
                verify_tensors(b.segments(), sides[1])

            def compared() -> None:
                pairs = list(zip(*sides, strict=True))
                assert not compare_tensors(a.segments(), b.segments(), pairs)

            ways = {"each side checked (before)": each_side,
                    "both checked, bytes compared": compared}
            times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
            for function in ways.values():
                function()  # warm: page cache, kernels
            for repeat in range(args.repeats):
                order = list(ways.items())
                for name, function in order if repeat % 2 == 0 else order[::-1]:
                    cpu, wall = time.process_time(), time.perf_counter()
                    function()
                    times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        memory = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)
        twin = memory.copy()
        same_bytes(memory, twin)
        cpu = time.process_time()
        for _ in range(10):
            same_bytes(memory, twin)
        rate = 10 * memory.nbytes / (time.process_time() - cpu) / 1e9
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{tensors} tensors, {nbytes / 1e9:.3f} GB a side, warm page cache, medians of "
          f"{args.repeats} ({time.strftime('%Y-%m-%d')})")
    print()
    print("| way | wall s | CPU s |")
    print("| --- | ---: | ---: |")
    for name, runs in times.items():
        print(f"| {name} | {statistics.median(r[0] for r in runs):.3f} | "
              f"{statistics.median(r[1] for r in runs):.3f} |")
    print(f"\nsame_bytes alone, in memory: {rate:.1f} GB/s of each side")


if __name__ == "__main__":
    main()
