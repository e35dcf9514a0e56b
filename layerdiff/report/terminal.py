"""The diff for a terminal: verdict and origin first, then the failing sites, in 100 columns."""

from __future__ import annotations

import math
import textwrap

import pandas as pd

from layerdiff.compare.judge import Status, Verdict
from layerdiff.compare.result import Column, Diff, Origin
from layerdiff.compare.suggest import wrap_command
from layerdiff.report.findings.diff import (
    describe_origin,
    forced_routing,
    position_line,
    routing_line,
    said_by_flip,
    shapes_differ,
)
from layerdiff.report.text import WIDTH, clip, clip_middle, number, ranges
from layerdiff.trace import schema
from layerdiff.trace.printable import printable
from layerdiff.trace.schema import PARAM_ROLES, Pass

MAX_SITES = 40


# (column, width, align); width 0 takes what the others leave.
COLUMNS = [("step", 4, "r"), ("pass", 4, "l"), ("site", 0, "l"), ("role", 11, "l"),
           ("arg", 6, "l"), ("ratio", 9, "r"), ("max_abs", 9, "r"), ("cosine", 9, "r"),
           ("status", 11, "l")]  # 'same-digest' whole


@printable
def format_diff(diff: Diff, *, verbose: bool = False, width: int = WIDTH) -> str:
    """The whole terminal report."""
    lines = [verdict_line(diff, width)]
    if diff.cannot_judge_first is not None:
        lines += _unjudged_details(diff, width)
    elif diff.origin is not None:
        lines += _origin_details(diff.origin, width)
    lines += _precision_hint(diff.meta.get("precision"), width)
    lines += _replicas(diff, width)
    lines += routing_lines(diff, width)
    lines.append("")
    lines += _summary(diff, width)
    if verbose:
        lines += ["", "every compared record:", format_rows(diff.rows, width)]
        if not diff.unmatched.empty:
            lines += ["", "without partner:", _format_unmatched(diff.unmatched, width)]
        if not diff.not_taken.empty:
            lines += ["", "not taken by the port (left out of the input check):",
                      _format_not_taken(diff.not_taken, width)]
        if diff.cannot_judge:
            lines += ["", "paired sites whose own code cannot be judged, and the rule to write:"]
            for site in diff.cannot_judge:
                lines += textwrap.wrap(f"{site.site}: {'; '.join(site.why)}", width,
                                       initial_indent="  ", subsequent_indent="    ")
    elif not diff.passed:
        failing = failing_sites(diff.rows)
        shown = failing.head(MAX_SITES)
        step = diff.first_failing_step
        lines += ["", f"out of tolerance (first failing step {step}), in execution order; "
                      "ratio = error / tolerance:", format_rows(shown, width)]
        if len(failing) > len(shown):
            lines.append(f"... {len(failing) - len(shown)} more (--verbose, or --json FILE, "
                         "for every row)")
    lines += ops_lines(diff, width)
    return "\n".join(lines)


def routing_lines(diff: Diff, width: int = WIDTH) -> list[str]:
    """The routers whose top-k experts differ for some tokens, each flip on a line (nothing
    when every token chose as the reference did)."""
    routers = diff.meta.get("routing") or []
    forced = [textwrap.wrap(text, width, subsequent_indent="  ") for text in forced_routing(diff)]
    lines = [line for said in forced for line in ["", *said]]
    if not routers:
        return lines
    lines += ["", "routing: tokens whose top-k experts differ (reference -> port):"]
    for router in routers:
        flips = router["flips"]
        shared = sum(bool(flip["shared"]) for flip in flips)
        lines += textwrap.wrap(
            f"{router['site']} (port {router['port_site']}, step {router['step']}): "
            f"{len(flips)} of {router['tokens']} tokens, top-{router['k']} of "
            f"{router['experts']}" + (f"; {shared} the baseline's too, within precision"
                                      if shared else ""), width, initial_indent="  ",
            subsequent_indent=" " * 6)
        for flip in flips:
            lines += textwrap.wrap(
                f"{flip['text']} (boundary margins: reference "
                f"{number(flip['reference_margin'], 2)}, port {number(flip['port_margin'], 2)})",
                width, initial_indent=" " * 4, subsequent_indent=" " * 6)
    return lines


