"""Capturing ports sharded by torch's DTensor APIs on 2 gloo ranks (tests/dtensor_cases.py): each
rank records its local part of every DTensor, and its rank file's meta says how the parts make
the whole (``layouts``) and what data parallelism the model ran (``data_parallel``). The parts,
put together as the layouts say, are the one-process reference's tensors."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

from layerdiff import capture, diff, load_case
from layerdiff.capture.sharded import Aliases, Layouts
from layerdiff.trace import Recorder, open_trace, schema
from layerdiff.trace.stats import text_digest
from layerdiff.trace.writer import base_meta
from reference_models import tensor_parallel as tp
from tests.gloo import needs_gloo

CASES = {name: f"tests.dtensor_cases:{name}"
         for name in ("fsdp", "tensor_parallel", "ddp", "fsdp_divide_by_four",
                      "sequence_parallel", "loss_parallel")}
STEPS = {"ddp": 1, "fsdp_divide_by_four": 1}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The one-process capture of the model the cases shard."""
    return capture(load_case(f"{tp.MODULE}:reference"),
                   tmp_path_factory.mktemp("reference") / "reference.h5")


@pytest.fixture(scope="module")
def traces(tmp_path_factory, reference) -> dict[str, Path]:
    """The reference, and each case's 2-rank capture (by one group of 2 spawned processes
    capturing every case in turn)."""
    import torch.multiprocessing as mp

    from tests.gloo import free_port
    from tests.rank_captures import _capture_each

    folder = tmp_path_factory.mktemp("dtensor")
    paths = {"reference": reference}
    jobs = []
    for name, spec in CASES.items():
        paths[name] = folder / f"{name}.h5"
        steps = {"steps": STEPS[name]} if name in STEPS else {}
        jobs.append((spec, str(paths[name]), steps))
    mp.start_processes(_capture_each, args=(2, free_port(), jobs), nprocs=2,
                       start_method="spawn")
    return paths


def rank_files(path: Path) -> list[Path]:
    return [path.with_name(f"{path.stem}.rank{rank}.h5") for rank in (0, 1)]


def layout_of(meta: dict, site: str, role: str, arg: str) -> dict | None:
    for row in meta["layouts"]["records"]:
        if row[:3] == [site, role, arg]:
            return meta["layouts"]["table"][row[3]]
    return None


def read(trace, step: int, site: str, role: str, arg: str) -> np.ndarray:
    row = trace.find(step, site, role, arg)
    assert row is not None, f"no record {site} {role} {arg} at step {step}"
    return trace.read(row)


def shard(dim: int) -> list[dict]:
    return [{"kind": "shard", "dim": dim}]


@needs_gloo
def test_tensor_parallel_records_local_parts_with_their_layouts(traces):
    ranks = [open_trace(path) for path in rank_files(traces["tensor_parallel"])]
    meta = ranks[1].meta
    fc, proj = "blocks.0.mlp.fc#0", "blocks.0.mlp.proj#0"
    expected = {(fc, "weight", "weight"): (shard(0), [128, 32]),
                (fc, "weight", "bias"): (shard(0), [128]),
                (proj, "weight", "weight"): (shard(1), [32, 128]),
                (proj, "weight", "bias"): ([{"kind": "replicate"}], [32]),
                # the module's own output, before ColwiseParallel's hook makes it local
                (fc, "output", "0"): (shard(2), [4, 8, 128]),
                (proj, "input", "0"): (shard(2), [4, 8, 128]),
                # RowwiseParallel's output before its all-reduce: each rank's partial sum
                (proj, "output", "0"): ([{"kind": "partial", "reduce": "sum"}], [4, 8, 32]),
                (fc, "weight_grad", "weight"): (shard(0), [128, 32])}
    for (site, role, arg), (placements, shape) in expected.items():
        layout = layout_of(meta, site, role, arg)
        assert layout == {"mesh": [2], "names": ["tp"], "ranks": [0, 1],
                          "placements": placements, "shape": shape}, (site, role, arg)
    # modules tensor parallelism leaves alone record plain tensors: no layout
    assert layout_of(meta, "blocks.0.ln1#0", "output", "0") is None
    assert "data_parallel" not in meta
    assert "layouts_varied" not in meta
    # the records are the local parts, and put together they are the reference's tensors
    with open_trace(traces["reference"]) as reference:
        for step in (0, 1):
            for (site, role, arg), (placements, shape) in expected.items():
                parts = [read(trace, step, site, role, arg) for trace in ranks]
                kind = placements[0]["kind"]
                if kind == "shard":
                    dim = placements[0]["dim"]
                    assert parts[0].shape[dim] * 2 == shape[dim]
                    whole = np.concatenate(parts, axis=dim)
                else:
                    whole = parts[0] + parts[1] if kind == "partial" else parts[0]
                np.testing.assert_allclose(whole, read(reference, step, site, role, arg),
                                           rtol=1e-5, atol=1e-6, err_msg=f"{site} {role} {arg}")
    for trace in ranks:
        trace.close()


