"""Replay judges what a module's call alone makes (issue 39): a weight also used by code
outside its module's calls (a tied head ``x @ self.tok.weight.T`` in the root's forward), buffers
of every layout and kind (sparse, complex, bool), and a port output apart from the reference's
only by axes of size 1. The cases are in ``tests/replay_alone_cases.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import capture, load_case
from layerdiff.compare.shapes import as_shape, same_elements, unit_axes_apart
from layerdiff.replay import ReplayOutcome, replay
from layerdiff.replay.torch_replay import restored
from layerdiff.replay.uses import outside_uses

CASES = "tests.replay_alone_cases"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    cache = {}

    def get(name: str):
        if name not in cache:
            path = tmp_path_factory.mktemp("ref") / "ref.h5"
            cache[name] = capture(load_case(f"{CASES}:{name}"), path)
        return cache[name]
    return get


def _local(result, verdict="LOCAL ERROR"):
    table = result.local
    return {(site, pass_) for site, pass_ in zip(
        table.loc[table["verdict"] == verdict, "site"],
        table.loc[table["verdict"] == verdict, "pass"], strict=True)}


# ---- a weight used outside its module's calls

def test_a_head_in_the_roots_code_is_found_as_a_use_outside_the_embedding():
    case = load_case(f"{CASES}:gpt")
    modules = dict(case.model.named_modules(remove_duplicate=False))
    modules["<root>"] = modules.pop("")
    uses = outside_uses(case.model, modules, case.call_model, [], restored)
    assert uses == {id(case.model.tok.weight): ["<root>"]}
    assert "forward" not in vars(case.model.tok)  # every watched forward put back


class _Reads(nn.Module):
    """Reads its child's weight's dtype, shape and a detached copy: no gradient flows from
    those; uses another child's weight in its own matmul: one does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.b(self.a(x).to(self.b.weight.dtype)) * self.b.weight.shape[0]
        return y + self.b.weight.detach().sum() + x @ self.a.weight.T


def test_only_uses_a_gradient_flows_from_count():
    model = _Reads()
    modules = dict(model.named_modules())
    modules["<root>"] = modules.pop("")
    uses = outside_uses(model, modules, lambda: model(torch.ones(1, 2)), [], restored)
    assert uses == {id(model.a.weight): ["<root>"]}


def test_a_faithful_port_with_a_head_in_the_roots_code_passes(traces):
    result = replay(traces("gpt"), load_case(f"{CASES}:gpt"))
    assert result.outcome == ReplayOutcome.PASS and not _local(result)
    why = dict(result.skipped)["tok#0 weight_grad weight"]
    assert why.startswith("cannot judge alone: tok.weight is also used at <root>")
    # nothing else of the embedding is set aside: its output is judged
    rows = result.diff.rows
    assert set(rows.loc[rows["site"] == "tok#0", "role"]) == {
        "input", "output", "grad_output", "weight"}
    assert "weight_grad" not in set(rows["role"][rows["site"] == "tok#0"])


def test_a_planted_bug_in_that_embedding_is_still_named(traces):
    result = replay(traces("gpt"), load_case(f"{CASES}:gpt_bug_embedding"))
    assert not result and _local(result) == {("tok#0", "forward")}


def test_with_the_reference_case_the_recorded_gradient_is_split_and_compared(traces):
    """The reference's tok calls replayed alone give its calls' part of the recorded total:
    the port's calls are judged against that, both made the same way."""
    reference = load_case(f"{CASES}:gpt")
    result = replay(traces("gpt"), load_case(f"{CASES}:gpt"), reference_case=reference)
    assert result.outcome == ReplayOutcome.PASS and not result.skipped
    assert result.notes == ["tok.weight is also used at <root>: judged on what the calls of "
                            "tok alone make, on both sides"]
    rows = result.diff.rows
    grad = rows[(rows["site"] == "tok#0") & (rows["role"] == "weight_grad")].iloc[0]
    assert grad["ratio"] <= 0.01


