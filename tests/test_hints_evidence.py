"""Likely-cause hints whose evidence a wrong cause cannot produce (issue 39, item 8): rotary
asks for a rotation between feature pairs, not an error growing with the position; position ids
are no mask; a fitted epsilon is never negative; a norm's (1 + w) weight offset is named; one
bfloat16 tensor inside a float32 port is named as that tensor; a port tensor no reference
tensor gives points at the port too. Each planted bug is a small model of
tests/hint_evidence_cases.py through capture and diff."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff, load_weights, map_check
from layerdiff.compare.hints import Kind, hint
from layerdiff.compare.hints.normalization import _fit_epsilons
from layerdiff.errors import MappingError
from layerdiff.report.findings.replay import mapcheck_text
from layerdiff.report.terminal import format_diff
from tests import hint_evidence_cases as cases

RTOL, ATOL = 1.3e-6, 1e-5


def _diff(pair, tmp_path):
    reference, port = pair
    return diff(capture(reference, tmp_path / "ref.h5"), capture(port, tmp_path / "port.h5"))


def _origin(result, site):
    origin = next((o for o in result.origins if o.site == site), None)
    assert origin is not None, [o.site for o in result.origins]
    return origin


# ---- rotary: a rotation between feature pairs, not growth with the position


def test_a_recurrence_with_another_decay_is_not_rotary(tmp_path):
    """h_t = a h_{t-1} + b x_t from h = 0: exact at position 0, error growing with every step
    (rank correlation 1.00), once hinted 'rotary'; no pair keeps its norm."""
    origin = _origin(_diff(cases.scan_decay(), tmp_path), "scan#0")
    assert origin.hint is None or origin.hint["kind"] not in ("rotary", "mask"), origin.hint


def test_a_rope_sign_bug_taking_position_ids_is_rotary_not_mask(tmp_path):
    result = _diff(cases.rotary_sign_position_ids(), tmp_path)
    origin = _origin(result, "attn.rotary#0")
    assert origin.hint is not None and origin.hint["kind"] == "rotary", origin.hint
    assert "keeps its norm" in origin.hint["evidence"]
    assert "sine negated" in origin.hint["evidence"]
    assert "likely cause: mask" not in format_diff(result)


def test_position_ids_are_no_mask_and_a_0_1_mask_still_is():
    rng = np.random.default_rng(4)
    out = rng.standard_normal((3, 10, 8))
    port = out.copy()
    port[:, 1:] += rng.standard_normal((3, 9, 8))  # every position but the first
    ids = np.broadcast_to(np.arange(10), (3, 10)).copy()
    found = hint(out, port, role="output", rtol=RTOL, atol=ATOL, inputs={"1": ids})
    assert found is None or found.kind != Kind.MASK, found
    keep = np.ones((3, 10), np.int64)
    keep[:, 0] = 0  # a 0/1 mask whose masked position is the exact one
    found = hint(out, port, role="output", rtol=RTOL, atol=ATOL, inputs={"keep": keep})
    assert found is not None and found.kind == Kind.MASK


def _rope(x, positions, base=10000.0, sign=1.0):
    """x (batch, length, heads, d) rotated, half-split pairs, as Hugging Face's."""
    d = x.shape[-1]
    angles = positions[:, None] * base ** (-np.arange(0, d, 2) / d)[None]
    angles = np.concatenate([angles, angles], -1)[None, :, None, :]
    turned = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * np.cos(angles) + sign * turned * np.sin(angles)


@pytest.mark.parametrize(("bug", "words"), [
    ({"offset": 3.0}, "the same turn at every position (positions offset"),
    ({"base": 500000.0}, "no turn at position 0"),
    ({"sign": -1.0}, "the sine negated")])
