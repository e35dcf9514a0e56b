"""Hints for the mistakes real ports have (issue 29): rotary embeddings, grouped key/value heads,
activations, dropped residual adds, a norm backward over the wrong axes, padding that gets
gradient, recurrent gate order. Synthetic pairs made with torch (an implementation apart from
the hint code's numpy models), then every planted bug of reference_models/hint_bugs_real.py
through capture, diff and the reports."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from layerdiff import capture, diff, load_case, load_weights
from layerdiff.compare.hints import Attention, Child, Kind, hint
from layerdiff.report.html import write_html
from layerdiff.report.terminal import format_diff
from reference_models import hint_bugs_real

RTOL, ATOL = 1.3e-6, 1e-5  # float32's tolerance, as the diff gives it
HERE = Path(__file__).resolve().parent.parent / "reference_models"


def f32(values) -> np.ndarray:
    if isinstance(values, torch.Tensor):
        values = values.detach().numpy()
    return np.asarray(values, np.float32).astype(np.float64)


def kind_of(ref, port, **site) -> str | None:
    found = hint(ref, port, role=site.pop("role", "output"), rtol=site.pop("rtol", RTOL),
                 atol=ATOL, **site)
    return None if found is None else str(found.kind)


# ---- rotary attention with grouped key/value heads, written with torch

B, L, HEADS, KV, D = 2, 12, 4, 2, 8


def rope(x: torch.Tensor, layout: str, base: float = 10000.0, sign: float = 1.0):
    """x (b, h, L, d) rotated: 'half' as HF's rotate_half, 'pairs' as Meta's complex view."""
    d = x.shape[-1]
    freqs = torch.outer(torch.arange(x.shape[2], dtype=torch.float64),
                        base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d))
    if layout == "half":
        emb = torch.cat([freqs, freqs], -1)
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
        return x * emb.cos() + sign * rotated * emb.sin()
    z = torch.view_as_complex(x.reshape(*x.shape[:-1], d // 2, 2).contiguous())
    turn = torch.polar(torch.ones_like(freqs), sign * freqs)
    return torch.view_as_real(z * turn).flatten(-2)


def gqa_attention(q, k, v, wo, layout="half", base=10000.0, sign=1.0, tile=False):
    split = lambda t, h: t.view(B, L, h, D).transpose(1, 2)  # noqa: E731
    qh, kh, vh = split(q, HEADS), split(k, KV), split(v, KV)
    if layout != "none":
        qh, kh = rope(qh, layout, base, sign), rope(kh, layout, base, sign)
    rep = HEADS // KV
    if tile:
        kh, vh = kh.repeat(1, rep, 1, 1), vh.repeat(1, rep, 1, 1)
    else:
        kh, vh = kh.repeat_interleave(rep, 1), vh.repeat_interleave(rep, 1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(D)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    context = (scores.masked_fill(~causal, -math.inf).softmax(-1) @ vh).transpose(1, 2)
    context = context.reshape(B, L, HEADS * D)
    return context, context @ wo.T


@pytest.fixture
def llama_attention():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, L, HEADS * D, generator=g, dtype=torch.float64)
    k = torch.randn(B, L, KV * D, generator=g, dtype=torch.float64)
    v = torch.randn(B, L, KV * D, generator=g, dtype=torch.float64)
    wo = torch.randn(HEADS * D, HEADS * D, generator=g, dtype=torch.float64) / 6
    context, out = gqa_attention(q, k, v, wo)
    parts = Attention(f32(q), f32(k), f32(v), f32(context), f32(wo))

    def port(**bug):
        return f32(gqa_attention(q, k, v, wo, **bug)[1])

    return f32(out), parts, port


@pytest.mark.parametrize(("bug", "kind", "words"), [
    ({"layout": "pairs"}, Kind.ROTARY, "interleaved pairs"),
    ({"sign": -1.0}, Kind.ROTARY, "sine negated"),
    ({"base": 500000.0}, Kind.ROTARY, "frequency base 5e+05"),
    ({"layout": "none"}, Kind.ROTARY, "no rotary"),
    ({"tile": True}, Kind.PERMUTATION, "tiled"),
])
def test_rotary_and_grouped_heads_by_recomputing_the_attention(llama_attention, bug, kind,
                                                                words):
    out, parts, port = llama_attention
    found = hint(out, port(**bug), role="output", rtol=RTOL, atol=ATOL, attention=parts)
    assert found is not None and found.kind == kind and words in found.evidence


def test_a_random_error_at_a_rotary_attention_gets_no_hint(llama_attention):
    out, parts, _ = llama_attention
    noisy = out + np.random.default_rng(1).standard_normal(out.shape) * 0.05
    assert kind_of(out, noisy, attention=parts) is None


def test_position_zero_exact_is_rotary_only_when_each_feature_pair_keeps_its_norm():
    """An error that is 0 at position 0 and grows with the position is no evidence of a
    rotary embedding by itself (a recurrence from a zero state has it too): the port must be
    the reference with each feature pair turned, its norm kept."""
    rng = np.random.default_rng(2)
    out = f32(rng.standard_normal((4, 16, 32)))
    growing, flat = out.copy(), out.copy()
    position = np.arange(16)[None, :, None]
    growing[:, 1:] += (position[:, 1:] * 1e-3) * rng.standard_normal((4, 15, 32))
    flat[:, 1:] += 1e-2 * rng.standard_normal((4, 15, 32))
    assert kind_of(out, growing) is None  # grows, but changes the pairs' norms
    # a causal softmax's scores changed (a scale) leave position 0 exact too: no hint, and
    # never a mask (a mask's boundary leaves the last position exact, not the first)
    assert kind_of(out, flat) is None
    # each interleaved pair turned by 1e-3 x position x its frequency: a rotary base off
    turn = 1e-3 * np.arange(16)[:, None] * 10000.0 ** (-np.arange(16) / 16)[None, :]
    z = (out[..., 0::2] + 1j * out[..., 1::2]) * np.exp(1j * turn)
    rotated = out.copy()
    rotated[..., 0::2], rotated[..., 1::2] = z.real, z.imag
    found = hint(out, f32(rotated), role="output", rtol=RTOL, atol=ATOL)
    assert found is not None and found.kind == Kind.ROTARY, found
    assert "interleaved pairs" in found.evidence and "keeps its norm" in found.evidence


# ---- activations


ACTS = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh,
        "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}


@pytest.mark.parametrize(("reference", "port"), [("gelu", "silu"), ("silu", "relu"),
                                                 ("relu", "gelu"), ("tanh", "silu")])
def test_another_activation_at_the_activation_site(reference, port):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(8, 40, generator=g, requires_grad=True)
    grad = torch.randn(8, 40, generator=g)
    outs, grads = [], []
    for name in (reference, port):
        y = ACTS[name](x)
        outs.append(f32(y))
        grads.append(f32(torch.autograd.grad(y, x, grad)[0]))
    inputs = {"0": f32(x)}
    found = hint(*outs, role="output", rtol=RTOL, atol=ATOL, inputs=inputs)
    assert found.kind == Kind.ACTIVATION and f"{port}(input)" in found.evidence
    assert kind_of(*grads, role="grad_input", inputs=inputs,
                   grad_output=f32(grad)) == Kind.ACTIVATION


def test_another_activation_inside_a_gated_mlp():
    g = torch.Generator().manual_seed(4)
    x = torch.randn(4, 6, 16, generator=g)
    w1, w3 = torch.randn(32, 16, generator=g) / 4, torch.randn(32, 16, generator=g) / 4
    w2 = torch.randn(16, 32, generator=g) / 6
    gate, up = x @ w1.T, x @ w3.T
    children = [Child("w1", f32(x), f32(gate), f32(w1)), Child("w3", f32(x), f32(up), f32(w3)),
                Child("w2", f32(F.silu(gate) * up), f32((F.silu(gate) * up) @ w2.T), f32(w2))]
    ref = f32((F.silu(gate) * up) @ w2.T)
    port = f32((F.gelu(gate) * up) @ w2.T)
    found = hint(ref, port, role="output", rtol=RTOL, atol=ATOL, inputs={"0": f32(x)},
                 children=children)
    assert found.kind == Kind.ACTIVATION and "w2(gelu(w1) x w3)" in found.evidence
    noisy = ref + np.random.default_rng(0).standard_normal(ref.shape) * 0.1
    assert kind_of(ref, noisy, inputs={"0": f32(x)}, children=children) is None


# ---- the other kinds of issue 29


def test_a_residual_dropped_between_children_is_a_missing_term():
    rng = np.random.default_rng(5)
    h = f32(rng.standard_normal((3, 5, 8)))
    branch = f32(np.tanh(h @ rng.standard_normal((8, 8))))
    children = [Child("blocks.1", h, branch)]
    assert kind_of(f32(h + branch), branch, children=children) == Kind.MISSING_TERM


def test_a_layer_norm_backward_that_reduces_over_the_batch_too():
    g = torch.Generator().manual_seed(6)
    x = torch.randn(4, 5, 12, generator=g, dtype=torch.float64)
    w = torch.rand(12, generator=g, dtype=torch.float64) + 0.5
    grad = torch.randn(4, 5, 12, generator=g, dtype=torch.float64)
    mean, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
    xhat, rstd = (x - mean) / torch.sqrt(var + 1e-5), 1 / torch.sqrt(var + 1e-5)
    gw = grad * w

    def backward(axes):
        return rstd * (gw - gw.mean(axes, keepdim=True)
                       - xhat * (gw * xhat).mean(axes, keepdim=True))

    xr = x.clone().requires_grad_(True)
    (true,) = torch.autograd.grad(F.layer_norm(xr, (12,), w, None, 1e-5), xr, grad)
    assert torch.allclose(true, backward((-1,)), atol=1e-10)  # the formula is right
    site = {"role": "grad_input", "inputs": {"0": f32(x)}, "weights": {"weight": f32(w)},
            "grad_output": f32(grad)}
    assert kind_of(f32(true), f32(backward((0, 2))), **site) == Kind.AXIS
    noisy = f32(true) + np.random.default_rng(0).standard_normal(true.shape) * 0.05
    assert kind_of(f32(true), noisy, **site) is None


def test_padding_rows_that_receive_gradient():
    rng = np.random.default_rng(7)
    grad = f32(rng.standard_normal((20, 8)))
    grad[[0, 4, 9]] = 0.0  # padding row 0 and two tokens not in the batch
    port = grad.copy()
    port[0] = f32(rng.standard_normal(8))
    found = hint(grad, port, role="weight_grad", rtol=RTOL, atol=ATOL)
    assert found.kind == Kind.MASK and "row(s) 0," in found.evidence


@pytest.mark.parametrize(("cell", "order"), [("lstm", "ifog"), ("gru", "zrn")])
def test_recurrent_gate_order(cell, order):
    torch.manual_seed(8)
    case_module = hint_bugs_real
    width, hidden = case_module.WIDTH, case_module.HIDDEN  # the hand cells' sizes
    reference = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(width, hidden,
                                                                    batch_first=True)
    port = (case_module.HandLSTM if cell == "lstm" else case_module.HandGRU)(order)
    port.weight_ih_l0 = torch.nn.Parameter(reference.weight_ih_l0.detach().clone())
    port.weight_hh_l0 = torch.nn.Parameter(reference.weight_hh_l0.detach().clone())
    port.bias_ih_l0 = torch.nn.Parameter(reference.bias_ih_l0.detach().clone())
    port.bias_hh_l0 = torch.nn.Parameter(reference.bias_hh_l0.detach().clone())
    x = torch.randn(3, 7, width)
    weights = {name: f32(p) for name, p in reference.named_parameters()}
    with torch.no_grad():
        ref_out, port_out = reference(x)[0], port(x)[0]
    found = hint(f32(ref_out), f32(port_out), role="output", rtol=RTOL, atol=ATOL,
                 inputs={"0": f32(x)}, weights=weights)
    assert found.kind == Kind.PERMUTATION and f"({', '.join(order)})" in found.evidence


# ---- the planted bugs, through capture, diff and the reports


@pytest.fixture(scope="module")
def reference_of(tmp_path_factory):
    work = tmp_path_factory.mktemp("hint_bugs_real")
    traces: dict[str, Path] = {}

    def get(spec: str) -> Path:
        if spec not in traces:
            traces[spec] = capture(load_case(spec), work / (spec.replace(":", "_") + ".h5"))
        return traces[spec]

    return get


def _diff_planted(planted, reference_of, tmp_path):
    pytest.importorskip("transformers") if "hf_llama" in planted.reference else None
    reference = reference_of(planted.reference)
    mapping = HERE / planted.mapping if planted.mapping else None
    case = load_case(planted.spec)
    load_weights(case.model, reference, mapping)
    port = capture(case, tmp_path / "port.h5")
    return diff(reference, port, mapping=mapping)


@pytest.mark.parametrize("planted", hint_bugs_real.BUGS, ids=lambda b: b.spec.split(":")[1])
def test_planted_bug_of_a_real_port_gets_its_hint(planted, reference_of, tmp_path):
    result = _diff_planted(planted, reference_of, tmp_path)
    origin = result.origin
    assert origin is not None and origin.pass_ == planted.pass_
    assert origin.hint is not None and origin.hint["kind"] == planted.kind, origin.hint


def test_forgotten_rope_permutation_is_rotary_in_terminal_and_html(reference_of, tmp_path):
    planted = next(b for b in hint_bugs_real.BUGS if "no_rope_permutation" in b.spec)
    result = _diff_planted(planted, reference_of, tmp_path)
    text = format_diff(result)
    assert "likely cause: rotary:" in text and "likely cause: mask" not in text
    page = write_html(result, tmp_path / "report.html").read_text(encoding="utf-8")
    assert "likely cause: <b>rotary</b>" in page and "<b>mask</b>" not in page


def test_faithful_llama_port_in_bfloat16_gets_no_false_hint(reference_of, tmp_path):
    """A correct port run in bfloat16 against a bfloat16 baseline: no origin carries a hint
    other than precision (its error is rounding)."""
    pytest.importorskip("transformers")
    spec, mapping = "reference_models.hf_llama:reference", HERE / "hf_llama.map.toml"
    reference = reference_of(spec)
    baseline = capture(load_case(spec), tmp_path / "baseline.h5", dtype="bfloat16")
    case = load_case("reference_models.llama_port:port")
    load_weights(case.model, reference, mapping)
    port = capture(case, tmp_path / "port.h5", dtype="bfloat16")
    result = diff(reference, port, mapping=mapping, baseline=baseline)
    assert all(o.hint is None or o.hint["kind"] == "precision" for o in result.origins)


def test_a_record_within_tolerance_gets_no_hint():
    """A passing record has no error to explain: not even a bfloat16 port's (precision), nor a
    sign-like pattern at rounding level."""
    rng = np.random.default_rng(9)
    ref = f32(rng.standard_normal((8, 32)))
    rounded = f32(torch.tensor(ref).bfloat16().double())
    assert kind_of(ref, rounded) == Kind.PRECISION  # out of float32's tolerance: named
    assert hint(ref, rounded, role="output", rtol=1e-2, atol=1e-5) is None  # within a baseline's


def test_a_parameter_the_mapping_transforms_is_hinted_as_the_diff_compared_it():
    """The stored port tensor is used as stored or transposed, whichever gives the diff's own
    largest difference; a tensor the mapping permutes (HF q/k rows for Meta's) is neither, and
    a hint of it would describe the mapping's layout, not a mistake."""
    from layerdiff.compare.hints.attach import _as_compared

    rng = np.random.default_rng(10)
    ref = rng.standard_normal((8, 8))
    port = ref * 1.01
    gap = float(np.max(np.abs(port - ref)))
    assert _as_compared(ref, port, gap) is port
    assert np.array_equal(_as_compared(ref, port.T.copy(), gap), port)  # stored transposed
    assert _as_compared(ref, port[::-1].copy(), gap) is None  # rows permuted by the mapping


def test_rounding_that_falls_in_some_batch_elements_is_precision_not_batch():
    """A float16 port's rounding is out of float32's tolerance only where the values are large:
    in some batch elements, not others. Where rounding falls is no evidence of a batch mix."""
    rng = np.random.default_rng(11)
    ref = f32(rng.standard_normal((8, 16, 32)))
    ref[[1, 2, 3, 5]] *= 1e-3  # small values: their float16 rounding is under atol
    port = f32(ref.astype(np.float16))
    assert kind_of(ref, port) == Kind.PRECISION


def test_an_error_of_varying_size_in_every_batch_element_is_not_a_batch_mix():
    """Accumulated rounding (a float16 port without its baseline) is in every batch element at
    sizes a few times apart, and crosses the tolerance in some only: not a batch pattern. A
    batch mix leaves the clean elements' values as they were."""
    rng = np.random.default_rng(12)
    ref = f32(rng.standard_normal((8, 16, 32)))
    size = np.where(np.isin(np.arange(8), [0, 4, 6, 7]), 6e-3, 8e-4)[:, None, None]
    noise = rng.uniform(-1, 1, ref.shape)
    rounding_like = f32(ref * (1 + size * noise))
    assert kind_of(ref, rounding_like, rtol=1e-3) is None
    mixed = ref.copy()
    mixed[[0, 4, 6, 7]] = f32(ref[[0, 4, 6, 7]] * (1 + 6e-3 * noise[[0, 4, 6, 7]]))
    assert kind_of(ref, mixed, rtol=1e-3) == Kind.BATCH


def test_gate_order_of_a_cell_whose_weights_have_other_names():
    """A hand-written reference LSTM (weights named W_x, W_h, b): found by their shapes."""
    torch.manual_seed(13)
    width, hidden = hint_bugs_real.WIDTH, hint_bugs_real.HIDDEN  # the hand cell's sizes
    torch_lstm = torch.nn.LSTM(width, hidden, batch_first=True)
    port = hint_bugs_real.HandLSTM("ifog")
    x = torch.randn(2, 4, width)
    with torch.no_grad():
        for name in ("weight_ih_l0", "weight_hh_l0", "bias_ih_l0", "bias_hh_l0"):
            setattr(port, name, torch.nn.Parameter(getattr(torch_lstm, name).clone()))
        port_out, ref_out = port(x)[0], torch_lstm(x)[0]
    weights = {"W_x": f32(torch_lstm.weight_ih_l0), "W_h": f32(torch_lstm.weight_hh_l0),
               "b": f32(torch_lstm.bias_ih_l0 + torch_lstm.bias_hh_l0)}
    found = hint(f32(ref_out), f32(port_out), role="output", rtol=RTOL, atol=ATOL,
                 inputs={"0": f32(x)}, weights=weights)
    assert found is not None and found.kind == Kind.PERMUTATION, found
