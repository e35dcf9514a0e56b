"""``replay``: each port layer on the reference's own inputs, to measure its own error.

The replayed calls are written as a trace in the port's names and diffed against the
reference like any port trace, judging every site on its own (``diff(independent=True)``).
Beside each site's local error the result carries the *propagated* error of a plain diff of
the port's own run, and the amplification (output error over input error) of that run, so a
layer that merely passes on an error is exonerated and one that makes its own is not.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.capture.routes import describe
from layerdiff.case import Case, ExternalCase
from layerdiff.compare import diff, judge
from layerdiff.compare.judge import PASSING, Status
from layerdiff.compare.matching import port_site_for
from layerdiff.compare.result import Column, Diff
from layerdiff.compare.tolerances import Tolerances
from layerdiff.errors import CaptureError, DiffError
from layerdiff.framework import framework_of
from layerdiff.mapping import Mapping
from layerdiff.mapping.code import CodeRef
from layerdiff.replay.calling import MAPPING_DROPS
from layerdiff.replay.recorded import RecordedCall, recorded_calls
from layerdiff.trace import Trace, TraceWriter, open_trace, schema
from layerdiff.trace.arguments import map_argument
from layerdiff.trace.routers import recorded_routes, routers
from layerdiff.trace.schema import CALL_ROLES, COMPUTED_GRAD_ROLES, Pass, Role


class LocalVerdict(StrEnum):
    """A site's verdict in :attr:`ReplayResult.local` (its ``verdict`` column holds the
    values)."""

    LOCAL_ERROR = "LOCAL ERROR"   # out of tolerance on the reference's own inputs
    EXONERATED = "exonerated"     # within on them, out in the port's own run: it passes one on
    HOLDS_ONE = "holds one"       # a container out only because a site inside it is
    WITHIN = "within"


class ReplayOutcome(StrEnum):
    """:attr:`ReplayResult.outcome` (the ``verdict`` of its JSON)."""

    PASS = "pass"                   # no layer has a local error, every one could be called
    FAIL = "fail"                   # some layer has a local error
    CANNOT_JUDGE = "cannot-judge"   # none has one, but some could not be called


@dataclass
class ReplayResult:
    """What replay found: each port layer's own error on the reference's recorded inputs.

    True when no layer has a local error and every paired layer could be called (``if
    result: ...``). A layer that could not be called, or raised, *cannot be judged*: it is
    listed with its reason in ``cannot_judge`` and never counts as within tolerance.
    """

    diff: Diff                                   # the replayed calls, each site on its own
    replayed: list[tuple[str, str]]              # (reference site, port site)
    cannot_judge: list[tuple[str, str]]          # (reference site, why)
    skipped: list[tuple[str, str]]               # (reference site, why): not replayable
    # port site -> [(reference argument, why)]: not taken by the port layer (no parameter for
    # it, or the mapping drops it), left out of its call and of the input check
    dropped: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    propagated: Diff | None = None               # a plain diff of the port's own run
    notes: list[str] = field(default_factory=list)  # what could not be measured, and why

    @property
    def not_taken(self) -> dict[str, list[tuple[str, str]]]:
        """The reference's arguments each port layer did not take (``dropped``)."""
        return self.dropped

    @property
    def local(self) -> pd.DataFrame:
        """One row per site and pass: local error, propagated error, amplification, verdict
        (a :class:`LocalVerdict`'s value)."""
        return _local_table(self.diff.rows, self.propagated)

    @property
    def skipped_sites(self) -> list[str]:
        """The reference sites that were skipped (not replayable), without the weight
        gradients set aside, which ``skipped`` lists too."""
        return [site for site, _ in self.skipped if " " not in site]

    @property
    def outcome(self) -> ReplayOutcome:
        if not self.diff.passed:
            return ReplayOutcome.FAIL
        return ReplayOutcome.CANNOT_JUDGE if self.cannot_judge else ReplayOutcome.PASS

    @property
    def passed(self) -> bool:
        return self.outcome == ReplayOutcome.PASS

    def __bool__(self) -> bool:
        return self.passed

    @property
    def origin(self):
        return self.diff.origin

    def as_json(self) -> dict[str, Any]:
        local = self.local
        return {**self.diff.as_json(), "verdict": str(self.outcome),
                "replay": {"replayed": len(self.replayed),
                           "cannot_judge": [list(entry) for entry in self.cannot_judge],
                           "skipped": [list(entry) for entry in self.skipped],
                           "dropped": self.dropped, "notes": self.notes},
                "propagated": None if self.propagated is None else {
                    "verdict": self.propagated.verdict,
                    "origin": self.propagated.origin.as_json() if self.propagated.origin
                    else None},
                "local": json.loads(local.to_json(orient="records"))}


