"""Likely-cause hints: each kind is named on an error of that kind, random errors get none, and
a planted bug's origin carries the right hint through diff, its JSON and its reports."""

from __future__ import annotations

import math

import hypothesis.strategies as st
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, diff, load_case, load_weights, seed_everything
from layerdiff.compare.hints import Attention, Kind, hint
from layerdiff.compare.hints.attach import attach_hints
from layerdiff.compare.pair import PairReader
from layerdiff.report.html import write_html
from layerdiff.report.terminal import format_diff
from layerdiff.trace import open_trace
from reference_models import hint_bugs
from reference_models.catalog import find

RTOL, ATOL = 1.3e-6, 1e-5  # float32's tolerance, as the diff gives it


def f32(values) -> np.ndarray:
    """Values as a float32 trace holds them."""
    return np.asarray(values, np.float32).astype(np.float64)


def kind_of(ref, port, **site) -> str | None:
    found = hint(ref, port, role=site.pop("role", "output"), rtol=RTOL, atol=ATOL, **site)
    return None if found is None else str(found.kind)


@pytest.fixture
def rng():
    return np.random.default_rng(0)


# ---- one synthetic pair per kind


def test_sign_scale_and_missing_term(rng):
    x = f32(rng.standard_normal((8, 6, 16)))
    weight, bias = f32(rng.standard_normal((16, 16)) / 4), f32(rng.standard_normal(16))
    y = f32(x @ weight.T + bias)
    site = {"inputs": {"0": x}, "weights": {"weight": weight, "bias": bias}}
    assert kind_of(y, -y, **site) == Kind.SIGN
    found = hint(y, f32(y / 8), role="output", rtol=RTOL, atol=ATOL, **site)
    assert found.kind == Kind.SCALE and "0.125 (1/8)" in found.evidence
    assert kind_of(y, f32(y - bias), **site) == Kind.MISSING_TERM
    assert kind_of(y + x, y, inputs={"0": x}) == Kind.MISSING_TERM  # a residual left out


def test_transposes_and_permutation(rng):
    square = f32(rng.standard_normal((12, 12)))
    assert kind_of(square, square.T, role="weight") == Kind.TRANSPOSE
    heads = f32(rng.standard_normal((4, 6, 10)))
    found = hint(heads, heads.transpose(1, 0, 2).reshape(heads.shape), role="output",
                 rtol=RTOL, atol=ATOL)
    assert found.kind == Kind.TRANSPOSE and "reshape or view" in found.evidence
    x, weight = f32(rng.standard_normal((8, 16))), f32(rng.standard_normal((16, 16)))
    assert kind_of(f32(x @ weight.T), f32(x @ weight), inputs={"0": x},
                   weights={"weight": weight}) == Kind.TRANSPOSE
    gates = f32(rng.standard_normal((32, 9, 3, 3)))
    i, f, g, o = np.split(gates, 4)
    found = hint(gates, np.concatenate([i, f, o, g]), role="weight", rtol=RTOL, atol=ATOL)
    assert found.kind == Kind.PERMUTATION and "[0, 1, 3, 2]" in found.evidence


def _softmax(x, axis):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def test_softmax_over_another_axis(rng):
    scores = f32(rng.standard_normal((4, 3, 10, 10)))
    assert kind_of(f32(_softmax(scores, -1)), f32(_softmax(scores, -2)),
                   inputs={"0": scores}) == Kind.AXIS


def test_epsilon_of_a_layer_norm_and_of_an_rms_norm(rng):
    x = f32(rng.standard_normal((8, 12, 32)) * rng.uniform(0.02, 2.0, (8, 12, 1)))
    gamma, beta = f32(rng.uniform(0.5, 1.5, 32)), f32(rng.standard_normal(32) * 0.1)

    def layer_norm(eps):
        return f32((x - x.mean(-1, keepdims=True)) / np.sqrt(x.var(-1, keepdims=True) + eps)
                   * gamma + beta)

    def rms_norm(eps):
        return f32(x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * gamma)

    found = hint(layer_norm(1e-5), layer_norm(1e-3), role="output", rtol=RTOL, atol=ATOL,
                 inputs={"0": x}, weights={"weight": gamma, "bias": beta})
    assert found.kind == Kind.EPSILON and "0.001" in found.evidence
    assert kind_of(rms_norm(1e-6), rms_norm(1e-2), inputs={"0": x},
                   weights={"weight": gamma}) == Kind.EPSILON


