"""Tied parameters: recorded once, where their gradient is complete, and judged there.

The cases are a GPT-2 in Hugging Face's layout and a nanoGPT-style port of it
(``tests/gpt_cases.py``), both with the output head's weight tied to the token embedding.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from layerdiff import capture, diff, load_weights, open_trace, run_case
from layerdiff.capture.hooks import shared_parameters
from layerdiff.trace.schema import param_name
from tests import gpt_cases

MAP = Path(__file__).parent / "gpt_port.map.toml"
REFERENCE = "tests.gpt_cases:reference"


def _param_rows(trace, full_name: str):
    index = trace.index
    params = index[index["role"].isin(["weight", "weight_grad"])]
    names = [param_name(site, arg) for site, arg in zip(params["site"], params["arg"],
                                                         strict=True)]
    return params[[name == full_name for name in names]]


def test_a_tied_weight_is_recorded_once_per_step_at_the_embedding(tmp_path):
    capture(gpt_cases.reference(), tmp_path / "ref.h5", steps=2)
    plain = gpt_cases.reference()
    run_case(plain, steps=2)
    with open_trace(tmp_path / "ref.h5") as trace:
        assert trace.meta["shared_parameters"] == [
            {"name": "transformer.wte.weight",
             "users": ["transformer.wte.weight", "lm_head.weight"]}]
        rows = _param_rows(trace, "transformer.wte.weight")
        assert sorted(zip(rows["step"], rows["role"], strict=False)) == [
            (0, "weight"), (0, "weight_grad"), (1, "weight"), (1, "weight_grad")]
        assert set(rows["site"]) == {"transformer.wte#0"}
        assert _param_rows(trace, "lm_head.weight").empty
        at_head = trace.index[trace.index["site"] == "lm_head#0"]
        assert set(at_head["role"]) == {"input", "output", "grad_output", "grad_input"}
        # the whole tied gradient: the head's part and the embedding's, as a plain run has it
        last = rows[(rows["step"] == 1) & (rows["role"] == "weight_grad")].iloc[0]
        tied = plain.model.transformer.wte.weight
        assert plain.model.lm_head.weight is tied
        assert torch.equal(torch.from_numpy(trace.read(last)), tied.grad)


def test_capturing_a_tied_model_changes_no_number(tmp_path):
    plain, captured = gpt_cases.reference(), gpt_cases.reference()
    losses = run_case(plain, steps=2).losses
    capture(captured, tmp_path / "ref.h5", steps=2)
    assert [float(x) for x in run_case(gpt_cases.reference(), steps=2).losses] == [
        float(x) for x in losses]
    pairs = zip(plain.model.named_parameters(), captured.model.parameters(), strict=True)
    for (name, a), b in pairs:
        assert torch.equal(a, b) and torch.equal(a.grad, b.grad), name


class _SharedTable(nn.Module):
    """A head registered before the embedding it shares a weight with, and one buffer shared
    by two blocks (a rotary table, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.head = nn.Linear(4, 6, bias=False)
        self.embed = nn.Embedding(6, 4)
        self.embed.weight = self.head.weight
        table = torch.arange(4.0)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        for block in self.blocks:
            block.register_buffer("table", table)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x) + block.table
        return self.head(x)


def test_meta_names_where_the_records_land_whatever_the_selection(tmp_path):
    from layerdiff import Case

    torch.manual_seed(0)
    model = _SharedTable()
    case = Case(model=model, inputs=(torch.randint(6, (3, 5)),), loss_fn=lambda o: o.sum())
    for exclude, weight_name in (((), "head.weight"), (("head",), "embed.weight")):
        path = tmp_path / f"t{len(exclude)}.h5"
        capture(case, path, exclude=exclude)
        with open_trace(path) as trace:
            shared = trace.meta["shared_parameters"]
            assert shared == shared_parameters(model, exclude=exclude)
            assert shared == [
                {"name": weight_name, "users": ["head.weight", "embed.weight"]},
                {"name": "blocks.0.table", "users": ["blocks.0.table", "blocks.1.table"]}]
            for entry in shared:
                for user in entry["users"]:
                    rows = _param_rows(trace, user)
                    expected = 2 if user == entry["name"] else 0  # weight and weight_grad
                    if user.endswith("table"):
                        expected //= 2  # a buffer has no gradient
                    assert len(rows) == expected, (user, exclude)


def test_nothing_shared_gives_an_empty_list():
    assert shared_parameters(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))) == []


# ---- the port against the reference: a tied gradient is judged where it is complete

def _diff_port(case, reference: Path, tmp_path: Path):
    load_weights(case.model, reference, MAP)
    capture(case, tmp_path / "port.h5")
    return diff(reference, tmp_path / "port.h5", mapping=MAP)


@pytest.fixture
def reference_trace(reference_traces) -> Path:
    return reference_traces(REFERENCE)


def test_the_correct_port_passes(reference_trace, tmp_path):
    result = _diff_port(gpt_cases.port(), reference_trace, tmp_path)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio"]]
    assert result.rows["ratio"].max() < 0.5  # float32 rounding of SDPA vs written-out attention
    assert result.undeclared_sites().empty


def test_a_backward_bug_upstream_of_the_head_is_found_at_its_site(reference_trace, tmp_path):
    result = _diff_port(gpt_cases.port_bug_gelu_backward(), reference_trace, tmp_path)
    assert not result.passed
    assert (result.origin.site, result.origin.pass_) == ("transformer.h.1.mlp.act#0",
                                                         "backward")
    assert result.origin.port_site == "transformer.h.1.mlp.gelu#0"
    sites = [origin.site for origin in result.origins]
    assert not any(s.startswith(("lm_head", "transformer.wte")) for s in sites), sites


@pytest.mark.parametrize("bug", [gpt_cases.port_bug_causal_mask, gpt_cases.port_bug_attn_scale])
def test_forward_bugs_are_found_at_block_0_attention(bug, reference_trace, tmp_path):
    result = _diff_port(bug(), reference_trace, tmp_path)
    assert (result.origin.site, result.origin.pass_, result.origin.role) == (
        "transformer.h.0.attn#0", "forward", "output")
    assert not any(o.site.startswith(("lm_head", "transformer.wte")) for o in result.origins)
