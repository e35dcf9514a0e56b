"""What a site returns in another layout than the reference's (issue 39, item 3).

Reshape-only pairs: a projection whose output is (B, T, N*H) in the reference and (B, T, N, H)
in the port holds the same elements in the same order; the diff pairs it without a rule, with
a note, forward and backward (it failed as ``not finite ... worst element [nan]``). A
transpose is never taken for a reshape.

Output conversions (``output_transform`` on a site rule): experts that return the routing
weights and each chosen expert's unweighted output (tokens, k, dim) against a reference whose
experts return the weighted sum. The faithful port passes with the rule (the gradients at the
port's outputs compared with the reference's pulled back through the function's vjp); a bug in
one expert is named at the experts, in the diff and in replay; a function that raises is one
sentence; a malformed rule is refused with its line; a trace's recorded mapping naming one is
not run; summary traces list the converted outputs as not compared.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from layerdiff import Case, MappingError, capture, diff, load_weights, seed_everything
from layerdiff.compare import read_pair
from layerdiff.compare.judge import Verdict
from layerdiff.compare.shapes import same_order
from layerdiff.mapping import Mapping

B, T, N, H = 2, 3, 2, 4
PASSING = {Verdict.WITHIN, Verdict.IDENTICAL}


# ---------------------------------------------------------------- reshape-only pairs

@pytest.mark.parametrize(("a", "b", "same"), [
    ((B, T, N * H), (B, T, N, H), True),       # heads split out of the features
    ((B, T, N, H), (B, T, N * H), True),
    ((B * T, N * H), (B, T, N, H), True),      # tokens flattened too
    ((1, T, N * H), (T, N, H), True),          # an axis of size 1 aside
    ((B, T, N, H), (B, N, T, H), False),       # a transpose: other elements at each place
    ((B, T * N, H), (B * T, N * H), False),    # merged here, split there: not assumed
    ((B, T, N * H), (B, T, N * H + 1), False),
    ((B, T, N * H), (B, T, N * H), False),     # equal shapes: nothing to allow
    ((0, N * H), (1, 0, N * H), True),         # empty: axes of size 1 only
    ((0, N * H), (0, N, H), False),
])
def test_same_order_is_a_merge_of_adjacent_axes_never_a_transpose(a, b, same):
    assert same_order(a, b) is same


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj, self.head = nn.Linear(N * H, N * H), nn.Linear(N * H, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x)))


class Heads(nn.Module):
    """The port's projection: returns its output split into heads, (B, T, N, H)."""

    scale = 1.0

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(N * H, N * H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.lin(x) * self.scale).view(*x.shape[:-1], N, H)


class BuggyHeads(Heads):
    scale = 1.01


class Port(nn.Module):
    def __init__(self, heads: type[Heads] = Heads) -> None:
        super().__init__()
        self.proj, self.head = heads(), nn.Linear(N * H, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x).flatten(2)))


def _case(model: type[nn.Module], *args) -> Case:
    seed_everything(0)
    x = torch.randn(B, T, N * H)
    return Case(model=model(*args), inputs=(x,), loss_fn=lambda out: out.pow(2).mean(), seed=0)


RESHAPE_MAP = """version = 1

[[param]]
port = "proj.lin.weight"
reference = "proj.weight"

[[param]]
port = "proj.lin.bias"
reference = "proj.bias"

[[unmatched]]
port = "proj.lin"
why = "the Linear inside the port's projection module"
"""


@pytest.fixture(scope="module")
def reshape_pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("reshape")
    mapping = folder / "port.map.toml"
    mapping.write_text(RESHAPE_MAP, encoding="utf-8")
    return capture(_case(Reference), folder / "ref.h5"), mapping


def _port(reference: Path, mapping: Path, tmp_path: Path, heads: type[Heads]) -> Path:
    port = _case(Port, heads)
    load_weights(port.model, reference, mapping)
    return capture(port, tmp_path / "port.h5")


def test_a_port_output_split_into_heads_pairs_without_a_rule(reshape_pair, tmp_path):
    reference, mapping = reshape_pair
    result = diff(reference, _port(reference, mapping, tmp_path, Heads), mapping=mapping)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio", "note"]]
    rows = result.rows[result.rows["site"] == "proj#0"]
    for role in ("output", "grad_output"):
        row = rows[rows["role"] == role].iloc[0]
        assert row["verdict"] in PASSING, row
        assert (row["shape"], row["port_shape"]) == ("2,3,8", "2,3,2,4")
        assert "the same elements in the same order, shapes (2,3,8) and (2,3,2,4)" in row["note"]


