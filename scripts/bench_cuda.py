#!/usr/bin/env python
"""Capture of CUDA tensors, side by side in one run: bare step, and captures with statistics
reduced on the GPU (the default) or on the host from copied bytes ("host stats"), copies to the
host asynchronous on a side stream (the default) or synchronous. Needs a GPU; CI has none.

For each case: median times over interleaved repeats, as ratios to the bare step; the full
capture's rate against the two limits it cannot beat (a pinned device-to-host copy and a
write of the same bytes to the same disk); then checks that every capture recorded the same
digests, minima and maxima, and that the CUDA trace matches a CPU capture within tolerance.

    python scripts/bench_cuda.py --steps 3 --repeats 3
"""

from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerdiff import diff, load_case, open_trace, run_case
from layerdiff.capture import torch_capture
from layerdiff.capture.stage import Stager
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


def time_capture(spec: str, steps: int, path: Path, *, summary: bool, async_device: bool,
                 device_stats: bool) -> float:
    case = on_device(spec, "cuda")
    torch_capture.Stager = functools.partial(Stager, device_stats=None if device_stats
                                             else False)
    prepared = PreparedCapture(case, path, steps=steps, summary=summary,
                               async_device=async_device)
    torch.cuda.synchronize()
    start = time.perf_counter()
    prepared.run()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def copy_rate(nbytes: int = 512 * 2**20) -> float:
    """GB/s of one device-to-host copy into pinned memory (PCIe or NVLink-C2C)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    target = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target.copy_(source)
    torch.cuda.synchronize()
    start = time.perf_counter()
    target.copy_(source)
    torch.cuda.synchronize()
    return nbytes / (time.perf_counter() - start) / 1e9


def disk_rate(directory: Path, nbytes: int = 1 << 30) -> float:
    """GB/s of numpy.tofile of ``nbytes`` to ``directory``, flushed to the disk."""
    data = np.ones(nbytes, dtype=np.uint8)
    path = directory / "rate.bin"
    start = time.perf_counter()
    with open(path, "wb") as file:
        data.tofile(file)
        file.flush()
        os.fsync(file.fileno())
    elapsed = time.perf_counter() - start
    path.unlink()
    return nbytes / elapsed / 1e9


def same_records(paths: list[Path]) -> bool:
    """Whether every trace holds the same digests, minima and maxima, row by row."""
    columns = []
    for path in paths:
        with open_trace(path) as trace:
            columns.append(trace.index.sort_values("seq")[["digest", "min", "max"]]
                           .reset_index(drop=True))
    return all(frame.equals(columns[0]) for frame in columns[1:])


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
    # mode: (summary, asynchronous copies, statistics on the device)
    modes = {"summary": (True, True, True), "summary host stats": (True, True, False),
             "full": (False, True, True), "full sync": (False, False, True),
             "full host stats": (False, True, False)}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        for spec in args.cases:
            time_bare(spec, 1)  # warm-up of this case's kernels
            times: dict[str, list[float]] = {"bare": [], **{m: [] for m in modes}}
            for _ in range(args.repeats):
                times["bare"].append(time_bare(spec, args.steps))
                for mode, (summary, async_device, device_stats) in modes.items():
                    path = directory / f"{mode.replace(' ', '_')}.h5"
                    times[mode].append(time_capture(spec, args.steps, path, summary=summary,
                                                    async_device=async_device,
                                                    device_stats=device_stats))
            median = {mode: statistics.median(values) for mode, values in times.items()}
            same = same_records([directory / f"{m.replace(' ', '_')}.h5" for m in modes])
            with open_trace(directory / "full.h5") as a:
                mib = a.index["nbytes"].sum() / 2**20 / args.steps
            full_rate = mib * 2**20 * args.steps / median["full"] / 1e9
            cpu = PreparedCapture(load_case(spec), directory / "cpu.h5", steps=1)
            cpu.run()
            cuda = PreparedCapture(on_device(spec, "cuda"), directory / "cuda.h5", steps=1)
            cuda.run()
            against_cpu = diff(directory / "cpu.h5", directory / "cuda.h5")
            bare = median["bare"] / args.steps * 1000
            rows.append((spec.split(":")[-1], f"{bare:.1f}", f"{mib:.0f}",
                         *(f"{median[m] / median['bare']:.2f}" for m in modes),
                         f"{full_rate:.2f}", "yes" if same else "NO",
                         f"{against_cpu.verdict} ({against_cpu.rows['ratio'].max():.2g})"))
        limits = (f"limits: device-to-host copy {copy_rate():.1f} GB/s, "
                  f"disk {disk_rate(directory):.2f} GB/s")
    header = ("case", "bare step ms", "MiB/step", *(f"{m} x" for m in modes),
              "full GB/s", "same digests, min, max", "CUDA vs CPU (max ratio)")
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" for _ in header) + " |")
    for row in rows:
        print("| " + " | ".join(row) + " |")
    print(limits)


if __name__ == "__main__":
    main()