def _replicas(diff: Diff, width: int) -> list[str]:
    """A multi-rank port whose replicated tensors differ across ranks: said before the table,
    since an origin after that record may only be its consequence."""
    first = diff.meta.get("replicas")
    if not first:
        return []
    gathered = diff.meta.get("gathered") or {}
    rules = gathered.get("mapping", "no mapping")
    command = f"layerdiff ranks {gathered.get('manifest', 'PORT')}" + (
        f" --map {rules}" if rules != "no mapping" else "")
    text = (f"RANKS replicated tensors differ across ranks, first at {first['where']} on "
            f"{first['on']} ({first['disagreeing']} records): the diff compares rank 0's copy and "
            "joins parts computed from diverged replicas, so an origin after that record may be "
            f"its consequence; `{command}` says more")
    return textwrap.wrap(text, width, subsequent_indent="      ")


# (meta key, what the commands are for): the next captures a diff suggests
NEXT = (("full_commands", ["a summary trace holds statistics only; these commands keep tensor "
                           "data", "around the origin on both sides, for its element-wise error "
                           "and likely cause:"]),
        ("ops_commands", ["the fault is in a module's own code, whose ops were not captured; "
                          "these", "commands capture them on both sides and name the op:"]))


def ops_lines(diff: Diff, width: int = WIDTH) -> list[str]:
    """The captures a diff suggests next (see layerdiff.compare.suggest), one block each."""
    lines: list[str] = []
    for key, why in NEXT:
        commands = diff.meta.get(key) or []
        if commands:
            lines += ["", *why]
            for command in commands:
                lines += [f"  {line}" for line in wrap_command(command, width - 2)]
    return lines


def verdict_line(diff: Diff, width: int = WIDTH) -> str:
    """One line: PASS, or FAIL with the first origin."""
    if diff.passed:
        padded = diff.rows[Column.VERDICT] == Verdict.PADDING if not diff.rows.empty else []
        worst = diff.rows[Column.RATIO][~padded].max() if not diff.rows.empty else 0.0
        # what a mapping question kept from being compared belongs in the verdict, not only
        # behind --verbose: a pass says nothing of it
        unpaired = int((~diff.unmatched["declared"].astype(bool)).sum())
        excused = int(sum(padded))
        # the number is what a reader comes for: say it shorter rather than cut into it
        for largest, padding, not_compared in (("largest error {} of its tolerance",
                                                "differ only at padding",
                                                "unpaired, not compared"),
                                               ("largest {} of tolerance", "padding only",
                                                "unpaired")):
            line = (f"PASS  {len(diff.rows):,} records within tolerance "
                    f"({largest.format(number(worst, 3))})"
                    + (f"; {excused:,} {padding}" if excused else "")
                    + (f"; {unpaired:,} {not_compared}" if unpaired else ""))
            if len(line) <= width:
                return line
        return clip_middle(line, width)
    first = diff.cannot_judge_first
    if first is not None:
        return clip_middle(f"FAIL  cannot judge {first.site}, which holds the first record "
                           f"out ({first.pass_}, {number(first.ratio, 3)}x tolerance)", width)
    if diff.origin is None:
        if (diff.rows[Column.STATUS] == Status.CANNOT_JUDGE).any():
            return clip_middle(f"FAIL  {len(diff.failing()):,} records out; no origin can be "
                               "named: what comes into them has no partner", width)
        return clip_middle(f"FAIL  {len(diff.failing()):,} records out of tolerance; no "
                           "origin found (every failing site's inputs were already out)", width)
    return f"FAIL  origin: {describe_origin(diff.origin, port_name=False)}"


def _unjudged_details(diff: Diff, width: int) -> list[str]:
    """Why the first failing record's site cannot be judged and what to write; a later origin
    only as a hedged second line."""
    first = diff.cannot_judge_first
    arg = "" if first.arg == "0" else f" '{first.arg}'"
    lines = [f"first record out: {first.record_site}, {first.pass_} {first.role}{arg}, step "
             f"{first.step}: {number(first.ratio, 3)}x tolerance",
             f"{first.site} cannot be judged: {first.why}"]
    if first.port_site not in ("", first.site):
        lines.insert(0, f"in the port: {first.port_site}")
    if diff.origin is not None:
        lines.append(f"a later origin, which may be its consequence: "
                     f"{describe_origin(diff.origin, port_name=False)}")
        lines += hint_lines(diff.origin)
    return [wrapped for line in lines for wrapped in textwrap.wrap(
        line, width, initial_indent=" " * 6, subsequent_indent=" " * 8)]


