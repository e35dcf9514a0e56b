"""The position-shift hint (issue 40, item 4): a port whose sequence is off by one position
(position ids from 1, a causal convolution padded on the wrong side, a roll with the wrong
sign) holds at port position p the reference's values at p + 1 (or p - 1); the hint names the
shift, its direction and the positions without a partner, and nothing else makes it fire:
noise, a sequence constant along its positions, coincidences of discrete values."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, capture, diff, seed_everything
from layerdiff.compare.hints import Kind, hint
from layerdiff.report.terminal import format_diff

RTOL, ATOL = 1.3e-6, 1e-5  # float32's tolerance, as the diff gives it


def f32(values) -> np.ndarray:
    return np.asarray(values, np.float32).astype(np.float64)


def found(ref, port, role="output"):
    return hint(ref, port, role=role, rtol=RTOL, atol=ATOL)


@pytest.fixture
def seq():
    """(batch 3, length 10, width 8)."""
    return f32(np.random.default_rng(0).standard_normal((3, 10, 8)))


# ---- arrays


def test_ahead_by_one_with_a_pad_at_the_end(seq):
    port = np.zeros_like(seq)
    port[:, :-1] = seq[:, 1:]  # p holds p + 1; the last position padded with zeros
    got = found(seq, port)
    assert got is not None and got.kind == Kind.SHIFT, got
    assert "holds the reference's position p+1 for every p in 0-8" in got.evidence
    assert "in every batch element" in got.evidence and "runs one position ahead" in got.evidence
    assert "position 9 has no partner (the port's values there are 0: a pad)" in got.evidence


def test_behind_by_one_a_roll_is_a_shift_not_a_permutation(seq):
    got = found(seq, np.roll(seq, 1, axis=1))  # p holds p - 1, position 0 the last one
    assert got is not None and got.kind == Kind.SHIFT, got
    assert "position p-1 for every p in 1-9" in got.evidence
    assert "lags one position behind" in got.evidence
    assert "position 0 has no partner (the port holds the reference's position 9 there: a roll)" \
        in got.evidence


def test_by_two_and_on_a_sequence_without_batch(seq):
    port = np.roll(seq, -2, axis=1)
    port[:, -2:] = 7.0  # whatever the port has past the end
    got = found(seq, port)
    assert got is not None and got.kind == Kind.SHIFT, got
    assert "p+2 for every p in 0-7" in got.evidence and "positions 8-9 have no partner" \
        in got.evidence
    tokens = seq[0]  # (length, width): the positions are axis 0
    got = found(tokens, np.roll(tokens, 1, axis=0))
    assert got is not None and got.kind == Kind.SHIFT and "of axis 0" in got.evidence, got


def test_a_shift_along_the_last_axis_of_a_channels_first_layout(seq):
    conv = seq.transpose(0, 2, 1)  # (batch, channels, length), as a Conv1d's output
    port = np.concatenate([conv[..., 1:], conv[..., -1:] * 0.5], axis=-1)
    got = found(conv, port)
    assert got is not None and got.kind == Kind.SHIFT and "of axis 2" in got.evidence, got


def test_an_exclusive_scan_for_an_inclusive_one(seq):
    """A cumulative sum that excludes the current position, where the reference's includes it:
    port position p is the reference's p - 1, position 0 empty."""
    inclusive = np.cumsum(seq, axis=1)
    exclusive = np.concatenate([np.zeros_like(seq[:, :1]), inclusive[:, :-1]], axis=1)
    got = found(inclusive, exclusive)
    assert got is not None and got.kind == Kind.SHIFT, got
    assert "p-1 for every p in 1-9" in got.evidence
    assert "position 0 has no partner (the port's values there are 0: a pad)" in got.evidence


def test_a_shift_of_integer_position_ids():
    ids = np.broadcast_to(np.arange(12), (2, 12))
    got = found(ids, ids + 1)  # positions counted from 1
    assert got is not None and got.kind == Kind.SHIFT, got
    assert "p+1 for every p in 0-10" in got.evidence


def test_a_shift_wins_over_a_mask_read_from_a_run_of_positions(seq):
    """The first positions equal one another, so shifted they stay within: unshifted the error
    is one run of whole positions to the end, which alone reads as a mask's boundary; the
    shift explains every position and is named instead."""
    ref = seq.copy()
    ref[:, :5] = ref[:, :1]            # constant over positions 0-4
    port = np.roll(ref, -1, axis=1)
    port[:, -1] = 0
    got = found(ref, port)
    assert got is not None and got.kind == Kind.SHIFT, got
    masked = ref.copy()
    masked[:, 5:] += 1.0  # the same run of positions wrong, not shifted: still a mask
    got = found(ref, masked)
    assert got is not None and got.kind == Kind.MASK, got


