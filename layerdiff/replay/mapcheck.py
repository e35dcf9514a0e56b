"""``map_check``: a dry run of a mapping before any capture: what every port tensor would get.

``map_check("ref.h5", port_case, mapping="port.map.toml")`` resolves the mapping exactly as
:func:`layerdiff.load_weights` does (one function serves both) and lists, per port parameter
and buffer, the reference tensors and transform chain it would receive; the port tensors
nothing provides; the reference tensors nothing uses; the shapes that do not fit. A square
matrix fits both ways round, so a missing or extra ``transpose`` loads without complaint: each
one is checked by running the module that owns it on the reference's recorded inputs at the
paired site, loaded as declared and transposed, against the reference's recorded output. A
chain with a conversion function is applied as the load applies it (shapes checked after it),
reported with the function's source digest, and checked the same way: the module that owns
the tensor, or the nearest paired module around it, runs with and without the conversion.

Last, the port's case runs once (one step, statistics only, into a temporary trace) with the
declared load, and the diff's own pairing lists every paired site whose own code cannot be
judged, whatever a later capture holds: an input or an output without partner, a port input
the reference has none for. Each comes with the rule or adapter to write (the same sentences
the diff gives a failing site); they do not fail the check, since a faithful port may have
them, but no declaration need wait for a bug to show them.

The port model is left as it was: its tensors are put back after the dry run.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from layerdiff.case import Case
from layerdiff.compare.matching import port_site_for
from layerdiff.compare.records import output_partners
from layerdiff.compare.result import Unjudgeable
from layerdiff.compare.shapes import as_shape
from layerdiff.errors import LayerdiffError, TraceError
from layerdiff.mapping import Mapping, ParamSource
from layerdiff.replay.ports import PortModel, port_model
from layerdiff.replay.recorded import RecordedCall, read_array, recorded_calls
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.schema import Role
from layerdiff.weights import (
    NO_SOURCE,
    PORT_OWN,
    SHAPE_MISMATCH,
    Assignment,
    as_mapping,
    combine,
    trace_weights,
    unused_reference,
)

OK = "ok"
SUSPICIOUS = "suspicious-transpose"
SUSPICIOUS_CONVERSION = "suspicious-conversion"
MISMATCH_AROUND = "mismatch-around"  # unchecked at its own module; the one around it is off
NOT_CHECKED = "not-checked"
FAILING = (NO_SOURCE, SHAPE_MISMATCH, SUSPICIOUS, SUSPICIOUS_CONVERSION, MISMATCH_AROUND)
LEVELS = 4           # a conversion is checked at the owner and at most this many modules out
BETTER = 10.0        # a transposed load this many times closer to the reference is suspicious
ROUNDING_ULPS = 16   # a declared load's error below this many ULPs is rounding, not a layout


@dataclass
class MapEntry:
    """One port tensor: where it would come from, and whether that is sound."""

    port: str
    reference: list[str]
    transform: tuple[str, ...]
    axis: int
    status: str            # ok | no-source | shape-mismatch | suspicious-transpose |
    #                        suspicious-conversion | mismatch-around | not-checked | port-own
    note: str = ""
    errors: tuple[float, float] | None = None  # square matrix: (as declared, transposed)
    functions: list[dict[str, str]] = field(default_factory=list)  # {function, source_sha256}
    # conversion checked: {"site", "with", "without"} relative errors at the deciding site
    conversion: dict[str, Any] | None = None

    def as_json(self) -> dict[str, Any]:
        return {"port": self.port, "reference": list(self.reference),
                "transform": list(self.transform), "axis": self.axis, "status": self.status,
                "note": self.note, "errors": None if self.errors is None else {
                    "declared": self.errors[0], "transposed": self.errors[1]},
                "functions": [dict(f) for f in self.functions],
                "conversion": None if self.conversion is None else dict(self.conversion)}


@dataclass
class MapCheck:
    """The dry run's findings; true when every port tensor gets a fitting, plausible source."""

    reference: str
    port: str
    mapping: str | None
    entries: list[MapEntry] = field(default_factory=list)
    unused_reference: list[str] = field(default_factory=list)
    # paired sites whose own code a diff cannot judge (not a failure: the rule to write)
    cannot_judge: list[Unjudgeable] = field(default_factory=list)
    # why the port's run that finds them did not run or pair ("" when it did)
    sites_unchecked: str = ""

    @property
    def passed(self) -> bool:
        return not self.failing()

    def __bool__(self) -> bool:
        return self.passed

    def failing(self) -> list[MapEntry]:
        """Entries without a source, with a shape that does not fit, or likely transposed."""
        return [entry for entry in self.entries if entry.status in FAILING]

    def count(self, status: str) -> int:
        return sum(entry.status == status for entry in self.entries)

    def as_json(self) -> dict[str, Any]:
        return {"verdict": "pass" if self.passed else "fail", "reference": self.reference,
                "port": self.port, "mapping": self.mapping,
                "entries": [entry.as_json() for entry in self.entries],
                "unused_reference": list(self.unused_reference),
                "cannot_judge": [site.as_json() for site in self.cannot_judge],
                "sites_unchecked": self.sites_unchecked}


