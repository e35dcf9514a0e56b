"""Pairing index rows: for each reference record, the port record (or slice of one) it is
compared with. Activations and gradients follow the site pairs and their argument maps;
weights and weight gradients follow the parameter mapping."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from layerdiff.compare.arguments import (
    ArgumentPairing,
    CallSignatures,
    head_of,
    leaf,
    pair_arguments,
)
from layerdiff.compare.matching import SiteMatching, SitePair
from layerdiff.errors import MappingError
from layerdiff.mapping import Mapping, ParamSource, PartView, Slice
from layerdiff.trace import schema
from layerdiff.trace.schema import Role, param_name


@dataclass(frozen=True)
class RecordPair:
    """One reference record and the port record it is compared with. The port's tensor is seen
    as the reference's by cutting it to ``port_slice`` and then, when ``transpose_port``,
    transposing it: in that order (see :class:`PartView`); the reference's is cut to
    ``ref_slice``."""

    ref: int                    # position in the reference index
    port: int                   # position in the port index
    match: str
    confidence: float
    ref_slice: Slice | None = None
    port_slice: Slice | None = None
    # True: reverse every axis (a mapping's transpose); a tuple: those axes (an op's operand
    # passed transposed, see op_alignment.py)
    transpose_port: bool | tuple[int, ...] = False


_ROOT = f"{schema.ROOT_MODULE}#0"
Entry = tuple[str, int, str, str, str, str]  # side, step, site, role, arg, reason
Key = tuple[int, str, str, str]               # step, reference site, role, arg


@dataclass
class RecordPairing:
    pairs: list[RecordPair]
    unmatched: list[Entry]
    # reference inputs a mapping ``args`` rule drops: the port takes no such argument, and
    # computes what it holds itself (a causal mask), so the site stays judgeable
    dropped: list[Key] = field(default_factory=list)
    # records without a partner the mapping declares so ([[unmatched]] input/output)
    declared: list[Entry] = field(default_factory=list)
    # reference arguments the port's forward has no parameter for:
    # (step, site, port site, role, arg, dtype, shape, why)
    not_taken: list[tuple[int, str, str, str, str, str, str, str]] = field(default_factory=list)
    # reference records without partner that never keep their site from being judged: the
    # above, inputs the port's call did not pass, outputs without partner and their gradients
    excused: set[Key] = field(default_factory=set)
    # port inputs (floating-point tensors) that nothing pairs: their site cannot be judged;
    # (step, reference site, port site, port arg, its parameter's name or the arg)
    port_missing: list[tuple[int, str, str, str, str]] = field(default_factory=list)
    adapted: list = field(default_factory=list)  # SitePairs with a call adapter (adapted.py)
    # L2 norms of compared tensors the reference index does not hold (an adapter's products)
    norms: dict[Key, float] = field(default_factory=dict)
    # reference gradients whose port record is absent although the port recorded the value
    # they belong to (its input, its weight): the port sent no gradient there (a detached
    # input, a parameter that never trains), compared with zeros by compare/absent.py;
    # (reference position, port position of the input or weight)
    absent: list[tuple[int, int]] = field(default_factory=list)
    # weights and weight gradients whose chain has a conversion function: no slice of the
    # port's tensor is a reference tensor, so compare/converted.py compares them through it
    converted: list[ConvertedParam] = field(default_factory=list)
    # site pairs whose port outputs an output conversion brings into the reference's layout,
    # with it: (SitePair, conversion), compared by compare/outconv.py
    output_converted: list = field(default_factory=list)


@dataclass(frozen=True)
class ConvertedParam:
    """A port weight or weight_grad record made from reference records through a chain with a
    conversion function (compared by :mod:`layerdiff.compare.converted`)."""

    port: int                   # position in the port index
    source: ParamSource         # the reference names and the chain
    refs: tuple[int, ...]       # positions in the reference index, one per reference name


def pair_records(ref_index: pd.DataFrame, port_index: pd.DataFrame, sites: SiteMatching,
                 mapping: Mapping, signatures: CallSignatures | None = None, *,
                 outside_gradients: bool = False,
                 output_conversions: dict | None = None) -> RecordPairing:
    """Pair every reference record with its port record. Inputs pair by the recorded
    signatures (``signatures``; by the same path without them, see :mod:`arguments`),
    outputs by the mapping's ``outputs`` renames, the same path, then shape (see
    :func:`output_partners`). Inputs of a site with a call adapter are left to
    :mod:`layerdiff.compare.adapted`; the output an output conversion gives (reference site
    -> conversion, ``output_conversions``), its gradient and the port outputs it takes, to
    :mod:`layerdiff.compare.outconv`."""
    pairer = _Pairer(ref_index, port_index, sites, mapping, signatures, outside_gradients,
                     output_conversions or {})
    ref_rows = zip(range(len(ref_index)), ref_index["step"], ref_index["site"],
                   ref_index["role"], ref_index["arg"], ref_index["value"], ref_index["kind"],
                   ref_index["dtype"], ref_index["shape"], strict=True)
    for pos, step, site, role, arg, value, kind, dtype, shape in ref_rows:
        if role not in schema.PARAM_ROLES and site in pairer.by_ref:
            pairer.reference_record(pos, int(step), site, role, arg, value, kind, dtype, shape)
    result = pairer.result
    param_pairs, param_unmatched, param_used, converted, absent = _pair_params(
        ref_index, port_index, sites, mapping)
    result.pairs += param_pairs
    result.unmatched += param_unmatched
    result.converted = converted
    result.absent += absent
    pairer.used_port |= param_used
    pairer.port_leftovers()
    result.pairs.sort(key=lambda p: p.ref)
    return result


class _Pairer:
    """The state of one pairing: what the port recorded, what is paired so far, and the
    per-site partners of outputs and arguments, worked out once per site."""

    def __init__(self, ref_index: pd.DataFrame, port_index: pd.DataFrame, sites: SiteMatching,
                 mapping: Mapping, signatures: CallSignatures | None, outside_gradients: bool,
                 conversions: dict) -> None:
        self.port_index, self.sites, self.mapping = port_index, sites, mapping
        self.signatures, self.outside_gradients = signatures, outside_gradients
        self.result = RecordPairing([], [])
        self.by_ref = sites.by_reference()
        self.port_keys = {key: pos for pos, key in enumerate(zip(
            port_index["step"], port_index["site"], port_index["role"], port_index["arg"],
            strict=True))}
        self.used_port: set[int] = set()
        self.calls = _Calls(ref_index, port_index)
        self.arguments: dict[str, ArgumentPairing] = {}
        self.outputs: dict[str, dict[str, str]] = {}
        self.adapted = {pair.reference for pair in sites.pairs
                        if mapping.call_adapter(pair.reference) is not None}
        self.result.adapted = [pair for pair in sites.pairs if pair.reference in self.adapted]
        self.conversions = conversions
        self.result.output_converted = [(pair, conversions[pair.reference])
                                        for pair in sites.pairs
                                        if pair.reference in conversions]
        graded = ref_index[ref_index["role"] == Role.GRAD_OUTPUT]
        self.fed = set(zip(graded["step"].astype(int), graded["site"], graded["arg"],
                           strict=True))

    def reference_record(self, pos: int, step: int, site: str, role: str, arg: str, value: str,
                         kind: str, dtype: str, shape: str) -> None:
        """Pair one reference record of a paired site, or say why it has no partner."""
        result, pair, mapping = self.result, self.by_ref[site], self.mapping
        key = (step, site, role, arg)
        if pair.roles is not None and role not in pair.roles:
            result.excused.add(key)  # inside a group of ops: the group's last op holds it
            return
        inputs = role in schema.ARGUMENT_ROLES
        declared = (mapping.why_unmatched_record("reference", site, role, arg)
                    if mapping.unmatched_records else None)
        if declared is not None:
            result.declared.append(("reference", *key, declared))
            result.excused.add(key)
            return
        if inputs and site in self.adapted:
            result.excused.add(key)  # given to the call adapter (adapted.py)
            return
        conversion = self.conversions.get(site)
        if not inputs and conversion is not None and _under(arg, (conversion.gives,)):
            return  # compared with what the output conversion makes (outconv.py)
        if inputs:
            port_arg, why = _input_partner(arg, pair, self.signatures, self.calls,
                                           self.arguments)
        else:
            port_arg, why = self._output_partners(site, pair, conversion).get(arg), None
        if port_arg is None and why == MAPPING_DROPS:
            result.dropped.append(key)
            result.excused.add(key)
            return
        if port_arg is None and why is not None:  # the port's forward takes no such argument
            result.excused.add(key)
            if kind != "tensor" and value == "null":
                return  # a None carries nothing
            result.not_taken.append((*key[:2], pair.port, role, arg, dtype if kind == "tensor"
                                     else "", shape if kind == "tensor" else value, why))
            return
        port_pos = None if port_arg is None else self.port_keys.get((step, pair.port, role,
                                                                      port_arg))
        port_kinds = self.port_index["kind"]
        if role == Role.INPUT and value == "null" and (
                port_pos is None or port_kinds.iat[port_pos] == "tensor"):
            # a None the reference passed carries nothing; a tensor the port passes there (a
            # cross-attention's mask) is the port's own input, unpaired (port_missing below)
            return
        none_in_port = (port_pos is not None and role == Role.OUTPUT and kind == "tensor"
                        and port_kinds.iat[port_pos] != "tensor")
        if none_in_port:  # a None (an attention's weights it does not return): no partner
            port_pos, port_arg = None, None
        elif (port_pos is not None and role == Role.OUTPUT and value == "null"
              and port_kinds.iat[port_pos] == "tensor"):
            return  # a None the reference returns carries nothing: the port's is unpaired
        if port_pos is None:
            self._no_port_record(pos, key, pair, port_arg, none_in_port)
            return
        self.used_port.add(port_pos)
        swap = _swapped_axes(shape) if inputs and arg in pair.swapped else False
        result.pairs.append(RecordPair(pos, port_pos, pair.match, pair.confidence,
                                       transpose_port=swap))

    def _output_partners(self, site: str, pair: SitePair, conversion: Any) -> dict[str, str]:
        if site not in self.outputs:
            gives, takes = ((conversion.gives,), conversion.takes) if conversion else ((), ())
            self.outputs[site] = output_partners(
                {a: s for a, s in self.calls.outputs("reference", site).items()
                 if not _under(a, gives)},
                {a: s for a, s in self.calls.outputs("port", pair.port).items()
                 if not _under(a, takes)}, self.mapping.output_names(site))
        return self.outputs[site]

    def _no_port_record(self, pos: int, key: Key, pair: SitePair, port_arg: str | None,
                        none_in_port: bool) -> None:
        """A reference record whose partner the port did not record: unmatched with why, a
        zero gradient compared, or excused where nothing can depend on it."""
        result = self.result
        step, site, role, arg = key
        inputs = role in schema.ARGUMENT_ROLES
        shown = port_arg if port_arg is not None else arg
        reason = f"the port recorded no {role} '{shown}' at {pair.port}"
        if not inputs and port_arg is None:
            reason = (f"{pair.port} has no output that pairs with it (name it with "
                      "outputs = { ... } on the site's rule, or declare it [[unmatched]])")
            if none_in_port:
                reason = (f"{pair.port} returns None there: declare it [[unmatched]] "
                          f"reference = \"{schema.split_site(site)[0]}\" output = "
                          f"\"{arg}\", or name its partner with outputs = {{ ... }}")
            # An output without partner that no gradient arrives at from outside the call
            # (eager attention's weights) never blocks its site. One that a gradient
            # arrives at does: what its users received cannot be judged. The model's own
            # output feeds the loss in any trace; elsewhere only a trace whose grad_output
            # is the outside gradient (meta grad_output = "outside") can tell.
            arrives = (step, site, arg) in self.fed
            if not (arrives and (site == _ROOT or self.outside_gradients)):
                result.excused.add(key)
        elif role == Role.GRAD_INPUT and port_arg is not None and (
                step, pair.port, Role.INPUT, port_arg) in self.port_keys:
            # the port took the input and sent it no gradient: a zero gradient, compared
            result.absent.append((pos, self.port_keys[(step, pair.port, Role.INPUT, port_arg)]))
            return
        elif role == Role.INPUT and port_arg is not None and self.signatures is not None \
                and self.signatures.signature("port", pair.port) is not None:
            reason += " (its forward has a parameter for it, which its caller left out)"
            result.excused.add(key)
        result.unmatched.append(("reference", *key, reason))

    def port_leftovers(self) -> None:
        """Port records of paired sites that nothing paired: unmatched, declared, or taken by
        an output conversion; a floating input among them is a port-only input."""
        result, port_index, signatures = self.result, self.port_index, self.signatures
        partner_of_port = {p.port: p.reference for p in self.sites.pairs}
        taken = {pair.port: conversion.takes for pair, conversion in result.output_converted}
        for pos, (step, site, role, arg, kind, dtype) in enumerate(zip(
                port_index["step"], port_index["site"], port_index["role"], port_index["arg"],
                port_index["kind"], port_index["dtype"], strict=True)):
            if pos in self.used_port or site not in partner_of_port:
                continue
            if role in (Role.OUTPUT, Role.GRAD_OUTPUT) and _under(arg, taken.get(site, ())):
                continue  # an output conversion takes it (outconv.py)
            if role == Role.OUTPUT and kind != "tensor" \
                    and port_index["value"].iat[pos] == "null":
                continue  # a None the port returns carries nothing
            declared = self.mapping.why_unmatched_record("port", site, role, arg)
            if declared is not None:
                result.declared.append(("port", int(step), site, role, arg, declared))
                continue
            result.unmatched.append(("port", int(step), site, role, arg,
                                     "no reference record pairs with it"))
            if role == Role.INPUT and kind == "tensor" and _floating(dtype):
                head, rest = head_of(arg)
                port_sig = None if signatures is None else signatures.signature("port", site)
                name = head if port_sig is None or not head.isdigit() or int(head) >= len(
                    port_sig.positional) else port_sig.positional[int(head)].name
                result.port_missing.append((int(step), partner_of_port[site], site, arg,
                                            name + rest))


def _under(arg: str, paths: tuple[str, ...]) -> bool:
    """Whether an argument path is one of ``paths`` or lies inside one."""
    return any(arg == path or arg.startswith(path + ".") for path in paths)


def _swapped_axes(shape: str) -> tuple[int, ...]:
    """The axes that swap the last two of a tensor of this shape."""
    rank = len(schema.parse_shape(shape))
    return (*range(rank - 2), rank - 1, rank - 2)


def _floating(dtype: str) -> bool:
    return str(dtype).startswith(("float", "bfloat", "complex"))


class _Calls:
    """Each site's recorded input heads (with their leaves' values) and outputs, per side."""

    def __init__(self, ref_index: pd.DataFrame, port_index: pd.DataFrame) -> None:
        self._index = {"reference": ref_index, "port": port_index}
        self._inputs: dict[str, dict[str, dict[str, list[str]]]] = {}
        self._outputs: dict[str, dict[str, dict[str, str]]] = {}

    def inputs(self, side: str, site: str) -> dict[str, dict[str, str]]:
        """head -> its leaves (see :func:`arguments.leaf`), first step each is in."""
        if side not in self._inputs:
            index = self._index[side]
            found: dict[str, dict[str, dict[str, str]]] = {}
            frame = index[index["role"] == Role.INPUT]
            for name, arg, value, kind, shape in zip(frame["site"], frame["arg"],
                                                     frame["value"], frame["kind"],
                                                     frame["shape"], strict=True):
                head, rest = head_of(arg)
                found.setdefault(name, {}).setdefault(head, {}).setdefault(
                    rest, leaf(kind, shape, value))
            self._inputs[side] = found
        return self._inputs[side].get(site, {})

    def outputs(self, side: str, site: str) -> dict[str, str]:
        """output path -> its shape ("" for a value that is no tensor), first step it has."""
        if side not in self._outputs:
            index = self._index[side]
            found: dict[str, dict[str, str]] = {}
            frame = index[index["role"] == Role.OUTPUT]
            for name, arg, kind, shape in zip(frame["site"], frame["arg"], frame["kind"],
                                              frame["shape"], strict=True):
                found.setdefault(name, {}).setdefault(arg, shape if kind == "tensor" else "")
            self._outputs[side] = found
        return self._outputs[side].get(site, {})


MAPPING_DROPS = "the mapping drops it"


def _input_partner(arg: str, pair: SitePair, signatures: CallSignatures | None, calls: _Calls,
                   cache: dict[str, ArgumentPairing]) -> tuple[str | None, str | None]:
    """The port's argument path for a reference input (or grad_input) path, or None and why:
    the mapping's ``args`` rule first, then the signatures."""
    head, rest = head_of(arg)
    if arg in pair.args or head in pair.args:
        port_arg = _port_argument(arg, pair.args)
        return port_arg, (MAPPING_DROPS if port_arg is None else None)
    if signatures is None:
        return arg, None
    if pair.reference not in cache:
        cache[pair.reference] = pair_arguments(
            calls.inputs("reference", pair.reference), calls.inputs("port", pair.port),
            signatures.signature("reference", pair.reference),
            signatures.signature("port", pair.port))
    pairing = cache[pair.reference]
    if head in pairing.not_taken:
        return None, pairing.not_taken[head]
    port_head = pairing.partner.get(head)
    return (None, None) if port_head is None else (port_head + rest, None)


