"""Inputs compared through a call adapter are judged by ``--baseline`` like any record.

The pair: Hugging Face's Llama in float32 (the reference), the same model under autocast
bfloat16 (the baseline), and the Meta-style port under autocast bfloat16 with the reference's
weights. Layer 1's block and attention take their hidden states through a call adapter
(reference_models/hf_llama.map.toml); in bfloat16 those carry layer 0's rounding, hundreds of
times float32's tolerance, so without the baseline they failed and a faithful port had no
origin, and a bug in layer 1's attention could not be named there (its input failed).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from click.testing import CliRunner

from layerdiff import diff
from layerdiff.cli import main
from layerdiff.report.findings.diff import describe_origin

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"
LOSS_SCALE = 2**20


def port_bug_mask_layer1():
    """Layer 1's causal mask lets each position see the next one: a bug at the site whose
    inputs come through the call adapter with bfloat16's error. (The bundled attention bugs,
    a wrong score scale or rotation, move this tiny model's near-uniform softmax by under
    bfloat16's resolution: 1.8x the baseline's rms error, inside its allowance.)"""
    import torch

    from reference_models import llama_port

    class MaskOffByOne(llama_port.Attention):
        def forward(self, x, freqs_cos, freqs_sin):
            self.mask = torch.triu(torch.full_like(self.mask, float("-inf")), diagonal=2)  # BUG
            return super().forward(x, freqs_cos, freqs_sin)

    return llama_port._planted("port_bug_mask_layer1", "layers.1.attention", MaskOffByOne)


def copied_attention_call(*args, **kwargs):
    """hf_llama_convert's adapter, with its rotary halves copied: tensors the adapter made."""
    from reference_models import hf_llama_convert

    (hidden, cos, sin), _ = hf_llama_convert.attention_call(*args, **kwargs)
    return (hidden, cos.clone(), sin.clone()), {}


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("adapted_baseline")

    def capture(name: str, spec: str, *extra) -> Path:
        path = folder / f"{name}.h5"
        result = CliRunner().invoke(main, [str(a) for a in (
            "capture", spec, "-o", path, "--loss-scale", LOSS_SCALE, *extra)])
        assert result.exit_code == 0, result.output
        return path

    reference = capture("reference", "reference_models.hf_llama:reference")
    bf16 = ("--autocast", "bfloat16")
    ported = ("--weights-from", reference, "--map", LLAMA_MAP, *bf16)
    return {
        "reference": reference,
        "baseline": capture("baseline", "reference_models.hf_llama:reference", *bf16),
        "port": capture("port", "reference_models.llama_port:port", *ported),
        "bug": capture("bug", "tests.test_adapted_baseline:port_bug_mask_layer1", *ported),
    }


def _adapted(result, site: str, arg: str):
    rows = result.rows
    found = rows[(rows["match"] == "adapted") & (rows["site"] == site) & (rows["arg"] == arg)
                 & (rows["role"] == "input")]
    assert len(found) == 1, found
    return found.iloc[0]


def test_faithful_bf16_port_passes_with_a_baseline_through_call_adapters(traces):
    result = diff(traces["reference"], traces["port"], mapping=LLAMA_MAP,
                  baseline=traces["baseline"])
    failing = result.rows[~result.rows["verdict"].isin(["identical", "within"])]
    assert result, failing[["site", "role", "arg", "ratio", "tol_source"]].to_string()
    # the hidden states passed through unchanged: the argument's own record, rms rule included
    for site, arg in (("model.layers.1#0", "0"), ("model.layers.1.self_attn#0", "hidden_states")):
        row = _adapted(result, site, arg)
        assert row["tol_source"].startswith("baseline"), row["tol_source"]
        assert row["rms_tol"] > 0 and row["rms"] > 0  # bfloat16's error, judged by the rms rule
        assert row["ratio"] < 1
    # the rotary halves are views of cos and sin: each element within cos's worst error
    row = _adapted(result, "model.layers.1.self_attn#0", "freqs_cos")
    assert "position_embeddings.0" in row["tol_source"] and "view" in row["tol_source"]


def test_without_the_baseline_the_bf16_inputs_fail_at_float32_tolerance(traces):
    """What the baseline is for: the same adapted rows fail at float32's tolerance."""
    result = diff(traces["reference"], traces["port"], mapping=LLAMA_MAP)
    row = _adapted(result, "model.layers.1.self_attn#0", "hidden_states")
    assert row["verdict"] == "out" and row["ratio"] > 10


def test_attention_bug_behind_an_adapter_is_named_at_the_attention(traces):
    result = diff(traces["reference"], traces["bug"], mapping=LLAMA_MAP,
                  baseline=traces["baseline"])
    assert not result
    origin = result.origin
    assert (origin.port_site, origin.pass_) == ("layers.1.attention#0", "forward"), \
        [describe_origin(o) for o in result.origins]
    assert all(o.port_site != "layers.1#0" for o in result.origins)


def test_tensors_the_adapter_computed_say_they_have_no_baseline(traces, tmp_path):
    text = LLAMA_MAP.read_text().replace("reference_models.hf_llama_convert:attention_call",
                                         "tests.test_adapted_baseline:copied_attention_call")
    mapping = tmp_path / "copied.map.toml"
    mapping.write_text(text)
    result = diff(traces["reference"], traces["port"], mapping=mapping,
                  baseline=traces["baseline"])
    assert result
    row = _adapted(result, "model.layers.1.self_attn#0", "freqs_cos")
    assert row["rms_tol"] is None or row["rms_tol"] != row["rms_tol"]  # None (NaN in a frame)
    assert "no baseline" in row["tol_source"] and "float32" in row["tol_source"]
    # the hidden states are still passed through: still the baseline's
    assert _adapted(result, "model.layers.1.self_attn#0",
                    "hidden_states")["tol_source"].startswith("baseline")
