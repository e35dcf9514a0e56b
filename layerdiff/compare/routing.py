"""Mixture-of-experts routing compared as decisions, not as numbers.

Which experts a token goes to is a decision: a near-tie that rounds the other way in the port
sends the token to another expert, and everything downstream of that token differs by a lot
although no code is wrong. So the decisions of every router (declared or detected, see
:mod:`layerdiff.trace.routers`) are compared as sets per token, and a flip is reported with the
scores at the boundary.
"""

from __future__ import annotations

import math
import shlex
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare.judge import UNCHANGED, Verdict, element_ratios
from layerdiff.compare.pair import origin_row
from layerdiff.compare.result import Column, Origin
from layerdiff.errors import LayerdiffError
from layerdiff.mapping import Mapping
from layerdiff.trace import Trace, schema
from layerdiff.trace.routers import read_side, routers, tokens_shape

LOW_PRECISIONS = ("bfloat16", "float16")  # what a router's softmax is commonly computed in


@dataclass
class Flip:
    """One token whose chosen experts differ between reference and port."""

    token: int                      # row of the router's (tokens, E) scores
    position: tuple[int, int] | None  # (batch, position) when the sequence's shape is known
    reference: list[int]            # the reference's chosen experts (sorted)
    port: list[int]
    baseline: list[int] | None      # the baseline's, when a baseline was given
    reference_margin: float         # k-th minus (k+1)-th score, the reference's own scores
    port_margin: float              # ... the port's own scores
    shared: bool                    # the baseline makes the same flip: within precision
    why: str                        # the scores at the boundary, one clause
    tie: str                        # the dtype the port's two boundary scores tie in, or ""

    def where(self) -> str:
        return (f"token (b={self.position[0]}, t={self.position[1]})" if self.position
                else f"token {self.token}")

    def text(self, layer: str) -> str:
        return (f"{layer}, {self.where()}: experts {_set(self.reference)} → {_set(self.port)}"
                f"; {self.why}" + ("; the baseline makes the same flip (within precision)"
                                   if self.shared else ""))


@dataclass
class RouterReport:
    """One router call's decisions, reference against port (and baseline)."""

    step: int
    site: str                       # the reference's router site
    port_site: str
    k: int
    experts: int
    tokens: int
    source: str                     # where each side's decision was read from
    records: list[list[str]]        # the reference's records of its choice: [site, role, arg]
    port_records: list[list[str]]
    flips: list[Flip] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        data = asdict(self)
        for flip, made in zip(data["flips"], self.flips, strict=True):
            flip["position"] = list(flip["position"]) if flip["position"] else None
            flip["text"] = made.text(_layer(self.site))
        return data


def _set(experts: list[int]) -> str:
    return "{" + ",".join(map(str, experts)) + "}"


def routing_report(ref: Trace, port: Trace, base: Trace | None, mapping: Mapping,
                   rows: pd.DataFrame) -> list[RouterReport]:
    """Every router's decisions compared, per step and call (empty: no router found)."""
    if ref.summary or port.summary or rows.empty:
        return []
    paired = rows[[Column.STEP, Column.SITE, Column.PORT_SITE]].drop_duplicates(
        [Column.STEP, Column.SITE])
    port_of = {(int(s), str(a)): str(b or a) for s, a, b in paired.itertuples(index=False)}
    entered_out = rows[(rows[Column.ROLE] == "input") & (rows[Column.VERDICT] == Verdict.OUT)]
    differs = set(zip(entered_out[Column.STEP].astype(int), entered_out[Column.SITE],
                      strict=True))
    reports = []
    for step, site, k in routers(ref, mapping):
        port_site = port_of.get((step, site))
        if port_site is None:
            continue
        report = _compare(ref, port, base, step, site, port_site, k, (step, site) in differs)
        if report is not None:
            reports.append(report)
    return reports


def _margins(scores: np.ndarray, k: int) -> np.ndarray:
    ranked = -np.sort(-scores, axis=-1)
    return ranked[:, k - 1] - ranked[:, k]


def _softmax(scores: np.ndarray) -> np.ndarray:
    shifted = np.exp(scores - scores.max())
    return shifted / shifted.sum()


