"""The diff judges real third-party pairs with what pairs (issue 27): keyword against positional
arguments by the recorded signatures, arguments the port does not take listed and never
blocking, an attention's extra output never blocking, a root ModelOutput's logits against a
plain tensor, and port-only inputs made by a call adapter (``call =`` in the mapping).

Pairs of our own making (tests/real_pairs_cases.py), and transformers' own GPT2LMHeadModel
against tests.gpt_cases' nanoGPT port."""

from __future__ import annotations

import re

import pytest
import torch

from layerdiff import diff, load_weights
from layerdiff.capture import capture
from layerdiff.compare.arguments import pair_arguments
from layerdiff.compare.records import output_partners
from layerdiff.errors import MappingError
from layerdiff.report.html import render_html
from layerdiff.signature import Parameter, Signature
from tests import gpt_cases
from tests import real_pairs_cases as cases

ATTN0, ATTN1 = "layers.0.attn#0", "layers.1.attn#0"

ADAPTERS = """version = 1

[[site]]
reference = "layers.*.attn"
port = "layers.*.attn"
call = "tests.real_pairs_cases:attention_call"

[[site]]
reference_regex = '^layers\\.(\\d+)$'
port = 'layers.\\1'
call = "tests.real_pairs_cases:block_call"
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("real_pairs")


@pytest.fixture(scope="module")
def reference(folder):
    return capture(cases.reference(), folder / "reference.h5")


@pytest.fixture(scope="module")
def adapters(folder):
    path = folder / "adapters.map.toml"
    path.write_text(ADAPTERS, encoding="utf-8")
    return path


def _port(folder, reference, name, mapping=None):
    case = getattr(cases, name)()
    load_weights(case.model, reference, mapping)
    return capture(case, folder / f"{name}.h5")


def _diff(folder, reference, name, mapping=None):
    return diff(reference, _port(folder, reference, name, mapping), mapping=mapping)


@pytest.fixture(scope="module")
def self_bug(folder, reference):
    return _diff(folder, reference, "port_self_bug_scale")


# ---- keyword and positional arguments, arguments the port does not take

def test_a_keyword_argument_pairs_with_the_ports_positional_one(self_bug):
    rows = self_bug.rows
    inputs = rows[(rows["site"] == ATTN0) & (rows["role"] == "input")]
    assert list(zip(inputs["arg"], inputs["port_arg"], strict=True)) == [("hidden_states", "0")]
    grads = rows[(rows["site"] == ATTN0) & (rows["role"] == "grad_input")]
    assert list(zip(grads["arg"], grads["port_arg"], strict=True)) == [("hidden_states", "0")]


def test_arguments_the_port_does_not_take_are_listed_not_unmatched(self_bug):
    taken = self_bug.not_taken
    mask = taken[(taken["site"] == ATTN0) & (taken["arg"] == "attention_mask")]
    assert len(mask) == 1
    assert (mask.iloc[0]["dtype"], mask.iloc[0]["shape"]) == ("float32", "2,1,8,8")
    assert "SelfAttention.forward(x) has no parameter" in mask.iloc[0]["reason"]
    assert {"position_embeddings.0", "position_embeddings.1"} <= set(
        taken[taken["site"] == ATTN0]["arg"])
    unmatched = self_bug.unmatched
    assert not ((unmatched["site"] == ATTN0) & (unmatched["role"] == "input")).any()
    assert self_bug.as_json()["not_taken"]


def test_a_bug_in_the_attention_is_named_at_the_attention(self_bug):
    origin = self_bug.origin
    assert (origin.site, origin.pass_, origin.role) == (ATTN0, "forward", "output")
    assert len(self_bug.origins) == 1
    assert "cannot-judge" not in set(self_bug.rows["status"])


@pytest.mark.parametrize("name, site", [("port_self_bug_mlp", "layers.0.mlp#0"),
                                        ("port_self_bug_norm", "layers.1.norm2#0")])
def test_a_bug_in_the_mlp_or_a_norm_is_named_there(folder, reference, name, site):
    result = _diff(folder, reference, name)
    assert [(o.site, o.pass_) for o in result.origins] == [(site, "forward")]


def test_the_faithful_port_passes_and_the_loss_and_root_are_judged(folder, reference):
    result = _diff(folder, reference, "port_self")
    assert result, result.failing()
    rows = result.rows
    root = rows[(rows["site"] == "<root>#0") & (rows["role"] == "output")]
    assert list(zip(root["arg"], root["port_arg"], strict=True)) == [("logits", "0")]
    assert (rows["site"] == "<loss>#0").any()


def test_the_loss_of_a_failing_diff_is_judged_and_the_root_is_not_green(self_bug):
    rows = self_bug.rows
    loss = rows[rows["site"] == "<loss>#0"]
    assert len(loss) == 1 and loss.iloc[0]["status"] != "cannot-judge"
    root_out = rows[(rows["site"] == "<root>#0") & (rows["role"] == "output")]
    assert root_out.iloc[0]["verdict"] == "out"
    page = render_html(self_bug)
    line = re.search(r'data-site="&lt;root&gt;#0"[^>]*data-ratio="([^"]+)"', page)
    assert line is not None and float(line.group(1)) > 1


def test_an_extra_output_and_its_gradient_never_block_the_attention(self_bug):
    """The reference attention returns (out, weights), the block drops the weights: whatever
    capture records at output 1 is listed, and the attention's backward is judged."""
    unmatched = self_bug.unmatched
    extra = unmatched[(unmatched["site"] == ATTN0) & (unmatched["arg"] == "1")]
    assert "output" in set(extra["role"])
    rows = self_bug.rows
    backward = rows[(rows["site"] == ATTN0) & (rows["pass"] == "backward")]
    assert not backward.empty and "cannot-judge" not in set(backward["status"])