def test_no_shift_from_constant_positions_noise_or_a_near_shift(seq):
    constant = np.broadcast_to(seq[:, :1], seq.shape).copy()
    port = constant.copy()
    port[:, -1] += 1.0  # a shift of a constant matches trivially: no evidence of one
    got = found(constant, port)
    assert got is None or got.kind != Kind.SHIFT, got
    rng = np.random.default_rng(1)
    for scale in (1e-3, 1.0):
        got = found(seq, seq + scale * rng.standard_normal(seq.shape))
        assert got is None or got.kind != Kind.SHIFT, got
    # shifted, but one value out of tolerance in the overlap: not "every position"
    port = np.roll(seq, -1, axis=1)
    port[1, 4, 3] += 0.1
    got = found(seq, port)
    assert got is None or got.kind != Kind.SHIFT, got


def test_coincidences_of_discrete_values_are_no_evidence():
    """Coin flips over 8 positions, shifted by one: 6 positions out unshifted and within
    shifted, but half the reference's values match any port value, so 6 matches happen by
    chance with probability 0.5^6 (x 4 shifts tried): no evidence of a shift. The same shift
    of continuous values over as few positions is one."""
    flips = np.array([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    port = np.append(flips[1:], 1.0)
    got = found(flips, port)
    assert got is None or got.kind != Kind.SHIFT, got
    values = f32(np.random.default_rng(2).standard_normal(8))
    got = found(values, np.append(values[1:], 0.0))
    assert got is not None and got.kind == Kind.SHIFT, got


def test_a_parameter_is_not_read_as_positions(seq):
    got = found(seq[0], np.roll(seq[0], 1, axis=0), role="weight")
    assert got is None or got.kind != Kind.SHIFT, got


# ---- end to end: a tiny sequence model whose port is one position off


class Embedder(nn.Module):
    """Tokens plus learned positions; ``offset`` 1 counts the positions from 1."""

    def __init__(self, vocab: int = 16, length: int = 12, width: int = 8,
                 offset: int = 0) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(length + 1, width)
        self.mix = nn.Linear(width, width)
        self.offset = offset

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]) + self.offset
        return self.mix(self.tok(ids) + self.pos(positions))


class CausalConv(nn.Module):
    """A causal depthwise-free 1-d convolution over (batch, length, width): the reference pads
    kernel - 1 on the left; the port one too few on the left and one on the right, so its
    position p sees the reference's window of p + 1."""

    def __init__(self, width: int = 8, kernel: int = 3, wrong_side: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width, kernel) / math.sqrt(width * kernel))
        self.pad = (kernel - 2, 1) if wrong_side else (kernel - 1, 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.conv1d(F.pad(x.transpose(1, 2), self.pad), self.weight).transpose(1, 2)


class ConvModel(nn.Module):
    def __init__(self, wrong_side: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.conv = CausalConv(wrong_side=wrong_side)
        self.out = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.conv(self.inp(x))))


def _case(model: nn.Module, inputs: tuple) -> Case:
    return Case(model=model, inputs=inputs, loss_fn=lambda out: (out**2).mean(), seed=0,
                steps=1, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def _diff(build, inputs, tmp_path, **bug):
    seed_everything(0)
    reference = build()
    port = build(**bug)
    port.load_state_dict(reference.state_dict())
    return diff(capture(_case(reference, inputs), tmp_path / "ref.h5"),
                capture(_case(port, inputs), tmp_path / "port.h5"))


def test_position_ids_from_one_end_to_end(tmp_path):
    ids = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(0))
    result = _diff(Embedder, (ids,), tmp_path, offset=1)
    origin = result.origins[0]
    # the positions are made by the model's own code: the hint reads the first value it makes
    assert origin.site == "<root>#0" and origin.hint is not None, origin
    assert origin.hint["kind"] == "position-shift", origin.hint
    assert origin.hint["evidence"].startswith("at pos's input"), origin.hint
    assert "p+1 for every p in 0-10" in origin.hint["evidence"]
    assert "likely cause: position-shift" in format_diff(result)


def test_causal_conv_padded_on_the_wrong_side_end_to_end(tmp_path):
    x = torch.randn(2, 12, 8, generator=torch.Generator().manual_seed(1))
    result = _diff(ConvModel, (x,), tmp_path, wrong_side=True)
    origin = result.origins[0]
    assert (origin.site, origin.role) == ("conv#0", "output"), origin
    assert origin.hint is not None and origin.hint["kind"] == "position-shift", origin.hint
    evidence = origin.hint["evidence"]
    assert "axis 1 holds the reference's position p+1 for every p in 0-10 in every batch " \
        "element" in evidence and "position 11 has no partner" in evidence, evidence