def _round(values: np.ndarray, dtype: str) -> np.ndarray:
    """``values`` rounded to ``dtype`` (bfloat16: round to nearest even on the top 16 bits)."""
    if dtype == "float16":
        return values.astype(np.float16).astype(np.float64)
    bits = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _why(ref: np.ndarray, port: np.ndarray, dropped: int, added: int,
         dtype: str) -> tuple[str, str]:
    """The boundary in one clause, and the dtype in which the port's scores of the expert it
    dropped and the one it took instead tie ("" when they do not: ranked the other way)."""
    ref_gap = ref[dropped] - ref[added]
    if port[dropped] == port[added]:
        return (f"the port's router scores tie in {dtype} ({port[dropped]:.6g} = "
                f"{port[added]:.6g}) where the reference's differ by {ref_gap:.2g}", dtype)
    if ref_gap < 0:  # the reference did not take the top k of the scores it records
        if np.array_equal(port, ref):
            return (f"both routers record the same scores for it, expert {added} above "
                    f"{dropped} by {-ref_gap:.2g}, and choose otherwise: the choice rests on more "
                    "than these scores (a selection-only bias, group limits) and that differs; "
                    "compare the routers' weights and buffers", "")
        return (f"the reference's recorded scores rank expert {added} above {dropped} by "
                f"{-ref_gap:.2g}, yet it chose {dropped}: the routers choose from more than the "
                "scores they record (a selection-only bias, group limits)", "")
    if port[dropped] > port[added]:  # the port's own scores rank them as the reference does:
        # it chose from a rounded copy; find the precision in which they tie
        probs, ref_probs = _softmax(port), _softmax(ref)
        for low in LOW_PRECISIONS:
            for name, values, ref_values in (("scores", port, ref),
                                             ("probabilities", probs, ref_probs)):
                rounded = _round(values, low)
                if rounded[dropped] == rounded[added]:
                    return (f"the port's router {name} tie in {low} ({rounded[dropped]:.6g} = "
                            f"{rounded[added]:.6g}) where the reference's differ by "
                            f"{ref_values[dropped] - ref_values[added]:.2g}", low)
        return (f"the port's recorded scores rank expert {dropped} above {added} by "
                f"{port[dropped] - port[added]:.2g}, yet it chose {added}: it chooses from "
                "other scores than it records", "")
    return (f"the port's scores rank expert {added} above {dropped} by "
            f"{port[added] - port[dropped]:.2g} where the reference's rank {dropped} above "
            f"{added} by {ref_gap:.2g}", "")


def _compare(ref: Trace, port: Trace, base: Trace | None, step: int, site: str,
             port_site: str, k: int, input_differs: bool) -> RouterReport | None:
    """``input_differs``: the router's input is already out of tolerance, so a flip whose
    scores rank the other way is that difference's consequence."""
    mine, theirs = read_side(ref, step, site, k), read_side(port, step, port_site, k)
    if mine is None or theirs is None or mine.scores.shape != theirs.scores.shape:
        return None
    ref_scores, ref_chosen = mine.scores, np.sort(mine.chosen, axis=-1)
    port_scores, port_chosen = theirs.scores, np.sort(theirs.chosen, axis=-1)
    if k >= ref_scores.shape[-1]:
        return None
    base_side = read_side(base, step, site, k) if base is not None else None
    base_chosen = (np.sort(base_side.chosen, axis=-1) if base_side is not None
                   and base_side.chosen.shape == ref_chosen.shape else None)
    parent = ref.sites.loc[(ref.sites["step"] == step) & (ref.sites["site"] == site), "parent"]
    shape = tokens_shape(ref, step, str(parent.iloc[0]) if len(parent) else "",
                         len(ref_scores))
    report = RouterReport(step, site, port_site, k, ref_scores.shape[-1], len(ref_scores),
                          f"reference: {mine.source}; port: {theirs.source}", mine.records,
                          theirs.records)
    ref_margin, port_margin = _margins(ref_scores, k), _margins(port_scores, k)
    for token in np.flatnonzero((ref_chosen != port_chosen).any(axis=-1)):
        ours, yours = set(ref_chosen[token].tolist()), set(port_chosen[token].tolist())
        dropped, added = min(ours - yours), min(yours - ours)
        baseline = None if base_chosen is None else sorted(base_chosen[token].tolist())
        why, tie = _why(ref_scores[token], port_scores[token], dropped, added, theirs.dtype)
        if not tie and input_differs:
            why += " (the router's input already differs: a consequence)"
        report.flips.append(Flip(
            int(token), None if shape is None else divmod(int(token), shape[1]),
            sorted(ours), sorted(yours), baseline, float(ref_margin[token]),
            float(port_margin[token]), baseline == sorted(yours), why, tie))
    return report