def test_a_weight_the_mapping_converts_is_not_split(traces, tmp_path):
    """A conversion stands between the two sides' tensors: the reference's part could not be
    taken from the port's by subtraction, so the weight gradient is set aside, saying why."""
    mapping = tmp_path / "conv.map.toml"
    mapping.write_text('version = 1\n\n[[param]]\nport = "tok.weight"\n'
                       'reference = "tok.weight"\n'
                       f'transform = "{CASES}:same"\n')
    result = replay(traces("gpt"), load_case(f"{CASES}:gpt"), mapping=mapping,
                    reference_case=load_case(f"{CASES}:gpt"), propagated=False)
    assert result.passed
    why = " ".join(dict(result.skipped)["tok#0 weight_grad weight"].split())
    assert f"the mapping makes it from tok.weight through {CASES}:same" in why


def test_a_bug_in_the_embeddings_own_gradient_is_named_only_with_the_split(traces):
    port = f"{CASES}:gpt_bug_embedding_backward"
    alone = replay(traces("gpt"), load_case(port))  # its weight gradient is set aside
    assert alone.passed and "tok#0 weight_grad weight" in dict(alone.skipped)
    split = replay(traces("gpt"), load_case(port), reference_case=load_case(f"{CASES}:gpt"))
    assert _local(split) == {("tok#0", "backward")}


def test_cli_reference_case(run, traces):
    ref = traces("gpt")
    bad = run("replay", ref, f"{CASES}:gpt_bug_embedding_backward",
              "--reference-case", f"{CASES}:gpt")
    assert bad.exit_code == 1
    assert bad.output.startswith("FAIL  local error in 1 site(s): tok#0 (backward)")
    good = run("replay", ref, f"{CASES}:gpt")
    assert good.exit_code == 0 and "cannot judge alone: tok.weight is also used at <root>" in (
        " ".join(good.output.split()))


# ---- buffers of every layout and kind

def test_sparse_complex_and_bool_buffers_are_compared(traces):
    result = replay(traces("buffers"), load_case(f"{CASES}:buffers"))
    assert result.outcome == ReplayOutcome.PASS and not result.cannot_judge
    rows = result.diff.rows
    weights = rows[(rows["site"] == "inner#0") & (rows["role"] == "weight")]
    assert dict(zip(weights["arg"], weights["verdict"], strict=True)) == {
        "adjacency": "identical", "phase": "identical", "keep": "identical"}
    assert result.notes == ["inner.adjacency is sparse_coo: compared by layout, shape and "
                            "dtype (all the trace holds of it)"]


def test_a_sparse_port_buffer_against_a_dense_reference_is_compared_dense(traces):
    result = replay(traces("buffers_dense"), load_case(f"{CASES}:buffers"))
    assert result.outcome == ReplayOutcome.PASS and not result.notes
    rows = result.diff.rows
    adjacency = rows[(rows["arg"] == "adjacency") & (rows["role"] == "weight")].iloc[0]
    assert adjacency["verdict"] == "identical" and adjacency["dtype"] == "float32"


@pytest.mark.parametrize(("port", "buffer"), [("buffers_bug_phase", "phase"),
                                              ("buffers_bug_keep", "keep")])
def test_a_wrong_complex_or_bool_buffer_is_out(traces, port, buffer):
    result = replay(traces("buffers"), load_case(f"{CASES}:{port}"))
    rows = result.diff.rows
    wrong = rows[(rows["site"] == "inner#0") & (rows["role"] == "weight")]
    assert set(wrong.loc[wrong["verdict"] == "out", "arg"]) == {buffer}
    assert ("inner#0", "forward") in _local(result)