def test_a_bug_in_the_split_projection_is_named_there_not_as_not_finite(reshape_pair,
                                                                         tmp_path):
    reference, mapping = reshape_pair
    result = diff(reference, _port(reference, mapping, tmp_path, BuggyHeads), mapping=mapping)
    assert not result.passed
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("proj#0", "forward", "output")
    assert 1 < origin.metrics["ratio"] < float("inf")
    assert not (result.rows["verdict"] == Verdict.SHAPE_MISMATCH).any()


# ---------------------------------------------------------------- output conversions: MoE

D, EXPERTS, K, TOKENS = 6, 3, 2, 7


def weighted_sum(weights: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
    """The port's (routing weights (tokens, k), unweighted outputs (tokens, k, dim)) -> the
    reference's weighted sum (tokens, dim)."""
    return (weights[..., None] * outputs).sum(1)


def _chosen(w: torch.Tensor, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    return torch.tanh(torch.einsum("tkod,td->tko", w[idx], x))  # (tokens, k, dim)


class ReferenceExperts(nn.Module):
    """Returns the routing-weighted sum of the chosen experts' outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(EXPERTS, D, D) / D ** 0.5)

    def forward(self, x, idx, weights):
        return (weights[..., None] * _chosen(self.w, x, idx)).sum(1)


class PortExperts(ReferenceExperts):
    """Returns the routing weights and each chosen expert's unweighted output."""

    bad_expert: int | None = None

    def forward(self, x, idx, weights):
        outputs = _chosen(self.w, x, idx)
        if self.bad_expert is not None:  # one expert computes something else
            outputs = torch.where((idx == self.bad_expert)[..., None], outputs * 1.05, outputs)
        return weights, outputs


class BuggyPortExperts(PortExperts):
    bad_expert = 1


class MoE(nn.Module):
    def __init__(self, experts: type[nn.Module]) -> None:
        super().__init__()
        self.router, self.experts = nn.Linear(D, EXPERTS), experts()

    def forward(self, x):
        weights, idx = self.router(x).softmax(-1).topk(K, -1)
        out = self.experts(x, idx, weights)
        if isinstance(out, tuple):  # the port combines the experts' outputs itself
            out = weighted_sum(*out)
        return out


class MoENet(nn.Module):
    def __init__(self, experts: type[nn.Module] = ReferenceExperts) -> None:
        super().__init__()
        self.moe, self.head = MoE(experts), nn.Linear(D, 3)

    def forward(self, x):
        return self.head(self.moe(x))


def _moe_case(experts: type[nn.Module]) -> Case:
    seed_everything(0)
    x = torch.randn(TOKENS, D)
    return Case(model=MoENet(experts), inputs=(x,), loss_fn=lambda out: out.pow(2).mean(),
                seed=0)


HERE = "tests.test_output_layouts"
MOE_MAP = f"""version = 1

[[site]]
reference = "moe.experts"
port = "moe.experts"
output_transform = {{ function = "{HERE}:weighted_sum", takes = ["0", "1"] }}
"""


@pytest.fixture(scope="module")
def moe_pair(tmp_path_factory) -> tuple[Path, Path]:
    folder = tmp_path_factory.mktemp("moe")
    mapping = folder / "moe.map.toml"
    mapping.write_text(MOE_MAP, encoding="utf-8")
    return capture(_moe_case(ReferenceExperts), folder / "ref.h5"), mapping


def _moe_diff(moe_pair, tmp_path, experts):
    reference, mapping = moe_pair
    port = _moe_case(experts)
    load_weights(port.model, reference, mapping)
    return diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)


def test_experts_returning_unweighted_outputs_pair_through_an_output_conversion(moe_pair,
                                                                                tmp_path):
    result = _moe_diff(moe_pair, tmp_path, PortExperts)
    assert result.passed, result.failing()[["site", "role", "arg", "ratio", "note"]]
    rows = result.rows[result.rows["site"] == "moe.experts#0"]
    converted = rows[rows["match"] == "output-converted"]
    assert sorted(zip(converted["role"], converted["arg"], converted["port_arg"],
                      strict=True)) == [
        ("grad_output", "0", "0"), ("grad_output", "0 (port 1)", "1"),
        ("output", "0", "0")]
    forward = converted[converted["role"] == "output"].iloc[0]
    assert (forward["shape"], forward["verdict"]) == (f"{TOKENS},{D}", Verdict.WITHIN), forward
    assert "weighted_sum" in forward["note"]
    grads = converted[converted["role"] == "grad_output"]
    assert set(grads["port_shape"]) == {f"{TOKENS},{K}", f"{TOKENS},{K},{D}"}
    assert grads["verdict"].isin(PASSING).all() and (grads["ratio"] < 0.5).all(), grads
    assert "pulled back through output conversion" in grads.iloc[0]["note"]
    assert "vector-Jacobian product" in grads.iloc[0]["note"]
    for _, row in converted.iterrows():  # read back as compared: reports and hints see this
        ref_values, port_values = read_pair(result, row)
        assert ref_values.shape == port_values.shape
        assert np.allclose(ref_values, port_values, rtol=1e-5, atol=1e-6)
    assert not (result.unmatched["site"] == "moe.experts#0").any(), result.unmatched


def test_a_bug_in_one_expert_is_named_at_the_experts_not_the_moe_block(moe_pair, tmp_path):
    result = _moe_diff(moe_pair, tmp_path, BuggyPortExperts)
    assert not result.passed
    origin = result.origin
    assert (origin.site, origin.pass_, origin.role) == ("moe.experts#0", "forward", "output")
    assert "moe#0" not in {o.site for o in result.origins}


def test_an_output_conversion_that_raises_is_one_sentence_naming_its_rule(moe_pair, tmp_path):
    reference, _ = moe_pair
    mapping = tmp_path / "broken.map.toml"
    mapping.write_text(MOE_MAP.replace("weighted_sum", "broken_sum"), encoding="utf-8")
    port = _moe_case(PortExperts)
    load_weights(port.model, reference)
    with pytest.raises(MappingError) as caught:
        diff(reference, capture(port, tmp_path / "port.h5"), mapping=mapping)
    message = str(caught.value)
    assert "broken_sum" in message and "line 3" in message and "moe.experts#0" in message
    assert "ValueError: two outputs expected" in message and "\n" not in message


def broken_sum(weights, outputs):
    raise ValueError("two outputs expected")


@pytest.mark.parametrize("value", ['"not code"', '{ function = "a.b:f", takes = [] }',
                                   '{ function = "a.b:f", takes = ["0", "0"] }',
                                   '{ function = "a.b:f", giving = "0" }'])
def test_a_malformed_output_transform_is_refused_with_its_line(tmp_path, value):
    path = tmp_path / "bad.map.toml"
    path.write_text(f'version = 1\n\n[[site]]\nreference = "a"\nport = "b"\n'
                    f'output_transform = {value}\n', encoding="utf-8")
    with pytest.raises(MappingError, match="line"):
        Mapping.load(path)


def test_a_recorded_mapping_that_names_an_output_conversion_is_not_run():
    with pytest.raises(MappingError, match="is code, and this mapping was read from"):
        Mapping.from_text(MOE_MAP, "moe.map.toml", recorded_in="port.h5")
    conversion = Mapping.from_text(MOE_MAP.split("output_transform")[0], "m.toml",
                                   recorded_in="port.h5").output_conversion("moe.experts#0")
    assert conversion is None


def test_an_output_conversion_is_read_as_data(moe_pair):
    mapping = Mapping.load(moe_pair[1])
    conversion = mapping.output_conversion("moe.experts#0")
    assert (conversion.spec, conversion.takes, conversion.gives) == (
        f"{HERE}:weighted_sum", ("0", "1"), "0")
    assert f"{HERE}:weighted_sum" in [ref.spec for ref in mapping.code_refs()]


def test_summary_traces_list_converted_outputs_as_not_compared(moe_pair, tmp_path):
    _, mapping = moe_pair
    reference = capture(_moe_case(ReferenceExperts), tmp_path / "ref.h5", summary=True)
    port = _moe_case(PortExperts)
    load_weights(port.model, moe_pair[0], mapping)
    result = diff(reference, capture(port, tmp_path / "port.h5", summary=True), mapping=mapping)
    rows = result.rows[result.rows["match"] == "output-converted"]
    assert sorted(rows["role"]) == ["grad_output", "output"]
    assert all("statistics only" in note and "not compared" in note for note in rows["note"])
    assert result.passed


@pytest.mark.parametrize(("experts", "local_at"), [(PortExperts, set()),
                                                   (BuggyPortExperts, {"moe.experts#0"})])
def test_replay_feeds_the_experts_the_reference_gradient_through_the_conversion(
        moe_pair, experts, local_at):
    from layerdiff.replay import replay

    reference, mapping = moe_pair
    result = replay(reference, _moe_case(experts), mapping=mapping, propagated=False)
    table = result.local
    local = table[table["verdict"] == "LOCAL ERROR"]
    assert set(local["port_site"]) == local_at, table
    assert not result.cannot_judge
