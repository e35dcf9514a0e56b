"""The bundled ports and planted bugs: correct ports agree with their references to float32
rounding, and each planted bug changes what the catalog says and nothing upstream of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from layerdiff import capture, load_case, open_trace, run_case
from reference_models import convlstm, convlstm_numpy, transformer
from reference_models.catalog import CATALOG

SMALL = [info for info in CATALOG if info.model != "bench" and not info.spec.endswith("_large")
         and info.kind != "diagnostic"]  # those have their own tests (test_nan, ...)
PORTS = [info for info in CATALOG if info.kind == "port"]
BUGS = [info for info in CATALOG if info.kind == "bug"]
# The correct port each bug was planted in: the same code but for the bug's one line.
PLANTED_IN = {
    "reference_models.transformer_port:bug_softmax_axis": "transformer_port:port_manual",
    "reference_models.transformer_port:bug_missing_scale": "transformer_port:port_manual",
    "reference_models.transformer_port:bug_inverted_mask": "transformer_port:port_manual",
    "reference_models.hint_bugs:mlp_sign_backward": "mlp_port:port",
    "reference_models.hint_bugs:mlp_bias_twice": "mlp_port:port",
    "reference_models.hint_bugs:mlp_bf16_layer": "mlp_port:port",
    "reference_models.hint_bugs:cnn_sum_pool": "cnn_port:port",
    "reference_models.hint_bugs:cnn_batchnorm_eps": "cnn_port:port",
    "reference_models.hint_bugs:convlstm_gate_order": "convlstm_numpy:port",
    "reference_models.hint_bugs:transformer_mask_ignored": "transformer_port:port",
    "reference_models.hint_bugs:causal_mask_off_by_one": "hint_bugs:causal_reference",
    "reference_models.hint_bugs:causal_heads_merged_by_reshape": "hint_bugs:causal_reference",
    "reference_models.op_bugs:bug_softmax_axis": "op_bugs:reference",
    "reference_models.op_bugs:bug_scale_1_over_d": "op_bugs:reference",
    "reference_models.op_bugs:bug_custom_backward": "op_bugs:reference",
    "reference_models.op_pairing:bug_custom_softmax_backward": "op_pairing:custom_softmax_port",
    "reference_models.op_pairing:bug_fused_softmax_backward": "op_pairing:fused_softmax_port",
}


def _correct_port(bug_spec: str) -> str:
    module = bug_spec.split(":")[0].removeprefix("reference_models.")
    return "reference_models." + PLANTED_IN.get(bug_spec, f"{module}:port")


def _ids(infos):
    return [info.spec.removeprefix("reference_models.") for info in infos]


@pytest.mark.parametrize("info", SMALL, ids=_ids(SMALL))
def test_every_bundled_case_captures_cleanly(info, trace_path):
    capture(load_case(info.spec), trace_path)
    with open_trace(trace_path) as trace:
        index = trace.index
        assert trace.complete and len(trace.sites) > 3
        tensors = index[index["kind"] == "tensor"]
        assert {"input", "output", "weight", "grad_output", "grad_input", "weight_grad"} <= set(
            tensors["role"])
        if info.kind != "bug":  # a correct model computes finite numbers everywhere
            assert tensors["nan"].sum() == 0 and tensors["inf"].sum() == 0


def test_the_catalog_is_consistent():
    specs = [info.spec for info in CATALOG]
    assert len(specs) == len(set(specs))
    references = {info.spec for info in CATALOG if info.kind == "reference"}
    for info in CATALOG:
        if info.kind == "reference":
            assert info.reference is None, info.spec
        elif info.kind != "diagnostic" or info.reference:  # a diagnostic case may have none
            assert info.reference in references, info.spec
        assert (info.site is not None) == (info.kind in ("bug", "diagnostic")) == (
            info.pass_ is not None), info.spec
        assert info.pass_ in (None, "forward", "backward")
    for model in ("mlp", "cnn", "transformer", "convlstm"):
        kinds = {info.kind for info in CATALOG if info.model == model}
        assert {"reference", "port", "bug"} <= kinds, model


# ---- correct ports against their references

TORCH_PORTS = [info for info in PORTS if "numpy" not in info.spec]


def _forward_and_grads(case):
    torch.manual_seed(case.seed)  # dropout draws the same mask in reference and port
    out = case.call_model()
    case.loss_fn(out).backward()
    return out.detach()


@pytest.mark.parametrize("info", TORCH_PORTS, ids=_ids(TORCH_PORTS))
def test_torch_port_outputs_match_the_reference_to_float32_rounding(info):
    reference, port = load_case(info.reference), load_case(info.spec)
    torch.testing.assert_close(_forward_and_grads(port), _forward_and_grads(reference))


# the transformer port has other names; the op-level LM's SDPA port has no causal-mask buffer
SAME_RECORDS = [i for i in TORCH_PORTS if "transformer" not in i.spec and "op_bugs" not in i.spec]


@pytest.mark.parametrize("info", SAME_RECORDS, ids=_ids(SAME_RECORDS))
def test_same_name_port_matches_every_record_of_the_reference(info, tmp_path):
    """Every tensor of every site, forward and backward, over the case's steps."""
    capture(load_case(info.reference), tmp_path / "ref.h5")
    capture(load_case(info.spec), tmp_path / "port.h5")
    with open_trace(tmp_path / "ref.h5") as ref, open_trace(tmp_path / "port.h5") as port:
        keys = ["step", "site", "role", "arg", "shape", "dtype"]
        assert ref.index[keys].equals(port.index[keys])
        for position, row in ref.index.iterrows():
            if row["kind"] == "tensor" and row["dtype"].startswith("float"):
                np.testing.assert_allclose(port.read(position), ref.read(position),
                                           rtol=1.3e-6, atol=1e-5,
                                           err_msg=f"{row['site']} {row['role']} {row['arg']}")


