"""Pairing the ops of one pair of module calls that do not pair by name.

The ops that pair by name and output shapes (see :mod:`layerdiff.compare.matching`) are
anchors; the calls' start and end are anchors too. Between two consecutive anchors lies a *gap*:
the part of the call that the two sides compute with differently named ops (a custom
``autograd.Function`` or a fused kernel's wrapper where the reference runs torch ops). A gap
pairs only where position and shapes leave one reading:

- the same number of ops on both sides: the k-th reference op pairs with the k-th port op when
  their outputs have the same shapes and kinds (float, integer, bool), their floating-point
  inputs the same paths and shapes, and no other op of the gap on either side has those
  outputs (else which is which cannot be told: refused, and said so);
- one port op against several reference ops: the port op computes the whole gap (a fused
  kernel against its explicit ops), so it pairs as a *group*: its output with the last
  reference op's, its floating-point inputs, in order, with the gap's inputs that come from
  outside the gap (an input is inside when an earlier op of the gap output those very values,
  by digest), when their number and shapes agree one for one (else refused, and said so);
- anything else (several ops on each side in different numbers, one reference op against
  several port ops): refused.

Every pairing made pairs every floating-point input on both sides, so a paired op can always be
judged: a pairing never turns its module's origin into a site that cannot be judged. Nothing
here reads tensor values, so a bug cannot change what pairs with what.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pandas as pd

from layerdiff.trace import schema
from layerdiff.trace.schema import ARGUMENT_ROLES, CALL_ROLES, Role


@dataclass(frozen=True)
class OpInput:
    arg: str
    shape: str
    kind: str      # float | int | bool | other
    digest: str


@dataclass(frozen=True)
class OpRecords:
    """What pairing looks at of one op site: its outputs' and inputs' shapes and kinds, in
    its first step."""

    site: str
    outputs: tuple[tuple[str, str, str], ...]   # (arg, shape, kind)
    inputs: tuple[OpInput, ...]
    output_digests: frozenset[str] = field(default_factory=frozenset)

    @property
    def output_signature(self) -> tuple[tuple[str, str], ...]:
        return tuple((shape, kind) for _, shape, kind in self.outputs)

    @property
    def float_inputs(self) -> list[OpInput]:
        return [i for i in self.inputs if i.kind == "float"]

    @property
    def name(self) -> str:
        parts = schema.split_op_site(self.site)
        return f"{parts[1]}#{parts[2]}" if parts else self.site


@dataclass(frozen=True)
class GapPair:
    """A pairing made in a gap: ``reference`` compared with ``port`` for ``roles`` (None: every
    role) with the reference's input paths renamed by ``args`` (``""``: not compared)."""

    reference: str
    port: str
    match: str             # position | group
    why: str
    args: dict[str, str] = field(default_factory=dict, hash=False)
    roles: frozenset[str] | None = None
    swapped: frozenset[str] = frozenset()   # reference inputs compared with last axes swapped


def _kind(dtype: str) -> str:
    dtype = str(dtype)
    if dtype.startswith(("float", "bfloat", "complex")):
        return "float"
    if dtype == "bool":
        return "bool"
    if dtype.startswith(("int", "uint")):
        return "int"
    return "other"


def op_records(index: pd.DataFrame, sites: list[str]) -> dict[str, OpRecords]:
    """site -> its :class:`OpRecords`, from the index rows of the first step it ran in."""
    wanted = index[index["site"].isin(sites) & index["role"].isin(CALL_ROLES)]
    found: dict[str, OpRecords] = {}
    for site, rows in wanted.groupby("site", sort=False):
        rows = rows[rows["step"] == rows["step"].min()]
        tensors = rows[rows["kind"] == "tensor"]
        outs = tensors[tensors["role"] == Role.OUTPUT]
        ins = tensors[tensors["role"] == Role.INPUT]
        found[site] = OpRecords(
            site,
            tuple((a, s, _kind(d)) for a, s, d in zip(outs["arg"], outs["shape"],
                                                       outs["dtype"], strict=True)),
            tuple(OpInput(a, s, _kind(d), str(g or "")) for a, s, d, g in zip(
                ins["arg"], ins["shape"], ins["dtype"], ins["digest"], strict=True)),
            frozenset(str(g) for g in outs["digest"] if g))
    return found