@needs_gloo
def test_plain_tensors_between_tensor_parallel_layers_take_the_layout_they_alias(traces):
    """``act`` (GELU) sits between ColwiseParallel (its output made local) and RowwiseParallel
    (its input wrapped by ``from_local``): it only sees plain local slices, the very memory of
    fc's output and proj's input DTensors, and its records get their layout: the diff passes
    with no mapping."""
    ranks = [open_trace(path) for path in rank_files(traces["tensor_parallel"])]
    sliced = {"mesh": [2], "names": ["tp"], "ranks": [0, 1], "placements": shard(2),
              "shape": [4, 8, 128]}
    with open_trace(traces["reference"]) as reference:
        for block in (0, 1):
            act = f"blocks.{block}.mlp.act#0"
            for role in ("input", "output", "grad_output", "grad_input"):
                for trace in ranks:
                    assert layout_of(trace.meta, act, role, "0") == sliced, (act, role)
                whole = np.concatenate([read(trace, 1, act, role, "0") for trace in ranks],
                                       axis=2)
                np.testing.assert_allclose(whole, read(reference, 1, act, role, "0"),
                                           rtol=1e-5, atol=1e-6, err_msg=f"{act} {role}")
    for trace in ranks:
        trace.close()
    found = diff(traces["reference"], traces["tensor_parallel"])
    assert found.passed, found.origins


@needs_gloo
def test_fully_shard_records_whole_weights_and_sharded_gradients(traces):
    ranks = [open_trace(path) for path in rank_files(traces["fsdp"])]
    meta = ranks[0].meta
    assert meta["data_parallel"] == {
        "how": "fully_shard", "ranks": [0, 1], "gradient_divide_factor": 2,
        "weights": "unsharded: the whole weight each module computed with (after FSDP's "
                   "all-gather)",
        "weight_grads": "reduced: each rank's shard of the gradient after FSDP's "
                        "reduce-scatter"}
    # fully_shard's FSDP<Name> subclasses are recorded under the model's own class names
    types = dict(zip(ranks[0].sites["site"], ranks[0].sites["type"], strict=True))
    assert (types["<root>#0"], types["blocks.0#0"]) == ("TinyGPT", "Block")
    assert "Block" in meta["signatures"] and "FSDPBlock" not in meta["signatures"]
    fc = "blocks.0.mlp.fc#0"
    # FSDP swaps the whole weight in for the forward: the weight records are plain and whole
    assert layout_of(meta, fc, "weight", "weight") is None
    assert layout_of(meta, fc, "output", "0") is None
    assert layout_of(meta, fc, "weight_grad", "weight") == {
        "mesh": [2], "names": [""], "ranks": [0, 1], "placements": shard(0), "shape": [128, 32]}
    with open_trace(traces["reference"]) as reference:
        for step in (0, 1):
            weights = [read(trace, step, fc, "weight", "weight") for trace in ranks]
            assert weights[0].shape == (128, 32)
            np.testing.assert_array_equal(weights[0], weights[1])
            np.testing.assert_allclose(weights[0], read(reference, step, fc, "weight", "weight"),
                                       rtol=1e-6, atol=1e-7)
            grads = [read(trace, step, fc, "weight_grad", "weight") for trace in ranks]
            assert grads[0].shape == (64, 32)
            # the same batch on both ranks: the average of the two is the reference's gradient
            np.testing.assert_allclose(np.concatenate(grads),
                                       read(reference, step, fc, "weight_grad", "weight"),
                                       rtol=1e-5, atol=1e-7)
    for trace in ranks:
        trace.close()


@needs_gloo
def test_the_gradient_divide_factor_is_the_one_fsdp_applied(traces):
    fc = "blocks.0.mlp.fc#0"
    ranks = [open_trace(path) for path in rank_files(traces["fsdp_divide_by_four"])]
    factor = ranks[0].meta["data_parallel"]["gradient_divide_factor"]
    assert factor == 4
    grads = np.concatenate([read(trace, 0, fc, "weight_grad", "weight") for trace in ranks])
    with open_trace(traces["reference"]) as reference:
        # both ranks' identical gradients summed, then divided by the factor
        np.testing.assert_allclose(grads * factor / 2,
                                   read(reference, 0, fc, "weight_grad", "weight"),
                                   rtol=1e-5, atol=1e-7)
    for trace in ranks:
        trace.close()