def judge_decisions(rows: pd.DataFrame, reports: list[RouterReport]) -> None:
    """The diff's rows of recorded top-k indices judged as decisions, in place: never a ratio
    (an expert's number is a name; 3 against 2 is not 'off by 1.5x'); out when some token
    chose other experts than the reference's and the baseline (if any) does not make the same
    flip, within when every token chose the same set (in any order) or every flip is the
    baseline's too."""
    if rows.empty or not reports:
        return
    numeric = [c for c in (Column.MAX_ABS, Column.MAX_REL, Column.MEAN_ABS, Column.RMS,
                           Column.COSINE, Column.MAX_ULP, Column.FRAC_OUT, Column.RATIO,
                           Column.WORST_INDEX, Column.BATCH_RATIO) if c in rows.columns]
    for report in reports:
        ours = {tuple(r) for r in report.records}
        theirs = {tuple(r) for r in report.port_records}
        at = rows[(rows[Column.STEP] == report.step) & rows[Column.DTYPE].astype(str).str
                  .startswith(("int", "uint"))]
        for label, row in at.iterrows():
            port_site = str(row.get(Column.PORT_SITE) or row[Column.SITE])
            port_arg = str(row.get(Column.PORT_ARG) or row[Column.ARG])
            if (str(row[Column.SITE]), str(row[Column.ROLE]), str(row[Column.ARG])) not in ours \
                    and (port_site, str(row[Column.ROLE]), port_arg) not in theirs:
                continue
            own = [flip for flip in report.flips if not flip.shared]
            shared = len(report.flips) - len(own)
            if report.flips:
                note = (f"decision differs: {len(report.flips)} of {report.tokens} tokens "
                        f"(router {report.site})"
                        + (f", {shared} the baseline's too" if shared else ""))
            else:
                note = (f"decision: the same top-{report.k} experts for all {report.tokens} "
                        "tokens")
            for column in numeric:
                rows.at[label, column] = None
            rows.at[label, Column.NOTE] = note
            if own:
                rows.at[label, Column.VERDICT] = Verdict.OUT
            elif row[Column.VERDICT] not in UNCHANGED:
                rows.at[label, Column.VERDICT] = Verdict.WITHIN


# ---------------------------------------------------------------- origins explained by a flip

def explain_origins(origins: list[Origin], reports: list[RouterReport], ref: Trace,
                    reader: Any = None, diff_command: list[str] | None = None) -> None:
    """An origin at or after a router with flips (same step; its call returns after the
    router's began: the MoE block around it, the experts, every later layer; in either pass, a
    gradient there runs back through the routed forward), whose worst element lies on a
    flipped token, gets the flip as ``origin.routing``. A flip the baseline
    shares explains nothing: it is within precision.

    ``origin.routing["lead"]`` says what the flip means for the verdict, and ``confined``
    whether the origin's error outside the flipped tokens is within its tolerance (read
    through ``reader``, a PairReader; None when it cannot be read). Confined, the flip is the
    whole story and the origin's reason says so; not confined, the rest is still out and the
    reason keeps what it said, after the flip. ``diff_command``: this diff's command line, to
    which the baseline a tie calls for is added."""
    if not origins or not any(r.flips for r in reports):
        return
    enter, leave = call_spans(ref)
    for origin in origins:
        worst = _worst(origin)
        if worst is None:
            continue
        for report in reports:
            began = enter.get((report.step, report.site))
            if report.step != origin.step or began is None \
                    or leave.get((origin.step, origin.site), -1) < began:
                continue
            flip = _on_token(report, worst, ref, origin)
            if flip is not None and not flip.shared:
                origin.routing = {"router": report.site, "port_router": report.port_site,
                                  "token": flip.token,
                                  "position": list(flip.position) if flip.position else None,
                                  "reference": flip.reference, "port": flip.port,
                                  "tie": flip.tie, "text": flip.text(_layer(report.site))}
                _lead(origin, report, flip, reader, diff_command)
                break


def call_spans(ref: Trace) -> tuple[dict[tuple[int, str], int], dict[tuple[int, str], int]]:
    """Each call's (step, site) -> its enter_seq, and -> its exit_seq."""
    sites = ref.sites
    keys = list(zip(sites["step"].astype(int), sites["site"], strict=True))
    return (dict(zip(keys, sites["enter_seq"].astype(int), strict=True)),
            dict(zip(keys, sites["exit_seq"].astype(int), strict=True)))


