"""The text of the replay family's results: a mapping's dry run (map-check), and the
replay, swap and bisect text, which :mod:`layerdiff.report.terminal` writes."""

from __future__ import annotations

from layerdiff.mapping import TRANSFORMS
from layerdiff.replay.mapcheck import (
    MISMATCH_AROUND,
    NOT_CHECKED,
    OK,
    SUSPICIOUS,
    SUSPICIOUS_CONVERSION,
    MapCheck,
    MapEntry,
)
from layerdiff.report.text import WIDTH, clip, clip_left, wrap
from layerdiff.weights import NO_SOURCE, PORT_OWN, SHAPE_MISMATCH


def mapcheck_text(check: MapCheck, width: int = WIDTH) -> str:
    """A table (port tensor, from, transform, status) with the notes of what is wrong, the
    unused reference tensors, then the verdict."""
    lines = _table(check.entries, width)
    if check.unused_reference:
        lines += ["", *wrap(f"reference tensors nothing uses ({len(check.unused_reference)}): "
                            + ", ".join(check.unused_reference), width)]
    without = [entry.port for entry in check.entries if entry.status == NO_SOURCE]
    if without:
        names = ", ".join(without[:4]) + (" ..." if len(without) > 4 else "")
        lines += ["", *wrap(f"port tensors no reference tensor gives ({len(without)}): {names}. "
                            "Either the mapping lacks their rule, or the port itself has a "
                            "parameter the reference's layer does not (an extra bias or weight: "
                            "look at the port's code there), or a buffer it makes itself "
                            "(declare it with [[unmatched]] port = ...)", width)]
    lines += _unjudgeable(check, width)
    return "\n".join([*lines, "", mapcheck_verdict(check)])


def _unjudgeable(check: MapCheck, width: int) -> list[str]:
    """The paired sites whose own code a diff could not judge, each with what has no partner
    and the rule or adapter to write; or why the port's run that finds them did not tell."""
    if check.sites_unchecked and check.sites_unchecked != "not asked for":
        return ["", *wrap(f"sites a diff could not judge: not listed; {check.sites_unchecked}",
                          width)]
    if not check.cannot_judge:
        return []
    lines = ["", *wrap(f"sites a diff cannot judge, whatever the port computes "
                       f"({len(check.cannot_judge)}; not a failure, but a bug there would "
                       "show only as 'cannot judge'): write the rule or adapter named", width)]
    for site in check.cannot_judge:
        port = "" if site.port_site == site.site else f" (port {site.port_site})"
        passes = " and ".join(site.passes) or "an output not compared"
        lines += wrap(f"{site.site}{port}: {passes}", width, "  ", "    ")
        for why in site.why:
            lines += wrap(why, width, "    ", "      ")
    return lines


def mapcheck_verdict(check: MapCheck) -> str:
    """'PASS  12 port tensors, each with a source that fits; ...' or 'FAIL  of 12 ...'."""
    checked = sum(entry.errors is not None for entry in check.entries)
    if check.passed:
        text = (f"PASS  {len(check.entries) - check.count(PORT_OWN)} port tensors, each "
                "with a source that fits; "
                f"{checked} checked for a transpose")
        if check.count(NOT_CHECKED):
            text += f", {check.count(NOT_CHECKED)} could not be"
        converted = sum(entry.conversion is not None for entry in check.entries)
        if converted:
            text += f"; {converted} conversions checked"
        if check.count(PORT_OWN):
            text += f"; {check.count(PORT_OWN)} more kept as the port's own"
        text += _sites_said(check)
        return "\n      ".join(wrap(text, WIDTH - 6, "", ""))  # under the text after PASS
    problems = [f"{check.count(status)} {label}" for status, label in (
        (NO_SOURCE, "without a source"), (SHAPE_MISMATCH, "with a shape that does not fit"),
        (SUSPICIOUS, "likely transposed"),
        (SUSPICIOUS_CONVERSION, "worse with their conversion"),
        (MISMATCH_AROUND, "off in the module around them"))
        if check.count(status)]
    mapping = check.mapping or "the mapping (--map)"
    # a module off around tensors nothing else checks: the rule, or the port's own code
    advice = ("check their rules, or the port there"
              if len(check.failing()) == check.count(MISMATCH_AROUND) else f"fix {mapping}")
    if check.count(NO_SOURCE):
        # a port tensor nothing gives: the mapping may miss a rule, or the port may hold a
        # parameter the reference has not (an extra bias or weight); its note says which
        advice += ", or the port"
    text = clip(f"FAIL  of {len(check.entries)} port tensors: {', '.join(problems)}; "
                + advice, WIDTH)
    said = _sites_said(check)
    return text if not said else "\n      ".join([text, *wrap(said[2:], WIDTH - 6, "", "")])


def _sites_said(check: MapCheck) -> str:
    """'; 2 sites a diff cannot judge (listed above)' when there are some."""
    count = len(check.cannot_judge)
    return (f"; {count} site{'s' if count != 1 else ''} a diff cannot judge (listed above)"
            if count else "")


def _table(entries: list[MapEntry], width: int) -> list[str]:
    status_w = max([len("status"), *(len(e.status) for e in entries)])
    transform_w = min(24, max([len("transform"), *(len(_chain(e)) for e in entries)]))
    names = [_sources(e.reference) for e in entries]
    room = width - status_w - transform_w - 6
    from_w = min(max([4, *map(len, names)]), room // 2)
    port_w = min(max([len("port tensor"), *(len(e.port) for e in entries)]), room - from_w)
    from_w = min(max([4, *map(len, names)]), room - port_w)  # what the port column leaves
    lines = [f"{'port tensor':<{port_w}}  {'from':<{from_w}}  {'transform':<{transform_w}}  "
             "status", "-" * (port_w + from_w + transform_w + status_w + 6)]
    for entry, source in zip(entries, names, strict=True):
        if len(entry.reference) > 1 and len(source) > from_w:
            more = f" +{len(entry.reference) - 1}"
            source = clip_left(entry.reference[0], from_w - len(more)) + more
        lines.append(f"{clip_left(entry.port, port_w):<{port_w}}  "
                     f"{clip_left(source, from_w):<{from_w}}  "
                     f"{clip(_chain(entry), transform_w):<{transform_w}}  {entry.status}")
        if entry.note and (entry.status != OK or entry.conversion is not None):
            lines += wrap(entry.note, width, "    ", "    ")
    return lines


def _sources(names: list[str]) -> str:
    """Reference names with what they share said once: 'a.w_q.weight, w_k.weight'."""
    if len(names) < 2:
        return names[0] if names else ""
    parts = [name.split(".") for name in names]
    shared = 0
    while all(len(p) > shared + 1 and p[shared] == parts[0][shared] for p in parts):
        shared += 1
    return ", ".join([names[0], *(".".join(p[shared:]) for p in parts[1:])])


def _chain(entry: MapEntry) -> str:
    """The transform chain in a few characters: concat(1),transpose; a conversion function
    by its name, permute_rope() (the note and the JSON give its module and digest)."""
    return ",".join(f"{step}({entry.axis})" if step in ("concat", "split") and entry.axis
                    else step if step in TRANSFORMS else step.rpartition(":")[2] + "()"
                    for step in entry.transform)


__all__ = ["mapcheck_text", "mapcheck_verdict"]