def map_check(reference_trace: str | os.PathLike, port_case: Case,
              mapping: str | os.PathLike | Mapping | None = None, *,
              sites: bool = True) -> MapCheck:
    """Check ``mapping`` between the reference trace (captured with weights) and a torch or
    Flax NNX port case without loading anything for good; see :class:`MapCheck`. ``sites``:
    also run the port's case once to list the sites a diff could not judge (``cannot_judge``);
    without, ``sites_unchecked`` says so."""
    port = port_model(port_case, "map-check")
    mapping = as_mapping(mapping)
    with open_trace(reference_trace) as ref:
        if ref.summary:
            raise TraceError(f"{ref.path} is a summary trace: map-check needs the reference's "
                             "weights and recorded inputs; capture the reference without "
                             "--summary")
        reference = trace_weights(ref)
        with port.restored():
            assignments = port.resolve(reference, mapping)
            entries = _checked_entries(ref, port, mapping, assignments, reference)
            unjudged, unchecked = (_unjudgeable(ref, port_case, mapping) if sites else
                                   ([], "not asked for"))
    return MapCheck(str(reference_trace), port.name,
                    str(mapping.path) if mapping.path else None, entries,
                    unused_reference(reference, assignments), unjudged, unchecked)


def _unjudgeable(ref: Trace, case: Case, mapping: Mapping) -> tuple[list[Unjudgeable], str]:
    """The paired sites whose own code a diff of this port could not judge, by the diff's own
    pairing and rule (:func:`layerdiff.compare.origins.unjudgeable_sites`): the port's case
    runs one step with the declared load (the caller's), recorded as statistics only into a
    temporary trace, and is diffed with the reference. What pairs does not depend on the
    values, so a load with problems (listed in the table) still tells. Returns the sites, or
    none and why the run or the diff could not tell (one sentence)."""
    from layerdiff.capture import capture
    from layerdiff.compare.engine import diff

    with tempfile.TemporaryDirectory(prefix="layerdiff-map-check-") as folder:
        try:
            port_trace = capture(case, os.path.join(folder, "port.h5"), steps=1, summary=True,
                                 progress=False)
            return diff(ref, port_trace, mapping=mapping).cannot_judge, ""
        except LayerdiffError as exc:  # the run or the pairing refused: said, not fatal here
            said = str(exc).replace(os.path.join(folder, "port.h5"), "the port's run")
            return [], f"the port's run to find them stopped: {said}"