def replay(reference: str | os.PathLike, port: Case | ExternalCase, *,
           mapping: str | os.PathLike | Mapping | None = None,
           sites: Sequence[str] = (), tolerances: str | os.PathLike | Tolerances | None = None,
           output: str | os.PathLike | None = None, propagated: bool = True,
           reference_case: Case | None = None, force_routing: bool = False) -> ReplayResult:
    """Replay every matched site of ``reference`` into ``port`` and judge each on its own.

    ``port`` is a torch Case (its model gets the reference's weights through ``mapping``) or
    an ExternalCase with per-site ``layers``. ``sites`` are globs over the reference's site or
    module names. ``output`` keeps the replay trace. With ``propagated``, the port also runs
    whole on the case's inputs, for the propagated error beside each local one.

    A weight the port's code also uses outside its modules' calls (a tied head
    ``x @ self.tok.weight.T`` in the root) has a recorded gradient that no module's call alone
    makes. With ``reference_case`` (the reference's torch case) the reference's modules are
    replayed alone too and what their calls make is compared with what the port's make;
    without it that weight gradient is set aside, "cannot judge alone", in ``skipped``.

    ``force_routing`` (a torch port): each replayed layer that holds a mixture-of-experts
    router sends every token to the experts the reference's recorded for it, so its experts
    are judged apart from routing (:mod:`layerdiff.capture.routes`).
    """
    mapping = mapping if isinstance(mapping, Mapping) else (
        Mapping.load(mapping) if mapping is not None else Mapping())
    with tempfile.TemporaryDirectory(prefix="layerdiff-replay-") as tmp:
        path = Path(output) if output else Path(tmp) / "replay.h5"
        with open_trace(reference) as ref:
            log = write_replay(ref, port, mapping, sites, path, reference_case, force_routing)
        result = ReplayResult(
            diff(reference, path, mapping=replayed_mapping(mapping, log), tolerances=tolerances,
                 independent=True),
            log.replayed, log.failed, log.skipped, log.dropped, notes=list(log.notes))
        if not force_routing and result.origin is not None:
            result.notes += _routing_hint(reference, mapping, result.origin.site)
        if propagated:
            try:
                result.propagated = _propagated(reference, port, mapping, tolerances, Path(tmp))
            except CaptureError as exc:  # the layers were judged one by one all the same
                result.notes.append(f"no propagated error: the port's own run failed ({exc})")
    return result


class ReplayLog:
    def __init__(self) -> None:
        self.failed: list[tuple[str, str]] = []     # (reference site, the error)
        self.skipped: list[tuple[str, str]] = []    # (reference site, why)
        self.replayed: list[tuple[str, str]] = []   # (reference site, port site)
        self.dropped: dict[str, list[tuple[str, str]]] = {}  # port site -> (argument, why)
        # reference site -> the reference's argument heads the port's call left out
        self.left_out: dict[str, set[str]] = {}
        self.notes: list[str] = []  # what the backend could not find out, and why