def test_tanh_gelu_for_erf_gelu_forward_and_backward(rng):
    x = torch.tensor(rng.standard_normal((16, 64)) * 1.5, dtype=torch.float32,
                     requires_grad=True)
    grad = torch.tensor(rng.standard_normal((16, 64)), dtype=torch.float32)
    outputs, grads = [], []
    for approximate in ("none", "tanh"):
        out = F.gelu(x, approximate=approximate)
        (g,) = torch.autograd.grad(out, x, grad)
        outputs.append(f32(out.detach()))
        grads.append(f32(g))
    inputs = {"0": f32(x.detach())}
    assert kind_of(*outputs, inputs=inputs) == Kind.APPROXIMATION
    assert kind_of(*grads, role="grad_input", inputs=inputs,
                   grad_output=f32(grad)) == Kind.APPROXIMATION


def test_where_the_error_is(rng):
    out = f32(rng.standard_normal((6, 10, 16)))
    later = out.copy()
    later[1:] += rng.standard_normal(later[1:].shape)  # all but the first batch element
    assert kind_of(out, later) == Kind.BATCH
    shifted = out.copy()
    shifted[:, :9] += rng.standard_normal(shifted[:, :9].shape)  # every position but the last
    assert kind_of(out, shifted) == Kind.MASK
    lengths = np.array([10, 7, 10, 4, 9, 10])
    mask = np.arange(10)[None, :] < lengths[:, None]  # True = a real token
    padded = out.copy()
    padded[~mask] += 1.0  # only the padding rows are wrong
    found = hint(out, padded, role="output", rtol=RTOL, atol=ATOL, inputs={"mask": mask})
    assert found.kind == Kind.MASK and "input 'mask'" in found.evidence


def test_boolean_masks_that_differ():
    causal = np.tril(np.ones((8, 8), bool))
    found = hint(causal, np.tril(np.ones((8, 8), bool), 1), role="weight", rtol=0, atol=0)
    assert found.kind == Kind.MASK and "off by 1" in found.evidence
    assert hint(causal, ~causal, role="weight", rtol=0, atol=0).kind == Kind.MASK


def test_bfloat16_numbers_are_precision(rng):
    x = torch.tensor(rng.standard_normal((16, 32)), dtype=torch.float32)
    weight = torch.tensor(rng.standard_normal((24, 32)) / 6, dtype=torch.float32)
    ref = f32(F.linear(x, weight))
    port = f32(F.linear(x.bfloat16(), weight.bfloat16()).float())
    assert kind_of(ref, port, inputs={"0": f32(x)}, weights={"weight": f32(weight)}) == \
        Kind.PRECISION


