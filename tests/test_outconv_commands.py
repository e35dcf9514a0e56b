"""Swap, bisect and map-check compare a site's outputs through the diff's output conversions
(compare/outconv.py ``SiteConversions``), and an attention bug in bfloat16 is named at the
attention when what its backward hands q/k is the first record out.

The pair is hf_llama.map.toml's: Hugging Face's Llama against the Meta-style port, q/k
projections paired, their outputs compared through the inverse of the weights' RoPE row
permutation. Tiny random config, no downloads; skipped without transformers.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from click.testing import CliRunner

from layerdiff import diff, load_case
from layerdiff.cli import main
from layerdiff.replay import Swapper, bisect
from layerdiff.replay.mapcheck import SUSPICIOUS_CONVERSION, map_check
from layerdiff.replay.swap import SwapOutcome
from layerdiff.report.findings.diff import describe_origin

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"
REFERENCE = "reference_models.hf_llama:reference"
PORT = "reference_models.llama_port:port"


def doubled(output):
    """A wrong output conversion: the port's v projection is the reference's already."""
    return output * 2


def weighted(first, second):
    """An output conversion taking two outputs, of a layer that returns one."""
    return first * second


def _with_output_transform(tmp_path: Path, value: str) -> Path:
    text = LLAMA_MAP.read_text(encoding="utf-8")
    rule = '[[site]]\nreference = "model.layers.*.self_attn.v_proj"\nport = "layers.*.attention.wv"'
    assert rule in text
    path = tmp_path / "llama.map.toml"
    path.write_text(text.replace(rule, f"{rule}\noutput_transform = {value}"), encoding="utf-8")
    return path


def _factory(spec: str):
    return lambda: load_case(spec)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("outconv_commands")


def _capture(folder: Path, name: str, spec: str, *extra) -> Path:
    path = folder / f"{name}.h5"
    if not path.exists():
        result = CliRunner().invoke(main, [str(a) for a in (
            "capture", spec, "-o", path, "--loss-scale", 2**20, *extra)])
        assert result.exit_code == 0, result.output
    return path


def test_a_qk_projection_swapped_in_either_way_keeps_the_model_within_tolerance():
    """The port's wq/wk give their rows interleaved; swapped into HF's attention their outputs
    go through the inverse permutation (and the gradient back through it), so the faithful
    projections break nothing; HF's projections go into the port the other way round."""
    swapper = Swapper(_factory(REFERENCE), _factory(PORT), LLAMA_MAP)
    for sites, into in ((["layers.0.attention.wq"], "reference"),
                        (["layers.0.attention.wq", "layers.0.attention.wk"], "port")):
        result = swapper.run(sites, into=into)
        assert result.outcome == SwapOutcome.WITHIN, result.describe()
        if into == "reference":  # the swapped layer's weight gradient, through the conversion
            assert any("weight_grad model.layers" in row.what and "(port layers." in row.what
                       for row in result.rows), [row.what for row in result.rows]


def test_a_conversion_the_swapped_layer_cannot_feed_is_cannot_judge(tmp_path):
    mapping = _with_output_transform(
        tmp_path, f'{{ function = "{__name__}:weighted", takes = ["0", "1"] }}')
    result = Swapper(_factory(REFERENCE), _factory(PORT), mapping).run(
        ["layers.0.attention.wv"])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE, result.describe()
    text = result.describe()
    assert text.startswith("cannot judge the swap of layers.0.attention.wv") and "\n" not in text
    assert "takes the output(s) '1'" in text and f"{__name__}:weighted" in text


def test_map_check_fails_a_wrong_output_conversion(folder, tmp_path):
    reference = _capture(folder, "reference", REFERENCE)
    check = map_check(reference, load_case(PORT),
                      _with_output_transform(tmp_path, f'"{__name__}:doubled"'))
    assert not check.passed
    failing = {entry.port: entry for entry in check.failing()}
    assert set(failing) == {"layers.0.attention.wv.weight", "layers.1.attention.wv.weight"}, \
        failing
    entry = failing["layers.0.attention.wv.weight"]
    assert entry.status == SUSPICIOUS_CONVERSION
    assert "model.layers.0.self_attn.v_proj#0" in entry.note and "doubled" in entry.note


def test_bisect_names_the_attention_not_the_qk_projections():
    """Before swap converted their outputs, every probe holding a q/k projection broke the
    reference, and bisect named all four projections for the attention bug."""
    swapper = Swapper(_factory(REFERENCE), _factory("reference_models.llama_port:"
                                                    "port_bug_attention"), LLAMA_MAP)
    result = bisect(swapper)
    assert result.culprits == [("model.layers.1.self_attn", "layers.1.attention")], \
        result.culprits
    assert not result.cannot_judge


