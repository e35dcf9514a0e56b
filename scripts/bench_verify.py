#!/usr/bin/env python
"""What checking every read against its index costs the diff, side by side in one run.

Two pairs of traces of the same size (``bench_diff.generate``): one whose port differs from the
reference in every tensor (every record read for its metrics, the digest and statistics check
rides along), and one whose port is a copy of the reference (every record decided by equal
digests: with verification each is read only to be checked, without it nothing is read). Each
diff runs in a fresh process, with and without ``verify``, interleaved; medians over repeats.

    python scripts/bench_verify.py --size 0.5 --repeats 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_diff import generate

CHILD = """
import sys, time
import layerdiff
start = time.perf_counter()
layerdiff.diff(sys.argv[1], sys.argv[2], verify=sys.argv[3] == "1")
print(time.perf_counter() - start)
"""


def timed(ref: Path, port: Path, verify: bool) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD, str(ref), str(port), str(int(verify))],
                         check=True, capture_output=True, text=True).stdout
    return float(out.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", type=float, default=0.5, help="GB per trace")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="layerdiff-verify-"))
    try:
        ref, port = directory / "ref.h5", directory / "port.h5"
        tensors, nbytes = generate(ref, port, int(args.size * 1e9))
        same = directory / "same.h5"
        shutil.copyfile(ref, same)
        rows = []
        for label, other, read_bytes in (("port differs everywhere", port, 2 * nbytes),
                                         ("port identical (copy)", same, 2 * nbytes)):
            times: dict[bool, list[float]] = {True: [], False: []}
            for repeat in range(args.repeats):
                for verify in ((True, False) if repeat % 2 == 0 else (False, True)):
                    times[verify].append(timed(ref, other, verify))
            on, off = (statistics.median(times[v]) for v in (True, False))
            rows.append((label, on, off, read_bytes / on / 1e9))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    print(f"{tensors} tensors, {nbytes / 1e9:.2f} GB per trace, warm page cache, medians of "
          f"{args.repeats}, each diff in a fresh process ({time.strftime('%Y-%m-%d')})")
    print()
    print("| pair | verify s | --no-verify s | verify / no-verify | verify GB/s (both sides) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for label, on, off, rate in rows:
        print(f"| {label} | {on:.2f} | {off:.2f} | {on / off:.2f} | {rate:.2f} |")


if __name__ == "__main__":
    main()