def output_partners(ref: dict[str, str], port: dict[str, str],
                     renames: dict[str, str]) -> dict[str, str]:
    """Reference output path -> port output path: the mapping's ``outputs`` renames (of a path
    or of its head), then the same path, then, for what is left, a tensor whose shape no other
    tensor left on either side has (a ``ModelOutput``'s ``logits`` and a port's plain logits:
    ``logits`` -> ``0``, or ``""`` for a bare tensor)."""
    partner: dict[str, str] = {}
    for arg in ref:
        head, rest = head_of(arg)
        if arg in renames:
            partner[arg] = renames[arg]
        elif head in renames:
            partner[arg] = renames[head] + rest
        elif arg in port:
            partner[arg] = arg
    taken = set(partner.values())
    ref_left = {arg: shape for arg, shape in ref.items() if arg not in partner and shape}
    port_left = {arg: shape for arg, shape in port.items() if arg not in taken and shape}
    for arg, shape in ref_left.items():
        same = [p for p, s in port_left.items() if s == shape]
        if len(same) == 1 and list(ref_left.values()).count(shape) == 1:
            partner[arg] = same[0]
    return partner


def _pair_params(ref_index: pd.DataFrame, port_index: pd.DataFrame, sites: SiteMatching,
                 mapping: Mapping):
    """Weight and weight-gradient records, paired through the parameter mapping; those whose
    chain has a conversion function set aside (returned last) to be compared through it."""
    ref_params = ref_index[ref_index["role"].isin(schema.PARAM_ROLES)]
    ref_by_name = {(step, role, param_name(site, arg)): pos for pos, step, role, site, arg in zip(
        ref_params.index, ref_params["step"], ref_params["role"], ref_params["site"],
        ref_params["arg"], strict=True)}
    pairs: list[RecordPair] = []
    unmatched: list[tuple[str, int, str, str, str, str]] = []
    used_port: set[int] = set()
    used_ref: set[int] = set()
    converted: list[ConvertedParam] = []
    port_params = port_index[port_index["role"].isin(schema.PARAM_ROLES)]
    # a parameter's module by the resolution loading weights used (renames, pairs, names), its
    # sites' pairing first: a reference module whose weights its parent's code uses is no site
    partner = mapping.module_partners(
        {param_name(s, a).rpartition(".")[0] for s, a in zip(port_params["site"],
                                                             port_params["arg"], strict=True)},
        {name.rpartition(".")[0] for _, _, name in ref_by_name})
    partner.update(sites.module_partner)
    for port_pos, step, role, site, arg, shape in zip(
            port_params.index, port_params["step"], port_params["role"], port_params["site"],
            port_params["arg"], port_params["shape"], strict=True):
        name = param_name(site, arg)
        # without a rule or a partner module: the same name in the reference, if it has one
        source = mapping.param_source(name, partner) or ParamSource([name])
        positions = [ref_by_name.get((step, role, n)) for n in source.reference]
        if any(p is None for p in positions):
            missing = [n for n, p in zip(source.reference, positions, strict=True) if p is None]
            why = mapping.why_unmatched("port", name)
            if why is not None:
                used_port.add(int(port_pos))  # declared: listed here once, as the port's own
            unmatched.append(("port", int(step), site, role, arg,
                              f"the port's own ({why})" if why is not None else
                              f"parameter {name} comes from reference {', '.join(missing)}, "
                              "which the reference trace does not record"))
            continue
        match = "exact" if source.reference == [name] else "mapped"
        used_port.add(int(port_pos))
        if source.functions:
            converted.append(ConvertedParam(int(port_pos), source, tuple(positions)))
            used_ref.update(positions)
            continue
        # shapes only where a concat or split needs them: a row lookup costs ~10 us
        ref_shapes = ([schema.parse_shape(ref_index.at[p, "shape"]) for p in positions]
                      if source.reshapes else [])
        for view in _views(source, ref_shapes, schema.parse_shape(shape), mapping):
            pairs.append(RecordPair(positions[view.reference], int(port_pos), match, 1.0,
                                    view.ref_slice, view.port_slice, view.transpose_port))
        used_ref.update(positions)
    paired_sites = sites.by_reference()
    # a reference weight paired whole with a port weight whose gradient the port lacks: the
    # parameter got no gradient in the port (it never trains), compared with zeros
    weight_partner = {(int(ref_index.at[pair.ref, "step"]), ref_index.at[pair.ref, "site"],
                       ref_index.at[pair.ref, "arg"]): pair.port for pair in pairs
                      if ref_index.at[pair.ref, "role"] == Role.WEIGHT
                      and pair.ref_slice is None and pair.port_slice is None
                      and not pair.transpose_port}
    absent: list[tuple[int, int]] = []
    for pos in ref_params.index:
        if pos not in used_ref:
            row = ref_index.loc[pos]
            partner = weight_partner.get((int(row["step"]), row["site"], row["arg"]))
            if row["role"] == Role.WEIGHT_GRAD and partner is not None:
                absent.append((int(pos), partner))
            elif row["site"] in paired_sites:
                unmatched.append(("reference", int(row["step"]), row["site"], row["role"],
                                  row["arg"], "no port parameter is mapped from it"))
    return pairs, unmatched, used_port, converted, absent


