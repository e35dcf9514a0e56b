"""Replay, swap and bisect across implementations: a GPT-2 reference whose blocks and attention
take Hugging Face's keyword arguments (``tests.hf_cases:reference_hf``) against nanoGPT-style
ports whose layers take the hidden states alone (``tests.gpt_cases``).

The reference's extra arguments (``past_key_values=None``, ``output_attentions=False``, a real
mask tensor, ...) that the port has no parameter for are not taken: left out and listed, saying
what they held, and the layer is judged on what it computed. A port layer that cannot be called
(a parameter nothing fills) must make the verdict "cannot judge", never "within"."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import torch

from layerdiff import diff, load_weights
from layerdiff.capture import capture
from layerdiff.compare.tolerances import Tolerances
from layerdiff.replay import Swapper, bisect, replay, swap
from layerdiff.replay.bisect import BisectOutcome
from layerdiff.replay.swap import SwapOutcome
from tests import gpt_cases, hf_cases

ROOT = Path(__file__).parent.parent
MAP = ROOT / "tests" / "gpt_port.map.toml"
REFERENCE = "tests.hf_cases:reference_hf"
BUGGY = "tests.gpt_cases:port_bug_attn_scale"
CLEAN = "tests.gpt_cases:port"
HERE = "tests.test_third_party"
ATTN0 = "transformer.h.0.attn"
LOSS_SCALE = 2.0 ** 20  # as docs recommend: tiny gradients rise above float32 rounding


# ---- variants built in this file (module-level, so the command line can load them too)

class _AttentionNeedsMask(gpt_cases.CausalSelfAttention):
    """The port's attention with a ``mask`` it requires (keyword-only, no default)."""

    def forward(self, x: torch.Tensor, *, mask: torch.Tensor | None) -> torch.Tensor:
        return super().forward(x)


class _AttentionNeedsMaskPositional(gpt_cases.CausalSelfAttention):
    """The same, ``mask`` positional."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        return super().forward(x)


class _BlockGivesMask(gpt_cases.Block):
    """The port's block calling its attention with the ``mask`` it needs."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), mask=None)
        return x + self.mlp(self.ln_2(x))


def _port_variant(name: str, base=gpt_cases.port) -> gpt_cases.Case:
    return dataclasses.replace(base(), name=f"{HERE}:{name}")


def port_attn_needs_mask():
    """Block 0's attention needs ``mask``; the port's own block does not give it either, so
    the port cannot run whole."""
    case = _port_variant("port_attn_needs_mask")
    case.model.transformer.h[0].attn.__class__ = _AttentionNeedsMask
    return case


def port_attn_needs_mask_positional():
    """As :func:`port_attn_needs_mask`, with ``mask`` a positional parameter."""
    case = _port_variant("port_attn_needs_mask_positional")
    case.model.transformer.h[0].attn.__class__ = _AttentionNeedsMaskPositional
    return case


def port_attn_needs_mask_runs():
    """Block 0's attention needs ``mask`` and the port's own block gives it: the port runs
    whole, but the attention cannot be called the reference's way."""
    case = port_attn_needs_mask()
    case.name = f"{HERE}:port_attn_needs_mask_runs"
    case.model.transformer.h[0].__class__ = _BlockGivesMask
    return case


class _BlockGivesAttentionMask(hf_cases.GPT2Block):
    """The reference's block, passing its attention a real (all-zero, additive) mask tensor
    where it was given none: the numbers stay those of the plain reference."""

    def forward(self, hidden_states, past_key_values=None, cache_position=None,
                attention_mask=None, head_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, use_cache=False, output_attentions=False,
                **kwargs):
        if attention_mask is None:
            attention_mask = hidden_states.new_zeros(1, 1, 1, hidden_states.size(1))
        return super().forward(hidden_states, past_key_values=past_key_values,
                               cache_position=cache_position, attention_mask=attention_mask,
                               head_mask=head_mask, encoder_hidden_states=encoder_hidden_states,
                               encoder_attention_mask=encoder_attention_mask,
                               use_cache=use_cache, output_attentions=output_attentions,
                               **kwargs)


