"""map-check lists, on a faithful port, every paired site whose own code a diff could not judge
(issue 39, item 4), by the diff's own rule (``compare.origins.unjudgeable_sites``): port-only
inputs named the right way round with the two rules that end them, a port input the reference
passes as nothing, an output the port returns as None. None of them fails the check. And the
argument pairing follows the diff's one shape rule (``compare.shapes``)."""

from __future__ import annotations

import json
import re

import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff, load_weights, seed_everything
from layerdiff.compare.arguments import pair_arguments
from layerdiff.compare.shapes import as_shape, same_elements
from layerdiff.replay.mapcheck import map_check
from layerdiff.report.findings import render
from layerdiff.report.terminal import format_diff
from layerdiff.signature import Parameter, Signature
from tests import real_pairs_cases as cases
from tests.test_cannot_judge import Branch, TwoBranches, _case
from tests.test_real_pairs_diff import ADAPTERS

ATTN0 = "layers.0.attn#0"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return capture(cases.reference(), tmp_path_factory.mktemp("unjudged") / "reference.h5")


@pytest.fixture(scope="module")
def without_adapters(reference):
    return map_check(reference, cases.port_freqs())


def test_port_only_inputs_are_listed_with_the_rules_and_the_check_passes(without_adapters):
    check = without_adapters
    assert check, check.failing()
    sites = {site.site: site for site in check.cannot_judge}
    assert set(sites) == {"layers.0#0", ATTN0, "layers.1#0", "layers.1.attn#0"}
    attn = sites[ATTN0]
    assert attn.passes == ["forward", "backward"] and attn.roles == ["input"]
    why = attn.why[0]
    # the right way round: the port has them, the reference does not
    assert why.startswith("the port's inputs 'freqs_cos', 'freqs_sin' at layers.0.attn#0 have "
                          "no partner in the reference")
    assert 'call = "pkg.module:function" on a [[site]] rule for layers.0.attn' in why
    assert '[[unmatched]] port = "layers.0.attn" input = "1"' in why
    text = render(check)
    assert "sites a diff cannot judge" in text and "layers.0.attn#0: forward and backward" in text
    last = " ".join(" ".join(text.splitlines()[-2:]).split())  # the verdict, wrapped
    assert last.startswith("PASS") and "4 sites a diff cannot judge" in last
    data = json.loads(json.dumps(check.as_json()))
    assert data["verdict"] == "pass" and data["sites_unchecked"] == ""
    assert [s["site"] for s in data["cannot_judge"]][:2] == ["layers.0#0", ATTN0]


def test_the_command_exits_0_and_its_json_carries_the_sites(run, reference):
    result = run("map-check", reference, "tests.real_pairs_cases:port_freqs", "--json", "-")
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert report["verdict"] == "pass" and len(report["cannot_judge"]) == 4


def test_the_listed_declaration_ends_the_listing(reference, tmp_path, without_adapters):
    """Written down as map-check printed them, the port's own inputs no longer keep any site
    from being judged."""
    rules = {rule for site in without_adapters.cannot_judge for why in site.why
             for rule in re.findall(r'\[\[unmatched\]\] port = "[^"]+" input = "[^"]+"', why)}
    assert len(rules) == 8  # two tables at each of four sites
    mapping = tmp_path / "own.map.toml"
    mapping.write_text("version = 1\n" + "".join(
        "\n" + rule.replace(" port", "\nport").replace(" input", "\ninput")
        + '\nwhy = "the port\'s own rotary tables"\n' for rule in sorted(rules)),
        encoding="utf-8")
    check = map_check(reference, cases.port_freqs(), mapping)
    assert check and check.cannot_judge == []


def test_with_call_adapters_every_site_is_judged_and_nothing_is_listed(reference, tmp_path):
    mapping = tmp_path / "adapters.map.toml"
    mapping.write_text(ADAPTERS, encoding="utf-8")
    check = map_check(reference, cases.port_freqs(), mapping)
    assert check and check.cannot_judge == [] and check.sites_unchecked == ""
    assert "cannot judge" not in render(check)


def test_a_mask_only_the_port_passes_is_listed(tmp_path):
    """The port hands its branch a mask the reference never builds (the cross-attention whose
    reference passes None): listed, with the adapter or the declaration."""
    seed_everything(0)
    reference = capture(_case(TwoBranches()), tmp_path / "ref.h5", progress=False)
    check = map_check(reference, _case(TwoBranches(port=True)))
    assert check and [site.site for site in check.cannot_judge] == ["a#0"]
    assert "'mask'" in check.cannot_judge[0].why[0]
    assert '[[unmatched]] port = "a" input = "1"' in check.cannot_judge[0].why[0]
    # the diff of the faithful port passes and says the same, its rule behind --verbose
    port = TwoBranches(port=True)
    load_weights(port, reference)
    result = diff(reference, capture(_case(port), tmp_path / "port.h5", progress=False))
    assert result and [site.site for site in result.cannot_judge] == ["a#0"]
    assert "unjudged  1 paired site(s) whose own code cannot be judged" in format_diff(result)
    assert '[[unmatched]] port = "a" input = "1"' in format_diff(result, verbose=True)