def _checked_entries(ref: Trace, port: PortModel, mapping: Mapping,
                     assignments: list[Assignment],
                     reference: dict[str, np.ndarray]) -> list[MapEntry]:
    for found in assignments:  # the declared load, so each module runs as the port would
        if not found.problem:
            port.set(found.port, found.value)
    runner = _SiteRunner(ref, port, mapping)
    probe = _ConversionProbe(assignments, port, runner, reference)
    entries = []
    for found in assignments:
        entry = MapEntry(found.port, [] if found.problem == PORT_OWN
                         else list(found.source.reference), found.source.transforms,
                         found.source.axis, found.problem or OK, found.note,
                         functions=[ref.provenance() for ref in found.source.code_refs()])
        if found.problem == SHAPE_MISMATCH and _transposed_fits(found):
            entry.note += "; transposed it would fit: does the rule need a 'transpose'?"
        elif not found.problem and _transposed_fits(found):
            _check_transpose(entry, found, port, runner)
        if not found.problem and found.source.functions and entry.status != SUSPICIOUS:
            _check_conversion(entry, found, probe)
        elif not found.problem and not runner.pairs(_owner(found.port)):
            _check_around(entry, found, runner)
        if not found.problem and entry.status in (OK, NOT_CHECKED):
            _check_output_conversion(entry, found, runner)
        entries.append(entry)
    return entries


def _owner(port_tensor: str) -> str:
    return port_tensor.rpartition(".")[0] or schema.ROOT_MODULE


def _check_around(entry: MapEntry, found: Assignment, runner: _SiteRunner) -> None:
    """A tensor whose own module has no paired site: nothing checks its layout there (a
    q/k projection declared without partner, loaded without the conversion it needs), so
    the nearest paired module around it runs with the declared load. Failing where that
    module does not reproduce the reference's output: the tensor's rule is wrong, or the
    port computes something else there (a diff after loading tells which)."""
    measured, _ = _first_measure(_around(_owner(found.port), LEVELS)[1:], runner.declared)
    if measured is None or measured.error <= BETTER * measured.rounding:
        return
    if _off_inside(entry, measured, runner):
        return
    entry.status = MISMATCH_AROUND
    entry.note = _join(entry.note, (
        f"its own module has no paired site, and at {measured.site}, the nearest paired "
        f"module around it, the declared load gives relative error {measured.error:.1e} "
        f"(rounding is below {measured.rounding:.0e}): check its rule (does it need a "
        "conversion?), or whether the port computes something else there"))


def _check_output_conversion(entry: MapEntry, found: Assignment, runner: _SiteRunner) -> None:
    """A tensor of a module whose outputs the mapping's ``output_transform`` converts: the
    module, loaded as declared, must reproduce the reference's output through it (as the diff
    will compare it); else the function or the tensor's rule is wrong."""
    module = _owner(found.port)
    if not runner.pairs(module) or runner.declared_conversion(module) is None:
        return
    try:
        measured = runner.declared(module)
    except Exception as exc:  # cannot run here: said, not failed
        _not_checked(entry, str(exc) if _known(exc) else f"port module {module} raised "
                     f"{type(exc).__name__} on the reference's recorded inputs: {exc}")
        return
    said = (f"at {measured.site} its outputs through "
            f"{runner.declared_conversion(module).describe()} give relative error "
            f"{measured.error:.1e} against the reference's")
    if measured.error <= BETTER * measured.rounding:
        entry.note = _join(entry.note, said)
        return
    entry.status = SUSPICIOUS_CONVERSION
    entry.note = _join(entry.note, f"{said} (rounding is below {measured.rounding:.0e}): check "
                       "the output_transform function and this tensor's rule, or whether the "
                       "port computes something else there")


