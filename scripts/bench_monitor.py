#!/usr/bin/env python
"""The monitor's cost, side by side in one run: bare training steps vs monitored ones.

For each case: a plain training loop (zero_grad, forward, loss, backward, optimizer step) run
bare, under ``layerdiff.monitor(every=1)`` and under ``layerdiff.monitor(every=10)``,
interleaved repeat by repeat so that machine drift hits all alike; medians of the repeats, as
ratios to the bare loop, of wall time and of this process's CPU time (on a shared machine the
CPU time is the steadier measure of what the monitor adds). The steps are timed inside the
``with`` block; writing the window at its end is timed apart (``write ms``: once per run, not
per step). With ``--peers``, msprobe's
statistics mode (module-level L0 forward and backward statistics), where it is installed, in
its own process against a bare loop timed in that process.

    OMP_WAIT_POLICY=PASSIVE python scripts/bench_monitor.py
    OMP_WAIT_POLICY=PASSIVE python scripts/bench_monitor.py --steps 20 --repeats 7 --peers
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CASES = [
    "reference_models.transformer:reference_large",
    "reference_models.transformer:reference",
]


def _quiet_gc() -> None:
    """Collect and freeze now: a full collection over torch's objects takes ~90 ms here and
    would otherwise land at random inside one timed run or another."""
    gc.collect()
    gc.freeze()


class Loop:
    """One case's model, optimizer and data, reused by every mode. ``rewind`` puts the
    weights and the optimizer's state back where ``keep`` took them, so that every timed run
    times the same steps: a model trained on drifts in speed (measured: the small
    transformer's step took 12 ms of CPU at step 50, 20 ms at step 350, and 13 ms again with
    ``torch.set_flush_denormal(True)``), which would favour whichever mode runs later."""

    def __init__(self, spec: str) -> None:
        from layerdiff import load_case
        self.case = load_case(spec)
        params = [p for p in self.case.model.parameters() if p.requires_grad]
        self.optimizer = self.case.optimizer(params)
        self._kept: tuple[dict, dict] | None = None

    def keep(self) -> None:
        import copy
        self._kept = (copy.deepcopy(self.case.model.state_dict()),
                      copy.deepcopy(self.optimizer.state_dict()))

    def rewind(self) -> None:
        if self._kept is not None:
            self.case.model.load_state_dict(self._kept[0])
            self.optimizer.load_state_dict(self._kept[1])

    def one_step(self) -> None:
        case = self.case
        loss = case.loss_fn(case.call_model())
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def bare(self, steps: int) -> float:
        return self.bare_times(steps)[0]

    def bare_times(self, steps: int) -> tuple[float, float]:
        """(wall seconds, this process's CPU seconds) of ``steps`` bare steps."""
        _quiet_gc()
        start, cpu = time.perf_counter(), time.process_time()
        for _ in range(steps):
            self.one_step()
        return time.perf_counter() - start, time.process_time() - cpu

    def monitored(self, steps: int, every: int, path: Path) -> tuple[float, float, float]:
        """(wall seconds of the steps, their CPU seconds, seconds writing the file at the
        end)."""
        import layerdiff
        _quiet_gc()
        with layerdiff.monitor(self.case.model, path, every=every) as m:
            start, cpu = time.perf_counter(), time.process_time()
            for _ in range(steps):
                self.one_step()
                m.step()
            stepped, cpu = time.perf_counter() - start, time.process_time() - cpu
        written = time.perf_counter() - start - stepped
        path.unlink()
        return stepped, cpu, written


def measure(spec: str, steps: int, repeats: int, directory: Path) -> dict:
    loop = Loop(spec)
    path = directory / "monitor.h5"
    loop.bare(2)  # warm-up: allocator, first calls, the statistics kernel's load
    loop.monitored(2, 1, path)
    loop.keep()
    wall: dict[str, list[float]] = {"bare": [], "every1": [], "every10": []}
    cpu: dict[str, list[float]] = {"bare": [], "every1": [], "every10": []}
    writes = []
    modes = ["bare", "every1", "every10"]
    for repeat in range(repeats):
        for mode in modes[repeat % 3:] + modes[:repeat % 3]:  # each mode first in turn
            loop.rewind()
            if mode == "bare":
                seconds, used = loop.bare_times(steps)
            else:
                seconds, used, written = loop.monitored(steps, int(mode[5:]), path)
                if mode == "every1":
                    writes.append(written)
            wall[mode].append(seconds)
            cpu[mode].append(used)
    bare, bare_cpu = statistics.median(wall["bare"]), statistics.median(cpu["bare"])
    return {"case": spec, "steps": steps, "repeats": repeats,
            "bare_ms": 1000 * bare / steps,
            "every1_x": statistics.median(wall["every1"]) / bare,
            "every10_x": statistics.median(wall["every10"]) / bare,
            "every1_cpu_x": statistics.median(cpu["every1"]) / bare_cpu,
            "every10_cpu_x": statistics.median(cpu["every10"]) / bare_cpu,
            "write_ms": 1000 * statistics.median(writes)}


def msprobe_ratio(spec: str, steps: int, repeats: int, directory: Path,
                  mode: str = "statistics") -> float:
    """msprobe over a bare loop, in a fresh process (its debugger and monitor are one per
    process): ``statistics`` (PrecisionDebugger, L0) or ``monitor`` (TrainerMon: module
    inputs and outputs, weights and weight gradients, norm/min/max/mean/NaN count); NaN where
    it does not run."""
    out = subprocess.run([sys.executable, __file__, f"--child-msprobe-{mode}", spec,
                          str(steps), str(repeats), str(directory)], capture_output=True,
                         text=True, check=False)
    try:
        return float(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        print(f"  msprobe did not run on {spec}: {out.stderr.strip().splitlines()[-1:]}",
              file=sys.stderr)
        return float("nan")


def _msprobe_child(spec: str, steps: int, repeats: int, directory: str) -> None:
    from msprobe.pytorch import PrecisionDebugger
    loop = Loop(spec)
    loop.bare(2)
    config = Path(directory) / "msprobe-statistics.json"
    config.write_text(json.dumps({"task": "statistics", "dump_path": str(Path(directory) / "ms"),
                                  "rank": [], "step": [], "level": "L0"}))
    debugger = PrecisionDebugger(config_path=str(config))
    loop.keep()

    def probed() -> float:
        loop.rewind()
        _quiet_gc()
        start = time.perf_counter()
        for _ in range(steps):
            debugger.start(model=loop.case.model)
            loop.one_step()
            debugger.stop()
            debugger.step()
        return time.perf_counter() - start

    bare, probe = [], []
    for _ in range(repeats):
        loop.rewind()
        bare.append(loop.bare(steps))
        probe.append(probed())
    print(statistics.median(probe) / statistics.median(bare))


def _msprobe_monitor_child(spec: str, steps: int, repeats: int, directory: str) -> None:
    import os
    os.environ["MONITOR_OUTPUT_DIR"] = str(Path(directory) / "msprobe-monitor")
    from msprobe.pytorch import TrainerMon
    loop = Loop(spec)
    loop.bare(2)
    config = Path(directory) / "msprobe-monitor.json"
    config.write_text(json.dumps({
        "targets": {}, "all_xy": True, "xy_distribution": True, "wg_distribution": True,
        "param_distribution": True, "ops": ["norm", "min", "max", "mean", "nans"],
        "format": "csv", "step_interval": 1}))
    loop.keep()

    def rewound() -> float:
        loop.rewind()
        return loop.bare(steps)

    # TrainerMon cannot be switched off once set: the bare loops first, then the monitored
    bare = [rewound() for _ in range(repeats)]
    monitor = TrainerMon(str(config), params_have_main_grad=False)
    monitor.set_monitor(loop.case.model, grad_acc_steps=1, optimizer=loop.optimizer)
    loop.bare(2)
    probe = [rewound() for _ in range(repeats)]  # its optimizer hook ends each step
    print(statistics.median(probe) / statistics.median(bare))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1].startswith("--child-msprobe-"):
        child = (_msprobe_child if sys.argv[1].endswith("statistics")
                 else _msprobe_monitor_child)
        child(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--steps", type=int, default=20, help="steps per timed run")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--peers", action="store_true", help="msprobe too, where installed")
    parser.add_argument("--json", type=Path, help="write the rows as JSON too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-monitor-") as tmp:
        directory = Path(tmp)
        rows = []
        for spec in args.cases:
            row = measure(spec, args.steps, args.repeats, directory)
            if args.peers:
                for mode in ("statistics", "monitor"):
                    row[f"msprobe_{mode}_x"] = msprobe_ratio(spec, args.steps, args.repeats,
                                                             directory, mode)
            rows.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    peers = " msprobe statistics x | msprobe monitor x |" if args.peers else ""
    print("| case | bare step ms | monitor every=1 x | monitor every=10 x | every=1 CPU x | "
          f"every=10 CPU x | write ms |{peers}")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
          + (" ---: | ---: |" if args.peers else ""))
    for row in rows:
        extra = (f" {row['msprobe_statistics_x']:.2f} | {row['msprobe_monitor_x']:.2f} |"
                 if args.peers else "")
        print(f"| {row['case']} | {row['bare_ms']:.1f} | {row['every1_x']:.3f} | "
              f"{row['every10_x']:.3f} | {row['every1_cpu_x']:.3f} | "
              f"{row['every10_cpu_x']:.3f} | {row['write_ms']:.0f} |{extra}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
