"""``bisect``: the smallest set of port layers whose swap into the reference breaks it.

First the whole port goes in (every paired layer, outermost first). When that stays within
tolerance there is nothing to find. Otherwise the search runs over the port's leaf layers
and, when the leaves alone do not break the reference, over its containers: a bug in a
container's own code (an attention's scaling around its projections) breaks no leaf.

Halves are swapped in turn: a half that breaks the reference alone holds a culprit; when
neither half does, the culprits interact, and each half is searched with the other swapped
in. After a culprit is found, the rest is probed once: if it still breaks, it holds another
culprit (independent culprits are each found). About log2(n) probes for one culprit.

A probe may not be judgeable: a swapped layer cannot be called, lacks an attribute the
reference's code reads of it, or the run raises. Such a probe is unknown, never a break:
- a layer the error names (or the only layer in the probe) *cannot be judged*: it is set aside
  with its reason (one line) and the probe runs again without it;
- a set whose run raised naming none of its layers is unjudgeable as a set: the layers that
  returned fewer outputs than their caller takes (None stood for the rest) are tried alone
  first; else it is split, each half probed, so the members that raise on their own are set
  aside, and the rest runs again;
  a set that raises only whole (each half runs) stays unknown, and the search is incomplete.
A layer set aside is never a culprit. A leaf that cannot be judged does not stop the search:
the containers are then searched too (those around a culprit already found excepted), and the
container swapped whole stands in for it: when that container is judged within tolerance, or
is itself a culprit, the leaf is covered. The search is *complete* when every layer set aside
is covered; only a complete search can conclude that there is nothing to find.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from layerdiff.errors import DiffError
from layerdiff.replay.swap import SwapOutcome, Swapper

GRANULARITIES = ("auto", "leaves", "all")


class BisectOutcome(StrEnum):
    CULPRITS = "culprits"                # the smallest breaking sets were found
    NOTHING_TO_FIND = "nothing-to-find"  # the whole port swapped in stays within tolerance
    CANNOT_CONCLUDE = "cannot-conclude"  # layers were set aside untried, or none was found


@dataclass
class Probe:
    swapped: list[str]      # port module names
    outcome: SwapOutcome
    summary: str
    reference: list[str] = field(default_factory=list)  # the reference modules replaced
    why: str = ""           # cannot judge: the reason, in one line

    @property
    def breaks(self) -> bool:
        return self.outcome == SwapOutcome.BREAKS


@dataclass
class CannotJudge:
    """Port layers bisect could not judge: one layer set aside, or a set whose run raised only
    whole. ``covered_by``: the container judged in their place (within tolerance, or itself a
    culprit), or "" when none was."""

    layers: list[str]       # port module names
    why: str                # one line: the exception, or why the layer cannot be called
    reference: list[str] = field(default_factory=list)
    covered_by: str = ""

    def as_json(self) -> dict[str, Any]:
        return {"port": self.layers, "why": self.why, "covered_by": self.covered_by or None}


@dataclass
class BisectResult:
    candidates: list[str]   # reference modules searched, in execution order
    culprits: list[tuple[str, str]] = field(default_factory=list)  # (reference, port)
    probes: list[Probe] = field(default_factory=list)
    reproduced: bool = True  # the whole port swapped in breaks the reference
    cannot_judge: list[CannotJudge] = field(default_factory=list)  # never culprits
    searched: str = "leaves"  # leaves | containers | leaves and containers | all

    @property
    def not_swapped(self) -> list[tuple[str, str]]:
        """(port layer, why) of each layer or set that could not be judged."""
        return [(" + ".join(c.layers), c.why) for c in self.cannot_judge]

    @property
    def complete(self) -> bool:
        """Every layer was judged, alone or inside a container judged in its place."""
        return all(c.covered_by for c in self.cannot_judge)

    @property
    def outcome(self) -> BisectOutcome:
        if self.culprits:
            return BisectOutcome.CULPRITS
        if not self.reproduced and self.complete:
            return BisectOutcome.NOTHING_TO_FIND
        return BisectOutcome.CANNOT_CONCLUDE

    def __bool__(self) -> bool:
        """True when the whole port swapped in stays within tolerance (nothing to find)."""
        return self.outcome == BisectOutcome.NOTHING_TO_FIND

    def as_json(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "reproduced": self.reproduced,
                "searched": self.searched, "complete": self.complete,
                "culprits": [{"reference": r, "port": p} for r, p in self.culprits],
                "cannot_judge": [c.as_json() for c in self.cannot_judge],
                "not_swapped": [{"port": p, "why": why} for p, why in self.not_swapped],
                "candidates": self.candidates,
                "probes": [{"swapped": p.swapped, "outcome": str(p.outcome),
                            "breaks": p.breaks, "summary": p.summary, "why": p.why or None}
                           for p in self.probes]}


def bisect(swapper: Swapper, *, granularity: str = "auto",
           on_probe: Callable[[int, Probe], None] | None = None) -> BisectResult:
    """Search ``swapper``'s port layers for the culprits; ``on_probe`` sees each probe.
    ``granularity``: "auto" (leaves, then containers), "leaves", or "all" (every paired
    layer at once)."""
    if granularity not in GRANULARITIES:
        raise DiffError(f"--granularity {granularity!r} is not one of "
                        f"{', '.join(GRANULARITIES)}")
    everything = [m for m in swapper.execution_order() if m in swapper.pairs]
    if not everything:
        raise DiffError("no layer of the port pairs with a layer of the reference; give a "
                        "mapping file (--map)")
    search = _Search(swapper, on_probe)
    # layers the port holds only inside a module of several (a scanned stack): never searched,
    # so never "nothing to find" while they are unjudged
    search.cannot_judge += [CannotJudge([port], why, [module])
                            for module, (port, why) in swapper.unswappable.items()]
    result = BisectResult(everything, probes=search.probes, cannot_judge=search.cannot_judge)
    whole = search.breaks(everything)
    result.reproduced = whole is True
    if whole is False:
        search.cover([])
        return result
    if granularity == "all":
        stages = [("all", everything)]
    else:
        stages = [("leaves", swapper.leaves())]
        if granularity == "auto":
            stages.append(("containers", swapper.containers()))
    found: list[str] = []
    ran, finding = [], []  # the stages run, and those that found culprits
    for name, candidates in stages:
        if name == "containers":
            # searched when the leaves found nothing, or some leaf could not be judged: the
            # container around it is judged in its place (none around a culprit found)
            if found and not search.cannot_judge:
                break
            candidates = [m for m in candidates if not any(_related(m, f) for f in found)]
        new = search.culprits(candidates)
        found += new
        ran.append((name, candidates))
        if new:
            finding.append((name, candidates))
    stages_said = finding or ran
    result.searched = " and ".join(name for name, _ in stages_said)
    result.candidates = [m for _, candidates in stages_said for m in candidates]
    order = {m: i for i, m in enumerate(everything)}
    result.culprits = [(m, swapper.pairs[m][0]) for m in sorted(found, key=order.__getitem__)]
    search.cover(found)
    return result


class _Search:
    """The probes of one bisection, and the layers it could not judge."""

    def __init__(self, swapper: Swapper, on_probe: Callable[[int, Probe], None] | None) -> None:
        self.swapper = swapper
        self.on_probe = on_probe
        self.probes: list[Probe] = []
        self.cannot_judge: list[CannotJudge] = []
        self._aside: set[str] = set()               # reference names of the layers set aside
        # the same set is not run twice; None: it raised, naming none of its layers
        self._known: dict[frozenset[str], bool | None] = {}

    def breaks(self, modules: Sequence[str]) -> bool | None:
        """Does swapping ``modules`` in break the reference? None: unknown (the set raises
        only whole). A layer that cannot be judged is set aside and the probe runs again
        without it (a container set aside lets its children in); a set whose run raised,
        naming none of its layers, is split to find the members that raise on their own."""
        while True:
            modules = [m for m in modules if m not in self._aside]
            if not modules:
                return False
            key = frozenset(_outermost(modules))  # what is swapped in: the outer layers
            if key in self._known:
                return self._known[key]
            outcome = self.swapper.run(modules)
            self._record(modules, outcome)
            if outcome.outcome != SwapOutcome.CANNOT_JUDGE:
                self._known[key] = outcome.breaks
                return outcome.breaks
            if outcome.not_swapped:
                for layer, why in outcome.not_swapped:
                    self._set_aside([self.swapper.resolve(layer)], why)
                continue
            # a set with a member that cannot be judged cannot be judged as a set: the layers
            # that returned fewer outputs than the caller takes are tried alone first, then
            # the set is split
            self._known[key] = None
            before = len(self._aside)
            for layer in outcome.suspects:
                module = self.swapper.resolve(layer)
                if module in modules and module not in self._aside:
                    self.breaks([module])
            if len(self._aside) > before:
                continue
            outer = _outermost(modules)
            if len(outer) == 1:  # (a swapper names the one layer itself; this one did not)
                self._set_aside(outer, outcome.raised)
                continue
            half = len(outer) // 2
            self.breaks(outer[:half])
            self.breaks(outer[half:])
            if len(self._aside) == before:  # each half runs: the set raises only whole
                self._set_aside(outer, outcome.raised, aside=False)
                return None

    def _record(self, modules: list[str], outcome: Any) -> None:
        swapped = [m for m, _ in outcome.swapped]
        why = outcome.raised or "; ".join(f"{layer}: {reason}"
                                          for layer, reason in outcome.not_swapped)
        probe = Probe([self.swapper.pairs[m][0] for m in swapped], outcome.outcome,
                      outcome.describe(), swapped, why)
        self.probes.append(probe)
        if self.on_probe is not None:
            self.on_probe(len(self.probes), probe)

    def _set_aside(self, modules: list[str], why: str, *, aside: bool = True) -> None:
        self.cannot_judge.append(CannotJudge([self.swapper.pairs[m][0] for m in modules], why,
                                             list(modules)))
        if aside:
            self._aside.update(modules)

    def cover(self, culprits: list[str]) -> None:
        """Each layer that could not be judged is covered by the innermost container around
        it that was judged in a probe within tolerance, or that is a culprit. Of the sets that
        raised only whole, the smallest are kept (a set holding one of them says no more)."""
        sets = [frozenset(c.reference) for c in self.cannot_judge]
        self.cannot_judge[:] = [c for c, mine in zip(self.cannot_judge, sets, strict=True)
                                if not any(other < mine for other in sets)]
        within = {m for p in self.probes if p.outcome == SwapOutcome.WITHIN for m in p.reference}
        judged = within | set(culprits)
        for entry in self.cannot_judge:
            around = [m for m in judged if all(r.startswith(m + ".") for r in entry.reference)]
            if around:
                inner = max(around, key=len)
                entry.covered_by = self.swapper.pairs[inner][0]

    def culprits(self, candidates: list[str]) -> list[str]:
        """The culprits among ``candidates``, or [] when swapping all of them does not break
        the reference."""
        candidates = [m for m in candidates if m not in self._aside]
        # unknown (the set raises only whole) is searched: its parts may be judged
        if not candidates or self.breaks(candidates) is False:
            return []
        found = self._innermost(self._halve(candidates, []), candidates)
        while True:  # the rest: neither a culprit nor inside or around one (the same bug)
            rest = [m for m in candidates if m not in self._aside
                    and not any(_related(m, f) for f in found)]
            if not rest or self.breaks(rest) is False:
                return found
            more = self._innermost(self._halve(rest, []), candidates)
            if not more:  # unknown, and no part of it breaks alone
                return found
            found += more

    def _halve(self, items: list[str], base: list[str]) -> list[str]:
        items = [m for m in items if m not in self._aside]
        if len(items) <= 1:  # a culprit only when judged breaking (cached: its parent's set)
            return items if items and self.breaks(base + items) is True else []
        half = len(items) // 2
        first, second = items[:half], items[half:]
        if self.breaks(base + first):
            return self._halve(first, base)
        if self.breaks(base + second):
            return self._halve(second, base)
        found = self._halve(first, base + second)  # they break only together
        return found + self._halve(second, base + found)

    def _innermost(self, found: list[str], candidates: list[str]) -> list[str]:
        """A container culprit whose own children break the reference gives way to them."""
        result = []
        for culprit in found:
            inside = [m for m in candidates if m.startswith(culprit + ".")]
            result += (self._innermost(self._halve(inside, []), candidates)
                       if inside and self.breaks(inside) else [culprit])
        return result


def _outermost(modules: Sequence[str]) -> list[str]:
    """Of nested modules the outer ones, in the given order (a swap puts in those alone)."""
    return [m for m in modules if not any(m.startswith(o + ".") for o in modules if o != m)]


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
