"""Measure what a baseline allows across rounding paths: faithful low-precision ports must pass,
planted bugs must not, when the baseline was captured on another kernel path than the port.

One machine runs several rounding paths: ATen's vector kernels (``ATEN_CPU_CAPABILITY=default|
avx2|avx512``), oneDNN's (``ONEDNN_MAX_CPU_ISA=SSE41|AVX2|AVX512_CORE|AVX512_CORE_BF16``, which
carries bfloat16 matmuls) and the thread count (how reductions are split). Three steps:

    # 1. on each path, in its own process: the float32 references, the baselines (each
    #    reference in bfloat16, float16 and under bfloat16 autocast), every bundled torch port
    #    in those precisions with the reference's weights, and every planted bug in bfloat16
    ATEN_CPU_CAPABILITY=default ONEDNN_MAX_CPU_ISA=AVX2 \
        python scripts/precision_study.py capture study/default-avx2 --threads 2
    # 2. every record's error, for each reference/baseline path judging each port path
    python scripts/precision_study.py measure study/* -o study/records.csv
    # 3. the rule's worst ratio per faithful port and each bug's margin, per path pair
    python scripts/precision_study.py table study/records.csv

``records.csv`` holds, per record, the baseline's error and the port's against the same
reference (max and rms), and the reference's scale, so any rule can be judged from it without
capturing again; ``table`` judges the one :mod:`layerdiff.compare.baseline` implements (and
the worst-element rule it replaced), ``origins`` runs the diff itself on each bug.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from layerdiff import capture, diff, load_case, load_weights, open_trace
from layerdiff.compare.baseline import FACTOR, Baseline, BaselineError
from layerdiff.compare.tolerances import DEFAULTS
from layerdiff.errors import CaptureError
from reference_models.catalog import CATALOG

PRECISIONS = {"bfloat16": {"dtype": "bfloat16"}, "float16": {"dtype": "float16"},
              "autocast": {"autocast": "bfloat16"}}
EXTRA_PORTS = [("tests.gpt_cases:port", "tests.gpt_cases:reference", "tests/gpt_port.map.toml")]
ENV = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA")


def _short(spec: str) -> str:
    return spec.removeprefix("reference_models.")


def _file(spec: str) -> str:
    return _short(spec).replace(":", "-").replace(".", "_")


def faithful_ports() -> list[tuple[str, str, str | None]]:
    """(port spec, reference spec, mapping) of every torch port and reference."""
    rows = []
    for info in CATALOG:
        if info.model == "bench" or info.spec.endswith("_large") or info.kind == "bug":
            continue
        if info.kind == "reference":
            rows.append((info.spec, info.spec, None))
        elif info.kind == "port" and "numpy" not in info.spec:
            rows.append((info.spec, info.reference,
                         str(info.mapping_path) if info.mapping_path else None))
    return rows + EXTRA_PORTS


def planted_bugs() -> list:
    return [info for info in CATALOG if info.kind == "bug" and "numpy" not in info.spec]


def _capture_port(spec: str, ref: Path, mapping: str | None, path: Path, **precision) -> Path:
    case = load_case(spec)
    dtype = precision.get("dtype")
    if dtype:
        from layerdiff.capture.precision import cast_case

        cast_case(case, dtype)
    load_weights(case.model, ref, mapping)
    return capture(case, path, **precision)


def capture_path(out: Path, threads: int) -> None:
    """Everything one rounding path produces, into ``out``."""
    torch.set_num_threads(threads)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    refs = sorted({ref for _, ref, _ in faithful_ports()})
    failed: dict[str, str] = {}
    for ref in refs:
        capture(load_case(ref), out / f"ref-{_file(ref)}.h5")
        for name, precision in PRECISIONS.items():
            try:
                capture(load_case(ref), out / f"base-{_file(ref)}-{name}.h5", **precision)
            except CaptureError as exc:
                failed[f"base {ref} {name}"] = str(exc)[:200]
    for spec, ref, mapping in faithful_ports():
        for name, precision in PRECISIONS.items():
            try:
                _capture_port(spec, out / f"ref-{_file(ref)}.h5", mapping,
                              out / f"port-{_file(spec)}-{name}.h5", **precision)
            except CaptureError as exc:  # e.g. masked_fill(-1e9) overflows float16
                failed[f"port {spec} {name}"] = str(exc)[:200]
    for info in planted_bugs():
        try:
            _capture_port(info.spec, out / f"ref-{_file(info.reference)}.h5",
                          str(info.mapping_path) if info.mapping_path else None,
                          out / f"bug-{_file(info.spec)}-bfloat16.h5", dtype="bfloat16")
        except (CaptureError, AttributeError) as exc:  # a case without a torch model
            failed[f"bug {info.spec} bfloat16"] = str(exc)[:200]
    (out / "path.json").write_text(json.dumps({
        "env": {key: os.environ.get(key, "") for key in ENV}, "threads": threads,
        "capability": torch.backends.cpu.get_cpu_capability(), "failed": failed,
        "seconds": round(time.time() - started, 1)}, indent=1))


def _errors(ref: Path, other: Path, mapping: str | None) -> pd.DataFrame:
    """Each floating record's error of ``other`` against ``ref``, with ``ref``'s scale."""
    rows = diff(ref, other, mapping=mapping).rows
    rows = rows[rows["port_dtype"].astype(str).str.contains("float")
                & rows["max_abs"].notna()].copy()
    with open_trace(ref) as trace:
        index = trace.index[["step", "site", "role", "arg", "min", "max", "l2", "numel"]]
    rows = rows.merge(index, on=["step", "site", "role", "arg"], how="left",
                      suffixes=("", "_ref"))
    rows["ref_max"] = np.maximum(rows["min"].abs(), rows["max"].abs())
    rows["ref_rms"] = rows["l2"] / np.sqrt(rows["numel_ref"].clip(lower=1))
    return rows[["step", "pass", "seq", "site", "role", "arg", "port_site", "dtype",
                 "port_dtype", "numel", "max_abs", "rms", "ref_max", "ref_rms"]]


def measure(paths: list[Path], out: Path, hubs: list[str],
            pairs: list[tuple[str, str]] | None = None, append: bool = False) -> None:
    """Per record: the baseline's error (reference and baseline from path A) and the port's
    (port from path B), for every path judging itself and every pair with a hub path in it
    (every ordered pair when no hub is named), or only the ``pairs`` named (A, B)."""
    frames: list[pd.DataFrame] = []
    if not append:
        out.unlink(missing_ok=True)
    for a in paths:
        bases = {}
        for _spec, ref, _mapping in faithful_ports():
            for name in PRECISIONS:
                base = a / f"base-{_file(ref)}-{name}.h5"
                if (ref, name) not in bases and base.exists():
                    bases[(ref, name)] = _errors(a / f"ref-{_file(ref)}.h5", base, None)
        runs = [("faithful", spec, ref, mapping, name, None, None)
                for spec, ref, mapping in faithful_ports() for name in PRECISIONS]
        runs += [("bug", info.spec, info.reference,
                  str(info.mapping_path) if info.mapping_path else None, "bfloat16", info.site,
                  info.pass_) for info in planted_bugs()]
        for b in paths:
            if pairs is not None:
                if (a.name, b.name) not in pairs:
                    continue
            elif hubs and a != b and a.name not in hubs and b.name not in hubs:
                continue
            for kind, spec, ref, mapping, name, site, pass_ in runs:
                prefix = "port" if kind == "faithful" else "bug"
                port = b / f"{prefix}-{_file(spec)}-{name}.h5"
                if not port.exists() or (ref, name) not in bases:
                    continue
                errors = _errors(a / f"ref-{_file(ref)}.h5", port, mapping)
                base = bases[(ref, name)][["step", "site", "role", "arg", "max_abs", "rms"]]
                errors = errors.merge(base, on=["step", "site", "role", "arg"], how="left",
                                      suffixes=("", "_base"))
                errors.insert(0, "bug_pass", pass_)
                errors.insert(0, "bug_site", site)
                errors.insert(0, "precision", name)
                errors.insert(0, "port", _short(spec))
                errors.insert(0, "kind", kind)
                errors.insert(0, "port_path", b.name)
                errors.insert(0, "base_path", a.name)
                frames.append(errors)
            # written pair by pair: a long measurement can be read while it runs
            pd.concat(frames, ignore_index=True).to_csv(out, index=False, mode="a",
                                                        header=not out.exists())
            frames.clear()
            print(f"measured {a.name} -> {b.name}", flush=True)


def ratios(records: pd.DataFrame, factor: float = FACTOR) -> pd.Series:
    """Each record's error / allowed under the rule :class:`Baseline` implements."""
    out = np.full(len(records), np.nan)
    for i, r in enumerate(records.itertuples(index=False)):
        if not np.isfinite(r.max_abs_base):
            continue
        rms = None if not np.isfinite(r.rms_base) else float(r.rms_base)
        judge = Baseline("study", {(0, "s", "r", "a"): BaselineError(
            float(r.max_abs_base), rms, r.port_dtype)}, factor=factor)
        limit = judge.limit((0, "s", "r", "a"), {"min": -r.ref_max, "max": r.ref_max,
                                                  "l2": r.ref_rms * math.sqrt(max(r.numel, 1)),
                                                  "numel": r.numel}, r.port_dtype, 1.0)
        over = r.max_abs / limit.tolerance.atol if limit.tolerance.atol else np.inf
        if limit.rms is not None:
            over = max(over, r.rms / limit.rms if limit.rms else np.inf)
        out[i] = 0.0 if r.max_abs == 0 else over
    return pd.Series(out, index=records.index)


