"""An honest "cannot judge" (issue 39): when the first out-of-tolerance record lies at or inside a
site that cannot be judged, the diff's answer is that site, the record and the rule to write,
and a later origin is offered only hedged, never as the confident answer."""

from __future__ import annotations

import json

import torch
from torch import nn

from layerdiff import Case, diff, load_weights, seed_everything
from layerdiff.capture import capture
from layerdiff.report.html import render_html
from layerdiff.report.terminal import format_diff
from tests import real_pairs_cases as cases

ATTN0 = "layers.0.attn#0"


def test_an_attention_whose_port_only_inputs_have_no_partner_is_the_answer(tmp_path):
    """Without call adapters the port's rotary tables pair with nothing: the first record out
    is the attention's output projection's input, inside the attention, and the headline says
    the attention cannot be judged and which adapter to write."""
    reference = capture(cases.reference(), tmp_path / "ref.h5", progress=False)
    port_case = cases.port_freqs_bug_scale()
    load_weights(port_case.model, reference)
    result = diff(reference, capture(port_case, tmp_path / "port.h5", progress=False))

    first = result.cannot_judge_first
    assert first is not None and not result
    assert (first.site, first.pass_, first.record_site) == (ATTN0, "forward", "layers.0.attn.o#0")
    assert first.ratio > 1e3
    assert "'freqs_cos', 'freqs_sin'" in first.why and "call adapter" in first.why
    text = format_diff(result)
    assert text.splitlines()[0].startswith(f"FAIL  cannot judge {ATTN0}, which holds the first "
                                           "record out (forward, ")
    assert "origin:" not in text.splitlines()[0]
    assert json.loads(json.dumps(result.as_json()))["cannot_judge_first"]["site"] == ATTN0
    assert f"Cannot judge {ATTN0}, which holds the first record out" in render_html(result)


class Branch(nn.Module):
    def __init__(self, scale: float = 1.0) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.scale = scale

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        y = self.proj(x) * self.scale
        return y if mask is None else y * mask


class TwoBranches(nn.Module):
    """``a`` runs first; ``b`` takes the model's input, so its inputs stay right whatever ``a``
    computes: a bug in ``b`` is an origin of its own."""

    def __init__(self, port: bool = False, a_scale: float = 1.0, b_scale: float = 1.0) -> None:
        super().__init__()
        self.a, self.b = Branch(a_scale), Branch(b_scale)
        self.port = port

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the port hands its branch a mask of ones that the reference never builds
        a = self.a(x, torch.ones(8)) if self.port else self.a(x)
        return a + self.b(x)


def _case(model: nn.Module) -> Case:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0)


def _two_branches(tmp_path, **port_bugs) -> object:
    seed_everything(0)
    reference = capture(_case(TwoBranches()), tmp_path / "ref.h5", progress=False)
    port = TwoBranches(port=True, **port_bugs)
    load_weights(port, reference)
    return diff(reference, capture(_case(port), tmp_path / "port.h5", progress=False))


def test_a_later_origin_is_offered_only_hedged(tmp_path):
    result = _two_branches(tmp_path, a_scale=2.0, b_scale=3.0)
    first = result.cannot_judge_first
    assert first is not None and (first.site, first.record_site) == ("a#0", "a#0")
    assert "'mask'" in first.why
    assert [o.site for o in result.origins if o.pass_ == "forward"][:1] == ["b#0"]
    assert all(o.hedged and "a#0" in o.hedged for o in result.origins)
    lines = format_diff(result).splitlines()
    assert lines[0].startswith("FAIL  cannot judge a#0")
    hedged = [line for line in lines[:8] if "later origin" in line]
    assert hedged and "b#0" in hedged[0]


def test_an_origin_before_anything_unjudged_stays_the_answer(tmp_path):
    """b's bug alone: a's extra input has no partner, but nothing of a's is out, so b is the
    confident origin as before."""
    result = _two_branches(tmp_path, b_scale=3.0)
    assert result.cannot_judge_first is None
    assert result.origin.site == "b#0" and not result.origin.hedged
    assert format_diff(result).splitlines()[0].startswith("FAIL  origin: b#0")


def test_the_faithful_port_with_an_unpaired_input_passes_and_says_what_was_not_compared(
        tmp_path):
    result = _two_branches(tmp_path)
    assert result and result.cannot_judge_first is None
    assert format_diff(result).splitlines()[0].endswith("; 1 unpaired, not compared")


def test_a_pass_line_too_long_for_the_terminal_is_said_shorter_never_cut_in_its_number(
        tmp_path):
    from layerdiff.report.terminal import verdict_line

    result = _two_branches(tmp_path)
    long = verdict_line(result, width=200)
    short = verdict_line(result, width=len(long) - 1)
    assert "…" not in short and len(short) < len(long)
    # the largest error, the number a reader comes for, is whole in both
    number = long.split("largest error ")[1].split(" ")[0]
    assert f"largest {number} of tolerance" in short and short.endswith("; 1 unpaired")
