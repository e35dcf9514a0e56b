"""Count the hints on faithful ports: every port of the catalog (kind "port"), the GPT port of
tests/gpt_cases.py, the Llama port against Hugging Face's and the correct ports of
reference_models/hint_bugs*.py, each diffed against its reference in float32 and in bfloat16
with a bfloat16 baseline (the reference run the port's way), or without one (--no-baseline:
every origin is then rounding-level). A faithful port's origins, where any, may carry a
``precision`` hint and nothing else: any other hint is false.

    python scripts/hint_false.py [--dtypes float32 bfloat16] [--no-baseline]

Prints one line per port and dtype and the count of false hints (docs/diff.md has it)."""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from layerdiff import capture, diff, load_case, load_weights
from layerdiff.case import ExternalCase
from layerdiff.compare.hints.attach import attach_hints
from layerdiff.compare.pair import PairReader
from layerdiff.compare.result import Origin
from layerdiff.errors import LayerdiffError
from layerdiff.report.findings.diff import describe_origin
from reference_models.catalog import CATALOG, HERE

ROOT = HERE.parent
EXTRA = [  # (port, reference, mapping from the repository root)
    ("tests.gpt_cases:port", "tests.gpt_cases:reference", "tests/gpt_port.map.toml"),
    ("reference_models.llama_port:port", "reference_models.hf_llama:reference",
     "reference_models/hf_llama.map.toml"),
    ("reference_models.llama_port:port", "reference_models.hf_llama:reference_sdpa",
     "reference_models/hf_llama.map.toml"),
    ("reference_models.hint_bugs:causal_port", "reference_models.hint_bugs:causal_reference",
     None),
]
OWN = ["stack_reference", "stack_loop_reference", "bag_reference", "classifier_reference",
       "lstm_reference", "gru_reference", "act_mlp_reference"]  # against themselves re-run


def faithful() -> list[tuple[str, str, Path | None]]:
    pairs = [(info.spec, info.reference, info.mapping_path) for info in CATALOG
             if info.kind == "port" and info.reference]
    pairs += [(port, ref, ROOT / m if m else None) for port, ref, m in EXTRA]
    return pairs


def _every_record(result) -> list[Origin]:
    """Every compared tensor record that differs at all, dressed as an origin."""
    rows = result.rows
    rows = rows[(rows["max_abs"].fillna(0) > 0) & (rows["numel"] >= 8)]
    return [Origin(int(row["step"]), str(row["pass"]), str(row["site"]), str(row["port_site"]),
                   str(row["role"]), str(row["arg"]), str(row["port_arg"]), "",
                   {"rtol": row["rtol"], "atol": row["atol"], "ratio": row["ratio"],
                    "max_abs": row["max_abs"]})
            for _, row in rows.iterrows()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--every-record", action="store_true",
                        help="ask for a hint at every compared record with any difference, "
                             "as if each were an origin (passing and rounding-level ones: "
                             "none may get one but precision)")
    parser.add_argument("--no-baseline", action="store_true",
                        help="diff a low-precision port without its baseline: every origin is "
                             "rounding-level, and none may carry a hint but precision")
    args = parser.parse_args()
    false, origins = 0, 0
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for n, (port_spec, ref_spec, mapping) in enumerate(faithful()):
            for dtype in args.dtypes:
                low = None if dtype == "float32" else dtype
                try:
                    ref = capture(load_case(ref_spec), work / f"r{n}.h5")
                    baseline = (capture(load_case(ref_spec), work / f"b{n}.h5", dtype=low)
                                if low and not args.no_baseline else None)
                    case = load_case(port_spec)
                    if not isinstance(case, ExternalCase):
                        load_weights(case.model, ref, mapping)
                    port = capture(case, work / f"p{n}.h5", dtype=low)
                    result = diff(ref, port, mapping=mapping, baseline=baseline)
                except (LayerdiffError, TypeError) as exc:
                    print(f"{port_spec} [{dtype}]: not measured: {exc}", flush=True)
                    continue
                origins_here = (_every_record(result) if args.every_record
                                else result.origins)
                if args.every_record:
                    with PairReader(ref, port, result.pairs) as reader:
                        attach_hints(origins_here, reader, max_origins=len(origins_here))
                hints = [(describe_origin(o), o.hint) for o in origins_here]
                origins += len(hints)
                wrong = [h for h in hints if h[1] and h[1]["kind"] != "precision"]
                false += len(wrong)
                print(f"{port_spec} vs {ref_spec} [{dtype}]: {len(hints)} origin(s), "
                      f"{len(wrong)} false hint(s)"
                      + "".join(f"\n    {where}: {h}" for where, h in hints
                                if h or not args.every_record), flush=True)
    print(f"\n{false} false hint(s) over {origins} origin(s)")


if __name__ == "__main__":
    main()
