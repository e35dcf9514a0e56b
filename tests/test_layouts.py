"""Layouts: how the ranks' parts of a record make the whole tensor (layerdiff/trace/layout.py),
declared by [[shard]] rules or recorded by a capture (meta ``layouts``, ``data_parallel``).
Rank files are written by hand here (no torch, no processes): each test cuts a one-process
tensor the way a sharded port would, gathers it, and diffs it against the whole."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from layerdiff import TraceWriter, diff
from layerdiff.errors import MappingError, TraceError
from layerdiff.mapping import Mapping
from layerdiff.report.findings.diff import describe_origin
from layerdiff.trace import gather as gather_module
from layerdiff.trace import open_trace
from layerdiff.trace.layout import Layout, LayoutError, Placement
from layerdiff.trace.manifest import rank_path, write_manifest

# ---- joining parts: every placement, any mesh ------------------------------------------------


@st.composite
def laid_out(draw):
    """A whole tensor and a layout over a 1-D or 2-D mesh that can hold it."""
    mesh = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=2)))
    ndim = draw(st.integers(len(mesh), 3))
    shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
    dims = draw(st.permutations(range(ndim)))  # each mesh dim cuts a tensor dim of its own
    placements = []
    for size, dim in zip(mesh, dims, strict=False):
        kind = draw(st.sampled_from(["shard", "zigzag", "experts", "replicate", "partial",
                                     "strided_shard"]))
        dim -= draw(st.sampled_from([0, ndim]))  # counted from either end
        if kind == "zigzag":
            shape[dim] *= 2 * size * draw(st.integers(1, 2))
        if kind == "strided_shard":
            factor = draw(st.integers(1, 3))
            shape[dim] *= size * factor
            placements.append(Placement(kind, dim, split_factor=factor))
            continue
        if kind == "experts":
            order = draw(st.permutations(range(2 * size)))
            shape[dim] *= 2 * size
            placements.append(Placement("experts", dim, experts=tuple(
                tuple(order[2 * c: 2 * c + 2]) for c in range(size))))
            continue
        placements.append(Placement(kind, None if kind in ("replicate", "partial") else dim))
    ranks = tuple(draw(st.permutations(range(int(np.prod(mesh))))))
    whole = np.arange(int(np.prod(shape)), dtype=np.float64).reshape(shape)
    return Layout(mesh, ranks, tuple(placements)), whole


def cut(layout: Layout, whole: np.ndarray) -> dict[int, np.ndarray]:
    """Each rank's part, cut outermost mesh dim first as DTensor cuts (partial: rank 0 of the
    mesh dim holds the whole, the others zeros: terms that sum to it)."""
    parts = {}
    for rank in layout.ranks:
        part = whole
        coordinate = layout.coordinate(rank)
        for placement, c in zip(layout.placements, coordinate, strict=True):
            if placement.kind == "partial":
                part = part * (1.0 if c == 0 else 0.0)
        index = layout.part_index(rank, whole.shape)
        parts[rank] = part if index is None else part[np.ix_(*index)]
    return parts


@settings(max_examples=150, deadline=None)
@given(laid_out())
def test_parts_cut_by_a_layout_join_back_into_the_whole(case):
    layout, whole = case
    parts = cut(layout, whole)
    np.testing.assert_array_equal(layout.unshard(parts, "float64"), whole)
    assert Layout.from_json(layout.to_json()) == layout


def test_zigzag_gives_rank_i_chunks_i_and_2r_minus_1_minus_i():
    layout = Layout.one_dim(2, Placement("zigzag", 0))
    assert layout.part_index(0, (8,))[0].tolist() == [0, 1, 6, 7]
    assert layout.part_index(1, (8,))[0].tolist() == [2, 3, 4, 5]


def test_fsdp_over_tensor_parallel_parts_join_as_dtensor_cuts_them():
    """[_StridedShard(0, 2), Shard(0)] over (dp, tp): what torch's own placements put on each
    rank joins back into the whole."""
    import torch
    from torch.distributed.tensor.placement_types import Shard, _StridedShard

    whole = np.arange(16 * 3, dtype=np.float32).reshape(16, 3)
    layout = Layout((2, 2), (0, 1, 2, 3), (Placement("strided_shard", 0, split_factor=2),
                                           Placement("shard", 0)), ("dp", "tp"))
    parts = {}
    for rank in range(4):
        dp, tp = divmod(rank, 2)
        local = _StridedShard(0, split_factor=2)._split_tensor(
            torch.from_numpy(whole), 2, with_padding=False)[0][dp]
        parts[rank] = Shard(0)._split_tensor(local, 2, with_padding=False)[0][tp].numpy()
        np.testing.assert_array_equal(whole[np.ix_(*layout.part_index(rank, whole.shape))],
                                      parts[rank])
    np.testing.assert_array_equal(layout.unshard(parts, "float32"), whole)


def test_a_partial_sum_is_reduced_in_float64_and_rounded_once():
    layout = Layout.one_dim(2, Placement("partial"))
    terms = {0: np.float32([1e8, 1.0]), 1: np.float32([-1e8, 1.0])}
    np.testing.assert_array_equal(layout.unshard(terms, "float32"), np.float32([0.0, 2.0]))


def test_parts_that_do_not_fit_their_layout_are_refused_saying_why():
    zigzag = Layout.one_dim(2, Placement("zigzag", 0))
    with pytest.raises(LayoutError, match="one length along dim 0; got \\[2, 4\\]"):
        zigzag.unshard({0: np.zeros(2), 1: np.zeros(4)}, "float64")
    with pytest.raises(LayoutError, match="differ outside dim 0"):
        zigzag.unshard({0: np.zeros((2, 3)), 1: np.zeros((2, 4))}, "float64")
    with pytest.raises(LayoutError, match="one placement per dim and 4 ranks"):
        Layout((2, 2), (0, 1), (Placement("shard", 0), Placement("replicate")))


# ---- [[shard]] rules declare layouts ----------------------------------------------------------


def test_shard_rules_read_each_layout_and_refuse_what_does_not_fit(tmp_path):
    text = """
