"""The HTML report's module tree: the path to the origin is open and lit, other subtrees are
folded, the ratios are the diff's, op sites nest under their module, and a big model's tree
stays small. The page is read back with the stdlib's html.parser through the data attributes
the tree writes for that purpose."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from html.parser import HTMLParser
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from layerdiff import TraceWriter, capture, diff, load_case, load_weights
from layerdiff.compare.judge import PASSING, Status
from layerdiff.compare.result import ROW_COLUMNS, UNMATCHED_COLUMNS, Diff, Origin
from layerdiff.report.html import render_html
from layerdiff.report.tree import MAX_NODES, OPEN_DEPTH, module_tree_section
from layerdiff.trace import open_trace
from reference_models.catalog import find

BUG = "reference_models.transformer_port:bug_softmax_axis"
PORT = "reference_models.transformer_port:port"


# ---- reading the tree back


@dataclass
class Node:
    attrs: dict[str, str | None]
    parent: Node | None
    children: list[Node] = field(default_factory=list)
    open: bool | None = None          # None: a leaf, drawn without <details>
    badge: tuple[str, str] | None = None   # (class, text) of the ratio
    markers: list[str] = field(default_factory=list)
    op_badge: bool = False
    name_tag: str = ""
    name: str = ""

    @property
    def site(self) -> str:
        return self.attrs.get("data-site") or ""

    @property
    def mark(self) -> str:
        return self.attrs.get("data-mark") or ""


class TreeReader(HTMLParser):
    """The nodes of the section id="module-tree", each with its own line's parts."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = False
        self.depth = 0                # <section> nesting while inside
        self.stack: list[Node] = []
        self.roots: list[Node] = []
        self.nodes: dict[str, Node] = {}
        self.more: list[Node] = []
        self.text_for: tuple[Node, str] | None = None

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if tag == "section" and attrs.get("id") == "module-tree":
            self.inside = True
        if not self.inside:
            return
        top = self.stack[-1] if self.stack else None
        if tag == "li":
            node = Node(attrs, top)
            (top.children if top else self.roots).append(node)
            self.stack.append(node)
            if "data-site" in attrs:
                self.nodes[node.site] = node
            else:
                self.more.append(node)
        elif top is None:
            return
        elif tag == "details" and top.open is None:
            top.open = "open" in attrs
        elif tag == "span" or (tag == "code" and top.name_tag == ""):
            classes = (attrs.get("class") or "").split()
            if "r" in classes and top.badge is None:
                self.text_for = (top, "badge:" + " ".join(c for c in classes if c != "r"))
            elif classes == ["m"]:
                self.text_for = (top, "marker")
            elif classes == ["op"]:
                top.op_badge = True
            elif "n" in classes and not top.name_tag:
                top.name_tag = tag
                self.text_for = (top, "name")

    def handle_data(self, data):
        if self.text_for is None:
            return
        node, what = self.text_for
        self.text_for = None
        if what.startswith("badge:"):
            node.badge = (what[6:], data)
        elif what == "marker":
            node.markers.append(data)
        else:
            node.name = data

    def handle_endtag(self, tag):
        if not self.inside:
            return
        if tag == "li":
            self.stack.pop()
        elif tag == "section":
            self.inside = False


def read_tree(page: str) -> TreeReader:
    reader = TreeReader()
    reader.feed(page)
    assert reader.nodes, "the page has no module tree"
    return reader


def depth(node: Node) -> int:
    return 0 if node.parent is None else 1 + depth(node.parent)


def expected_scores(result: Diff, step: int) -> dict[str, tuple[float, str]]:
    """Per site: its worst ratio (NaN as inf) and 'o' out / 'p' only propagated / 'w' within."""
    rows = result.rows[result.rows["step"] == step]
    scores = {}
    for site, group in rows.groupby("site"):
        worst = group["ratio"].astype(float).fillna(math.inf).max()
        failing = group[~group["verdict"].isin(PASSING)]
        state = ("w" if failing.empty else "p" if (failing["status"] == Status.PROPAGATED).all()
                 else "o")
        scores[site] = (worst, state)
    return scores


