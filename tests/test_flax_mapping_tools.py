"""map-check, map-suggest and replay through call adapters on Flax NNX ports, as on torch
ports (issue 39 item 5): the bundled Flax MLP port's mapping checked (its untransposed kernel
flagged), a drafted mapping that makes the faithful port pass its diff, and a torch attention
taking an additive float mask replayed into a Flax one taking a boolean mask through a call
adapter (tests/flax_mask_pair.py), whichever array library the adapter returns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flax")
import jax
from flax import nnx

from layerdiff import Case, capture, load_case, seed_everything
from layerdiff.capture.port import capture_port
from layerdiff.compare import diff
from layerdiff.flax.weights import load_nnx_weights, nnx_variables
from layerdiff.mapping import Mapping
from layerdiff.mapsuggest import suggest_mapping
from layerdiff.replay import replay
from layerdiff.replay.mapcheck import SUSPICIOUS, map_check
from layerdiff.trace import open_trace
from reference_models.catalog import HERE

MLP_REF = "reference_models.flax_mlp_reference:reference"
MLP_PORT = "reference_models.flax_mlp:port"
MLP_MAP = HERE / "flax_mlp.map.toml"
MLP_UNTRANSPOSED = HERE / "flax_mlp_untransposed.map.toml"
MASK_REF = "tests.flax_mask_pair:reference"
MASK_MAP = Path(__file__).with_name("mask_pair.map.toml")


@pytest.fixture(scope="module")
def mlp_ref(reference_traces):
    return reference_traces(MLP_REF)


@pytest.fixture(scope="module")
def mask_ref(reference_traces):
    return reference_traces(MASK_REF)


# ---- map-check

def test_map_check_passes_the_bundled_flax_port_with_its_mapping(mlp_ref, run):
    result = run("map-check", mlp_ref, MLP_PORT, "--map", MLP_MAP)
    assert result.exit_code == 0, result.output
    assert "PASS  12 port tensors, each with a source that fits" in result.output
    assert "block.fc1.kernel  block.fc1.weight  transpose  ok" in result.output


def test_map_check_flags_the_untransposed_square_kernel(mlp_ref, run, tmp_path):
    result = run("map-check", mlp_ref, MLP_PORT, "--map", MLP_UNTRANSPOSED,
                 "--json", tmp_path / "check.json")
    assert result.exit_code == 1, result.output
    entries = {e["port"]: e for e in json.loads((tmp_path / "check.json").read_text())["entries"]}
    flagged = [name for name, e in entries.items() if e["status"] == SUSPICIOUS]
    assert flagged == ["block.fc1.kernel"]
    declared, transposed = entries["block.fc1.kernel"]["errors"].values()
    assert declared > 0.1 and transposed < 1e-6
    assert entries["block.fc2.kernel"]["status"] == "ok"   # square too, transposed as it should


def test_map_check_leaves_the_flax_port_as_it_was(mlp_ref):
    case = load_case(MLP_PORT)
    before = {name: v.get_value().copy() for name, v in nnx_variables(case.model).items()}
    map_check(mlp_ref, case, MLP_UNTRANSPOSED)
    after = {name: v.get_value() for name, v in nnx_variables(case.model).items()}
    assert before.keys() == after.keys()
    assert all((before[name] == after[name]).all() for name in before)


def test_map_check_runs_a_flax_layer_through_its_call_adapter(mask_ref):
    check = map_check(mask_ref, load_case("tests.flax_mask_pair:port"), MASK_MAP)
    assert check.passed, [(e.port, e.status, e.note) for e in check.failing()]
    notes = {e.port: e.note for e in check.entries}
    assert "transpose checked at attn.out#0" in notes["attn.out.kernel"]


def test_a_port_the_mapping_tools_cannot_handle_is_one_sentence_and_exit_2(mlp_ref, run):
    for command in ("map-check", "map-suggest"):
        result = run(command, mlp_ref, "tests.tiny_cases:numpy_port")
        assert result.exit_code == 2, result.output
        assert "Traceback" not in result.output
        assert f"{command} needs a layerdiff.Case whose model is a torch or Flax NNX " \
               "module" in result.output


# ---- replay through call adapters

@pytest.mark.parametrize("adapter", ["mask_call", "mask_call_numpy", "mask_call_torch"])
def test_flax_replay_through_an_adapter_passes_the_faithful_layer(mask_ref, tmp_path, adapter):
    mapping = tmp_path / "mask.map.toml"
    mapping.write_text(MASK_MAP.read_text().replace(":mask_call\"", f":{adapter}\""))
    result = replay(mask_ref, load_case("tests.flax_mask_pair:port"), mapping=mapping,
                    propagated=False)
    assert result.passed and not result.cannot_judge, result.cannot_judge
    local = result.local
    attn = local[local["port_site"] == "attn#0"]
    assert set(attn["pass"]) == {"forward", "backward"} and set(attn["verdict"]) == {"within"}
    # the input gradient flows back to the reference's hidden_states through the adapter
    rows = result.diff.rows
    grads = rows[(rows["site"] == "attn#0") & (rows["role"] == "grad_input")]
    assert list(grads["arg"]) == ["0"] and (grads["ratio"] <= 1).all()


def test_flax_replay_through_an_adapter_names_the_planted_layer(mask_ref):
    result = replay(mask_ref, load_case("tests.flax_mask_pair:bug_scale"), mapping=MASK_MAP,
                    propagated=False)
    assert not result.passed
    local = result.local
    errors = set(local[local["verdict"] == "LOCAL ERROR"]["port_site"])
    assert errors == {"attn#0"}


def test_capture_and_diff_of_the_flax_port_through_its_adapter(mask_ref, tmp_path):
    port = capture_port(load_case("tests.flax_mask_pair:port"), tmp_path / "port.h5",
                        weights_from=mask_ref, mapping=MASK_MAP, progress=False)
    result = diff(mask_ref, port, mapping=MASK_MAP)
    assert result.passed, result.summary()
    rows = result.rows
    mask = rows[(rows["site"] == "attn#0") & (rows["role"] == "input") & (rows["arg"] == "mask")]
    # the port's boolean mask, compared with the one the adapter made
    assert len(mask) == 1 and mask["match"].iloc[0] == "adapted"


# ---- map-suggest

def test_map_suggest_drafts_the_flax_ports_mapping_and_the_faithful_port_passes_with_it(
        mlp_ref, run, tmp_path):
    draft = tmp_path / "draft.map.toml"
    result = run("map-suggest", mlp_ref, MLP_PORT, "-o", draft)
    assert result.exit_code == 0, result.output
    text = draft.read_text()
    assert "UNSURE" not in text
    assert 'port = "*.kernel"\nreference = "*.weight"\ntransform = "transpose"' in text
    assert 'port = "*.scale"\nreference = "*.weight"\n' in text
    assert run("map-check", mlp_ref, MLP_PORT, "--map", draft).exit_code == 0
    port_trace = tmp_path / "port.h5"
    captured = run("capture", MLP_PORT, "-o", port_trace, "--weights-from", mlp_ref,
                   "--map", draft)
    assert captured.exit_code == 0, captured.output
    diffed = run("diff", mlp_ref, port_trace, "--map", draft)
    assert diffed.exit_code == 0 and diffed.output.startswith("PASS"), diffed.output


def test_map_suggest_marks_the_input_that_needs_an_adapter_and_leaves_out_none_outputs(
        mask_ref):
    draft = suggest_mapping(mask_ref, load_case("tests.flax_mask_pair:port"))
    text = draft.text
    # the attention's weights (output 1): the port returns None there
    assert '[[unmatched]]\nreference = "attn"\noutput = "1"\n' in text
    # the boolean mask no rename makes from the additive one
    site = next(s for s in draft.suggestions if s.kind == "site" and s.reference == ["attn"])
    assert site.unsure and "mask bool (3,6,6)" in site.adapter
    assert "attention_mask float32 (3,1,6,6)" in site.adapter
    assert '# UNSURE: needs a call adapter: the port\'s Attention.__call__(x, mask)' in text
    assert '# call = "your_module:adapter"' in text
    assert all(len(line) <= 100 for line in text.splitlines())
    Mapping.from_text(text, "draft.toml")   # the draft reads back as it is


class TorchConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.head = nn.Linear(4 * 5 * 5, 2)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


class ConvNet(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.conv = nnx.Conv(3, 4, (3, 3), padding=1, rngs=rngs)
        self.head = nnx.Linear(4 * 5 * 5, 2, rngs=rngs)

    def __call__(self, x):
        h = jax.nn.relu(self.conv(x.transpose(0, 2, 3, 1))).transpose(0, 3, 1, 2)  # NHWC
        return self.head(h.reshape(h.shape[0], -1))


def test_map_suggest_gives_a_flax_conv_kernel_its_layout_conversion(tmp_path):
    seed_everything(0)
    x = torch.randn(2, 3, 5, 5)
    reference = capture(Case(model=TorchConvNet(), inputs=(x,), loss_fn=lambda y: y.sum(),
                             name="conv-reference"), tmp_path / "conv.h5")
    port = ConvNet()
    draft = suggest_mapping(reference, Case(model=port, inputs=(x.numpy(),),
                                            loss_fn=lambda y: y.sum(), name="conv-port"))
    assert 'port = "conv.kernel"\nreference = "conv.weight"\n' \
           'transform = "layerdiff.flax.layouts:conv_kernel"' in draft.text
    assert draft.tensor_sources["head.kernel"] == ["head.weight"]
    path = tmp_path / "conv.map.toml"
    path.write_text(draft.text)
    load_nnx_weights(port, reference, path)
    with open_trace(reference) as ref:
        expected = ref.read(ref.records(0, "<root>#0", "output").iloc[0])
    np.testing.assert_allclose(np.asarray(port(x.numpy())), expected, rtol=1e-5, atol=1e-5)


def test_map_suggest_drafts_the_held_out_gpt2_flax_port_whose_diff_then_passes(
        reference_traces, tmp_path):
    """HF's 4-D additive mask, which the port's blocks and attentions leave None (they build
    their causal mask themselves), is drafted as dropped, as the hand mapping drops it; the
    Conv1D weights keep their layout (no transpose)."""
    pytest.importorskip("transformers")
    ref = reference_traces("tests.flax_heldout:reference")
    case = load_case("tests.flax_heldout:port")
    draft = suggest_mapping(ref, case)
    text = draft.text
    assert 'reference = "transformer.h.*.attn"\nport = "transformer.h.*.attn"\n' \
           'args = { "attention_mask" = "" }' in text
    assert 'args = { "2" = "" }' in text and "transpose" not in text
    assert not draft.without_source
    path = tmp_path / "draft.map.toml"
    path.write_text(text)
    port = capture_port(load_case("tests.flax_heldout:port"), tmp_path / "port.h5",
                        weights_from=ref, mapping=path, progress=False)
    assert diff(ref, port, mapping=path).passed


def test_map_check_flags_a_conversion_that_fits_the_shapes_but_loads_the_wrong_layout(
        mask_ref, tmp_path):
    path = tmp_path / "flipped.map.toml"
    path.write_text(MASK_MAP.read_text().replace(
        'version = 1\n', 'version = 1\n\n[[param]]\nport = "attn.qkv.kernel"\n'
        'reference = "attn.qkv.weight"\n'
        'transform = ["tests.flax_mask_pair:flip_rows", "transpose"]\n', 1))
    check = map_check(mask_ref, load_case("tests.flax_mask_pair:port"), path)
    assert not check.passed
    entry = next(e for e in check.entries if e.port == "attn.qkv.kernel")
    assert entry.status in ("suspicious-conversion", "mismatch-around"), entry
    assert entry.conversion["without"] < 1e-6 < entry.conversion["with"]


def test_replay_without_the_adapter_says_what_the_layer_was_given_and_what_to_write(
        mask_ref, tmp_path):
    path = tmp_path / "nocall.map.toml"
    path.write_text(MASK_MAP.read_text().replace('call = "tests.flax_mask_pair:mask_call"\n',
                                                 ""))
    result = replay(mask_ref, load_case("tests.flax_mask_pair:port"), mapping=path,
                    propagated=False)
    assert not result.passed and [site for site, _ in result.cannot_judge] == ["attn#0"]
    reason = dict(result.cannot_judge)["attn#0"]
    assert "1 float32 (3,1,6,6)" in reason and 'call = "your_module:adapter"' in reason
