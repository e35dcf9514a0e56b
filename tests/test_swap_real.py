"""Swap and bisect on real code: the reference's own code reads attributes of the layers it
calls (``self.conv1.stride[0]``, ``self.embed_positions.num_embeddings``,
``self.norm.weight.dtype``), and a swapped-in layer it cannot use is "cannot judge", never a
culprit (tests/swap_real_cases.py has the models: third-party-style code on both sides,
unedited by these tests)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from layerdiff.replay import Swapper, bisect, swap
from layerdiff.replay.adapters import LayerAdapter, SwappedAttributeError
from layerdiff.replay.bisect import BisectOutcome
from layerdiff.replay.swap import SwapOutcome, SwapResult
from tests import swap_real_cases as cases

ROUTER0, ROUTER1 = "encoder.layers.0.moe.router", "encoder.layers.1.moe.router"


@pytest.fixture(scope="module")
def faithful():
    return Swapper(cases.reference, cases.port)


def test_bisect_finds_nothing_on_the_faithful_port(faithful):
    result = bisect(faithful)
    assert result.outcome == BisectOutcome.NOTHING_TO_FIND and result, result.probes
    assert len(result.probes) == 1 and result.complete and not result.cannot_judge


@pytest.mark.parametrize("site", ["encoder.conv1", "encoder.conv2", "encoder.embed_positions",
                                  "encoder.layers.0.final_layer_norm",
                                  "encoder.layers.0.self_attn", "classifier", "encoder"])
def test_a_layer_whose_attributes_the_reference_reads_swaps_in(faithful, site):
    """conv1.stride, embed_positions.num_embeddings, final_layer_norm.weight.dtype,
    self_attn.num_heads (the port's attention calls it n_head: the reference module's answers),
    classifier.weight.dtype, encoder.config (the port's config is another class: the
    reference's answers)."""
    result = faithful.run([site])
    assert result.outcome == SwapOutcome.WITHIN, result.describe()


def test_a_router_the_reference_cannot_use_is_cannot_judge_in_one_line(faithful):
    """The port's router returns its logits alone; the reference's MoE block takes (logits,
    weights, experts) and one-hots the experts: None stood for them, and the run raised."""
    result = faithful.run([ROUTER0])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result and not result.breaks
    (layer, why), = result.not_swapped
    assert layer == ROUTER0 and "\n" not in why
    assert why.startswith("the run raised TypeError: one_hot(): argument "
                          "'input' (position 1) must be Tensor, not NoneType (at "
                          "swap_real_cases.py:"), why
    assert why.endswith(f"None stood for outputs the swapped-in layer does not return: "
                        f"{ROUTER0} (output 1..)"), why
    assert "cannot be judged" in result.describe() and "\n" not in result.describe()
    assert result.as_json()["outcome"] == "cannot-judge"


def test_several_layers_in_a_run_that_raised_are_cannot_judge_not_a_break(faithful):
    result = faithful.run([ROUTER0, "encoder.conv1"])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result.not_swapped
    assert result.raised.startswith("the run raised TypeError: one_hot()")
    assert result.suspects == [ROUTER0]


def _check_routers(result, covers):
    assert [c.layers for c in result.cannot_judge] == [[ROUTER0], [ROUTER1]]
    for entry, cover in zip(result.cannot_judge, covers, strict=True):
        assert "TypeError: one_hot()" in entry.why and "\n" not in entry.why
        assert entry.covered_by in cover
    assert result.complete


def test_bisect_names_a_bug_in_a_container_whose_leaf_cannot_be_judged():
    """No leaf breaks the reference (the routers cannot be judged, the rest is within), so the
    containers are searched, and the MoE block whose own code drops the renormalisation is
    named; the routers are listed apart, each judged inside a container."""
    result = bisect(Swapper(cases.reference, cases.port_bug_moe))
    assert result.outcome == BisectOutcome.CULPRITS and not result
    assert [port for _, port in result.culprits] == ["encoder.layers.1.moe"]
    _check_routers(result, [{"encoder.layers.0", "encoder.layers.0.moe"},
                            {"encoder.layers.1.moe"}])
    assert len(result.probes) <= 20


def test_bisect_names_a_leaf_bug_and_still_judges_the_routers_inside_their_containers():
    result = bisect(Swapper(cases.reference, cases.port_bug_norm))
    assert [port for _, port in result.culprits] == ["encoder.layers.0.final_layer_norm"]
    _check_routers(result, [{"encoder.layers.0.moe"},
                            {"encoder.layers.1", "encoder.layers.1.moe"}])
    said = result.as_json()
    assert said["complete"] and said["cannot_judge"][0]["port"] == [ROUTER0]


def test_cli_bisect_lists_what_it_cannot_judge_apart(run):
    found = run("bisect", "tests.swap_real_cases:reference", "tests.swap_real_cases:port_bug_moe")
    assert found.exit_code == 1, found.output
    out = found.output
    assert "culprits: encoder.layers.1.moe (" in out
    assert "cannot judge (never a culprit):" in out and "search complete" in out
    assert "probe   3  cannot-judge  encoder.layers.0.moe.router" in out
    clean = run("bisect", "tests.swap_real_cases:reference", "tests.swap_real_cases:port")
    assert clean.exit_code == 0 and "nothing to find" in clean.output, clean.output


# ---- transformers' own Whisper audio classifier against a port written in tests/
def test_whisper_faithful_port_nothing_to_find_and_a_planted_bug_found():
    clean = bisect(Swapper(cases.whisper_reference, cases.whisper_port))
    assert clean.outcome == BisectOutcome.NOTHING_TO_FIND, clean.probes
    buggy = bisect(Swapper(cases.whisper_reference, cases.whisper_port_bug))
    assert [port for _, port in buggy.culprits] == ["encoder.layers.1"], buggy.probes
    assert not buggy.cannot_judge


@pytest.mark.parametrize("site", ["encoder.conv1", "encoder.embed_positions", "encoder"])
def test_whisper_layers_its_encoder_reads_swap_in(site):
    """WhisperEncoder.forward reads self.conv1.stride[0] and
    self.embed_positions.num_embeddings; WhisperForAudioClassification reads
    encoder_outputs[0] of the encoder's BaseModelOutput (the port's encoder returns a tensor)."""
    result = swap(cases.whisper_reference, cases.whisper_port, [site])
    assert result.outcome == SwapOutcome.WITHIN, result.describe()


# ---- transformers' own Mixtral against a port written in tests/: its gate returns logits alone
GATE0, GATE1 = "model.layers.0.mlp.gate", "model.layers.1.mlp.gate"


def test_mixtral_faithful_port_finds_nothing_and_the_moe_bug_is_named_not_the_gates():
    """On the original adapter bisect named both gates for the faithful port and for the bug
    alike, and set the experts aside for raising on the None the gates did not return."""
    clean = bisect(Swapper(cases.mixtral_reference, cases.mixtral_port))
    assert clean.outcome == BisectOutcome.NOTHING_TO_FIND, clean.probes
    buggy = bisect(Swapper(cases.mixtral_reference, cases.mixtral_port_bug))
    assert [port for _, port in buggy.culprits] == ["model.layers.1.mlp"], buggy.probes
    assert [c.layers for c in buggy.cannot_judge] == [[GATE0], [GATE1]]  # not the experts
    assert buggy.complete and all("(output 1..)" in c.why for c in buggy.cannot_judge)


def test_a_layer_that_raises_on_what_another_did_not_return_is_not_blamed():
    """The port's experts raise on the None the port's gate left for the reference's block to
    pass on: the run cannot be judged, and the gate is the suspect, not the experts."""
    result = swap(cases.mixtral_reference, cases.mixtral_port,
                  [GATE0, "model.layers.0.mlp.experts"])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE and not result.not_swapped
    assert result.suspects == [GATE0]
    assert result.raised.startswith("layer model.layers.0.mlp.experts: MixExperts.forward")
    alone = swap(cases.mixtral_reference, cases.mixtral_port, ["model.layers.0.mlp.experts"])
    assert alone.outcome == SwapOutcome.WITHIN, alone.describe()


# ---- what a stand-in answers
class _Norm(nn.Module):
    def __init__(self, dtype=torch.float32) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, dtype=dtype))
        self.eps = 1e-5

    def forward(self, x):
        return x * self.weight