def sites_of(path: Path, step: int = 0) -> pd.DataFrame:
    with open_trace(path) as trace:
        sites = trace.sites
    return sites[sites["step"] == step]


# ---- the bundled transformer and its planted softmax bug


def _port(spec: str, reference: Path, path: Path) -> Diff:
    info = find(spec)
    case = load_case(spec)
    load_weights(case.model, reference, info.mapping_path)
    return diff(reference, capture(case, path), mapping=info.mapping_path)


@pytest.fixture(scope="module")
def bug(reference_traces, tmp_path_factory):
    reference = reference_traces(find(BUG).reference)
    result = _port(BUG, reference, tmp_path_factory.mktemp("bug") / "port.h5")
    return result, render_html(result)


def test_path_to_each_origin_is_open_and_highlighted(bug):
    result, page = bug
    tree = read_tree(page)
    parents = dict(zip(sites_of(result.reference)["site"], sites_of(result.reference)["parent"],
                       strict=True))
    assert result.origins, "the planted bug gives an origin"
    for origin in result.origins:
        node = tree.nodes[origin.site]
        assert node.mark == "origin"
        assert node.open is True              # its children are shown
        assert f"origin: {origin.pass_} {origin.role}" in node.markers
        assert node.badge[0] == "o"
        above, site = node.parent, parents[origin.site]
        while site:                           # every ancestor, up to the model
            assert above is not None and above.site == site
            assert above.mark in ("path", "origin") and above.open is True
            above, site = above.parent, parents[site]
        assert above is None
    # The softmax bug sits in the first encoder layer's attention.
    assert result.origin.site == "encoder.layers.0.self_attn#0"
    # Off the path, below the open top levels, subtrees start folded: the second encoder
    # layer (error propagated into it, no origin) among them.
    second = tree.nodes["encoder.layers.1#0"]
    assert second.mark == "" and second.open is False and second.badge[0] == "p"
    for node in tree.nodes.values():
        if node.open is not None and not node.mark:
            assert node.open is (depth(node) < OPEN_DEPTH), node.site


def test_ratios_shown_are_the_diffs(bug):
    result, page = bug
    tree = read_tree(page)
    sites = sites_of(result.reference)
    assert set(tree.nodes) == set(sites["site"])       # every site of step 0, none left out
    assert tree.more == []
    scores = expected_scores(result, 0)
    for site, node in tree.nodes.items():
        if site not in scores:
            assert "data-unpaired" in node.attrs and node.badge is None
            continue
        worst, state = scores[site]
        assert float(node.attrs["data-ratio"]) == worst
        assert node.badge[0] == state, site
        if np.isfinite(worst) and worst > 0:
            assert float(node.badge[1]) == pytest.approx(worst, rel=5e-3)
    # Sites the port has no module for (its encoder loop is its own code) are unpaired.
    assert "data-unpaired" in tree.nodes["encoder#0"].attrs


def test_tree_comes_before_the_error_plot_and_names_nested_sites_short(bug):
    _, page = bug
    assert page.index('id="module-tree"') < page.index("Error per site, in execution order")
    node = read_tree(page).nodes["encoder.layers.0.self_attn.w_q#0"]
    assert node.name == "w_q#0"


def test_passing_diff_has_no_highlight(reference_traces, tmp_path):
    reference = reference_traces(find(PORT).reference)
    result = _port(PORT, reference, tmp_path / "port.h5")
    assert result.passed
    tree = read_tree(module_tree_section(result))
    assert not any(node.mark for node in tree.nodes.values())
    assert {node.badge[0] for node in tree.nodes.values() if node.badge} == {"w"}
    assert tree.nodes["<root>#0"].open is True
    assert tree.nodes["encoder.layers.0#0"].open is False   # depth 2: folded


# ---- a model of our own, with op sites written by hand


