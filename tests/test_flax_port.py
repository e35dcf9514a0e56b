"""The bundled Flax NNX port (reference_models/flax_mlp.py) against its torch reference, checked
without a capture: the faithful port with the reference's weights computes the reference's
outputs, loss and gradients, each planted slip moves its own layer out of tolerance and no
other, and the mapping files say what the hand copy does."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.nn import functional as F

pytest.importorskip("flax")
import jax.numpy as jnp
from flax import nnx

from layerdiff.compare.judge import element_ratios
from layerdiff.compare.tolerances import DEFAULTS
from layerdiff.errors import CaseError
from layerdiff.mapping import Mapping
from reference_models import flax_mlp, flax_mlp_reference
from reference_models.catalog import HERE, find

RTOL, ATOL = DEFAULTS["float32"]
SITES = ["proj_in", "block.ln", "block.fc1", "block.act", "block.fc2", "block", "ln_f", "head"]
# slip -> the one module whose own computation it changes (measured ratios on the reference's
# inputs: ln 126, act 23, fc1 2.8e5; every other module under 0.06 of the tolerance)
PLANTED = {"layernorm_default_eps": {"block.ln", "ln_f"}, "gelu_tanh": {"block.act"},
           "kernel_not_transposed": {"block.fc1"}}


def _worst(ref, port) -> float:
    return float(element_ratios(np.asarray(ref, np.float32), np.asarray(port, np.float32),
                                RTOL, ATOL).max())


def _submodule(model, path: str):
    for part in path.split("."):
        model = getattr(model, part)
    return model


@pytest.fixture(scope="module")
def reference():
    """The torch reference's per-module inputs and outputs, loss and parameter gradients."""
    model, x, labels = flax_mlp_reference.build()
    calls = {}

    def record(name):
        def hook(module, args, output):
            calls[name] = (args[0].detach().numpy(), output.detach().numpy())
        return hook

    for name in SITES:
        model.get_submodule(name).register_forward_hook(record(name))
    loss = F.cross_entropy(model(x), labels)
    loss.backward()
    grads = {name: p.grad.numpy() for name, p in model.named_parameters()}
    return calls, loss.item(), grads


def _local_ratios(parts, calls) -> dict[str, float]:
    """Each port module run on the reference module's recorded input, against its output."""
    return {name: _worst(out, _submodule(parts.model, name)(jnp.asarray(inp)))
            for name, (inp, out) in calls.items()}


def test_faithful_port_computes_the_references_outputs_loss_and_gradients(reference):
    calls, loss, grads = reference
    parts = flax_mlp.parts()
    assert all(ratio <= 1 for ratio in _local_ratios(parts, calls).values())
    assert _worst(calls["head"][1], parts.model(jnp.asarray(parts.x))) <= 1
    port_loss, port_grads = nnx.value_and_grad(
        lambda m: parts.loss_fn(m(jnp.asarray(parts.x))))(parts.model)
    assert _worst(loss, port_loss) <= 1
    flat = {".".join(map(str, k)): np.asarray(v[...]) for k, v in nnx.to_flat_state(port_grads)}
    for torch_name, (nnx_name, transposed) in flax_mlp.torch_to_nnx_names().items():
        port_grad = flat[nnx_name].T if transposed else flat[nnx_name]
        assert _worst(grads[torch_name], port_grad) <= 1, torch_name
    assert len(flat) == len(grads)  # every parameter of the port has its reference


@pytest.mark.parametrize("slip", sorted(PLANTED))
def test_each_planted_slip_moves_its_own_layer_out_of_tolerance_and_no_other(slip, reference):
    calls, _, _ = reference
    ratios = _local_ratios(flax_mlp.parts(flax_mlp.Slips(**{slip: True})), calls)
    out = {name for name, ratio in ratios.items() if ratio > 1}
    # a container is out where the layer inside it is; its own code is the residual add
    containers = {"block"} if out & {"block.ln", "block.fc1", "block.act"} else set()
    assert PLANTED[slip] & out and out <= PLANTED[slip] | containers, ratios


