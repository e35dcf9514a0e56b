#!/usr/bin/env python
"""Whole-capture time of one case, for A/B runs of two checkouts in fresh processes.

Prints the median wall time (ms) of ``--captures`` captures after the first, each of
``--steps`` steps on ``--threads`` torch threads (1 by default), then the median CPU time of
the whole process (ms, every thread: torch's, the writer's, the statistics'). On a shared,
loaded machine the wall time follows the other jobs; the CPU time much less so, and on an idle
2-core machine where torch keeps both cores busy the capture's CPU is what it adds to the wall.
``--mode bare`` times the plain training step the same way. Run it from each checkout in turn,
alternating, e.g.

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
    parser.add_argument("--mode", choices=("summary", "full", "bare"), default="summary")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--captures", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import torch

    from layerdiff import capture, load_case, run_case

    torch.set_num_threads(args.threads)
    walls, cpus = [], []
    with tempfile.TemporaryDirectory() as folder:
        for number in range(args.captures):
            case = load_case(args.case)
            path = Path(folder) / f"t{number}.h5"
            cpu, start = time.process_time(), time.perf_counter()
            if args.mode == "bare":
                run_case(case, steps=args.steps)
            else:
                capture(case, path, summary=args.mode == "summary", steps=args.steps)
            walls.append(time.perf_counter() - start)
            cpus.append(time.process_time() - cpu)
            path.unlink(missing_ok=True)
    print(f"{statistics.median(walls[1:]) * 1000:.1f} {statistics.median(cpus[1:]) * 1000:.1f}")


if __name__ == "__main__":
    main()