def test_unmatched_output_declared_in_the_mapping(folder, reference, tmp_path):
    mapping = tmp_path / "declared.map.toml"
    mapping.write_text('version = 1\n\n[[unmatched]]\nreference = "layers.*.attn"\n'
                       'output = "1"\nwhy = "attention weights; the block drops them"\n',
                       encoding="utf-8")
    result = diff(reference, folder / "port_self_bug_scale.h5", mapping=mapping)
    declared = result.unmatched[(result.unmatched["site"] == ATTN0)
                                & (result.unmatched["arg"] == "1")]
    assert len(declared) and declared["declared"].all()
    assert set(declared["reason"]) == {"attention weights; the block drops them"}
    assert result.origin.site == ATTN0


# ---- port-only inputs: a call adapter, or "cannot judge" saying which to write

def test_without_an_adapter_port_only_inputs_make_the_attention_cannot_judge(folder,
                                                                             reference):
    result = _diff(folder, reference, "port_freqs_bug_scale")
    assert result.origins == []  # not the block, not the root
    rows = result.rows
    attn = rows[(rows["site"] == ATTN0) & (rows["status"] == "cannot-judge")]
    assert len(attn)
    cause = attn.iloc[0]["cause"]
    assert "'freqs_cos', 'freqs_sin'" in cause and "call adapter" in cause
    # the reference's mask is not mistaken for the port's freqs_cos, which sits at its place
    inputs = rows[(rows["site"] == ATTN0) & (rows["role"] == "input")]
    assert list(inputs["arg"]) == ["hidden_states"]


@pytest.mark.parametrize("name, site", [("port_freqs_bug_scale", ATTN0),
                                        ("port_freqs_bug_rotary", ATTN1)])
def test_with_call_adapters_a_bug_is_named_at_its_attention(folder, reference, adapters,
                                                              name, site):
    result = _diff(folder, reference, name, adapters)
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [(site, "forward", "output")]
    assert "cannot-judge" not in set(result.rows["status"])


def test_with_call_adapters_the_faithful_port_passes_and_its_own_inputs_are_judged(
        folder, reference, adapters):
    result = _diff(folder, reference, "port_freqs", adapters)
    assert result, result.failing()
    rows = result.rows
    made = rows[(rows["site"] == ATTN0) & (rows["role"] == "input")]
    assert set(zip(made["arg"], made["port_arg"], made["match"], strict=True)) == {
        ("hidden_states", "0", "adapted"), ("freqs_cos", "1", "adapted"),
        ("freqs_sin", "2", "adapted")}
    assert (made["verdict"] == "within").all()
    # the hidden states pass through unchanged: their gradient is compared; the rest listed
    grads = rows[(rows["site"] == ATTN0) & (rows["role"] == "grad_input")]
    assert list(grads["arg"]) == ["hidden_states"]
    unmatched = result.unmatched
    assert not ((unmatched["site"] == ATTN0) & (unmatched["role"] == "input")).any()
    assert result.not_taken[result.not_taken["site"] == ATTN0].empty


