"""``bisect``: the smallest set of port layers whose swap into the reference breaks it.

Candidates are the port's leaf layers that have a reference partner, in execution order.
Halves are swapped in turn: a half that breaks the reference alone holds a culprit; when
neither half does, the culprits interact, and each half is searched with the other swapped
in. After a culprit is found, the rest is probed once: if it still breaks, it holds another
culprit (independent culprits are each found). About log2(n) probes for one culprit.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from layerdiff.errors import DiffError
from layerdiff.replay.swap import Swapper, SwapResult

GRANULARITIES = ("leaves", "all")


@dataclass
class Probe:
    swapped: list[str]      # port module names
    breaks: bool
    summary: str


@dataclass
class BisectResult:
    candidates: list[str]   # reference modules, in execution order
    culprits: list[tuple[str, str]] = field(default_factory=list)  # (reference, port)
    probes: list[Probe] = field(default_factory=list)
    reproduced: bool = True

    def as_json(self) -> dict[str, Any]:
        return {"reproduced": self.reproduced,
                "culprits": [{"reference": r, "port": p} for r, p in self.culprits],
                "candidates": self.candidates,
                "probes": [{"swapped": p.swapped, "breaks": p.breaks, "summary": p.summary}
                           for p in self.probes]}


def bisect(swapper: Swapper, *, granularity: str = "leaves",
           on_probe: Callable[[int, Probe], None] | None = None) -> BisectResult:
    """Search ``swapper``'s port layers for the culprits; ``on_probe`` sees each probe."""
    if granularity not in GRANULARITIES:
        raise DiffError(f"--granularity {granularity!r} is not one of "
                        f"{', '.join(GRANULARITIES)}")
    if granularity == "leaves":
        candidates = swapper.leaves()
    else:
        candidates = [m for m in swapper.execution_order() if m in swapper.pairs]
    if not candidates:
        raise DiffError("no layer of the port pairs with a layer of the reference; give a "
                        "mapping file (--map)")
    result = BisectResult(candidates)

    def breaks(modules: Sequence[str]) -> bool:
        outcome: SwapResult = swapper.run(modules)
        probe = Probe([swapper.pairs[m][0] for m in modules], outcome.breaks, outcome.describe())
        result.probes.append(probe)
        if on_probe is not None:
            on_probe(len(result.probes), probe)
        return outcome.breaks

    def search(items: list[str], base: list[str]) -> list[str]:
        if len(items) == 1:
            return items
        half = len(items) // 2
        first, second = items[:half], items[half:]
        if breaks(base + first):
            return search(first, base)
        if breaks(base + second):
            return search(second, base)
        found = search(first, base + second)  # they break only together
        return found + search(second, base + found)

    if not breaks(candidates):
        result.reproduced = False
        return result
    def innermost(found: list[str]) -> list[str]:
        """A container culprit whose own children break the reference gives way to them."""
        result = []
        for culprit in found:
            inside = [m for m in candidates if m.startswith(culprit + ".")]
            result += innermost(search(inside, [])) if inside and breaks(inside) else [culprit]
        return result

    found = innermost(search(candidates, []))
    while True:  # the rest: neither a culprit nor inside or around one (the same bug)
        rest = [m for m in candidates if not any(_related(m, f) for f in found)]
        if not rest or not breaks(rest):
            break
        found += innermost(search(rest, []))
    order = {m: i for i, m in enumerate(candidates)}
    result.culprits = [(m, swapper.pairs[m][0]) for m in sorted(found, key=order.__getitem__)]
    return result


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b + ".") or b.startswith(a + ".")