def _attention_case(rng, batch=3, length=7, width=16, heads=4):
    q, k, v = (f32(rng.standard_normal((batch, length, width))) for _ in range(3))
    lengths = np.array([length, length - 2, length - 4])
    keys = np.arange(length)[None, :] < lengths[:, None]  # (batch, Lk), True = attend

    def attend(mask, scale=None, axis=-1, merge_transposed=True):
        scale = 1 / math.sqrt(width // heads) if scale is None else scale
        split = [t.reshape(batch, length, heads, -1).transpose(0, 2, 1, 3) for t in (q, k, v)]
        scores = scale * split[0] @ split[1].transpose(0, 1, 3, 2)
        scores = np.where(mask, scores, -1e9)
        out = _softmax(scores, axis) @ split[2]
        if merge_transposed:
            return f32(out.transpose(0, 2, 1, 3).reshape(batch, length, width))
        return f32(out.reshape(batch, length, width))

    return q, k, v, keys, attend


def test_attention_recomputed_from_the_references_q_k_v(rng):
    q, k, v, keys, attend = _attention_case(rng)
    mask = keys[:, None, None, :]
    context = attend(mask)
    parts = Attention(q, k, v, context, mask=keys)

    def kind(port):
        return kind_of(context, port, attention=parts)

    assert kind(attend(mask, axis=-2)) == Kind.AXIS
    assert kind(attend(mask, scale=1.0)) == Kind.SCALE
    assert kind(attend(~mask)) == Kind.MASK
    assert kind(attend(mask, merge_transposed=False)) == Kind.TRANSPOSE
    causal = np.tril(np.ones((7, 7), bool))
    parts = Attention(q, k, v, attend(causal))
    found = hint(attend(causal), attend(np.tril(np.ones((7, 7), bool), 1)), role="output",
                 rtol=RTOL, atol=ATOL, attention=parts)
    assert found.kind == Kind.MASK and "off by one" in found.evidence


# ---- no hint where nothing matches


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**32 - 1),
       shape=st.lists(st.integers(2, 12), min_size=2, max_size=4).map(tuple),
       log_size=st.floats(-6, 1))
def test_an_error_with_no_structure_gets_no_hint(seed, shape, log_size):
    """i.i.d. Gaussian errors of any size, from a millionth of the reference's rms to ten
    times it, on a Gaussian reference with an input of its shape and a bias on offer."""
    rng = np.random.default_rng(seed)
    ref = f32(rng.standard_normal(shape))
    port = f32(ref + rng.standard_normal(shape) * 10.0**log_size)
    site = {"inputs": {"0": f32(rng.standard_normal(shape))},
            "weights": {"bias": f32(rng.standard_normal(shape[-1]))}}
    if np.all(np.abs(port - ref) <= ATOL + RTOL * np.abs(ref)):
        return  # within tolerance: never an origin
    assert hint(ref, port, role="output", rtol=RTOL, atol=ATOL, **site) is None
    assert hint(ref, port, role="weight", rtol=RTOL, atol=ATOL) is None


def test_a_random_error_at_an_attention_site_gets_no_hint(rng):
    q, k, v, keys, attend = _attention_case(rng)
    context = attend(keys[:, None, None, :])
    noisy = f32(context + rng.standard_normal(context.shape) * 0.05)
    assert kind_of(context, noisy, attention=Attention(q, k, v, context, mask=keys)) is None


# ---- end to end: a planted bug diffed, its origin's hint


@pytest.fixture(scope="module")
def mlp_traces(tmp_path_factory):
    """The MLP reference and two of its planted bugs, captured once."""
    work = tmp_path_factory.mktemp("hints")
    reference = capture(load_case("reference_models.mlp:reference"), work / "ref.h5")
    ports = {}
    for name in ("mlp_bias_twice", "mlp_sign_backward"):
        case = load_case(f"reference_models.hint_bugs:{name}")
        load_weights(case.model, reference, None)
        ports[name] = capture(case, work / f"{name}.h5")
    return reference, ports


@pytest.mark.parametrize("name", ["mlp_bias_twice", "mlp_sign_backward"])
def test_planted_bug_origin_carries_its_hint(mlp_traces, name, tmp_path):
    reference, ports = mlp_traces
    planted = next(b for b in hint_bugs.BUGS if b.spec.endswith(f":{name}"))
    result = diff(reference, ports[name])
    origin = result.origin
    assert (origin.port_site, origin.pass_) == (planted.site, planted.pass_)
    assert origin.hint is not None and origin.hint["kind"] == planted.kind
    assert result.as_json()["origin"]["hint"] == origin.hint
    assert f"likely cause: {planted.kind}:" in format_diff(result)
    if name == "mlp_bias_twice":  # the page, once: plotting takes seconds
        page = write_html(result, tmp_path / "report.html").read_text(encoding="utf-8")
        assert f"likely cause: <b>{planted.kind}</b>" in page


