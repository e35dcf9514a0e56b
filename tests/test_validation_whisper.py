"""The encoder-decoder validation pair (issue 39): transformers' own
``WhisperForConditionalGeneration`` against a Whisper written the way OpenAI's ``model.py``
writes it (``tests/validation/``: both models unedited, wired by a case file and a mapping
drafted by ``map-suggest``), with one planted bug per case. Every command gives the right
answer: the faithful port passes map-check, diff and replay, and bisect names no culprit; each
bug is named at its site and pass by diff and replay, swap breaks with the planted layer and
not with a faithful one, and bisect names the planted layer (a container's own code)."""

from __future__ import annotations

from pathlib import Path

import pytest

from layerdiff import capture, diff, load_case
from layerdiff.capture.port import capture_port
from layerdiff.replay import ReplayOutcome, Swapper, bisect, replay
from layerdiff.replay.bisect import BisectOutcome
from layerdiff.replay.mapcheck import map_check
from layerdiff.replay.swap import SwapOutcome
from layerdiff.report.findings.diff import describe_origin
from tests.validation import whisper_cases as cases

pytestmark = pytest.mark.slow

CASES = "tests.validation.whisper_cases"
MAP = Path(__file__).parent / "validation" / "whisper.map.toml"

# bug -> (reference module, port module, pass) where it is planted
BUGS = {
    "bug_cross_scale": ("model.decoder.layers.1.encoder_attn", "decoder.blocks.1.cross_attn",
                        "forward"),
    "bug_gelu_tanh": ("model.encoder.layers.1.activation_fn", "encoder.blocks.1.mlp.1",
                      "forward"),
    "bug_conv2_padding": ("model.encoder.conv2", "encoder.conv2", "forward"),
    "bug_ln_eps": ("model.decoder.layers.1.final_layer_norm", "decoder.blocks.1.mlp_ln",
                   "forward"),
    "bug_backward": ("model.decoder.layers.0.activation_fn", "decoder.blocks.0.mlp.1",
                     "backward"),
    "bug_residual": ("model.decoder.layers.0", "decoder.blocks.0", "forward"),
}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("whisper")
    ref = capture(load_case(f"{CASES}:reference"), folder / "ref.h5", progress=False)
    cache = {"reference": ref}

    def get(name: str) -> Path:
        if name not in cache:
            cache[name] = capture_port(f"{CASES}:{name}", folder / f"{name}.h5",
                                       weights_from=ref, mapping=MAP, progress=False)
        return cache[name]
    return get


def test_map_check_passes_the_draft_with_its_adapters(traces):
    check = map_check(traces("reference"), load_case(f"{CASES}:port"), MAP)
    assert check.passed


def test_the_faithful_port_passes_diff_and_replay(traces):
    result = diff(traces("reference"), traces("port"), mapping=MAP)
    assert result.origin is None and result.passed
    replayed = replay(traces("reference"), load_case(f"{CASES}:port"), mapping=MAP)
    assert replayed.outcome == ReplayOutcome.PASS, replayed.local
    # the tied head in the decoder's own code: the embedding's gradient is set aside, not failed
    why = dict(replayed.skipped)["decoder.token_embedding#0 weight_grad weight"]
    assert why.startswith("cannot judge alone: decoder.token_embedding.weight is also used at "
                          "decoder"), why


@pytest.mark.parametrize("bug", list(BUGS))
def test_diff_and_replay_name_each_bug_at_its_site_and_pass(traces, bug):
    ref_module, port_module, pass_ = BUGS[bug]
    origin = diff(traces("reference"), traces(bug), mapping=MAP).origin
    assert origin is not None
    assert (origin.site, origin.port_site, origin.pass_) == (
        f"{ref_module}#0", f"{port_module}#0", pass_), describe_origin(origin)
    replayed = replay(traces("reference"), load_case(f"{CASES}:{bug}"), mapping=MAP,
                      sites=[ref_module])
    table = replayed.local
    local = set(zip(table.loc[table["verdict"] == "LOCAL ERROR", "site"],
                    table.loc[table["verdict"] == "LOCAL ERROR", "pass"], strict=True))
    assert (f"{ref_module}#0", pass_) in local, table
    assert {site for site, _ in local} == {f"{ref_module}#0"}, table


@pytest.fixture(scope="module")
def cross_scale():
    return Swapper(cases.reference, cases.bug_cross_scale, MAP)


def test_swap_breaks_with_the_planted_layer_only(cross_scale):
    assert cross_scale.run(["decoder.blocks.1.cross_attn"]).outcome == SwapOutcome.BREAKS
    assert cross_scale.run(["decoder.blocks.0.cross_attn"]).outcome == SwapOutcome.WITHIN


def test_bisect_names_the_planted_container(cross_scale):
    result = bisect(cross_scale)
    assert result.outcome == BisectOutcome.CULPRITS, result.probes
    assert result.culprits == [("model.decoder.layers.1.encoder_attn",
                                "decoder.blocks.1.cross_attn")]


def test_bisect_names_no_culprit_on_the_faithful_port():
    """The port's decoder returns the logits (its tied head is its own code) where HF's returns
    the hidden states: it cannot stand in for HF's decoder, and nothing around it can, so the
    search cannot conclude; every layer it could judge is within."""
    result = bisect(Swapper(cases.reference, cases.port, MAP))
    assert not result.culprits
    assert [c.layers for c in result.cannot_judge] == [["decoder"]], result.cannot_judge