def _first_measure(modules: list[str], measure: Any) -> tuple[Any, list[str]]:
    """The first of ``modules`` that ``measure`` can run, with its result (its ``module`` set),
    and why each one before it could not."""
    reasons = []
    for module in modules:
        try:
            return dataclasses.replace(measure(module), module=module), reasons
        except Exception as exc:  # not paired or not replayable here: try the next one out
            known = _known(exc)
            reasons.append(str(exc) if known else f"port module {module} raised "
                           f"{type(exc).__name__} on the reference's recorded inputs: {exc}")
    return None, reasons


def _transposed_fits(found: Assignment) -> bool:
    value = found.value
    return value is not None and value.ndim == 2 and tuple(value.T.shape) == found.shape


def _check_transpose(entry: MapEntry, found: Assignment, port: PortModel,
                     runner: _SiteRunner) -> None:
    """Flag a square matrix whose transpose reproduces the reference's output far better."""
    if np.array_equal(found.value, found.value.T):
        entry.note = "symmetric: a transpose would change nothing"
        return
    module = found.port.rpartition(".")[0] or schema.ROOT_MODULE
    try:
        declared = runner.declared(module)
        port.set(found.port, found.value.T)
        try:
            transposed = runner.measure(module)
        finally:
            port.set(found.port, found.value)
    except Exception as exc:  # a module that cannot run on the recorded call is not checked
        known = _known(exc)
        entry.status = NOT_CHECKED
        entry.note = "transpose not checked: " + (
            str(exc) if known else f"port module {module} raised {type(exc).__name__} on the "
            f"reference's recorded inputs: {exc}")
        return
    entry.errors = (declared.error, transposed.error)
    errors = f"relative error {declared.error:.1e} as declared, {transposed.error:.1e} transposed"
    if transposed.error * BETTER < declared.error and declared.error > declared.rounding:
        entry.status = SUSPICIOUS
        entry.note = (f"at {declared.site} the transposed load reproduces the reference's "
                      f"output far better ({errors}): add or remove a 'transpose' in the rule")
    else:
        entry.note = f"transpose checked at {declared.site}: {errors}"


class _ConversionProbe:
    """Runs a module on the reference's recorded call at its paired site loaded as declared,
    and loaded without the conversions of every converted tensor under it (the chains'
    built-in steps alone: a RoPE permutation of q without that of k shows nothing), against
    the reference's recorded outputs; once per module."""

    def __init__(self, assignments: list[Assignment], port: PortModel,
                 runner: _SiteRunner, reference: dict[str, np.ndarray]) -> None:
        self.port, self.runner = port, runner
        self.plain: dict[str, np.ndarray] = {}   # port tensor -> its load without conversions
        self.why: dict[str, str] = {}            # port tensor -> why it has none
        self.declared = {found.port: found.value for found in assignments}
        self._measured: dict[str, tuple[_Measure, _Measure] | Exception] = {}
        for found in assignments:
            if found.problem or not found.source.functions:
                continue
            source = found.source
            steps = tuple(t for t in source.transforms if t not in source.functions)
            plain = ParamSource(source.reference, steps or ("copy",), source.axis,
                                source.part, source.parts, where=source.where)
            try:
                value = combine(plain, [reference[n] for n in source.reference])
            except ValueError as exc:
                self.why[found.port] = str(exc)
                continue
            if tuple(value.shape) != found.shape:
                self.why[found.port] = (f"without it the chain gives shape "
                                        f"{tuple(value.shape)}, not the port's {found.shape}")
            else:
                self.plain[found.port] = value

    def measure(self, module: str) -> tuple[_Measure, _Measure]:
        """(as declared, without the conversions under ``module``); raises what the run
        raises (a module with no paired site, one that cannot be replayed)."""
        if module not in self._measured:
            try:
                self._measured[module] = self._run(module)
            except Exception as exc:
                self._measured[module] = exc
        found = self._measured[module]
        if isinstance(found, Exception):
            raise found
        return found

    def _run(self, module: str) -> tuple[_Measure, _Measure]:
        declared = self.runner.declared(module)
        under = [name for name in self.plain
                 if module == schema.ROOT_MODULE or name.startswith(module + ".")]
        try:
            for name in under:
                self.port.set(name, self.plain[name])
            return declared, self.runner.measure(module)
        finally:
            for name in under:
                self.port.set(name, self.declared[name])


