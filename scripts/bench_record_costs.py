#!/usr/bin/env python
"""Per-record costs of capture, writing, gathering and statistics, side by side in one run:
the numbers a plan for a large multi-rank capture multiplies (docs/distributed.md, "On paper").

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_record_costs.py [--repeats 3]

Prints one table. Rows:

- hooked capture of a stack of small Linear+ReLU blocks (1 KiB activations and weights), summary
  and full: the capture's time over a bare step, per record (hooks, staging, writer threads);
- the recorder alone (torch tensors staged as a capture stages them, no hooks): 1 KiB float32
  and 8 MiB bfloat16 tensors, summary and full, per record and GB/s;
- the trace writer (numpy, packed segments) against ``numpy.tofile`` of the same bytes;
- the statistics kernel (min, max, sums, NaN/Inf counts and digest) per element, bfloat16 and
  float32, and per 1 KiB span in a batch;
- the bytes of one index row of a summary trace (names shaped like a 70B model's);
- gather: two full rank files joined (rank bytes in and gathered bytes out per second), and
  summary rank files of 2, 8 and 16 ranks (statistics combined, per record and rank).

Medians of ``--repeats``; every file goes to a temporary folder beside the working directory
(the disk traces go to), page cache warm. The diff's rate is not re-measured here: see
docs/benchmarks.md, "Diff".
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_ranks import RULES, stack_layers, write_rank  # the same synthetic stack

Row = tuple[str, str, str, str]  # what, per record, throughput, note


def _median(run: Callable[[], float], repeats: int) -> float:
    values = []
    for _ in range(repeats):
        gc.collect()
        values.append(run())
    return statistics.median(values)


def _timed(run: Callable[[], object]) -> float:
    start = time.perf_counter()
    run()
    return time.perf_counter() - start


# ---- hooked capture ------------------------------------------------------------------------

def hooked_rows(folder: Path, repeats: int, steps: int = 2) -> list[Row]:
    import torch
    from torch import nn
    from torch.nn import functional

    from layerdiff import run_case
    from layerdiff.capture.torch_capture import PreparedCapture
    from layerdiff.case import Case
    from layerdiff.trace.reader import open_trace

    def case() -> Case:
        torch.manual_seed(0)
        layers: list[nn.Module] = []
        for _ in range(60):
            layers += [nn.Linear(16, 16), nn.ReLU()]
        model = nn.Sequential(*layers, nn.Linear(16, 4))
        x, y = torch.randn(16, 16), torch.randint(0, 4, (16,))
        return Case(model=model, inputs=(x,), loss_fn=lambda out: functional.cross_entropy(out, y),
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.01), name="record_costs:stack")

    def bare() -> float:
        made = case()
        return _timed(lambda: run_case(made, steps=steps))

    counts: dict[bool, int] = {}

    def captured(summary: bool) -> float:
        path = folder / f"hooked_{summary}.h5"
        prepared = PreparedCapture(case(), path, steps=steps, summary=summary)
        elapsed = _timed(prepared.run)
        with open_trace(path) as trace:
            counts[summary] = len(trace.index)
        path.unlink()
        return elapsed

    bare()
    captured(True)  # imports and the kernel's first load, outside the timings
    times: dict[str, list[float]] = {"bare": [], "summary": [], "full": []}
    for _ in range(repeats):
        gc.collect()
        times["bare"].append(bare())
        times["summary"].append(captured(True))
        times["full"].append(captured(False))
    base = statistics.median(times["bare"])
    rows = []
    for mode, summary in (("summary", True), ("full", False)):
        took = statistics.median(times[mode])
        per = (took - base) / counts[summary] * 1e6
        rows.append((f"hooked capture, 1 KiB tensors, {mode}", f"{per:.1f} us",
                     f"{counts[summary] / steps:.0f} records/step",
                     f"{took / base:.2f}x a {base / steps * 1e3:.1f} ms bare step"))
    return rows


# ---- the recorder alone --------------------------------------------------------------------

def recorder_rows(folder: Path, repeats: int) -> list[Row]:
    import torch

    from layerdiff.capture.stage import Stager
    from layerdiff.trace.recorder import Recorder
    from layerdiff.trace.stats import compiled

    compiled()  # the kernel loaded: large tensors take their statistics inline, as in a capture
    torch.manual_seed(0)
    small = [torch.randn(256) for _ in range(64)]                     # 1 KiB float32
    large = [torch.randn(4 << 20).to(torch.bfloat16) for _ in range(24)]  # 8 MiB bfloat16

    def run(tensors: list, count: int, summary: bool) -> float:
        path = folder / "recorder.h5"
        recorder = Recorder(path, {"case": "record_costs"}, summary=summary)
        stager = Stager(recorder, device_stats=False)
        start = time.perf_counter()
        for i in range(count):
            stager.tensor(0, "forward", f"layers.{i // 16}.m{i % 16}#0", "output", "0",
                          tensors[i % len(tensors)])
        recorder.close(True)
        elapsed = time.perf_counter() - start
        path.unlink()
        return elapsed

    rows = []
    for label, tensors, count in (("1 KiB float32", small, 20000),
                                  ("8 MiB bfloat16", large, len(large))):
        nbytes = tensors[0].numel() * tensors[0].element_size()
        results = {}
        for summary in (True, False):
            run(tensors, min(count, 256), summary)
            results[summary] = _median(
                lambda t=tensors, c=count, s=summary: run(t, c, s), repeats)
        for summary, mode in ((True, "summary"), (False, "full")):
            took = results[summary]
            rows.append((f"recorder alone, {label}, {mode}", f"{took / count * 1e6:.1f} us",
                         f"{count * nbytes / took / 1e6:,.0f} MB/s",
                         f"full / summary {results[False] / results[True]:.2f}"
                         if not summary else f"{count} records"))
    return rows


# ---- the writer ----------------------------------------------------------------------------

def writer_rows(folder: Path, repeats: int, total: int = 256 << 20) -> list[Row]:
    from layerdiff.trace import TraceWriter

    rows = []
    for tensor_bytes in (64 << 10, 8 << 20):
        count = total // tensor_bytes
        block = np.random.default_rng(0).standard_normal(tensor_bytes // 4).astype(np.float32)

        def raw(block: np.ndarray = block, count: int = count) -> float:
            path = folder / "raw.bin"
            with open(path, "wb") as handle:
                took = _timed(lambda: [block.tofile(handle) for _ in range(count)])
            path.unlink()
            return took

        def ours(block: np.ndarray = block, count: int = count) -> float:
            path = folder / "writer.h5"

            def write() -> None:
                with TraceWriter(path) as writer:
                    for i in range(count):
                        writer.record(f"layers.{i}#0", "output", block)
            took = _timed(write)
            path.unlink()
            return took

        tofile, writer = _median(raw, repeats), _median(ours, repeats)
        rows.append((f"trace writer, {tensor_bytes >> 10} KiB float32 tensors, full",
                     f"{writer / count * 1e6:.0f} us", f"{total / writer / 1e6:,.0f} MB/s",
                     f"numpy.tofile {total / tofile / 1e6:,.0f} MB/s; ratio "
                     f"{tofile / writer:.2f}"))
    return rows


# ---- the statistics kernel -----------------------------------------------------------------

def stats_rows(repeats: int) -> list[Row]:
    from layerdiff.trace.stats import batch_stats, span_stats

    rng = np.random.default_rng(0)
    rows = []
    # a pool larger than the caches, as a capture's tensors are
    for name, numel in (("bfloat16", 4 << 20), ("float32", 2 << 20)):
        if name == "bfloat16":
            values = rng.standard_normal(numel, dtype=np.float32)
            pool = [(values.view(np.uint32) >> 16).astype(np.uint16) for _ in range(16)]
        else:
            pool = [rng.standard_normal(numel, dtype=np.float32) for _ in range(16)]
        raws = [p.view(np.uint8) for p in pool]
        span_stats(raws[0], name)
        took = _median(lambda r=raws, n=name: _timed(lambda: [span_stats(x, n) for x in r]),
                       repeats)
        elements = numel * len(raws)
        rows.append((f"statistics + digest, {name}, 8 MiB tensors (128 MiB pool)",
                     f"{took / elements * 1e9:.2f} ns/element",
                     f"{elements * pool[0].itemsize / took / 1e9:.1f} GB/s", "one core"))
    buffer = rng.standard_normal(4000 * 256, dtype=np.float32).view(np.uint8)
    spans = [(i * 1024, 1024, "float32") for i in range(4000)]
    batch_stats(buffer, spans[:10])
    took = _median(lambda: _timed(lambda: batch_stats(buffer, spans)), repeats)
    rows.append(("statistics + digest, 4,000 spans of 1 KiB float32 in one batch",
                 f"{took / len(spans) * 1e6:.2f} us/span", f"{buffer.nbytes / took / 1e9:.2f} GB/s",
                 "one core"))
    return rows


# ---- index rows ----------------------------------------------------------------------------

def _llama_records(layers: int) -> list[tuple[str, str, str, tuple[int, ...]]]:
    """(site, role, arg, shape) of a Llama-shaped port's records (torchtitan's module names),
    the shapes one tensor-parallel rank of 8 holds (sizes only: the arrays written are tiny)."""
    out = []
    convert = {"input": "0", "output": "0", "grad_output": "0", "grad_input": "0"}
    modules = [("attention_norm", (1, 1024, 8192)), ("attention", (1, 8192, 8192)),
               ("attention.wq", (1, 8192, 1024)), ("attention.wk", (1, 8192, 128)),
               ("attention.wv", (1, 8192, 128)), ("attention.wo", (1, 1024, 8192)),
               ("ffn_norm", (1, 1024, 8192)), ("feed_forward", (1, 1024, 8192)),
               ("feed_forward.w1", (1, 8192, 3584)), ("feed_forward.w3", (1, 8192, 3584)),
               ("feed_forward.w2", (1, 1024, 8192)), ("", (1, 1024, 8192))]
    for layer in range(layers):
        for module, shape in modules:
            site = f"layers.{layer}" + (f".{module}" if module else "") + "#0"
            for role, arg in convert.items():
                out.append((site, role, arg, shape))
            if module.count(".") == 1 or module.endswith("norm"):
                out.append((site, "weight", "weight", (1024, 8192)))
                out.append((site, "weight_grad", "weight", (1024, 8192)))
    return out


def index_rows(folder: Path) -> list[Row]:
    from layerdiff.trace import TraceWriter

    records = _llama_records(16)
    tiny = np.zeros(4, dtype=np.float32)
    sizes = {}
    for count in (0, len(records)):
        path = folder / f"index{count}.h5"
        with TraceWriter(path, summary=True) as writer:
            for site, role, arg, _ in records[:count]:
                writer.record(site, role, tiny + len(site), arg=arg)
        sizes[count] = path.stat().st_size
        path.unlink()
    per = (sizes[len(records)] - sizes[0]) / len(records)
    return [("index row of a summary trace (gzip tables)", f"{per:.0f} bytes",
             f"{len(records)} rows", f"empty trace {sizes[0] / 1024:.0f} KiB")]


# ---- gather --------------------------------------------------------------------------------

def gather_rows(folder: Path, repeats: int) -> list[Row]:
    from layerdiff.mapping import Mapping
    from layerdiff.trace.gather import gather
    from layerdiff.trace.manifest import rank_path, write_manifest

    rules = Mapping.from_text(RULES, "record_costs.map.toml")
    rows = []
    cases = (("full", 8, 512, 512, (2, 4)), ("summary", 400, 64, 64, (2, 8, 16)))
    for kind, layers, width, tokens, worlds in cases:
        stack = stack_layers(layers, width, tokens)
        for world in worlds:
            manifest = folder / f"{kind}{world}.h5"
            files = [rank_path(manifest, rank) for rank in range(world)]
            for rank, path in enumerate(files):
                write_rank(path, stack, rank, world, summary=kind == "summary",
                           case="record_costs")
            write_manifest(manifest, files)
            rank_bytes = sum(path.stat().st_size for path in files)
            out = folder / f"gathered{kind}{world}.h5"

            def once(manifest: Path = manifest, out: Path = out) -> float:
                out.unlink(missing_ok=True)
                return _timed(lambda: gather(manifest, rules, out, workers=1))

            took = _median(once, repeats)
            records = 6 * layers
            if kind == "full":
                rows.append((f"gather, full, {world} rank files of {rank_bytes / world / 2**20:.0f}"
                             f" MiB ({records} records each)", f"{took / records * 1e6:.0f} us",
                             f"{rank_bytes / took / 1e6:,.0f} MB/s of rank files in",
                             f"{out.stat().st_size / took / 1e6:,.0f} MB/s gathered out"))
            else:
                rows.append((f"gather, summary, {world} rank files of {records} records",
                             f"{took / (records * world) * 1e6:.1f} us per record and rank",
                             f"{records * world / took:,.0f} record-ranks/s",
                             f"{took:.2f} s"))
            out.unlink()
            for path in [*files, manifest]:
                path.unlink()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(dir=".", prefix="record_costs_") as name:
        folder = Path(name)
        rows = [*recorder_rows(folder, args.repeats), *hooked_rows(folder, args.repeats),
                *writer_rows(folder, args.repeats), *stats_rows(args.repeats),
                *index_rows(folder), *gather_rows(folder, args.repeats)]
    print(f"medians of {args.repeats}; OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '')}; "
          f"load average {os.getloadavg()[0]:.1f}; {time.perf_counter() - started:.0f} s\n")
    print("| what | per record | throughput | note |")
    print("| --- | ---: | ---: | --- |")
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
