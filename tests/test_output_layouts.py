"""What a site returns in another layout than the reference's (issue 39, item 3).

Reshape-only pairs: a projection whose output is (B, T, N*H) in the reference and (B, T, N, H)
in the port holds the same elements in the same order; the diff pairs it without a rule, with
a note, forward and backward (it failed as ``not finite ... worst element [nan]``). A
transpose is never taken for a reshape.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff, load_weights, seed_everything
from layerdiff.compare.engine import same_order
from layerdiff.compare.judge import Verdict

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