def test_each_rope_mistake_at_a_rotary_site_is_a_rotation(bug, words):
    rng = np.random.default_rng(3)
    x = np.asarray(rng.standard_normal((3, 12, 2, 8)), np.float32).astype(np.float64)
    positions = np.arange(12, dtype=np.float64)
    ref = np.asarray(_rope(x, positions), np.float32).astype(np.float64)
    port = _rope(x, positions + bug.get("offset", 0.0), bug.get("base", 10000.0),
                 bug.get("sign", 1.0))
    found = hint(ref, np.asarray(port, np.float32).astype(np.float64), role="output",
                 rtol=RTOL, atol=ATOL, inputs={"0": x})
    assert found is not None and found.kind == Kind.ROTARY, found
    assert words in found.evidence and "half-split pairs" in found.evidence


def test_a_random_error_that_keeps_no_pair_norm_gets_no_rotary():
    rng = np.random.default_rng(5)
    out = rng.standard_normal((4, 16, 32))
    for size in (1e-4, 1e-2, 1.0):
        noisy = out + size * np.arange(16)[None, :, None] * rng.standard_normal(out.shape)
        noisy[:, 0] = out[:, 0]
        found = hint(out, noisy, role="output", rtol=RTOL, atol=ATOL)
        assert found is None or found.kind != Kind.ROTARY, found


def test_a_pair_reflection_keeps_norms_but_is_not_a_rotary_turn():
    """Negating the second element of every pair keeps each pair's norm, but the turn depends
    on each pair's own angle, not on the position alone: no rotary."""
    rng = np.random.default_rng(6)
    out = rng.standard_normal((4, 12, 16))
    port = out.copy()
    port[:, 1:, 1::2] *= -1
    found = hint(out, port, role="output", rtol=RTOL, atol=ATOL)
    assert found is None or found.kind != Kind.ROTARY, found


# ---- precision: one bfloat16 tensor inside a float32 port


def test_a_rotary_table_cast_to_bfloat16_is_named_not_the_port(tmp_path):
    result = _diff(cases.rotary_table_bf16(), tmp_path)
    origin = _origin(result, "attn#0")
    assert origin.hint is not None and origin.hint["kind"] == "precision", origin.hint
    assert "rotary tables (cos, sin) rounded to bfloat16" in origin.hint["evidence"]
    assert "the port runs in bfloat16" not in format_diff(result)


def test_a_table_passed_in_bfloat16_is_named_as_that_tensor(tmp_path):
    result = _diff(cases.passed_table_bf16(), tmp_path)
    origin = result.origin
    assert origin.hint is not None and origin.hint["kind"] == "precision", origin.hint
    assert "attn's input '1'" in origin.hint["evidence"]
    assert "inside a float32 port" in origin.hint["evidence"]
    precision = result.meta["precision"]
    assert precision["lower"] == "bfloat16" and precision["port"] == "float32"
    assert "attn#0 input '1'" in precision["records"]
    text = format_diff(result)
    assert "the port runs in bfloat16" not in text
    assert "are bfloat16 inside a float32 port" in text


# ---- epsilon: fitted >= 0


@pytest.mark.parametrize(("reference_eps", "port_eps"), [(1e-6, 1e-5), (1e-5, 1e-6)])
def test_an_rms_norm_epsilon_is_fitted_positive_and_close(reference_eps, port_eps, tmp_path):
    """Rows whose mean square spans 1e-2 to 1: the linearized least-squares fit put the
    reference's epsilon at -6e-6 for 1e-6 here (then clipped to 0, 'too small to measure')."""
    pair = cases.rms_norm_eps(reference_eps, port_eps, scales=(-1.0, 0.0))
    origin = _origin(_diff(pair, tmp_path), "norm#0")
    assert origin.hint is not None and origin.hint["kind"] == "epsilon", origin.hint
    evidence = origin.hint["evidence"]
    assert f"{port_eps:.2g} where the reference's is {reference_eps:.2g}" in evidence, evidence


def _rms_norm(x, w, eps):
    x = torch.tensor(x, dtype=torch.float32)
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * torch.tensor(w).float()
    return y.double().numpy()


@pytest.mark.parametrize(("decades", "reference_eps", "port_eps"), [
    ((-3, 0), 1e-6, 1e-5), ((-3, 0), 1e-5, 1e-6), ((-1, 0), 1e-6, 1e-5), ((-1, 0), 1e-5, 1e-6)])
