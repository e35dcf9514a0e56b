#!/usr/bin/env python
"""How the diff of a multi-rank port scales with the world size and with --workers.

Rank files are written by hand (no processes to launch): a stack of Megatron MLPs, each a
column-parallel ``fc`` (d -> 4d, weight and output cut across ranks) and a row-parallel ``proj``
(4d -> d, weight and input cut), on ``tokens`` rows. The one-process reference holds the whole
tensors; world size W splits them into W rank files and a manifest, as ``capture --nproc W``
would. Each row diffs the reference against the one-process trace and against the W-rank
manifest (gathered into one trace first, the gathered file removed before each run), with
1 worker and with ``--workers`` (2), in turn, and gives medians. The
port's weights are the reference's times 1 + 1e-7, so every pair is measured (none skipped as
bit-identical).

    python scripts/bench_ranks.py [--layers 6] [--width 768] [--tokens 512] [--worlds 2 4 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from layerdiff import TraceWriter, diff
from layerdiff.trace.gather import gathered_path
from layerdiff.trace.manifest import rank_path, write_manifest

RULES = """
[[shard]]
site = "layers.*.fc"
tensor = "weight"
dim = 0

[[shard]]
site = "layers.*.fc"
tensor = "output"
dim = -1

[[shard]]
site = "layers.*.proj"
tensor = "weight"
dim = 1

[[shard]]
site = "layers.*.proj"
tensor = "input"
dim = -1
"""


def stack_layers(layers: int, width: int, tokens: int,
            nudge: float = 0.0) -> list[dict[str, np.ndarray]]:
    """The stack's tensors; ``nudge`` scales the weights by 1 + nudge, so that a port differs
    from the reference within tolerance everywhere and every pair is measured, not skipped."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((tokens, width), dtype=np.float32)
    out = []
    for _ in range(layers):
        fc = rng.standard_normal((4 * width, width), dtype=np.float32) / width**0.5
        proj = rng.standard_normal((width, 4 * width), dtype=np.float32) / (4 * width)**0.5
        fc, proj = (np.float32(1 + nudge) * w for w in (fc, proj))
        hidden = x @ fc.T
        y = hidden @ proj.T
        out.append({"x": x, "fc": fc, "hidden": hidden, "proj": proj, "y": y})
        x = y
    return out


def write_rank(path: Path, layers: list[dict[str, np.ndarray]], rank: int, world: int, *,
               summary: bool = False, case: str = "bench_ranks") -> None:
    """Rank ``rank``'s file of the stack cut Megatron-style over ``world`` ranks (RULES)."""
    def part(array: np.ndarray, dim: int) -> np.ndarray:
        return np.ascontiguousarray(np.split(array, world, axis=dim)[rank])

    meta = {"case": case, "rank": rank, "world_size": world}
    with TraceWriter(path, meta=meta, summary=summary) as writer:
        for number, layer in enumerate(layers):
            with writer.site(f"layers.{number}.fc", "Linear") as site:
                writer.record(site, "input", layer["x"])
                writer.record(site, "weight", part(layer["fc"], 0), arg="weight")
                writer.record(site, "output", part(layer["hidden"], -1))
            with writer.site(f"layers.{number}.proj", "Linear") as site:
                writer.record(site, "input", part(layer["hidden"], -1))
                writer.record(site, "weight", part(layer["proj"], 1), arg="weight")
                writer.record(site, "output", layer["y"])


def _time(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2, help="the parallel column's")
    args = parser.parse_args()
    layers = stack_layers(args.layers, args.width, args.tokens)
    port = stack_layers(args.layers, args.width, args.tokens, nudge=1e-7)
    with tempfile.TemporaryDirectory(dir=".") as folder:
        folder = Path(folder)
        rules = folder / "map.toml"
        rules.write_text(RULES)
        reference, single = folder / "ref.h5", folder / "single.h5"
        write_rank(reference, layers, 0, 1)
        write_rank(single, port, 0, 1)
        size = reference.stat().st_size / 2**20
        one = _time(lambda: diff(reference, single), args.repeats)
        print(f"{args.layers} layers, d={args.width}, {args.tokens} tokens: {size:.0f} MiB per "
              f"one-process trace; medians of {args.repeats}\n")
        print(f"| port | rank file MiB | diff s (workers 1) | diff s (workers {args.workers}) | "
              "best x one-process diff |")
        print("| --- | ---: | ---: | ---: | ---: |")
        print(f"| one process | {size:.0f} | {one:.2f} | {one:.2f} | 1.00 |")
        for world in args.worlds:
            manifest = folder / f"w{world}.h5"
            files = [rank_path(manifest, rank) for rank in range(world)]
            for rank, path in enumerate(files):
                write_rank(path, port, rank, world)
            write_manifest(manifest, files)

            def run(workers: int, manifest: Path = manifest) -> None:
                gathered_path(manifest).unlink(missing_ok=True)
                assert diff(reference, manifest, mapping=rules, workers=workers).passed

            serial, parallel = _time(lambda: run(1), args.repeats), _time(
                lambda: run(args.workers), args.repeats)
            print(f"| {world} ranks | {files[0].stat().st_size / 2**20:.0f} | {serial:.2f} | "
                  f"{parallel:.2f} | {min(serial, parallel) / one:.2f} |")


if __name__ == "__main__":
    main()