def write_replay(ref: Trace, port: Case | ExternalCase, mapping: Mapping,
                 sites: Sequence[str], path: Path,
                 reference_case: Case | None = None, force_routing: bool = False) -> ReplayLog:
    """The replay trace: every recorded call of step 0 that has a port partner, replayed.
    ``reference_case`` (torch) splits a weight gradient that has a use outside its modules'
    calls (:mod:`layerdiff.replay.alone`), for a torch or a Flax port."""
    calls = recorded_calls(ref, sites)  # refuses a summary trace before any work
    backend = _backend(ref, port, mapping, reference_case)
    adapters = _call_adapters(calls, mapping)  # a function that does not import: bad input
    if force_routing:
        _routes_to_force(ref, port, mapping, backend)
    if hasattr(backend, "output_conversions"):
        backend.output_conversions.update(_output_conversions(ref, calls, mapping, backend))
    if hasattr(backend, "output_renames"):  # each output gradient fed where the diff pairs it
        backend.output_renames.update({call.site: mapping.output_names(call.site)
                                       for call in calls})
    log = ReplayLog()
    meta = {"case": port.name, "replay_of": str(ref.path), "loss_scale": ref.loss_scale,
            "steps": 1}
    open_calls: list[tuple[RecordedCall, str]] = []
    unreplayable = _unreplayable(calls, mapping, backend)
    with TraceWriter(path, meta=meta, producer="layerdiff.replay") as writer:
        for call in calls:
            target = port_site_for(call.site, mapping, backend.modules)
            if target is None:   # the stack's reason, or the mapping's where it declares one
                declared = mapping.why_unmatched("reference", call.site)
                why = unreplayable.get(call.site) or ("no port layer pairs with it"
                                                      + (f" ({declared})" if declared else ""))
                log.skipped.append((call.site, why))
                continue
            held = next((inner for inner in unreplayable
                         if call.contains(_call_of(calls, inner))), None)
            if held is not None:  # its own error could not be told from that layer's
                log.skipped.append((call.site, f"it holds {held}, which replay cannot run "
                                    "alone: its error would be that layer's too"))
                continue
            while open_calls and not open_calls[-1][0].contains(call):
                writer.exit(open_calls.pop()[1])
            port_site, args_map = target
            adapter = adapters.get(call.site)
            module, number = schema.split_site(port_site)
            site = writer.enter(module, backend.type_of(module), call=number)
            open_calls.append((call, site))
            try:
                dropped = backend.replay(call, site, args_map, writer, adapter=adapter)
                log.replayed.append((call.site, port_site))
                if dropped:
                    log.dropped[port_site] = dropped
                    log.left_out[call.site] = _reference_heads(call, {} if adapter else args_map,
                                                               dropped)
            except Exception as exc:  # a port layer that raises is named; the rest goes on
                reason = f"{type(exc).__name__}: {exc}"
                if adapter is None and type(exc).__name__ not in ("NotReplayable",
                                                                  "CannotCall"):
                    reason += _adapter_hint(call, module)
                (log.skipped if type(exc).__name__ == "NotReplayable" else log.failed).append(
                    (call.site, reason))
        while open_calls:
            writer.exit(open_calls.pop()[1])
        backend.finish(writer, _complete_modules(ref, log))
        log.skipped.extend(getattr(backend, "set_aside", ()))
        log.notes.extend(getattr(backend, "notes", ()))
        if force_routing:
            # a router inside nested replayed layers (block, layer, root) is forced in each:
            # said once, with the most tokens it moved
            once = {}
            for forced in sorted(backend.forced, key=lambda f: len(f.rerouted)):
                once[forced.site] = forced
            log.notes.append("--force-routing: " + (
                describe(list(once.values())) if once else "no replayed port layer made a "
                "top-k over a router's scores (its layers route by other means, or hold no "
                "router): nothing was forced"))
    if not log.replayed:
        raise DiffError(f"no call of {ref.path} was replayed into {port.name}: "
                        + ("; ".join(f"{s}: {why}" for s, why in (log.failed + log.skipped)[:3])
                           or "no port layer pairs with any reference site")
                        + "; check the case and the mapping (--map)")
    return log


def _routing_hint(reference: str | os.PathLike, mapping: Mapping, site: str) -> list[str]:
    """When the failing layer holds a mixture-of-experts router: how to tell an expert's error
    from a token sent to another expert."""
    with open_trace(reference) as ref:
        at = ref.sites[ref.sites["step"] == 0].set_index("site")
        if site not in at.index:
            return []
        held = [router for step, router, _ in routers(ref, mapping) if step == 0
                and at.at[site, "enter_seq"] <= at.at[router, "enter_seq"]
                and at.at[router, "exit_seq"] <= at.at[site, "exit_seq"]]
    if not held:
        return []
    return [f"{site} holds the router {held[0]}: a token its port sends to other experts than "
            "the reference's changes its output by a lot without wrong code; replay "
            "--force-routing judges its experts on the reference's routes"]