def _record_word(role: str) -> str:
    """What a record's path names, for people: an output (a (cache, x) port's '1') is no
    argument."""
    return {"output": "output", "grad_output": "output"}.get(str(role), "argument")


def _origin_details(origin: Origin, width: int) -> list[str]:
    m = origin.metrics
    in_port = [] if origin.port_site in ("", origin.site) else [
        f"in the port: {origin.port_site}" + (
            "" if origin.port_arg == origin.arg else
            f", {_record_word(origin.role)} '{origin.port_arg}'")]
    tolerance = (f"tolerance rtol={m.get('rtol', 0):g} atol={m.get('atol', 0):g} "
                 f"({m.get('tol_source', '')}); worst element [{m.get('worst_index', '')}]; "
                 f"{number((m.get('frac_out') or 0) * 100, 3)}% of elements out")
    if shapes_differ(origin):
        tolerance = (f"not compared element by element: {shapes_differ(origin)} and no rule "
                     "relates them; for an output, name an output conversion (output_transform "
                     "on the site's rule, docs/mapping.md), for an input a call adapter")
    # a flip leads: it says why before the reason does (which it may have qualified)
    lines = [*in_port, *filter(None, [origin.pairing]), *routing_line(origin), origin.reason,
             *hint_lines(origin), tolerance]
    batch = m.get("batch_ratio")
    if batch:
        out = [i for i, r in enumerate(batch) if r is not None and r > 1]
        inside = len(batch) - len(out)
        lines.append(f"batch elements out of tolerance: {ranges(out) or 'none'} "
                     f"({inside} of {len(batch)} within)")
    lines += list(filter(None, [position_line(origin.positions), origin.shards]))
    if origin.holders:
        lines.append(f"inside {', '.join(origin.holders)}")
    if m.get("note"):
        lines.append(f"note: {m['note']}")
    return [wrapped for line in lines for wrapped in textwrap.wrap(
        line, width, initial_indent=" " * 6, subsequent_indent=" " * 8)]


def _precision_hint(hint: dict | None, width: int) -> list[str]:
    if not hint:
        return []
    if hint.get("records"):  # a few tensors of a lower dtype inside a full-precision port
        more = hint["count"] - len(hint["records"])
        named = ", ".join(hint["records"]) + (f" and {more} more" if more > 0 else "")
        return textwrap.wrap(
            f"values at {named} are {hint['lower']} inside a {hint['port']} port (a table, a "
            f"constant or one layer cast to {hint['lower']}?): the rest of the port runs in "
            f"{hint['port']} like the reference, so these are the tensors to look at, not a "
            f"baseline in {hint['lower']}", width, initial_indent=" " * 6,
            subsequent_indent=" " * 6)
    lines = textwrap.wrap(
        f"the port runs in {hint['port']}, the reference in {hint['reference']}: per-dtype "
        "tolerances cannot know what that precision accumulates. Judge the port by the "
        "reference run its way (a baseline):", width, initial_indent=" " * 6,
        subsequent_indent=" " * 6)
    return [*lines, f"        {hint['capture']}", f"        {hint['diff']}"]


