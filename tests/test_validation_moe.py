"""The mixture-of-experts validation pair (issue 39): transformers' ``MixtralForCausalLM``
against an independent gpt-fast-style port (``tests/validation/``), wired with a case file and a
mapping only. The faithful port passes diff, replay, map-check and bisect; each planted bug is
named by the diff at its own site and pass; bisect names the planted layer where swap can judge
it. Regressions found on this pair: an output conversion that needs the reference's routing
weights (``reference_inputs``), diverge judging without the diff's dropped arguments, and
map-suggest missing a split of one tensor into two differently named ones."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from layerdiff import capture, diff
from layerdiff.capture.port import capture_port
from layerdiff.compare.judge import Verdict
from layerdiff.debug.diverge import _diff
from layerdiff.errors import MappingError
from layerdiff.mapping import Mapping
from layerdiff.mapsuggest import suggest_mapping
from layerdiff.replay import Swapper, bisect, replay
from layerdiff.replay.bisect import BisectOutcome
from layerdiff.replay.mapcheck import map_check
from layerdiff.report.findings.diff import describe_origin
from tests.validation import moe_cases as cases

pytestmark = pytest.mark.slow
MAP = Path(__file__).resolve().parent / "validation" / "moe.map.toml"
PASSING = {Verdict.WITHIN, Verdict.IDENTICAL}
EXPERTS0 = "model.layers.0.mlp.experts#0"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder = tmp_path_factory.mktemp("moe")
    reference = capture(cases.reference(), folder / "ref.h5", loss_scale=2**20, progress=False)
    made: dict[str, Path] = {}

    def port(name: str) -> Path:
        if name not in made:
            made[name] = capture_port(getattr(cases, name)(), folder / f"{name}.h5",
                                      weights_from=reference, mapping=MAP, progress=False)
        return made[name]

    return reference, port


def test_the_faithful_port_passes_diff_with_the_experts_compared_through_the_weighted_sum(
        traces):
    reference, port = traces
    result = diff(reference, port("port"), mapping=MAP)
    assert result, [describe_origin(origin) for origin in result.origins]
    rows = result.rows
    for layer in (0, 1):
        at = rows[(rows["site"] == f"model.layers.{layer}.mlp.experts#0")
                  & rows["role"].isin(["output", "grad_output"])]
        assert sorted(at["role"]) == ["grad_output", "output"], at
        assert (at["match"] == "output-converted").all() and at["verdict"].isin(PASSING).all()
        assert "with the reference's input(s) '2'" in at[at["role"] == "output"]["note"].iloc[0]


def test_the_faithful_port_passes_replay_and_map_check(traces):
    reference, _ = traces
    result = replay(reference, cases.port(), mapping=MAP)
    assert result and not result.cannot_judge, result.diff.origins
    assert map_check(reference, cases.port(), MAP)


def test_the_faithful_port_passes_with_ops_captured_under_the_block_call_adapter(tmp_path):
    """The ``model.layers.*`` rule's call adapter is its layers' own call: it was run on the op
    sites inside them too (KeyError 'position_embeddings' on an op's arguments)."""
    reference = capture(cases.reference(), tmp_path / "ref.h5", ops=["*"], progress=False)
    port = capture_port(cases.port(), tmp_path / "port.h5", weights_from=reference,
                        mapping=MAP, ops=["*"], progress=False)
    result = diff(reference, port, mapping=MAP)
    assert result, [describe_origin(origin) for origin in result.origins]
    ops = result.rows[result.rows["site"].str.startswith("model.layers.0#0/")]
    assert not ops.empty and (ops["match"] == "op").all()  # the layer's own ops, compared


@pytest.mark.parametrize(("bug", "site", "pass_"), [
    ("port_bug_expert", EXPERTS0, "forward"),                     # an expert's own code
    ("port_bug_renorm", "model.layers.1.mlp#0", "forward"),       # the MoE block's own code
    ("port_bug_rope", "model.layers.0.self_attn#0", "forward"),
    ("port_bug_eps", "model.layers.1.input_layernorm#0", "forward"),
    ("port_bug_backward", "model.layers.0.post_attention_layernorm#0", "backward"),
    ("port_bug_unweighted", "model.layers.1.mlp#0", "forward"),   # experts summed unweighted
    ("port_bug_detached", "model.layers.1.mlp.gate#0", "backward"),  # the router never learns
])
def test_each_planted_bug_is_named_at_its_site_and_pass(traces, bug, site, pass_):
    reference, port = traces
    result = diff(reference, port(bug), mapping=MAP)
    assert not result
    assert (result.origin.site, result.origin.pass_) == (site, pass_), \
        describe_origin(result.origin)
    if bug == "port_bug_backward":  # the last position gets no gradient (it has no target):
        # zero on both sides is no mask's boundary
        assert result.origin.hint is None or result.origin.hint["kind"] != "mask", \
            result.origin.hint
    if bug == "port_bug_renorm":  # the cause, matched to the router's probabilities per token
        assert result.origin.hint["kind"] == "routing-weights", result.origin.hint
        assert "does not renormalise its top-2 routing weights" in \
            result.origin.hint["evidence"]
    if bug in ("port_bug_unweighted", "port_bug_detached"):  # told by the router's gradient
        hint = result.origin.hint
        assert hint["kind"] == "routing-weights", hint
        assert "layers.1.block_sparse_moe.gate#0 gets no gradient" in hint["evidence"], hint
    if bug == "port_bug_unweighted":  # ... and by the per-expert outputs' plain sum
        assert "the plain sum of layers.1.block_sparse_moe.cond_ffn#0's top-2" in \
            result.origin.hint["evidence"], result.origin.hint


def test_experts_whose_output_shape_no_rule_relates_say_so_not_not_finite(traces, tmp_path):
    """Without the output conversion, (20, 32) against (20, 2, 32) is not compared: the
    headline says the shapes differ (it said 'not finite ... worst element [nan]')."""
    reference, port = traces
    bare = tmp_path / "bare.map.toml"
    bare.write_text("".join(line for line in MAP.read_text(encoding="utf-8").splitlines(True)
                            if not line.startswith("output_transform")), encoding="utf-8")
    result = diff(reference, port("port"), mapping=bare)
    assert result.origin.site == EXPERTS0
    assert describe_origin(result.origin).endswith(
        "shapes differ (reference (20,32), port (20,2,32))"), describe_origin(result.origin)


def test_replay_names_the_expert_bug_at_the_experts(traces):
    reference, _ = traces
    result = replay(reference, cases.port_bug_expert(), mapping=MAP)
    assert not result and not result.cannot_judge
    assert {o.site for o in result.diff.origins} == {EXPERTS0}, result.diff.origins


def test_diverge_judges_its_rows_with_the_arguments_the_mapping_drops(traces):
    """Diverge re-judges the diff's rows by the golden band; the experts' top_k_weights, which
    the mapping drops, must not make their site unjudgeable there ('no origin was found')."""
    reference, port = traces
    golden = capture_port(cases.reference(), reference.parent / "golden.h5", dtype="float64",
                          progress=False, loss_scale=2**20)
    found = _diff({"reference": reference, "port": port("port_bug_expert"),
                   "golden": golden}, "reference", "port", "golden", MAP, None, [])
    assert found.origin is not None and found.origin.site == EXPERTS0


def test_bisect_finds_nothing_on_the_faithful_port_and_the_planted_norm():
    assert bisect(Swapper(cases.reference, cases.port, MAP)).outcome == \
        BisectOutcome.NOTHING_TO_FIND
    result = bisect(Swapper(cases.reference, cases.port_bug_eps, MAP))
    assert [port for _, port in result.culprits] == ["layers.1.attention_norm"], result.probes


def test_map_suggest_drafts_the_experts_gate_up_split(traces):
    reference, _ = traces
    text = suggest_mapping(reference, cases.port()).text
    rule = ('port = ["layers.*.block_sparse_moe.cond_ffn.w1", '
            '"layers.*.block_sparse_moe.cond_ffn.w3"]\n'
            'reference = "model.layers.*.mlp.experts.gate_up_proj"\ntransform = "split"\naxis = 1')
    assert rule in text, text


@pytest.mark.parametrize("value", ['["2", "2"]', '[""]', '{ a = 1 }'])
def test_a_malformed_reference_inputs_is_refused_with_its_line(value):
    text = ('version = 1\n\n[[site]]\nreference = "a"\nport = "b"\noutput_transform = '
            f'{{ function = "a.b:f", reference_inputs = {value} }}\n')
    with pytest.raises(MappingError, match=r"reference_inputs.*line|line.*reference_inputs"):
        Mapping.from_text(text, "bad.map.toml", recorded_in="")


def test_a_site_rule_that_an_unmatched_glob_overrides_everywhere_is_a_warning():
    """'self_attn.*_proj' declared unmatched (meant for the fused q, k, v) also matches o_proj,
    whose [[site]] rule then pairs nothing: the diff compared o_proj's weights only, silently,
    and map-check said 'a [[site]] rule would pair it'."""
    text = ('version = 1\n\n[[site]]\nreference = "m.layers.*.attn.o_proj"\nport = "l.*.wo"\n\n'
            '[[site]]\nreference = "m.layers.*.attn"\nport = "l.*.attention"\n\n'
            '[[unmatched]]\nreference = "m.layers.*.attn.*_proj"\nwhy = "fused"\n')
    mapping = Mapping.from_text(text, "m.toml", recorded_in="")
    modules = ["m.layers.0.attn", "m.layers.0.attn.q_proj", "m.layers.0.attn.o_proj"]
    warnings = mapping.unused_site_rules(modules)
    assert len(warnings) == 1 and warnings[0].startswith("m.toml site rule 1 (line 3) pairs "
                                                         "nothing"), warnings
    assert "m.layers.0.attn.o_proj" in warnings[0]


def test_diverge_keeps_the_data_an_output_conversion_takes():
    """The experts' output conversion needs the port's outputs and the reference's inputs as
    tensors: statistics alone listed them 'not compared' at every step of diverge's scan."""
    from layerdiff.debug.diverge import data_needed

    plan = data_needed(cases.reference(), cases.port(), MAP)
    assert {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"} <= plan.reference
    assert {"layers.0.block_sparse_moe.cond_ffn", "layers.1.block_sparse_moe.cond_ffn"} <= \
        plan.port
    assert "output conversion tests.validation.moe_cases:weighted_sum" in plan.note


def test_experts_that_ignore_the_weights_they_are_passed_are_named_by_the_routers_gradient(
        traces, tmp_path):
    """HF weights inside its experts (they take top_k_weights): experts that drop them are the
    origin, and the router that then gets no gradient is the cause."""
    reference, _ = traces
    port = capture_port(cases.reference_experts_unweighted(), tmp_path / "port.h5",
                        weights_from=reference, progress=False)
    result = diff(reference, port)
    assert (result.origin.site, result.origin.pass_) == ("model.layers.1.mlp.experts#0",
                                                         "forward")
    assert result.origin.hint["kind"] == "routing-weights", result.origin.hint
    assert "router model.layers.1.mlp.gate#0 gets no gradient" in \
        result.origin.hint["evidence"], result.origin.hint