def test_a_failing_adapter_is_one_sentence_naming_it(folder, reference, tmp_path):
    mapping = tmp_path / "bad.map.toml"
    mapping.write_text('version = 1\n\n[[site]]\nreference = "layers.*.attn"\n'
                       'port = "layers.*.attn"\ncall = "tests.real_pairs_cases:_halves"\n',
                       encoding="utf-8")
    with pytest.raises(MappingError, match=r"call adapter tests.real_pairs_cases:_halves "
                                           r"failed on the reference's call of layers.0.attn#0"):
        diff(reference, folder / "port_freqs.h5", mapping=mapping)


# ---- the pairing rules on their own

def _sig(name, *params):
    return Signature(tuple(Parameter(p, "positional", False, None) for p in params), name)


def test_pairing_by_name_position_and_reference_position():
    tensor = {"": "tensor 4,8"}
    ref = _sig("Ref.forward", "hidden_states", "mask")
    port = _sig("Port.forward", "x")
    found = pair_arguments({"hidden_states": tensor, "mask": {"": "tensor 8,8"}},
                           {"0": tensor}, ref, port)
    assert found.partner == {"hidden_states": "0"}
    assert set(found.not_taken) == {"mask"}
    # the same name wins over the place: the port takes mask first
    port = _sig("Port.forward", "mask", "hidden_states")
    found = pair_arguments({"0": tensor, "1": {"": "tensor 8,8"}},
                           {"mask": {"": "tensor 8,8"}, "hidden_states": tensor}, ref, port)
    assert found.partner == {"0": "hidden_states", "1": "mask"}


def test_without_a_port_signature_a_keyword_pairs_by_the_references_place():
    """A port in another framework records no signature: ``hidden_states=`` still finds the
    port's first positional argument, a mask of another shape at the second place does not."""
    ref = _sig("Ref.forward", "hidden_states", "mask")
    found = pair_arguments({"hidden_states": {"": "tensor 4,8"}, "mask": {"": "tensor 8,8"}},
                           {"0": {"": "tensor 4,8"}, "1": {"": "tensor 8,4"}}, ref, None)
    assert found.partner == {"hidden_states": "0"}


def test_a_root_model_output_pairs_with_a_plain_tensor_only_when_unambiguous():
    assert output_partners({"logits": "2,8,32", "loss": "", "past": ""},
                            {"0": "2,8,32", "1": ""}, {}) == {"logits": "0"}
    assert output_partners({"logits": "2,8,32"}, {"": "2,8,32"}, {}) == {"logits": ""}
    two = {"logits": "2,8,32", "hidden": "2,8,32"}
    assert output_partners(two, {"0": "2,8,32"}, {}) == {}
    assert output_partners(two, {"0": "2,8,32"}, {"logits": "0"}) == {"logits": "0"}


# ---- transformers' own GPT-2 (5.x, eager) against a nanoGPT port, renames and transposes only

@pytest.fixture(scope="module")
def hf_reference(folder):
    pytest.importorskip("transformers")
    return capture(cases.hf_gpt2(), folder / "hf_gpt2.h5", loss_scale=2.0 ** 20)


def _gpt_diff(folder, hf_reference, name):
    from pathlib import Path

    mapping = Path(__file__).parent / "gpt_port.map.toml"
    case = getattr(gpt_cases, name)()
    load_weights(case.model, hf_reference, mapping)
    port = capture(case, folder / f"gpt_{name}.h5", loss_scale=2.0 ** 20)
    return diff(hf_reference, port, mapping=mapping)


def test_hugging_face_gpt2_attention_bug_is_named_at_the_attention(folder, hf_reference):
    result = _gpt_diff(folder, hf_reference, "port_bug_attn_scale")
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [
        ("transformer.h.0.attn#0", "forward", "output")]
    assert "cannot-judge" not in set(result.rows["status"])
    taken = result.not_taken
    assert "attention_mask" in set(taken[taken["site"] == "transformer.h.0.attn#0"]["arg"])


