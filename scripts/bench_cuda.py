#!/usr/bin/env python
"""Capture of CUDA tensors, side by side in one run: bare step, and captures with the
device-to-host copies asynchronous (the default) and synchronous. Needs a GPU; CI has none.

For each case: median times over interleaved repeats, as ratios to the bare step; then checks
that the asynchronous capture recorded exactly what the synchronous one did (digest by digest)
and that the CUDA trace matches a CPU capture of the same case within tolerance.

    python scripts/bench_cuda.py --steps 3 --repeats 3
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

from layerdiff import diff, load_case, open_trace, run_case
from layerdiff.capture.torch_capture import PreparedCapture

CASES = ["reference_models.transformer:reference",
         "reference_models.transformer:reference_large"]


def on_device(spec: str, device: str):
    case = load_case(spec)
    case.model.to(device)
    case.inputs = tuple(x.to(device) for x in case.inputs)
    return case


def time_bare(spec: str, steps: int) -> float:
    case = on_device(spec, "cuda")
    run_case(case, steps=1)  # warm-up: kernels, allocator
    torch.cuda.synchronize()
    case = on_device(spec, "cuda")
    start = time.perf_counter()
    run_case(case, steps=steps)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def time_capture(spec: str, steps: int, path: Path, *, summary: bool,
                 async_device: bool) -> float:
    case = on_device(spec, "cuda")
    prepared = PreparedCapture(case, path, steps=steps, summary=summary,
                               async_device=async_device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    prepared.run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--cases", nargs="*", default=CASES)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_cuda.py needs a CUDA GPU; this machine has none")
    torch.backends.cuda.matmul.allow_tf32 = False  # compare with the CPU at float32
    torch.backends.cudnn.allow_tf32 = False
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.steps} steps, median of {args.repeats}")
    modes = {"summary async": (True, True), "full async": (False, True),
             "full sync": (False, False)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for spec in args.cases:
            time_bare(spec, 1)  # warm-up of this case's kernels
            times: dict[str, list[float]] = {"bare": [], **{m: [] for m in modes}}
            for _ in range(args.repeats):
                times["bare"].append(time_bare(spec, args.steps))
                for mode, (summary, async_device) in modes.items():
                    path = directory / f"{mode.replace(' ', '_')}.h5"
                    times[mode].append(time_capture(spec, args.steps, path, summary=summary,
                                                    async_device=async_device))
            median = {mode: statistics.median(values) for mode, values in times.items()}
            with open_trace(directory / "full_async.h5") as a, \
                    open_trace(directory / "full_sync.h5") as b:
                same = a.index["digest"].equals(b.index["digest"])
                mib = a.index["nbytes"].sum() / 2**20 / args.steps
            cpu = PreparedCapture(load_case(spec), directory / "cpu.h5", steps=1)
            cpu.run()
            cuda = PreparedCapture(on_device(spec, "cuda"), directory / "cuda.h5", steps=1)
            cuda.run()
            against_cpu = diff(directory / "cpu.h5", directory / "cuda.h5")
            bare = median["bare"] / args.steps * 1000
            rows.append((spec.split(":")[-1], f"{bare:.1f}", f"{mib:.0f}",
                         *(f"{median[m] / median['bare']:.2f}" for m in modes),
                         "yes" if same else "NO",
                         f"{against_cpu.verdict} ({against_cpu.rows['ratio'].max():.2g})"))
    header = ("case", "bare step ms", "MiB/step", *(f"{m} x" for m in modes),
              "async == sync digests", "CUDA vs CPU (max ratio)")
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