def _check_conversion(entry: MapEntry, found: Assignment, probe: _ConversionProbe) -> None:
    """Judge a converted tensor by the modules around it, innermost first.

    A conversion changes the layout, so a module's own output may be in the port's layout
    (a permuted projection): only where the two loads differ tenfold does a site decide. The
    conversion holds where its load is the far closer one at some site; it is suspicious
    where only the load without it is (and its own error is above rounding)."""
    names = ", ".join(found.source.functions)
    if found.port not in probe.plain:
        _check_declared_only(entry, found, probe.runner, names, probe.why[found.port])
        return
    if np.array_equal(probe.plain[found.port], found.value):
        entry.note = _join(entry.note, f"conversion {names} changes nothing in this tensor")
        return
    module = found.port.rpartition(".")[0] or schema.ROOT_MODULE
    hurts, reasons, innermost = None, [], None
    for candidate in _around(module, LEVELS):
        try:
            declared, plain = probe.measure(candidate)
            if probe.runner.derived_from(candidate, found.port):
                continue  # compared through the inverse of this very conversion: says nothing
        except Exception as exc:  # not paired or not replayable here: try the next one out
            known = _known(exc)
            reasons.append(str(exc) if known else f"port module {candidate} raised "
                           f"{type(exc).__name__} on the reference's recorded inputs: {exc}")
            continue
        innermost = innermost or (declared, plain)
        measured = {"site": declared.site, "with": declared.error, "without": plain.error}
        errors = (f"relative error {declared.error:.1e} with the conversion, "
                  f"{plain.error:.1e} without")
        if declared.error * BETTER < plain.error:
            entry.conversion = measured
            said = f"conversion {names} checked at {declared.site}: {errors}"
            if entry.status == NOT_CHECKED and declared.error <= declared.rounding:
                # the declared load reproduces the module around it: its layout holds, a
                # transpose the owner could not be run to check included
                entry.status, entry.note = OK, said
            else:
                entry.note = _join(entry.note, said)
            return
        if plain.error * BETTER < declared.error and declared.error > declared.rounding:
            hurts = hurts or (measured, errors)
    if hurts is not None:
        entry.conversion, errors = hurts
        entry.status = SUSPICIOUS_CONVERSION
        entry.note = _join(entry.note, f"at {entry.conversion['site']} the load without "
                           f"conversion {names} reproduces the reference's output far better "
                           f"({errors}), and no module around it does better with it: check "
                           "the function, or whether the port needs it")
        return
    if innermost is not None and innermost[0].error > BETTER * innermost[0].rounding:
        declared, plain = innermost
        # neither load reproduces the module: a conversion is only right where its load does
        entry.conversion = {"site": declared.site, "with": declared.error,
                            "without": plain.error}
        entry.status = MISMATCH_AROUND
        entry.note = _join(entry.note, f"conversion {names} not confirmed: at {declared.site}, "
                           "the nearest paired module around it, neither load reproduces the "
                           f"reference's output (relative error {declared.error:.1e} with the "
                           f"conversion, {plain.error:.1e} without; rounding is below "
                           f"{declared.rounding:.0e}): check the function, or whether the port "
                           "computes something else there")
        return
    _not_checked(entry, f"conversion {names} not checked: no paired module around "
                 f"{found.port} tells the loads with and without it apart"
                 + (f" ({reasons[-1]})" if reasons else ""))