def test_catalog_bug_at_an_attention_site_is_named_by_recomputing_attention(
        reference_traces, tmp_path):
    info = find("reference_models.transformer_port:bug_missing_scale")
    reference = reference_traces(info.reference)
    case = load_case(info.spec)
    load_weights(case.model, reference, info.mapping_path)
    port = capture(case, tmp_path / "port.h5")
    result = diff(reference, port, mapping=info.mapping_path)
    assert result.origin.hint["kind"] == Kind.SCALE
    assert "0.25 (1/4)" in result.origin.hint["evidence"]  # 1/sqrt(d_k), d_k = 16


def test_no_hint_without_tensor_data(mlp_traces):
    reference, ports = mlp_traces
    result = diff(reference, ports["mlp_bias_twice"])
    with open_trace(reference) as ref, open_trace(ports["mlp_bias_twice"]) as port:
        # nothing small enough
        attach_hints(result.origins, PairReader(ref, port, result.pairs), max_elements=8)
    assert result.origin.hint is None


# ---- a model the bundled zoo does not have: RMS norm and a softmax module over channels


class RMSNorm(nn.Module):
    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class Tagger(nn.Module):
    """(batch, time, features) -> per-step class probabilities laid out (batch, class, time)."""

    def __init__(self, eps: float = 1e-6, softmax_dim: int = 1) -> None:
        super().__init__()
        self.proj = nn.Linear(12, 16)
        self.norm = RMSNorm(16, eps)
        self.out = nn.Linear(16, 5)
        self.probs = nn.Softmax(dim=softmax_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.probs(self.out(self.norm(self.proj(x))).transpose(1, 2))


def _tagger(**options) -> Case:
    seed_everything(3)
    model = Tagger(**options)
    x = torch.randn(4, 9, 12) * torch.linspace(0.01, 1.0, 9).view(1, 9, 1)
    return Case(model=model, inputs=(x,), loss_fn=lambda p: p[:, 0].sum(), seed=3)


@pytest.mark.parametrize(("options", "site", "kind"), [
    ({"eps": 1e-2}, "norm#0", Kind.EPSILON),
    ({"softmax_dim": 2}, "probs#0", Kind.AXIS),
])
def test_own_model_rms_norm_epsilon_and_softmax_axis(options, site, kind, tmp_path):
    reference = capture(_tagger(), tmp_path / "ref.h5")
    port = capture(_tagger(**options), tmp_path / "port.h5")
    origin = diff(reference, port).origin
    assert origin.site == site and origin.hint["kind"] == kind


def test_precision_decides_from_the_first_values_as_from_all(rng):
    """The precision kind's test of the port's values (>= 99% lower-dtype numbers) gives the
    whole tensor's answer when it stops at the first values; a tensor whose first values are
    float32 and the rest bfloat16 still goes the whole way."""
    from layerdiff.compare.hints import elementwise
    values = rng.standard_normal(1 << 16)
    bf16 = np.asarray(torch.from_numpy(values).to(torch.bfloat16).double())
    mixed = bf16.copy()
    mixed[:200] = values[:200]  # 200 of 65,536 off: 99.7% representable
    over = bf16.copy()
    over[:1000] = values[:1000]  # 98.5%: refused
    zeros = np.where(rng.random(values.size) < 0.9, 0.0, values)
    for case in (values, bf16, mixed, over, zeros, np.zeros(100)):
        for _, bits in elementwise.LOWER:
            whole = elementwise._representable(case, bits) >= 0.99 if np.any(case) else False
            assert elementwise._mostly_representable(case, bits, 0.99) == whole
    assert elementwise._mostly_representable(mixed, 8, 0.99)
    assert not elementwise._mostly_representable(over, 8, 0.99)
