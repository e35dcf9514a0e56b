"""Measure the likely-cause hints: how often the first origin of each planted bug carries the
hint kind its mistake is.

Every bug of the catalog (reference_models/catalog.py, kind "bug") and every one of
reference_models/hint_bugs.py is captured as `layerdiff demo` captures it (the reference; the
port with the reference's weights loaded through its mapping), diffed, and its first origin's
hint compared with the kind expected. A bug no kind describes expects no hint: a hint there is a
false positive. The planted bugs of the other tests and commands (OTHERS), which the hints were
not developed on, are measured apart.

    python scripts/hint_rates.py [--json FILE]

Prints a markdown table per bug and the hit rate per kind (docs/diff.md has them).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from layerdiff import capture, diff, load_case, load_weights
from layerdiff.case import ExternalCase
from layerdiff.errors import LayerdiffError
from layerdiff.report.findings.diff import describe_origin
from reference_models import hint_bugs, hint_bugs_heldout, hint_bugs_real
from reference_models.catalog import CATALOG, HERE

# The kind of mistake each of the catalog's planted bugs is; None: no kind describes it.
CATALOG_KINDS: dict[str, str | None] = {
    "reference_models.mlp_port:bug_weight_not_transposed": "transpose",
    "reference_models.mlp_port:bug_gelu_tanh": "approximation",
    "reference_models.cnn_port:bug_relu_backward_batch": "batch",
    "reference_models.transformer_port:bug_softmax_axis": "axis",
    "reference_models.transformer_port:bug_head_split_reshape": "transpose",
    "reference_models.transformer_port:bug_missing_scale": "scale",
    "reference_models.transformer_port:bug_layernorm_eps": "epsilon",
    "reference_models.transformer_port:bug_inverted_mask": "mask",
    # stale values from the previous call added to a gradient: no kind is that
    "reference_models.convlstm_numpy:bug_accumulator_not_zeroed": None,
    # the planted bugs of the other diagnostics, should the catalog list them
    "reference_models.batch_mixing:bug_reshape_seq_first": "transpose",  # reshape for transpose
    "reference_models.schedule_port:bug_schedule_early": None,  # an update, not a weight, scaled
    "reference_models.numerics:nan_log_softmax": None,      # non-finite: no hint by design
    "reference_models.numerics:nan_sqrt_backward": None,
    "reference_models.numerics:convlstm_uninitialised_bias": None,
}
UNKNOWN = "?"

# Planted bugs the hints were not built around: written for other tests and commands before
# or beside them. (spec, reference, mapping from the repository root, kind expected, whether
# the reference's weights are loaded into the port: batch_mixing's are its own already and no
# mapping gives them)
OTHERS: list[tuple[str, str, str | None, str | None, bool]] = [
    ("tests.gpt_cases:port_bug_gelu_backward", "tests.gpt_cases:reference",
     "tests/gpt_port.map.toml", None, True),  # a derivative term dropped: no kind is that
    ("tests.gpt_cases:port_bug_causal_mask", "tests.gpt_cases:reference",
     "tests/gpt_port.map.toml", "mask", True),
    ("tests.gpt_cases:port_bug_attn_scale", "tests.gpt_cases:reference",
     "tests/gpt_port.map.toml", "scale", True),
    ("reference_models.batch_mixing:bug_reshape_seq_first",
     "reference_models.batch_mixing:reference", None, "transpose", False),
    ("reference_models.schedule_port:bug_schedule_early",
     "reference_models.schedule_port:reference", None, None, True),
]
ROOT = HERE.parent


@dataclass
class Planted:
    spec: str
    reference: str
    mapping: Path | None
    expected: str | None       # a kind, None (no kind fits) or UNKNOWN (not classified here)
    built_for: bool = True     # among the bugs the hints were developed on
    load: bool = True          # load the reference's weights into the port first
    group: str = ""            # the table it is counted in (see GROUPS)


@dataclass
class Outcome:
    planted: Planted
    origin: str
    kind: str | None
    evidence: str
    seconds: float

    @property
    def hit(self) -> bool | None:
        if self.planted.expected == UNKNOWN:
            return None
        return self.kind == self.planted.expected


def planted_bugs() -> list[Planted]:
    bugs = [Planted(info.spec, info.reference, info.mapping_path,
                    CATALOG_KINDS.get(info.spec, UNKNOWN))
            for info in CATALOG if info.kind == "bug" and info.reference]
    listed = {bug.spec for bug in bugs}
    for bug in hint_bugs.BUGS:
        if bug.spec in listed:  # once the catalog lists it, the expected kind is still ours
            next(b for b in bugs if b.spec == bug.spec).expected = bug.kind
            continue
        bugs.append(Planted(bug.spec, bug.reference,
                            HERE / bug.mapping if bug.mapping else None, bug.kind))
    listed = {bug.spec for bug in bugs}
    bugs += [Planted(spec, reference, ROOT / mapping if mapping else None, kind, False, load)
             for spec, reference, mapping, kind, load in OTHERS if spec not in listed]
    for group, module in (("real", hint_bugs_real), ("heldout", hint_bugs_heldout)):
        bugs += [Planted(bug.spec, bug.reference, HERE / bug.mapping if bug.mapping else None,
                         bug.kind, group == "real", True, group) for bug in module.BUGS]
    return bugs


GROUPS = [  # (title, which outcomes)
    ("the planted bugs of the catalog and of reference_models/hint_bugs.py",
     lambda o: o.planted.built_for and not o.planted.group),
    ("planted bugs the hints were not built around",
     lambda o: not o.planted.built_for and not o.planted.group),
    ("issue 29's planted bugs of real ports (reference_models/hint_bugs_real.py)",
     lambda o: o.planted.group == "real"),
    ("held-out planted bugs, written after the rules (reference_models/hint_bugs_heldout.py)",
     lambda o: o.planted.group == "heldout"),
]


def measure(bug: Planted, reference: Path, work: Path) -> Outcome:
    start = time.perf_counter()
    case = load_case(bug.spec)
    if bug.load and not isinstance(case, ExternalCase):  # one that records itself has its own
        load_weights(case.model, reference, bug.mapping)
    port = capture(case, work / (bug.spec.replace(":", "_") + ".h5"))
    result = diff(reference, port, mapping=bug.mapping)
    origin = result.origin
    hint = origin.hint if origin is not None else None
    where = describe_origin(origin) if origin is not None else "no origin"
    return Outcome(bug, where, hint["kind"] if hint else None,
                   hint["evidence"] if hint else "", time.perf_counter() - start)


def table(outcomes: list[Outcome]) -> str:
    lines = ["| planted bug | kind expected | hint given | hit |", "| --- | --- | --- | --- |"]
    for o in outcomes:
        hit = {True: "hit", False: "miss", None: "-"}[o.hit]
        lines.append(f"| `{o.planted.spec.split('.', 1)[-1]}` | {o.planted.expected or '(none)'} "
                     f"| {o.kind or '(none)'} | {hit} |")
    return "\n".join(lines)


def rates(outcomes: list[Outcome]) -> str:
    kinds: dict[str, list[bool]] = {}
    for o in outcomes:
        if o.hit is not None:
            kinds.setdefault(o.planted.expected or "(none)", []).append(o.hit)
    lines = ["| kind | planted bugs | hits | rate |", "| --- | --- | --- | --- |"]
    for kind in sorted(kinds):
        hits = kinds[kind]
        lines.append(f"| {kind} | {len(hits)} | {sum(hits)} | {sum(hits) / len(hits):.0%} |")
    every = [h for hits in kinds.values() for h in hits]
    lines.append(f"| all | {len(every)} | {sum(every)} | {sum(every) / max(len(every), 1):.0%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="also write every outcome as JSON here")
    args = parser.parse_args()
    outcomes = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        references: dict[str, Path] = {}
        for bug in planted_bugs():
            if bug.reference not in references:
                path = work / (bug.reference.replace(":", "_") + ".h5")
                references[bug.reference] = capture(load_case(bug.reference), path)
            try:
                outcome = measure(bug, references[bug.reference], work)
            except LayerdiffError as exc:  # e.g. a port that needs another command's setup
                print(f"{bug.spec}: not measured: {exc}", flush=True)
                continue
            outcomes.append(outcome)
            print(f"{bug.spec}: {outcome.origin}\n    hint {outcome.kind or '(none)'}: "
                  f"{outcome.evidence} [{outcome.seconds:.1f} s]", flush=True)
    for title, which in GROUPS:
        group = [o for o in outcomes if which(o)]
        if group:
            print(f"\n{title}:\n")
            print(table(group))
            print()
            print(rates(group))
    if args.json:
        args.json.write_text(json.dumps([
            {"spec": o.planted.spec, "expected": o.planted.expected, "origin": o.origin,
             "kind": o.kind, "evidence": o.evidence, "hit": o.hit} for o in outcomes],
            indent=2), encoding="utf-8")


if __name__ == "__main__":
    main()