def _softmax(a: np.ndarray, axis: int) -> np.ndarray:
    e = np.exp(a - a.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _op_trace(path: Path, softmax_axis: int) -> Path:
    """An encoder: an MLP branch, then attention whose own code runs matmul, softmax, matmul,
    recorded as op sites `enc.attn#0/<op>#k` around its child module `enc.attn.q`."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((2, 5, 4)).astype(np.float32)
    w1, w2, wq = (rng.standard_normal((4, 4)).astype(np.float32) for _ in range(3))
    with TraceWriter(path) as w, w.site("<root>", "Tiny") as root:
        w.record(root, "input", x)
        with w.site("enc", "Encoder"):
            with w.site("enc.pre", "MLP") as pre:
                w.record(pre, "input", x)
                h = x
                for name, weight in (("enc.pre.fc1", w1), ("enc.pre.fc2", w2)):
                    with w.site(name, "Linear") as s:
                        w.record(s, "input", h)
                        h = h @ weight
                        w.record(s, "output", h)
                w.record(pre, "output", h)
            with w.site("enc.attn", "Attention") as attn:
                w.record(attn, "input", h)
                with w.site("enc.attn.q", "Linear") as s:
                    w.record(s, "input", h)
                    q = h @ wq
                    w.record(s, "output", q)
                with w.site(f"{attn}/matmul", "matmul") as s:
                    w.record(s, "input", q, arg="0")
                    w.record(s, "input", h, arg="1")
                    scores = q @ h.transpose(0, 2, 1)
                    w.record(s, "output", scores)
                with w.site(f"{attn}/softmax", "softmax") as s:
                    w.record(s, "input", scores)
                    p = _softmax(scores, softmax_axis)
                    w.record(s, "output", p)
                with w.site(f"{attn}/matmul", "matmul") as s:
                    w.record(s, "input", p, arg="0")
                    w.record(s, "input", h, arg="1")
                    y = p @ h
                    w.record(s, "output", y)
                w.record(attn, "output", y)
        w.record(root, "output", y)
    return path


def test_op_sites_nest_under_their_module_with_the_op_style(tmp_path):
    reference = _op_trace(tmp_path / "ref.h5", softmax_axis=-1)
    port = _op_trace(tmp_path / "port.h5", softmax_axis=1)   # softmax over the query axis
    result = diff(reference, port)
    assert result.origin.site == "enc.attn#0/softmax#0"
    tree = read_tree(module_tree_section(result))
    attn = tree.nodes["enc.attn#0"]
    # execution order among the module's children: its child module, then its own ops
    assert [c.site for c in attn.children] == [
        "enc.attn.q#0", "enc.attn#0/matmul#0", "enc.attn#0/softmax#0", "enc.attn#0/matmul#1"]
    softmax = tree.nodes["enc.attn#0/softmax#0"]
    assert softmax.attrs["data-kind"] == "op" and softmax.op_badge
    assert (softmax.name_tag, softmax.name) == ("code", "softmax#0")
    assert tree.nodes["enc.attn.q#0"].attrs["data-kind"] == "module"
    assert not tree.nodes["enc.attn.q#0"].op_badge
    # the origin is the op, its module and everything above it are on the lit path
    assert softmax.mark == "origin" and softmax.markers == ["origin: forward output"]
    assert [tree.nodes[s].mark for s in ("enc.attn#0", "enc#0", "<root>#0")] == ["path"] * 3
    assert attn.open and tree.nodes["enc#0"].open
    # the branch before it has no error at all: folded, not lit, green
    pre = tree.nodes["enc.pre#0"]
    assert pre.open is False and pre.mark == "" and pre.badge == ("w", "0")
    assert tree.nodes["enc.attn#0/matmul#1"].badge[0] == "p"   # inherited, not its own
    assert "data-unpaired" in tree.nodes["enc#0"].attrs       # no records of its own


# ---- scale: a deep stack of repeated blocks


def _stack_trace(path: Path, layers: int) -> list[str]:
    """`layers` blocks of attention (4 linears, 3 op sites) and an MLP (2 linears)."""
    x = np.zeros(2, np.float32)
    sites = []
    with TraceWriter(path) as w, w.site("<root>", "Stack") as root:
        sites.append(root)
        for i in range(layers):
            with w.site(f"h.{i}", "Block") as block:
                sites.append(block)
                for name, kids in (("attn", ("q", "k", "v", "o")), ("mlp", ("fc1", "fc2"))):
                    with w.site(f"h.{i}.{name}", name.upper()) as module:
                        sites.append(module)
                        for kid in kids:
                            with w.site(f"h.{i}.{name}.{kid}", "Linear") as s:
                                sites.append(s)
                                w.record(s, "output", x)
                        for op in (("matmul", "softmax", "matmul") if name == "attn" else ()):
                            with w.site(f"{module}/{op}", op) as s:
                                sites.append(s)
                                w.record(s, "output", x)
                        w.record(module, "output", x)
    return sites


def _rows(sites: list[str], origin: str) -> pd.DataFrame:
    at = sites.index(origin)
    rows = []
    for seq, site in enumerate(sites):
        row = dict.fromkeys(ROW_COLUMNS)
        out = seq >= at
        row.update({"step": 0, "pass": "forward", "seq": seq, "site": site, "role": "output",
                    "arg": "0", "ratio": 40.0 if out else 0.25,
                    "verdict": "out" if out else "within",
                    "status": "origin" if seq == at else "propagated" if out else ""})
        rows.append(row)
    return pd.DataFrame(rows, columns=ROW_COLUMNS)


def test_a_big_model_collapses_repeated_blocks_but_keeps_the_origin(tmp_path):
    path = tmp_path / "stack.h5"
    sites = _stack_trace(path, layers=200)      # 3,201 sites
    assert len(sites) > MAX_NODES
    origin = "h.120.attn#0/softmax#0"
    result = Diff(path, path, _rows(sites, origin),
                  [Origin(0, "forward", origin, origin, "output", "0", "0", "planted")],
                  pd.DataFrame(columns=UNMATCHED_COLUMNS), 0)
    section = module_tree_section(result)
    tree = read_tree(section)
    assert len(tree.nodes) <= MAX_NODES
    # every site is either drawn or counted on a "more" line
    assert len(tree.nodes) + sum(int(n.attrs["data-more"]) for n in tree.more) == len(sites)
    for site in (origin, "h.120.attn#0", "h.120#0", "<root>#0"):
        assert tree.nodes[site].mark in ("origin", "path")
    # the first blocks and the last are drawn; the repeats between stand as lines carrying
    # the worst ratio of what they hide: within before the origin, out after it
    assert {"h.0#0", "h.1#0", "h.199#0"} <= set(tree.nodes)
    assert "h.50#0" not in tree.nodes
    badges = [n.badge[0] for n in tree.more]
    assert badges == ["w", "p"]
    assert len(section.encode()) < 100_000


def test_an_unreadable_reference_leaves_a_note_not_a_broken_page(tmp_path):
    reference = _op_trace(tmp_path / "ref.h5", softmax_axis=-1)
    result = diff(reference, reference)
    reference.unlink()
    section = module_tree_section(result)
    assert "Not drawn" in section and "does not exist" in section


# ---- a real browser draws it


def test_a_real_browser_draws_the_tree_with_the_origin_lit(bug, tmp_path, screenshot):
    _, page = bug
    report = tmp_path / "report.html"
    report.write_text(page, encoding="utf-8")
    pixels = screenshot(report, 1400)
    rgb = (pixels * 255).round().astype(np.int32)
    # the origin's line: background #ffcdd2; the path's lines: #fdecea
    for colour, least in (((0xff, 0xcd, 0xd2), 2_000), ((0xfd, 0xec, 0xea), 10_000)):
        near = (np.abs(rgb - np.array(colour)) <= 3).all(axis=2).sum()
        assert near > least, f"only {near} pixels of {colour}: the tree is not drawn lit"
