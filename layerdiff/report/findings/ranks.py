"""The text of ``check_ranks``: whether the replicas of a multi-rank capture agree, and where
they first do not, with the likely cause and the [[shard]] rule that would cover it."""

from __future__ import annotations

import textwrap

from layerdiff.compare.ranks import Disagreement, Mode, RanksResult, Reason
from layerdiff.report.text import WIDTH
from layerdiff.trace import schema
from layerdiff.trace.schema import ARGUMENT_ROLES, PARAM_ROLES, Pass, Role


def ranks_text(result: RanksResult) -> str:
    how = ("bit for bit by the index digests" if result.mode == Mode.BITWISE
           else f"within tolerance ({result.tolerance})")
    rules = (f"{result.shard_rules} [[shard]] rule{'s' * (result.shard_rules != 1)} from "
             f"{result.mapping}" if result.shard_rules else "no [[shard]] rules")
    lines = [f"ranks: {result.manifest}, {result.world_size} ranks, {how}; {rules}"]
    skipped = f"; {result.sharded:,} sharded records not compared" if result.sharded else ""
    within = (f"; {result.within:,} differ in their bits only within tolerance"
              if result.within else "")
    if result.first is None:
        lines.append(f"agree: all {result.records:,} replicated records are the same on every "
                     f"rank{within}{skipped}")
    else:
        counts = ", ".join(f"rank {rank}: {count:,}" for rank, count in
                           result.per_rank.items() if count)
        lines.append(f"disagree: {result.disagreeing:,} of {result.records:,} replicated "
                     f"records differ from rank 0's copy ({counts}){within}{skipped}")
        lines.extend(_first_lines(result))
        if result.next:
            lines.append("then: " + "; ".join(f"{d.where()} on {d.on()}" for d in result.next))
    lines.extend(f"warning: {warning}" for warning in result.warnings)
    out: list[str] = []
    for line in lines:  # a continuation two spaces deeper than its line's own indent; names
        indent = " " * (len(line) - len(line.lstrip()))   # with hyphens stay whole
        out.extend(textwrap.wrap(line, WIDTH, subsequent_indent=indent + "  ",
                                 break_on_hyphens=False) or [""])
    return "\n".join(out)


def _first_lines(result: RanksResult) -> list[str]:
    first = result.first
    assert first is not None
    whys = "; ".join(detail.why if len(first.details) == 1
                     else f"rank {detail.rank}: {detail.why}" for detail in first.details)
    lines = [f"replicas of a replicated tensor disagree first at {first.where()} on "
             f"{first.on()}: {whys}",
             f"  likely: {_cause(first)}"]
    tensor = _rule_tensor(first.role, first.arg)
    module = schema.split_site(first.site)[0]
    advice = (f'  if this tensor is meant to differ across ranks (it is sharded), add a '
              f'[[shard]] rule for it (site = "{module}", tensor = "{tensor}", dim = the '
              "dimension the ranks' parts join along)")
    if not result.shard_rules:
        advice += ("; no [[shard]] rules were given, so every tensor counts as replicated "
                   "and the sharded ones (a tensor-parallel weight, a data-parallel batch) "
                   "disagree by design: pass --map FILE with the port's [[shard]] rules")
    lines.append(advice)
    if result.mode == Mode.BITWISE and any(d.norms_close for d in first.details):
        lines.append("  the copies' L2 norms agree as closely as rounding leaves them: if "
                     "the difference is rounding (a reduction whose order depends on the "
                     "rank), check again with --tolerance")
    return lines


def _rule_tensor(role: str, arg: str) -> str:
    """The ``tensor`` of a [[shard]] rule that would cover this record."""
    if role in PARAM_ROLES:
        return arg
    return "input" if role in ARGUMENT_ROLES else "output"  # the rule's own words


def _cause(first: Disagreement) -> str:
    """What usually makes replicas of such a record disagree."""
    reasons = {detail.reason for detail in first.details}
    if reasons & {Reason.MISSING, Reason.EXTRA, Reason.KIND}:
        return ("the ranks ran different code here: a rank skipped or added this call, or a "
                "branch depends on the rank")
    if reasons & {Reason.SHAPE, Reason.DTYPE}:
        return ("the ranks hold it in different shapes or dtypes: it is cut across ranks, or "
                "a branch depends on the rank")
    if first.role == Role.WEIGHT:
        return ("a rank initialised its own weights or missed their broadcast from rank 0 "
                "(step 0), or an earlier update used gradients that were not all-reduced")
    if first.role == Role.WEIGHT_GRAD:
        return ("a gradient not all-reduced across the ranks (a parameter without its "
                "all-reduce hook, a reduction over another group), or averaged by another "
                "world size")
    if first.pass_ == Pass.BACKWARD:
        return ("a backward all-reduce missed (as Megatron's f does for a column-parallel "
                "layer's input gradient), or a per-rank computation in backward")
    return ("a per-rank random generator (a dropout drawing from a generator seeded by rank), a "
            "rank-dependent computation, or inputs not broadcast from rank 0")


__all__ = ["ranks_text"]
