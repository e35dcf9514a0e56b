"""Pairing index rows: for each reference record, the port record (or slice of one) it is
compared with. Activations and gradients follow the site pairs and their argument maps;
weights and weight gradients follow the parameter mapping."""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from layerdiff.compare.matching import SiteMatching
from layerdiff.errors import MappingError
from layerdiff.mapping import Mapping, ParamSource, PartView, Slice
from layerdiff.trace import schema
from layerdiff.trace.schema import param_name

PARAM_ROLES = ("weight", "weight_grad")


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
    transpose_port: bool = False


@dataclass
class RecordPairing:
    pairs: list[RecordPair]
    unmatched: list[tuple[str, int, str, str, str, str]]  # side, step, site, role, arg, reason
    # reference inputs a mapping ``args`` rule drops: the port takes no such argument, and
    # computes what it holds itself (a causal mask), so the site stays judgeable
    dropped: list[tuple[int, str, str, str]] = field(default_factory=list)  # step, site, role, arg
    # weights and weight gradients whose chain has a conversion function: no slice of the
    # port's tensor is a reference tensor, so compare/converted.py compares them through it
    converted: list[ConvertedParam] = field(default_factory=list)


@dataclass(frozen=True)
class ConvertedParam:
    """A port weight or weight_grad record made from reference records through a chain with a
    conversion function (compared by :mod:`layerdiff.compare.converted`)."""

    port: int                   # position in the port index
    source: ParamSource         # the reference names and the chain
    refs: tuple[int, ...]       # positions in the reference index, one per reference name


def pair_records(ref_index: pd.DataFrame, port_index: pd.DataFrame, sites: SiteMatching,
                 mapping: Mapping) -> RecordPairing:
    pairs: list[RecordPair] = []
    unmatched: list[tuple[str, int, str, str, str, str]] = []
    dropped: list[tuple[int, str, str, str]] = []
    by_ref = sites.by_reference()
    port_keys = {key: pos for pos, key in enumerate(zip(
        port_index["step"], port_index["site"], port_index["role"], port_index["arg"],
        strict=True))}
    used_port: set[int] = set()

    ref_rows = zip(range(len(ref_index)), ref_index["step"], ref_index["site"],
                   ref_index["role"], ref_index["arg"], ref_index["value"], strict=True)
    for pos, step, site, role, arg, value in ref_rows:
        if role in PARAM_ROLES:
            continue
        pair = by_ref.get(site)
        if pair is None:
            continue  # the site itself is reported unmatched
        port_arg = _port_argument(arg, pair.args) if role in ("input", "grad_input") else arg
        if port_arg is None:
            dropped.append((int(step), site, role, arg))
            continue
        port_pos = port_keys.get((step, pair.port, role, port_arg))
        if port_pos is None and role == "input" and value == "null":
            continue  # a None the reference passed and the port does not take carries nothing
        if port_pos is None:
            unmatched.append(("reference", int(step), site, role, arg,
                              f"the port recorded no {role} '{port_arg}' at {pair.port}"))
            continue
        used_port.add(port_pos)
        pairs.append(RecordPair(pos, port_pos, pair.match, pair.confidence))

    param_pairs, param_unmatched, param_used, converted = _pair_params(ref_index, port_index,
                                                                       sites, mapping)
    pairs += param_pairs
    unmatched += param_unmatched
    used_port |= param_used
    matched_port_sites = {p.port for p in sites.pairs}
    for pos, (step, site, role, arg) in enumerate(zip(
            port_index["step"], port_index["site"], port_index["role"], port_index["arg"],
            strict=True)):
        if pos not in used_port and site in matched_port_sites:
            unmatched.append(("port", int(step), site, role, arg,
                              "no reference record pairs with it"))
    pairs.sort(key=lambda p: p.ref)
    return RecordPairing(pairs, unmatched, dropped, converted)


def _pair_params(ref_index: pd.DataFrame, port_index: pd.DataFrame, sites: SiteMatching,
                 mapping: Mapping):
    """Weight and weight-gradient records, paired through the parameter mapping; those whose
    chain has a conversion function set aside (returned last) to be compared through it."""
    ref_params = ref_index[ref_index["role"].isin(PARAM_ROLES)]
    ref_by_name = {(step, role, param_name(site, arg)): pos for pos, step, role, site, arg in zip(
        ref_params.index, ref_params["step"], ref_params["role"], ref_params["site"],
        ref_params["arg"], strict=True)}
    pairs: list[RecordPair] = []
    unmatched: list[tuple[str, int, str, str, str, str]] = []
    used_port: set[int] = set()
    used_ref: set[int] = set()
    converted: list[ConvertedParam] = []
    port_params = port_index[port_index["role"].isin(PARAM_ROLES)]
    for port_pos, step, role, site, arg, shape in zip(
            port_params.index, port_params["step"], port_params["role"], port_params["site"],
            port_params["arg"], port_params["shape"], strict=True):
        name = param_name(site, arg)
        # without a rule or a partner module: the same name in the reference, if it has one
        source = mapping.param_source(name, sites.module_partner) or ParamSource([name])
        positions = [ref_by_name.get((step, role, n)) for n in source.reference]
        if any(p is None for p in positions):
            missing = [n for n, p in zip(source.reference, positions, strict=True) if p is None]
            why = mapping.why_unmatched("port", name)
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
    for pos in ref_params.index:
        if pos not in used_ref:
            row = ref_index.loc[pos]
            if row["site"] in paired_sites:
                unmatched.append(("reference", int(row["step"]), row["site"], row["role"],
                                  row["arg"], "no port parameter is mapped from it"))
    return pairs, unmatched, used_port, converted


def _views(source: ParamSource, ref_shapes: list[tuple[int, ...]],
           port_shape: tuple[int, ...], mapping: Mapping) -> list[PartView]:
    try:
        return source.views(ref_shapes, port_shape)
    except ValueError as exc:
        raise MappingError(f"{mapping.name}: parameter from {', '.join(source.reference)}: "
                           f"{exc}; fix the rule's axis") from None


def sliced_shape(shape: tuple[int, ...], part: Slice | None, transpose: bool) -> tuple[int, ...]:
    """The shape a record has after its slice and then, when ``transpose``, its transpose."""
    if part is not None:
        shape = list(shape)
        shape[part.axis] = part.stop - part.start
        shape = tuple(shape)
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