[[shard]]
site = "attn"
tensor = "input"
dim = 1
layout = "zigzag"
[[shard]]
site = "proj"
tensor = "output"
layout = "partial"
[[shard]]
site = "moe"
tensor = "w1"
dim = 0
layout = "experts"
experts = [[0, 2], [1, 3]]
"""
    rules = Mapping.from_text(text, "m.toml").shard_rules
    assert [(r.layout, r.dim, r.experts) for r in rules] == [
        ("zigzag", 1, ()), ("partial", None, ()), ("experts", 0, ((0, 2), (1, 3)))]
    assert rules[2].describe() == "shard rule 3 (line 11: moe w1 experts dim 0)"
    bad = {
        'layout = "ring"': "layout 'ring' is not one of split, zigzag, partial",
        'layout = "zigzag"': "needs 'dim' as an integer",
        'layout = "partial"\ndim = 0': "a partial tensor is not cut along a dim",
        'layout = "experts"\ndim = 0': "needs 'experts'",
        'layout = "experts"\ndim = 0\nexperts = [[0, 1], [1, 2]]': "each of experts 0..3",
    }
    for body, message in bad.items():
        with pytest.raises(MappingError, match=message):
            Mapping.from_text(f'[[shard]]\nsite = "m"\ntensor = "w"\n{body}\n', "m.toml")


# ---- gathered by what the rank files recorded, or by rules -----------------------------------


def write(path, records, meta=None):
    """One trace: ``records`` is [(module, role, arg, array)] in order, a module's run of
    records one call of it."""
    with TraceWriter(path, meta=meta or {}) as writer:
        for module, group in itertools.groupby(records, key=lambda record: record[0]):
            with writer.site(module, "Module") as opened:
                for _, role, arg, value in group:
                    writer.record(opened, role, value, arg=arg)
    return path


def world(tmp_path, parts_by_rank, meta_by_rank=lambda rank: {}):
    manifest, files = tmp_path / "port.h5", []
    for rank, records in enumerate(parts_by_rank):
        files.append(write(rank_path(manifest, rank), records,
                           {"case": "port", "rank": rank, "world_size": len(parts_by_rank),
                            **meta_by_rank(rank)}))
    write_manifest(manifest, files)
    return manifest


RNG = np.random.default_rng(0)
X = RNG.standard_normal((4, 8), dtype=np.float32)
W = RNG.standard_normal((6, 8), dtype=np.float32)


def test_dtensor_layouts_recorded_at_capture_gather_with_no_rule(tmp_path):
    """A column-parallel weight (Shard(0)) and a row-parallel output before its all-reduce
    (Partial) recorded as each rank's local part with their layouts: the diff passes with no
    mapping; an error in rank 1's shard is named on rank 1, with where it stands."""
    ref = write(tmp_path / "ref.h5", [("fc", "weight", "weight", W),
                                      ("fc", "output", "0", X @ W.T)])
    split = Layout.one_dim(2, Placement("shard", 0)).to_json()
    partial = Layout.one_dim(2, Placement("partial")).to_json()
    layouts = {"table": [split, partial], "records": [["fc#0", "weight", "weight", 0],
                                                      ["fc#0", "output", "0", 1]]}
    halves = [(W[:3], X[:, :4] @ W[:, :4].T), (W[3:], X[:, 4:] @ W[:, 4:].T)]
    port = world(tmp_path, [[("fc", "weight", "weight", w), ("fc", "output", "0", y)]
                            for w, y in halves], lambda rank: {"layouts": layouts})
    assert diff(ref, port).passed

    bad = W[3:].copy()
    bad[1, 2] += 1.0
    port = world(tmp_path, [[("fc", "weight", "weight", w), ("fc", "output", "0", X @ W.T / 2)]
                            for w in (W[:3], bad)], lambda rank: {"layouts": layouts})
    origin = diff(ref, port).origins[0]
    assert (origin.site, origin.role, origin.ranks) == ("fc#0", "weight", [1])
    assert "rank 1's part" in describe_origin(origin)
    assert origin.shards.startswith("joined across the ranks: split along dim 0 over 2 ranks "
                                    "(the DTensor placements recorded at capture)")