def reference_hf_masked():
    case = dataclasses.replace(hf_cases.reference_hf(), name=f"{HERE}:reference_hf_masked")
    for block in case.model.transformer.h:
        block.__class__ = _BlockGivesAttentionMask
    return case


# ---- fixtures

@pytest.fixture(scope="module")
def reference_trace(tmp_path_factory):
    """The Hugging Face-style reference, captured once for this module."""
    path = tmp_path_factory.mktemp("hf") / "reference.h5"
    return capture(hf_cases.reference_hf(), path, loss_scale=LOSS_SCALE)


@pytest.fixture(scope="module")
def buggy_replay(reference_trace):
    return replay(reference_trace, gpt_cases.port_bug_attn_scale(), mapping=MAP)


@pytest.fixture(scope="module")
def buggy_swapper():
    return Swapper(hf_cases.reference_hf, gpt_cases.port_bug_attn_scale, MAP)


def _has_no_traceback(result) -> None:
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception


# ---- replay

def test_replay_finds_the_attention_scale_bug_alone_in_the_forward(buggy_replay):
    result = buggy_replay
    assert not result.cannot_judge and result.outcome == "fail" and not result
    table = result.local
    local = table[table["verdict"] == "LOCAL ERROR"]
    assert set(local[local["pass"] == "forward"]["port_site"]) == {f"{ATTN0}#0"}
    # the tied embedding/head gradient sums over both users on both sides: no local error
    wte = table[(table["port_site"] == "transformer.wte#0") & (table["pass"] == "backward")]
    assert len(wte) == 1 and wte.iloc[0]["verdict"] != "LOCAL ERROR"
    assert wte.iloc[0]["local"] <= 1
    rows = result.diff.rows
    assert ((rows["site"] == "transformer.wte#0") & (rows["role"] == "weight_grad")).any()


def test_replay_drops_the_hugging_face_arguments_saying_why(buggy_replay):
    for layer in ("transformer.h.0.attn#0", "transformer.h.1.attn#0"):
        dropped = dict(buggy_replay.dropped[layer])
        assert dropped["past_key_values"] == "None"
        assert dropped["attention_mask"] == "None"
        assert dropped["head_mask"] == "None"
        assert dropped["output_attentions"] == "its default false"
        assert "hidden_states" not in dropped  # it feeds the port's x


def test_replay_into_the_clean_port_passes(reference_trace):
    result = replay(reference_trace, gpt_cases.port(), mapping=MAP)
    assert result and result.outcome == "pass" and not result.cannot_judge
    assert (result.local["verdict"] != "LOCAL ERROR").all()


def test_cli_replay_exit_codes(run, reference_trace):
    bad = run("replay", reference_trace, BUGGY, "--map", MAP)
    assert bad.exit_code == 1 and bad.output.startswith("FAIL  local error"), bad.output
    assert f"{ATTN0}#0 (forward)" in bad.output
    _has_no_traceback(bad)
    good = run("replay", reference_trace, CLEAN, "--map", MAP)
    assert good.exit_code == 0 and good.output.startswith("PASS"), good.output


# ---- swap

def test_swapping_the_buggy_attention_breaks_the_reference(buggy_swapper):
    result = buggy_swapper.run([ATTN0])
    assert result.outcome == SwapOutcome.BREAKS and result.breaks and not result
    assert result.ratio > 100 and math.isfinite(result.ratio)
    assert result.swapped == [(ATTN0, ATTN0)]
    dropped = dict(result.dropped[ATTN0])
    assert dropped["past_key_values"] == "None"
    assert dropped["output_attentions"] == "its default false"


def test_swapping_the_clean_attention_stays_within():
    result = swap(hf_cases.reference_hf, gpt_cases.port, [ATTN0], mapping=MAP)
    assert result and result.outcome == SwapOutcome.WITHIN and result.ratio < 0.5


def test_swapping_the_tied_embedding_keeps_the_tie():
    result = swap(hf_cases.reference_hf, gpt_cases.port, ["transformer.wte"], mapping=MAP)
    assert result, result.describe()


