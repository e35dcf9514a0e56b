#!/usr/bin/env python
"""Per-step cost of `layerdiff nan` and `layerdiff diverge`, side by side with the bare steps.

On the bundled transformer (its reference, and its port through the mapping for diverge): the
bare training step of each, `find_nan` over the same steps (nothing to find: every step is
checked), and `diverge` with and without its float64 run (a correct port: the statistics phase
of every step, no full capture); with another --case, the case is its own port. Interleaved
repeats in one process, one torch thread, medians; ratios are over the bare reference step
(diverge: over both bare steps, it trains both).

    python scripts/bench_debug.py --steps 10 --repeats 3
    python scripts/bench_debug.py --case reference_models.transformer:reference_large --steps 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerdiff import load_case, run_case
from layerdiff.debug import diverge, find_nan
from reference_models.catalog import HERE

SMALL = "reference_models.transformer:reference"
PORT = "reference_models.transformer_port:port"
MAPPING = HERE / "transformer_port.map.toml"


def per_step(work, steps: int) -> float:
    start = time.perf_counter()
    work()
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", default=SMALL)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    steps = args.steps
    # the bundled port exists at the small size only: elsewhere the case is its own port
    port, mapping = (PORT, MAPPING) if args.case == SMALL else (args.case, None)
    with tempfile.TemporaryDirectory() as tmp:
        work = {
            "bare step, reference": lambda: run_case(load_case(args.case), steps=steps),
            "bare step, port": lambda: run_case(load_case(port), steps=steps),
            "nan (reference)": lambda: find_nan(load_case(args.case), steps),
            "diverge, with float64 run": lambda: diverge(
                args.case, port, mapping=mapping, steps=steps, output_dir=Path(tmp) / "a"),
            "diverge, --no-golden": lambda: diverge(
                args.case, port, mapping=mapping, steps=steps, golden=False,
                output_dir=Path(tmp) / "b"),
        }
        for job in work.values():  # warm up: imports, first-call compilation
            job()
        times: dict[str, list[float]] = {name: [] for name in work}
        for repeat in range(args.repeats):
            names = list(work) if repeat % 2 == 0 else list(reversed(work))
            for name in names:
                times[name].append(per_step(work[name], steps))
    median = {name: statistics.median(values) for name, values in times.items()}
    bare_ref = median["bare step, reference"]
    both = bare_ref + median.get("bare step, port", 0.0)
    print(f"{args.case}, {steps} steps a run, medians of {args.repeats} interleaved repeats, "
          f"1 torch thread ({time.strftime('%Y-%m-%d')})")
    print()
    print("| what | ms per step | x bare |")
    print("| --- | ---: | ---: |")
    for name, value in median.items():
        base = both if name.startswith("diverge") else bare_ref
        ratio = "" if name.startswith("bare") else f"{value / base:.2f}"
        print(f"| {name} | {value * 1e3:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
