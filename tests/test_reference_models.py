"""The bundled reference cases: reproducible, learnable, and their masks really mask."""

from __future__ import annotations

import pytest
import torch

from layerdiff import capture, open_trace, run_case
from reference_models import cnn, convlstm, mlp, transformer

CASES = [mlp.reference, cnn.reference, transformer.reference, convlstm.reference]


@pytest.mark.parametrize("factory", CASES)
def test_a_case_is_the_same_every_time(factory):
    a, b = factory(), factory()
    for (name, p), q in zip(a.model.state_dict().items(), b.model.state_dict().values(),
                            strict=True):
        assert torch.equal(p, q), name
    for x, y in zip(a.inputs, b.inputs, strict=True):
        assert torch.equal(x, y)
    assert torch.equal(run_case(a).losses[0], run_case(b).losses[0])


@pytest.mark.parametrize("factory", CASES)
def test_every_parameter_gets_a_finite_gradient(factory):
    case = factory()
    case.loss_fn(case.call_model()).backward()
    for name, param in case.model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


@pytest.mark.parametrize(("factory", "steps", "ratio"), [
    (transformer.reference, 30, 0.8), (cnn.reference, 30, 0.1), (convlstm.reference, 40, 0.3)])
def test_reference_learns(factory, steps, ratio):
    case = factory()
    case.steps = steps
    losses = run_case(case).losses
    assert float(losses[-1]) < ratio * float(losses[0])


def test_decoder_cannot_see_future_target_tokens():
    case = transformer.reference()
    case.model.eval()
    src, tgt = case.inputs
    changed = tgt.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 50 + 1
    with torch.no_grad():
        before, after = case.model(src, tgt), case.model(src, changed)
    torch.testing.assert_close(before[:, :-1], after[:, :-1])
    assert not torch.allclose(before[:, -1], after[:, -1])


def test_padded_source_positions_are_ignored():
    case = transformer.reference()
    case.model.eval()
    src, tgt = case.inputs
    row = int((src == transformer.PAD).any(dim=1).nonzero()[0])
    pad_at = int((src[row] == transformer.PAD).nonzero()[0])
    changed = src.clone()
    changed[row, pad_at] = 7  # a real token where the mask says padding...
    with torch.no_grad():
        before = case.model(src, tgt)
        # ...but keep the mask: build it from the original source
        model = case.model
        src_mask = (src != transformer.PAD).unsqueeze(1).unsqueeze(1)
        tgt_mask = ((tgt != transformer.PAD).unsqueeze(1)
                    & transformer.causal_mask(tgt.size(1))).unsqueeze(1)
        memory = model.encoder(model.src_pos(model.src_embed(changed)), src_mask)
        after = model.generator(model.decoder(model.tgt_pos(model.tgt_embed(tgt)), memory,
                                              src_mask, tgt_mask))
    torch.testing.assert_close(before[row], after[row], rtol=1e-5, atol=1e-6)


def test_transformer_capture_records_keyword_masks_and_every_layer(trace_path):
    capture(transformer.reference(), trace_path)
    with open_trace(trace_path) as trace:
        index = trace.index
        attn = index[(index["site"] == "encoder.layers.0.self_attn#0")
                     & (index["role"] == "input")]
        assert set(attn["arg"]) == {"0", "1", "2", "mask"}
        grads = index[(index["site"] == "encoder.layers.0.self_attn#0")
                      & (index["role"] == "grad_input")]
        assert list(grads["arg"]) == ["0"]  # q, k and v are one tensor: one gradient
        sites = set(trace.sites["site"])
        assert {f"decoder.layers.{i}.cross_attn.w_{p}#0" for i in (0, 1) for p in "qkvo"} <= sites