class ExplicitNone(nn.Module):
    """The reference passes ``mask=None`` by name, the port a tensor there."""

    def __init__(self, port: bool = False, a_scale: float = 1.0) -> None:
        super().__init__()
        self.a, self.b = Branch(a_scale), Branch()
        self.port = port

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x, mask=torch.ones(8) if self.port else None) + self.b(x)


def test_a_tensor_where_the_reference_passes_none_is_the_ports_own_input(tmp_path):
    """It was compared with the None ('out'), so the branch's output read as propagated and the
    diff named the root, confidently; now it is the port's input without partner: the diff's
    headline is the branch that cannot be judged, and map-check lists it on the faithful port."""
    seed_everything(0)
    reference = capture(_case(ExplicitNone()), tmp_path / "ref.h5", progress=False)
    port = ExplicitNone(port=True, a_scale=2.0)
    load_weights(port, reference)
    result = diff(reference, capture(_case(port), tmp_path / "port.h5", progress=False))
    assert result.cannot_judge_first is not None and result.cannot_judge_first.site == "a#0"
    assert result.origins == []
    check = map_check(reference, _case(ExplicitNone(port=True)))
    assert check and [site.site for site in check.cannot_judge] == ["a#0"]
    assert '[[unmatched]] port = "a" input = "mask"' in check.cannot_judge[0].why[0]


class Attention(nn.Module):
    def __init__(self, port: bool) -> None:
        super().__init__()
        self.proj, self.port = nn.Linear(8, 8), port

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = self.proj(x)
        return (y, None) if self.port else (y, y.softmax(-1))


class WithWeights(nn.Module):
    def __init__(self, port: bool = False) -> None:
        super().__init__()
        self.attn, self.out = Attention(port), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.attn(x)[0])


def _with_weights(port: bool) -> Case:
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    return Case(model=WithWeights(port), inputs=(x,), loss_fn=lambda o: o.square().mean(),
                seed=0)


def test_an_output_the_port_returns_as_none_is_no_partner_and_the_port_passes(tmp_path):
    """The reference's attention also returns its weights, the port None there: no partner
    (it was compared with the None and failed the faithful port), and since no gradient
    arrives at it, it keeps nothing from being judged."""
    seed_everything(0)
    reference = capture(_with_weights(False), tmp_path / "ref.h5", progress=False)
    port = _with_weights(True)
    load_weights(port.model, reference)
    result = diff(reference, capture(port, tmp_path / "port.h5", progress=False))
    assert result and result.cannot_judge == []
    unmatched = result.unmatched
    assert list(zip(unmatched["side"], unmatched["site"], unmatched["arg"], strict=True)) == [
        ("reference", "attn#0", "1")]
    assert "attn#0 returns None there" in unmatched["reason"].iloc[0]
    assert map_check(reference, _with_weights(True)).cannot_judge == []


# ---- one shape rule: the argument pairing agrees with the diff's comparison

@pytest.mark.parametrize("ref_shape, port_shape, same", [
    ((1, 5, 8), (5, 8), True),              # a block's (1, T, D) against (T, D)
    ((2, 5, 12), (2, 5, 3, 4), True),       # a projection's (B, T, N*H) against (B, T, N, H)
    ((2, 3, 5, 4), (2, 5, 3, 4), False),    # heads transposed: never the same tensor
])
def test_argument_pairing_and_the_diff_share_the_shape_rule(ref_shape, port_shape, same):
    def leaf(shape):
        return {"": "tensor " + ",".join(map(str, shape))}

    ref_sig = Signature((Parameter("hidden_states", "positional", False, None),), "Ref.forward")
    # a keyword pairs with the port's positional argument at its place only when alike
    paired = pair_arguments({"hidden_states": leaf(ref_shape)}, {"0": leaf(port_shape)},
                            ref_sig, None).partner == {"hidden_states": "0"}
    assert paired is same is same_elements(ref_shape, port_shape)
    values = torch.arange(int(torch.tensor(ref_shape).prod())).reshape(ref_shape).numpy()
    assert (as_shape(values, port_shape).shape == port_shape) is same


class Mix(nn.Module):
    """A square weight applied by the module's own code; the reference returns (1, T, D), the
    port (T, D): the same elements in the same order."""

    def __init__(self, batched: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(8, 8))
        self.batched = batched

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.w.T
        return y.unsqueeze(0) if self.batched else y


class Mixer(nn.Module):
    def __init__(self, batched: bool) -> None:
        super().__init__()
        self.mix = Mix(batched)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(x).reshape(x.shape).sum()


def test_map_check_measures_an_output_apart_by_an_axis_of_size_1(tmp_path):
    """The transpose check compares a module's output with the recorded one by the diff's rule:
    (T, D) against (1, T, D) is measured (it was refused as 'nothing can be measured')."""
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))

    def case(model):
        return Case(model=model, inputs=(x,), loss_fn=lambda out: out, seed=0)

    seed_everything(0)
    reference = capture(case(Mixer(batched=True)), tmp_path / "ref.h5", progress=False)
    check = map_check(reference, case(Mixer(batched=False)), sites=False)
    entry = next(e for e in check.entries if e.port == "mix.w")
    assert entry.status == "ok" and entry.errors is not None and entry.errors[0] < 1e-6
    assert "transpose checked at mix#0" in entry.note