def _views(source: ParamSource, ref_shapes: list[tuple[int, ...]],
           port_shape: tuple[int, ...], mapping: Mapping) -> list[PartView]:
    try:
        return source.views(ref_shapes, port_shape)
    except ValueError as exc:
        raise MappingError(f"{mapping.name}: parameter from {', '.join(source.reference)}: "
                           f"{exc}; fix the rule's axis") from None


def sliced_shape(shape: tuple[int, ...], part: Slice | None,
                 transpose: bool | tuple[int, ...]) -> tuple[int, ...]:
    """The shape a record has after its slice and then, when ``transpose``, its transpose
    (every axis reversed, or the axes ``transpose`` lists)."""
    if part is not None:
        shape = list(shape)
        shape[part.axis] = part.stop - part.start
        shape = tuple(shape)
    if isinstance(transpose, tuple):
        return tuple(shape[axis] for axis in transpose)
    return tuple(reversed(shape)) if transpose else tuple(shape)



def _port_argument(arg: str, args: dict[str, str]) -> str | None:
    """A reference argument path under the port's name (a mapping ``args`` rule names the
    whole path or its top-level part), or None where the rule drops it (``""``)."""
    if arg in args:
        return args[arg] or None
    head, dot, rest = arg.partition(".")
    if head not in args:
        return arg
    return args[head] + dot + rest if args[head] else None
