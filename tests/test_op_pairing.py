"""Op sites of other names paired inside a module pair (compare/op_alignment.py): a custom
autograd function in a torch op's place pairs by position and shapes, a fused function as a
group for the ops it stands for; ambiguous or uneven places are refused with the reason; a bug in
such a function's backward is named at that op."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff, load_case, load_weights
from layerdiff.compare.op_alignment import OpInput, OpRecords, align_gap
from layerdiff.report.html import render_html
from layerdiff.report.terminal import format_diff
from reference_models import op_bugs, op_pairing

REFERENCE = f"{op_bugs.MODULE}:reference"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return capture(load_case(REFERENCE), tmp_path_factory.mktemp("pairing") / "ref.h5",
                   ops=["*"])


def _port(spec_or_case, reference, path):
    case = load_case(spec_or_case) if isinstance(spec_or_case, str) else spec_or_case
    load_weights(case.model, reference, None)
    return capture(case, path, ops=["*"])


def _case(name: str) -> str:
    return f"{op_pairing.MODULE}:{name}"


# ---- a custom autograd function in softmax's place: paired by position


def test_custom_function_in_a_torch_ops_place_pairs_by_position_and_passes(reference, tmp_path):
    result = diff(reference, _port(_case("custom_softmax_port"), reference, tmp_path / "p.h5"))
    assert result.passed and not result.origins
    made = {(p["reference"], p["port"], p["match"]) for p in result.meta["op_pairings"]}
    assert made == {(f"blocks.{i}.attn#0/softmax#0", f"blocks.{i}.attn#0/MySoftmax#0",
                     "position") for i in (0, 1)}
    assert not any("/" in site for site in result.unmatched["site"])  # every op pairs
    compared = result.rows[result.rows["site"] == "blocks.1.attn#0/softmax#0"]
    assert set(compared["role"]) == {"input", "output", "grad_output", "grad_input"}
    assert (compared["ratio"] > 0).any()  # really another computation, within tolerance


def test_custom_function_backward_bug_is_named_at_that_op(reference, tmp_path):
    port = _port(_case("bug_custom_softmax_backward"), reference, tmp_path / "p.h5")
    result = diff(reference, port)
    origin = result.origin
    assert (origin.site, origin.port_site, origin.pass_, origin.role, origin.step) == (
        "blocks.1.attn#0/softmax#0", "blocks.1.attn#0/MySoftmax#0", "backward", "grad_input",
        0)
    assert [o.site for o in result.origins] == [origin.site]
    assert origin.reason.startswith("its grad_input is out of tolerance while the gradient "
                                    "arriving at its outputs and its forward are within")
    assert origin.pairing.startswith("paired by position: port op MySoftmax#0 has the shape "
                                     "and place of softmax#0")
    assert result.as_json()["origin"]["pairing"] == origin.pairing
    text = format_diff(result)
    assert "paired by position: port op MySoftmax#0" in text
    assert "in the port: blocks.1.attn#0/MySoftmax#0" in text
    origins = render_html(result).split('<ol class="origins">', 1)[1].split("</ol>", 1)[0]
    assert "paired by position: port op MySoftmax#0" in origins


# ---- a fused function for mul, masked_fill and softmax: paired as a group


def test_fused_function_pairs_as_a_group_and_passes(reference, tmp_path):
    result = diff(reference, _port(_case("fused_softmax_port"), reference, tmp_path / "p.h5"))
    assert result.passed and not result.origins
    group = [p for p in result.meta["op_pairings"] if p["reference"].startswith("blocks.0.")]
    assert [(p["reference"].rpartition("/")[2], p["match"]) for p in group] == [
        ("mul#0", "group"), ("masked_fill#0", "group"), ("softmax#0", "group")]
    assert "stands for mul#0, masked_fill#0, softmax#0" in group[0]["why"]
    rows = result.rows[result.rows["port_site"] == "blocks.0.attn#0/FusedScaleMaskSoftmax#0"]
    compared = set(zip(rows["site"].str.rpartition("/")[2], rows["role"], rows["arg"],
                       rows["port_arg"], strict=True))
    # the group's output is its last op's; its inputs, those coming into it (scores, mask)
    assert {("softmax#0", "output", "0", "0"), ("softmax#0", "grad_output", "0", "0"),
            ("mul#0", "input", "0", "0"), ("mul#0", "grad_input", "0", "0"),
            ("masked_fill#0", "input", "1", "1")} <= compared
    assert not any(site == "mul#0" and role == "output" for site, role, _, _ in compared)
    assert result.unmatched[result.unmatched["side"] == "port"].empty


def test_fused_function_backward_bug_is_named_at_the_group(reference, tmp_path):
    port = _port(_case("bug_fused_softmax_backward"), reference, tmp_path / "p.h5")
    result = diff(reference, port)
    origin = result.origin
    assert (origin.port_site, origin.pass_, origin.role, origin.step) == (
        "blocks.1.attn#0/FusedScaleMaskSoftmax#0", "backward", "grad_input", 0)
    assert origin.site == "blocks.1.attn#0/mul#0"  # where the group's input gradient is
    assert len(result.origins) == 1
    assert origin.pairing.startswith("paired as a group: port op FusedScaleMaskSoftmax#0 "
                                     "stands for mul#0, masked_fill#0, softmax#0")


# ---- refused: SDPA against its explicit ops, and places that position cannot decide


def test_sdpa_pairs_as_a_group_with_its_explicit_ops_and_passes(reference, tmp_path):
    result = diff(reference, _port(f"{op_bugs.MODULE}:port", reference, tmp_path / "p.h5"))
    assert result.passed and not result.origins
    group = [p for p in result.meta["op_pairings"] if p["reference"].startswith("blocks.0.")]
    assert [p["reference"].rpartition("/")[2] for p in group] == [
        "matmul#0", "mul#0", "masked_fill#0", "softmax#0", "matmul#1"]
    assert group[0]["why"].endswith("matmul#0's input 1 as its input 1 transposed)")
    rows = result.rows[(result.rows["step"] == 0)
                       & (result.rows["port_site"] == f"blocks.0.attn#0/{SDPA}")]
    compared = {(site.rpartition("/")[2], role, arg, port_arg): (shape, port_shape, ratio)
                for site, role, arg, port_arg, shape, port_shape, ratio in zip(
                    rows["site"], rows["role"], rows["arg"], rows["port_arg"], rows["shape"],
                    rows["port_shape"], rows["ratio"], strict=True)}
    # q, k^T (the port's k with its last two axes swapped) and v in; the weighted sum out
    assert set(compared) == {("matmul#0", "input", "0", "0"), ("matmul#0", "input", "1", "1"),
                             ("matmul#1", "input", "1", "2"), ("matmul#1", "output", "0", "0"),
                             ("matmul#1", "grad_output", "0", "0"),
                             ("matmul#0", "grad_input", "0", "0"),
                             ("matmul#0", "grad_input", "1", "1"),
                             ("matmul#1", "grad_input", "1", "2")}
    shape, port_shape, ratio = compared[("matmul#0", "input", "1", "1")]
    assert shape == port_shape == "4,4,8,10" and ratio == 0  # the same values, transposed
    assert not any("/" in site for site in result.unmatched["site"])


SDPA = "scaled_dot_product_attention#0"


class _NotCausal(op_bugs.SDPAAttention):
    def forward(self, x):
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, op_bugs.HEADS, op_bugs.HEAD).permute(
            2, 0, 3, 1, 4)
        y = torch.nn.functional.scaled_dot_product_attention(heads[0], heads[1], heads[2])
        return self.proj(y.permute(0, 2, 1, 3).reshape(batch, length, width))  # BUG: no mask


def test_a_wrong_sdpa_call_is_named_at_the_group(reference, tmp_path):
    case = load_case(f"{op_bugs.MODULE}:port")
    case.model.blocks[1].attn.__class__ = _NotCausal
    result = diff(reference, _port(case, reference, tmp_path / "p.h5"))
    origin = result.origin
    assert (origin.site, origin.port_site, origin.pass_, origin.role, origin.step) == (
        "blocks.1.attn#0/matmul#1", f"blocks.1.attn#0/{SDPA}", "forward", "output", 0)
    assert len(result.origins) == 1
    assert origin.pairing.startswith(f"paired as a group: port op {SDPA} stands for matmul#0, "
                                     "mul#0, masked_fill#0, softmax#0, matmul#1")
    causes = result.rows.loc[result.rows["status"] == "propagated", "cause"]
    assert set(causes) == {"blocks.1.attn#0/matmul#1", "step 0 (blocks.1.attn#0/matmul#1)"}


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        y = torch.sigmoid(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * y * (1 - y)


class _Tanh(torch.autograd.Function):
    wrong = False

    @staticmethod
    def forward(ctx, x):
        y = torch.tanh(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad):
        (y,) = ctx.saved_tensors
        return grad * (1 - y) if _Tanh.wrong else grad * (1 - y * y)  # BUG when wrong


class _Gated(nn.Module):
    """sigmoid(h) * tanh(h) in its own code: two ops with the same output shape."""

    def __init__(self, custom: bool) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.custom = custom

    def forward(self, x):
        h = self.fc(x)
        if self.custom:
            return _Sigmoid.apply(h) * _Tanh.apply(h)
        return torch.sigmoid(h) * torch.tanh(h)


def _gated_case(custom: bool) -> Case:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _Gated(custom), nn.Linear(6, 2))
    x = torch.randn(5, 6)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                steps=1, name="tests.gated")


@pytest.mark.parametrize("wrong", [False, True])
def test_two_ops_with_the_same_shapes_between_anchors_are_refused(tmp_path, wrong, monkeypatch):
    monkeypatch.setattr(_Tanh, "wrong", wrong)
    ref = capture(_gated_case(False), tmp_path / "ref.h5", ops=["*"])
    port = _port(_gated_case(True), ref, tmp_path / "port.h5")
    result = diff(ref, port)
    assert result.meta["op_pairings"] == []
    why = result.unmatched.set_index("site")["reason"]["1#0/sigmoid#0"]
    assert why == ("ambiguous ([[pair]] in a mapping pairs them): in 1#0 before mul#0 the "
                   "reference runs sigmoid#0, tanh#0 and the port _Sigmoid#0, _Tanh#0, all with "
                   "outputs (5,6) float: position and shapes cannot tell which is which")
    if not wrong:
        assert result.passed
    else:  # not guessed: the fault is named at the module whose own code holds it
        assert (result.origin.site, result.origin.pass_) == ("1#0", "backward")
        assert result.origin.pairing == ""


# ---- the rule itself


def _op(site: str, out: str, *inputs: tuple[str, str], kind: str = "float") -> OpRecords:
    return OpRecords(site, (("0", out, kind),),
                     tuple(OpInput(arg, shape, "float", f"{site}:{arg}")
                           for arg, shape in inputs), frozenset({f"{site}:out"}))


def test_uneven_gaps_and_other_shapes_are_refused():
    refs = {s: _op(s, "2,3", ("0", "2,3")) for s in ("m#0/a#0", "m#0/b#0", "m#0/c#0")}
    ports = {s: _op(s, "2,3", ("0", "2,3")) for s in ("m#0/X#0", "m#0/Y#0")}
    pairs, refused = align_gap(list(refs), list(ports), refs, ports, before=None, after=None,
                               call="m#0")
    assert not pairs and "there the reference runs 3 and the port 2" in refused["m#0/a#0"]
    other = {"m#0/X#0": _op("m#0/X#0", "3,2", ("0", "2,3"))}
    pairs, refused = align_gap(["m#0/a#0"], ["m#0/X#0"], refs, other, before="p#0",
                               after="q#0", call="m#0")
    assert not pairs and "whose outputs ((3,2) float) are not its ((2,3) float)" in refused[
        "m#0/a#0"]
    # the same outputs but another input: compared, they would leave an input without partner
    extra = {"m#0/X#0": _op("m#0/X#0", "2,3", ("0", "2,3"), ("1", "3"))}
    pairs, refused = align_gap(["m#0/a#0"], ["m#0/X#0"], refs, extra, before="p#0",
                               after="q#0", call="m#0")
    assert not pairs and "other floating-point inputs" in refused["m#0/a#0"]


def test_a_square_matmul_operand_is_refused_as_a_group_input():
    """k^T and k of one shape: whether the fused op takes it transposed cannot be told."""
    refs = {"m#0/matmul#0": _op("m#0/matmul#0", "2,4,4", ("0", "2,4,4"), ("1", "2,4,4")),
            "m#0/softmax#0": _op("m#0/softmax#0", "2,4,4", ("0", "2,4,4"))}
    refs["m#0/softmax#0"] = OpRecords("m#0/softmax#0", (("0", "2,4,4", "float"),),
                                      (OpInput("0", "2,4,4", "float", "m#0/matmul#0:out"),))
    fused = {"m#0/F#0": _op("m#0/F#0", "2,4,4", ("0", "2,4,4"), ("1", "2,4,4"))}
    pairs, refused = align_gap(list(refs), list(fused), refs, fused, before=None, after=None,
                               call="m#0")
    assert not pairs
    assert refused["m#0/matmul#0"].endswith(
        "theirs do not line up, matmul#0 input 1 (2,4,4) against F#0 input 1 (2,4,4)")


def test_a_group_whose_output_is_not_the_last_ops_is_refused():
    refs = {"m#0/a#0": _op("m#0/a#0", "2,3", ("0", "2,3")),
            "m#0/b#0": _op("m#0/b#0", "2,2", ("0", "2,3"))}
    fused = {"m#0/F#0": _op("m#0/F#0", "2,3", ("0", "2,3"))}
    pairs, refused = align_gap(list(refs), list(fused), refs, fused, before=None, after=None,
                               call="m#0")
    assert not pairs and refused["m#0/b#0"].startswith("not paired as a group with the port's F#0")
    assert refused["m#0/b#0"].endswith("its outputs ((2,3) float) are not the last one's "
                                       "((2,2) float)")