def _shapes(signature: tuple[tuple[str, str], ...]) -> str:
    return "; ".join(f"({shape}) {kind}" for shape, kind in signature) or "nothing"


def _between(before: str | None, after: str | None, call: str) -> str:
    if before is None and after is None:
        return f"in {call}"
    if before is None:
        return f"in {call} before {after}"
    if after is None:
        return f"in {call} after {before}"
    return f"in {call} between {before} and {after}"


def align_gap(refs: list[str], ports: list[str], records: dict[str, OpRecords],
              port_records: dict[str, OpRecords], *, before: str | None, after: str | None,
              call: str) -> tuple[list[GapPair], dict[str, str]]:
    """The pairings of one gap (reference op sites ``refs``, port op sites ``ports``, in
    execution order, between the anchors ``before`` and ``after``: reference op names, None at
    the call's start or end), and for each reference op left unpaired, why."""
    if not refs or not ports:
        return [], {}
    ref_rec = [records.get(s) or OpRecords(s, (), ()) for s in refs]
    port_rec = [port_records.get(s) or OpRecords(s, (), ()) for s in ports]
    where = _between(before, after, call)
    if len(refs) == len(ports):
        return _by_position(ref_rec, port_rec, where)
    if len(ports) == 1:
        return _as_group(ref_rec, port_rec[0], where)
    names = ", ".join(r.name for r in port_rec[:6])
    why = (f"not paired by position ({where}; {_BY_HAND}): one port op can stand for several "
           f"reference ops, not several for one, and there the reference runs {len(refs)} "
           f"and the port {len(ports)} ({names})")
    return [], {r.site: why for r in ref_rec}


def _by_position(refs: list[OpRecords], ports: list[OpRecords], where: str
                 ) -> tuple[list[GapPair], dict[str, str]]:
    pairs: list[GapPair] = []
    refused: dict[str, str] = {}
    for ref, port in zip(refs, ports, strict=True):
        signature = ref.output_signature
        if not signature or signature != port.output_signature:
            refused[ref.site] = (f"not paired by position ({where}; {_BY_HAND}): the port "
                                 f"runs {port.name} in its place, whose outputs "
                                 f"({_shapes(port.output_signature)}) are not its "
                                 f"({_shapes(signature)})")
            continue
        same_ref = [r.name for r in refs if r.output_signature == signature]
        same_port = [p.name for p in ports if p.output_signature == signature]
        if len(same_ref) > 1 or len(same_port) > 1:
            refused[ref.site] = (
                f"ambiguous ({_BY_HAND}): {where} the reference runs {', '.join(same_ref)} "
                f"and the port {', '.join(same_port)}, all with outputs {_shapes(signature)}: "
                "position and shapes cannot tell which is which")
            continue
        ref_in = [(i.arg, i.shape) for i in ref.float_inputs]
        port_in = [(i.arg, i.shape) for i in port.float_inputs]
        if ref_in != port_in:
            refused[ref.site] = (
                f"not paired by position ({where}; {_BY_HAND} and args): the port runs "
                f"{port.name} in its place with the same outputs but other floating-point "
                f"inputs ({_inputs(port_in)} against {_inputs(ref_in)})")
            continue
        pairs.append(GapPair(ref.site, port.site, "position",
                             f"paired by position: port op {port.name} has the shape and place "
                             f"of {ref.name} (the only op with outputs {_shapes(signature)} "
                             f"{where}, on each side)"))
    return pairs, refused


_BY_HAND = "[[pair]] in a mapping pairs them"


def _inputs(inputs: list[tuple[str, str]]) -> str:
    return ", ".join(f"{arg} ({shape})" for arg, shape in inputs) or "none"


