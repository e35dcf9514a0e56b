"""diverge finds origins by the diff's own rule: the reference's arguments of a site whose call
a call adapter makes (judged through what the adapter makes of them), arguments the port does not
take and records declared unmatched do not keep their site from being judged. Re-judging the rows
by the golden band once left those out, so a bug in such a block's own code (its residual
dropped; Whisper's decoder layer against OpenAI's block) got "no origin was found" while the
diff of the same step's traces named the block."""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import Case, seed_everything
from layerdiff.debug.diverge import Cause, diverge


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, scale: torch.Tensor, use_cache: bool = False
                ) -> torch.Tensor:
        return x + self.lin(x) * scale


class PortBlock(RefBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * 2.0  # BUG: the residual is dropped (the block's own code)


class Model(nn.Module):
    def __init__(self, block: type[nn.Module]) -> None:
        super().__init__()
        self.block = block()
        self.head = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if isinstance(self.block, PortBlock):
            return self.head(self.block(x))
        return self.head(self.block(x, torch.full((4,), 2.0), use_cache=True))


def _case(block: type[nn.Module]) -> Case:
    seed_everything(0)
    model = Model(block)
    x = torch.randn(3, 4)
    return Case(model=model, inputs=(x,), loss_fn=lambda out: out.square().mean(), seed=0,
                steps=1, optimizer=lambda params: torch.optim.SGD(params, lr=0.1))


def reference() -> Case:
    return _case(RefBlock)


def port() -> Case:
    return _case(PortBlock)


def block_call(x: torch.Tensor, scale: torch.Tensor, use_cache: bool = False
               ) -> tuple[tuple, dict]:
    """The port's block has its scale built in: the reference's tensor is not passed on."""
    return (x,), {}


MAPPING = """version = 1
[[site]]
reference = "block"
port = "block"
call = "tests.test_diverge_excused:block_call"
"""


def test_a_block_called_through_an_adapter_is_named(tmp_path):
    mapping = tmp_path / "block.map.toml"
    mapping.write_text(MAPPING, encoding="utf-8")
    result = diverge(reference(), port(), steps=1, mapping=mapping,
                     output_dir=tmp_path / "out")
    assert result.cause == Cause.FORWARD, result.explanation
    origin = result.step_diff.origin
    assert (origin.site, origin.pass_) == ("block#0", "forward")