def test_swapping_embedding_and_head_together_stays_within():
    """Both users of the tied weight swapped: the tie is the port's own, and holds."""
    result = swap(hf_cases.reference_hf, gpt_cases.port, ["transformer.wte", "lm_head"],
                  mapping=MAP)
    assert result, result.describe()


def test_cli_swap_exit_codes(run):
    bad = run("swap", REFERENCE, BUGGY, "--site", ATTN0, "--map", MAP)
    assert bad.exit_code == 1 and bad.output.startswith("BREAKS"), bad.output
    assert f"not taken by the swapped-in layer at {ATTN0}: past_key_va" in bad.output
    assert "output_attentions (its default false)" in bad.output
    _has_no_traceback(bad)
    good = run("swap", REFERENCE, CLEAN, "--site", ATTN0, "--map", MAP)
    assert good.exit_code == 0 and good.output.startswith("WITHIN"), good.output


# ---- bisect

def test_bisect_finds_the_attention_container(buggy_swapper):
    result = bisect(buggy_swapper)
    assert result.outcome == BisectOutcome.CULPRITS and not result
    assert result.culprits == [(ATTN0, ATTN0)]
    assert result.searched == "containers"
    assert len(result.probes) <= 12


def test_bisect_of_the_clean_port_has_nothing_to_find():
    result = bisect(Swapper(hf_cases.reference_hf, gpt_cases.port, MAP))
    assert result and result.outcome == BisectOutcome.NOTHING_TO_FIND and not result.culprits
    assert len(result.probes) <= 12


def test_cli_bisect_exit_codes(run):
    bad = run("bisect", REFERENCE, BUGGY, "--map", MAP)
    assert bad.exit_code == 1 and f"culprits: {ATTN0} (" in bad.output, bad.output
    _has_no_traceback(bad)
    good = run("bisect", REFERENCE, CLEAN, "--map", MAP)
    assert good.exit_code == 0 and "nothing to find" in good.output, good.output


# ---- a port layer that cannot be called

def _needs_mask_sentence(why: str) -> None:
    assert "needs 'mask'" in why and "reference's call does not give" in why, why
    assert "\n" not in why


def test_replay_cannot_judge_an_attention_it_cannot_call(reference_trace):
    result = replay(reference_trace, port_attn_needs_mask(), mapping=MAP, propagated=False)
    failed = dict(result.cannot_judge)
    _needs_mask_sentence(failed[f"{ATTN0}#0"])
    assert result.outcome == "cannot-judge" and not result
    # the attention's own projections were replayed all the same
    assert f"{ATTN0}.c_attn#0" in set(result.diff.rows["site"])


def test_cli_replay_cannot_judge_exits_1(run, reference_trace):
    """The port runs whole (its block gives the mask), its attention cannot be replayed."""
    result = run("replay", reference_trace, f"{HERE}:port_attn_needs_mask_runs", "--map", MAP)
    assert result.exit_code == 1 and result.output.startswith("CANNOT JUDGE"), result.output
    assert f"cannot judge {ATTN0}#0" in result.output
    _has_no_traceback(result)


def test_replay_of_a_port_that_cannot_run_whole_still_judges_its_layers(run, reference_trace):
    result = replay(reference_trace, port_attn_needs_mask(), mapping=MAP)
    assert result.outcome == "cannot-judge" and f"{ATTN0}#0" in dict(result.cannot_judge)
    cli = run("replay", reference_trace, f"{HERE}:port_attn_needs_mask", "--map", MAP)
    assert cli.exit_code == 1


def test_replay_cannot_judge_an_attention_whose_positional_mask_nothing_gives(
        reference_trace):
    result = replay(reference_trace, port_attn_needs_mask_positional(), mapping=MAP,
                    propagated=False)
    failed = dict(result.cannot_judge)
    assert f"{ATTN0}#0" in failed
    _needs_mask_sentence(failed[f"{ATTN0}#0"])


def test_swap_cannot_judge_an_attention_it_cannot_call():
    result = swap(hf_cases.reference_hf, port_attn_needs_mask, [ATTN0], mapping=MAP)
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result and not result.breaks
    assert [layer for layer, _ in result.not_swapped] == [ATTN0]
    _needs_mask_sentence(result.not_swapped[0][1])
    assert result.describe().startswith(f"cannot judge the swap of {ATTN0}")
    assert "\n" not in result.describe()