def test_a_wrong_chunk_order_under_a_zigzag_rule_is_named_on_its_rank(tmp_path):
    seq = RNG.standard_normal((2, 8, 3), dtype=np.float32)  # (batch, sequence, features)
    ref = write(tmp_path / "ref.h5", [("attn", "output", "0", seq)])
    rules = Mapping.from_text('[[shard]]\nsite = "attn"\ntensor = "output"\ndim = 1\n'
                              'layout = "zigzag"\n', "cp.toml")
    layout = Layout.one_dim(2, Placement("zigzag", 1))
    parts = [seq[:, layout.part_index(rank, seq.shape)[1]] for rank in range(2)]
    port = world(tmp_path, [[("attn", "output", "0", p)] for p in parts])
    assert diff(ref, port, mapping=rules).passed
    # rank 1 holds chunks 1 and 2 but stores them 2, 1: the wrong chunk order
    swapped = np.concatenate([parts[1][:, 2:], parts[1][:, :2]], axis=1)
    port = world(tmp_path, [[("attn", "output", "0", p)] for p in (parts[0], swapped)])
    origin = diff(ref, port, mapping=rules).origins[0]
    assert (origin.site, origin.role, origin.ranks) == ("attn#0", "output", [1])
    # a plain split would have paired the chunks wrongly: the diff fails without the layout
    plain = Mapping.from_text('[[shard]]\nsite = "attn"\ntensor = "output"\ndim = 1\n', "s.toml")
    port = world(tmp_path, [[("attn", "output", "0", p)] for p in parts])
    assert not diff(ref, port, mapping=plain).passed


def test_an_expert_on_the_wrong_rank_is_named_on_the_ranks_holding_it(tmp_path):
    experts = RNG.standard_normal((4, 3, 2), dtype=np.float32)  # (experts, d, h)
    ref = write(tmp_path / "ref.h5", [("moe", "weight", "w1", experts)])
    rules = Mapping.from_text('[[shard]]\nsite = "moe"\ntensor = "w1"\ndim = 0\n'
                              'layout = "experts"\nexperts = [[0, 2], [1, 3]]\n', "ep.toml")
    port = world(tmp_path, [[("moe", "weight", "w1", experts[[0, 2]])],
                            [("moe", "weight", "w1", experts[[1, 3]])]])
    assert diff(ref, port, mapping=rules).passed
    # rank 0 computes with expert 1 where the placement says expert 2
    port = world(tmp_path, [[("moe", "weight", "w1", experts[[0, 1]])],
                            [("moe", "weight", "w1", experts[[1, 3]])]])
    origin = diff(ref, port, mapping=rules).origins[0]
    assert (origin.site, origin.ranks) == ("moe#0", [0])
    wrong_world = Mapping.from_text('[[shard]]\nsite = "moe"\ntensor = "w1"\ndim = 0\n'
                                    'layout = "experts"\nexperts = [[0], [1], [2, 3]]\n', "e.toml")
    with pytest.raises(TraceError, match="lists the experts of 3 ranks; the capture has 2"):
        gather_module.gather(port, wrong_world, tmp_path / "g.h5")