def test_a_sparse_weight_gradient_is_compared_as_capture_records_it(traces):
    result = replay(traces("sparse_gradient"), load_case(f"{CASES}:sparse_gradient"))
    assert result.outcome == ReplayOutcome.PASS
    assert result.notes == ["emb.weight's gradient is sparse_coo: compared by layout, shape "
                            "and dtype (all the trace holds of it)"]
    rows = result.diff.rows
    grad = rows[(rows["site"] == "emb#0") & (rows["role"] == "weight_grad")].iloc[0]
    assert grad["verdict"] == "identical"


# ---- axes of size 1: the diff's rule

def test_the_shared_rule():
    assert unit_axes_apart((1, 6, 8), (6, 8)) and unit_axes_apart((6, 1, 8), (1, 6, 8))
    assert not unit_axes_apart((6, 8), (6, 8)) and not unit_axes_apart((8, 6), (6, 8))
    assert same_elements((6, 8), (6, 8)) and same_elements((48,), (6, 8))  # merged axes
    assert not same_elements((8, 6), (6, 8))  # a transpose's shape: other places
    array = np.arange(48.0).reshape(1, 6, 8)
    assert as_shape(array, (6, 8)).shape == (6, 8)
    assert as_shape(array, (8, 6)) is array  # not the same elements in the same places


def test_a_block_whose_output_drops_an_axis_of_size_1_replays_its_backward(traces):
    result = replay(traces("unit_reference"), load_case(f"{CASES}:unit_port"))
    assert result.outcome == ReplayOutcome.PASS and not result.cannot_judge
    rows = result.diff.rows
    backward = rows[(rows["site"] == "mix#0") & (rows["pass"] == "backward")]
    assert set(backward["role"]) >= {"grad_output", "weight_grad"}
    output = rows[(rows["site"] == "mix#0") & (rows["role"] == "output")].iloc[0]
    assert (output["shape"], output["port_shape"]) == ("1,6,8", "6,8")
    assert "axes of size 1" in output["note"]


def test_modules_reached_by_two_paths_get_their_own_forward_back():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(shared, shared)
    modules = dict(model.named_modules(remove_duplicate=False))
    modules["<root>"] = modules.pop("")
    outside_uses(model, modules, lambda: model(torch.ones(1, 2)), [], restored)
    assert "forward" not in vars(shared) and "forward" not in vars(model)


# ---- a real pair: transformers' GPT2LMHeadModel against a port whose head is in its root

HF_MAP = "reference_models/hf_gpt2.map.toml"


@pytest.fixture(scope="module")
def hf_trace(tmp_path_factory):
    pytest.importorskip("transformers")
    return capture(load_case("reference_models.hf_gpt2:reference"),
                   tmp_path_factory.mktemp("hf") / "ref.h5")


@pytest.mark.parametrize(("port", "split", "named"), [
    ("gpt2_head_in_root", False, set()),   # was transformer.wte#0 backward at 7295x
    ("gpt2_head_in_root", True, set()),
    ("gpt2_head_in_root_bug_lookup_grad", True, {("transformer.wte#0", "backward")}),
    ("gpt2_head_in_root_bug_gelu_backward", False,
     {("transformer.h.1.mlp.act#0", "backward")}),
    ("gpt2_head_in_root_bug_gelu_backward", True,
     {("transformer.h.1.mlp.act#0", "backward")}),
])
def test_hf_gpt2_against_a_port_with_its_head_in_the_root(hf_trace, monkeypatch, port, split,
                                                          named):
    monkeypatch.chdir(Path(__file__).parent.parent)
    reference = load_case("reference_models.hf_gpt2:reference") if split else None
    result = replay(hf_trace, load_case(f"{CASES}:{port}"), mapping=HF_MAP,
                    reference_case=reference, propagated=False)
    assert not result.cannot_judge and _local(result) == named
    assert bool(result) == (not named)
    set_aside = [site for site, why in result.skipped if "cannot judge alone" in why]
    assert set_aside == ([] if split else ["transformer.wte#0 weight_grad weight"])
