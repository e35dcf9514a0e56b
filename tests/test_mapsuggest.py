"""map-suggest: a drafted mapping wires a faithful port with no edits beyond its UNSURE lines."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from layerdiff import Case
from layerdiff.case import load_case
from layerdiff.mapping import Mapping
from layerdiff.mapsuggest import name_similarity, suggest_mapping

PAIRS = [("reference_models.transformer:reference", "reference_models.transformer_port:port"),
         ("tests.gpt_cases:reference", "tests.gpt_cases:port")]


def _unsure_rules(text: str) -> int:
    return len(re.findall(r"^# UNSURE", text, flags=re.M))


@pytest.mark.parametrize(("reference", "port"), PAIRS)
def test_the_draft_makes_a_faithful_port_pass_its_diff(reference, port, reference_traces,
                                                       run, tmp_path):
    ref_trace = reference_traces(reference)
    draft = tmp_path / "draft.map.toml"
    result = run("map-suggest", ref_trace, port, "-o", draft)
    assert result.exit_code == 0, result.output
    assert f"layerdiff map-check {ref_trace} {port} --map {draft}" in result.output
    assert _unsure_rules(draft.read_text()) == 0  # nothing to edit: the draft is used as is
    assert run("map-check", ref_trace, port, "--map", draft).exit_code == 0
    port_trace = tmp_path / "port.h5"
    captured = run("capture", port, "-o", port_trace, "--weights-from", ref_trace,
                   "--map", draft)
    assert captured.exit_code == 0, captured.output
    diff = run("diff", ref_trace, port_trace, "--map", draft)
    assert diff.exit_code == 0, diff.output
    assert "PASS" in diff.output


def test_a_draft_made_from_a_buggy_port_still_names_the_bug_at_its_layer(reference_traces,
                                                                        run, tmp_path):
    # values after the bug differ, so arguments are decided by the calls before it, and by
    # shape and dtype among what the values left
    ref_trace = reference_traces(PAIRS[0][0])
    port = "reference_models.transformer_port:bug_softmax_axis"
    draft = tmp_path / "draft.map.toml"
    assert run("map-suggest", ref_trace, port, "-o", draft).exit_code == 0
    assert _unsure_rules(draft.read_text()) == 0
    port_trace = tmp_path / "port.h5"
    assert run("capture", port, "-o", port_trace, "--weights-from", ref_trace, "--map",
               draft).exit_code == 0
    diff = run("diff", ref_trace, port_trace, "--map", draft)
    assert diff.exit_code == 1
    assert "FAIL  origin: encoder.layers.0.self_attn#0, forward output" in diff.output


def test_the_draft_pairs_fused_projections_and_reordered_arguments(reference_traces):
    result = suggest_mapping(reference_traces(PAIRS[0][0]), load_case(PAIRS[0][1]))
    mapping = Mapping.from_text(result.text, "draft.toml")
    assert mapping.rename("decoder.layers.1") == ("dec.1", {"1": "2", "2": "3", "3": "1"},
                                                  "draft.toml site rule " +
                                                  _rule_number(mapping, "decoder.layers.*"))
    assert result.tensor_sources["enc.1.self_attn.in_proj_weight"] == [
        f"encoder.layers.1.self_attn.w_{x}.weight" for x in "qkv"]
    assert mapping.pairs == {"tgt_pos#0": "pos#1"}
    fused = next(s for s in result.suggestions if s.port == ["dec.*.cross_attn.in_proj_bias"])
    assert fused.transform == ("concat",) and "stacked on axis 0 in call order" in \
        fused.evidence[0]
    assert all(s.evidence for s in result.suggestions)
    lines = result.text.splitlines()
    for number, line in enumerate(lines):  # no rule without its evidence above it
        if line.startswith("[[") and line != "[[unmatched]]":
            assert lines[number - 1].startswith("# ") and len(lines[number - 1]) > 10, line
    as_json = json.loads(json.dumps(result.as_json()))
    assert as_json["without_source"] == [] and as_json["suggestions"][0]["confidence"] > 0


def _rule_number(mapping: Mapping, reference: str) -> str:
    return str(next(n for n, rule in enumerate(mapping.site_rules, start=1)
                    if rule.reference.text == reference))


def test_square_weights_of_conv1d_are_transposed_like_its_other_weights(reference_traces):
    result = suggest_mapping(reference_traces(PAIRS[1][0]), load_case(PAIRS[1][1]))
    rules = {s.port[0]: s for s in result.suggestions if s.kind == "param"}
    square = rules["transformer.h.*.attn.c_proj.weight"]  # (32, 32): shapes cannot tell
    assert square.transform == ("transpose",)
    assert "Conv1D -> Linear" in square.evidence[0]


def test_llama_port_tensors_get_their_right_source_from_hugging_face(tmp_path):
    pytest.importorskip("transformers")
    from layerdiff.capture import capture
    from tests import llama_suggest_cases as llama

    ref_trace = capture(llama.reference(), tmp_path / "ref.h5")
    result = suggest_mapping(ref_trace, llama.port())
    right = llama.right_sources()
    got = {port: sources for port, sources in result.tensor_sources.items()}
    assert set(got) == set(right)
    correct = sum(got[port] == [ref] for port, ref in right.items())
    assert correct / len(right) >= 0.9, {p: got[p] for p in right if got[p] != [right[p]]}
    # the feed-forward's w1/w3 have one shape: the names decide (w1~gate_proj, w3~up_proj)
    assert got["layers.1.feed_forward.w3.weight"] == ["model.layers.1.mlp.up_proj.weight"]
    # gpt-fast's fused wqkv: q (64 rows), k and v (32 each, GQA) stacked in call order
    fused = suggest_mapping(ref_trace, llama.fused_port()).tensor_sources
    right = llama.fused_right_sources()
    assert set(fused) == set(right)
    assert sum(fused[name] == refs for name, refs in right.items()) / len(right) >= 0.9
    assert fused["layers.0.attention.wqkv.weight"] == right["layers.0.attention.wqkv.weight"]


def test_nanogpt_port_tensors_get_their_right_source_from_hugging_face_gpt2(tmp_path):
    pytest.importorskip("transformers")
    from layerdiff.capture import capture
    from layerdiff.trace import open_trace
    from layerdiff.weights import resolve_weights, trace_weights
    from tests import gpt_cases
    from tests import llama_suggest_cases as cases

    ref_trace = capture(cases.gpt2_reference(), tmp_path / "ref.h5")
    port = gpt_cases.port()
    result = suggest_mapping(ref_trace, port)
    with open_trace(ref_trace) as trace:
        weights = trace_weights(trace)
    got = {found.port: (found.source.reference, found.source.transforms) for found in
           resolve_weights(port.model, weights, Mapping.from_text(result.text, "draft.toml"))}
    right = cases.gpt2_right_sources()
    correct = sum(got[name] == ([ref], (how,)) for name, (ref, how) in right.items())
    assert set(got) == set(right) and correct / len(right) >= 0.9


def test_without_output_file_the_draft_goes_to_stdout_and_the_next_step_to_stderr(
        run, reference_traces):
    ref_trace = reference_traces(PAIRS[1][0])
    result = run("map-suggest", ref_trace, PAIRS[1][1])
    assert result.exit_code == 0
    draft = Mapping.from_text(result.stdout, "draft.toml")  # `> port.map.toml` keeps a mapping
    assert draft.rename("transformer.h.1.mlp.act")[0] == "transformer.h.1.mlp.gelu"
    assert f"layerdiff map-check {ref_trace} {PAIRS[1][1]} --map" in result.stderr


def test_an_existing_output_file_is_refused(run, tmp_path, reference_traces):
    draft = tmp_path / "draft.map.toml"
    draft.write_text("keep me")
    result = run("map-suggest", reference_traces(PAIRS[1][0]), PAIRS[1][1], "-o", draft)
    assert result.exit_code == 2
    assert "already exists" in result.output and draft.read_text() == "keep me"


class _Block(nn.Module):
    def __init__(self, names: tuple[str, str]) -> None:
        super().__init__()
        setattr(self, names[0], nn.Linear(4, 6))
        setattr(self, names[1], nn.Linear(6, 4))

    def forward(self, x):
        first, second = (getattr(self, n) for n in self._modules)
        return second(torch.relu(first(x)))


class _Net(nn.Module):
    def __init__(self, names: list[tuple[str, str]]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block(n) for n in names)

    def forward(self, x):
        for block in self.blocks:
            x = block.forward(x)  # called through .forward(): still seen
        return x


def _case(names) -> Case:
    torch.manual_seed(0)
    return Case(_Net(names), (torch.randn(3, 4),), lambda y: y.sum(), name="net")


def test_a_glob_is_drafted_only_where_every_block_agrees(tmp_path):
    from layerdiff.capture import capture

    ref = capture(_case([("up", "down")] * 3), tmp_path / "ref.h5")
    result = suggest_mapping(ref, _case([("w1", "w2"), ("w1", "w2"), ("fc", "proj")]))
    sites = {(s.reference[0], s.port[0]) for s in result.suggestions if s.kind == "site"}
    assert ("blocks.*.up", "blocks.*.fc") not in sites
    assert ("blocks.2.up", "blocks.2.fc") in sites and ("blocks.0.up", "blocks.0.w1") in sites
    assert result.tensor_sources["blocks.2.proj.weight"] == ["blocks.2.down.weight"]
    assert not result.without_source


def test_names_are_alike_through_common_conventions():
    assert name_similarity("model.layers.0.self_attn.q_proj", "layers.0.attention.wq") == 1.0
    assert name_similarity("mlp.gate_proj", "feed_forward.w1") > \
        name_similarity("mlp.gate_proj", "feed_forward.w3")
    assert name_similarity("model.embed_tokens", "tok_embeddings") == 1.0
    assert name_similarity("transformer.ln_f", "norm") == 1.0


class Conv1D(nn.Module):
    """Hugging Face GPT-2's dense layer: weight stored (in, out)."""

    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n_in, n_out))
        self.bias = nn.Parameter(torch.randn(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


class _FusedAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c_attn = Conv1D(4, 12)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(4, dim=-1)
        return torch.softmax(q @ k.T, -1) @ v


class _SeparateAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.query, self.key, self.value = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        q, k, v = self.query(x), self.key(x), self.value(x)
        return torch.softmax(q @ k.T, -1) @ v


class _Stack(nn.Module):
    def __init__(self, attention: type[nn.Module]) -> None:
        super().__init__()
        self.h = nn.ModuleList(attention() for _ in range(2))

    def forward(self, x):
        for block in self.h:
            x = block(x)
        return x


def test_a_fused_reference_projection_is_split_into_the_ports_separate_ones(tmp_path):
    from layerdiff.capture import capture
    from layerdiff.weights import load_weights

    torch.manual_seed(0)
    x = torch.randn(3, 4)
    ref = capture(Case(_Stack(_FusedAttention), (x,), lambda y: y.sum()), tmp_path / "r.h5")
    port = Case(_Stack(_SeparateAttention), (x,), lambda y: y.sum())
    result = suggest_mapping(ref, port)
    rules = [s for s in result.suggestions if s.kind == "param"]
    weight = next(s for s in rules if s.port[0] == "h.*.query.weight")
    assert weight.port == ["h.*.query.weight", "h.*.key.weight", "h.*.value.weight"]
    assert weight.reference == ["h.*.c_attn.weight"]
    assert weight.transform == ("transpose", "split")
    bias = next(s for s in rules if s.port[0] == "h.*.query.bias")
    assert bias.transform == ("split",)
    load_weights(port.model, ref, Mapping.from_text(result.text, "draft.toml"))
    torch.testing.assert_close(port.model(x), _reference_output(ref))


def _reference_output(trace_path):
    from layerdiff.trace import open_trace

    with open_trace(trace_path) as trace:
        row = trace.records(0, "<root>#0", "output").iloc[0]
        return torch.from_numpy(trace.read(row))


def test_a_summary_reference_is_refused_with_what_to_do(tmp_path):
    from layerdiff.capture import capture
    from layerdiff.errors import TraceError

    ref = capture(_case([("up", "down")]), tmp_path / "ref.h5", summary=True)
    with pytest.raises(TraceError, match=r"summary trace.*capture the reference without --summary"):
        suggest_mapping(ref, _case([("w1", "w2")]))