def test_a_missing_reduction_is_named_at_the_replicated_record_on_every_rank(tmp_path):
    """proj's output is declared a partial sum; its parent's output is meant to be the
    all-reduced whole on every rank. A parent that forgets the all-reduce holds its own term:
    the origin is the parent, and every rank's copy is named."""
    y = X @ W.T
    ref = write(tmp_path / "ref.h5", [("proj", "output", "0", y), ("mlp", "output", "0", y)])
    rules = Mapping.from_text('[[shard]]\nsite = "proj"\ntensor = "output"\n'
                              'layout = "partial"\n', "p.toml")
    terms = [X[:, :4] @ W[:, :4].T, X[:, 4:] @ W[:, 4:].T]
    port = world(tmp_path, [[("proj", "output", "0", t), ("mlp", "output", "0", y)]
                            for t in terms])
    assert diff(ref, port, mapping=rules).passed
    port = world(tmp_path, [[("proj", "output", "0", t), ("mlp", "output", "0", t)]
                            for t in terms])
    origin = diff(ref, port, mapping=rules).origins[0]
    assert (origin.site, origin.ranks) == ("mlp#0", [0, 1])
    assert "ranks 0, 1' copies" in describe_origin(origin)


def test_a_data_parallel_world_joins_the_batch_and_scales_its_gradients(tmp_path):
    """FSDP or DDP seen at capture, each rank on its half of the batch: activations differ
    across ranks and are joined along dim 0; each rank's loss is its half's mean, the whole's
    the mean of the two; an activation's gradient is its rank loss's, twice the whole's; a
    weight every rank holds whole is its copy."""
    y = X @ W.T
    grad = RNG.standard_normal(y.shape).astype(np.float32) / 4
    ref = write(tmp_path / "ref.h5", [("fc", "input", "0", X), ("fc", "weight", "weight", W),
                                      ("fc", "output", "0", y), ("<loss>", "output", "0",
                                                                np.float32(0.75)),
                                      ("fc", "grad_output", "0", grad)])
    meta = {"data_parallel": {"how": "fully_shard", "ranks": [0, 1],
                              "gradient_divide_factor": 2}}
    port = world(tmp_path, [[("fc", "input", "0", X[rows]), ("fc", "weight", "weight", W),
                             ("fc", "output", "0", y[rows]),
                             ("<loss>", "output", "0", np.float32(loss)),
                             ("fc", "grad_output", "0", grad[rows] * 2)]
                            for rows, loss in ((slice(0, 2), 0.5), (slice(2, 4), 1.0))],
                 lambda rank: meta)
    found = diff(ref, port)
    assert found.passed, found.origins
    with open_trace(tmp_path / "port.gathered.h5") as gathered:
        shapes = dict(zip(gathered.index["role"] + " " + gathered.index["site"],
                          gathered.index["shape"], strict=True))
    assert shapes["input fc#0"] == "4,8" and shapes["weight fc#0"] == "6,8"


def test_rules_over_a_mesh_cut_one_tensor_along_two_axes(tmp_path):
    """4 ranks as data parallel 2 x tensor parallel 2 (rank = dp * 2 + tp), by hand: fc's
    weight is split by rows over tp and replicated over dp; its output is split by the batch
    over dp and by features over tp. A slip in rank 3's part alone is named on rank 3."""
    y = X @ W.T
    ref = write(tmp_path / "ref.h5", [("fc", "weight", "weight", W), ("fc", "output", "0", y)])
    rules = Mapping.from_text("""
[mesh]
dp = 2
tp = 2
[[shard]]
site = "fc"
tensor = "weight"
dim = 0
over = "tp"
[[shard]]
site = "fc"
tensor = "output"
dim = 0
over = "dp"
[[shard]]
site = "fc"
tensor = "output"
dim = -1
over = "tp"
""", "mesh.toml")

    def ranks(slip=None):
        parts = []
        for rank in range(4):
            dp, tp = divmod(rank, 2)
            out = y[2 * dp: 2 * dp + 2, 3 * tp: 3 * tp + 3].copy()
            if rank == slip:
                out[0, 0] += 1.0
            parts.append([("fc", "weight", "weight", W[3 * tp: 3 * tp + 3]),
                          ("fc", "output", "0", out)])
        return world(tmp_path, parts)

    assert diff(ref, ranks(), mapping=rules).passed
    origin = diff(ref, ranks(slip=3), mapping=rules).origins[0]
    assert (origin.site, origin.role, origin.ranks) == ("fc#0", "output", [3])
    assert "split along dim 0 over dp (2 ranks), split along dim -1 over tp" in origin.shards
    for text, message in (('[mesh]\ndp = 2\n[[shard]]\nsite = "fc"\ntensor = "w"\ndim = 0\n',
                           "every rule names the mesh dim"),
                          ('[[shard]]\nsite = "fc"\ntensor = "w"\ndim = 0\nover = "tp"\n',
                           "has no \\[mesh\\] table")):
        with pytest.raises(MappingError, match=message):
            Mapping.from_text(text, "m.toml")
    three = Mapping.from_text('[mesh]\ndp = 3\n[[shard]]\nsite = "fc"\ntensor = "weight"\n'
                              'dim = 0\nover = "dp"\n', "three.toml")
    with pytest.raises(TraceError, match="holds 3 ranks; the capture has 4"):
        gather_module.gather(tmp_path / "port.h5", three, tmp_path / "g.h5")


