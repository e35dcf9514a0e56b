"""``bisect``: the smallest set of port layers whose swap into the reference breaks it.

First the whole port goes in (every paired layer, outermost first). When that stays within
tolerance there is nothing to find. Otherwise the search runs over the port's leaf layers
and, when the leaves alone do not break the reference, over its containers: a bug in a
container's own code (an attention's scaling around its projections) breaks no leaf.

Halves are swapped in turn: a half that breaks the reference alone holds a culprit; when
neither half does, the culprits interact, and each half is searched with the other swapped
in. After a culprit is found, the rest is probed once: if it still breaks, it holds another
culprit (independent culprits are each found). About log2(n) probes for one culprit.

A layer that cannot be called (:class:`~layerdiff.replay.adapters.LayerCallError`) is set
aside with its reason, and the probe runs again without it. Such a layer was never tried, so a
search that set one aside cannot conclude that there is nothing to find.
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

    @property
    def breaks(self) -> bool:
        return self.outcome == SwapOutcome.BREAKS


@dataclass
class BisectResult:
    candidates: list[str]   # reference modules searched, in execution order
    culprits: list[tuple[str, str]] = field(default_factory=list)  # (reference, port)
    probes: list[Probe] = field(default_factory=list)
    reproduced: bool = True  # the whole port swapped in breaks the reference
    not_swapped: list[tuple[str, str]] = field(default_factory=list)  # (port layer, why)
    searched: str = "leaves"  # leaves | containers | all

    @property
    def outcome(self) -> BisectOutcome:
        if self.culprits:
            return BisectOutcome.CULPRITS
        if not self.reproduced and not self.not_swapped:
            return BisectOutcome.NOTHING_TO_FIND
        return BisectOutcome.CANNOT_CONCLUDE

    def __bool__(self) -> bool:
        """True when the whole port swapped in stays within tolerance (nothing to find)."""
        return self.outcome == BisectOutcome.NOTHING_TO_FIND

    def as_json(self) -> dict[str, Any]:
        return {"outcome": str(self.outcome), "reproduced": self.reproduced,
                "searched": self.searched,
                "culprits": [{"reference": r, "port": p} for r, p in self.culprits],
                "not_swapped": [{"port": p, "why": why} for p, why in self.not_swapped],
                "candidates": self.candidates,
                "probes": [{"swapped": p.swapped, "outcome": str(p.outcome),
                            "breaks": p.breaks, "summary": p.summary} for p in self.probes]}


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
    result = BisectResult(everything, probes=search.probes, not_swapped=search.set_aside)
    if not search.breaks(everything):
        result.reproduced = False
        return result
    if granularity == "all":
        stages = [("all", everything)]
    else:
        stages = [("leaves", swapper.leaves())]
        if granularity == "auto":
            stages.append(("containers", swapper.containers()))
    for name, candidates in stages:
        found = search.culprits(candidates)
        if found:
            order = {m: i for i, m in enumerate(candidates)}
            result.candidates, result.searched = candidates, name
            result.culprits = [(m, swapper.pairs[m][0])
                               for m in sorted(found, key=order.__getitem__)]
            break
    return result


class _Search:
    """The probes of one bisection, and the layers set aside because they cannot be called."""

    def __init__(self, swapper: Swapper, on_probe: Callable[[int, Probe], None] | None) -> None:
        self.swapper = swapper
        self.on_probe = on_probe
        self.probes: list[Probe] = []
        self.set_aside: list[tuple[str, str]] = []  # (port layer, why)
        self._aside: set[str] = set()               # their reference names
        self._known: dict[frozenset[str], bool] = {}  # the same set is not run twice

    def breaks(self, modules: Sequence[str]) -> bool:
        """Does swapping ``modules`` in break the reference? Layers that cannot be called are
        set aside and the probe runs again without them (a container set aside lets its
        children in)."""
        while True:
            modules = [m for m in modules if m not in self._aside]
            if not modules:
                return False
            if frozenset(modules) in self._known:
                return self._known[frozenset(modules)]
            outcome = self.swapper.run(modules)
            probe = Probe([self.swapper.pairs[m][0] for m in modules], outcome.outcome,
                          outcome.describe())
            self.probes.append(probe)
            if self.on_probe is not None:
                self.on_probe(len(self.probes), probe)
            if outcome.outcome != SwapOutcome.CANNOT_JUDGE:
                self._known[frozenset(modules)] = outcome.breaks
                return outcome.breaks
            for layer, why in outcome.not_swapped:
                self.set_aside.append((layer, why))
                self._aside.add(self.swapper.resolve(layer))

    def culprits(self, candidates: list[str]) -> list[str]:
        """The culprits among ``candidates``, or [] when swapping all of them does not break
        the reference."""
        candidates = [m for m in candidates if m not in self._aside]
        if not candidates or not self.breaks(candidates):
            return []
        found = self._innermost(self._halve(candidates, []), candidates)
        while True:  # the rest: neither a culprit nor inside or around one (the same bug)
            rest = [m for m in candidates if m not in self._aside
                    and not any(_related(m, f) for f in found)]
            if not rest or not self.breaks(rest):
                return found
            found += self._innermost(self._halve(rest, []), candidates)

    def _halve(self, items: list[str], base: list[str]) -> list[str]:
        items = [m for m in items if m not in self._aside]
        if len(items) <= 1:
            return items
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


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