def worst_element_ratios(records: pd.DataFrame, factor: float = FACTOR) -> pd.Series:
    """The rule before: the worst element against the baseline's worst (and the rms rule)."""
    u = records["port_dtype"].map(lambda d: DEFAULTS.get(d, (0.0, 0.0))[0])
    tiny = np.where(records["port_dtype"] == "float16", np.finfo(np.float16).tiny,
                    np.finfo(np.float32).tiny)
    worst = records["max_abs"] / (factor * records["max_abs_base"] + u * records["ref_max"]
                                  + tiny)
    rms = records["rms"] / (factor * records["rms_base"] + u * records["ref_rms"] + tiny)
    return np.maximum(worst, rms).where(records["max_abs"] > 0, 0.0)


def _at_bug_site(records: pd.DataFrame) -> pd.DataFrame:
    return records[(records["kind"] == "bug") & (records["port_site"] == records["bug_site"])
                   & (records["pass"] == records["bug_pass"])]


def table(path: Path, factor: float = FACTOR) -> None:
    records = pd.read_csv(path)
    records = records[records["max_abs_base"].notna()].copy()
    records["ratio"] = ratios(records, factor)
    records["before"] = worst_element_ratios(records, factor)
    records["same"] = records["base_path"] == records["port_path"]
    records["pair"] = np.where(records["same"], records["base_path"],
                               records["base_path"] + " → " + records["port_path"])
    npaths = records.loc[records["same"], "pair"].nunique()
    ncross = records.loc[~records["same"], "pair"].nunique()
    print(f"## Faithful ports: worst error / allowed over all records, K = {factor:g}\n")
    print(f"| port | precision | rms rule, own path ({npaths} paths) | rms rule, baseline from "
          f"another path ({ncross} pairs) | worst-element rule (before), all pairs |")
    print("| --- | --- | ---: | ---: | ---: |")
    faithful = records[records["kind"] == "faithful"]
    for (port, precision), group in faithful.groupby(["port", "precision"], sort=False):
        same, cross = group[group["same"]], group[~group["same"]]
        print(f"| {port} | {precision} | {same['ratio'].max():.3g} | {cross['ratio'].max():.3g} "
              f"| {group['before'].max():.3g} |")
    print(f"\n## Planted bugs in bfloat16: error / allowed at the documented site (its margin), "
          f"K = {factor:g}\n")
    print("| bug | site | rms rule, own path (least of the paths) | rms rule, baseline from "
          "another path (least) | worst-element rule (before), least |")
    print("| --- | --- | ---: | ---: | ---: |")
    bugs = _at_bug_site(records)
    for port, group in bugs.groupby("port", sort=False):
        per = group.groupby(["pair", "same"])[["ratio", "before"]].max().reset_index()
        same, cross = per[per["same"]], per[~per["same"]]
        print(f"| {port} | {group['bug_site'].iloc[0]} {group['bug_pass'].iloc[0]} | "
              f"{same['ratio'].min():.3g} | {cross['ratio'].min():.3g} | "
              f"{per['before'].min():.3g} |")
    print(f"\n## Per path (baseline path → port path): the worst faithful record and the weakest "
          f"bug bfloat16 resolves (found on some path at K = {factor:g}), "
          "rms rule\n")
    print("| path | worst faithful | where | weakest bug | which |")
    print("| --- | ---: | --- | ---: | --- |")
    resolved = bugs.groupby("port")["ratio"].max()
    resolved = set(resolved[resolved > 1].index)
    for pair, group in records.groupby("pair", sort=False):
        ok = group[group["kind"] == "faithful"]
        top = ok.loc[ok["ratio"].idxmax()]
        found = _at_bug_site(group)
        found = found[found["port"].isin(resolved)].groupby("port")["ratio"].max()
        print(f"| {pair} | {top['ratio']:.3g} | {top['port']} {top['precision']} {top['site']} "
              f"{top['role']} {top['arg']} | {found.min():.3g} | {found.idxmin()} |")