def _lead(origin: Origin, report: RouterReport, flip: Flip, reader: Any,
          diff_command: list[str] | None) -> None:
    """The flip's meaning for the verdict, derived from its numbers: a tie in a lower dtype is
    the port choosing from rounded scores (no wrong code downstream); scores ranked the other
    way are the router's input or weights differing. Then whether the origin's error is
    confined to the flipped tokens, which decides if its reason still stands."""
    routing = origin.routing
    assert routing is not None
    tokens = [f for f in report.flips if not f.shared]
    where = flip.where() + (f" (and {len(tokens) - 1} more)" if len(tokens) > 1 else "")
    if flip.tie:
        # this diff again against the reference captured with its router in that dtype
        baseline = (str(Path(diff_command[2]).with_suffix(f".router-{flip.tie}.h5"))
                    if diff_command and len(diff_command) > 2 else "")
        routing["baseline_command"] = (shlex.join([*diff_command, "--baseline", baseline])
                                       if baseline else "")
        lead = (f"the port's router decides in {flip.tie}: a near-tie (margin "
                f"{flip.reference_margin:.2g} in the reference) flips {where}; everything "
                "downstream of that token differs without any wrong code there — compare with "
                f"a {flip.tie} baseline (--baseline) to see whether the reference flips too")
    else:
        lead = (f"the port's router scores rank the experts the other way at {where}: the "
                f"router's inputs or weights differ; look at the router {report.port_site} "
                f"(reference {report.site})")
    routing["lead"] = lead
    outside = _outside_ratio(origin, report, tokens, reader)
    routing["outside_ratio"] = outside
    routing["confined"] = None if outside is None else bool(outside <= 1.0)
    if routing["confined"]:
        origin.reason = (f"its output is out of tolerance only at the flipped token"
                         f"{'s' if len(tokens) > 1 else ''}; everywhere else within "
                         f"(worst {outside:.2g}x tolerance)")
    elif outside is not None:
        also = (f" (a router that decides in {flip.tie} may weight every token in {flip.tie} "
                "too: the baseline tells)" if flip.tie else "")
        origin.reason = (f"outside the flipped token{'s' if len(tokens) > 1 else ''} it is "
                         f"still out ({outside:.3g}x tolerance), which the flip does not "
                         f"explain{also}: {origin.reason}")


def _outside_ratio(origin: Origin, report: RouterReport, flips: list[Flip],
                   reader: Any) -> float | None:
    """The worst |port - ref| / (atol + rtol |ref|) of the origin's record outside the flipped
    tokens (its leading axes (B, S) or (T,) the router's tokens); None when it cannot be read
    or its shape does not hold the tokens."""
    if reader is None:
        return None
    try:
        ref, port = reader.read(origin_row(origin), compared=True)
    except (LayerdiffError, OSError, ValueError):  # no tensors: the flip is still worth saying
        return None
    if ref.shape != port.shape or ref.ndim < 1:
        return None
    ratios = element_ratios(ref, port, float(origin.metrics.get("rtol") or 0),
                                  float(origin.metrics.get("atol") or 0))
    # (B, S, ...) or (T, ...): the leading axes are the router's tokens
    if not (ref.shape[0] == report.tokens or (
            ref.ndim >= 2 and ref.shape[0] * ref.shape[1] == report.tokens)):
        return None
    ratios = ratios.reshape(report.tokens, -1)
    keep = np.ones(report.tokens, dtype=bool)
    keep[[f.token for f in flips]] = False
    rest = ratios[keep]
    return float(np.nanmax(rest)) if rest.size else 0.0


def _layer(site: str) -> str:
    """'model.layers.0.mlp.gate#0' -> 'layer 0' when the name holds one number, else the site."""
    numbers = [part for part in site.split("#")[0].split(".") if part.isdigit()]
    return f"layer {numbers[0]}" if len(numbers) == 1 else site


def _worst(origin: Origin) -> tuple[int, ...] | None:
    text = origin.metrics.get(Column.WORST_INDEX)
    if text is None or (isinstance(text, float) and math.isnan(text)) or text == "":
        return None
    try:
        return tuple(int(part) for part in str(text).strip("[]() ").split(",") if part.strip())
    except ValueError:
        return None


def _on_token(report: RouterReport, worst: tuple[int, ...], ref: Trace,
              origin: Origin) -> Flip | None:
    """The flip whose token holds the origin's worst element: its record (B, S, ...) or
    (T, ...), T the router's tokens."""
    row = ref.find(origin.step, origin.site, origin.role, origin.arg)
    dims = () if row is None else schema.parse_shape(row["shape"])
    for flip in report.flips:
        if flip.position and len(dims) >= 2 and len(worst) >= 2 and \
                dims[0] * dims[1] == report.tokens and tuple(worst[:2]) == flip.position:
            return flip
        if dims and dims[0] == report.tokens and worst[0] == flip.token:
            return flip
    return None