def _check_declared_only(entry: MapEntry, found: Assignment, runner: _SiteRunner,
                         names: str, why: str) -> None:
    """A conversion with no load without it to weigh against (the chain's built-in steps
    alone do not fit the port's shape: a (N*H, D) q weight into a (N, D, H) kernel): the
    declared load alone runs at the nearest paired module around the tensor, innermost first.
    It holds where that module's recorded output is reproduced; a conversion that fits the
    shape but puts the elements in the wrong places does not reproduce it."""
    measured, reasons = _first_measure(_around(_owner(found.port), LEVELS), runner.declared)
    if measured is None:
        _not_checked(entry, f"conversion {names} not checked: {why}"
                     + (f"; and no paired module around it could be run ({reasons[-1]})"
                        if reasons else ""))
        return
    errors = (f"relative error {measured.error:.1e} with the conversion (rounding is below "
              f"{measured.rounding:.0e}; {why}, so there is no load without it to compare)")
    if measured.error <= BETTER * measured.rounding:
        entry.note = _join(entry.note, f"conversion {names} checked at {measured.site}: the "
                           f"declared load reproduces the reference's output, {errors}")
        return
    if measured.module != _owner(found.port) and _off_inside(entry, measured, runner):
        return
    entry.status = MISMATCH_AROUND
    entry.note = _join(entry.note, f"conversion {names} not confirmed: at {measured.site}, the "
                       f"nearest paired module around it, the declared load does not reproduce "
                       f"the reference's output, {errors}: check the function (a reshape "
                       "where the layout needs a transpose loads every element, in the wrong "
                       "place), or whether the port computes something else there")


def _off_inside(entry: MapEntry, measured: _Measure, runner: _SiteRunner) -> bool:
    """Whether a paired module inside the one measured around a tensor is off on its own
    recorded call: then the container's error is no evidence against this tensor's rule (a
    wrong q kernel, or a port whose norm computes something else, is all the root shows), and
    the entry is left not checked, pointing at that module."""
    inside = runner.off_inside(measured.module)
    if inside is None:
        return False
    _not_checked(entry, f"not judged at {measured.site}, the nearest paired module around it: "
                 f"{inside.site} inside it does not reproduce its own recorded output either "
                 f"(relative error {inside.error:.1e}), which explains it; look there first")
    return True


def _not_checked(entry: MapEntry, why: str) -> None:
    if entry.status == OK:
        entry.status = NOT_CHECKED
    entry.note = _join(entry.note, why)


def _around(module: str, levels: int) -> list[str]:
    """``module`` and the modules that hold it, innermost first (the root last)."""
    chain = [module]
    while module != schema.ROOT_MODULE and len(chain) <= levels:
        module = module.rpartition(".")[0] or schema.ROOT_MODULE
        chain.append(module)
    return chain


def _known(exc: Exception) -> bool:
    """An error that says itself (no pair, no replay: torch's or Flax's NotReplayable)."""
    return isinstance(exc, (LookupError, ValueError, LayerdiffError)) or (
        type(exc).__name__ == "NotReplayable")


def _join(*notes: str) -> str:
    return "; ".join(note for note in notes if note)


@dataclass(frozen=True)
class _Measure:
    site: str          # the reference site whose recorded call the module ran on
    error: float       # relative Frobenius error of the module's outputs
    rounding: float    # an error this small is rounding, whatever the layout
    module: str = ""   # the port module measured, where a search set it