def _adapter(layer: nn.Module, replaced: nn.Module) -> LayerAdapter:
    return LayerAdapter("norm", layer, {}, replaced=replaced)


def test_a_stand_in_answers_from_the_port_layer_then_the_replaced_module():
    replaced = nn.LayerNorm(4)
    replaced.config = cases.RefConfig()
    replaced.layer = "the reference's own 'layer'"
    port = _Norm()
    port.config = cases.PortConfig()
    adapter = _adapter(port, replaced)
    assert adapter.eps == 1e-5                          # the port's
    assert adapter.normalized_shape == (4,)             # only the reference has it
    assert adapter.config is replaced.config            # the port's config is another class
    assert adapter.layer == "the reference's own 'layer'"  # not the adapter's own state
    assert adapter.weight is port.weight                # the port's trained parameter
    assert adapter.training and not adapter.eval().training  # the stand-in's own mode
    assert not _adapter(_Norm(), nn.LayerNorm(4).eval()).training  # the replaced one's first
    assert not isinstance(adapter, nn.LayerNorm)        # documented: no dynamic subclass
    assert adapter.bias is replaced.bias                # the port norm has no bias attribute
    assert _adapter(nn.Linear(4, 4, bias=False), nn.Linear(4, 4)).bias is None  # its answer
    assert dict(adapter.named_parameters()) == {"wrapped.weight": port.weight}


