"""Hints on bugs written after the rules were frozen, in a pair built by others: Hugging Face's
GPT-2 (random config) against the nanoGPT port. Each bug's origin and the kind of its hint;
q and k swapped in the fused projection's split is a mistake no kind describes (the scores
transpose), so it expects none, and any hint there would be a false one."""

from __future__ import annotations

import pytest

from layerdiff import capture, diff, load_case, load_weights

pytest.importorskip("transformers")

MAP = "reference_models/hf_gpt2.map.toml"
BUGS = {  # bug: (reference origin site, pass, hint kind)
    "silu_block0": ("transformer.h.0.mlp.act#0", "forward", "activation"),
    "relu_mlp": ("transformer.h.1.mlp.act#0", "forward", "activation"),
    "gelu_erf": ("transformer.h.0.mlp.act#0", "forward", "approximation"),
    "no_residual_block1": ("transformer.h.1#0", "forward", "missing-term"),
    "ln_eps": ("transformer.h.1.ln_2#0", "forward", "epsilon"),
    "not_causal": ("transformer.h.0.attn#0", "forward", "mask"),
    "scale_twice": ("transformer.h.1.attn#0", "forward", "scale"),
    "heads_merged_wrong": ("transformer.h.1.attn#0", "forward", "transpose"),
    "qk_swapped": ("transformer.h.0.attn#0", "forward", None),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return capture(load_case("reference_models.hf_gpt2:reference"),
                   tmp_path_factory.mktemp("gpt") / "ref.h5")


@pytest.mark.slow
@pytest.mark.parametrize("bug", sorted(BUGS))
def test_a_held_out_gpt2_bug_is_named_at_its_site_with_its_kind(reference, tmp_path, bug):
    case = load_case(f"tests.gpt_hint_bugs:{bug}")
    load_weights(case.model, reference, MAP)
    result = diff(reference, capture(case, tmp_path / "port.h5"), mapping=MAP)
    site, pass_, kind = BUGS[bug]
    assert (result.origin.site, result.origin.pass_) == (site, pass_)
    assert (result.origin.hint or {}).get("kind") == kind
