"""Pairing a port's sites with the reference's: declared, exact, mapped, then structural.

Order of trust, per reference site:
1. the mapping file's ``[[unmatched]]`` declarations and explicit ``[[pair]]`` entries;
2. the same name in the port;
3. the mapping's ``[[site]]`` rename rules;
4. a structural fallback for what is left on both sides: the two lists of sites, in execution
   order, aligned on their output shapes (difflib's longest matching blocks); confidence is
   higher where input shapes and module types agree too.
Op sites (``<module site>/<op>#<k>``, captured with ``--ops``) pair only inside a pair of module
sites, after those: by the mapping's ``[[pair]]`` entries, then the two calls' op lists aligned
on op name and output shapes in execution order; between two ops paired so, ops that differ
in name pair by position and shapes when only one reading is possible (a custom
``autograd.Function`` in a torch op's place; a fused kernel against the explicit ops it stands
for, as a group): see :mod:`layerdiff.compare.op_alignment`.
What stays unpaired is reported with the reason.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import pandas as pd

from layerdiff.compare.op_alignment import align_gap, op_records
from layerdiff.compare.result import Column
from layerdiff.errors import MappingError
from layerdiff.mapping import Mapping
from layerdiff.trace import schema
from layerdiff.trace.schema import CALL_ROLES, Role


@dataclass(frozen=True)
class SitePair:
    reference: str
    port: str
    match: str            # exact | pair | mapped | structural | op | position | group
    confidence: float
    args: dict[str, str] = field(default_factory=dict, hash=False)  # reference arg -> port arg
    label: str = ""       # which rule, for explanations
    # the roles of the reference site compared with the port site; None: every role (an op of
    # a group compares only its inputs; its last op, the output, see op_alignment.py)
    roles: frozenset[str] | None = None
    # reference input paths whose port tensor is compared with its last two axes swapped (a
    # matmul's second operand, which a fused op takes untransposed)
    swapped: frozenset[str] = frozenset()


@dataclass
class SiteMatching:
    pairs: list[SitePair]
    unmatched: list[tuple[str, str, str, bool]]  # (side, site, reason, declared in the mapping)
    module_partner: dict[str, str]          # port module -> reference module

    def by_reference(self) -> dict[str, SitePair]:
        return {pair.reference: pair for pair in self.pairs}


def _site_list(sites: pd.DataFrame) -> pd.DataFrame:
    """One row per site name (first step it appears in), in execution order."""
    ordered = sites.sort_values(["step", "enter_seq"], kind="stable")
    return ordered.drop_duplicates("site").reset_index(drop=True)


def _signatures(index: pd.DataFrame, sites: list[str]) -> dict[str, tuple[str, str]]:
    """site -> (output shapes, input shapes) of its first step, as text."""
    first_step = index[index["step"] == index["step"].min()]
    wanted = first_step[first_step["site"].isin(sites) & first_step["role"].isin(
        CALL_ROLES)]
    result: dict[str, tuple[str, str]] = {}
    for site, rows in wanted.groupby("site", sort=False):
        out = ";".join(rows.loc[rows["role"] == Role.OUTPUT, "shape"])
        inp = ";".join(rows.loc[rows["role"] == Role.INPUT, "shape"])
        result[site] = (out, inp)
    return result


def match_sites(ref_sites: pd.DataFrame, port_sites: pd.DataFrame, ref_index: pd.DataFrame,
                port_index: pd.DataFrame, mapping: Mapping) -> SiteMatching:
    refs, ports = _site_list(ref_sites), _site_list(port_sites)
    ref_is_op, port_is_op = _op_rows(refs), _op_rows(ports)
    matching = _match_modules(refs[~ref_is_op], ports[~port_is_op], ref_index, port_index,
                              mapping)
    if ref_is_op.any() or port_is_op.any():
        _match_ops(matching, refs[ref_is_op], ports[port_is_op], ref_index, port_index, mapping)
        order = {site: i for i, site in enumerate(refs["site"])}
        matching.pairs.sort(key=lambda p: order[p.reference])
    return matching


def _op_rows(sites: pd.DataFrame) -> pd.Series:
    return pd.Series([schema.is_op_site(s) for s in sites["site"]], index=sites.index,
                     dtype=bool)


def _match_modules(refs: pd.DataFrame, ports: pd.DataFrame, ref_index: pd.DataFrame,
                   port_index: pd.DataFrame, mapping: Mapping) -> SiteMatching:
    port_names = set(ports["site"])
    claimed: set[str] = set()
    paired_targets: dict[str, str] = {}
    for ref_site, port_site in mapping.pairs.items():  # explicit pairs first: they are claims
        if port_site in paired_targets:
            raise MappingError(f"{mapping.name}: [[pair]] entries give port site {port_site} "
                               f"to both {paired_targets[port_site]} and {ref_site}; one port "
                               "site pairs with one reference site")
        paired_targets[port_site] = ref_site
    claimed |= set(paired_targets) & port_names
    pairs: list[SitePair] = []
    unmatched: list[tuple[str, str, str, bool]] = []
    leftover_refs: list[str] = []

    for ref_site, module, call in zip(refs["site"], refs["module"], refs["call"], strict=True):
        why = mapping.why_unmatched("reference", ref_site)
        if why is not None:
            unmatched.append(("reference", ref_site, why, True))
            continue
        pair = _named_partner(ref_site, module, int(call), mapping, port_names,
                              claimed - ({mapping.pairs[ref_site]} if ref_site in mapping.pairs
                                         else set()))
        if isinstance(pair, SitePair):
            pairs.append(pair)
            claimed.add(pair.port)
        elif pair:  # a rule named a port site that is not there
            unmatched.append(("reference", ref_site, pair, False))
        else:
            leftover_refs.append(ref_site)

    leftover_ports = []
    for port_site in ports["site"]:
        if port_site in claimed:
            continue
        why = mapping.why_unmatched("port", port_site)
        if why is not None:
            unmatched.append(("port", port_site, why, True))
        else:
            leftover_ports.append(port_site)

    structural = _align(leftover_refs, leftover_ports, refs, ports, ref_index, port_index)
    pairs += structural
    found_ref = {p.reference for p in structural}
    found_port = {p.port for p in structural}
    unmatched += [("reference", s, "no port site of that name, no mapping rule for it, and no "
                   "leftover port site with the same output shapes at that point", False)
                  for s in leftover_refs if s not in found_ref]
    unmatched += [("port", s, "no reference site of that name or mapped to it", False)
                  for s in leftover_ports if s not in found_port]

    order = {site: i for i, site in enumerate(refs["site"])}
    pairs.sort(key=lambda p: order[p.reference])
    partner: dict[str, str] = {}
    for pair in pairs:
        partner.setdefault(schema.split_site(pair.port)[0], schema.split_site(pair.reference)[0])
    return SiteMatching(pairs, unmatched, partner)


def _named_partner(ref_site: str, module: str, call: int, mapping: Mapping,
                   port_names: set[str], claimed: set[str]) -> SitePair | str | None:
    """A pair by explicit entry, exact name or rename rule; a reason string when a rule
    points at a missing port site; None when nothing names a partner."""
    if ref_site in mapping.pairs:
        port_site = mapping.pairs[ref_site]
        if port_site not in port_names:
            return (f"the mapping pairs it with port site {port_site}, which the port trace "
                    "does not have")
        return SitePair(ref_site, port_site, "pair", 1.0, mapping.pair_args.get(ref_site, {}),
                        label=f"{mapping.name} [[pair]]")
    renamed = mapping.rename(module)
    if ref_site in port_names and ref_site not in claimed:
        return SitePair(ref_site, ref_site, "exact", 1.0, _same_name_args(module, renamed))
    if renamed is not None:
        port_module, args, label = renamed
        port_site = schema.site_name(port_module, call)
        if port_site in port_names and port_site not in claimed:
            return SitePair(ref_site, port_site, "mapped", 1.0, args, label)
        if port_site in claimed:
            return f"{label} maps it to {port_site}, which pairs with another reference site"
        return f"{label} maps it to {port_site}, which the port trace does not have"
    return None


def _align(ref_left: list[str], port_left: list[str], refs: pd.DataFrame, ports: pd.DataFrame,
           ref_index: pd.DataFrame, port_index: pd.DataFrame) -> list[SitePair]:
    if not ref_left or not port_left:
        return []
    ref_sig = _signatures(ref_index, ref_left)
    port_sig = _signatures(port_index, port_left)
    ref_types = dict(zip(refs["site"], refs["type"], strict=True))
    port_types = dict(zip(ports["site"], ports["type"], strict=True))
    a = [ref_sig.get(s, ("", ""))[0] for s in ref_left]
    b = [port_sig.get(s, ("", ""))[0] for s in port_left]
    matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    pairs = []
    for block in matcher.get_matching_blocks():
        for k in range(block.size):
            ref_site, port_site = ref_left[block.a + k], port_left[block.b + k]
            if not a[block.a + k]:
                continue  # no outputs recorded: nothing to align on
            confidence = 0.5
            if ref_sig.get(ref_site, ("", ""))[1] == port_sig.get(port_site, ("", ""))[1]:
                confidence += 0.25
            if ref_types.get(ref_site) == port_types.get(port_site):
                confidence += 0.25
            pairs.append(SitePair(ref_site, port_site, "structural", confidence,
                                  label="aligned by execution order and output shapes"))
    return pairs


def port_site_for(ref_site: str, mapping: Mapping,
                  port_modules: set[str]) -> tuple[str, dict[str, str]] | None:
    """The port site a reference site corresponds to, from names alone (no port trace): by
    explicit pair, same module name, or rename rule; with the argument map. None when the
    mapping declares it without partner or nothing names one."""
    if mapping.why_unmatched("reference", ref_site) is not None:
        return None
    if ref_site in mapping.pairs:
        port_site = mapping.pairs[ref_site]
        return (port_site, {}) if schema.split_site(port_site)[0] in port_modules else None
    module, call = schema.split_site(ref_site)
    renamed = mapping.rename(module)
    if module in port_modules:
        return schema.site_name(module, call), _same_name_args(module, renamed)
    if renamed is not None and renamed[0] in port_modules:
        return schema.site_name(renamed[0], call), renamed[1]
    return None


def _same_name_args(module: str, renamed: tuple | None) -> dict[str, str]:
    """A [[site]] rule that maps a module to its own name still says how its arguments
    differ (``args = { attention_mask = "" }``)."""
    return renamed[1] if renamed is not None and renamed[0] == module else {}


def _match_ops(matching: SiteMatching, ref_ops: pd.DataFrame, port_ops: pd.DataFrame,
               ref_index: pd.DataFrame, port_index: pd.DataFrame, mapping: Mapping) -> None:
    """Pair the op sites inside each pair of module sites (see the module docstring); adds to
    ``matching`` in place."""
    port_names = set(port_ops["site"])
    explicit = {ref: port for ref, port in mapping.pairs.items()
                if schema.is_op_site(ref) and port in port_names}
    claimed = set(explicit.values())
    ref_by_call = _ops_by_call(ref_ops, "reference", mapping, matching)
    port_by_call = _ops_by_call(port_ops, "port", mapping, matching)
    paired_calls = {pair.reference: pair.port for pair in matching.pairs}
    ref_sig = _signatures(ref_index, list(ref_ops["site"]))
    port_sig = _signatures(port_index, list(port_ops["site"]))
    ref_records = op_records(ref_index, list(ref_ops["site"]))
    port_records = op_records(port_index, list(port_ops["site"]))
    found_ref: set[str] = set()
    port_refused: dict[str, str] = {}  # port op -> why the ops around it did not pair
    for ref_site, port_site in explicit.items():
        matching.pairs.append(SitePair(ref_site, port_site, "pair", 1.0,
                                       mapping.pair_args.get(ref_site, {}),
                                       label=f"{mapping.name} [[pair]]"))
        found_ref.add(ref_site)
    for ref_call, refs in ref_by_call.items():
        port_call = paired_calls.get(ref_call)
        if port_call is None:
            for site in refs:
                matching.unmatched.append(("reference", site, f"its module site {ref_call} "
                                           "has no partner in the port", False))
            continue
        ports = [s for s in port_by_call.get(port_call, []) if s not in claimed]
        left = [s for s in refs if s not in found_ref]
        a = [(_op(s), ref_sig.get(s, ("", ""))[0]) for s in left]
        b = [(_op(s), port_sig.get(s, ("", ""))[0]) for s in ports]
        matcher = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
        refused: dict[str, str] = {}
        done_a = done_b = 0
        for block in matcher.get_matching_blocks():  # ends with an empty block at the ends
            # the ops between two name pairs (anchors): by position and shapes, or a group
            gap_pairs, gap_refused = align_gap(
                left[done_a:block.a], ports[done_b:block.b], ref_records, port_records,
                before=_short(left[done_a - 1]) if done_a else None,
                after=_short(left[block.a]) if block.a < len(left) else None, call=ref_call)
            refused.update(gap_refused)
            if gap_refused:  # the port's ops of that gap: the same reason, from their side
                theirs = ", ".join(_short(s) for s in gap_refused)
                for port_site in ports[done_b:block.b]:
                    port_refused[port_site] = (f"not paired with the reference's {theirs}: "
                                               f"{next(iter(gap_refused.values()))}")
            for gap in gap_pairs:
                matching.pairs.append(SitePair(gap.reference, gap.port, gap.match, 1.0,
                                               gap.args, gap.why, gap.roles, gap.swapped))
                found_ref.add(gap.reference)
                claimed.add(gap.port)
            for k in range(block.size):
                ref_site, port_site = left[block.a + k], ports[block.b + k]
                exact = ref_site == port_site
                matching.pairs.append(SitePair(
                    ref_site, port_site, "exact" if exact else "op", 1.0,
                    label="" if exact else f"same op and output shapes, in order, inside "
                                           f"{ref_call} and {port_call}"))
                found_ref.add(ref_site)
                claimed.add(port_site)
            done_a, done_b = block.a + block.size, block.b + block.size
        lone_ports = [s for s in ports if s not in claimed]
        for site in left:
            if site in found_ref:
                continue
            why = (refused.get(site) or _lone_op_reason(site, port_call, lone_ports)
                   if port_call in port_by_call
                   else f"the port trace records no ops of {port_call} (capture the port with "
                        f"--ops '{schema.split_site(port_call)[0]}' too)")
            matching.unmatched.append(("reference", site, why, False))
    for port_call, ports in port_by_call.items():
        for site in ports:
            if site not in claimed:
                matching.unmatched.append(("port", site, port_refused.get(site) or (
                    "no reference op of the same name and output shapes lines up with it in "
                    f"{port_call}'s partner"), False))


def _ops_by_call(ops: pd.DataFrame, side: str, mapping: Mapping,
                 matching: SiteMatching) -> dict[str, list[str]]:
    """Module site -> its op sites in execution order; those the mapping declares without
    partner go to ``matching.unmatched`` instead."""
    by_call: dict[str, list[str]] = {}
    for site, parent in zip(ops["site"], ops["parent"], strict=True):
        why = mapping.why_unmatched(side, site)
        if why is not None:
            matching.unmatched.append((side, site, why, True))
        else:
            by_call.setdefault(parent, []).append(site)
    return by_call


def _op(site: str) -> str:
    parts = schema.split_op_site(site)
    return parts[1] if parts else site


def _short(site: str) -> str:
    """``softmax#0`` of ``blocks.0.attn#0/softmax#0``."""
    return site.rpartition("/")[2]


