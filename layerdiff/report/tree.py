"""The HTML report's module tree: the reference's sites nested as they were called, each with
its worst error over tolerance, and the path from the model down to each origin open and lit.

It answers "where in the model does the error start" before any table is read. Plain
``<details>``/``<summary>`` elements do the folding: no script, nothing fetched. Every node
carries ``data-site``, ``data-kind`` (``module`` or ``op``), ``data-ratio`` (the worst ratio
shown, as Python's ``repr``) or ``data-unpaired`` when the site has no rows, and on the
highlighted path ``data-mark`` (``origin`` or ``path``): stable hooks for tests and scripts.
A line for sites left out to bound the page's size carries ``data-more`` (how many).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from html import escape

import numpy as np
import pandas as pd

from layerdiff.compare.judge import PASSING, Status
from layerdiff.compare.pair import PairReader
from layerdiff.compare.result import Column, Diff
from layerdiff.errors import LayerdiffError
from layerdiff.report.text import number
from layerdiff.trace.schema import ROOT_MODULE

# Nodes drawn at most. Past it the shallowest levels are drawn first and each parent's
# remaining children become one "N more sites" line carrying their worst ratio, so a
# 100-layer model with op sites still gives a page of a few hundred KiB.
MAX_NODES = 2000
# Subtrees deeper than this start folded, unless they lead to an origin.
OPEN_DEPTH = 2

TREE_CSS = """
.mt ul { list-style: none; margin: 0; padding-left: 20px; border-left: 1px solid var(--line); }
.mt > ul { padding-left: 0; border-left: 0; margin-top: 6px; }
.mt li { margin: 0; }
.mt details { margin: 0; }
.mt summary, .mt .row { padding: 1px 6px; border-radius: 4px; font-size: 13px; }
.mt summary { cursor: pointer; }
.mt .row { padding-left: 20px; }
.mt .n { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.mt .t { color: var(--muted); margin-left: 6px; }
.mt .r { margin-left: 6px; padding: 0 5px; border-radius: 3px; font-size: 12px;
         font-variant-numeric: tabular-nums; }
.mt .r.o { color: #fff; background: var(--fail); }
.mt .r.p { color: #fff; background: #ef8a17; }
.mt .r.w { color: var(--pass); background: #e6f4ea; }
.mt .u { margin-left: 6px; color: #8c959f; font-style: italic; font-size: 12px; }
.mt li[data-unpaired] > details > summary .n, .mt li[data-unpaired] > .row .n { color: #8c959f; }
.mt .op { margin-right: 4px; padding: 0 4px; border-radius: 3px; font-size: 11px;
          color: #3949ab; background: #e8eaf6; border: 1px solid #c5cae9; }
.mt li[data-kind=op] .n { color: #3949ab; }
.mt li[data-mark=path] > details > summary, .mt li[data-mark=path] > .row
  { background: #fdecea; }
.mt li[data-mark=origin] > details > summary, .mt li[data-mark=origin] > .row
  { background: #ffcdd2; font-weight: 600; box-shadow: inset 4px 0 0 #d62728; }
.mt .m { margin-left: 6px; padding: 0 5px; border-radius: 3px; font-size: 12px;
         color: #fff; background: #d62728; }
.mt .h { margin-left: 6px; font-size: 12px; color: #9467bd; }
.mt .more { color: var(--muted); font-style: italic; }
"""


@dataclass
class _Node:
    site: str
    type: str
    parent: str
    op: bool
    children: list[_Node] = field(default_factory=list)
    depth: int = 0


@dataclass
class _Score:
    """What the diff says of one site at the drawn step."""

    worst: float      # the largest ratio over its rows, NaN counted as inf
    state: str        # 'o' out of tolerance, 'p' out but each such row propagated, 'w' within


def module_tree_section(diff: Diff, reader: PairReader | None = None) -> str:
    """The module tree as an HTML section; "" when the reference trace lists no sites.
    ``reader``: the report's reader of the diff's traces (one is opened when not given)."""
    head = "<section class=\"mt\" id=\"module-tree\"><h2>Module tree</h2>"
    try:
        if reader is None:
            with PairReader.of(diff) as own:
                sites = own.ref.sites
        else:
            sites = reader.ref.sites
    except (LayerdiffError, OSError) as exc:
        # The rest of the page stands without it; say why it is missing.
        return head + f"<p class=\"note\">Not drawn: {escape(str(exc))}</p></section>"
    if sites.empty:
        return ""
    step = _tree_step(diff, sites)
    roots, count = _build(sites[sites["step"] == step])
    scores = _scores(diff.rows, step)
    marks, notes = _marks(diff, step, roots)
    drawn = _drawn(roots, marks, MAX_NODES)
    body = "".join(_render(roots, drawn, scores, marks, notes))
    others = sum(1 for o in diff.origins if o.step != step)
    text = (f"Step {step}, {count:,} sites in execution order, each with its type and its worst "
            "error over tolerance across all its rows, forward and backward: red is out of "
            "tolerance, orange out only by error propagated from an origin, green within. The "
            "path to each origin is open and highlighted; click a site to open or fold it.")
    if others:
        text += f" {others} origin(s) at other steps are not marked here."
    if len(drawn) < count:
        text += (f" {count - len(drawn):,} of the sites are summarised as \"more sites\" lines "
                 f"to keep the page small; the JSON or CSV report has every row.")
    return head + f"<p class=\"note\">{escape(text)}</p><ul>{body}</ul></section>"


def _tree_step(diff: Diff, sites: pd.DataFrame) -> int:
    """The first failing step, else step 0, else the first step the trace has."""
    steps = set(int(s) for s in sites["step"].unique())
    for step in (diff.first_failing_step, 0):
        if step is not None and int(step) in steps:
            return int(step)
    return min(steps)


def _build(sites: pd.DataFrame) -> tuple[list[_Node], int]:
    """The forest of one step's sites, children in execution order; and its node count.
    A site whose parent is missing becomes a root (as does one on a damaged table's cycle)."""
    # enter_seq orders calls; exit_seq breaks ties between siblings that recorded nothing.
    last = np.iinfo(np.int64).max
    order = sites.assign(_exit=sites["exit_seq"].where(sites["exit_seq"] >= 0, last))
    order = order.sort_values(["enter_seq", "_exit"], kind="stable")
    nodes: dict[str, _Node] = {}
    for site, type_, parent in zip(order["site"], order["type"], order["parent"], strict=True):
        site, parent = str(site), str(parent)
        nodes[site] = _Node(site, str(type_), parent,
                            op=bool(parent) and site.startswith(parent + "/"))
    for node in nodes.values():
        holder = nodes.get(node.parent)
        if holder is not None and holder is not node:
            holder.children.append(node)
    # Adopt from the true roots first, then from whatever a cycle left unreached.
    roots = [n for n in nodes.values() if n.parent not in nodes or n.parent == n.site]
    seen: set[str] = set()
    forest: list[_Node] = []
    for root in [*roots, *nodes.values()]:
        if root.site in seen:
            continue
        forest.append(root)
        root.depth = 0
        seen.add(root.site)
        stack = [root]
        while stack:
            node = stack.pop()
            node.children = [c for c in node.children if c.site not in seen]
            for child in node.children:
                seen.add(child.site)
                child.depth = node.depth + 1
            stack.extend(node.children)
    return forest, len(nodes)


def _walk(roots: Iterable[_Node]) -> Iterator[tuple[_Node, int]]:
    """Depth first, in execution order, without recursion (models nest deep)."""
    stack = [(node, 0) for node in reversed(list(roots))]
    visited: set[str] = set()
    while stack:
        node, depth = stack.pop()
        if node.site in visited:
            continue
        visited.add(node.site)
        yield node, depth
        stack.extend((child, depth + 1) for child in reversed(node.children))


def _scores(rows: pd.DataFrame, step: int) -> dict[str, _Score]:
    if rows.empty:
        return {}
    rows = rows[rows[Column.STEP] == step]
    ratio = pd.to_numeric(rows[Column.RATIO], errors="coerce").fillna(math.inf)
    worst = ratio.groupby(rows[Column.SITE]).max()
    failing = ~rows[Column.VERDICT].isin(PASSING)
    # Error a site only inherits is told apart from its own, as in the error plot's colours.
    own = failing & (rows[Column.STATUS] != Status.PROPAGATED)
    out = failing.groupby(rows[Column.SITE]).any()
    unexplained = own.groupby(rows[Column.SITE]).any()
    return {str(site): _Score(float(worst[site]), "o" if unexplained[site] else
                              "p" if out[site] else "w") for site in worst.index}


def _marks(diff: Diff, step: int,
           roots: list[_Node]) -> tuple[dict[str, str], dict[str, list[str]]]:
    """``site -> 'origin' | 'path'`` for the origins at ``step`` and every site above them,
    and the markers each highlighted site's line carries."""
    parents = {root.site: "" for root in roots}
    for node, _ in _walk(roots):
        parents.update((child.site, node.site) for child in node.children)
    marks: dict[str, str] = {}
    notes: dict[str, list[str]] = {}
    holders: set[str] = set()
    for origin in diff.origins:
        if origin.step != step or origin.site not in parents:
            continue
        marks[origin.site] = "origin"
        arg = "" if origin.arg in ("", "0") else f" {origin.arg}"
        notes.setdefault(origin.site, []).append(
            f"<span class=\"m\">origin: {escape(origin.pass_)} {escape(origin.role)}"
            f"{escape(arg)}</span>")
        above = parents[origin.site]
        while above:
            if marks.get(above) != "origin":
                marks[above] = "path"
            above = parents[above]
        holders.update(h for h in origin.holders if h in parents)
    for holder in holders:
        notes.setdefault(holder, []).append("<span class=\"h\">holds an origin</span>")
    return marks, notes


def _drawn(roots: list[_Node], marks: dict[str, str], limit: int) -> set[str]:
    """The sites to draw: all of them when there are at most ``limit``. Otherwise every
    highlighted one; of each run of alike siblings (repeated layers) the first two and the
    last; and of what remains, level by level from the top until ``limit``."""
    everything = [node for node, _ in _walk(roots)]
    if len(everything) <= limit:
        return {node.site for node in everything}
    repeated = _repeated(everything, marks)
    drawn = set(marks)
    level = list(roots)
    while level and len(drawn) < limit:
        following: list[_Node] = []
        for node in level:
            if len(drawn) >= limit:
                break
            drawn.add(node.site)
            following.extend(c for c in node.children if c.site not in repeated)
        level = following
    return drawn


def _repeated(nodes: list[_Node], marks: dict[str, str]) -> set[str]:
    """Siblings left out as repeats: inside each run of five or more consecutive siblings
    with the same shape (type, and the types of everything below, in order), all but the
    first two, the last, and those on a highlighted path. Shorter runs are drawn: a line
    saying "2 more" costs as much as the two."""
    shapes: dict[tuple, int] = {}
    shape: dict[str, int] = {}
    for node in reversed(nodes):  # depth-first order reversed: children before parents
        key = (node.type, node.op, tuple(shape[c.site] for c in node.children))
        shape[node.site] = shapes.setdefault(key, len(shapes))
    left_out: set[str] = set()
    for node in nodes:
        run: list[_Node] = []
        for child in [*node.children, None]:
            if child is not None and run and shape[child.site] == shape[run[0].site]:
                run.append(child)
                continue
            if len(run) >= 5:
                left_out.update(c.site for c in run[2:-1] if c.site not in marks)
            run = [child] if child is not None else []
    return left_out


def _render(roots: list[_Node], drawn: set[str], scores: dict[str, _Score],
            marks: dict[str, str], notes: dict[str, list[str]]) -> Iterator[str]:
    """The ``<li>`` items of the forest, depth first without recursion."""
    # The stack holds nodes to open, closing tags, and runs of siblings left out.
    stack: list[_Node | str | list[_Node]] = list(reversed(_runs(roots, drawn)))
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            yield item
            continue
        if isinstance(item, list):
            yield _more(item, scores)
            continue
        node = item
        mark = marks.get(node.site, "")
        attrs = (f" data-site=\"{escape(node.site)}\" data-kind=\"{'op' if node.op else 'module'}\""
                 + (f" data-mark=\"{mark}\"" if mark else ""))
        score = scores.get(node.site)
        attrs += (f" data-ratio=\"{score.worst!r}\"" if score is not None
                  else " data-unpaired")
        line = _line(node, score, notes.get(node.site, []))
        if not node.children:
            yield f"<li{attrs}><div class=\"row\">{line}</div></li>"
            continue
        is_open = bool(mark) or node.depth < OPEN_DEPTH
        yield f"<li{attrs}><details{' open' if is_open else ''}><summary>{line}</summary><ul>"
        stack.append("</ul></details></li>")
        stack.extend(reversed(_runs(node.children, drawn)))


def _runs(children: list[_Node], drawn: set[str]) -> list[_Node | list[_Node]]:
    """Drawn children as themselves; each run of siblings not drawn as one list."""
    out: list[_Node | list[_Node]] = []
    for child in children:
        if child.site in drawn:
            out.append(child)
        elif out and isinstance(out[-1], list):
            out[-1].append(child)
        else:
            out.append([child])
    return out


def _line(node: _Node, score: _Score | None, notes: list[str]) -> str:
    name = _short_name(node)
    title = f" title=\"{escape(node.site)}\"" if name != node.site else ""
    if node.op:
        label = f"<span class=\"op\">op</span><code class=\"n\"{title}>{escape(name)}</code>"
    else:
        label = (f"<span class=\"n\"{title}>{escape(name)}</span>"
                 + (f"<span class=\"t\">{escape(node.type)}</span>" if node.type else ""))
    if score is None:
        ratio = "<span class=\"u\">unpaired</span>"
    else:
        ratio = f"<span class=\"r {score.state}\">{number(score.worst, 3)}</span>"
    return label + ratio + "".join(notes)


def _short_name(node: _Node) -> str:
    """The name below the parent: 'w_q#0' under 'encoder.layers.0.self_attn#0', 'softmax#0'
    under the module call that ran it."""
    if node.op:
        return node.site[len(node.parent) + 1:]
    module = node.parent.rsplit("#", 1)[0]
    if module and module != ROOT_MODULE and node.site.startswith(module + "."):
        return node.site[len(module) + 1:]
    return node.site


def _more(run: list[_Node], scores: dict[str, _Score]) -> str:
    """One line for siblings left out: how many sites they hold and the worst of them."""
    inside = [node for node, _ in _walk(run)]
    found = [scores[node.site] for node in inside if node.site in scores]
    if found:
        worst = max(score.worst for score in found)
        state = min(score.state for score in found)  # 'o' before 'p' before 'w'
        ratio = f"<span class=\"r {state}\">worst {number(worst, 3)}</span>"
    else:
        ratio = "<span class=\"u\">unpaired</span>"
    first, last = _short_name(run[0]), _short_name(run[-1])
    span = escape(first if len(run) == 1 else f"{first} … {last}")
    kinds = {node.type for node in run}
    what = f"{escape(kinds.pop())} sites" if len(kinds) == 1 and run[0].type else "sites"
    below = len(inside) - len(run)
    holding = f" ({below:,} sites inside)" if below else ""
    return (f"<li data-more=\"{len(inside)}\"><div class=\"row more\">{len(run):,} more {what}"
            f"{holding} not drawn: <span class=\"n\">{span}</span>{ratio}</div></li>")
