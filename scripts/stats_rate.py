#!/usr/bin/env python
"""Rate of the capture's statistics on tensors of the d=256 transformer's sizes: layerdiff's
``span_stats`` (compiled kernel + xxh3 digest, what a CPU capture runs on every tensor from
1 MiB) against torch's own reductions for the same numbers, on 1 and 2 torch threads.

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python scripts/stats_rate.py

Prints GB/s (best and median of 7) and what that costs for the 1,050 MiB a step that a
summary capture of ``reference_large`` reduces on its capturing thread.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

STEP_BYTES = 1050 * 2**20
# reference_large's activations: (batch, length, d_model) 1 MiB, FFN hidden and attention 4 MiB
SHAPES = [(8, 128, 256)] * 24 + [(8, 128, 1024)] * 6 + [(8, 8, 128, 128)] * 6


def main() -> None:
    import torch
    import xxhash

    from layerdiff.capture.stage import _bytes_of
    from layerdiff.trace import stats

    torch.manual_seed(0)
    tensors = [torch.randn(shape) for shape in SHAPES]
    raws = [_bytes_of(t, t.nbytes) for t in tensors]
    total = sum(t.nbytes for t in tensors)
    stats.span_stats(raws[0], "float32")   # numba loaded

    def ours() -> None:
        for raw in raws:
            stats.span_stats(raw, "float32")

    def kernel() -> None:
        compiled = stats.compiled()
        for raw in raws:
            compiled.chunk_stats(raw, 4, None)

    def digest() -> None:
        for raw in raws:
            xxhash.xxh3_64_hexdigest(raw)

    def torch_all() -> None:   # min, max, float64 sum and L2, non-finite check
        for t in tensors:
            low, high = torch.aminmax(t)
            total64 = t.sum(dtype=torch.float64)
            l2 = torch.linalg.vector_norm(t, 2, dtype=torch.float64)
            float(low), float(high), float(total64), float(l2), bool(torch.isfinite(total64))

    def torch_min_sum() -> None:
        for t in tensors:
            low, high = torch.aminmax(t)
            total64 = t.sum(dtype=torch.float64)
            float(low), float(high), float(total64)

    print(f"{len(tensors)} tensors, {total / 2**20:.0f} MiB")
    runs = [(1, "span_stats (kernel + xxh3)", ours), (1, "  kernel alone", kernel),
            (1, "  xxh3 alone", digest)]
    runs += [(n, name, fn) for n in (1, 2) for name, fn in (
        ("torch aminmax + sum64 + norm64 + isfinite", torch_all),
        ("torch aminmax + sum64", torch_min_sum))]
    for threads, name, fn in runs:
        torch.set_num_threads(threads)
        times = []
        for _ in range(7):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        best, median = min(times), statistics.median(times)
        print(f"threads={threads} {name:44s} best {total / best / 1e9:5.2f} GB/s  median "
              f"{total / median / 1e9:5.2f} GB/s  {STEP_BYTES / (total / median) * 1000:6.1f} ms "
              "per reference_large step")


if __name__ == "__main__":
    main()