def test_hugging_face_gpt2_against_the_faithful_nanogpt_port_passes(folder, hf_reference):
    result = _gpt_diff(folder, hf_reference, "port")
    assert result, result.failing()[["site", "role", "arg", "ratio", "note"]]


def test_a_keyword_at_a_later_place_is_not_paired_by_place():
    """Only the reference's first parameter pairs by place with the port's first (replay's
    rule): the third place of two signatures often holds different things."""
    def ref_forward(hidden_states, attention_mask=None, position_ids=None): ...

    def port_forward(x, mask, pos_scale=None): ...

    pairing = pair_arguments(
        {"hidden_states": {"": "tensor 2,8,16"}, "position_ids": {"": "tensor 1,8"}},
        {"0": {"": "tensor 2,8,16"}, "1": {"": "tensor 8,8"}, "2": {"": "tensor 8"}},
        Signature.of(ref_forward), Signature.of(port_forward))
    assert pairing.partner == {"hidden_states": "0"}
    assert set(pairing.not_taken) == {"position_ids"}


class _DetachingBlock(torch.nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.lin, self.detach = torch.nn.Linear(8, 8), detach

    def forward(self, x):
        return torch.tanh(self.lin(x.detach() if self.detach else x))


class _Chain(torch.nn.Module):
    def __init__(self, detach: bool) -> None:
        super().__init__()
        self.a, self.b = torch.nn.Linear(8, 8), _DetachingBlock(detach)

    def forward(self, x):
        return self.b(self.a(x))


def _chain(detach: bool):
    from layerdiff import Case

    torch.manual_seed(0)
    return Case(model=_Chain(detach), inputs=(torch.randn(4, 8),),
                loss_fn=lambda out: out.pow(2).mean(), name="chain")


def test_a_port_that_detaches_an_input_fails_where_the_gradient_stops(tmp_path):
    """A detached input leaves the port's gradient None: compared with zeros, the diff fails
    at the innermost call whose input got none (the detach is in it or just before it), and
    the layer before, which never trains, fails its weight gradient."""
    result = diff(capture(_chain(False), tmp_path / "ref.h5"),
                  capture(_chain(True), tmp_path / "port.h5"))
    assert not result.passed
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [
        ("b.lin#0", "backward", "grad_input")]
    assert "b#0" in result.origin.holders
    absent = result.rows[result.rows["match"] == "absent"]
    assert {(site, role) for site, role in zip(absent["site"], absent["role"], strict=True)} \
        >= {("b.lin#0", "grad_input"), ("b#0", "grad_input"), ("a#0", "weight_grad")}
    assert absent["note"].str.contains("the port sent no gradient here").all()
    assert (absent["verdict"] == "out").all()


def test_a_faithful_chain_has_no_absent_gradient(tmp_path):
    result = diff(capture(_chain(False), tmp_path / "ref.h5"),
                  capture(_chain(False), tmp_path / "port.h5"))
    assert result.passed and not (result.rows["match"] == "absent").any()


@pytest.mark.parametrize(("name", "culprit", "with_adapters"), [
    ("port_self", None, False), ("port_self_bug_mlp", "layers.0.mlp", False),
    ("port_freqs", None, True), ("port_freqs_bug_rotary", "layers.1.attn", True)])
def test_bisect_names_the_planted_layer_and_nothing_on_the_faithful_ports(
        adapters, name, culprit, with_adapters):
    """Swapped in where the Hugging Face-style reference calls its layers by keyword (and, for
    port_freqs, through the call adapters), each port layer is judged: the faithful ports find
    nothing to find in one probe, a bug is named where it was planted, and nothing is set aside."""
    from layerdiff.replay import Swapper, bisect

    result = bisect(Swapper(cases.reference, getattr(cases, name),
                            adapters if with_adapters else None))
    assert not result.cannot_judge, result.cannot_judge
    if culprit is None:
        assert result.outcome == "nothing-to-find" and len(result.probes) == 1
    else:
        assert [port for _, port in result.culprits] == [culprit], result.probes
