#!/usr/bin/env python
"""Diff rate, side by side in one run: the diff engine vs a plain numpy loop on the same traces.

For each size: a reference trace and a port trace of that many GB each (float32 activations,
weights and gradients of 256 KiB-16 MiB, plus ~20% of the tensors small, 4-64 KiB), the port's
values the reference's times (1 + ~1e-7 noise) so that no digest matches and every tensor is
read and compared. Then ``layerdiff.diff`` and a plain loop (``open_trace``, ``Trace.read`` of
whole tensors, the same metrics with whole-array float64 numpy) each run in a fresh process,
interleaved, medians over repeats; peak RSS (VmHWM) per process, over its RSS after imports.

    python scripts/bench_diff.py --sizes 0.05,0.2 --repeats 1      # quick
    OMP_WAIT_POLICY=PASSIVE python scripts/bench_diff.py --sizes 0.5,2,8 --repeats 3

Variants of the engine run in the same interleaved rounds (``--variants``): ``no-verify``
(``diff(verify=False)``), ``stats-numpy`` (verification's statistics in numpy,
LAYERDIFF_STATS=numpy), ``numpy`` (that and the numpy metrics, LAYERDIFF_NUMPY_METRICS=1), and
``before`` / ``before-no-verify``: the engine of another source tree given with ``--before DIR``
(e.g. ``git archive HEAD | tar -x -C DIR``), so that before and after are measured side by side
on the same traces and the same machine load. Each variant's rows are checked against the
engine's. For a diff's fixed cost: ``warm-kernel`` (numba and the kernels loaded before the
clock starts: the engine less numba's set-up), ``jit`` (numba's JIT even where
``python -m layerdiff.compare.aot`` built the kernel ahead of time), ``cli`` / ``before-cli``
(``layerdiff diff`` end to end, wall time), and ``--sizes tiny`` (2 MB of small tensors). A
second table gives each mode's phases: streaming, hints, the rest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

# a child measuring the "before" variant imports layerdiff from the tree the parent names
sys.path.insert(0, os.environ.get("BENCH_DIFF_SOURCES")
                or str(Path(__file__).resolve().parent.parent))

TARGET_RATE = 0.70      # engine GB/s over the loop's
TARGET_GBS = 1.0        # issue 15: engine GB/s of tensor data, warm cache, 2 cores
TARGET_RSS_MIB = 1024   # engine peak RSS, absolute
RTOL, ATOL = 1.3e-6, 1e-5  # float32 defaults (torch.testing.assert_close)
BATCH = 8
WIDTH = 256             # last axis of activations and weights
BASE_ELEMENTS = 5 * 2**20  # each base array: 20 MiB of float32, sliced per tensor
SMALL = (4 << 10, 64 << 10)
LARGE = (256 << 10, 16 << 20)
TINY = 0.002            # --sizes tiny: 2 MB of 4-64 KiB tensors, what a small model's diff reads
OUT_SHARE = 0.03        # tensors given 1e-5 noise, so some elements are out of tolerance
KEY = ("step", "site", "role", "arg")


# ---------------------------------------------------------------------------------------------
# Generating a trace pair


class _Data:
    """A few random base arrays; each tensor is a slice of one times a scale (cheap)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.rng = rng
        normal = rng.standard_normal(BASE_ELEMENTS, dtype=np.float32)
        self.bases = {
            "activation": normal,
            "relu": np.maximum(np.roll(normal, 12345), 0),  # half zeros, like after a ReLU
            "weight": rng.uniform(-0.05, 0.05, BASE_ELEMENTS).astype(np.float32),
            "gradient": (rng.standard_normal(BASE_ELEMENTS, dtype=np.float32) * 1e-3),
        }
        noise = rng.standard_normal(BASE_ELEMENTS, dtype=np.float32)
        self.tiny = (1 + 1e-7 * noise).astype(np.float32)   # within tolerance, digest differs
        self.large = (1 + 1e-5 * noise).astype(np.float32)  # some elements out of tolerance

    def pair(self, kind: str, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
        count = math.prod(shape)
        start = int(self.rng.integers(0, BASE_ELEMENTS - count + 1))
        ref = self.bases[kind][start:start + count] * np.float32(self.rng.uniform(0.5, 2.0))
        factors = self.large if self.rng.random() < OUT_SHARE else self.tiny
        start = int(self.rng.integers(0, BASE_ELEMENTS - count + 1))
        port = ref * factors[start:start + count]
        return ref.reshape(shape), port.reshape(shape)

    def rows(self, size: tuple[int, int]) -> int:
        """Rows of WIDTH float32 for a byte size drawn log-uniformly in ``size``."""
        nbytes = math.exp(self.rng.uniform(math.log(size[0]), math.log(size[1])))
        return max(1, round(nbytes / (4 * WIDTH)))


def _layers(data: _Data, total: int, large: tuple[int, int] = LARGE) -> list[dict]:
    """Layer shapes adding up to about ``total`` bytes per trace (forward and backward)."""
    layers, nbytes = [], 0
    while nbytes < total:
        seq = max(1, data.rows(large) // BATCH)
        layer = {"input": (BATCH, seq, WIDTH), "output": (BATCH, max(1, data.rows(large)
                                                                      // BATCH), WIDTH),
                 "weight": (data.rows(large), WIDTH)}
        if data.rng.random() < 0.8:  # small tensors: ~20% of the count, ~1% of the bytes
            layer["bias"] = (data.rows(SMALL) * WIDTH,)
        layers.append(layer)
        nbytes += 2 * 4 * sum(math.prod(s) for s in layer.values())
    return layers


def generate(ref_path: Path, port_path: Path, total: int, seed: int = 0,
             large: tuple[int, int] = LARGE) -> tuple[int, int]:
    """Write the pair; returns (tensors per trace, tensor bytes per trace). ``large`` is the
    byte range of activations and weights (``--tiny``: the small range, a small model's)."""
    from layerdiff import TraceWriter
    data = _Data(seed)
    layers = _layers(data, total, large)
    count = nbytes = 0
    meta = {"case": "bench_diff", "seed": seed}
    with TraceWriter(ref_path, meta=meta) as ref_w, TraceWriter(port_path, meta=meta) as port_w:

        def record(sites: tuple[str, str], role: str, kind: str, shape, arg: str = "0") -> None:
            nonlocal count, nbytes
            ref, port = data.pair(kind, shape)
            ref_w.record(sites[0], role, ref, arg=arg)
            port_w.record(sites[1], role, port, arg=arg)
            count += 1
            nbytes += ref.nbytes

        names = []
        for i, layer in enumerate(layers):  # forward, in execution order
            sites = (ref_w.enter(f"layers.{i}", "Linear"), port_w.enter(f"layers.{i}", "Linear"))
            names.append(sites)
            record(sites, "input", "relu" if i else "activation", layer["input"])
            record(sites, "weight", "weight", layer["weight"], "weight")
            if "bias" in layer:
                record(sites, "weight", "weight", layer["bias"], "bias")
            record(sites, "output", "activation", layer["output"])
            ref_w.exit(sites[0])
            port_w.exit(sites[1])
        for layer, sites in zip(reversed(layers), reversed(names), strict=True):  # backward
            record(sites, "grad_output", "gradient", layer["output"])
            record(sites, "grad_input", "gradient", layer["input"])
            record(sites, "weight_grad", "gradient", layer["weight"], "weight")
            if "bias" in layer:
                record(sites, "weight_grad", "gradient", layer["bias"], "bias")
    return count, nbytes


# ---------------------------------------------------------------------------------------------
# The two things measured (each in a child process)


def run_engine(ref_path: str, port_path: str, verify: bool = True) -> tuple[list[dict], int]:
    """``layerdiff.diff``; returns the metric rows and how many were decided by digest."""
    import layerdiff
    from layerdiff.compare.judge import Verdict
    rows = layerdiff.diff(ref_path, port_path, verify=verify).rows
    tensors = rows[rows["numel"] > 0]
    out = []
    for r in tensors.itertuples(index=False):
        batch = r.batch_ratio
        out.append({"step": int(r.step), "site": r.site, "role": r.role, "arg": r.arg,
                    "bytes": int(r.numel) * np.dtype(r.dtype).itemsize,
                    "max_abs": r.max_abs, "max_rel": r.max_rel, "mean_abs": r.mean_abs,
                    "rms": r.rms, "cosine": r.cosine, "max_ulp": r.max_ulp,
                    "out": round(r.frac_out * r.numel), "worst_index": r.worst_index,
                    "ratio": r.ratio, "nan_inf": [r.ref_nan, r.ref_inf, r.port_nan, r.port_inf],
                    "batch_ratio": None if batch is None else [float(x) for x in batch]})
    return out, int((rows["verdict"] == Verdict.IDENTICAL).sum())


def _ordered_bits(values: np.ndarray) -> np.ndarray:
    ints = values.view(np.int32).astype(np.int64)
    return np.where(ints < 0, np.int64(-(1 << 31)) - ints, ints)


def loop_metrics(ref: np.ndarray, port: np.ndarray, batched: bool) -> dict:
    """The engine's metrics of one float32 pair, whole-array float64 numpy."""
    a = ref.astype(np.float64).ravel()
    b = port.astype(np.float64).ravel()
    with np.errstate(invalid="ignore", over="ignore"):
        diff = np.abs(a - b)
    finite = np.isfinite(diff)
    all_finite = bool(finite.all())
    nan_inf = [0, 0, 0, 0]
    if not all_finite:  # NaN on both sides and equal infinities count as equal
        nan_inf = [int(np.isnan(a).sum()), int(np.isinf(a).sum()), int(np.isnan(b).sum()),
                   int(np.isinf(b).sum())]
        same = (a == b) | (np.isnan(a) & np.isnan(b))
        diff = np.where(finite, diff, np.where(same, 0.0, np.inf))
        both = np.isfinite(a) & np.isfinite(b)
        a, b = a[both], b[both]
    magnitude = np.abs(a) if all_finite else np.abs(ref.astype(np.float64).ravel())
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = diff / (ATOL + RTOL * magnitude)
        ratio[diff == 0] = 0.0
        rel = diff / np.maximum(magnitude, ATOL)
    worst = int(np.argmax(ratio))
    dot, aa, bb = float(np.dot(a, b)), float(np.dot(a, a)), float(np.dot(b, b))
    norms = math.sqrt(aa * bb)
    ulp = np.abs(_ordered_bits(ref.ravel()) - _ordered_bits(port.ravel()))
    if not all_finite:
        ulp[~finite] = 0
    return {"max_abs": float(diff.max()), "max_rel": float(np.nanmax(rel)),
            "mean_abs": float(diff.mean()), "rms": math.sqrt(float(np.mean(diff * diff))),
            "cosine": dot / norms if norms > 0 else (1.0 if aa == bb else 0.0),
            "max_ulp": float(ulp.max()), "out": int(np.count_nonzero(ratio > 1.0)),
            "worst_index": ",".join(str(int(i)) for i in np.unravel_index(worst, ref.shape)),
            "ratio": float(ratio[worst]), "nan_inf": nan_inf,
            "batch_ratio": ratio.reshape(ref.shape[0], -1).max(axis=1).tolist() if batched
            else None}


def run_loop(ref_path: str, port_path: str) -> tuple[list[dict], int]:
    """The plain way: whole tensors, paired by (step, site, role, arg), whole-array metrics."""
    import pandas as pd

    import layerdiff
    out = []
    with layerdiff.open_trace(ref_path) as ref, layerdiff.open_trace(port_path) as port:
        ref_index, port_index = ref.index, port.index
        port_pos = {key: pos for pos, key in enumerate(zip(*(port_index[c] for c in KEY),
                                                           strict=True))}
        tensors = ref_index[(ref_index["kind"] == "tensor") & (ref_index["segment"] >= 0)]
        for pos, key in zip(tensors.index, zip(*(tensors[c] for c in KEY), strict=True),
                            strict=True):
            a, b = ref.read(int(pos)), port.read(port_pos[key])
            batched = a.ndim >= 2 and key[2] not in ("weight", "weight_grad")
            row = dict(zip(KEY, (int(key[0]), *key[1:]), strict=True))
            row["bytes"] = a.nbytes
            row.update(loop_metrics(a, b, batched))
            out.append(row)
    pd.DataFrame(out)  # a table at the end, as the engine gives
    return out, 0


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _load_kernels() -> None:
    """numba's import and both compiled kernels' first (cached) load, done before the clock
    starts: what a diff costs in a process that already paid them (the warm-kernel mode)."""
    from layerdiff.compare.metrics import PairMetrics
    from layerdiff.trace import stats
    values = np.zeros(1 << 20, np.float32)
    PairMetrics(RTOL, ATOL, values.size).update(values, values, 0)
    stats.compiled()


def _timed_phases() -> dict[str, float]:
    """Wall seconds of the diff's phases, filled in as they run: everything before the
    streaming (opening, index and segment checks, pairing), the streaming (numba's set-up
    included when it happens there), and the hints."""
    from layerdiff.compare import engine
    phases: dict[str, float] = {}

    def timed(owner, name: str, label: str) -> None:
        function = getattr(owner, name)

        def wrapper(*args, **kwargs):
            begin = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                phases[label] = phases.get(label, 0.0) + time.perf_counter() - begin
        setattr(owner, name, wrapper)

    timed(engine._Comparer, "_stream", "stream")
    timed(engine, "attach_hints", "hints")
    return phases


def _child(mode: str, ref_path: str, port_path: str, check: str | None) -> None:
    import h5py  # noqa: F401  the same imports in both modes, before the baseline RSS
    import pandas  # noqa: F401

    import layerdiff.compare
    import layerdiff.trace  # noqa: F401
    if mode == "engine-warm-kernel":
        _load_kernels()
    phases = _timed_phases()
    numba_before = "numba" in sys.modules
    import_kib = _status_kib("VmRSS")
    usage = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if mode == "loop":
        rows, identical = run_loop(ref_path, port_path)
    else:
        rows, identical = run_engine(ref_path, port_path, verify=mode != "engine-no-verify")
    seconds = time.perf_counter() - start
    phases["other"] = seconds - sum(phases.values())
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = after.ru_utime + after.ru_stime - usage.ru_utime - usage.ru_stime  # all threads
    peak_kib = _status_kib("VmHWM")  # not ru_maxrss: that survives exec (the parent's peak)
    if check:
        Path(check).write_text(json.dumps(rows))
    print(json.dumps({"mode": mode, "seconds": seconds, "bytes": sum(r["bytes"] for r in rows),
                      "tensors": len(rows), "identical": identical, "cpu_seconds": cpu,
                      "peak_mib": peak_kib / 1024, "import_mib": import_kib / 1024,
                      "phases": phases,
                      "numba_loaded": "numba" in sys.modules and not numba_before}))


# ---------------------------------------------------------------------------------------------
# The parent: generate, measure interleaved, check agreement, print the table


def _drop_caches() -> bool:
    try:
        os.sync()
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        return True
    except OSError:
        return False


# variant: (child mode, environment, needs --before)
VARIANTS = {
    "no-verify": ("engine-no-verify", {}, False),
    "stats-numpy": ("engine", {"LAYERDIFF_STATS": "numpy"}, False),
    "numpy": ("engine", {"LAYERDIFF_STATS": "numpy", "LAYERDIFF_NUMPY_METRICS": "1"}, False),
    "before": ("engine", {}, True),
    "before-no-verify": ("engine-no-verify", {}, True),
    # numba and the kernels loaded before the clock starts: the engine minus numba's set-up
    "warm-kernel": ("engine-warm-kernel", {}, False),
    "before-warm-kernel": ("engine-warm-kernel", {}, True),
    # the kernel through numba's JIT even where `python -m layerdiff.compare.aot` built it
    "jit": ("engine", {"LAYERDIFF_AOT": "0"}, False),
    # `python -m layerdiff diff` end to end (interpreter, imports, report), wall time only
    "cli": ("cli", {}, False),
    "before-cli": ("cli", {}, True),
    # the same without the built kernel (numba's JIT), and never starting a build of it
    "jit-cli": ("cli", {"LAYERDIFF_AOT": "0"}, False),
    "before-jit-cli": ("cli", {"LAYERDIFF_AOT": "0"}, True),
}


def measure_cli(ref: Path, port: Path, env: dict[str, str] | None = None) -> dict:
    """``python -m layerdiff diff REF PORT`` end to end: interpreter start, imports, diff and
    report, the wall time a user waits (exit 1: the pair is out somewhere)."""
    sources = (env or {}).get("BENCH_DIFF_SOURCES") or str(Path(__file__).resolve().parent.parent)
    command = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv.pop(1)); "
               "from layerdiff.cli import run; sys.argv[0] = 'layerdiff'; run()", sources,
               "diff", str(ref), str(port), "--json", os.devnull]
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, check=False,
                         env={**os.environ, **(env or {})})
    seconds = time.perf_counter() - start
    if out.returncode not in (0, 1):
        raise RuntimeError(f"layerdiff diff failed:\n{out.stderr}")
    return {"mode": "cli", "seconds": seconds, "bytes": 0, "tensors": 0, "identical": 0,
            "cpu_seconds": math.nan, "peak_mib": math.nan, "import_mib": math.nan,
            "phases": {}, "numba_loaded": None}


def measure(mode: str, ref: Path, port: Path, check: Path | None, cold: bool,
            env: dict[str, str] | None = None) -> dict:
    if mode in ("cli", "before-cli"):
        return measure_cli(ref, port, env)
    if cold and not _drop_caches():
        raise PermissionError("cannot write /proc/sys/vm/drop_caches")
    command = [sys.executable, __file__, "--child", mode, str(ref), str(port)]
    if check:
        command.append(str(check))
    out = subprocess.run(command, capture_output=True, text=True, check=False,
                         env={**os.environ, **(env or {})})
    if out.returncode:
        raise RuntimeError(f"{mode} child failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare_rows(engine_file: Path, loop_file: Path) -> dict[str, float]:
    """Largest relative disagreement per metric over all rows; raises when they disagree."""
    engine = {tuple(r[k] for k in KEY): r for r in json.loads(engine_file.read_text())}
    loop = {tuple(r[k] for k in KEY): r for r in json.loads(loop_file.read_text())}
    if engine.keys() != loop.keys():
        raise AssertionError(f"engine and loop compared different records: "
                             f"{len(engine.keys() ^ loop.keys())} differ")
    worst: dict[str, float] = {}
    problems = []
    for key, e in engine.items():
        lo = loop[key]
        for name in ("max_abs", "max_rel", "mean_abs", "rms", "cosine", "max_ulp", "ratio"):
            gap = abs(e[name] - lo[name]) / max(abs(lo[name]), 1e-300)
            worst[name] = max(worst.get(name, 0.0), gap if e[name] != lo[name] else 0.0)
            if name in ("max_abs", "ratio") and gap > 1e-6:
                problems.append(f"{key} {name}: engine {e[name]!r}, loop {lo[name]!r}")
        for name in ("out", "worst_index", "nan_inf"):
            if e[name] != lo[name]:
                worst[name] = worst.get(name, 0.0) + 1
                problems.append(f"{key} {name}: engine {e[name]!r}, loop {lo[name]!r}")
        if (e["batch_ratio"] is None) != (lo["batch_ratio"] is None):
            problems.append(f"{key} batch_ratio: engine {e['batch_ratio'] is not None}, "
                            f"loop {lo['batch_ratio'] is not None}")
        elif e["batch_ratio"] is not None:
            gap = float(np.max(np.abs(np.subtract(e["batch_ratio"], lo["batch_ratio"]))
                               / np.maximum(np.abs(lo["batch_ratio"]), 1e-300)))
            worst["batch_ratio"] = max(worst.get("batch_ratio", 0.0), gap)
            if gap > 1e-6:
                problems.append(f"{key} batch_ratio differs by {gap:.2g} relative")
    if problems:
        raise AssertionError("engine and loop disagree:\n  " + "\n  ".join(problems[:20]))
    worst["rows"] = len(engine)
    return worst


def _sources() -> tuple[str, str]:
    """(commit, fingerprint of layerdiff's sources): children import the working tree, so an
    edit during a run would measure two versions of the engine."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted((root / "layerdiff").rglob("*.py")):
        digest.update(path.read_bytes())
    try:
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    return commit, digest.hexdigest()[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="0.5,2,8",
                        help="GB per trace, comma-separated; 'tiny': 2 MB of 4-64 KiB tensors "
                             "(a diff's fixed cost, also timed through the CLI end to end)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--keep", action="store_true", help="keep the traces")
    parser.add_argument("--drop-caches", action="store_true",
                        help="drop the page cache before each run (cold reads; needs root)")
    parser.add_argument("--json", type=Path, help="write the rows as JSON too")
    parser.add_argument("--variants", default="",
                        help=f"engine variants to run alongside, comma-separated: "
                             f"{', '.join(VARIANTS)}")
    parser.add_argument("--before", type=Path,
                        help="source tree (holding layerdiff/) of the 'before' variants")
    parser.add_argument("--no-loop", action="store_true",
                        help="skip the plain loop (its rate and the ratio target)")
    args = parser.parse_args()
    sizes = [TINY if s == "tiny" else float(s) for s in args.sizes.split(",")]
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"bench_diff: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    if any(VARIANTS[v][2] for v in variants) and not (
            args.before and (args.before / "layerdiff" / "__init__.py").is_file()):
        sys.exit("bench_diff: the before variants need --before DIR, a source tree holding "
                 "layerdiff/ (e.g. git archive HEAD | tar -x -C DIR)")

    parent = args.dir or Path(tempfile.gettempdir())
    parent.mkdir(parents=True, exist_ok=True)
    margin = 1.05
    need = margin * 2 * (sum(sizes) if args.keep else max(sizes)) * 1e9 + 1e9
    free = shutil.disk_usage(parent).free
    if free < need:
        sys.exit(f"bench_diff: {parent} has {free / 1e9:.1f} GB free; traces of "
                 f"{args.sizes} GB per side need about {need / 1e9:.1f} GB "
                 f"({'all kept' if args.keep else 'one pair at a time'}). Pass --dir on a "
                 "larger disk or smaller --sizes.")
    load_before = os.getloadavg()[0]
    commit, sources = _sources()
    cold = args.drop_caches and _drop_caches()
    if args.drop_caches and not cold:
        print("cannot write /proc/sys/vm/drop_caches: measuring with a warm page cache",
              file=sys.stderr)
    directory = Path(tempfile.mkdtemp(prefix="bench-diff-", dir=parent))
    rows = []
    try:
        for size in sizes:
            ref, port = directory / f"ref-{size:g}GB.h5", directory / f"port-{size:g}GB.h5"
            start = time.perf_counter()
            tensors, nbytes = generate(ref, port, int(size * 1e9),
                                       large=SMALL if size == TINY else LARGE)
            generated = time.perf_counter() - start
            print(f"{size:g} GB: wrote 2 x {tensors} tensors, 2 x {nbytes / 1e9:.2f} GB in "
                  f"{generated:.1f} s", file=sys.stderr, flush=True)
            names = ["engine", *([] if args.no_loop else ["loop"]), *variants]
            runs: dict[str, list[dict]] = {name: [] for name in names}
            agreement: dict[str, dict] = {}
            for repeat in range(args.repeats):
                order = names if repeat % 2 == 0 else names[::-1]
                for name in order:
                    mode, env = (name, {}) if name in ("engine", "loop") else VARIANTS[name][:2]
                    if name.startswith("before"):
                        env = {**env, "BENCH_DIFF_SOURCES": str(args.before.resolve())}
                    check = (directory / f"{name}.json" if repeat == 0 and mode != "cli"
                             else None)
                    result = measure(mode, ref, port, check, cold, env)
                    result["load"] = os.getloadavg()[0]
                    runs[name].append(result)
                    extra = result["peak_mib"] - result["import_mib"]
                    print(f"  {name}: {result['seconds']:.2f} s ({result['cpu_seconds']:.1f} "
                          "s of CPU), "
                          f"{result['bytes'] / result['seconds'] / 1e9:.2f} GB/s, peak "
                          f"{result['peak_mib']:.0f} MiB (+{extra:.0f}), load "
                          f"{result['load']:.1f}", file=sys.stderr, flush=True)
                if repeat == 0:
                    for name in names[1:]:
                        if name.endswith("cli"):
                            continue  # the command's rows are not kept
                        agreement[name] = compare_rows(directory / "engine.json",
                                                       directory / f"{name}.json")
            rows.append(_summarise(size, tensors, nbytes, generated, runs, agreement))
            if not args.keep:
                ref.unlink()
                port.unlink()
    finally:
        if not args.keep:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            print(f"traces kept in {directory}", file=sys.stderr)

    print()
    cache = ("cold (dropped before each run)" if cold
             else "warm (the traces were just written; nothing dropped)")
    print(f"page cache: {cache}; medians of {args.repeats}, all modes interleaved, "
          f"each run in a fresh process; load average {load_before:.2f} before, "
          f"{os.getloadavg()[0]:.2f} after (2 cores: other work on the machine skews both)")
    changed = _sources()[1] != sources
    print(f"commit {commit}, layerdiff sources {sources}"
          + ("; WARNING: layerdiff's sources changed during the run, rows mix versions"
             if changed else ", unchanged during the run"))
    print()
    if not args.no_loop:
        print("| GB per side | tensors | engine GB/s | loop GB/s | engine/loop | engine peak RSS "
              "MiB (+ over import) | loop peak RSS MiB (+ over import) | targets |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |")
        for r in rows:
            ok = r["ratio"] >= TARGET_RATE and r["engine_peak_mib"] < TARGET_RSS_MIB
            print(f"| {r['bytes'] / 1e9:.2f} | {r['tensors']} | {r['engine_gbs']:.2f} | "
                  f"{r['loop_gbs']:.2f} | {r['ratio']:.2f} | {r['engine_peak_mib']:.0f} "
                  f"(+{r['engine_extra_mib']:.0f}) | {r['loop_peak_mib']:.0f} "
                  f"(+{r['loop_extra_mib']:.0f}) | {'PASS' if ok else 'MISS'} |")
        print()
        print(f"targets: engine >= {TARGET_RATE:.2f}x the loop's rate; engine peak RSS < "
              f"{TARGET_RSS_MIB} MiB at every size")
        print()
    print("| GB per side | mode | GB/s | s | CPU s | CPU s per s | peak RSS MiB (+ over import) "
          f"| >= {TARGET_GBS:g} GB/s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for r in rows:
        for name, m in r["modes"].items():
            target = "" if name == "loop" else "PASS" if m["gbs"] >= TARGET_GBS else "MISS"
            print(f"| {r['bytes'] / 1e9:.2f} | {name} | {m['gbs']:.2f} | {m['seconds']:.2f} | "
                  f"{m['cpu_seconds']:.2f} | {m['cpu_per_s']:.2f} | {m['peak_mib']:.0f} "
                  f"(+{m['extra_mib']:.0f}) | {target} |")
    print()
    print("Phases, medians, wall s: before streaming and after it (opening, index and segment "
          "checks, pairing, origins), streaming (numba's set-up where it loads), hints")
    print()
    print("| GB per side | mode | s | streaming | hints | other | numba loaded | runs, s |")
    print("| ---: | --- | ---: | ---: | ---: | ---: | --- | --- |")
    for r in rows:
        for name, m in r["modes"].items():
            ph = m["phases"]
            loaded = {None: "", True: "yes", False: "no"}[m["numba_loaded"]]
            cells = ("", "", "") if name.endswith("cli") or name == "loop" else (
                f"{ph['stream']:.3f}", f"{ph['hints']:.3f}", f"{ph['other']:.3f}")
            print(f"| {r['bytes'] / 1e9:.3f} | {name} | {m['seconds']:.3f} | "
                  + " | ".join(cells) + f" | {loaded} | "
                  + ", ".join(f"{x:.3f}" for x in m["runs"]) + " |")
    print()
    print("load average at the end of each run, per size: " + "; ".join(
        f"{r['size_gb']:g} GB {min(r['loads']):.1f}-{max(r['loads']):.1f}" for r in rows))
    for r in rows:
        for name, agree in r["agreement"].items():
            print(f"agreement of {name} with the engine at {r['size_gb']:g} GB ({agree['rows']} "
                  "rows): largest relative gap "
                  + ", ".join(f"{k} {v:.1e}" for k, v in agree.items() if k != "rows")
                  + "; out counts, worst indices and NaN/Inf counts equal")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def _summarise(size: float, tensors: int, nbytes: int, generated: float, runs: dict,
               agreement: dict) -> dict:
    for mode, results in runs.items():
        if mode.endswith("cli"):
            continue
        if {r["bytes"] for r in results} != {nbytes} or any(r["identical"] for r in results):
            raise AssertionError(f"{mode} compared {results[0]['bytes']} bytes "
                                 f"({results[0]['identical']} rows skipped as identical), "
                                 f"expected all {nbytes}")
    modes = {}
    for mode, results in runs.items():
        median = {k: statistics.median(r[k] for r in results)
                  for k in ("seconds", "peak_mib", "import_mib", "cpu_seconds")}
        median["phases"] = {k: statistics.median(r["phases"].get(k, 0.0) for r in results)
                            for k in ("stream", "hints", "other")}
        median["runs"] = [r["seconds"] for r in results]
        median["numba_loaded"] = results[0]["numba_loaded"]
        modes[mode] = {**median, "gbs": nbytes / median["seconds"] / 1e9,
                       "extra_mib": statistics.median(r["peak_mib"] - r["import_mib"]
                                                      for r in results),
                       "cpu_per_s": statistics.median(r["cpu_seconds"] / r["seconds"]
                                                      for r in results)}
    engine = modes["engine"]
    loop = modes.get("loop", {k: math.nan for k in engine})
    return {"size_gb": size, "tensors": tensors, "bytes": nbytes, "generate_s": generated,
            "engine_s": engine["seconds"], "loop_s": loop["seconds"],
            "engine_gbs": engine["gbs"], "loop_gbs": loop["gbs"],
            "ratio": engine["gbs"] / loop["gbs"],
            "engine_peak_mib": engine["peak_mib"], "engine_extra_mib": engine["extra_mib"],
            "loop_peak_mib": loop["peak_mib"], "loop_extra_mib": loop["extra_mib"],
            "engine_cpu_per_s": engine["cpu_per_s"], "loop_cpu_per_s": loop["cpu_per_s"],
            "modes": modes, "loads": [r["load"] for rs in runs.values() for r in rs],
            "agreement": agreement, "runs": runs}


if __name__ == "__main__":
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if len(sys.argv) > 2 and sys.argv[1] == "--child":  # one measurement in a fresh process
        _child(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5] if len(sys.argv) > 5 else None)
    else:
        main()
