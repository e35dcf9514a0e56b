"""Pairing the two sides' calls: a fit score from type, shapes, place, output and name; an
order-keeping alignment; pairs by call structure."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import numpy as np

from layerdiff.mapsuggest.calls import _Call, _ordinal
from layerdiff.mapsuggest.names import _LEAF_KINDS, _similar_words, name_similarity

PAIR_SCORE = 3.0        # the least score a call pair needs from type, shapes, output and name


def _shape_text(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + (",)" if len(shape) == 1 else ")")


def _score(ref: _Call, port: _Call) -> tuple[float, list[str]] | None:
    """How well two calls fit, with the evidence; None where they cannot be one layer."""
    score, evidence = 0.0, []
    if ref.kind == port.kind and ref.kind != "other":
        score += 2 + (ref.type == port.type)
        evidence.append(f"type {ref.type}" if ref.type == port.type else
                        f"type {ref.type}~{port.type} ({ref.kind})")
    elif ref.kind in _LEAF_KINDS and port.kind in _LEAF_KINDS:
        return None
    elif ref.type == port.type:
        score += 2
        evidence.append(f"type {ref.type}")
    ref_shapes = sorted(ref.params.values())
    port_shapes = sorted(port.params.values())
    if ref_shapes and port_shapes:
        if ref_shapes == port_shapes:
            score += 4
            evidence.append("shape " + ", ".join(_shape_text(s) for s in ref_shapes))
        elif sorted(tuple(reversed(s)) for s in ref_shapes) == port_shapes:
            score += 3
            evidence.append("shapes transposed")
        else:
            return None
    elif ref_shapes or port_shapes:
        score -= 1
    if ref.output is not None and port.output is not None:
        if ref.output == port.output:
            score += 1
            evidence.append(f"output {_shape_text(ref.output)}")
        else:
            score -= 1
    if ref.parent and port.parent and (ref.nth, ref.siblings) == (port.nth, port.siblings):
        score += 0.5
        evidence.append(f"{_ordinal(ref.nth + 1)} of {ref.siblings} calls in its caller")
    similarity = name_similarity(ref.module, port.module)
    if similarity > 0:
        score += 3 * similarity
        evidence.append(_similar_words(ref.module, port.module))
    return score, evidence


@dataclass
class _Pair:
    ref: _Call
    port: _Call
    confidence: float
    evidence: list[str]


def _align(refs: list[_Call], ports: list[_Call]) -> dict[str, _Pair]:
    """The order-keeping pairing of the two call sequences with the largest total score."""
    n, m = len(refs), len(ports)
    scores: dict[tuple[int, int], tuple[float, list[str]]] = {}
    for i, ref in enumerate(refs):
        for j, port in enumerate(ports):
            found = _score(ref, port)
            if found is not None and found[0] >= PAIR_SCORE:
                scores[i, j] = found
    best = np.zeros((n + 1, m + 1))
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            value = max(best[i - 1, j], best[i, j - 1])
            if (i - 1, j - 1) in scores:
                value = max(value, best[i - 1, j - 1] + scores[i - 1, j - 1][0])
            best[i, j] = value
    pairs: dict[str, _Pair] = {}
    i, j = n, m
    while i and j:
        here = scores.get((i - 1, j - 1))
        if here is not None and best[i, j] == best[i - 1, j - 1] + here[0]:
            ref, port = refs[i - 1], ports[j - 1]
            pairs[ref.site] = _Pair(ref, port, min(1.0, here[0] / 10), list(here[1]))
            i, j = i - 1, j - 1
        elif best[i, j] == best[i - 1, j]:
            i -= 1
        else:
            j -= 1
    return pairs


def _pair_by_structure(refs: list[_Call], ports: list[_Call], pairs: dict[str, _Pair]) -> None:
    """A call left unpaired pairs with the port call that holds the partners of its children
    (their lowest common caller), when that call is unpaired too."""
    port_by_site = {c.site: c for c in ports}
    taken = {p.port.site for p in pairs.values()}
    children: dict[str, list[str]] = defaultdict(list)
    for call in refs:
        children[call.parent].append(call.site)
    for ref in reversed(refs):
        if ref.site in pairs:
            continue
        images = [pairs[c].port.site for c in _descendants(ref.site, children) if c in pairs]
        if not images:
            continue
        common = _common_caller(images, port_by_site)
        if common is None or common in taken:
            continue
        port = port_by_site[common]
        if ref.kind in _LEAF_KINDS and port.kind in _LEAF_KINDS and ref.kind != port.kind:
            continue
        evidence = [f"calls the partners of {len(images)} of its calls"]
        found = _score(ref, port)
        if found is not None:
            evidence += found[1]
        pairs[ref.site] = _Pair(ref, port, 0.6, evidence)
        taken.add(common)


def _confirm_by_structure(refs: list[_Call], ports: list[_Call],
                          pairs: dict[str, _Pair]) -> None:
    """A pair of callers whose callees' partners all lie inside the port caller is sure of
    itself; one where some lie elsewhere is not."""
    port_by_site = {c.site: c for c in ports}
    children: dict[str, list[str]] = defaultdict(list)
    for call in refs:
        children[call.parent].append(call.site)
    for pair in pairs.values():
        inner = [pairs[c].port.site for c in _descendants(pair.ref.site, children) if c in pairs]
        if not inner or not pair.ref.parent:
            continue
        inside = sum(pair.port.site in _callers(site, port_by_site) for site in inner)
        if inside == len(inner):
            if pair.confidence < 0.7:
                pair.evidence.append(f"holds the partners of its {len(inner)} paired calls")
            pair.confidence = max(pair.confidence, 0.7)
        else:
            pair.confidence = min(pair.confidence, 0.4)
            pair.evidence.append(f"UNSURE: {len(inner) - inside} of the partners of its "
                                 f"{len(inner)} paired calls lie outside {pair.port.site}")


def _callers(site: str, calls: dict[str, _Call]) -> set[str]:
    out = set()
    while site in calls and calls[site].parent:
        site = calls[site].parent
        out.add(site)
    return out


def _descendants(site: str, children: dict[str, list[str]]) -> list[str]:
    out, todo = [], list(children.get(site, []))
    while todo:
        site = todo.pop()
        out.append(site)
        todo += children.get(site, [])
    return out


def _common_caller(sites: list[str], calls: dict[str, _Call]) -> str | None:
    def chain(site: str) -> list[str]:
        out = []
        while site:
            out.append(site)
            site = calls[site].parent if site in calls else ""
        return out[::-1]

    chains = [chain(s) for s in sites]
    common = None
    for level in zip(*chains, strict=False):  # up to the shortest chain
        if len(set(level)) != 1:
            break
        common = level[0]
    return common


def _fill_out_of_order(refs: list[_Call], ports: list[_Call], pairs: dict[str, _Pair]) -> None:
    """Calls the order-keeping alignment left out (a port that computes k before q) pair with
    the one unpaired port call under the same paired caller that fits best."""
    taken = {p.port.site for p in pairs.values()}
    for ref in refs:
        if ref.site in pairs or ref.parent not in pairs:
            continue
        caller = pairs[ref.parent].port.site
        found = [(s, port) for port in ports if port.parent == caller
                 and port.site not in taken
                 and (s := _score(ref, port)) is not None and s[0] >= PAIR_SCORE]
        if not found:
            continue
        found.sort(key=lambda f: -f[0][0])
        (score, evidence), port = found[0]
        close = len(found) > 1 and found[1][0][0] >= score - 0.5
        pairs[ref.site] = _Pair(ref, port, 0.3 if close else 0.55,
                                [*evidence, "out of call order"])
        taken.add(port.site)
