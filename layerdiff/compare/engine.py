"""``diff``: compare a port's trace with the reference's, record by record, and find origins.

Reads both indexes, pairs sites and records, then streams tensor data pair by pair and computes
one row of metrics per pair. Records whose digests agree are not compared element by element:
when verifying, their bytes are read on a second thread to be checked, and compared with each
other (``identical`` is equal bytes); without, they are not read (``same-digest``). Memory stays
at the tables plus a few MiB of chunk buffers, whatever the traces' size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
import shlex
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import judge, padding, positions
from layerdiff.compare import result as R
from layerdiff.compare.absent import absent_rows
from layerdiff.compare.adapted import adapt_calls
from layerdiff.compare.arguments import CallSignatures
from layerdiff.compare.baseline import FACTOR, Baseline
from layerdiff.compare.hints.attach import attach_hints
from layerdiff.compare.judge import UNCHANGED, Verdict
from layerdiff.compare.matching import explain_op_pairings, match_sites, op_pairings
from layerdiff.compare.metrics import PairMetrics, Scratch
from layerdiff.compare.origins import find_origins, first_unjudged, unjudgeable_sites
from layerdiff.compare.pair import ConvertedPair, PairReader, RowKey
from layerdiff.compare.rank_parts import (
    attach_ranks,
    gathered,
    reference_shapes,
    refuse_multi_rank_reference,
    replica_disagreement,
)
from layerdiff.compare.reading import TensorRef, compare_tensors, stream_pairs, verify_tensors
from layerdiff.compare.records import RecordPair, RecordPairing, pair_records, sliced_shape
from layerdiff.compare.result import Column
from layerdiff.compare.routing import explain_origins, judge_decisions, routing_report
from layerdiff.compare.row_metrics import finish_row, new_metrics
from layerdiff.compare.shapes import reshape_note, same_order
from layerdiff.compare.suggest import diff_options, full_commands, ops_commands
from layerdiff.compare.tolerances import Tolerance, Tolerances, looser_dtype
from layerdiff.compare.weighting import explain_weighting
from layerdiff.errors import DiffError
from layerdiff.mapping import Mapping, is_code
from layerdiff.outputs import replacing
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.schema import GRAD_ROLES, PARAM_ROLES, Role
from layerdiff.trace.stats import record_rms

STAT_COLUMNS = ("min", "max", "mean", "std")
Progress = Callable[[int, int], None]  # (bytes done, bytes total)


def diff(reference: str | os.PathLike | Trace, port: str | os.PathLike | Trace, *,
         mapping: str | os.PathLike | Mapping | None = None,
         tolerances: str | os.PathLike | Tolerances | None = None,
         baseline: str | os.PathLike | Trace | None = None, baseline_factor: float = FACTOR,
         progress: Progress | None = None, independent: bool = False,
         verify: bool = True, workers: int | None = None,
         seq_axis: int | None = None, padding_mask: str | bool | None = None) -> R.Diff:
    """Compare ``port``'s trace with ``reference``'s; see :class:`layerdiff.compare.Diff`.

    ``mapping`` pairs names that differ (a file or a :class:`Mapping`); ``tolerances``
    overrides the per-dtype defaults (a file or :class:`Tolerances`). ``baseline`` is a trace of
    the reference run the way the port runs (its dtype, autocast or device): each record's
    tolerance then follows the error the baseline has there (see
    :mod:`layerdiff.compare.baseline`: at most ``baseline_factor`` times the baseline's error,
    plus a few roundings); a tolerance file's rules still win. ``independent`` says
    that every site of ``port`` ran on the reference's own inputs (a replay), so each site is
    judged on its own. Raises :class:`DiffError` when the traces have nothing in common.
    ``verify`` checks every tensor the verdict rests on against its index digest and
    statistics, reading even records whose digests agree (traces given open keep their own
    setting); a damaged file raises :class:`TraceError`. A multi-rank ``port`` (the manifest
    of ``capture --nproc``) is first gathered into one trace by the mapping's ``[[shard]]``
    rules, its rank files checked by ``workers`` processes (default: every core but one).
    ``seq_axis`` declares the axis of positions of activation records, for the error by
    position of failing records (found from the inputs' token ids when not given; see
    :mod:`layerdiff.compare.positions`). ``padding_mask`` names the root's argument that is 0 at
    padding positions (None: found from the root's inputs; False: none): a forward record out
    only at padding positions that the reference's gradient shows unused is then judged
    ``padding-only``, not out (see :mod:`layerdiff.compare.padding`).
    """
    tolerances = Tolerances.build(tolerances)
    with contextlib.ExitStack() as stack:
        ref_trace, port_trace, base_trace = (
            None if given is None else given if isinstance(given, Trace)
            else stack.enter_context(open_trace(given, verify=verify))
            for given in (reference, port, baseline))
        mapping, said = _mapping(mapping, port_trace)
        refuse_multi_rank_reference(ref_trace)
        manifest = port_trace.path if port_trace.rank_paths else None
        replicas = None
        if manifest is not None:
            shapes = reference_shapes(ref_trace)  # what plain local parts are cut from
            replicas = replica_disagreement(port_trace, mapping, shapes)
            port_trace, told = stack.enter_context(gathered(
                port_trace, mapping, workers=workers,
                others=[t.path for t in (ref_trace, base_trace) if t is not None],
                shapes=shapes))
            said += told
        if base_trace is not None and (
                base_trace.path.resolve() == port_trace.path.resolve()
                or (base_trace.meta.get("case") and base_trace.meta.get("case")
                    == port_trace.meta.get("case") != ref_trace.meta.get("case"))):
            raise DiffError(f"baseline {base_trace.path} is a trace of the port, not of the "
                            "reference: judged by its own error, any port passes; capture the "
                            f"reference's case ({ref_trace.meta.get('case', 'REF_CASE')}) the "
                            "port's way as the baseline")
        judge = None if base_trace is None else measure_baseline(
            ref_trace, base_trace, baseline_factor, progress)
        result = _diff(ref_trace, port_trace, mapping, tolerances, progress, independent, judge,
                       seq_axis, base_trace, padding_mask)
        result.meta["warnings"] = said + result.meta["warnings"]
        if manifest is not None:
            attach_ranks(result.origins, PairReader(ref_trace, port_trace, result.pairs))
            result.meta["gathered"] = port_trace.meta["gathered"]
            result.meta["replicas"] = replicas
        return result


def _mapping(given: str | os.PathLike | Mapping | None, port: Trace) -> tuple[Mapping, list[str]]:
    """The mapping to pair with: the one given, else the one the port trace recorded when its
    weights were loaded (``capture --weights-from --map``); and what to tell the user."""
    weights = port.meta.get("weights")
    recorded = weights.get("mapping") if isinstance(weights, dict) else None
    if isinstance(given, Mapping):
        return given, []
    if given is None:
        return Mapping.recorded(port.meta, port.path.name) or Mapping(), []
    mapping = Mapping.load(given)
    text = Path(given).read_text(encoding="utf-8")
    if isinstance(recorded, dict) and hashlib.sha256(text.encode()).hexdigest() != recorded.get(
            "sha256"):
        return mapping, [f"--map {given} differs from the mapping {port.path.name} was captured "
                         f"with ({recorded['name']}); pairing follows --map"]
    return mapping, []


def measure_baseline(ref: Trace, base: Trace, factor: float,
                      progress: Progress | None) -> Baseline:
    """The baseline's own error against the reference, record by record (same names)."""
    sites = match_sites(ref.sites, base.sites, ref.index, base.index, Mapping())
    records = pair_records(ref.index, base.index, sites, Mapping())
    exact = [pair for pair in records.pairs if pair.match == "exact"]
    if base.summary and not ref.summary:
        raise DiffError(f"baseline {base.path} is a summary trace: its statistics cannot show "
                        "the element-wise error a full trace is judged by; capture the baseline "
                        "without --summary")
    if len({pair.ref for pair in exact}) < len(ref.index) // 2:
        raise DiffError(f"baseline {base.path} shares under half of its records with reference "
                        f"{ref.path}; a baseline is the reference's own case captured in the "
                        "port's precision "
                        f"(layerdiff capture {ref.meta.get('case', 'CASE')} --dtype ... -o "
                        "baseline.h5)")
    rows = _Comparer(ref, base, Tolerances(), ref.loss_scale / base.loss_scale).run(
        exact, progress)
    floats = rows[rows[Column.DTYPE].astype(str).str.contains("float")]
    if len(floats) and floats[Column.VERDICT].isin(UNCHANGED).all():
        raise DiffError(f"baseline {base.path} is identical to reference {ref.path}: it shows "
                        "no error to allow; a baseline is the reference run the port's way "
                        "(--dtype, --autocast, or on the port's device)")
    judge = Baseline.from_rows(base.path.name, rows, factor=factor)
    cases = ref.meta.get("case"), base.meta.get("case")
    if all(cases) and cases[0] != cases[1]:  # a case built on another device may be named so
        judge.warnings.append(f"the baseline is a trace of case {cases[1]}, the reference of "
                              f"{cases[0]}: a baseline should be the reference's own model")
    return judge


def _diff(ref: Trace, port: Trace, mapping: Mapping, tolerances: Tolerances,
          progress: Progress | None, independent: bool,
          baseline: Baseline | None = None, seq_axis: int | None = None,
          base_trace: Trace | None = None, padding_mask: str | bool | None = None) -> R.Diff:
    ref_index, port_index = ref.index, port.index
    sites = match_sites(ref.sites, port.sites, ref_index, port_index, mapping)
    records = pair_records(ref_index, port_index, sites, mapping, CallSignatures.of(ref, port),
                           outside_gradients=ref.meta.get("grad_output") == "outside",
                           output_conversions=_output_conversions(ref, port, sites, mapping))
    # call = "...": imports the adapter; its inputs judged by the baseline as any record
    adapted = adapt_calls(ref, port, records, mapping, tolerances, baseline)
    if not records.pairs and adapted.empty:
        raise DiffError(f"{ref.path} and {port.path} have nothing in common: no site of one "
                        "pairs with a site of the other (first reference sites: "
                        f"{', '.join(ref.sites['site'][:3])}; first port sites: "
                        f"{', '.join(port.sites['site'][:3])}); pass --map with a mapping file")
    grad_factor = ref.loss_scale / port.loss_scale
    comparer = _Comparer(ref, port, tolerances, grad_factor, baseline)
    rows = adapted.join(comparer.run(records.pairs, progress))
    converted_said: list[str] = []
    if records.converted:  # parameters made through a conversion function: compared through it
        from layerdiff.compare.converted import converted_rows
        rows, converted_said = converted_rows(comparer, rows, records.converted)
    output_plans: dict = {}
    if records.output_converted:  # outputs brought into the reference's layout by a function
        from layerdiff.compare.outconv import output_rows
        rows, output_plans = output_rows(comparer, rows, records)
    if not independent:  # a replay records only the calls it made: absent is not None there
        rows = absent_rows(comparer, rows, records.absent)  # gradients the port never sent
    _refuse_guessed_names(ref, port, sites, rows, mapping)
    _refuse_other_models(ref, port, rows)
    _excuse_inner_ops(rows)
    unmatched = pd.DataFrame(
        [(side, None, site, "", "", why, declared) for side, site, why, declared
         in sites.unmatched] + [(*entry, False) for entry in records.unmatched]
        + [(*entry, True) for entry in records.declared], columns=R.UNMATCHED_COLUMNS)
    # routers' top-k compared as sets per token; their index records judged as decisions
    routers = routing_report(ref, port, base_trace, mapping, rows)
    judge_decisions(rows, routers)
    pairs = _row_pairs(ref_index, records)
    pairs.update(output_plans)
    reader = PairReader(ref, port, pairs)
    # before the origins: a record out only at unused padding positions can never be one
    padded = padding.excuse_padding(rows, reader, declared=padding_mask, seq_axis=seq_axis)
    origins, first_step = find_origins(rows, ref.sites, independent=independent,
                                       ref_index=ref_index, dropped=records.excused,
                                       port_missing=records.port_missing,
                                       extra_norms=records.norms)
    unjudged = first_unjudged(rows, ref.sites, origins, first_step)
    explain_op_pairings(origins, sites, rows)  # before the hints: it names the op they read
    # failing records only, read once more: a passing diff pays nothing
    by_position = positions.by_position(rows, reader, declared=seq_axis,
                                        known=padding.padding_vectors(padded))
    positions.attach(origins, by_position)
    attach_hints(origins, reader)
    # an origin whose worst element a flip explains (and whether the flip explains all of it)
    explain_origins(origins, routers, ref, reader, ["layerdiff", "diff", str(ref.path),
                    str(port.path), *diff_options(mapping, tolerances)])
    explain_weighting(origins, routers, ref, reader)
    meta = _diff_meta(ref, port, mapping, tolerances, baseline, rows, sites, routers, padded,
                      origins, first_step, converted_said)
    judging = {"dropped": records.excused, "port_missing": records.port_missing,
               "extra_norms": records.norms}
    found = R.Diff(ref.path, port.path, rows, origins, unmatched, first_step, meta,
                  pd.DataFrame(records.not_taken, columns=R.NOT_TAKEN_COLUMNS), pairs, unjudged,
                  unjudgeable_sites(rows, ref_index, dropped=records.excused,
                                    port_missing=records.port_missing),
                  judging=judging)
    found.positions = by_position
    found.padding = padding.position_marks(padded, by_position)
    return found


def _diff_meta(ref: Trace, port: Trace, mapping: Mapping, tolerances: Tolerances,
               baseline: Baseline | None, rows: pd.DataFrame, sites, routers, padded,
               origins: list, first_step: int | None, converted_said: list[str]
               ) -> dict[str, Any]:
    """What a diff's result says of how it was made: the loss scales, mapping, tolerances,
    site counts, warnings, the precision hint, routing and padding, and the commands to run
    next."""
    return {
        "loss_scale": {"reference": ref.loss_scale, "port": port.loss_scale},
        "mapping": (None if not mapping.path else f"{mapping.path} ({mapping.origin})"
                    if mapping.origin else str(mapping.path)),
        "tolerances": tolerances.as_json(),
        "sites": {"reference": int(ref.sites["site"].nunique()),
                  "port": int(port.sites["site"].nunique()),
                  "paired": len(sites.pairs)},
        "summary": ref.summary or port.summary,
        "baseline": None if baseline is None else {"trace": baseline.name,
                                                   "factor": baseline.factor},
        "warnings": ([] if baseline is None else list(baseline.warnings))
        + mapping.unused_site_rules(ref.sites["module"].unique())
        + tolerances.unmatched(rows) + converted_said + _steps_apart(ref, port),
        "precision": None if baseline is not None else _precision_hint(ref, port, rows,
                                                                        mapping, tolerances),
        "routing": [router.as_json() for router in routers if router.flips],
        "padding": padded.as_json(),
        "forced_routing": {side: trace.meta["forced_routing"] for side, trace in
                           (("reference", ref), ("port", port))
                           if trace.meta.get("forced_routing")},
        "op_pairings": op_pairings(sites),
        "ops_commands": ops_commands(ref, port, [o for o in origins if not (
            o.routing and o.routing.get("confined"))], first_step,
                                     diff_options(mapping, tolerances)),
        "full_commands": full_commands(ref, port, origins, first_step,
                                       diff_options(mapping, tolerances)),
    }


def _steps_apart(ref: Trace, port: Trace) -> list[str]:
    """A warning when the two traces recorded different steps (two monitors' every=K or
    windows, captures of different --steps): only the steps both hold are compared."""
    steps = [sorted({int(step) for step in trace.sites["step"]}) for trace in (ref, port)]
    if steps[0] == steps[1]:
        return []
    both = sorted(set(steps[0]) & set(steps[1]))

    def said(found: list[int]) -> str:
        return ", ".join(map(str, found[:6])) + (" ..." if len(found) > 6 else "")

    return [f"the reference recorded steps {said(steps[0])} and the port steps "
            f"{said(steps[1])}: only the {len(both)} both recorded were compared"
            + (f" ({said(both)})" if both else "")
            + "; record the same steps on both sides (the same every= and window=, or --steps)"]


def _output_conversions(ref: Trace, port: Trace, sites, mapping: Mapping) -> dict:
    """Reference site -> its output conversion: ``output_transform =`` on its rule, else one
    the diff derives where the mapping converts the site's weights by a row permutation
    (compare/outconv.py; torch, only for a mapping whose [[param]] rules name a function)."""
    found = {}
    for pair in sites.pairs:
        conversion = mapping.output_conversion(pair.reference)
        if conversion is not None:
            found[pair.reference] = conversion
    if any(is_code(step) for rule in mapping.param_rules for step in rule.transforms):
        from layerdiff.compare.outconv import derived_conversions
        found.update(derived_conversions(ref, port, sites, mapping, set(found)))
    return found


def _row_pairs(ref_index: pd.DataFrame, records: RecordPairing) -> dict[RowKey, RecordPair]:
    """How each row's records were paired, by the row's key: what a row is read back through
    (:mod:`layerdiff.compare.pair`). A gradient the port never sent pairs the reference's with
    zeros (``absent``), a parameter made through a conversion is read through it; rows a
    call adapter made are read by their names."""
    steps, sites = ref_index["step"].to_numpy(), ref_index["site"].to_numpy()
    roles, args = ref_index["role"].to_numpy(), ref_index["arg"].to_numpy()
    found: dict[RowKey, RecordPair] = {}
    plans = [*records.pairs, *(RecordPair(ref, port, "absent", 1.0)
                               for ref, port in records.absent)]
    for item in records.converted:  # a weight's row at its first reference tensor, a
        # gradient's at each (see compare/converted.py)
        weight = roles[item.refs[0]] == Role.WEIGHT
        plans += [ConvertedPair(ref, item.port, "converted", 1.0, item=item)
                  for ref in (item.refs[:1] if weight else item.refs)]
    for plan in plans:
        at = plan.ref
        found.setdefault((int(steps[at]), str(sites[at]), str(roles[at]), str(args[at])), plan)
    return found


def _excuse_inner_ops(rows: pd.DataFrame) -> None:
    """An op site's failing rows, in a pass where every record of the module call that runs it
    is within, are marked ``module-within``: op sites pair by name and shapes, and a port that
    computes the module through other intermediate values (a scale moved before a matmul) is
    not wrong where the module is right."""
    failing = rows.index[~rows[Column.VERDICT].isin(judge.PASSING)]
    ops = [pos for pos in failing if schema.is_op_site(rows.at[pos, Column.SITE])]
    if not ops:
        return
    module_ok: dict[tuple[int, str, str], bool] = {}
    own = rows[~rows[Column.ROLE].isin(PARAM_ROLES)]
    calls = own.groupby([Column.STEP, Column.PASS, Column.SITE], sort=False)
    for key, verdicts in calls[Column.VERDICT]:
        module_ok[key] = bool(verdicts.isin(judge.PASSING).all())
    for pos in ops:
        module = schema.split_op_site(rows.at[pos, Column.SITE])[0]
        if module_ok.get((rows.at[pos, Column.STEP], rows.at[pos, Column.PASS], module), False):
            rows.at[pos, Column.VERDICT] = Verdict.MODULE_WITHIN
            rows.at[pos, Column.NOTE] = "; ".join(filter(None, [
                rows.at[pos, Column.NOTE], f"out, but every {rows.at[pos, 'pass']} record of "
                f"{module} is within: the port computes it through other intermediate values"]))


def _refuse_guessed_names(ref: Trace, port: Trace, sites, rows: pd.DataFrame,
                          mapping: Mapping) -> None:
    """Most sites paired only by the structural guess, and shapes clash: the names differ and
    no verdict on such pairs can be trusted, so ask for a mapping instead of naming an origin."""
    guessed = [pair for pair in sites.pairs if pair.match == "structural"]
    clashes = rows[rows[Column.VERDICT] == Verdict.SHAPE_MISMATCH]
    if len(guessed) * 2 <= len(sites.pairs) or clashes.empty:
        return
    lost = [site for side, site, _, declared in sites.unmatched if not declared]
    example = clashes.iloc[0]
    raise DiffError(
        f"the names differ between {ref.path} and {port.path}: {len(guessed)} of "
        f"{len(sites.pairs)} site pairs were only guessed from execution order and output "
        f"shapes, and {len(clashes)} compared records clash in shape (e.g. {example['site']} "
        f"{example['role']} {example['arg']} ({example['shape']}) with {example['port_site']} "
        f"({example['port_shape']})); write a mapping (--map, see docs/mapping.md"
        + ("; `layerdiff map-check` checks it" if mapping.path is None else "") + ")"
        + (f"; sites it could not pair: {', '.join(lost[:6])}"
           + (" ..." if len(lost) > 6 else "") if lost else ""))


def _refuse_other_models(ref: Trace, port: Trace, rows: pd.DataFrame) -> None:
    """A port computes the reference's function on the reference's data: when the model's own
    inputs differ in size, or most paired records clash in shape, the traces are of different
    models (or cases), and no verdict on them means anything."""
    tensors = rows[rows[Column.NUMEL] > 0]
    clashes = tensors[tensors[Column.VERDICT] == Verdict.SHAPE_MISMATCH]
    inputs = clashes[(clashes[Column.SITE] == "<root>#0") & (clashes[Column.ROLE] == Role.INPUT)]
    sizes = [(row, int(np.prod(schema.parse_shape(row[Column.PORT_SHAPE]))))
             for _, row in inputs.iterrows()]
    wrong = [(row, size) for row, size in sizes if size != row[Column.NUMEL]]
    if not wrong and (clashes.empty or len(clashes) * 2 <= len(tensors)):
        return
    cases = (ref.meta.get("case"), port.meta.get("case"))
    what = (f" (cases {cases[0]} and {cases[1]})" if all(cases) and cases[0] != cases[1]
            else "")
    if wrong:
        row = wrong[0][0]
        evidence = (f"the model's input {row['arg']} is ({row['shape']}) in the reference and "
                    f"({row['port_shape']}) in the port")
    else:
        example = clashes.iloc[0]
        evidence = (f"{len(clashes)} of {len(tensors)} paired records differ in shape (e.g. "
                    f"{example['site']} {example['role']} {example['arg']}: ({example['shape']}) "
                    f"and ({example['port_shape']}))")
    raise DiffError(f"{ref.path} and {port.path} are traces of different models or inputs"
                    f"{what}: {evidence}; capture the port on the reference's case inputs, with "
                    "its weights (--weights-from), or pass --map where names differ")


MAX_LOWER_NAMED = 5    # records of a lower dtype in a full-precision port, named by the hint
LOWER_SHARE = 0.1      # a port with at most this share of its float records in a lower dtype
                       # (and captured without a lower --dtype or autocast) runs in full
                       # precision


def _one_tensor_lower(port: Trace, floats: pd.DataFrame, differ: pd.DataFrame) -> bool:
    """Whether the port runs in its reference's precision but for a few records of a lower
    dtype: captured without a lower --dtype or an autocast, and those records at most
    LOWER_SHARE of its floating-point ones."""
    meta = port.meta
    if meta.get("autocast") or str(meta.get("dtype") or "") in ("bfloat16", "float16", "half"):
        return False
    return len(differ) <= LOWER_SHARE * len(floats)


def _precision_hint(ref: Trace, port: Trace, rows: pd.DataFrame, mapping: Mapping,
                    tolerances: Tolerances | None = None) -> dict[str, Any] | None:
    """When the port runs in another precision and no baseline was given: the two commands
    that judge it by what that precision allows (the baseline captured as the reference was,
    the diff with this diff's mapping and tolerances)."""
    # both floats: a record paired with an integer one (a (batch, T) 0/1 mask against a 4-D
    # float mask of the same name) is a different tensor, not the port's precision
    floats = rows[rows[Column.DTYPE].astype(str).str.contains("float")
                  & rows[Column.PORT_DTYPE].astype(str).str.contains("float")]
    differ = floats[floats[Column.DTYPE] != floats[Column.PORT_DTYPE]]
    if differ.empty:
        return None
    port_dtype = str(differ[Column.PORT_DTYPE].mode().iloc[0])
    autocast = port.meta.get("autocast")
    if _one_tensor_lower(port, floats, differ):
        # a float32 port with a few lower-precision tensors (a table, a constant cast to
        # bfloat16 and multiplied into float32 values): a baseline run wholly in that dtype
        # would hide the mistake; name the tensors instead
        named = [f"{row[Column.SITE]} {row[Column.ROLE]} '{row[Column.ARG]}'"
                 for _, row in differ.drop_duplicates(
                     [Column.SITE, Column.ROLE, Column.ARG]).head(MAX_LOWER_NAMED).iterrows()]
        return {"reference": str(floats[Column.DTYPE].mode().iloc[0]),
                "port": str(floats[Column.PORT_DTYPE].mode().iloc[0]), "lower": port_dtype,
                "records": named, "count": len(differ)}
    flag = (f"--autocast {autocast}" if autocast
            else f"--dtype {port.meta.get('dtype') or port_dtype}")
    # always the steps: the trace cannot tell whether the reference ran its case's default
    options = f" --steps {int(ref.meta.get('steps', 1) or 1)}"
    if ref.loss_scale != 1.0:
        options += f" --loss-scale {ref.loss_scale:g}"
    same = [[f"--{name}", glob] for name in ("include", "exclude")
            for glob in ref.meta.get(name) or []]  # the same records as the reference
    same += [["--ops", glob] for glob in (ref.meta.get("ops") or {}).get("globs") or []]
    if ref.summary:
        same.append(["--summary"])
    if same:
        options += " " + shlex.join([word for words in same for word in words])
    case = ref.meta.get("case") or "REF_CASE"
    base = ref.path.with_name(f"{ref.path.stem}.{port_dtype}.h5")
    given = diff_options(mapping, tolerances)
    return {"reference": str(differ[Column.DTYPE].mode().iloc[0]), "port": port_dtype,
            "capture": f"layerdiff capture {case} {flag}{options} -o {base}",
            "diff": f"layerdiff diff {ref.path} {port.path} --baseline {base}"
                    + (" " + shlex.join(given) if given else "")}


class _Comparer:
    """Turns record pairs into rows: digests first, data only where they differ."""

    def __init__(self, ref: Trace, port: Trace, tolerances: Tolerances,
                 grad_factor: float, baseline: Baseline | None = None) -> None:
        self.ref, self.port = ref, port
        self.tolerances = tolerances
        self.baseline = baseline
        self.grad_factor = grad_factor
        self.scratch = Scratch()  # one set of work arrays for every chunk of this diff

    def run(self, pairs: list[RecordPair], progress: Progress | None) -> pd.DataFrame:
        # plain dicts: a pandas row lookup costs ~100 us, which dominated large identical diffs
        ref_index = self.ref.index.to_dict("records")
        port_index = self.port.index.to_dict("records")
        rows: list[dict[str, Any]] = []
        streamed: list[tuple[int, TensorRef, TensorRef, PairMetrics, tuple[int, ...]]] = []
        # records decided from the index (same digests, statistics) whose data the verdict
        # still vouches for: read only to check them against their digests
        unread: tuple[dict[int, TensorRef], dict[int, TensorRef]] = ({}, {})
        # pairs of equal digests whose bytes are both read (to be checked): compared as well,
        # so that "identical" means equal bytes, not a digest a crafted file can keep
        same: list[_SamePair] = []
        checked: tuple[set[int], set[int]] = (set(), set())
        for pair in pairs:
            r, p = ref_index[pair.ref], port_index[pair.port]
            row = self._base_row(pair, r, p)
            rows.append(row)
            if row[Column.VERDICT]:  # decided from the index alone
                if row[Column.VERDICT] == Verdict.IDENTICAL and r["kind"] == "tensor":
                    refs = []
                    for side, trace, number, record in ((0, self.ref, pair.ref, r),
                                                        (1, self.port, pair.port, p)):
                        tensor = _tensor(trace, record, None, False, compared=False)
                        if number in checked[side]:  # its bytes checked once is enough
                            tensor = dataclasses.replace(tensor, check=None)
                        checked[side].add(number)
                        refs.append(tensor)
                    same.append(_SamePair(len(rows) - 1, pair, r, p, *refs))
                elif (row[Column.VERDICT] == Verdict.SAME_DIGEST
                      or min(r["segment"], p["segment"]) < 0):
                    for side, trace, number, record in ((0, self.ref, pair.ref, r),
                                                        (1, self.port, pair.port, p)):
                        if trace.verify and record["kind"] == "tensor" and record["segment"] >= 0:
                            unread[side][number] = _tensor(trace, record, None, False,
                                                           compared=False)
                continue
            streamed.append(self._streamed(len(rows) - 1, pair, r, p, row))
        self._stream(rows, streamed, [list(side.values()) for side in unread], same, progress)
        frame = pd.DataFrame(rows, columns=R.ROW_COLUMNS)
        return frame.sort_values([Column.STEP, Column.SEQ], kind="stable", ignore_index=True)

    def _streamed(self, position: int, pair: RecordPair, r: dict, p: dict,
                  row: dict[str, Any]) -> tuple[int, TensorRef, TensorRef, PairMetrics,
                                                tuple[int, ...]]:
        """What the metrics stream needs of a pair compared element by element."""
        shape = sliced_shape(schema.parse_shape(r["shape"]), pair.ref_slice, False)
        tolerance = Tolerance(row[Column.RTOL], row[Column.ATOL], row[Column.TOL_SOURCE])
        metrics = new_metrics(tolerance, r, p, shape, row[Column.ROLE])
        metrics.scratch = self.scratch
        if row[Column.ROLE] in GRAD_ROLES and self.grad_factor != 1.0:
            metrics.ulp_scale = None  # rescaled values: ULPs of neither side
        return (position, _tensor(self.ref, r, pair.ref_slice, False, compared=True),
                _tensor(self.port, p, pair.port_slice, pair.transpose_port, compared=True),
                metrics, shape)

    def _base_row(self, pair: RecordPair, r: dict, p: dict) -> dict[str, Any]:
        ref_shape = sliced_shape(schema.parse_shape(r["shape"]), pair.ref_slice, False)
        port_shape = sliced_shape(schema.parse_shape(p["shape"]), pair.port_slice,
                                  pair.transpose_port)
        dtype = looser_dtype(r["dtype"], p["dtype"]) if r["kind"] == "tensor" else ""
        tolerance = self.tolerances.lookup(r["site"], r["role"], r["arg"], dtype)
        scale = self.ref.loss_scale
        if r["role"] in GRAD_ROLES and scale != 1.0:
            # Tolerances are for the loss as it is; gradients here are amplified by the loss
            # scale, and so is their rounding error: atol follows, rtol needs nothing.
            tolerance = Tolerance(tolerance.rtol, tolerance.atol * scale,
                                  f"{tolerance.source}; atol x loss scale {scale:g}",
                                  tolerance.kind)
        rms_tol = None
        if (self.baseline is not None and r["kind"] == "tensor"
                and tolerance.kind not in ("rule", "flags")):  # what the user said wins
            limit = self.baseline.limit(
                (int(r["step"]), r["site"], r["role"], r["arg"]), r, p["dtype"],
                scale if r["role"] in GRAD_ROLES else 1.0)
            if limit is not None:
                tolerance, rms_tol = limit.tolerance, limit.rms
        row: dict[str, Any] = dict.fromkeys(R.ROW_COLUMNS)  # plain strings: the frame's labels
        row.update({
            Column.STEP: int(r["step"]), Column.PASS: r["pass"], Column.SEQ: int(r["seq"]),
            Column.SITE: r["site"], Column.ROLE: r["role"], Column.ARG: r["arg"],
            Column.PORT_SITE: p["site"], Column.PORT_ARG: p["arg"], Column.MATCH: pair.match,
            Column.CONFIDENCE: pair.confidence, Column.SHAPE: schema.format_shape(ref_shape),
            Column.PORT_SHAPE: schema.format_shape(port_shape), Column.DTYPE: r["dtype"],
            Column.PORT_DTYPE: p["dtype"], Column.NUMEL: int(np.prod(ref_shape)),
            Column.RTOL: tolerance.rtol, Column.ATOL: tolerance.atol,
            Column.TOL_SOURCE: tolerance.source, Column.RMS_TOL: rms_tol,
            Column.VERDICT: "", Column.NOTE: "", Column.STATUS: "", Column.CAUSE: "",
        })
        notes = []
        if r["kind"] != "tensor" or p["kind"] != "tensor":
            same = r["kind"] == p["kind"] and r["value"] == p["value"]
            row.update(verdict=Verdict.IDENTICAL if same else Verdict.OUT,
                       ratio=0.0 if same else np.inf,
                       note="" if same else f"values differ: reference {r['value'] or 'tensor'}"
                       f", port {p['value'] or 'tensor'}")
            return row
        if ref_shape != port_shape and not same_order(ref_shape, port_shape):
            row.update(verdict=Verdict.SHAPE_MISMATCH, ratio=np.inf,
                       note=f"shapes differ: reference ({r['shape']}), port ({p['shape']})")
            return row
        if ref_shape != port_shape:
            notes.append(reshape_note(ref_shape, port_shape))
        if r["dtype"] != p["dtype"]:
            notes.append(f"dtypes differ ({r['dtype']} vs {p['dtype']}): compared in float64 "
                         f"at {dtype}'s tolerance")
        if r["role"] in GRAD_ROLES and self.grad_factor != 1.0:
            notes.append(f"port gradients multiplied by {self.grad_factor:g} to the "
                         f"reference's loss scale {self.ref.loss_scale:g}")
        row[Column.NOTE] = "; ".join(notes)
        plain = pair.ref_slice is None and pair.port_slice is None and not pair.transpose_port
        unscaled = r["role"] not in GRAD_ROLES or self.grad_factor == 1.0
        if (plain and unscaled and r["digest"] and r["digest"] == p["digest"]
                and r["dtype"] == p["dtype"]):
            # identical only where both sides' bytes are read (to be checked) and compared
            # (in _stream); else all that is known is the digest
            compared = (min(r["segment"], p["segment"]) >= 0 and self.ref.verify
                        and self.port.verify)
            row.update(_identical_metrics(r),
                       verdict=Verdict.IDENTICAL if compared else Verdict.SAME_DIGEST)
        elif r["segment"] < 0 or p["segment"] < 0:
            self._compare_statistics(row, r, p, plain)
        return row

    def _compare_statistics(self, row: dict[str, Any], r: pd.Series, p: pd.Series,
                            plain: bool) -> None:
        """No tensor data on a side (a summary trace, or a site a --full-around capture kept
        statistics of): judge by the statistics in the index."""
        if not plain:
            row.update(verdict=Verdict.WITHIN, ratio=np.nan, note="statistics only: a sliced "
                       "or transposed parameter cannot be judged from statistics; not compared")
            return
        factor = self.grad_factor if r["role"] in GRAD_ROLES else 1.0
        ref_stats, port_stats = _statistics(r), _statistics(p) * factor
        with np.errstate(invalid="ignore"):
            gaps = np.abs(port_stats - ref_stats)
        ratio = judge.statistics_ratio(ref_stats, port_stats, row[Column.RTOL], row[Column.ATOL],
                                       ref_counts=(int(r["nan"]), int(r["inf"])),
                                       port_counts=(int(p["nan"]), int(p["inf"])))
        row.update(max_abs=float(np.nanmax(gaps, initial=0.0)), ratio=ratio,
                   ref_nan=int(r["nan"]), ref_inf=int(r["inf"]), port_nan=int(p["nan"]),
                   port_inf=int(p["inf"]),
                   note="; ".join(filter(None, [
                       row[Column.NOTE], "statistics only (no tensor data on one side): min, max, "
                       "mean, std and rms compared"])))
        row[Column.VERDICT] = judge.verdict(ratio, ref_nan=row[Column.REF_NAN],
                                            port_nan=row[Column.PORT_NAN],
                                            port_inf=row[Column.PORT_INF])

    def _stream(self, rows: list[dict[str, Any]], streamed: list,
                unread: list[list[TensorRef]], same: list[_SamePair],
                progress: Progress | None) -> None:
        """Metrics of the streamed pairs; meanwhile, on a second thread, the check of the
        records nothing else reads, and the byte comparison of the pairs whose digests agree.
        A pair whose bytes differ all the same (a digest collision: a crafted file, or a
        chance near 2**-63) is then compared element by element like any other."""
        total = sum(ref.byte_range()[1] if ref.streamable else ref.nbytes
                    for _, ref, _, _, _ in streamed)
        checked = sum(tensor.nbytes for side in unread for tensor in side) + sum(
            pair.ref_tensor.nbytes + pair.port_tensor.nbytes for pair in same)
        done = [0, 0]  # streamed, checked

        def report() -> None:
            if progress is not None:
                progress(min(sum(done), total + checked), total + checked)

        def count_checked(nbytes: int) -> None:
            done[1] += nbytes
            report()

        differing: list[int] = []
        jobs = [functools.partial(verify_tensors, trace.segments(), tensors, count_checked)
                for trace, tensors in zip((self.ref, self.port), unread, strict=True)
                if tensors]
        if same:
            jobs.append(lambda: differing.extend(compare_tensors(
                self.ref.segments(), self.port.segments(),
                [(pair.ref_tensor, pair.port_tensor) for pair in same], count_checked)))
        with _Background(jobs):
            self._metrics(rows, streamed, done, report)
        again = []
        for number in differing:
            pair = same[number]
            row = rows[pair.position]
            row.update(verdict="", note="; ".join(filter(None, [
                row[Column.NOTE], "equal digests, unequal bytes (a digest collision: a crafted "
                "file, or a chance near 2**-63): compared element by element"])))
            again.append(self._streamed(pair.position, pair.pair, pair.ref, pair.port, row))
        self._metrics(rows, again, done, report)

    def _metrics(self, rows: list[dict[str, Any]], streamed: list, done: list[int],
                 report: Callable[[], None]) -> None:
        if not streamed:
            return
        tensor_pairs = [(ref, port) for _, ref, port, _, _ in streamed]
        for chunk in stream_pairs(self.ref.segments(), self.port.segments(),
                                  tensor_pairs):
            position, _, _, metrics, shape = streamed[chunk.pair]
            port_values = chunk.port
            if rows[position][Column.ROLE] in GRAD_ROLES and self.grad_factor != 1.0:
                port_values = port_values.astype(np.float64) * self.grad_factor
            metrics.update(chunk.ref, port_values, chunk.start)
            done[0] += chunk.ref.nbytes
            if chunk.last:
                finish_row(rows[position], metrics, shape)
            report()


def _tensor(trace: Trace, row: dict, part, transpose: bool, *, compared: bool) -> TensorRef:
    """Where a record's bytes lie. When the trace verifies, they are checked against the
    record's digest, and against its statistics unless the pair is compared element by element
    and both a digest and a sealed index (verified by its table digest) vouch for the record:
    then the statistics are the writer's own, of those very bytes, and no verdict rests on
    them. Recomputing them anyway cost a third of a 2 GB diff's CPU."""
    statistics = not (compared and trace.index_sealed and row["digest"])
    return TensorRef(int(row["segment"]), int(row["offset"]), int(row["nbytes"]),
                     row["dtype"], schema.parse_shape(row["shape"]), part, transpose,
                     row if trace.verify else None, statistics)


@dataclasses.dataclass
class _SamePair:
    """A pair whose digests agree, its bytes to be compared: its row, and where they lie."""

    position: int  # of its row
    pair: RecordPair
    ref: dict
    port: dict
    ref_tensor: TensorRef
    port_tensor: TensorRef


class _Background:
    """Runs each job in turn on one daemon thread while the block runs; on leaving, waits for
    it and raises what it raised."""

    def __init__(self, jobs: list[Callable[[], None]]) -> None:
        self._error: BaseException | None = None

        def run() -> None:
            try:
                for job in jobs:
                    job()
            except BaseException as exc:  # surfaced in the caller's thread
                self._error = exc

        self._thread = threading.Thread(target=run, name="layerdiff-verify", daemon=True)

    def __enter__(self) -> _Background:
        self._thread.start()
        return self

    def __exit__(self, kind, *rest) -> None:
        if kind is not None:
            return  # the caller's error wins; the thread is a daemon and ends with its reads
        self._thread.join()
        if self._error is not None:
            raise self._error


def _statistics(row: pd.Series) -> np.ndarray:
    """min, max, mean, std and rms: per-element quantities, so the per-element tolerance
    applies to them (an L2 norm's error grows with the square root of the size)."""
    rms = record_rms(row)
    return np.array([*(float(row[c]) for c in STAT_COLUMNS), rms], dtype=np.float64)


def _identical_metrics(r: pd.Series) -> dict[str, Any]:
    return {"max_abs": 0.0, "max_rel": 0.0, "mean_abs": 0.0, "rms": 0.0, "cosine": 1.0,
            "max_ulp": 0.0, "frac_out": 0.0, "worst_index": "", "ratio": 0.0,
            "ref_nan": int(r["nan"]), "ref_inf": int(r["inf"]), "port_nan": int(r["nan"]),
            "port_inf": int(r["inf"])}


def save_rows_csv(diff_result: R.Diff, path: str | os.PathLike) -> Path:
    """The rows as CSV (per-batch errors as a JSON list in their column)."""
    frame = diff_result.rows.copy()
    frame[Column.BATCH_RATIO] = [json.dumps(None if v is None else [float(x) for x in v])
                            for v in frame[Column.BATCH_RATIO]]
    with replacing(path) as temporary:
        frame.to_csv(temporary, index=False)
    return Path(path)