def test_cli_swap_cannot_judge_exits_1(run):
    result = run("swap", REFERENCE, f"{HERE}:port_attn_needs_mask", "--site", ATTN0,
                 "--map", MAP)
    assert result.exit_code == 1 and result.output.startswith("CANNOT JUDGE"), result.output
    assert "needs 'mask'" in result.output
    _has_no_traceback(result)


def test_bisect_sets_the_uncallable_attention_aside_and_cannot_conclude():
    result = bisect(Swapper(hf_cases.reference_hf, port_attn_needs_mask, MAP))
    aside = dict(result.not_swapped)
    assert ATTN0 in aside
    _needs_mask_sentence(aside[ATTN0])
    assert result.outcome == BisectOutcome.CANNOT_CONCLUDE and not result
    assert result.outcome != BisectOutcome.NOTHING_TO_FIND and not result.culprits
    assert len(result.probes) <= 12


def test_cli_bisect_cannot_conclude_exits_1(run):
    result = run("bisect", REFERENCE, f"{HERE}:port_attn_needs_mask", "--map", MAP)
    assert result.exit_code == 1 and "cannot conclude" in result.output, result.output
    _has_no_traceback(result)


# ---- a reference argument that holds a real tensor

@pytest.fixture(scope="module")
def masked_reference_trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf-masked") / "reference.h5"
    return capture(reference_hf_masked(), path, loss_scale=LOSS_SCALE)


def test_a_tensor_argument_the_port_lacks_is_not_taken_and_the_attention_judged(
        masked_reference_trace):
    """The reference's attention gets a real (all-zero) mask tensor the nanoGPT port has no
    parameter for: left out of the call and the input check, listed, and the attention judged
    (within: the port's own causal mask computes the same)."""
    result = replay(masked_reference_trace, gpt_cases.port(), mapping=MAP, propagated=False)
    assert not result.cannot_judge, result.cannot_judge
    for layer in ("transformer.h.0.attn#0", "transformer.h.1.attn#0"):
        assert (layer, layer) in result.replayed
        assert dict(result.not_taken[layer])["attention_mask"] == "float32 (1,1,1,16)"
    assert result and result.outcome == "pass"
    # the block's None mask is left out as before
    assert dict(result.dropped["transformer.h.0#0"])["attention_mask"] == "None"
    buggy = replay(masked_reference_trace, gpt_cases.port_bug_attn_scale(), mapping=MAP,
                   propagated=False)
    table = buggy.local
    local = table[(table["verdict"] == "LOCAL ERROR") & (table["pass"] == "forward")]
    assert set(local["port_site"]) == {f"{ATTN0}#0"} and not buggy.cannot_judge


def _mapping_dropping_the_mask(tmp_path) -> Path:
    mapping = tmp_path / "gpt_port_drop_mask.map.toml"
    mapping.write_text(MAP.read_text(encoding="utf-8") + (
        '\n[[site]]\nreference = "transformer.h.*.attn"\nport = "transformer.h.*.attn"\n'
        'args = { attention_mask = "" }\n'), encoding="utf-8")
    return mapping


def test_a_site_rule_that_drops_the_tensor_argument_lets_replay_run_the_site(
        masked_reference_trace, tmp_path):
    result = replay(masked_reference_trace, gpt_cases.port(),
                    mapping=_mapping_dropping_the_mask(tmp_path))
    assert not result.cannot_judge, result.cannot_judge
    assert result, result.outcome
    for layer in ("transformer.h.0.attn#0", "transformer.h.1.attn#0"):
        assert (layer, layer) in result.replayed
        assert dict(result.dropped[layer])["attention_mask"] == "the mapping drops it"


