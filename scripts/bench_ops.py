#!/usr/bin/env python
"""Op-level capture cost, side by side in one run: bare step, module-level capture, --ops.

For each case, in one process with one torch thread, interleaved repeats (the order reversed
every other repeat, so machine drift hits all modes alike), medians: the bare training step;
module-level capture (full and --summary); --ops on one attention module; --ops '*' (full and
--summary); --ops '*' --ops-all. Per mode: time per step as a ratio to the bare step, records
and staged bytes per step, file bytes per step, op sites per step, and the cost of each record
a mode adds over its base (modules over the bare step; --ops over modules of the same kind),
and the time from the last step's end to the published file (writer drained, file closed).

--peers times TorchLens (every op's output forward, and with save_grads=True the gradient at
every op's output backward, in RAM) in its own process against a bare step timed there.
--profile runs ablations of one case (the recorder's classes patched in this process only: no
op recorded, writer stubbed, the recorder's own torch calls outside the mode), counts the
__torch_function__ calls of one step, and splits a cProfile of the capturing thread and of the
two writer threads.

    python scripts/bench_ops.py                        # the default cases (~3 minutes)
    python scripts/bench_ops.py --cases reference_models.transformer:reference --repeats 3
    python scripts/bench_ops.py --cases 'pkg.mod:case=blocks.0.attn'   # SPEC=GLOB: one module
    python scripts/bench_ops.py --peers                # torchlens, every op, fwd (+ bwd)
    python scripts/bench_ops.py --profile              # where one --ops '*' step spends time
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# bench_capture's helpers: the bare-step timer and its GC hygiene (_quiet_gc is private there).
from bench_capture import _quiet_gc, time_bare

# spec -> (the one module for --ops, steps, repeats). Small cases run 10 steps: publishing the
# file costs ~50 ms per capture, which 3 steps of a 5 ms model would not amortize. The large
# case writes ~3 GB per step under --ops '*', so 1 step x 3 repeats keeps the run near 3 min.
DEFAULT_CASES: dict[str, tuple[str, int, int]] = {
    "reference_models.op_bugs:reference": ("blocks.0.attn", 10, 5),
    "reference_models.transformer:reference": ("encoder.layers.0.self_attn", 10, 5),
    "reference_models.transformer:reference_large": ("encoder.layers.0.self_attn", 1, 3),
}
PROFILE_CASE = "reference_models.transformer:reference"


@dataclass(frozen=True)
class Mode:
    key: str
    label: str
    options: dict[str, Any] | None   # PreparedCapture keywords; None: the bare step
    base: str | None = None          # the mode its extra records are costed against


def modes(glob: str) -> list[Mode]:
    return [
        Mode("bare", "bare", None),
        Mode("modules", "modules", {}, "bare"),
        Mode("modules_summary", "modules --summary", {"summary": True}, "bare"),
        Mode("ops_one", "--ops ONE", {"ops": [glob]}, "modules"),
        Mode("ops_all", "--ops '*'", {"ops": ["*"]}, "modules"),
        Mode("ops_all_summary", "--ops '*' --summary", {"ops": ["*"], "summary": True},
             "modules_summary"),
        Mode("ops_all_views", "--ops '*' --ops-all", {"ops": ["*"], "ops_all": True},
             "modules"),
    ]


@dataclass
class Sample:
    """What one capture recorded (the same in every repeat: only the first is kept)."""

    records: int = 0
    staged_bytes: int = 0
    file_bytes: int = 0
    op_sites: int = 0       # op sites of step 0
    sites: int = 0          # all sites (module and op) of step 0
    close_seconds: float = 0.0   # after the last step: the writer drained, the file published


def time_mode(spec: str, steps: int, options: dict[str, Any], directory: Path,
              count: bool) -> tuple[float, Sample]:
    """Seconds for ``steps`` captured steps (writer drained, file published; setup excluded)."""
    from layerdiff import load_case
    from layerdiff.capture import torch_capture
    case = load_case(spec)
    path = directory / "ops.h5"
    prepared = torch_capture.PreparedCapture(case, path, steps=steps, **options)
    run_case, spans = torch_capture.run_case, []

    def timed_steps(*args: Any, **kwargs: Any) -> Any:
        begin = time.perf_counter()
        try:
            return run_case(*args, **kwargs)
        finally:
            spans.append(time.perf_counter() - begin)

    _quiet_gc()
    with _patched(torch_capture, run_case=timed_steps):
        start = time.perf_counter()
        prepared.run()
        elapsed = time.perf_counter() - start
    sample = Sample(prepared.recorder.seq, prepared.recorder.bytes_submitted,
                    path.stat().st_size, close_seconds=elapsed - sum(spans))
    if count:
        sample.sites, sample.op_sites = _count_sites(path)
    path.unlink()
    return elapsed, sample


def _count_sites(path: Path) -> tuple[int, int]:
    from layerdiff import open_trace
    from layerdiff.trace import schema
    with open_trace(path) as trace:
        sites = trace.sites
        first = sites[sites["step"] == sites["step"].min()]["site"]
        return len(first), int(sum(schema.is_op_site(site) for site in first))


def bench_case(spec: str, glob: str, steps: int, repeats: int, directory: Path) -> dict:
    all_modes = modes(glob)
    time_bare(spec, 1)  # warm-up: allocator, first-call overheads
    time_mode(spec, 1, {"summary": True, "ops": ["*"]}, directory, False)
    times: dict[str, list[float]] = {m.key: [] for m in all_modes}
    closes: dict[str, list[float]] = {m.key: [] for m in all_modes}
    samples: dict[str, Sample] = {}
    for repeat in range(repeats):
        order = all_modes if repeat % 2 == 0 else list(reversed(all_modes))
        for mode in order:
            if mode.options is None:
                times[mode.key].append(time_bare(spec, steps))
                continue
            seconds, sample = time_mode(spec, steps, mode.options, directory,
                                        count=mode.key not in samples)
            times[mode.key].append(seconds)
            closes[mode.key].append(sample.close_seconds)
            samples.setdefault(mode.key, sample)
    median = {key: statistics.median(values) / steps for key, values in times.items()}
    bare = median["bare"]
    rows = []
    for mode in all_modes:
        sample = samples.get(mode.key, Sample())
        row: dict[str, Any] = {
            "mode": mode.label, "key": mode.key, "ms_per_step": 1000 * median[mode.key],
            "x_bare": median[mode.key] / bare, "records_per_step": sample.records / steps,
            "staged_mib_per_step": sample.staged_bytes / steps / 2**20,
            "file_mib_per_step": sample.file_bytes / steps / 2**20,
            "sites_per_step": sample.sites, "op_sites_per_step": sample.op_sites,
            "us_per_extra_record": None, "base": mode.base,
            "close_ms": 1000 * statistics.median(closes[mode.key]) if closes[mode.key] else None}
        if mode.base is not None:
            extra = (sample.records - samples.get(mode.base, Sample()).records) / steps
            if extra > 0:
                row["us_per_extra_record"] = 1e6 * (median[mode.key] - median[mode.base]) / extra
        rows.append(row)
    return {"case": spec, "ops_glob": glob, "steps": steps, "repeats": repeats,
            "bare_ms": 1000 * bare, "modes": rows}


def format_case(result: dict) -> str:
    lines = [f"{result['case']}: bare step {result['bare_ms']:.1f} ms",
             f"{result['steps']} steps x {result['repeats']} repeats; ONE = {result['ops_glob']}",
             "",
             "| mode | ms/step | x bare | records | staged MiB | file MiB | op sites "
             "| µs/extra rec | close ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in result["modes"]:
        if r["key"] == "bare":
            lines.append(f"| bare | {r['ms_per_step']:.1f} | 1.00 | | | | | | |")
            continue
        cost = r["us_per_extra_record"]
        lines.append(
            f"| {r['mode']} | {r['ms_per_step']:.1f} | {r['x_bare']:.2f} | "
            f"{r['records_per_step']:.0f} | {r['staged_mib_per_step']:.1f} | "
            f"{r['file_mib_per_step']:.1f} | {r['op_sites_per_step']} | "
            f"{'' if cost is None else f'{cost:.0f}'} | {r['close_ms']:.0f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- peers: torchlens


def peer_torchlens(spec: str, steps: int, repeats: int) -> dict | None:
    """TorchLens in its own process (it wraps torch's functions for good on first use)."""
    out = subprocess.run([sys.executable, __file__, "--child", "torchlens", spec, str(steps),
                          str(repeats)], capture_output=True, text=True, check=False)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        tail = out.stderr.strip().splitlines()[-3:]
        print(f"  torchlens did not run on {spec}: {tail}", file=sys.stderr)
        return None


def _torchlens_child(spec: str, steps: int, repeats: int) -> None:
    import torch
    import torchlens
    from torchlens.options import CaptureOptions

    from layerdiff import load_case, run_case, seed_everything
    torch.set_num_threads(1)
    args = lambda case: list(case.inputs) if isinstance(case.inputs, tuple) else []  # noqa: E731
    kwargs = lambda case: case.inputs if isinstance(case.inputs, dict) else {}  # noqa: E731
    facts: dict[str, Any] = {}

    def bare() -> None:
        run_case(load_case(spec), steps=steps)

    def forward_only(case) -> None:
        for _ in range(steps):  # forward activations only, in RAM: bench_capture's peer
            torchlens.trace(case.model, input_args=args(case), input_kwargs=kwargs(case))

    def training(case) -> None:
        # every op's output forward, the gradient at every op's output backward
        # (save_grads=True, Trace.log_backward), then the optimizer step: one training step
        seed_everything(case.seed)
        params = [p for p in case.model.parameters() if p.requires_grad]
        optimizer = case.optimizer(params) if case.optimizer else None
        for _ in range(steps):
            case.model.zero_grad(set_to_none=True)
            trace = torchlens.trace(case.model, input_args=args(case),
                                    input_kwargs=kwargs(case),
                                    capture=CaptureOptions(save_grads=True))
            trace.log_backward(case.loss_fn(trace.reconstruct_output()))
            facts.update(forward_ops=int(trace.num_ops),
                         grads_saved=int(trace.num_saved_grad_ops),
                         activation_bytes=int(trace.saved_activation_memory),
                         gradient_bytes=int(trace.saved_gradient_memory))
            if optimizer is not None:
                optimizer.step()
            del trace

    def timed(work: Callable[[], None]) -> float:
        _quiet_gc()
        start = time.perf_counter()
        work()
        return time.perf_counter() - start

    # the bare step before torchlens first wraps torch (its wrappers stay, and cost a little)
    bare()
    bare_times = [timed(bare) for _ in range(repeats)]
    forward_only(load_case(spec))   # warm-up: the first call wraps torch's functions
    training(load_case(spec))
    fwd, train = [], []
    for _ in range(repeats):  # a fresh case each: the model is built outside the timed span
        fwd.append(timed(partial(forward_only, load_case(spec))))
        train.append(timed(partial(training, load_case(spec))))
    b = statistics.median(bare_times)
    print(json.dumps({"case": spec, "bare_ms": 1000 * b / steps,
                      "torchlens_fwd_x": statistics.median(fwd) / b,
                      "torchlens_train_x": statistics.median(train) / b, **facts}))


def format_peers(results: list[dict], peers: dict[str, dict | None]) -> str:
    lines = ["| case | ld '*' x | ld --ops-all x | tl fwd x | tl fwd+bwd x | tl ops | tl grads "
             "| tl MiB kept |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for result in results:
        peer = peers.get(result["case"])
        by_key = {r["key"]: r for r in result["modes"]}
        ours = (f"| {result['case'].removeprefix('reference_models.')} | "
                f"{by_key['ops_all']['x_bare']:.2f} | {by_key['ops_all_views']['x_bare']:.2f}")
        if peer is None:
            lines.append(f"{ours} | did not run | | | | |")
            continue
        kept = (peer.get("activation_bytes", 0) + peer.get("gradient_bytes", 0)) / 2**20
        lines.append(f"{ours} | {peer['torchlens_fwd_x']:.2f} | {peer['torchlens_train_x']:.2f}"
                     f" | {peer.get('forward_ops', '')} | {peer.get('grads_saved', '')} | "
                     f"{kept:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- where the time goes


@contextlib.contextmanager
def _patched(owner: Any, **attributes: Any) -> Iterator[None]:
    saved = {name: owner.__dict__[name] for name in attributes}
    for name, value in attributes.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(owner, name, value)


def _without_mode(method: Callable) -> Callable:
    """``method`` with torch-function handling (the op mode) off while it runs."""
    import torch

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with torch._C.DisableTorchFunction():
            return method(*args, **kwargs)
    return wrapper


def _passthrough() -> contextlib.AbstractContextManager:
    """Mode and frames in place, no op recorded: what the dispatch alone costs."""
    from layerdiff.capture.ops import OpRecorder
    return _patched(OpRecorder, op=lambda self, func, args, kwargs: func(*args, **kwargs),
                    custom_function=lambda self, cls, args, kwargs:
                    _original_apply()(cls, *args, **kwargs))


def _recorder_out_of_mode() -> contextlib.AbstractContextManager:
    """The recorder's own torch calls (staging, module hooks, backward hooks) skip the mode."""
    from layerdiff.capture.hooks import ModuleRecorder
    from layerdiff.capture.stage import Stager
    stack = contextlib.ExitStack()
    stack.enter_context(_patched(Stager, tensor=_without_mode(Stager.tensor),
                                 value=_without_mode(Stager.value)))
    stack.enter_context(_patched(ModuleRecorder, **{
        name: _without_mode(ModuleRecorder.__dict__[name])
        for name in ("_before", "_after", "_on_gradients", "_hook_outside_consumers",
                     "after_backward")}))
    return stack


def writer_stubbed() -> contextlib.AbstractContextManager:
    """Records staged (copied into the ring) and counted, then dropped: no statistics, no
    digest, no HDF5 write, so what remains is the capturing thread's own work."""
    from layerdiff.trace.recorder import Recorder

    def submit(self, step, pass_, site, role, arg, dtype, shape, *, offset=-1, nbytes=0,
               array=None, value=""):
        self.seq += 1
        self.bytes_submitted += nbytes

    return _patched(Recorder, reserve=lambda self, nbytes: 0, submit=submit,
                    submit_site=lambda self, row: None)


def _ablations(glob: str) -> list[tuple[str, dict[str, Any] | None, Callable]]:
    """(name, capture options or None for the bare step, context that patches the classes)."""
    plain, every = contextlib.nullcontext, {"ops": ["*"]}
    return [
        ("bare", None, plain),
        ("modules", {}, plain),
        ("modules, writer stubbed (capturing thread only)", {}, writer_stubbed),
        ("--ops ONE", {"ops": [glob]}, plain),
        ("--ops ONE, no op recorded (mode + frames only)", {"ops": [glob]}, _passthrough),
        ("--ops '*'", every, plain),
        ("--ops '*', no op recorded (mode + frames only)", every, _passthrough),
        ("--ops '*', writer stubbed (capturing thread only)", every, writer_stubbed),
        ("--ops '*', the recorder's own torch calls skip the mode", every,
         _recorder_out_of_mode),
    ]


def _original_apply() -> Callable:
    from layerdiff.capture import ops
    return ops._original_apply.__func__


def mode_calls(spec: str, directory: Path) -> dict[str, Any]:
    """__torch_function__ calls of one --ops '*' step: in recorded code, and everywhere else."""
    from layerdiff import load_case
    from layerdiff.capture import ops
    from layerdiff.capture.torch_capture import PreparedCapture
    inside, outside = Counter(), Counter()
    original = ops._Mode.__torch_function__

    def counting(self, func, types, args=(), kwargs=None):
        frames = self.recorder.frames
        name = ops.op_name(func)
        if name == "__get__":  # a property read: x.shape, x.grad_fn
            name = "." + getattr(getattr(func, "__self__", None), "__name__", "?")
        (inside if frames and frames[-1].recording else outside)[name] += 1
        return original(self, func, types, args, kwargs)

    with _patched(ops._Mode, __torch_function__=counting):
        prepared = PreparedCapture(load_case(spec), directory / "count.h5", steps=1, ops=["*"])
        prepared.run()
    (directory / "count.h5").unlink()
    return {"in_recorded_code": sum(inside.values()), "elsewhere": sum(outside.values()),
            "elsewhere_top": outside.most_common(12), "recorded_records": prepared.recorder.seq}


def profile_step(spec: str, steps: int, directory: Path) -> dict[str, Any]:
    """cProfile of ``steps`` --ops '*' steps with the writer stubbed (after a warm-up), so that
    the wall time it charges to functions is the capturing thread's own, not waits for the GIL
    held by the writer threads; file close excluded."""
    from layerdiff import load_case
    from layerdiff.capture import hooks, ops, stage, torch_capture
    from layerdiff.capture.torch_capture import PreparedCapture
    with writer_stubbed():
        time_mode(spec, 1, {"ops": ["*"]}, directory, False)
        prepared = PreparedCapture(load_case(spec), directory / "profile.h5", steps=steps,
                                   ops=["*"])
    profiler = cProfile.Profile()
    original_run_case = torch_capture.run_case

    def profiled(*args: Any, **kwargs: Any) -> Any:
        profiler.enable()
        try:
            return original_run_case(*args, **kwargs)
        finally:
            profiler.disable()

    with _patched(torch_capture, run_case=profiled), writer_stubbed():
        prepared.run()
    (directory / "profile.h5").unlink()
    stats = pstats.Stats(profiler).stats
    total = max(ct for (_, _, name), (_, _, _, ct, _) in stats.items() if name == "run_case")

    def entry(module: Any, qualname: str) -> tuple:
        code = module
        for part in qualname.split("."):
            code = getattr(code, part)
        code = code.__code__
        return (code.co_filename, code.co_firstlineno, code.co_name)

    def inclusive(key: tuple) -> tuple[int, float]:
        _, calls, _, ct, _ = stats.get(key, (0, 0, 0, 0.0, {}))
        return calls, ct

    record = entry(ops, "OpRecorder._record")
    # what _record spends running the op itself (callees outside layerdiff)
    op_compute = sum(callers[record][3] for key, (_, _, _, _, callers) in stats.items()
                     if record in callers and "layerdiff" not in key[0])
    parts = {
        "module hooks, forward (ModuleRecorder._before/_after, incl. their staging)":
            [entry(hooks, "ModuleRecorder._before"), entry(hooks, "ModuleRecorder._after")],
        "op records, forward (OpRecorder._record less the op's own compute)": [record],
        "backward hooks (grad_output / grad_input records, incl. staging)":
            [entry(hooks, "ModuleRecorder._on_gradients")],
        "graph walk for grad_output, once a step (ModuleRecorder._hook_outside_consumers)":
            [entry(hooks, "ModuleRecorder._hook_outside_consumers")],
        "weight gradients after backward (ModuleRecorder.after_backward)":
            [entry(hooks, "ModuleRecorder.after_backward")],
        "frames (OpRecorder._push/_start/_stop/_pop)":
            [entry(ops, "OpRecorder._push"), entry(ops, "OpRecorder._start"),
             entry(ops, "OpRecorder._stop"), entry(ops, "OpRecorder._pop")],
    }
    nested = {
        "staging (Stager.tensor: detach, ring view, copy_, submit)":
            [entry(stage, "Stager.tensor")],
        "graph walk for grad_input (ModuleRecorder._hook_grad_inputs)":
            [entry(hooks, "ModuleRecorder._hook_grad_inputs")],
    }
    rows = []
    for label, keys in {**parts, **nested}.items():
        calls = sum(inclusive(k)[0] for k in keys)
        seconds = sum(inclusive(k)[1] for k in keys)
        if label.startswith("op records"):
            seconds -= op_compute
        rows.append({"part": label, "calls_per_step": calls / steps,
                     "ms_per_step": 1000 * seconds / steps, "share": seconds / total,
                     "nested": label in nested})
    return {"case": spec, "steps": steps, "profiled_ms_per_step": 1000 * total / steps,
            "parts": rows}


def profile_writer(spec: str, steps: int, directory: Path) -> dict[str, Any]:
    """cProfile of the two writer threads (statistics, I/O) during ``steps`` --ops '*' steps:
    their busiest functions by own time. Time waiting for work (a lock) is idle, not listed;
    time waiting for the GIL is charged to whatever call released it."""
    from layerdiff import load_case
    from layerdiff.capture.torch_capture import PreparedCapture
    from layerdiff.trace.recorder import Recorder
    profilers: dict[str, cProfile.Profile] = {}

    def profiled(name: str, method: Callable) -> Callable:
        def run(self: Recorder) -> None:
            profiler = profilers[name] = cProfile.Profile()
            profiler.enable()
            try:
                method(self)
            finally:
                profiler.disable()
        return run

    path = directory / "writer.h5"
    with _patched(Recorder, _run_stats=profiled("stats", Recorder._run_stats),
                  _run_io=profiled("io", Recorder._run_io)):
        prepared = PreparedCapture(load_case(spec), path, steps=steps, ops=["*"])
        start = time.perf_counter()
        prepared.run()
        wall = time.perf_counter() - start
    path.unlink()
    threads = {}
    for name, profiler in profilers.items():
        stats = pstats.Stats(profiler).stats
        idle = sum(tt for (_, _, fn), (_, _, tt, _, _) in stats.items()
                   if fn == "<method 'acquire' of '_thread.lock' objects>")
        total = max(ct for (_, _, _, ct, _) in stats.values())
        top = sorted(((tt, nc, f"{Path(file).name}:{fn}" if file != "~" else fn)
                      for (file, _, fn), (_, nc, tt, _, _) in stats.items()
                      if fn != "<method 'acquire' of '_thread.lock' objects>"), reverse=True)
        threads[name] = {"busy_ms_per_step": 1000 * (total - idle) / steps,
                         "top": [{"function": fn, "calls_per_step": nc / steps,
                                  "ms_per_step": 1000 * tt / steps} for tt, nc, fn in top[:5]]}
    return {"steps": steps, "wall_ms_per_step": 1000 * wall / steps, "threads": threads}


def profile(spec: str, glob: str, steps: int, repeats: int,
            directory: Path) -> dict[str, Any]:
    """Ablations (interleaved medians) of --ops captures, the mode's call counts, and a
    cProfile split of one profiled run."""
    time_bare(spec, 1)
    time_mode(spec, 1, {"ops": ["*"]}, directory, False)
    runs = _ablations(glob)
    times: dict[str, list[float]] = {name: [] for name, _, _ in runs}
    records: dict[str, int] = {}
    for repeat in range(repeats):
        for name, options, context in runs if repeat % 2 == 0 else list(reversed(runs)):
            if options is None:
                times[name].append(time_bare(spec, steps))
                continue
            with context():
                seconds, sample = time_mode(spec, steps, options, directory, False)
            times[name].append(seconds)
            records[name] = sample.records
    median = {name: statistics.median(values) / steps for name, values in times.items()}
    ablation = [{"run": name, "ms_per_step": 1000 * median[name],
                 "x_bare": median[name] / median["bare"],
                 "records_per_step": records.get(name, 0) / steps} for name, _, _ in runs]
    return {"case": spec, "ops_glob": glob, "steps": steps, "repeats": repeats,
            "ablation": ablation, "mode_calls": mode_calls(spec, directory),
            "cprofile": profile_step(spec, steps, directory),
            "writer": profile_writer(spec, steps, directory)}


def format_profile(result: dict[str, Any]) -> str:
    lines = [f"{result['case']}: {result['steps']} steps x {result['repeats']} repeats; "
             f"ONE = {result['ops_glob']}", "",
             "| run (one torch thread) | ms/step | x bare | records/step |",
             "| --- | ---: | ---: | ---: |"]
    for r in result["ablation"]:
        lines.append(f"| {r['run']} | {r['ms_per_step']:.1f} | {r['x_bare']:.2f} | "
                     f"{r['records_per_step']:.0f} |")
    calls = result["mode_calls"]
    top = ", ".join(f"{name} {count}" for name, count in calls["elsewhere_top"])
    lines += ["", *textwrap.wrap(
        f"__torch_function__ calls in one --ops '*' step: {calls['in_recorded_code']} in "
        f"recorded code, {calls['elsewhere']} elsewhere (top: {top})", 100), ""]
    prof = result["cprofile"]
    lines += [f"cProfile of --ops '*' with the writer stubbed, {prof['steps']} steps, "
              f"{prof['profiled_ms_per_step']:.1f} ms/step profiled (run_case only):", "",
              "| part | calls/step | ms/step | share |", "| --- | ---: | ---: | ---: |"]
    for r in prof["parts"]:
        label = ("  of which: " if r["nested"] else "") + r["part"]
        lines.append(f"| {label} | {r['calls_per_step']:.0f} | {r['ms_per_step']:.1f} | "
                     f"{100 * r['share']:.0f}% |")
    writer = result["writer"]
    lines += ["", f"Writer threads under cProfile, --ops '*', {writer['steps']} steps, "
              f"{writer['wall_ms_per_step']:.1f} ms/step wall:", "",
              "| thread | function (own time) | calls/step | ms/step |",
              "| --- | --- | ---: | ---: |"]
    for name, thread in writer["threads"].items():
        lines.append(f"| {name} | busy (all but waiting for work) | | "
                     f"{thread['busy_ms_per_step']:.1f} |")
        for top in thread["top"]:
            lines.append(f"| {name} | {top['function'][:60]} | {top['calls_per_step']:.0f} | "
                         f"{top['ms_per_step']:.1f} |")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def _parse_cases(given: list[str] | None) -> dict[str, tuple[str, int, int]]:
    if not given:
        return dict(DEFAULT_CASES)
    cases = {}
    for item in given:
        spec, _, glob = item.partition("=")
        default = DEFAULT_CASES.get(spec, ("", 3, 5))
        if not (glob or default[0]):
            raise SystemExit(f"name the one module for --ops as {spec}=GLOB")
        cases[spec] = (glob or default[0], default[1], default[2])
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="*", help="SPEC or SPEC=GLOB (GLOB: the one module)")
    parser.add_argument("--steps", type=int, help="steps per timed run (default: per case)")
    parser.add_argument("--repeats", type=int, help="interleaved repeats (default: per case)")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--peers", action="store_true", help="also time torchlens, if installed")
    parser.add_argument("--profile", nargs="?", const=PROFILE_CASE, metavar="SPEC",
                        help="ablations and a cProfile split of --ops '*' (only this)")
    parser.add_argument("--json", type=Path, help="write the results as JSON too")
    args = parser.parse_args()

    import torch
    torch.set_num_threads(1)  # 2 shared cores: one torch thread leaves one to the writer
    directory = Path(tempfile.mkdtemp(prefix="bench-ops-", dir=args.dir))
    output: dict[str, Any] = {"num_threads": 1}
    try:
        if args.profile:
            glob = DEFAULT_CASES.get(args.profile, ("*",))[0]
            output["profile"] = profile(args.profile, glob, args.steps or 10,
                                        args.repeats or 5, directory)
            print(format_profile(output["profile"]))
        else:
            results = []
            for spec, (glob, steps, repeats) in _parse_cases(args.cases).items():
                result = bench_case(spec, glob, args.steps or steps, args.repeats or repeats,
                                    directory)
                results.append(result)
                print(format_case(result), end="\n\n", flush=True)
            output["cases"] = results
            if args.peers:
                peers = {r["case"]: peer_torchlens(r["case"], r["steps"], min(r["repeats"], 3))
                         for r in results}
                output["peers"] = peers
                print(format_peers(results, peers))
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(output, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # torchlens in a fresh process
        _torchlens_child(sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        main()
