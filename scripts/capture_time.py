#!/usr/bin/env python
"""Whole-capture time of one case, for A/B runs of two checkouts in fresh processes.

Prints the median wall time (ms) of ``--captures`` captures after the first, each of
``--steps`` steps on one torch thread. Run it from each checkout in turn, alternating, e.g.

    (cd ../before && PYTHONPATH=. python ../main/scripts/capture_time.py \
        reference_models.mlp:reference)
    PYTHONPATH=. python scripts/capture_time.py reference_models.mlp:reference
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("--mode", choices=("summary", "full"), default="summary")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--captures", type=int, default=7)
    args = parser.parse_args()

    import torch

    from layerdiff import capture, load_case

    torch.set_num_threads(1)
    times = []
    with tempfile.TemporaryDirectory() as folder:
        for number in range(args.captures):
            case = load_case(args.case)
            path = Path(folder) / f"t{number}.h5"
            start = time.perf_counter()
            capture(case, path, summary=args.mode == "summary", steps=args.steps)
            times.append(time.perf_counter() - start)
            path.unlink()
    print(f"{statistics.median(times[1:]) * 1000:.1f}")


if __name__ == "__main__":
    main()