def _summary(diff: Diff, width: int) -> list[str]:
    rows, meta = diff.rows, diff.meta
    sites = rows[~rows[Column.ROLE].isin(PARAM_ROLES)].drop_duplicates(Column.SITE)
    matches = sites[Column.MATCH].value_counts().to_dict()
    how = ", ".join(f"{n} {kind}" for kind, n in matches.items())
    gathered = diff.meta.get("gathered")
    port = diff.port if not gathered else (
        f"{diff.port} (the {gathered['world_size']} ranks of {gathered['manifest']}, gathered)")
    lines = [f"reference {diff.reference}", f"port      {port}",
             f"compared  {len(rows):,} records at {len(sites)} site pairs ({how})",
             f"unpaired  {len(diff.unmatched):,} sites or records"
             + ("" if diff.unmatched.empty else " (--verbose lists them, with why)")]
    if not diff.not_taken.empty:
        names = ", ".join(dict.fromkeys(diff.not_taken["arg"].astype(str)))
        lines += textwrap.wrap(f"not taken {len(diff.not_taken):,} reference arguments the "
                               f"port's layers have no parameter for ({names}): left out of "
                               "the input check", width, subsequent_indent=" " * 10)
    if meta.get("mapping"):
        lines.append(f"mapping   {meta['mapping']}")
    scales = meta.get("loss_scale", {})
    if scales and scales.get("reference") != scales.get("port"):
        lines.append(f"loss scale reference {scales['reference']:g}, port {scales['port']:g}: "
                     "port gradients rescaled to the reference's")
    if meta.get("summary"):
        lines.append("summary trace: statistics compared, not tensors")
    digests = int((rows[Column.VERDICT] == Verdict.SAME_DIGEST).sum()) if len(rows) else 0
    if digests:
        lines += textwrap.wrap(
            f"digests   {digests:,} records agree by their digests alone, bytes not compared "
            "(a side holds no data, or --no-verify read none): equal against any accidental "
            "change, not against a deliberate one", width, subsequent_indent=" " * 10,
            break_on_hyphens=False)
    if meta.get("baseline"):
        lines.append(f"baseline  {meta['baseline']['trace']}: each record may have "
                     f"{meta['baseline']['factor']:g}x the baseline's error + its dtype's rtol")
    lines += padding_lines(meta.get("padding"), width)
    for warning in meta.get("warnings", []):
        lines += textwrap.wrap(f"warning   {warning}", width, subsequent_indent=" " * 10)
    unjudged = rows[rows[Column.STATUS] == Status.CANNOT_JUDGE].drop_duplicates(Column.SITE)
    if len(unjudged):
        names = ", ".join(unjudged[Column.SITE].head(6)) + (" ..." if len(unjudged) > 6 else "")
        lines += textwrap.wrap(f"cannot judge {len(unjudged)} failing site(s) where an input or "
                               f"incoming gradient has no partner: {names}",
                               width, subsequent_indent=" " * 10)
    elif diff.cannot_judge:  # none fails, but a bug there would show only as 'cannot judge'
        sites = [site.site for site in diff.cannot_judge]
        names = ", ".join(sites[:6]) + (" ..." if len(sites) > 6 else "")
        lines += textwrap.wrap(f"unjudged  {len(sites)} paired site(s) whose own code cannot be "
                               f"judged, whatever they compute: {names} (--verbose, or "
                               "map-check, gives the rule to write for each)",
                               width, subsequent_indent=" " * 10)
    if len(diff.origins) > 1:
        lines.append(f"origins   {len(diff.origins)}:")
        for i, origin in enumerate(diff.origins, start=1):
            lines.append(clip_middle(f"  {i}. {describe_origin(origin, port_name=False)}",
                                     width))
            lines += [clip(f"       {text}", width) for text in hint_lines(origin)]
            lines += [clip(f"       {text}", width)
                      for text in filter(None, [position_line(origin.positions)])]
    return lines


def padding_lines(found: dict | None, width: int = WIDTH) -> list[str]:
    """What the padding mask set apart (compare/padding.py), or why it could not."""
    if not found or not (found["records"] or found["not_excluded"]):
        return []
    mask = f"root input '{found['mask']}'" + (" (--padding-mask)" if found["declared"] else "")
    worst = (f"worst {number(found['worst'], 3)}x tolerance" if math.isfinite(found["worst"])
             else "NaN or Inf where the reference is finite")
    if found["records"]:
        text = (f"padding   {found['records']:,} records differ only at padding positions "
                f"({worst} there), where the reference's gradient "
                f"({', '.join(found['shown_by'])}) is zero: the loss does not use them, so they "
                f"pass; mask: {mask}")
        if found.get("non_finite"):
            text += (f". The port holds NaN or Inf there in {found['non_finite']:,} of them: a "
                     "backward that multiplies it by a zero gradient (0 x NaN) makes gradients "
                     "NaN, which are judged as any gradient")
    else:
        text = (f"padding   {found['not_excluded']:,} failing records differ only at padding "
                f"positions ({worst} there; mask: {mask}), but they were not "
                f"excluded from the verdict: {found['why_not']}")
    return textwrap.wrap(text, width, subsequent_indent=" " * 10, break_on_hyphens=False)