def test_a_weight_of_another_dtype_reads_as_the_replaced_ones_and_trains_the_port():
    port = _Norm(torch.bfloat16)
    adapter = _adapter(port, nn.LayerNorm(4))
    weight = adapter.weight
    assert weight.dtype == torch.float32 and weight.shape == (4,)
    (weight * 2).sum().backward()
    assert port.weight.grad is not None and port.weight.grad.dtype == torch.bfloat16


def test_an_attribute_neither_has_is_an_attribute_error_naming_the_layer():
    adapter = _adapter(_Norm(), nn.LayerNorm(4))
    assert not hasattr(adapter, "num_experts")
    with pytest.raises(SwappedAttributeError, match=r"reads 'num_experts' of the layer swapped "
                       r"in at norm, and neither that layer .*_Norm.* nor the LayerNorm"):
        adapter.num_experts  # noqa: B018


# ---- the search rules, on a model that raises by design
class _Fake:
    """A swapper over named layers: ``bug`` breaks the reference, ``raises`` raise when swapped
    in (a set of them: the set raises only whole), names ending in a digit nest under their
    prefix (``c`` holds ``c.x``)."""

    def __init__(self, order, leaves, bugs=(), raises=(), together=()):
        self.order, self._leaves = order, leaves
        self.pairs = {m: (m, {}) for m in order}
        self.unswappable = {}  # no layer held only inside a stack
        self.bugs, self.raises, self.together = set(bugs), set(raises), set(together)
        self.runs = []

    def execution_order(self):
        return list(self.order)

    def leaves(self):
        return [m for m in self.order if m in self._leaves]

    def containers(self):
        return [m for m in self.order if m not in self._leaves]

    def resolve(self, name):
        return name

    def run(self, modules):
        outer = [m for m in modules if not any(m.startswith(o + ".") for o in modules)]
        self.runs.append(outer)
        result = SwapResult([(m, m) for m in outer], 1, [])
        inside = {m for m in self.order if any(m == o or m.startswith(o + ".") for o in outer)}
        raising = [m for m in outer if m in self.raises]
        if len(outer) == 1 and raising:
            result.not_swapped.append((outer[0], "the run raised KeyError: 'x'"))
        elif raising or (self.together and self.together <= set(outer)):
            result.raised = "the run raised KeyError: 'x'"
        else:
            ratio = 10.0 if inside & self.bugs else 0.0
            result.rows.append(_row(ratio))
        return result