def test_both_epsilons_within_ten_percent(decades, reference_eps, port_eps):
    """Rows of width 64 whose mean squares span the decades given: the linearized fit gave
    no hint at (-3, 0) and a reference epsilon of 0 (fitted -5e-6, clipped) at (-1, 0)."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 32, 64)) * np.logspace(*decades, 32)[None, :, None]
    x = np.asarray(x, np.float32).astype(np.float64)
    w = np.asarray(1 + 0.3 * rng.standard_normal(64), np.float32).astype(np.float64)
    found = hint(_rms_norm(x, w, reference_eps), _rms_norm(x, w, port_eps), role="output",
                 rtol=RTOL, atol=ATOL, inputs={"0": x}, weights={"weight": w})
    assert found is not None and found.kind == Kind.EPSILON, found
    numbers = [float(v) for v in re.findall(r"(\d\.?\d*e-\d+) where the reference's is "
                                            r"(\d\.?\d*e-\d+)", found.evidence)[0]]
    assert numbers[0] == pytest.approx(port_eps, rel=0.1), found.evidence
    assert numbers[1] == pytest.approx(reference_eps, rel=0.1), found.evidence


def test_the_epsilon_fit_never_goes_negative():
    rng = np.random.default_rng(7)
    for _ in range(20):
        variance = 10.0 ** rng.uniform(-3, 0, 200)
        eps_ref, eps_port = 10.0 ** rng.uniform(-8, -4, 2)
        c = np.sqrt((variance + eps_ref) / (variance + eps_port))
        c = c * (1 + 1e-7 * rng.standard_normal(c.shape))  # float32 rounding
        fitted = _fit_epsilons(c, variance)
        assert fitted is None or min(fitted) >= 0, fitted


# ---- the (1 + w) norm weight offset


@pytest.mark.parametrize(("reference_offset", "words"), [
    (True, "the port multiplies by w where the reference multiplies by (1 + w)"),
    (False, "the port multiplies by (1 + w) where the reference multiplies by w")])
def test_a_norm_weight_offset_is_named(reference_offset, words, tmp_path):
    origin = _origin(_diff(cases.norm_offset(reference_offset), tmp_path), "norm#0")
    assert origin.hint is not None and origin.hint["kind"] == "weight-offset", origin.hint
    assert words in origin.hint["evidence"]


def test_a_norm_whose_port_forgets_its_weight_is_no_offset():
    """port = x_hat where the reference has x_hat w: a ratio 1/w per feature, not w/(1+w)."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, 6, 16))
    w = 1 + 0.3 * rng.standard_normal(16)
    xhat = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + 1e-6)
    found = hint(xhat * w, xhat, role="output", rtol=RTOL, atol=ATOL, inputs={"0": x},
                 weights={"weight": w})
    assert found is None or found.kind != Kind.WEIGHT_OFFSET, found


# ---- a port tensor no reference tensor gives


class Plain(nn.Module):
    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8, bias=False)
        if extra:
            self.lin.bias = nn.Parameter(torch.zeros(8))  # the port's own, not the reference's

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


def _plain_case(model: nn.Module) -> Case:
    return Case(model=model, inputs=(torch.randn(2, 8),), loss_fn=lambda out: out.sum(),
                name="tests.test_hints_evidence:plain")


def test_a_port_tensor_nothing_gives_points_at_the_port_too(tmp_path):
    torch.manual_seed(0)
    reference = capture(_plain_case(Plain()), tmp_path / "ref.h5")
    with pytest.raises(MappingError) as raised:
        load_weights(Plain(extra=True), reference)
    message = str(raised.value)
    assert "lin.bias" in message and "the port's module lin may have a parameter" in message
    check = map_check(reference, _plain_case(Plain(extra=True)))
    text = mapcheck_text(check)
    verdict = text.splitlines()[-1]
    assert verdict.startswith("FAIL") and verdict.endswith("or the port"), verdict
    text = " ".join(text.split())
    assert "port tensors no reference tensor gives (1): lin.bias" in text
    assert "the port itself has a parameter the reference's layer does not" in text