def origins(root: Path, pairs: list[tuple[str, str]]) -> None:
    """Each planted bug's first origin under the rule, with the baseline from path A and the
    bug's port from path B: is it the documented site and pass?"""
    names = [a if a == b else f"{a} → {b}" for a, b in pairs]
    print("| bug | documented | " + " | ".join(names) + " |")
    print("| --- | --- |" + " --- |" * len(names))
    for info in planted_bugs():
        mapping = str(info.mapping_path) if info.mapping_path else None
        cells = []
        for a, b in pairs:
            ref = root / a / f"ref-{_file(info.reference)}.h5"
            base = root / a / f"base-{_file(info.reference)}-bfloat16.h5"
            port = root / b / f"bug-{_file(info.spec)}-bfloat16.h5"
            if not port.exists():
                cells.append("cannot run")
                continue
            origin = diff(ref, port, mapping=mapping, baseline=base).origin
            if origin is None:
                cells.append("passes")
            else:
                found = (origin.port_site, origin.pass_) == (info.site, info.pass_)
                cells.append(f"{'found' if found else origin.port_site + ' ' + origin.pass_}"
                             f" {origin.metrics.get('ratio', math.nan):.3g}x")
        print(f"| {_short(info.spec)} | {info.site} {info.pass_} | " + " | ".join(cells) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    one = commands.add_parser("capture", help="capture every case on the current path")
    one.add_argument("out", type=Path)
    one.add_argument("--threads", type=int, default=2)
    two = commands.add_parser("measure", help="every record's error, for each path pair")
    two.add_argument("paths", type=Path, nargs="+")
    two.add_argument("-o", "--out", type=Path, required=True)
    two.add_argument("--hub", action="append", default=[], metavar="PATH_NAME",
                     help="measure only pairs with this path on one side (and the diagonal)")
    two.add_argument("--pair", action="append", metavar="BASE:PORT",
                     help="measure only this pair of path names (repeatable)")
    two.add_argument("--append", action="store_true", help="add to the records file")
    three = commands.add_parser("table", help="the rule's ratios per path pair")
    three.add_argument("records", type=Path)
    three.add_argument("--factor", type=float, default=FACTOR)
    four = commands.add_parser("origins", help="each bug's first origin, per path pair")
    four.add_argument("root", type=Path, help="the folder holding the paths' folders")
    four.add_argument("--pair", action="append", required=True, metavar="BASE:PORT")
    args = parser.parse_args()
    if args.command == "capture":
        capture_path(args.out, args.threads)
    elif args.command == "measure":
        pairs = None if not args.pair else [tuple(p.split(":", 1)) for p in args.pair]
        measure([p for p in args.paths if (p / "path.json").exists()], args.out, args.hub,
                pairs, args.append)
    elif args.command == "origins":
        origins(args.root, [tuple(p.split(":", 1)) for p in args.pair])
    else:
        table(args.records, args.factor)


if __name__ == "__main__":
    main()