class _SiteRunner:
    """Runs a port module on the reference's first recorded call at its paired site (paired
    by name, as replay pairs them; through the site's call adapter where the mapping names
    one) and measures its outputs against the recorded ones, paired as the diff pairs them
    (the mapping's ``outputs`` renames, the same path, then a shape no other output has)."""

    def __init__(self, ref: Trace, model: PortModel, mapping: Mapping) -> None:
        self.ref, self.mapping, self.model = ref, mapping, model
        self.port = model.replayer(ref)
        self._calls = self._paired_calls()  # an adapter that does not import: refused here
        self._inputs: dict[str, list] = {}
        self._expected: dict[str, dict[str, np.ndarray]] = {}
        self._declared: dict[str, _Measure] = {}
        self._conversions: Any = None  # SiteConversions, made on first use (imports torch)
        self._found: dict[str, Any] = {}  # port module -> its output conversion, as measured

    def declared(self, module: str) -> _Measure:
        """The measure with the declared load, taken once per module."""
        if module not in self._declared:
            self._declared[module] = self.measure(module)
        return self._declared[module]

    def measure(self, module: str) -> _Measure:
        call, port_site, args, adapter = self._call_for(module)
        if module not in self._inputs:  # inputs read once: each run gets clones of them
            self._inputs[module] = self.port.inputs(call, args)
        outputs = self.port.outputs(call, module, args, self._inputs[module], adapter=adapter)
        got = {arg: value.astype(np.float64) for arg, value in self._converted(
                   call, module, self.model.arrays(outputs))
               if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating)
               and self.mapping.why_unmatched_record("port", port_site, Role.OUTPUT, arg) is None}
        eps = self.model.eps(outputs)
        expected = self._recorded_outputs(call.site)
        partners = output_partners(
            {arg: schema.format_shape(value.shape) for arg, value in expected.items()},
            {arg: schema.format_shape(value.shape) for arg, value in got.items()},
            self.mapping.output_names(call.site))
        gap = norm = 0.0
        compared = 0
        for arg, port_arg in partners.items():
            if port_arg not in got:
                continue
            # (B, T, N, H) against (B, T, N*H): the same elements in the same order, as the
            # diff compares them (compare/shapes.py)
            value = as_shape(got[port_arg], expected[arg].shape)
            if value.shape != expected[arg].shape:
                raise ValueError(f"port site {port_site} gives output {port_arg or '0'} of shape "
                                 f"{got[port_arg].shape}, the reference's {call.site} output "
                                 f"{arg} {expected[arg].shape}, so nothing can be measured there")
            gap += float(np.sum((value - expected[arg]) ** 2))
            norm += float(np.sum(expected[arg] ** 2))
            compared += 1
        if not compared:
            raise ValueError(f"port site {port_site} gives no floating-point output that pairs "
                             f"with one the reference records at {call.site} (reference: "
                             f"{', '.join(expected) or 'none'}; port: {', '.join(got) or 'none'}"
                             "), so nothing can be measured there; name them with outputs = "
                             "{ ... } on the site's rule")
        return _Measure(call.site, float(np.sqrt(gap / max(norm, np.finfo(float).tiny))),
                        ROUNDING_ULPS * eps)

    def conversion(self, site: str, module: str, features: int | None) -> Any:
        """The output conversion of reference ``site`` paired with port ``module``, declared
        or derived, as the diff finds it (compare/outconv.py)."""
        if self._conversions is None:
            from layerdiff.compare.outconv import SiteConversions, weight_shapes

            self._conversions = SiteConversions(self.mapping, weight_shapes(self.ref))
            self._shapes = self.model.shapes()
        prefix = "" if module == schema.ROOT_MODULE else module + "."
        params = {name: shape for name, shape in self._shapes.items()
                  if name.startswith(prefix) and "." not in name[len(prefix):]}
        return self._conversions.find(site, module, params, features)

    def declared_conversion(self, module: str) -> Any:
        """The mapping's ``output_transform`` at the site paired with port ``module``."""
        return self.mapping.output_conversion(self._call_for(module)[0].site)

    def derived_from(self, module: str, tensor: str) -> bool:
        """Whether ``module``'s outputs are compared through a permutation derived from
        ``tensor``'s own conversion: there the conversion is undone by itself and cannot be
        judged (a wrong row order is undone as exactly as the right one)."""
        from layerdiff.compare.outconv import DerivedPermutation

        found = self._found.get(module)
        return isinstance(found, DerivedPermutation) and tensor in found.params

    def _converted(self, call: RecordedCall, module: str, arrays: list[tuple[str, Any]]
                   ) -> list[tuple[str, Any]]:
        """The port module's outputs in the reference's layout, through the site's output
        conversion (the diff's, with the reference's recorded inputs it takes); one that
        cannot be applied is a ValueError: cannot judge."""
        site = call.site
        first = dict(arrays).get("0")
        conversion = self.conversion(site, module, first.shape[-1] if isinstance(
            first, np.ndarray) and first.ndim else None)
        self._found[module] = conversion
        if conversion is None:
            return arrays
        import torch

        from layerdiff.compare.outconv import CannotConvert, convert_outputs

        values = [(arg, torch.from_numpy(np.ascontiguousarray(value))
                   if isinstance(value, np.ndarray) else value) for arg, value in arrays]
        try:
            wanted = set(getattr(conversion, "reference_inputs", ()))
            made = convert_outputs(conversion, self._conversions.function(conversion), values,
                                   f"port module {module}",
                                   {path: read_array(self.ref, row) for path, row in call.inputs
                                    if path in wanted})
        except CannotConvert as exc:
            raise ValueError(f"cannot judge {site}: {exc}") from None
        return [(arg, value.detach().numpy() if torch.is_tensor(value) else value)
                for arg, value in made]

    def _paired_calls(self) -> dict[str, tuple[RecordedCall, str, dict[str, str], Any]]:
        """Port module -> the first recorded call whose site pairs with it, the port site, its
        argument map and its call adapter (the mapping's ref and function, or None)."""
        calls: dict[str, tuple[RecordedCall, str, dict[str, str], Any]] = {}
        functions: dict[Any, Any] = {}
        for call in recorded_calls(self.ref):
            # the container itself: a Flax port's also holds a scanned stack's layers by name
            target = port_site_for(call.site, self.mapping, self.port.modules)
            module = None if target is None else schema.split_site(target[0])[0]
            if target is None or module in calls:
                continue
            code = self.mapping.call_adapter(call.site)
            adapter = None
            if code is not None:
                if code not in functions:
                    functions[code] = code.resolve()
                adapter = (code, functions[code])
            port_site, args = target
            # the adapter makes the whole call from the reference's arguments, as in replay
            calls[module] = (call, port_site, {} if adapter else args, adapter)
        return calls

    def pairs(self, module: str) -> bool:
        """Whether a reference site pairs with port ``module``."""
        return module in self._calls

    def off_inside(self, module: str) -> _Measure | None:
        """The first paired port module strictly inside ``module`` (call order) whose output,
        with the declared load, is off beyond rounding on its own recorded call, narrowed to
        the innermost such module inside it; None if none is (modules that cannot be run are
        passed over)."""
        prefix = "" if module == schema.ROOT_MODULE else module + "."
        for inner in self._calls:
            if inner == module or not inner.startswith(prefix):
                continue
            try:
                measured = self.declared(inner)
            except Exception:  # not replayable here: it tells nothing
                continue
            if measured.error > BETTER * measured.rounding:   # the innermost that is off
                return self.off_inside(inner) or measured
        return None

    def _call_for(self, module: str) -> tuple[RecordedCall, str, dict[str, str], Any]:
        if module not in self._calls:
            raise LookupError(f"no reference site pairs with port module {module} by name; a "
                              "[[site]] rule would pair it")
        return self._calls[module]

    def _recorded_outputs(self, site: str) -> dict[str, np.ndarray]:
        """The reference's recorded tensor outputs of ``site``, less those the mapping
        declares without a partner."""
        if site not in self._expected:
            rows = self.ref.records(0, site, Role.OUTPUT, kind="tensor")
            self._expected[site] = {
                row["arg"]: read_array(self.ref, row).astype(np.float64)
                for _, row in rows.iterrows()
                if self.mapping.why_unmatched_record("reference", site, Role.OUTPUT,
                                                     row["arg"]) is None}
        return self._expected[site]