def test_fsdp_over_dp_with_tensor_parallel_inside_joins_each_replica_then_the_batch(tmp_path):
    """A (dp = 2, tp = 2) world, rank = 2 dp + tp: the data-parallel groups are [0, 2] and
    [1, 3], each replica (ranks 0, 1 and 2, 3) runs its half of the batch. fc's output is a
    DTensor recorded Shard(-1) over its replica's tp ranks, act's a plain local part of it (the
    reference's shape cuts it within the replica), norm's a plain tensor whole in its replica:
    each is joined within the replica, then the replicas along the batch. Each replica's loss
    is its half's mean, fc's output gradient its half's (twice the whole's): summed, then
    divided by the factor 2. An error in rank 3's cell of fc's output is named on rank 3."""
    y = X @ W.T                                                    # (4 batch, 6 features)
    norm = RNG.standard_normal((4, 5)).astype(np.float32)
    grad = RNG.standard_normal(y.shape).astype(np.float32) / 4
    halves = (0.5, 1.0)
    ref = write(tmp_path / "ref.h5", [("model", "input", "0", X), ("fc", "output", "0", y),
                                      ("fc", "grad_output", "0", grad),
                                      ("act", "output", "0", np.tanh(y)),
                                      ("norm", "output", "0", norm),
                                      ("<loss>", "output", "0", np.float32(sum(halves) / 2))])

    def meta(rank):
        tp_group = (rank - rank % 2, rank - rank % 2 + 1)
        split = Layout((2,), tp_group, (Placement("shard", 1),), ("tp",)).to_json()
        return {"layouts": {"table": [split], "records": [["fc#0", "output", "0", 0],
                                                          ["fc#0", "grad_output", "0", 0]]},
                "data_parallel": {"how": "fully_shard", "ranks": [rank % 2, rank % 2 + 2],
                                  "gradient_divide_factor": 2}}

    def parts(fc_output=y):
        for rank in range(4):
            dp, tp = divmod(rank, 2)
            rows, cols = slice(2 * dp, 2 * dp + 2), slice(3 * tp, 3 * tp + 3)
            yield [("model", "input", "0", X[rows]), ("fc", "output", "0", fc_output[rows, cols]),
                   ("fc", "grad_output", "0", grad[rows, cols] * 2),
                   ("act", "output", "0", np.tanh(y[rows, cols])),
                   ("norm", "output", "0", norm[rows]),
                   ("<loss>", "output", "0", np.float32(halves[dp]))]

    port = world(tmp_path, list(parts()), meta)
    found = diff(ref, port)
    assert found.passed, found.origins
    with open_trace(tmp_path / "port.gathered.h5") as gathered:
        for site, role, whole in (("model", "input", X), ("fc", "output", y),
                                  ("act", "output", np.tanh(y)), ("norm", "output", norm),
                                  ("<loss>", "output", np.float32(0.75)),
                                  ("fc", "grad_output", grad)):
            row = gathered.find(0, f"{site}#0", role, "0")
            np.testing.assert_allclose(gathered.read(row), whole,
                                       rtol=1e-6, err_msg=f"{site} {role}")
        joined = gathered.meta["gathered"]["layouts"]
    placed = {(site, role): joined["table"][at] for site, role, _, at in joined["records"]}
    assert placed[("fc#0", "output")]["placements"] == [{"kind": "shard", "dim": 0},
                                                        {"kind": "shard", "dim": 1}]
    assert placed[("norm#0", "output")]["placements"][1] == {"kind": "replicate"}
    assert placed[("fc#0", "grad_output")]["scale"] == 0.5                 # 1 / the factor
    assert placed[("<loss>#0", "output")]["scale"] == 0.5

    slipped = y.copy()
    slipped[3, 4] += 1.0  # batch row 3 (replica 1), feature 4 (tp 1): rank 3's cell
    port = world(tmp_path, list(parts(slipped)), meta)
    origin = diff(ref, port).origins[0]
    assert (origin.site, origin.role, origin.ranks) == ("fc#0", "output", [3])
    assert "rank 3's part" in describe_origin(origin)