def _row(ratio):
    from layerdiff.replay.swap import SwapRow
    from layerdiff.trace.schema import Role

    return SwapRow("loss, step 0", 0, "<loss>#0", Role.OUTPUT, "0", ratio, ratio, True, "")


ORDER = ["c", "c.a", "c.b", "c.r", "d", "d.e", "f"]
LEAVES = {"c.a", "c.b", "c.r", "d.e", "f"}


def test_a_raising_leaf_is_never_a_culprit_and_its_container_is_searched():
    # the bug is in c's own code; c.r cannot be judged alone
    fake = _Fake(ORDER, LEAVES, bugs={"c"}, raises={"c.r"})
    result = bisect(fake)
    assert [r for r, _ in result.culprits] == ["c"]
    assert [(c.layers, c.covered_by) for c in result.cannot_judge] == [(["c.r"], "c")]
    assert result.complete and result.searched == "containers"
    assert len({frozenset(r) for r in fake.runs}) == len(fake.runs)  # no set run twice


def test_a_raising_leaf_beside_a_leaf_culprit_is_judged_inside_its_container():
    fake = _Fake(ORDER, LEAVES, bugs={"d.e"}, raises={"c.r"})
    result = bisect(fake)
    assert [r for r, _ in result.culprits] == ["d.e"]
    assert [(c.layers, c.covered_by) for c in result.cannot_judge] == [(["c.r"], "c")]
    assert result.complete


def test_a_set_that_raises_only_whole_leaves_the_search_incomplete():
    fake = _Fake(ORDER, LEAVES, together={"c.a", "f"})
    result = bisect(fake, granularity="leaves")
    assert result.outcome == BisectOutcome.NOTHING_TO_FIND  # the whole port: c, d, f run
    fake = _Fake(ORDER, LEAVES, bugs={"d.e"}, together={"c.a", "f"})
    result = bisect(fake, granularity="leaves")
    assert [r for r, _ in result.culprits] == ["d.e"]
    entry, = result.cannot_judge  # the smallest set that raises whole: each half runs
    assert set(entry.layers) == {"c.a", "f"} and not entry.covered_by
    assert not result.complete and result.outcome == BisectOutcome.CULPRITS


def test_a_port_whose_every_probe_raises_cannot_conclude():
    fake = _Fake(ORDER, LEAVES, raises=set(ORDER))
    result = bisect(fake)
    assert result.outcome == BisectOutcome.CANNOT_CONCLUDE and not result.culprits
    assert {m for c in result.cannot_judge for m in c.layers} == {"c", "d", "f", "c.a", "c.b",
                                                                  "c.r", "d.e"}


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return torch.nn.functional.gelu(x)

    @staticmethod
    def backward(ctx, grad):
        raise NotImplementedError("the kernel's backward is not written yet")


class _ForwardOnlyGELU(nn.Module):
    def forward(self, x):
        return _NoBackward.apply(x)


def _forward_only_port():
    from reference_models import mlp_port

    case = mlp_port.port()
    case.model.act2 = _ForwardOnlyGELU()
    return case


def test_a_layer_whose_backward_raises_cannot_be_judged_and_bisect_says_so():
    from reference_models import mlp

    result = swap(mlp.reference, _forward_only_port, ["act2"])
    assert result.outcome == SwapOutcome.CANNOT_JUDGE, result.describe()
    (layer, why), = result.not_swapped
    assert layer == "act2" and "NotImplementedError: the kernel's backward is not written" in why
    found = bisect(Swapper(mlp.reference, _forward_only_port))
    assert not found.culprits and found.outcome == BisectOutcome.CANNOT_CONCLUDE
    assert [c.layers for c in found.cannot_judge] == [["act2"]]
    assert not found.complete  # act2 has no container to be judged in its place