def _routes_to_force(ref: Trace, port: Case | ExternalCase, mapping: Mapping,
                     backend: Any) -> None:
    """Give a torch port's replay the reference's step-0 routes, each with its router call's
    span; refuse a port of another framework or a reference that records no router."""
    if not hasattr(backend, "routes"):
        raise DiffError(f"--force-routing forces routes into a torch port's top-k calls; "
                        f"{port.name} is not a torch port: replay it without --force-routing")
    routes = recorded_routes(ref, mapping).by_step.get(0, [])
    if not routes:
        raise DiffError(f"--force-routing: {ref.path} records no router whose routes can be read "
                        "(a site whose output is (..., E) expert scores beside the (T, k) "
                        "experts taken from them, or one declared with [[router]] in the "
                        "mapping); replay without it")
    at = ref.sites[ref.sites["step"] == 0].set_index("site")
    backend.routes = [(int(at.at[route.site, "enter_seq"]), int(at.at[route.site, "exit_seq"]),
                       route) for route in routes]


def _adapter_hint(call: RecordedCall, port_module: str) -> str:
    """What a port layer that raised on the reference's arguments was given, and the call
    adapter that would give it what it takes instead (an additive mask for a boolean one)."""
    given = ", ".join(f"{arg} {row['dtype']} ({row['shape']})" if row["kind"] == "tensor"
                      else f"{arg} {row['value'] or 'None'}" for arg, row in call.inputs)
    module = schema.split_site(call.site)[0]
    return (f" (it was given the reference's arguments {given or 'none'}; where port layer "
            f"{port_module} takes one in another form, write a call adapter and name it on "
            f"the mapping's [[site]] rule for {module}: call = \"your_module:adapter\")")


def _call_adapters(calls: list[RecordedCall], mapping: Mapping
                   ) -> dict[str, tuple[CodeRef, Any]]:
    """Reference site -> (the mapping's call adapter, its function), imported once each; a
    name that does not import is refused (MappingError naming the rule's line)."""
    functions: dict[CodeRef, Any] = {}
    found = {}
    for call in calls:
        ref = mapping.call_adapter(call.site)
        if ref is not None:
            if ref not in functions:
                functions[ref] = ref.resolve()
            found[call.site] = (ref, functions[ref])
    return found


def _output_conversions(ref: Trace, calls: list[RecordedCall], mapping: Mapping,
                        backend: Any) -> dict[str, tuple[Any, Any]]:
    """Reference site -> (its output conversion, the function) for a torch port, as the diff
    finds it (compare/outconv.py ``SiteConversions``: the mapping's ``output_transform``, else
    the row permutation its conversion of the layer's weights makes), so a replayed layer is
    fed the reference's output gradient in its own layout."""
    from layerdiff.compare.outconv import SiteConversions, weight_shapes

    conversions = SiteConversions(mapping, weight_shapes(ref) if mapping.param_rules else {})
    index = ref.index
    firsts = index[(index["role"] == Role.OUTPUT) & (index["kind"] == "tensor")
                   & (index["arg"] == "0")]
    outputs = dict(zip(firsts["site"], firsts["shape"], strict=True))
    found: dict[str, tuple[Any, Any]] = {}
    for call in calls:
        target = port_site_for(call.site, mapping, backend.modules)
        if target is None:
            continue
        module_name = schema.split_site(target[0])[0]
        module = backend.modules[module_name]
        params = {f"{module_name}.{name}" if module_name else name: tuple(tensor.shape)
                  for held in (module._parameters, module._buffers)
                  for name, tensor in held.items() if tensor is not None}
        shape = schema.parse_shape(outputs[call.site]) if outputs.get(call.site) else ()
        conversion = conversions.find(call.site, module_name, params,
                                      shape[-1] if shape else None)
        if conversion is not None:
            found[call.site] = (conversion, conversions.function(conversion))
    return found