@needs_gloo
def test_ddp_is_data_parallel_with_no_sharded_records(traces):
    with open_trace(rank_files(traces["ddp"])[1]) as trace:
        meta = trace.meta
    assert meta["data_parallel"]["how"] == "ddp"
    assert meta["data_parallel"]["ranks"] == [0, 1]
    assert meta["data_parallel"]["gradient_divide_factor"] == 2
    assert "layouts" not in meta


@needs_gloo
def test_sequence_parallel_is_captured_and_joins_to_the_reference(traces):
    """torchtitan's sequence-parallel plan: the row-parallel embeddings' outputs are masked
    partial sums (the rows of tokens another rank holds are looked up at a clamped id and
    zeroed only by the reduction, after our hook), and the norms' outputs are cut along the
    sequence. Each rank's embedding part is recorded as the reduction adds it, so the parts
    sum to the reference's embedding, and the whole gathered trace passes the diff."""
    ranks = [open_trace(path) for path in rank_files(traces["sequence_parallel"])]
    meta = ranks[0].meta
    partial = [{"kind": "partial", "reduce": "sum"}]
    expected = {("embed#0", "output", "0"): (partial, [4, 8, 32]),
                ("pos#0", "output", "0"): (partial, [8, 32]),
                ("blocks.0.ln1#0", "output", "0"): (shard(1), [4, 8, 32]),
                ("blocks.1.ln2#0", "input", "0"): (shard(1), [4, 8, 32])}
    for (site, role, arg), (placements, shape) in expected.items():
        assert layout_of(meta, site, role, arg) == {
            "mesh": [2], "names": ["tp"], "ranks": [0, 1], "placements": placements,
            "shape": shape}, (site, role, arg)
    with open_trace(traces["reference"]) as reference:
        for step in (0, 1):
            for site in ("embed#0", "pos#0"):
                whole = sum(read(trace, step, site, "output", "0").astype(np.float64)
                            for trace in ranks)
                error = np.abs(whole - read(reference, step, site, "output", "0")).max()
                # each row is one rank's embedding plus the other's zeros: exact up to rounding
                assert error < 1e-6, f"{site} output at step {step}: max abs error {error}"
            norm = np.concatenate([read(trace, step, "blocks.0.ln1#0", "output", "0")
                                   for trace in ranks], axis=1)
            np.testing.assert_allclose(norm, read(reference, step, "blocks.0.ln1#0", "output",
                                                  "0"), rtol=1e-5, atol=1e-6)
    for trace in ranks:
        trace.close()
    found = diff(traces["reference"], traces["sequence_parallel"])
    assert found.passed, found.origins


def test_a_plain_capture_writes_its_meta_once(reference):
    """No sharded tensor, no data parallelism: no key is added, and the meta text is the one
    written when the file was created (its digest taken of that text)."""
    with h5py.File(reference) as h5:
        text = h5.attrs[schema.ATTR_META]
        meta = json.loads(text)
        assert h5.attrs[schema.ATTR_META_DIGEST] == text_digest(text)
    assert "layouts" not in meta and "data_parallel" not in meta
    assert text == json.dumps(meta, default=str)


def test_meta_added_before_a_complete_close_is_written_and_digested(tmp_path):
    recorder = Recorder(tmp_path / "done.h5", base_meta("test"))
    recorder.add_meta({"layouts": {"table": [], "records": []}})
    with open_trace(recorder.close(complete=True)) as trace:   # the reader checks the digest
        assert trace.meta["layouts"] == {"table": [], "records": []}
    partial = Recorder(tmp_path / "cut.h5", base_meta("test"))
    partial.add_meta({"layouts": {}})
    with open_trace(partial.close(complete=False), allow_incomplete=True) as trace:
        assert "layouts" not in trace.meta


def _fake(placements: tuple, shape: tuple, local=None) -> SimpleNamespace:
    """What Layouts and Aliases read of a DTensor: its spec, mesh, placements, global shape
    and local part."""
    mesh = SimpleNamespace(shape=(2,), mesh_dim_names=None, ndim=1,
                           mesh=np.array([0, 1]))
    return SimpleNamespace(_spec=SimpleNamespace(mesh="mesh", placements=placements,
                                                 shape=shape),
                           device_mesh=mesh, placements=placements, shape=shape,
                           _local_tensor=local)