def test_transformer_port_differs_in_structure_but_trains_like_the_reference():
    port, reference = load_case("reference_models.transformer_port:port"), transformer.reference()
    port_names = {name for name, _ in port.model.named_modules()}
    assert "enc.0.self_attn" in port_names and "encoder.layers.0.self_attn" not in port_names
    assert not any(name.endswith(".w_q") for name in port_names)  # q, k, v are fused
    port.steps = reference.steps = 3
    torch.testing.assert_close(torch.stack(run_case(port).losses),
                               torch.stack(run_case(reference).losses))


def test_numpy_convlstm_port_records_what_torch_capture_records(tmp_path):
    capture(convlstm.reference(), tmp_path / "ref.h5")
    capture(convlstm_numpy.port(), tmp_path / "port.h5")
    with open_trace(tmp_path / "ref.h5") as ref, open_trace(tmp_path / "port.h5") as port:
        keys = ["step", "pass", "site", "role", "arg", "shape", "dtype"]
        assert ref.index[keys].equals(port.index[keys])
        site_keys = ["step", "site", "module", "call", "type", "parent", "enter_seq", "exit_seq"]
        assert ref.sites[site_keys].equals(port.sites[site_keys])
        for position, row in ref.index.iterrows():
            np.testing.assert_allclose(port.read(position), ref.read(position), rtol=1.3e-6,
                                       atol=1e-5, err_msg=f"{row['site']} {row['role']}")


def _numpy_setup(cfg, dtype=np.float32):
    model, frames, targets = convlstm.setup(cfg)
    params = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    return model, convlstm_numpy.NumpyConvLSTM(params, dtype), frames, targets


def test_numpy_convlstm_backward_agrees_with_autograd():
    model, port, frames, targets = _numpy_setup(convlstm.Config())
    predicted, tape = port.forward(frames.numpy())
    loss, grad = convlstm_numpy.mse(predicted, targets.numpy())
    grads = port.backward(tape, grad)
    torch_loss = torch.nn.functional.mse_loss(model(frames), targets)
    torch_loss.backward()
    assert float(loss) == pytest.approx(torch_loss.item(), rel=1e-6)
    for name, param in model.named_parameters():
        torch.testing.assert_close(torch.from_numpy(grads[name]), param.grad, msg=name)


def test_numpy_convlstm_backward_agrees_with_finite_differences_in_float64():
    cfg = convlstm.Config(batch=2, frames=3, hidden=3, size=5)
    _, port, frames, targets = _numpy_setup(cfg, np.float64)
    rng = np.random.default_rng(0)
    for value in port.params.values():  # weights large enough that every path matters
        value[...] = rng.standard_normal(value.shape) * 0.5
    frames, targets = frames.numpy().astype(np.float64), targets.numpy().astype(np.float64)

    def loss_of() -> float:
        return float(convlstm_numpy.mse(port.forward(frames)[0], targets)[0])

    predicted, tape = port.forward(frames)
    grads = port.backward(tape, convlstm_numpy.mse(predicted, targets)[1])
    eps = 1e-6
    for name, value in port.params.items():
        flat, grad = value.reshape(-1), grads[name].reshape(-1)
        for i in rng.choice(flat.size, size=min(12, flat.size), replace=False):
            saved = flat[i]
            flat[i] = saved + eps
            up = loss_of()
            flat[i] = saved - eps
            down = loss_of()
            flat[i] = saved
            numeric = (up - down) / (2 * eps)
            assert grad[i] == pytest.approx(numeric, rel=1e-5, abs=1e-9), f"{name}[{i}]"