def test_an_fsdp_weight_wrong_in_one_ranks_shard_is_named_on_that_rank(tmp_path):
    """FSDP2 records the whole, all-gathered weight on every rank (no layout) and its gradient
    as each rank's Shard(0) part: a slip in the rows rank 1 keeps is named on rank 1."""
    grad = RNG.standard_normal(W.shape).astype(np.float32)
    ref = write(tmp_path / "ref.h5", [("fc", "weight", "weight", W),
                                      ("fc", "weight_grad", "weight", grad)])
    shard = Layout.one_dim(2, Placement("shard", 0)).to_json()
    meta = {"layouts": {"table": [shard], "records": [["fc#0", "weight_grad", "weight", 0]]},
            "data_parallel": {"how": "fully_shard", "ranks": [0, 1], "gradient_divide_factor": 2,
                              "weights": "unsharded: the whole weight"}}
    slipped = W.copy()
    slipped[4, 0] += 1.0  # row 4 of 6: rank 1 keeps rows 3-5
    port = world(tmp_path, [[("fc", "weight", "weight", slipped),
                             ("fc", "weight_grad", "weight", grad[rows])]
                            for rows in (slice(0, 3), slice(3, 6))], lambda rank: meta)
    origin = diff(ref, port).origins[0]
    assert (origin.site, origin.role, origin.ranks) == ("fc#0", "weight", [1])
    assert origin.shards.startswith("whole on every rank (all-gathered for the module's "
                                    "forward)")
    assert "The weight records of this capture are unsharded" in origin.shards


def test_a_batch_long_record_the_ranks_agree_on_is_still_cut(tmp_path):
    """Each rank on its half of the batch: a causal mask expanded over the batch is the same
    on both ranks, yet per example; a record shorter than the batch part (positions) is
    replicated."""
    mask = np.triu(np.full((4, 1, 3, 3), -np.inf, np.float32), 1)
    positions = np.arange(3, dtype=np.float32)[None]
    ref = write(tmp_path / "ref.h5", [("model", "input", "0", X),
                                      ("attn", "input", "0", mask),
                                      ("pos", "output", "0", positions)])
    meta = {"data_parallel": {"how": "fully_shard", "ranks": [0, 1]}}
    port = world(tmp_path, [[("model", "input", "0", X[rows]), ("attn", "input", "0", mask[rows]),
                             ("pos", "output", "0", positions)]
                            for rows in (slice(0, 2), slice(2, 4))], lambda rank: meta)
    found = diff(ref, port)
    assert found.passed, found.origins


def test_records_nothing_places_are_named_by_gather_and_cut_by_the_diff(tmp_path):
    """A DTensor port's plain local part (here a GELU's output, each rank its half of the
    features) has no layout: gather says so, `ranks` flags it unless given the reference, and
    the diff cuts it by the reference's shape."""
    from click.testing import CliRunner

    from layerdiff.cli import main

    hidden = X @ W.T
    ref = write(tmp_path / "ref.h5", [("fc", "output", "0", hidden), ("act", "output", "0",
                                                                       np.tanh(hidden))])
    split = Layout.one_dim(2, Placement("shard", 1)).to_json()
    meta = {"layouts": {"table": [split], "records": [["fc#0", "output", "0", 0]]}}
    port = world(tmp_path, [[("fc", "output", "0", hidden[:, cols]),
                             ("act", "output", "0", np.tanh(hidden[:, cols]))]
                            for cols in (slice(0, 3), slice(3, 6))], lambda rank: meta)
    done = gather_module.gather(port, None, tmp_path / "g.h5")
    assert any("1 record(s)" in note and "act#0 output 0" in note for note in done.notes)
    found = diff(ref, port)
    assert found.passed, found.origins
    assert any("cut as the reference's shapes say" in w for w in found.meta["warnings"])
    runner = CliRunner()
    assert runner.invoke(main, ["ranks", str(port)]).exit_code == 1
    agreed = runner.invoke(main, ["ranks", str(port), "--reference", str(ref)])
    assert agreed.exit_code == 0, agreed.output