def hint_lines(origin: Origin) -> list[str]:
    """'likely cause: KIND: evidence' when the origin's error matches a known kind of mistake."""
    hint = origin.hint
    if not hint or said_by_flip(origin):
        return []
    return [f"likely cause: {hint['kind']}: {hint['evidence']}"]



def failing_sites(rows: pd.DataFrame) -> pd.DataFrame:
    """The worst failing row of each (step, pass, site, role), in execution order."""
    failing = rows[rows[Column.STATUS] != ""]
    if failing.empty:
        return failing
    worst = failing.assign(_r=failing[Column.RATIO].fillna(math.inf)).sort_values(
        "_r", ascending=False, kind="stable")
    keep = worst.drop_duplicates([Column.STEP, Column.PASS, Column.SITE, Column.ROLE]).drop(
        columns="_r")
    return keep.sort_values([Column.STEP, Column.SEQ], kind="stable")


@printable
def format_rows(rows: pd.DataFrame, width: int = WIDTH) -> str:
    # the arg column grows to the longest argument shown (out_proj.weight), up to 20, out of
    # the site column's share
    arg = min(20, max([6, *(len(str(a)) for a in rows[Column.ARG])])) if len(rows) else 6
    columns = [(c, arg if c == "arg" else w, a) for c, w, a in COLUMNS]
    fixed = sum(w for _, w, _ in columns) + len(columns) - 1
    widths = [(c, w or max(16, width - fixed), a) for c, w, a in columns]
    site_width = next(w for c, w, _ in widths if c == "site")
    out = [_row(widths, {c: c for c, _, _ in columns})]
    above = ""   # the module site of the row above: its op rows nest under it
    for row in rows.rename(columns={"pass": "pass_"}).itertuples(index=False):
        status = {"origin": "ORIGIN", "holds-origin": "holds", "propagated": "propagated",
                  Status.CANNOT_JUDGE: "unjudged"}.get(row.status, row.verdict)
        site, above = _site_cell(row.site, above, site_width)
        out.append(_row(widths, {
            "step": str(row.step), "pass": "fwd" if row.pass_ == Pass.FORWARD else "bwd",
            "site": site, "role": row.role, "arg": row.arg,
            "ratio": number(row.ratio, 3), "max_abs": number(row.max_abs, 3),
            "cosine": number(row.cosine, 6), "status": status}))
    return "\n".join(out)


def _site_cell(site: str, above: str, width: int) -> tuple[str, str]:
    """How a site shows in the table, and its module site. An op site under a row of its own
    module (or of another of its ops) shows as ``  └ softmax#0``; elsewhere in full, clipped in
    its module's part so that the op stays readable."""
    parts = schema.split_op_site(site)
    if parts is None:
        return site, site
    module, op, k = parts
    if module == above:
        return f"  └ {op}#{k}", module
    tail = f"/{op}#{k}"
    return clip_middle(module, max(1, width - len(tail))) + tail, module


def _format_unmatched(unmatched: pd.DataFrame, width: int) -> str:
    lines = []
    for row in unmatched.itertuples(index=False):
        what = row.site if not row.role else f"{row.site} {row.role} {row.arg}"
        lines.append(clip_middle(f"  {row.side:<9} {what}: {row.reason}", width))
    return "\n".join(lines)


def _format_not_taken(not_taken: pd.DataFrame, width: int) -> str:
    lines = []
    for row in not_taken.itertuples(index=False):
        what = f"{row.dtype} ({row.shape})" if row.dtype else str(row.shape)
        lines.append(clip_middle(f"  {row.site} {row.role} {row.arg}: {what}; {row.reason}", width))
    return "\n".join(lines)


def _row(columns: list[tuple[str, int, str]], values: dict[str, str]) -> str:
    cells = []
    for name, width, align in columns:
        text = clip_middle(str(values.get(name, "")), width)
        cells.append(text.rjust(width) if align == "r" else text.ljust(width))
    return " ".join(cells).rstrip()


