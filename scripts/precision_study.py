"""Measure what a baseline allows: faithful low-precision ports must pass, planted bugs must not.

For each bundled torch port (and the reference itself) run in bfloat16, float16 and under
bfloat16 autocast, with the reference's weights, this diffs the port against the float32
reference three ways: without a baseline (the per-dtype element-wise rule), and with the
reference run in the same precision as the baseline at factor 1 (how many times the baseline's
error the port has, floor included) and at the default factor. Then every planted bug, run in
bfloat16, is diffed with the baseline: is its first origin still the documented site and pass?
Last, a float32 port with a small real bug against a float64 golden, with the float32 baseline.

    python scripts/precision_study.py [--extra tests.gpt_cases:port=tests/gpt_port.map.toml]

Prints markdown tables (docs/tolerances.md has them, with the command).
"""

from __future__ import annotations

import argparse
import math
import tempfile
from pathlib import Path

import torch

from layerdiff import capture, diff, load_case, load_weights
from layerdiff.compare.baseline import FACTOR
from layerdiff.errors import CaptureError
from reference_models.catalog import CATALOG

PRECISIONS = [("bfloat16", {"dtype": "bfloat16"}), ("float16", {"dtype": "float16"}),
              ("autocast bf16", {"autocast": "bfloat16"})]


def _torch_ports() -> list[tuple[str, str, str | None]]:
    """(port spec, reference spec, mapping) of every torch port and reference."""
    rows = []
    for info in CATALOG:
        if info.model == "bench" or info.spec.endswith("_large") or info.kind == "bug":
            continue
        if info.kind == "reference":
            rows.append((info.spec, info.spec, None))
        elif "numpy" not in info.spec:
            mapping = str(info.mapping_path) if info.mapping_path else None
            rows.append((info.spec, info.reference, mapping))
    return rows


def _worst(result) -> float:
    ratios = result.rows["ratio"].astype(float)
    return float(ratios.replace(math.nan, math.inf).max()) if len(ratios) else 0.0


def _capture_port(spec: str, ref: Path, mapping: str | None, path: Path, **precision) -> Path:
    case = load_case(spec)
    dtype = precision.get("dtype")
    if dtype:
        from layerdiff.capture.precision import cast_case

        cast_case(case, dtype)
    load_weights(case.model, ref, mapping)
    return capture(case, path, **precision)


def _origin_text(result) -> str:
    origin = result.origin
    if origin is None:
        return "none (passes)"
    return f"{origin.port_site} {origin.pass_} ({origin.metrics.get('ratio', math.nan):.3g}x)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--extra", action="append", default=[], metavar="PORT=MAP",
                        help="another port (spec=mapping, mapping may be empty) against the "
                             "reference given with --extra-reference")
    parser.add_argument("--extra-reference", default="tests.gpt_cases:reference")
    args = parser.parse_args()
    torch.set_num_threads(2)
    tmp = Path(tempfile.mkdtemp(prefix="layerdiff-precision-"))
    ports = _torch_ports() + [(spec, args.extra_reference, mapping or None) for spec, _, mapping
                              in (e.partition("=") for e in args.extra)]
    refs: dict[str, Path] = {}
    baselines: dict[tuple[str, str], Path] = {}

    def reference(spec: str) -> Path:
        if spec not in refs:
            refs[spec] = capture(load_case(spec), tmp / f"ref-{len(refs)}.h5")
        return refs[spec]

    def baseline(spec: str, name: str, precision: dict) -> Path:
        if (spec, name) not in baselines:
            path = tmp / f"base-{len(baselines)}.h5"
            baselines[(spec, name)] = capture(load_case(spec), path, **precision)
        return baselines[(spec, name)]

    print("## Faithful ports in low precision (worst error / allowed over all records)\n")
    print(f"| port | precision | no baseline | baseline, factor 1 | baseline, factor {FACTOR:g} |")
    print("| --- | --- | ---: | ---: | ---: |")
    for port_spec, ref_spec, mapping in ports:
        ref = reference(ref_spec)
        for name, precision in PRECISIONS:
            try:
                port = _capture_port(port_spec, ref, mapping, tmp / "port.h5", **precision)
                base = baseline(ref_spec, name, precision)
            except CaptureError as exc:  # e.g. masked_fill(-1e9) overflows float16
                print(f"| {port_spec.removeprefix('reference_models.')} | {name} | cannot run: "
                      f"{str(exc).split(': ', 2)[-1][:60]} | | |")
                continue
            plain = diff(ref, port, mapping=mapping)
            k1 = diff(ref, port, mapping=mapping, baseline=base, baseline_factor=1.0)
            kd = diff(ref, port, mapping=mapping, baseline=base)
            print(f"| {port_spec.removeprefix('reference_models.')} | {name} | "
                  f"{_worst(plain):.3g} | {_worst(k1):.3g} | {_worst(kd):.3g} |")
            port.unlink()

    print("\n## Planted bugs run in bfloat16, with the bfloat16 baseline\n")
    print("| bug | documented | first origin (bf16, baseline) | found | float32 origin |")
    print("| --- | --- | --- | --- | --- |")
    for info in CATALOG:
        if info.kind != "bug" or "numpy" in info.spec:
            continue
        ref = reference(info.reference)
        mapping = str(info.mapping_path) if info.mapping_path else None
        base = baseline(info.reference, "bfloat16", {"dtype": "bfloat16"})
        port = _capture_port(info.spec, ref, mapping, tmp / "bug.h5", dtype="bfloat16")
        low = diff(ref, port, mapping=mapping, baseline=base)
        port32 = _capture_port(info.spec, ref, mapping, tmp / "bug32.h5")
        full = diff(ref, port32, mapping=mapping)
        origin = low.origin
        found = origin is not None and origin.port_site == info.site and \
            origin.pass_ == info.pass_
        print(f"| {info.spec.removeprefix('reference_models.')} | {info.site} {info.pass_} | "
              f"{_origin_text(low)} | {'yes' if found else 'NO'} | {_origin_text(full)} |")
        port.unlink()
        port32.unlink()

    print("\n## float32 port with a small real bug, against a float64 golden\n")
    golden = capture(load_case("reference_models.mlp:reference"), tmp / "golden64.h5",
                     dtype="float64")
    ref32 = capture(load_case("reference_models.mlp:reference"), tmp / "ref32.h5")
    print("| port | no baseline | float32 baseline |")
    print("| --- | --- | --- |")
    for spec in ("reference_models.mlp_port:port", "reference_models.mlp_port:bug_gelu_tanh"):
        port = _capture_port(spec, golden, None, tmp / "p32.h5")
        plain = diff(golden, port)
        judged = diff(golden, port, baseline=ref32)
        print(f"| {spec.removeprefix('reference_models.')} | {_origin_text(plain)} | "
              f"{_origin_text(judged)} (worst {_worst(judged):.3g}) |")
        port.unlink()


if __name__ == "__main__":
    main()
