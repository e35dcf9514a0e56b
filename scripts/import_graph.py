"""The package's import graph, from the code's own imports (module level and inside functions):
how many modules and arrows, the arrows between the parts of docs' layering, every arrow that
runs from a lower part to a higher one, and every cycle of modules.

    python scripts/import_graph.py            # the numbers and the offending arrows
    python scripts/import_graph.py --parts    # and the arrows between parts, counted

tests/test_layers.py holds the same layering as a test.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "layerdiff"

# Parts from the ground up: a part may import its own and lower parts only. One line, one
# floor; the parts on one floor do not import each other.
LAYERS: list[tuple[str, ...]] = [
    ("errors", "progress", "callable_module", "rng", "bundled"),
    ("framework",),
    ("case", "signature", "config_file"),
    ("mapping",),
    ("trace",),
    ("weights", "outputs", "options"),
    ("capture",),
    ("compare", "monitor"),
    ("replay", "debug", "ci"),
    ("flax",),
    ("frameworks",),
    ("mapsuggest", "health"),
    ("report",),
    ("show", "demo", "pytest_plugin"),
    ("cli",),
    ("__main__", "__init__"),
]
FLOOR = {part: floor for floor, parts in enumerate(LAYERS) for part in parts}


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / PACKAGE).rglob("*.py"))}


def imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The package's modules that ``path`` imports (``from pkg import sub`` names the sub)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                found.add(sub if sub in known else base)
    return {m for m in found if m in known and m != name}


def part(module: str) -> str:
    pieces = module.split(".")
    return pieces[1] if len(pieces) > 1 else "__init__"


def graph() -> dict[str, set[str]]:
    found = modules()
    return {name: imports(path, name, set(found)) for name, path in found.items()}


def upward(edges: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Arrows into a higher part, or across parts of one floor."""
    wrong = []
    for source, targets in edges.items():
        for target in targets:
            a, b = part(source), part(target)
            if a != b and (a not in FLOOR or b not in FLOOR or FLOOR[b] >= FLOOR[a]):
                wrong.append((source, target))
    return sorted(wrong)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = 0
    for start in edges:
        if start in index:
            continue
        work = [(start, iter(sorted(edges[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter
                counter += 1
                stack.append(child)
                on.add(child)
                work.append((child, iter(sorted(edges[child]))))
            elif child in on:
                low[node] = min(low[node], index[child])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", action="store_true", help="count the arrows between parts")
    args = parser.parse_args()
    edges = graph()
    between = Counter((part(s), part(t)) for s, ts in edges.items() for t in ts
                      if part(s) != part(t))
    wrong, loops = upward(edges), cycles(edges)
    print(f"modules {len(edges)}, arrows {sum(map(len, edges.values()))}, "
          f"arrows between parts {sum(between.values())} ({len(between)} pairs of parts), "
          f"upward {len(wrong)}, cycles {len(loops)}")
    for source, target in wrong:
        print(f"  upward: {source} -> {target}")
    for loop in loops:
        print(f"  cycle: {' <-> '.join(loop)}")
    if args.parts:
        for (a, b), n in sorted(between.items()):
            print(f"  {a} -> {b}: {n}")
    return 1 if wrong or loops else 0


if __name__ == "__main__":
    sys.exit(main())