REPLAY_COLUMNS = [("pass", 4, "l"), ("site", 0, "l"), ("local", 9, "r"), ("propagated", 10, "r"),
                  ("amplif.", 8, "r"), ("verdict", 12, "l")]


@printable
def format_replay(result, *, verbose: bool = False, width: int = WIDTH) -> str:
    """A replay (a ``ReplayResult``): its verdict, then local beside propagated error per
    site and pass, and the layers that could not be judged."""
    from layerdiff.replay.replay import LocalVerdict, ReplayOutcome  # torch: not for a diff

    table = result.local
    local = table[table["verdict"] == LocalVerdict.LOCAL_ERROR]
    unjudged = result.cannot_judge
    skipped = len(getattr(result, "skipped_sites", ()))
    if result.outcome == ReplayOutcome.PASS and skipped:  # a pass says what it did not judge
        head = (f"PASS  no replayed layer has a local error ({len(result.replayed)} of "
                f"{len(result.replayed) + skipped} sites replayed; {skipped} skipped)")
    elif result.outcome == ReplayOutcome.PASS:
        head = ("PASS  no layer has a local error: each is within tolerance on the reference's "
                "inputs")
    elif result.outcome == ReplayOutcome.CANNOT_JUDGE:
        head = (f"CANNOT JUDGE  {len(unjudged)} layer(s) could not be called: "
                + ", ".join(site for site, _ in unjudged[:6])
                + "; no other layer has a local error")
    else:
        sites = ", ".join(dict.fromkeys(f"{r.port_site} ({r['pass']})" for _, r in
                                        local.iterrows()))
        head = f"FAIL  local error in {len(local)} site(s): {sites}"
    lines = textwrap.wrap(head, width, subsequent_indent=" " * 6)
    if result.origin is not None:
        lines += _origin_details(result.origin, width)
    lines += ["", f"replayed {len(result.replayed)} sites of {result.diff.reference}"]
    lines += [line for note in result.notes
              for line in textwrap.wrap(note, width, initial_indent="  ", subsequent_indent="    ",
                                        break_on_hyphens=False)]
    dropped = [(site, ", ".join(f"{arg} ({why})" for arg, why in args))
               for site, args in result.dropped.items()]
    for label, entries in (("cannot judge", unjudged), ("skipped", result.skipped),
                           ("not taken by the port at", dropped)):
        for site, why in entries[: None if verbose else 5]:
            lines += _reason(f"{label} {site}: {why}", width)
        if not verbose and len(entries) > 5:
            lines.append(f"  ... {len(entries) - 5} more {label} (--verbose)")
    shown = table if verbose else table[table["verdict"] != "within"]
    if not shown.empty:
        lines += ["", "local = error on the reference's own inputs; propagated = error in the "
                      "port's own run (x tolerance)"]
        fixed = sum(w for _, w, _ in REPLAY_COLUMNS) + len(REPLAY_COLUMNS) - 1
        widths = [(c, w or max(16, width - fixed), a) for c, w, a in REPLAY_COLUMNS]
        lines.append(_row(widths, {c: c for c, _, _ in REPLAY_COLUMNS}))
        for _, row in shown.head(None if verbose else MAX_SITES).iterrows():
            lines.append(_row(widths, {
                "pass": "fwd" if row["pass"] == Pass.FORWARD else "bwd", "site": row["port_site"],
                "local": number(row["local"], 3), "propagated": number(row["propagated"], 3),
                "amplif.": number(row["amplification"], 3), "verdict": row["verdict"]}))
    return "\n".join(lines)