def test_only_the_same_memory_at_the_same_version_is_an_alias():
    import torch
    from torch.distributed.tensor import Partial, Shard

    layouts = Layouts()
    aliases = Aliases(layouts)
    local = torch.ones(4, 3)
    before = local.view(4, 3)   # recorded before the DTensor, a view of the same memory
    aliases.plain("a#0", "output", "0", before)
    aliases.plain("b#0", "output", "0", local[1:])   # other elements
    aliases.plain("c#0", "output", "0", local.t())   # seen another way
    dtensor = _fake((Shard(1),), (4, 6), local)
    aliases.part(dtensor, layouts.add("fc#0", "output", "0", dtensor))
    aliases.plain("d#0", "input", "0", local.detach())   # after it, the same memory
    aliases.plain("e#0", "input", "0", local.clone())    # equal values, other memory
    local.mul_(2)   # changed in place since: no longer the part recorded
    aliases.plain("f#0", "input", "0", local)
    partial = _fake((Partial(),), (4, 3), torch.zeros(4, 3))
    aliases.part(partial, layouts.add("proj#0", "output", "0", partial))
    # an in-place all_reduce counts no version: a partial part's aliases keep no layout
    aliases.plain("g#0", "input", "0", partial._local_tensor)
    assert [row[:3] for row in layouts.meta()["layouts"]["records"]] == [
        ["fc#0", "output", "0"], ["a#0", "output", "0"], ["d#0", "input", "0"],
        ["proj#0", "output", "0"]]
    assert {row[3] for row in layouts.meta()["layouts"]["records"][:3]} == {0}


def test_a_record_whose_layout_changes_keeps_its_first_and_is_listed():
    from torch.distributed.tensor import Replicate, Shard

    layouts = Layouts()
    layouts.add("fc#0", "output", "0", _fake((Shard(-1),), (4, 6)))
    layouts.add("fc#0", "output", "0", _fake((Replicate(),), (4, 6)))
    layouts.add("proj#0", "input", "0", _fake((Shard(1),), (4, 6)))
    meta = layouts.meta()
    assert meta["layouts"]["table"][0]["placements"] == [{"kind": "shard", "dim": 1}]
    assert meta["layouts"]["records"] == [["fc#0", "output", "0", 0], ["proj#0", "input", "0", 0]]
    assert meta["layouts_varied"] == [["fc#0", "output", "0"]]
    assert Layouts().meta() == {}


def test_placements_in_the_trace_words():
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    from layerdiff.capture.sharded import placement_json

    assert placement_json(Shard(-1), 3) == {"kind": "shard", "dim": 2}
    assert placement_json(Replicate(), 3) == {"kind": "replicate"}
    assert [placement_json(Partial(op), 3)["reduce"] for op in ("sum", "avg", "max", "min")] == [
        "sum", "avg", "max", "min"]
    assert placement_json(_StridedShard(0, split_factor=2), 3) == {
        "kind": "strided_shard", "dim": 0, "split_factor": 2}


def test_a_local_part_with_no_storage_of_its_own_is_no_alias():
    """A sequence-parallel redistribute leaves an AsyncCollectiveTensor as a DTensor's local
    part: a wrapper whose storage has no data pointer. It is matched with nothing, and neither
    it nor a plain record of it stops the capture."""
    import torch
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import Shard

    layouts = Layouts()
    aliases = Aliases(layouts)
    local = AsyncCollectiveTensor(torch.ones(4, 3))
    dtensor = _fake((Shard(1),), (4, 6), local)
    aliases.part(dtensor, layouts.add("norm#0", "output", "0", dtensor))
    aliases.plain("a#0", "input", "0", local)
    assert [row[:3] for row in layouts.meta()["layouts"]["records"]] == [
        ["norm#0", "output", "0"]]


@needs_gloo
def test_a_loss_computed_under_loss_parallel_runs_its_backward_there_and_joins(traces):
    """torch's loss_parallel(): the logits stay cut along the vocabulary and the loss's
    backward fails outside the context; the case's ``step_context`` runs each step in it."""
    ranks = [open_trace(path) for path in rank_files(traces["loss_parallel"])]
    assert layout_of(ranks[0].meta, "head#0", "output", "0")["placements"] == shard(2)
    found = diff(traces["reference"], traces["loss_parallel"])
    assert found.passed, found.origins
