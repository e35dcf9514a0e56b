#!/usr/bin/env python
"""Two-phase capture against a full one, side by side: time and bytes to the origin.

The large bundled transformer (d_model 256, 4+4 layers, length 128: about 1 GB of tensors a
step) against a copy of it with one planted bug (a layer norm's epsilon 1e-1 in encoder layer
2). Full: both sides captured with tensors, then diffed. Two-phase: both sides captured with
--summary and diffed, which names the origin; then both captured again with --full-around the
origin's module and diffed, which gives the element-wise error and the likely cause.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_two_phase.py [--steps 1] [--radius 1]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

BUG_MODULE = "encoder.layers.2.norm1"


def _cases():
    from reference_models import transformer

    def reference():
        return transformer.reference_large()

    def port():
        case = transformer.reference_large()
        case.model.get_submodule(BUG_MODULE).eps = 1e-1  # the planted bug
        case.name = "bench_two_phase:port"
        return case

    return reference, port


def _timed(fn):
    start = time.perf_counter()
    value = fn()
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1)
    parser.add_argument("--radius", type=int, default=1)
    parser.add_argument("--dir", default=None, help="where to write (default: tmp)")
    args = parser.parse_args()
    import torch

    from layerdiff import capture, diff

    torch.set_num_threads(1)
    reference, port = _cases()
    rows = []
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        out = Path(tmp)

        def both(tag, **options):
            paths, seconds = [], 0.0
            for name, make in (("ref", reference), ("port", port)):
                path, spent = _timed(lambda m=make, n=name: capture(
                    m(), out / f"{tag}.{n}.h5", steps=args.steps, **options))
                paths.append(path)
                seconds += spent
            result, diff_s = _timed(lambda: diff(*paths))
            size = sum(p.stat().st_size for p in paths)
            return result, seconds, diff_s, size

        full, cap_s, diff_s, size = both("full")
        rows.append(("full", cap_s, diff_s, size, full))
        summary, cap1, diff1, size1 = both("summary", summary=True)
        module = summary.origin.site.rpartition("#")[0]
        around, cap2, diff2, size2 = both("around", full_around=[module], radius=args.radius)
        rows.append(("phase 1: --summary", cap1, diff1, size1, summary))
        rows.append((f"phase 2: --full-around {module}", cap2, diff2, size2, around))
        rows.append(("two-phase total", cap1 + cap2, diff1 + diff2, size1 + size2, around))
    print(f"transformer:reference_large, {args.steps} step(s), bug in {BUG_MODULE}, "
          f"radius {args.radius}, one torch thread\n")
    print("| capture | capture s (both) | diff s | total s | MiB written | origin | hint |")
    print("| --- | ---: | ---: | ---: | ---: | --- | --- |")
    for name, cap, dif, size, result in rows:
        origin = result.origin
        hint = (origin.hint or {}).get("kind", "-") if origin else "-"
        where = f"{origin.site} {origin.pass_} {origin.role}" if origin else "-"
        print(f"| {name} | {cap:.1f} | {dif:.1f} | {cap + dif:.1f} | {size / 2**20:,.1f} | "
              f"{where} | {hint} |")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