def test_mapping_file_says_what_the_hand_copy_does():
    mapping = Mapping.load(HERE / "flax_mlp.map.toml")
    for torch_name, (nnx_name, transposed) in flax_mlp.torch_to_nnx_names().items():
        module = nnx_name.rpartition(".")[0]
        source = mapping.param_source(nnx_name, {module: module})
        assert source.reference == [torch_name]
        assert source.transforms == (("transpose",) if transposed else ("copy",)), nnx_name


def test_the_untransposed_mapping_copies_only_block_fc1s_kernel():
    mapping = Mapping.load(HERE / "flax_mlp_untransposed.map.toml")
    for nnx_name, transposed in flax_mlp.torch_to_nnx_names().values():
        module = nnx_name.rpartition(".")[0]
        source = mapping.param_source(nnx_name, {module: module})
        slipped = nnx_name == "block.fc1.kernel"
        assert source.transforms == (("transpose",) if transposed and not slipped
                                     else ("copy",)), nnx_name


def test_the_port_takes_the_references_inputs_as_numpy():
    _, x, labels = flax_mlp_reference.build()
    parts = flax_mlp.parts()
    assert isinstance(parts.x, np.ndarray) and np.array_equal(parts.x, x.numpy())
    assert np.array_equal(parts.labels, labels.numpy())


def test_catalog_lists_each_flax_case_with_its_site_and_mapping():
    for name in ("port", "bug_layernorm_eps", "bug_gelu_tanh", "bug_kernel_not_transposed"):
        info = find(f"reference_models.flax_mlp:{name}")
        assert info is not None and info.reference == flax_mlp_reference.NAME
        assert info.mapping_path.exists()
    assert find("reference_models.flax_mlp:bug_kernel_not_transposed").mapping == (
        "flax_mlp_untransposed.map.toml")


def test_the_cases_are_layerdiff_cases_of_an_nnx_module():
    try:
        case = flax_mlp.port()
    except CaseError as exc:  # before layerdiff.Case takes an nnx.Module (issue 31)
        pytest.skip(f"layerdiff.Case does not take an nnx.Module yet: {exc}")
    assert isinstance(case.model, flax_mlp.PreNormMLP) and case.steps == 1
    assert isinstance(case.inputs[0], np.ndarray)
    assert float(case.loss_fn(case.model(jnp.asarray(case.inputs[0])))) == pytest.approx(
        float(torch.nn.functional.cross_entropy(*_reference_logits_and_labels())), rel=1e-5)


def _reference_logits_and_labels():
    model, x, labels = flax_mlp_reference.build()
    return model(x).detach(), labels


# ---- end to end, once layerdiff.Case takes an nnx.Module and capture records one (issue 31)

def _nnx_capture_available() -> bool:
    try:
        flax_mlp.port()
    except CaseError:
        return False
    return True


FLAX_CASES = ["port", "bug_layernorm_eps", "bug_gelu_tanh", "bug_kernel_not_transposed"]


@pytest.mark.skipif(not _nnx_capture_available(),
                    reason="layerdiff.Case does not take an nnx.Module yet (the Flax capture)")
@pytest.mark.parametrize("name", FLAX_CASES)
def test_flax_port_passes_and_each_slip_is_the_origin_at_its_site(name, reference_traces,
                                                                   tmp_path):
    from layerdiff import diff
    from layerdiff.capture.port import capture_port

    info = find(f"reference_models.flax_mlp:{name}")
    reference = reference_traces(info.reference)
    port = capture_port(info.spec, tmp_path / "port.h5", weights_from=reference,
                        mapping=info.mapping_path, progress=False)
    result = diff(reference, port, mapping=info.mapping_path)
    if info.kind == "port":
        assert result.passed, result.failing()[["site", "role", "ratio"]].head()
        return
    origin = result.origin
    assert (origin.port_site, origin.pass_, origin.step) == (info.site, info.pass_, 0)
