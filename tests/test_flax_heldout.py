"""A held-out Flax NNX port of Hugging Face's GPT2LMHeadModel (tests/flax_heldout.py), written
by a porter from the transformers source: the faithful port passes diff and replay, and each
planted slip is named at its layer and pass. Tied wte / lm head, dict inputs, integer tokens,
nnx.List blocks, nnx.Dropout(deterministic=True) and HF's extra block arguments all on the way.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("flax")
pytest.importorskip("transformers")

from flax import nnx

from layerdiff import load_case
from layerdiff.capture.port import capture_port
from layerdiff.flax.graph import ModelGraph
from layerdiff.flax.weights import load_nnx_weights
from layerdiff.trace import open_trace
from layerdiff.weights import trace_weights
from tests import flax_heldout

REF = "tests.flax_heldout:reference"
MAP = str(Path(__file__).with_name("flax_heldout.map.toml"))


@pytest.fixture(scope="module")
def ref(reference_traces):
    return reference_traces(REF)


def _port_trace(ref, tmp_path, name):
    return capture_port(load_case(f"tests.flax_heldout:{name}"), tmp_path / f"{name}.h5",
                        weights_from=ref, mapping=MAP, progress=False)


def test_faithful_port_passes_diff_and_replay(ref, tmp_path, run):
    port = _port_trace(ref, tmp_path, "port")
    diff = run("diff", ref, port, "--map", MAP)
    assert diff.exit_code == 0, diff.output
    assert "PASS" in diff.output and "origin" not in diff.output
    replay = run("replay", ref, "tests.flax_heldout:port", "--map", MAP)
    assert replay.exit_code == 0, replay.output
    assert "LOCAL ERROR" not in replay.output and "cannot judge" not in replay.output
    # HF's block arguments the port's __call__ has no parameter for are left out, and said
    assert "not taken by the port at transformer.h.0.attn#0" in replay.output


@pytest.mark.parametrize("case, site, pass_", [
    ("bug_layernorm_eps", "transformer.h.0.ln_1#0", "forward"),
    ("bug_gelu_erf", "transformer.h.0.mlp.act#0", "forward"),
    ("bug_attn_scale", "transformer.h.0.attn#0", "forward"),
    ("bug_no_causal_mask", "transformer.h.0.attn#0", "forward"),
    # backward runs from the last block: its GELU's wrong derivative is met first
    ("bug_gelu_backward", "transformer.h.1.mlp.act#0", "backward"),
])
def test_planted_slip_named_at_its_layer_and_pass(ref, tmp_path, run, case, site, pass_):
    port = _port_trace(ref, tmp_path, case)
    diff = run("diff", ref, port, "--map", MAP)
    assert diff.exit_code == 1, diff.output
    assert f"origin: {site}, {pass_}" in diff.output, diff.output
    replay = run("replay", ref, f"tests.flax_heldout:{case}", "--map", MAP)
    assert replay.exit_code == 1, replay.output
    first = replay.output.split("\n\n")[0]
    assert f"{site} ({pass_})" in first, replay.output


def test_tied_module_named_as_torch_names_it():
    """GPT-2's lm head holds wte: NNX's own traversal (sorted names) reaches it first as
    lm_head.wte; torch names it by registration order, transformer.wte, where it is called."""
    model = flax_heldout.GPT2LMHeadModel(flax_heldout.CONFIG, rngs=nnx.Rngs(0))
    graph = ModelGraph.of(model)
    names = [name for name, _ in graph.modules]
    assert "transformer.wte" in names and "lm_head.wte" not in names
    assert [v.name for v in graph.owned["transformer.wte"]] == ["embedding"]


def test_tied_embedding_loads_from_whichever_name_the_mapping_sources(ref):
    model = flax_heldout.GPT2LMHeadModel(flax_heldout.CONFIG, rngs=nnx.Rngs(1))
    report = load_nnx_weights(model, ref, MAP)
    with open_trace(ref) as trace:
        expected = trace_weights(trace)["transformer.wte.weight"]
    assert (model.transformer.wte.embedding[...] == expected).all()
    assert model.lm_head.wte is model.transformer.wte
    assert "transformer.wte.embedding" in report.loaded
    # lm_head.weight is the reference's wte.weight under its tied name: used, not "unused"
    assert report.unused == []


def test_replay_judges_the_tied_embedding_gradient_summed_over_both_uses(ref):
    """wte's gradient is its lookup's plus the lm head's (wte.attend, no call of wte): replay
    sums both where wte records it, as the reference records the tied weight's whole gradient."""
    import layerdiff

    result = layerdiff.replay(ref, load_case("tests.flax_heldout:port"), mapping=MAP,
                              propagated=False)
    rows = result.diff.rows
    tied = rows[(rows.site == "transformer.wte#0") & (rows.role.astype(str) == "weight_grad")]
    assert len(tied) == 1 and tied.ratio.iloc[0] < 1, tied
    assert result.passed


def test_padding_mask_as_a_keyword_input(tmp_path, run, reference_traces):
    """A dict of keyword inputs with an integer padding mask: recorded at the root as given,
    with no gradient; the port passes once HF's 4-D additive block mask, which the port takes
    in (batch, T) form under the same name, is dropped from the input check."""
    ref = reference_traces("tests.flax_heldout:reference_masked")
    port = capture_port(load_case("tests.flax_heldout:port_masked"), tmp_path / "port.h5",
                        weights_from=ref, mapping=MAP, progress=False)
    with open_trace(port) as trace:
        root = trace.index[trace.index.site == "<root>#0"]
    mask = root[root.arg == "attention_mask"]
    assert list(mask.role.astype(str)) == ["input"]          # no gradient for integers
    assert str(mask.dtype.iloc[0]).startswith("int")
    diff = run("diff", ref, port, "--map", MAP)
    assert diff.exit_code == 0, diff.output
    # without the drop the two masks pair by name and cannot be compared: not a pass
    text = Path(MAP).read_text()
    no_drop = tmp_path / "no_drop.map.toml"
    no_drop.write_text(text[:text.index("# HF hands each block")])
    paired_by_name = run("diff", ref, port, "--map", no_drop)
    assert paired_by_name.exit_code == 1
    assert "runs in int" not in paired_by_name.output   # not a precision: another tensor


def test_a_port_tying_what_the_reference_does_not_is_refused_in_one_sentence(tmp_path):
    """Two torch Linears with their own weights, one NNX Linear held as both: loading either
    would silently drop the other's values."""
    import torch

    import layerdiff
    from layerdiff.errors import MappingError

    class TorchTwo(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = torch.nn.Linear(4, 4)
            self.b = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.b(self.a(x))

    class FlaxTied(nnx.Module):
        def __init__(self) -> None:
            self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.b = self.a

        def __call__(self, x):
            return self.b(self.a(x))

    torch.manual_seed(0)
    ref = layerdiff.capture(layerdiff.Case(model=TorchTwo(), inputs=(torch.ones(2, 4),),
                                           loss_fn=lambda y: y.sum()), tmp_path / "ref.h5")
    mapping = tmp_path / "m.toml"
    mapping.write_text('version = 1\n[[param]]\nport = "*.kernel"\nreference = "*.weight"\n'
                       'transform = "transpose"\n')
    with pytest.raises(MappingError, match=r"port a\.(kernel|bias) and b\.(kernel|bias) are "
                       "one tied variable, but the reference gives them different values"):
        load_nnx_weights(FlaxTied(), ref, mapping)