def _reference_heads(call: RecordedCall, args_map: dict[str, str],
                     dropped: list[tuple[str, str]]) -> set[str]:
    """The reference's argument heads behind the heads a port call left out (a rename rule
    may have given them the port's names)."""
    left = {head for head, why in dropped if why != MAPPING_DROPS}
    return {arg.partition(".")[0] for arg, _ in call.inputs
            if map_argument(arg, args_map).partition(".")[0] in left}


def replayed_mapping(mapping: Mapping, log: ReplayLog) -> Mapping:
    """The mapping the replay trace is diffed with. The trace holds each replayed call's inputs
    and input gradients under the reference's own argument names (mapped by the site's
    ``args``), so no call adapter stands between them; and what a port layer did not take is
    dropped at its site, so it is left out of the input check, not missing."""
    adjusted = dataclasses.replace(
        mapping, site_rules=[dataclasses.replace(rule, call=None) for rule in mapping.site_rules],
        pairs=dict(mapping.pairs), pair_args=dict(mapping.pair_args), pair_calls={},
        pair_outputs=dict(mapping.pair_outputs),
        pair_output_transforms=dict(mapping.pair_output_transforms))
    replayed = dict(log.replayed)
    for ref_site, heads in log.left_out.items():
        rename = mapping.rename(schema.split_site(ref_site)[0])
        args = mapping.pair_args.get(ref_site, {}) if ref_site in mapping.pairs else (
            rename[1] if rename is not None else {})
        if mapping.call_adapter(ref_site) is not None:
            args = {}
        adjusted.pairs[ref_site] = replayed[ref_site]
        adjusted.pair_args[ref_site] = {**args, **{head: "" for head in heads}}
        adjusted.pair_outputs[ref_site] = mapping.output_names(ref_site)
        conversion = mapping.output_conversion(ref_site)
        if conversion is not None:
            adjusted.pair_output_transforms[ref_site] = conversion
    return adjusted


def _complete_modules(ref: Trace, log: ReplayLog) -> set[str]:
    """Port modules all of whose reference calls were replayed: their weight gradients are
    sums over every call, as the reference's are."""
    calls = ref.sites[(ref.sites["step"] == 0)].groupby("module")["site"].apply(set)
    replayed: dict[str, set[str]] = {}
    ports: dict[str, str] = {}
    for ref_site, port_site in log.replayed:
        module = schema.split_site(ref_site)[0]
        replayed.setdefault(module, set()).add(ref_site)
        ports[module] = schema.split_site(port_site)[0]
    complete = set()
    for module, done in replayed.items():
        if done == calls.get(module, set()):
            complete.add(ports[module])
        else:
            log.skipped.append((f"{module} weight_grad", f"{len(done)} of "
                                f"{len(calls.get(module, ()))} calls replayed: the reference's "
                                "weight gradient sums them all, so it is not compared"))
    return complete


def _unreplayable(calls: list[RecordedCall], mapping: Mapping, backend) -> dict[str, str]:
    """Reference sites whose port layer exists but cannot be replayed alone (a layer of a
    stack the port runs with nnx.scan), with the backend's reason."""
    why_unpaired = getattr(backend, "why_unpaired", lambda site: None)
    found = {}
    for call in calls:
        if port_site_for(call.site, mapping, backend.modules) is None:
            module, number = schema.split_site(call.site)
            renamed = mapping.rename(module)  # the port's name for it, though it has no module
            why = why_unpaired(schema.site_name(renamed[0] if renamed else module, number))
            if why:
                found[call.site] = why
    return found


def _call_of(calls: list[RecordedCall], site: str) -> RecordedCall:
    return next(call for call in calls if call.site == site)


def _backend(ref: Trace, port: Case | ExternalCase, mapping: Mapping,
             reference_case: Case | None = None):
    """The port as replay calls it, from its framework, its weights loaded from ``ref``."""
    backend = framework_of(port).replay_port(port, ref, mapping)
    return _split_with(backend, ref, mapping, reference_case)