def test_numpy_convlstm_trains_like_the_reference_with_clipping():
    cfg = convlstm.Config()
    reference = convlstm.reference()
    losses = run_case(reference).losses
    _, port, frames, targets = _numpy_setup(cfg)
    port_losses = convlstm_numpy.train(port, frames.numpy(), targets.numpy(), steps=cfg.steps,
                                       loss_scale=1.0, clip=cfg.clip, lr=cfg.lr)
    np.testing.assert_allclose(port_losses, [float(x) for x in losses], rtol=1e-5)
    for name, param in reference.model.named_parameters():
        np.testing.assert_allclose(port.params[name], param.detach().numpy(), rtol=1e-5,
                                   atol=1e-6, err_msg=name)


def test_convlstm_clipping_is_active_at_the_first_step():
    """Otherwise the clipping in the reference and the numpy port would go untested."""
    case = convlstm.reference()
    case.loss_fn(case.call_model()).backward()
    norm = torch.nn.utils.clip_grad_norm_(case.model.parameters(), float("inf"))
    assert norm > convlstm.Config().clip


# ---- planted bugs

def _first_difference(bug_path, port_path):
    with open_trace(bug_path) as bug, open_trace(port_path) as port:
        keys = ["step", "pass", "site", "role", "arg", "shape"]
        assert bug.index[keys].equals(port.index[keys]), "a bug must not change the structure"
        differs = bug.index["digest"] != port.index["digest"]
        assert differs.any(), "the planted bug changes nothing"
        return bug.index[differs].iloc[0]


@pytest.mark.parametrize("info", BUGS, ids=_ids(BUGS))
def test_planted_bug_first_changes_its_documented_site_and_pass(info, tmp_path):
    """Bit for bit, everything recorded before the bug's site is as in the correct port."""
    capture(load_case(info.spec), tmp_path / "bug.h5", summary=True)
    capture(load_case(_correct_port(info.spec)), tmp_path / "port.h5", summary=True)
    first = _first_difference(tmp_path / "bug.h5", tmp_path / "port.h5")
    assert (first["step"], first["pass"]) == (0, info.pass_)
    if first["site"] == info.site:
        assert first["role"] in (("output",) if info.pass_ == "forward"
                                 else ("grad_input", "weight_grad"))
    else:  # a bug in a container's own code: first seen entering the child that runs next
        assert first["site"].startswith(info.site.rpartition("#")[0] + "."), first["site"]
        assert first["role"] == ("input" if info.pass_ == "forward" else "grad_output")


def test_relu_backward_bug_is_wrong_only_after_the_first_batch_element(tmp_path):
    capture(load_case("reference_models.cnn_port:bug_relu_backward_batch"), tmp_path / "bug.h5")
    capture(load_case("reference_models.cnn_port:port"), tmp_path / "port.h5")
    with open_trace(tmp_path / "bug.h5") as bug, open_trace(tmp_path / "port.h5") as port:
        query = "site == 'block.act#0' and role == 'grad_input'"
        wrong = bug.read(bug.index.query(query).iloc[0])
        right = port.read(port.index.query(query).iloc[0])
    np.testing.assert_array_equal(wrong[0], right[0])
    assert all(not np.array_equal(wrong[b], right[b]) for b in range(1, len(right)))


def test_head_split_bug_mixes_batch_elements():
    """Changing only the second sequence changes the first one's attention output."""
    from reference_models import transformer_port as tp

    outputs = {}
    for name, case in (("port", tp.port()), ("bug", tp.bug_head_split_reshape())):
        block = case.model.enc[0].self_attn
        x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(0))
        mask = torch.ones(2, 1, 1, 5, dtype=torch.bool)
        changed = x.clone()
        changed[1] += 1.0
        with torch.no_grad():
            outputs[name] = (block(x, mask=mask)[0], block(changed, mask=mask)[0])
    torch.testing.assert_close(*outputs["port"])
    assert not torch.allclose(*outputs["bug"])


def test_flax_layernorm_epsilon_stays_within_tolerance_where_it_acts():
    """eps 1e-6 instead of 1e-5 changes a norm's own output by less than float32 tolerance;
    the Keras 1e-3 of the planted bug does not."""
    from reference_models import transformer_port as tp

    x = load_case("reference_models.transformer_port:port").inputs
    outputs = {}
    for eps in (1e-5, 1e-6, 1e-3):
        case = tp._case("eps", tp.PortOptions(norm_eps=eps))
        norm_outputs = []
        hook = case.model.enc[0].ln1.register_forward_hook(
            lambda _m, _i, out, keep=norm_outputs: keep.append(out.detach()))
        with torch.no_grad():
            case.model(*x)
        hook.remove()
        outputs[eps] = norm_outputs[0]
    torch.testing.assert_close(outputs[1e-6], outputs[1e-5])
    with pytest.raises(AssertionError):
        torch.testing.assert_close(outputs[1e-3], outputs[1e-5])
