#!/usr/bin/env python
"""Capture overhead, side by side in one run: bare step vs summary and full capture.

For each case: the bare training step (median over repeats, interleaved with the captures so
machine drift hits all alike), capture with --summary and with tensors as ratios to it, bytes
recorded per step, and peak memory over the bare run (each mode in its own process). Then the
writer's rate against numpy.tofile of the same bytes to the same disk.

    python scripts/bench_capture.py                    # the bundled cases
    python scripts/bench_capture.py --steps 3 --repeats 5 --cases reference_models.mlp:reference
    python scripts/bench_capture.py --peers            # torchlens / msprobe too, if installed
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CASES = [
    "reference_models.mlp:reference",
    "reference_models.transformer:reference",
    "reference_models.transformer:reference_large",
    "reference_models.bench:deep_narrow",
]


def _quiet_gc() -> None:
    """Collect now and freeze what exists: a full collection over torch's ~300k objects takes
    ~90 ms here and otherwise lands at random inside one timed run or another."""
    gc.collect()
    gc.freeze()


def time_bare(spec: str, steps: int) -> float:
    from layerdiff import load_case, run_case
    case = load_case(spec)
    _quiet_gc()
    start = time.perf_counter()
    run_case(case, steps=steps)
    return time.perf_counter() - start


def time_capture(spec: str, steps: int, summary: bool, directory: Path) -> tuple[float, int]:
    from layerdiff import load_case
    from layerdiff.capture.torch_capture import PreparedCapture
    case = load_case(spec)
    path = directory / ("summary.h5" if summary else "full.h5")
    prepared = PreparedCapture(case, path, steps=steps, summary=summary)
    _quiet_gc()
    start = time.perf_counter()
    prepared.run()  # all steps, the writer drained, the file published
    elapsed = time.perf_counter() - start
    recorded = prepared.recorder.bytes_submitted
    path.unlink()
    return elapsed, recorded


def child_peak_rss(spec: str, mode: str, steps: int, directory: Path) -> float:
    """Peak RSS (MiB) of a fresh process running one mode (bare, summary or full)."""
    out = subprocess.run([sys.executable, __file__, "--child", "rss", mode, spec, str(steps),
                          str(directory)], capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def _rss_child(mode: str, spec: str, steps: int, directory: Path) -> None:
    if mode == "bare":
        time_bare(spec, steps)
    else:
        time_capture(spec, steps, mode == "summary", directory)
    # VmHWM, not ru_maxrss: ru_maxrss survives exec and reports the forking parent's peak
    with open("/proc/self/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM"))
    print(peak_kib / 1024)


def writer_rate(total_bytes: int, tensor_bytes: int, directory: Path) -> tuple[float, float]:
    """GB/s of the trace writer and of numpy.tofile, for the same bytes to the same disk."""
    from layerdiff.trace import TraceWriter
    count = max(1, total_bytes // tensor_bytes)
    block = np.random.default_rng(0).standard_normal(tensor_bytes // 4).astype(np.float32)
    raw_path, trace_path = directory / "raw.bin", directory / "rate.h5"
    start = time.perf_counter()
    with open(raw_path, "wb") as handle:
        for _ in range(count):
            block.tofile(handle)
    raw = count * block.nbytes / (time.perf_counter() - start) / 1e9
    start = time.perf_counter()
    with TraceWriter(trace_path) as writer:
        for i in range(count):
            writer.record(f"layer{i}#0", "output", block)
    ours = count * block.nbytes / (time.perf_counter() - start) / 1e9
    raw_path.unlink()
    trace_path.unlink()
    return ours, raw


def peer_ratios(spec: str, steps: int, repeats: int, directory: Path) -> dict[str, float]:
    """Peers' time as a ratio to the bare step, each measured in its own process.

    TorchLens wraps torch functions for good on first use and msprobe's debugger is one per
    process, so each peer gets a fresh process that times the bare step first, then the peer.
    """
    ratios = {}
    for peer in ("torchlens", "msprobe-statistics", "msprobe-tensor"):
        out = subprocess.run([sys.executable, __file__, "--child", "peer", peer, spec,
                              str(steps), str(repeats), str(directory)],
                             capture_output=True, text=True, check=False)
        try:
            ratios[peer] = float(out.stdout.strip().splitlines()[-1])
        except (IndexError, ValueError):
            ratios[peer] = float("nan")
            print(f"  {peer} did not run on {spec}: {out.stderr.strip().splitlines()[-1:]}",
                  file=sys.stderr)
    return ratios


def _peer_child(peer: str, spec: str, steps: int, repeats: int, directory: str) -> None:
    from layerdiff import load_case, run_case
    case = load_case(spec)
    bare = min(_timed(lambda: run_case(case, steps=steps)) for _ in range(repeats))
    args = list(case.inputs) if isinstance(case.inputs, tuple) else []
    kwargs = case.inputs if isinstance(case.inputs, dict) else {}
    if peer == "torchlens":
        import torchlens

        def one_run() -> None:
            for _ in range(steps):  # forward activations only, kept in RAM, as TorchLens does
                torchlens.trace(case.model, input_args=args, input_kwargs=kwargs)
    else:
        from msprobe.pytorch import PrecisionDebugger
        config = Path(directory) / f"{peer}.json"
        config.write_text(json.dumps({
            "task": peer.split("-")[1], "dump_path": str(Path(directory) / peer), "rank": [],
            "step": [], "level": "L0"}))
        debugger = PrecisionDebugger(config_path=str(config))

        def one_run() -> None:
            # module-level forward and backward dumps, one debugger step per training step
            optimizer = case.optimizer(case.model.parameters()) if case.optimizer else None
            for _ in range(steps):
                debugger.start(model=case.model)
                loss = case.loss_fn(case.call_model())
                loss.backward()
                if optimizer:
                    optimizer.step()
                    optimizer.zero_grad()
                debugger.stop()
                debugger.step()
    peer_time = min(_timed(one_run) for _ in range(repeats))
    print(peer_time / bare)


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-RSS processes")
    parser.add_argument("--peers", action="store_true", help="also time torchlens / msprobe")
    parser.add_argument("--json", type=Path, help="write the rows as JSON too")
    args = parser.parse_args()

    directory = Path(tempfile.mkdtemp(prefix="bench-capture-", dir=args.dir))
    rows = []
    try:
        for spec in args.cases:
            time_bare(spec, 1)  # warm-up: allocator, first-call overheads
            time_capture(spec, 1, True, directory)
            bare, summ, full = [], [], []
            recorded = 0
            for _ in range(args.repeats):
                bare.append(time_bare(spec, args.steps))
                summ.append(time_capture(spec, args.steps, True, directory)[0])
                seconds, recorded = time_capture(spec, args.steps, False, directory)
                full.append(seconds)
            b, s, f = (statistics.median(x) for x in (bare, summ, full))
            row = {"case": spec, "bare_ms": 1000 * b / args.steps, "summary_x": s / b,
                   "full_x": f / b, "mib_per_step": recorded / args.steps / 2**20,
                   "capture_gbs": recorded / f / 1e9}
            if not args.no_memory:
                base = child_peak_rss(spec, "bare", args.steps, directory)
                row["extra_rss_summary_mib"] = child_peak_rss(spec, "summary", args.steps,
                                                              directory) - base
                row["extra_rss_full_mib"] = child_peak_rss(spec, "full", args.steps,
                                                           directory) - base
            if args.peers:
                row.update(peer_ratios(spec, args.steps, args.repeats, directory))
            rows.append(row)
            print(_format_row(row), flush=True)
        rates = []
        for total, size in ((512 * 2**20, 64 * 2**10), (512 * 2**20, 4 * 2**20)):
            ours, raw = writer_rate(total, size, directory)
            rates.append({"tensor_kib": size // 1024, "count": total // size,
                          "writer_gbs": ours, "tofile_gbs": raw, "ratio": ours / raw})
    finally:
        shutil.rmtree(directory, ignore_errors=True)

    print()
    print("| case | bare step ms | summary x | full x | MiB/step | capture GB/s "
          "| +RSS summary MiB | +RSS full MiB |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['case']} | {r['bare_ms']:.1f} | {r['summary_x']:.2f} | {r['full_x']:.2f} | "
              f"{r['mib_per_step']:.1f} | {r['capture_gbs']:.2f} | "
              f"{r.get('extra_rss_summary_mib', float('nan')):.0f} | "
              f"{r.get('extra_rss_full_mib', float('nan')):.0f} |")
    print()
    print("| writer test | tensors | trace writer GB/s | numpy.tofile GB/s | ratio |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for r in rates:
        print(f"| {r['tensor_kib']} KiB tensors | {r['count']} | {r['writer_gbs']:.2f} | "
              f"{r['tofile_gbs']:.2f} | {r['ratio']:.2f} |")
    if args.peers:
        print()
        print("| case | layerdiff summary x | layerdiff full x | torchlens x (fwd only, RAM) | "
              "msprobe L0 statistics x | msprobe L0 tensor x |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for r in rows:
            print(f"| {r['case']} | {r['summary_x']:.2f} | {r['full_x']:.2f} | "
                  f"{r['torchlens']:.2f} | {r['msprobe-statistics']:.2f} | "
                  f"{r['msprobe-tensor']:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"capture": rows, "writer": rates}, indent=1))


def _format_row(row: dict) -> str:
    return "  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in row.items())


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # one measurement in a fresh process
        what, rest = sys.argv[2], sys.argv[3:]
        if what == "rss":
            _rss_child(rest[0], rest[1], int(rest[2]), Path(rest[3]))
        else:
            _peer_child(rest[0], rest[1], int(rest[2]), int(rest[3]), rest[4])
    else:
        main()