def _lone_op_reason(site: str, port_call: str, lone_ports: list[str]) -> str:
    if not lone_ports:
        return (f"the port's {port_call} runs no {_op(site)} with the same output shapes at "
                "that point")
    others = ", ".join(dict.fromkeys(_op(s) for s in lone_ports[:6]))
    return (f"no {_op(site)} with the same output shapes at that point in the port's "
            f"{port_call}, which computes that part with other ops ({others})")


_ACROSS_NAMES = ("position", "group")


def op_pairings(matching: SiteMatching) -> list[dict[str, str]]:
    """The op sites paired across names (by position, or as a group), each with why: for the
    diff's JSON (``meta.op_pairings``)."""
    return [{"reference": pair.reference, "port": pair.port, "match": pair.match,
             "why": pair.label} for pair in matching.pairs if pair.match in _ACROSS_NAMES]


def explain_op_pairings(origins: list, matching: SiteMatching, rows: pd.DataFrame) -> None:
    """Each origin at an op site paired across names says how it was paired (its
    ``pairing``), so a reader can check the pairing the verdict rests on. An origin in a group
    of ops is named by the op whose record it reports (the group's output is its last op's,
    an input gradient the op's that took that input), in the origin and in the rows' causes."""
    by_reference = matching.by_reference()
    for origin in origins:
        pair = by_reference.get(origin.site)
        if pair is None or pair.match not in _ACROSS_NAMES:
            continue
        origin.pairing = pair.label
        if pair.match != "group":
            continue
        held = rows[(rows[Column.STEP] == origin.step)
                    & (rows[Column.PORT_SITE] == origin.port_site)
                    & (rows[Column.ROLE] == origin.role)
                    & (rows[Column.PORT_ARG] == origin.port_arg)]
        if len(held) == 1 and held[Column.SITE].iloc[0] != origin.site:
            named = str(held[Column.SITE].iloc[0])
            old = origin.site   # causes name it alone, or as "step N (site)" in later steps
            rows[Column.CAUSE] = [named if c == old else c.replace(f"({old})", f"({named})")
                             if isinstance(c, str) else c for c in rows[Column.CAUSE]]
            origin.site, origin.arg = named, str(held[Column.ARG].iloc[0])