def test_the_diff_judges_a_site_whose_dropped_argument_the_port_computes_itself(
        masked_reference_trace, tmp_path):
    """Real transformers 5.x hands every attention a float causal mask; the nanoGPT port
    builds its own. With the mask dropped by the mapping, the attention is judged (not 'cannot
    judge' for an input without partner) and the planted scale bug is its origin."""
    mapping = _mapping_dropping_the_mask(tmp_path)
    port_case = gpt_cases.port_bug_attn_scale()
    load_weights(port_case.model, masked_reference_trace, mapping)
    port = capture(port_case, tmp_path / "port.h5", loss_scale=LOSS_SCALE)
    result = diff(masked_reference_trace, port, mapping=mapping)
    assert result.origin is not None
    assert (result.origin.site, result.origin.pass_, result.origin.role) == (
        f"{ATTN0}#0", "forward", "output")
    assert "cannot-judge" not in set(result.rows["status"])


# ---- tolerance files and flags reach swap and bisect

_LOOSE = """version = 1

[[rule]]
site = "<root>#0"
rtol = 1.0
atol = 1.0
why = "logits of a port with another attention kernel"

[[rule]]
site = "<loss>#0"
rtol = 1.0
atol = 1.0

[[rule]]
site = "*"
role = "weight_grad"
rtol = 1.0
atol = 1.0
"""


@pytest.fixture
def loose_tolerances(tmp_path):
    path = tmp_path / "loose.toml"
    path.write_text(_LOOSE, encoding="utf-8")
    return path


def test_a_tolerance_file_judges_every_compared_row_of_a_swap(loose_tolerances):
    result = swap(hf_cases.reference_hf, gpt_cases.port_bug_attn_scale, [ATTN0], mapping=MAP,
                  tolerances=Tolerances.build(loose_tolerances))
    assert result and result.outcome == SwapOutcome.WITHIN, result.describe()
    judged = [row for row in result.rows if row.judged]
    assert {row.site for row in judged if row.role == "output"} == {"<loss>#0", "<root>#0"}
    rules = {row.site: row.tolerance for row in judged if row.role == "output"}
    assert "loose.toml rule 1" in rules["<root>#0"] and "logits" in rules["<root>#0"]
    assert "loose.toml rule 2" in rules["<loss>#0"]
    grads = [row for row in judged if row.role == "weight_grad"]
    assert grads and all("loose.toml rule 3" in row.tolerance for row in grads)
    assert all(row.role in ("output", "weight_grad") for row in judged)
    # weights after the step are reported, not judged, at the default tolerance
    reported = [row for row in result.rows if not row.judged]
    assert reported and all(row.role == "weight" and "default" in row.tolerance
                            for row in reported)


def test_cli_swap_and_bisect_take_tolerance_files_and_flags(run, loose_tolerances):
    args = (REFERENCE, BUGGY, "--site", ATTN0, "--map", MAP)
    assert run("swap", *args).exit_code == 1
    loose = run("swap", *args, "--tolerances", loose_tolerances)
    assert loose.exit_code == 0 and loose.output.startswith("WITHIN"), loose.output
    flags = run("swap", *args, "--rtol", 10, "--atol", 10)
    assert flags.exit_code == 0 and flags.output.startswith("WITHIN"), flags.output
    found = run("bisect", REFERENCE, BUGGY, "--map", MAP, "--tolerances", loose_tolerances)
    assert found.exit_code == 0 and "nothing to find" in found.output, found.output


def test_a_port_layer_returning_fewer_tensors_stands_in_with_none_for_the_rest():
    """transformers 5.x's attention returns (output, weights) and its block takes [0]; the
    nanoGPT attention returns the output alone: the weights become None, said in the result,
    and the swap is judged (the planted scale bug breaks the reference, the clean port not)."""
    broken = swap(hf_cases.reference_hf_weights, gpt_cases.port_bug_attn_scale, [ATTN0],
                  mapping=MAP)
    assert broken.outcome == SwapOutcome.BREAKS, broken.describe()
    said = dict(broken.dropped[ATTN0])
    assert said["output 1"] == "the port layer does not return it: None"
    clean = swap(hf_cases.reference_hf_weights, gpt_cases.port, [ATTN0], mapping=MAP)
    assert clean.outcome == SwapOutcome.WITHIN, clean.describe()


def test_the_hugging_face_style_reference_computes_what_gpt_cases_reference_does():
    hf_cases._check_same_as_gpt_cases()  # parameters, logits, loss and gradients, bit for bit