def _as_group(refs: list[OpRecords], port: OpRecords, where: str
              ) -> tuple[list[GapPair], dict[str, str]]:
    names = ", ".join(r.name for r in refs)
    last = refs[-1]
    if not last.output_signature or last.output_signature != port.output_signature:
        why = (f"not paired as a group with the port's {port.name} ({where}, where it runs "
               f"that one op for {names}; {_BY_HAND}): its outputs "
               f"({_shapes(port.output_signature)}) are not the last one's "
               f"({_shapes(last.output_signature)})")
        return [], {r.site: why for r in refs}
    outside = _outside_inputs(refs)
    port_in = port.float_inputs
    theirs = [(f"{r.name} input {i.arg}", i.shape) for r, i in outside]
    ours = [(f"{port.name} input {i.arg}", i.shape) for i in port_in]
    lined = [_lines_up(r, i, p) for (r, i), p in zip(outside, port_in, strict=False)]
    if len(theirs) != len(ours) or not all(lined):
        first = lined.index(None) if None in lined else min(len(theirs), len(ours))
        detail = (f"{theirs[first][0]} ({theirs[first][1]}) against {ours[first][0]} "
                  f"({ours[first][1]})" if first < min(len(theirs), len(ours)) else
                  f"{len(theirs)} inputs from outside the group against {len(ours)}")
        why = (f"not paired as a group with the port's {port.name} ({where}, where it runs "
               f"that one op for {names}, with the last one's output; {_BY_HAND} and args): "
               f"an input would go uncompared, as theirs do not line up, {detail}")
        return [], {r.site: why for r in refs}
    partner = {(r.site, i.arg): p.arg for (r, i), p in zip(outside, port_in, strict=True)}
    swapped = {(r.site, i.arg) for (r, i), how in zip(outside, lined, strict=True)
               if how == "swapped"}
    # masks and indices: compared too where they line up one for one (they carry no error, so
    # one left unpaired never keeps the group from being judged)
    other_in = [i for i in port.inputs if i.kind != "float"]
    others = _outside_inputs(refs, float_only=False)
    others = [(r, i) for r, i in others if i.kind != "float"]
    if [(i.shape, i.kind) for _, i in others] == [(i.shape, i.kind) for i in other_in]:
        partner.update({(r.site, i.arg): p.arg for (r, i), p in zip(others, other_in,
                                                                      strict=True)})
    turned = "".join(f", {r.name}'s input {i.arg} as its input {partner[(r.site, i.arg)]} "
                     "transposed" for r, i in outside if (r.site, i.arg) in swapped)
    why = (f"paired as a group: port op {port.name} stands for {names} {where} (its output "
           f"is {last.name}'s, its inputs {_inputs([(p.arg, p.shape) for p in port_in])} those "
           f"coming into the group{turned})")
    pairs = []
    for ref in refs:
        args = {i.arg: partner.get((ref.site, i.arg), "") for i in ref.inputs}
        roles = None if ref is last else frozenset(ARGUMENT_ROLES)
        mine = frozenset(arg for site, arg in swapped if site == ref.site)
        pairs.append(GapPair(ref.site, port.site, "group", why, args, roles, mine))
    return pairs, {}


# A matmul's second operand is contracted over its second-to-last axis: attention written out
# passes ``k.transpose(-2, -1)`` where a fused call takes ``k`` (SDPA's definition).
_TRANSPOSED_OPERAND = (("matmul", "1"), ("bmm", "1"))


def _lines_up(ref: OpRecords, given: OpInput, port: OpInput) -> str | None:
    """How a group's input compares with the fused op's: "same" shape, "swapped" (a matmul's
    second operand whose last two axes, of different sizes, are the port input's swapped), or
    None. A square operand is None: whether it was passed transposed cannot be told."""
    parts = schema.split_op_site(ref.site)
    operand = (parts[1] if parts else "", given.arg) in _TRANSPOSED_OPERAND
    a, b = schema.parse_shape(given.shape), schema.parse_shape(port.shape)
    if operand and len(a) >= 2 and a[-1] == a[-2]:
        return None
    if a == b:
        return "same"
    if operand and len(a) == len(b) >= 2 and a[:-2] == b[:-2] and a[-2:] == b[-2:][::-1]:
        return "swapped"
    return None


def _outside_inputs(refs: list[OpRecords], *, float_only: bool = True
                    ) -> list[tuple[OpRecords, OpInput]]:
    """The group's (floating-point) inputs that come from outside it, in execution and
    argument order: not the values an earlier op of the group output (by digest), and each
    once."""
    made: set[str] = set()
    seen: set[str] = set()
    outside = []
    for ref in refs:
        for item in ref.float_inputs if float_only else ref.inputs:
            if not (item.digest and (item.digest in made or item.digest in seen)):
                outside.append((ref, item))
                seen.add(item.digest)
        made |= ref.output_digests
    return outside