@printable
def format_swap(result, width: int = WIDTH) -> str:
    """A swap: verdict, losses per step, and the worst of what was compared."""
    verdict = {"within": "WITHIN", "breaks": "BREAKS", "cannot-judge": "CANNOT JUDGE"}[
        str(result.outcome)]
    lines = textwrap.wrap(f"{verdict}  {result.describe()}", width,
                          subsequent_indent=" " * (len(verdict) + 2))
    for ref, port in result.swapped:
        lines.append(clip_middle(f"  swapped: reference {ref} <- port {port}", width))
    for layer, dropped in result.dropped.items():
        said = ", ".join(f"{arg} ({why})" for arg, why in dropped)
        lines += _reason(f"not taken by the swapped-in layer at {layer}: {said}", width)
    if result.routing:
        lines += _reason(f"--force-routing (the reference's routes): {result.routing}", width)
    if result.losses:
        lines += ["", "step  reference loss   swapped loss"]
        for step, (a, b) in enumerate(result.losses):
            lines.append(f"{step:>4}  {a:>14.7g}  {b:>13.7g}")
    def largest(rows: list) -> list:
        return sorted(rows, key=lambda r: -(r.ratio if r.ratio == r.ratio else math.inf))

    # what the verdict rests on first; the weights after the steps only after it, and only when
    # they moved: a pass must not open with numbers nobody judged
    judged = largest([row for row in result.rows if row.judged])
    if judged and all(row.ratio == 0 for row in judged):
        lines += ["", f"every judged record ({len(judged)}: loss, outputs, weight gradients) "
                      "is identical to the reference's"]
    elif judged:
        lines += ["", "largest differences (x tolerance):"]
        lines += [clip_middle(f"  {number(row.ratio, 3):>9}  {row.what}", width)
                  for row in judged[:8]]
    moved = [row for row in largest([row for row in result.rows if not row.judged])
             if row.ratio != 0][:3]
    if moved:
        lines += ["", "weights after the steps (reported, not judged: the steps amplify what "
                      "the gradients carry):"]
        lines += [clip_middle(f"  {number(row.ratio, 3):>9}  {row.what}", width) for row in moved]
    return "\n".join(lines)


def format_probe(number: int, probe, width: int = WIDTH) -> str:
    """One bisect probe as it runs: its number, outcome and layers, and, when it could not be
    judged, why, on the line under it (each clipped to the width)."""
    line = f"probe {number:>3}  {probe.outcome:<12}  {', '.join(probe.swapped)}"
    lines = [line if len(line) <= width else line[:width - 4] + " ..."]
    if probe.why:
        why = f"           {probe.why}"
        lines.append(why if len(why) <= width else why[:width - 4] + " ...")
    return "\n".join(lines)


@printable
def format_bisect(result, width: int = WIDTH) -> str:
    """A bisection's conclusion, the layers it could not judge (apart: never culprits), and
    whether the search was complete."""
    outcome = str(result.outcome)
    if outcome == "culprits":
        names = ", ".join(port for _, port in result.culprits)
        text = (f"culprits: {names} ({len(result.probes)} probes over "
                f"{len(result.candidates)} {result.searched})")
    elif outcome == "nothing-to-find":
        text = (f"nothing to find: with all {len(result.candidates)} paired port layers "
                "swapped in, the reference stays within tolerance")
    elif result.reproduced:
        text = ("cannot conclude: the whole port swapped in breaks the reference, but no "
                "smaller set of the layers that could be judged does")
    else:
        text = ("cannot conclude: some of the port's layers could not be judged (below), and "
                "no set of the others swapped in breaks the reference")
    lines = textwrap.wrap(text, width, subsequent_indent="  ")
    if result.cannot_judge:
        lines += ["", "cannot judge (never a culprit):"]
    for entry in result.cannot_judge:
        names = " + ".join(entry.layers)
        covered = (f" [judged inside {entry.covered_by}]" if entry.covered_by else "")
        lines += _reason(f"{names}{covered}: {entry.why}", width)
    if result.cannot_judge:
        uncovered = [" + ".join(e.layers) for e in result.cannot_judge if not e.covered_by]
        lines += ["", *textwrap.wrap(
            "search complete: each layer that could not be judged is inside a container "
            "judged in its place" if not uncovered else
            f"search incomplete: {', '.join(uncovered)} could not be judged, alone or inside "
            "a container judged in its place", width, subsequent_indent="  ")]
    return "\n".join(lines)


def _reason(text: str, width: int) -> list[str]:
    """A why, whole: it says what to do, so it is wrapped, not clipped."""
    return textwrap.wrap(text, width, initial_indent="  ", subsequent_indent="    ",
                         break_on_hyphens=False)
