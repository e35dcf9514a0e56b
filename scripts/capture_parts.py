#!/usr/bin/env python
"""Where a capture's time goes on the capturing thread, per step, beside the bare step.

Times each part of the hot path with exclusive timers (a part's time excludes the parts it
calls): the module hooks, the grad_input walk, the outside-consumer walk, the backward node
hooks, the staging copies and the statistics taken on the capturing thread. Also runs variants
with one part stubbed out, interleaved with the bare step, so that the cost a part adds to the
step (its own time plus what it does to torch's threads) can be read as a difference:

- ``nostats``: ``span_stats`` answers a constant (the big tensors' statistics skipped)
- ``nostage``: ``Stager.tensor`` does nothing (hooks and walks alone, nothing recorded)

    OMP_WAIT_POLICY=PASSIVE PYTHONPATH=. python scripts/capture_parts.py \
        reference_models.transformer:reference_large --steps 2 --repeats 3
    # the hooks alone, as the capturing thread's least CPU over the bare step's:
    python scripts/capture_parts.py CASE --modes summary --variants nostage --threads 1 \
        --steps 3 --repeats 15

Timings only: the traces the stubbed variants write are wrong and are deleted.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PARTS = {  # (module, owner, attribute) -> the name printed
    ("layerdiff.capture.hooks", "ModuleRecorder", "_before"): "forward pre-hook",
    ("layerdiff.capture.hooks", "ModuleRecorder", "_after"): "forward hook",
    ("layerdiff.capture.hooks", "ModuleRecorder", "_hook_grad_inputs"): "grad_input walk",
    ("layerdiff.capture.hooks", "ModuleRecorder", "_hook_outside_consumers"): "outside walk",
    ("layerdiff.capture.hooks", "ModuleRecorder", "_on_gradients"): "node hooks (backward)",
    ("layerdiff.capture.hooks", "ModuleRecorder", "after_backward"): "after backward",
    ("layerdiff.capture.stage", "Stager", "tensor"): "staging",
    ("layerdiff.trace.stats", None, "span_stats"): "statistics (capturing thread)",
}


class ExclusiveTimers:
    """Wall time per part, each part's own (time in parts it calls is theirs)."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []   # [start, time spent in callees]

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            frame = [time.perf_counter(), 0.0]
            self._stack.append(frame)
            try:
                return fn(*args, **kwargs)
            finally:
                self._stack.pop()
                spent = time.perf_counter() - frame[0]
                self.total[name] += spent - frame[1]
                self.calls[name] += 1
                if self._stack:
                    self._stack[-1][1] += spent
        return timed


def _resolve(module_name: str, owner: str | None):
    import importlib
    module = importlib.import_module(module_name)
    return module if owner is None else getattr(module, owner)


def install(timers: ExclusiveTimers) -> list:
    undo = []
    for (module_name, owner, attr), name in PARTS.items():
        target = _resolve(module_name, owner)
        original = getattr(target, attr)
        setattr(target, attr, timers.wrap(name, original))
        undo.append((target, attr, original))
    return undo


def uninstall(undo: list) -> None:
    for target, attr, original in reversed(undo):
        setattr(target, attr, original)


def bare(spec: str, steps: int) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this thread)."""
    from layerdiff import load_case, run_case
    case = load_case(spec)
    gc.collect()
    mine, start = time.thread_time(), time.perf_counter()
    run_case(case, steps=steps)
    return time.perf_counter() - start, time.thread_time() - mine


def captured(spec: str, steps: int, summary: bool, folder: Path) -> tuple[float, float, float]:
    """(wall seconds, CPU seconds of the capturing thread, of the other threads)."""
    from layerdiff import load_case
    from layerdiff.capture.torch_capture import PreparedCapture
    case = load_case(spec)
    path = folder / "parts.h5"
    prepared = PreparedCapture(case, path, steps=steps, summary=summary)
    gc.collect()
    cpu0, mine0 = time.process_time(), time.thread_time()
    start = time.perf_counter()
    prepared.run()
    wall = time.perf_counter() - start
    mine = time.thread_time() - mine0
    path.unlink()
    return wall, mine, (time.process_time() - cpu0) - mine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("case")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--modes", nargs="*", default=["summary", "full"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: "
                        "torch's own)")
    parser.add_argument("--variants", nargs="*", default=["", "timers", "nostats", "nostage"],
                        help="'' (plain), or stubs and timers joined by '+': timers, "
                             "nostats, nostage (e.g. nostage+timers)")
    args = parser.parse_args()

    from layerdiff.capture import stage
    from layerdiff.trace import stats

    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    folder = Path(tempfile.mkdtemp(prefix="capture-parts-"))
    bare(args.case, 1)
    captured(args.case, 1, True, folder)   # numba loaded, caches warm
    constant = stats.span_stats(__import__("numpy").zeros(16, "uint8"), "float32")
    variants = ["bare"] + [f"{m}+{v}".rstrip("+") for m in args.modes for v in args.variants]
    wall: dict[str, list[float]] = defaultdict(list)
    others: dict[str, list[float]] = defaultdict(list)
    mine: dict[str, list[float]] = defaultdict(list)
    timers = {mode: ExclusiveTimers() for mode in args.modes}
    for _ in range(args.repeats):
        for variant in variants:
            if variant == "bare":
                seconds, cpu = bare(args.case, args.steps)
                wall[variant].append(seconds)
                mine[variant].append(cpu)
                continue
            mode, _, rest = variant.partition("+")
            changes = set(rest.split("+")) - {""}
            undo = []
            if "timers" in changes:
                undo += install(timers[mode])
            if "nostats" in changes:
                undo.append((stats, "span_stats", stats.span_stats))
                stats.span_stats = lambda raw, name: constant
            if "nostage" in changes:
                undo.append((stage.Stager, "tensor", stage.Stager.tensor))
                stage.Stager.tensor = lambda self, *a: None
            try:
                seconds, cpu, other = captured(args.case, args.steps, mode == "summary",
                                               folder)
            finally:
                uninstall(undo)
            wall[variant].append(seconds)
            mine[variant].append(cpu)
            others[variant].append(other)
    os.rmdir(folder)
    per_step = {v: 1000 * statistics.median(t) / args.steps for v, t in wall.items()}
    print(f"{args.case}: {args.steps} steps x {args.repeats} repeats, ms per step (median)")
    for variant in variants:
        cpu = 1000 * statistics.median(others[variant]) / args.steps if others[variant] else None
        extra = f"  other threads' CPU {cpu:7.1f}" if cpu is not None else ""
        ratio = per_step[variant] / per_step["bare"]
        # the least CPU the capturing thread took: robust to other jobs on the machine
        least = 1000 * (min(mine[variant]) - min(mine["bare"])) / args.steps
        added = f"  capturing thread CPU over bare (min) {least:7.2f}" if variant != "bare" else ""
        print(f"  {variant:24s} {per_step[variant]:8.1f}  x{ratio:.2f}{extra}{added}")
    runs = args.repeats * args.steps
    for mode, timed in timers.items():
        if not timed.calls:
            continue
        print(f"  {mode}: exclusive time per step on the capturing thread (+timers runs):")
        for name in PARTS.values():
            if timed.calls[name]:
                print(f"    {name:32s} {1000 * timed.total[name] / runs:8.2f} ms"
                      f"  {timed.calls[name] // runs:6d} calls")


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    main()