def test_a_bfloat16_attention_bug_is_named_at_the_attention_backward(folder):
    """In bfloat16 with a bfloat16 baseline, the attention scaled by 1/head_dim stays within
    the baseline's spread at its output and at its input gradient (a sum over q, k and v);
    the first record out is q/k's grad_output, which the attention's own backward (softmax,
    scale, rotary) makes from a gradient arriving within tolerance. Without counting what a
    container hands its children as its own result, the diff named no origin."""
    reference = _capture(folder, "reference", REFERENCE)
    bf16 = ("--dtype", "bfloat16")
    baseline = _capture(folder, "baseline_bf16", REFERENCE, *bf16)
    port = _capture(folder, "bug_bf16", "reference_models.llama_port:port_bug_attention",
                    "--weights-from", reference, "--map", LLAMA_MAP, *bf16)
    result = diff(reference, port, mapping=LLAMA_MAP, baseline=baseline)
    assert not result
    origin = result.origin
    assert origin is not None, "no origin"
    assert (origin.port_site, origin.pass_) == ("layers.1.attention#0", "backward"), \
        describe_origin(origin)
    assert "self_attn.q_proj#0" in origin.reason and "own backward code" in origin.reason


# ---------------------------------------------------------------- experts: a weighting function

def test_experts_swapped_in_return_the_weighted_sum_and_a_bug_in_one_breaks_it(tmp_path):
    """The port's experts return (routing weights, unweighted outputs); swapped into the
    reference's MoE block, whose code takes their weighted sum, they go through the rule's
    function, gradient included (the weight gradient of the experts is compared)."""
    from tests import test_output_layouts as moe

    mapping = tmp_path / "moe.map.toml"
    mapping.write_text(moe.MOE_MAP, encoding="utf-8")
    outcomes = {}
    for experts in (moe.PortExperts, moe.BuggyPortExperts):
        swapper = Swapper(lambda: moe._moe_case(moe.ReferenceExperts),
                          lambda e=experts: moe._moe_case(e), mapping)
        result = swapper.run(["moe.experts"])
        outcomes[experts.__name__] = result.outcome
        assert any(row.what.startswith("weight_grad moe.experts.w (port moe.experts.w)")
                   for row in result.rows), [row.what for row in result.rows]
    assert outcomes == {"PortExperts": SwapOutcome.WITHIN,
                        "BuggyPortExperts": SwapOutcome.BREAKS}, outcomes


def test_map_check_measures_the_experts_through_their_output_conversion(tmp_path):
    from layerdiff import capture
    from tests import test_output_layouts as moe

    mapping = tmp_path / "moe.map.toml"
    mapping.write_text(moe.MOE_MAP, encoding="utf-8")
    reference = capture(moe._moe_case(moe.ReferenceExperts), tmp_path / "ref.h5")
    check = map_check(reference, moe._moe_case(moe.PortExperts), mapping)
    entry = {e.port: e for e in check.entries}["moe.experts.w"]
    assert check.passed and entry.status == "ok", entry.note
    assert "at moe.experts#0 its outputs through output conversion" in entry.note
    wrong = tmp_path / "wrong.map.toml"  # the unweighted mean: shapes fit, numbers do not
    wrong.write_text(moe.MOE_MAP.replace(
        'function = "tests.test_output_layouts:weighted_sum"',
        f'function = "{__name__}:unweighted_mean"'), encoding="utf-8")
    check = map_check(reference, moe._moe_case(moe.PortExperts), wrong)
    assert [(e.port, e.status) for e in check.failing()] == [
        ("moe.experts.w", SUSPICIOUS_CONVERSION)], [e.note for e in check.failing()]


def unweighted_mean(weights, outputs):
    return outputs.mean(1)


def test_a_conversion_that_raises_or_returns_no_tensor_is_one_sentence_naming_it():
    """The user's function fails inside swap or map-check: one line naming the rule and where,
    never a traceback; the same check the diff's rows make (compare/outconv.py)."""
    import torch

    from layerdiff.compare.outconv import CannotConvert, convert_outputs
    from layerdiff.mapping.code import CodeRef
    from layerdiff.mapping.rules import OutputConversion

    conversion = OutputConversion(CodeRef("my_port.convert:weighted_sum", "port.map.toml line 7"),
                                  takes=("0",), gives="0")
    outputs = [("0", torch.ones(2, 3))]

    def boom(x):
        raise ValueError("shapes do not fit\nsecond line")

    with pytest.raises(CannotConvert) as raised:
        convert_outputs(conversion, boom, outputs, "the layer swapped in at experts")
    said = str(raised.value)
    assert "my_port.convert:weighted_sum" in said and "port.map.toml line 7" in said
    assert "ValueError: shapes do not fit" in said and "second line" not in said
    with pytest.raises(CannotConvert, match=r"returned a list .* one tensor"):
        convert_outputs(conversion, lambda x: [x], outputs, "the layer swapped in at experts")
