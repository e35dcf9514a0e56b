"""The Gemma validation pair (tests/validation/): transformers' GemmaForCausalLM against an
independent Flax NNX port in the gemma library's layout (Einsum projections giving (B, T, N, H),
blocks and attention returning (cache, x), a tied head called as a method from the root),
wired with a case file and a mapping only. The faithful port passes diff, replay and
map-check; each planted slip is named at its site and pass; a q conversion that fits the
shapes but loads the wrong layout fails map-check; diverge refuses the Flax port in one
sentence (swap and bisect take it: tests/test_swap_flax.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("transformers")

import torch

from layerdiff import load_case
from layerdiff.capture.port import capture_port
from layerdiff.replay.mapcheck import map_check

CASES = "tests.validation.gemma_cases"
MAP = Path(__file__).parent / "validation" / "gemma.map.toml"


def q_kernel_reshaped(w: torch.Tensor) -> torch.Tensor:
    """q_proj.weight (N*H, D) reshaped to the kernel's (N, D, H) without the transpose: every
    element loads, in the wrong place."""
    return w.reshape(2, 32, 16)


@pytest.fixture(scope="module")
def ref(reference_traces):
    return reference_traces(f"{CASES}:reference")


@pytest.fixture(scope="module")
def port_traces(ref, tmp_path_factory):
    folder = tmp_path_factory.mktemp("gemma")
    made: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in made:
            made[name] = capture_port(load_case(f"{CASES}:{name}"), folder / f"{name}.h5",
                                      weights_from=ref, mapping=MAP, progress=False)
        return made[name]
    return get


@pytest.mark.slow
def test_faithful_port_passes_diff_replay_and_map_check(ref, port_traces, run):
    diff = run("diff", ref, port_traces("port"), "--map", MAP)
    assert diff.exit_code == 0 and "PASS" in diff.output, diff.output
    # the attention and block return (cache, x): replay feeds the recorded output gradient to
    # the output the mapping's outputs = { "0" = "1" } pairs, and HF's DynamicCache argument
    # reaches the call adapters as None instead of stopping the layer
    replay = run("replay", ref, f"{CASES}:port", "--map", MAP)
    assert replay.exit_code == 0, replay.output
    assert "LOCAL ERROR" not in replay.output and "cannot judge" not in replay.output
    check = map_check(ref, load_case(f"{CASES}:port"), MAP)
    assert check.passed, [(e.port, e.status, e.note) for e in check.failing()]
    # every conversion is checked by the declared load at a paired module, none left unchecked
    assert not [e.port for e in check.entries if e.status == "not-checked"]


@pytest.mark.slow
@pytest.mark.parametrize("case, site, pass_, replayed", [
    ("bug_norm_offset", "model.layers.0.post_attention_layernorm#0", "forward",
     "layers.0.pre_ffw_norm#0"),
    # Embedder.encode is a method the root calls: the root's own code holds the slip
    ("bug_embed_unscaled", "<root>#0", "forward", "<root>#0"),
    ("bug_rope_reversed", "model.layers.1.self_attn#0", "forward", "layers.1.attn#0"),
    ("bug_gelu_erf", "model.layers.0.mlp#0", "forward", "layers.0.mlp#0"),
    ("bug_norm_backward", "model.layers.1.input_layernorm#0", "backward",
     "layers.1.pre_attention_norm#0"),
    ("bug_softcap", "model.layers.0.self_attn#0", "forward", "layers.0.attn#0"),
])
def test_planted_slip_named_at_its_site_and_pass(ref, port_traces, run, case, site, pass_,
                                                replayed):
    diff = run("diff", ref, port_traces(case), "--map", MAP)
    assert diff.exit_code == 1, diff.output
    assert f"origin: {site}, {pass_}" in diff.output, diff.output
    if replayed.endswith("attn#0"):   # the port's attention returns (cache, x): x is output 1
        assert f"in the port: {replayed}, output '1'" in diff.output, diff.output
    reference_module = site.partition("#")[0]
    replay = run("replay", ref, f"{CASES}:{case}", "--map", MAP, "--site", reference_module)
    assert replay.exit_code == 1, replay.output
    assert f"{replayed} ({pass_})" in replay.output.split("\n\n")[0], replay.output


@pytest.mark.slow
def test_draft_renames_outputs_the_port_returns_after_its_cache(ref, run):
    """Attention and Block return (cache, x): the draft pairs the reference's output 0 with
    the port's output 1 instead of declaring the call's own output [[unmatched]]."""
    draft = run("map-suggest", ref, f"{CASES}:port")
    rules = draft.output.split("\n\n")
    for module in ("model.layers.*.self_attn", "model.layers.*"):
        rule = next(r for r in rules if f'reference = "{module}"\nport' in r)
        assert 'outputs = { "0" = "1" }' in rule, rule
    assert 'output = "0"' not in draft.output, draft.output
    # HF's attention weights, whose same-named port output is the attention's own output
    assert 'reference = "model.layers.*.self_attn"\noutput = "1"' in draft.output


@pytest.mark.slow
def test_q_conversion_that_fits_the_shape_in_the_wrong_layout_fails_map_check(ref, tmp_path):
    text = MAP.read_text().replace(f'"{CASES}:q_kernel"',
                                   '"tests.test_validation_gemma:q_kernel_reshaped"')
    wrong = tmp_path / "wrong_q.map.toml"
    wrong.write_text(text)
    check = map_check(ref, load_case(f"{CASES}:port"), wrong)
    assert not check.passed
    flagged = {e.port: e for e in check.failing()}
    # only the q kernels: the kv kernels and the embedding, measured around them where the
    # wrong q also shows, are pointed at q_proj instead of failed
    assert set(flagged) == {"layers.0.attn.q_einsum.w", "layers.1.attn.q_einsum.w"}
    for layer in (0, 1):
        entry = flagged[f"layers.{layer}.attn.q_einsum.w"]
        assert "does not reproduce the reference's output" in entry.note, entry.note
        assert f"model.layers.{layer}.self_attn.q_proj#0" in entry.note, entry.note


@pytest.mark.slow
def test_map_check_passes_the_mapping_of_a_port_whose_norm_is_wrong(ref):
    """The mapping is right; the port's norm computes something else: map-check passes, and
    the embedding, judged only at the root around it, points at that norm."""
    check = map_check(ref, load_case(f"{CASES}:bug_norm_offset"), MAP)
    assert check.passed, [(e.port, e.status, e.note) for e in check.failing()]
    entry = next(e for e in check.entries if e.port == "embedder.input_embedding")
    assert "model.layers.0.post_attention_layernorm#0 inside it" in entry.note, entry.note


def test_flax_port_refused_by_diverge_in_one_sentence(run):
    result = run("diverge", f"{CASES}:reference", f"{CASES}:port", "--map", MAP, "--steps", "2")
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "is a Flax model, which diverge" in result.output


def test_replay_feeds_each_output_gradient_where_the_diff_pairs_it():
    """A port layer returning (cache, x) where the reference returns x: the reference's
    gradient at output 0 goes to the port's output 1 (outputs = { "0" = "1" }), not to the
    cache; without a rename, the same path, then the one tensor of its shape."""
    import numpy as np
    import pandas as pd

    from layerdiff.replay.recorded import RecordedCall, grad_outputs_at_port

    row = pd.Series({"shape": "2,8,32"})
    call = RecordedCall("attn#0", "attn", "Attention", 0, 1, [], {"0": row}, set())
    outputs = [("0", None), ("1", np.zeros((2, 8, 32), np.float32))]
    assert list(grad_outputs_at_port(call, outputs, {"0": "1"})) == ["1"]
    # without the rename the same path wins, as in the diff: the port's None (which is why
    # the mapping needs the rename)
    assert list(grad_outputs_at_port(call, outputs, {})) == ["0"]
    alone = [("x", np.zeros((2, 8, 32), np.float32))]
    assert list(grad_outputs_at_port(call, alone, {})) == ["x"]   # the one tensor of its shape


def test_positions_no_gradient_reached_are_no_mask_boundary():
    """A causal LM's loss leaves out the last position, so no gradient reaches it on either
    side: a backward slip out everywhere else is no 'mask or boundary off'. The same pattern
    with the last position's gradient nonzero and within still is."""
    import numpy as np

    from layerdiff.compare.hints._common import Judge, Site
    from layerdiff.compare.hints.positions import positions
    from layerdiff.trace.schema import Role

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((2, 8, 32))
    port = ref + 1e-3 * rng.standard_normal(ref.shape)
    site = Site(Role.GRAD_INPUT, {}, {}, None, None)
    ref[:, -1], port[:, -1] = 0.0, 0.0
    assert positions(Judge(ref, port, 1.3e-6, 1e-5), site) is None
    ref[:, -1] = port[:, -1] = 1.0   # a gradient arrived there and came out right: a boundary
    hint = positions(Judge(ref, port, 1.3e-6, 1e-5), site)
    assert hint is not None and "a mask or a boundary off" in hint.evidence
