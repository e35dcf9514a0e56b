"""A [[site]] rule describes its module's own call, never the op sites inside it: a block-level
call adapter (``blocks.*`` -> ``layers.*`` with ``call = ...``) must not be run on the ops the
block's code records with ``--ops`` (their arguments are not the block's). The faithful port
passes with its ops captured, and a planted op-level bug is still named at its op."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from layerdiff import Case, capture, diff
from layerdiff.capture.port import capture_port
from layerdiff.mapping import Mapping

HERE = "tests.test_ops_site_rules"
WIDTH = 8


def block_call(hidden, *, cond):
    """The reference block's call ``block(h, cond=c)`` -> the port's ``layer(x, gain)``; an op's
    arguments (no ``cond``) would raise here."""
    return (hidden, cond), {}


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, WIDTH)

    def forward(self, hidden: torch.Tensor, *, cond: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.fc(hidden), dim=-1) * cond + hidden


class PortLayer(nn.Module):
    def __init__(self, bug: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.bug = bug

    def forward(self, x: torch.Tensor, gain: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.proj(x), dim=0 if self.bug else -1) * gain + x  # the bug


class Model(nn.Module):
    def __init__(self, port: bool = False, bug: bool = False) -> None:
        super().__init__()
        blocks = [PortLayer(bug and i == 1) if port else RefBlock() for i in range(2)]
        setattr(self, "layers" if port else "blocks", nn.ModuleList(blocks))
        self.port = port

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cond = torch.sigmoid(x.sum(-1, keepdim=True))
        for block in self.layers if self.port else self.blocks:
            x = block(x, cond) if self.port else block(x, cond=cond)
        return x


def _case(port: bool = False, bug: bool = False) -> Case:
    torch.manual_seed(0)
    return Case(model=Model(port, bug), inputs=(torch.randn(3, 5, WIDTH),),
                loss_fn=lambda out: out.pow(2).mean(), seed=0)


MAP = f"""version = 1
[[site]]
reference = "blocks.*.fc"
port = "layers.*.proj"

[[site]]
reference = "blocks.*"
port = "layers.*"
call = "{HERE}:block_call"
"""


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    folder: Path = tmp_path_factory.mktemp("ops_site_rules")
    (folder / "map.toml").write_text(MAP)
    reference = capture(_case(), folder / "ref.h5", ops=["*"], progress=False)
    ports = {bug: capture_port(_case(port=True, bug=bug), folder / f"port{bug}.h5",
                               weights_from=reference, mapping=folder / "map.toml",
                               ops=["*"], progress=False)
             for bug in (False, True)}
    return reference, ports, folder / "map.toml"


def test_a_site_rules_call_adapter_applies_to_its_module_call_only(traces):
    mapping = Mapping.load(traces[2])
    assert mapping.call_adapter("blocks.0#0").spec == f"{HERE}:block_call"
    for op in ("blocks.0#0/softmax#0", "blocks.0#1/mul#2"):  # '*' would match these names too
        assert mapping.call_adapter(op) is None
        assert mapping.output_conversion(op) is None and mapping.output_names(op) == {}


def test_the_faithful_port_passes_with_ops_under_a_block_call_adapter(traces):
    reference, ports, mapping = traces
    result = diff(reference, ports[False], mapping=mapping)
    assert result.passed and not result.origins
    rows = result.rows
    assert "adapted" in set(rows[rows["site"] == "blocks.1#0"]["match"])  # its inputs
    op_rows = rows[rows["site"] == "blocks.1#0/softmax#0"]
    assert set(op_rows["role"]) == {"input", "output", "grad_output", "grad_input"}
    assert (op_rows["port_site"] == "layers.1#0/softmax#0").all()


def test_a_planted_op_bug_under_a_block_call_adapter_is_named_at_its_op(traces):
    reference, ports, mapping = traces
    origin = diff(reference, ports[True], mapping=mapping).origin
    assert (origin.site, origin.port_site, origin.pass_) == (
        "blocks.1#0/softmax#0", "layers.1#0/softmax#0", "forward")