def _split_with(backend, ref: Trace, mapping: Mapping, reference_case: Case | None):
    """``backend`` (a torch or Flax port) given the reference case's modules replayed alone,
    to split a weight gradient that has a use outside its modules' calls
    (:mod:`layerdiff.replay.alone`); the reference is torch whatever the port's framework."""
    if reference_case is not None and hasattr(backend, "reference_alone"):
        from layerdiff.replay.alone import ReferenceAlone
        from layerdiff.replay.torch_replay import TorchPort

        backend.reference_alone = ReferenceAlone(reference_case.model, ref, TorchPort)
        backend.param_source = lambda name: mapping.param_source(name, {})
    return backend


def _propagated(reference, port, mapping: Mapping, tolerances, directory: Path) -> Diff:
    """A plain diff of the port's own run: the error each site inherited."""
    from layerdiff.capture import capture

    if getattr(port, "model", None) is not None:  # again: a replayed call may have changed
        framework_of(port).load_weights(port, reference, mapping)  # a BatchNorm's statistics
    run = capture(port, directory / "port.h5", steps=1)
    return diff(reference, run, mapping=mapping, tolerances=tolerances)


def _local_table(rows: pd.DataFrame, plain: Diff | None) -> pd.DataFrame:
    """One row per site and pass: local error, propagated error, amplification, verdict."""
    keys = [Column.STEP, Column.SITE, Column.ROLE, Column.ARG]
    if plain is None:
        rows = rows.assign(propagated_ratio=np.nan, propagated_out=False, amplification=np.nan)
    else:
        # a record the plain diff passes whatever its ratio (padding-only) propagates nothing
        propagated = plain.rows[[*keys, Column.RATIO]].rename(
            columns={Column.RATIO: "propagated_ratio"})
        propagated["propagated_out"] = ~plain.rows[Column.VERDICT].isin(PASSING).to_numpy()
        rows = rows.merge(propagated, on=keys, how="left")
        first = plain.rows[plain.rows[Column.STEP] == 0]
        by_site = {role: first[first[Column.ROLE] == role].groupby(Column.SITE)[Column.RATIO].max()
                   for role in CALL_ROLES}
        with np.errstate(divide="ignore", invalid="ignore"):
            amplification = (by_site[Role.OUTPUT] / by_site[Role.INPUT]).replace(
                [np.inf, -np.inf], np.nan)
        rows = rows.assign(amplification=rows[Column.SITE].map(amplification))
    roles = {Pass.FORWARD: [Role.OUTPUT], Pass.BACKWARD: list(COMPUTED_GRAD_ROLES)}
    parts = []
    for pass_, wanted in roles.items():
        chosen = rows[(rows[Column.PASS] == pass_) & rows[Column.ROLE].isin(wanted)]
        grouped = chosen.groupby([Column.SITE, Column.PORT_SITE], sort=False).agg(
            seq=(Column.SEQ, "min"), local=(Column.RATIO, _worst),
            propagated=("propagated_ratio", "max"), amplification=("amplification", "max"),
            holds=(Column.STATUS, lambda s: (s == Status.HOLDS_ORIGIN).any()),
            # judged by the verdict, not the ratio alone: a record out only at padding the
            # loss leaves unused passes (compare/padding.py)
            out=(Column.VERDICT, lambda v: (~v.isin(PASSING)).any()),
            propagated_out=("propagated_out", lambda v: v.fillna(False).astype(bool).any()),
        ).reset_index()
        grouped["pass"] = str(pass_)
        parts.append(grouped)
    table = pd.concat(parts, ignore_index=True)
    local_error = ~table["local"].map(judge.within) & table["out"]
    table["verdict"] = np.where(   # the values: a DataFrame column holds plain strings
        table["holds"], LocalVerdict.HOLDS_ONE.value, np.where(
            local_error, LocalVerdict.LOCAL_ERROR.value, np.where(
                (table["propagated"] > 1) & table["propagated_out"],
                LocalVerdict.EXONERATED.value, LocalVerdict.WITHIN.value)))
    return table.sort_values(["pass", "seq"], ascending=[False, True], kind="stable")


def _worst(ratios: pd.Series) -> float:
    return judge.worst(ratios.fillna(0.0))
