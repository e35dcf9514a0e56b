"""Flax replay's compiled calls (layerdiff/flax/calls.py): modules of one structure and
call shape share one program, a slip that makes two such modules differ is still named at its
own site, compiled and eager replay agree, and code that needs concrete values runs eagerly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

pytest.importorskip("flax")
import jax.numpy as jnp
from flax import nnx

from layerdiff import Case, capture, seed_everything
from layerdiff.flax import replay as flax_replay
from layerdiff.replay import replay
from reference_models.catalog import HERE

MAP = HERE / "flax_mlp.map.toml"   # kernel <- weight transposed


class TorchBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x, mask):
        return x + torch.tanh(self.fc(x)) * mask


class TorchStack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([TorchBlock() for _ in range(3)])

    def forward(self, x, mask):
        for block in self.blocks:
            x = block(x, mask)
        return x


class Block(nnx.Module):
    def __init__(self, gain: float, concrete: bool) -> None:
        self.fc = nnx.Linear(8, 8, rngs=nnx.Rngs(0))
        self.gain = gain            # a static attribute: part of the module's structure
        self.concrete = concrete

    def __call__(self, x, mask):
        if self.concrete:           # the mask read as numpy: no tracing can run this
            mask = jnp.asarray(np.asarray(mask))
        return x + self.gain * jnp.tanh(self.fc(x)) * mask


class Stack(nnx.Module):
    def __init__(self, gains=(1.0, 1.0, 1.0), concrete: bool = False) -> None:
        self.blocks = nnx.List([Block(gain, concrete) for gain in gains])

    def __call__(self, x, mask):
        for block in self.blocks:
            x = block(x, mask)
        return x


@pytest.fixture(scope="module")
def stack_reference(tmp_path_factory):
    seed_everything(0)
    x = torch.randn(4, 8, requires_grad=False)
    mask = (torch.rand(4, 8) > 0.3).float()   # no gradient recorded: a floating non-leaf
    case = Case(model=TorchStack(), inputs=(x, mask), loss_fn=lambda out: out.square().sum(),
                name="stack-reference")
    return capture(case, tmp_path_factory.mktemp("stack") / "stack.h5")


def _replay(reference, model, compiled: bool = True):
    """The replay result and the port replayer it used."""
    ports = []
    original = flax_replay.FlaxPort

    def make(*args, **kwargs):
        ports.append(original(*args, compiled=compiled, **kwargs))
        return ports[-1]

    flax_replay.FlaxPort = make
    try:
        port = Case(model=model, inputs=(), loss_fn=lambda out: out.sum(), name="stack-port")
        result = replay(reference, port, mapping=MAP, propagated=False)
    finally:
        flax_replay.FlaxPort = original
    return result, ports[0]


def _verdicts(result):
    return {(row.port_site, row["pass"]): row.verdict for _, row in result.local.iterrows()}


def test_blocks_of_one_structure_share_a_program_and_match_eager(stack_reference):
    result, port = _replay(stack_reference, Stack())
    assert result.passed and not result.cannot_judge, result.local
    sites = {site for site, _ in result.replayed}
    assert len(sites) == 7   # the root, three blocks and their three fc
    # the root; the first block and its fc, whose input (the model's) gets no gradient; the
    # other two blocks and their fc, one program each kind
    assert port.calls.programs == 5 and port.calls.eager_shapes == 0
    eager, eager_port = _replay(stack_reference, Stack(), compiled=False)
    assert eager_port.calls.programs == 0
    assert _verdicts(eager) == _verdicts(result)
    rows = result.diff.rows.set_index(["site", "role", "arg"])["ratio"]
    eager_rows = eager.diff.rows.set_index(["site", "role", "arg"])["ratio"]
    assert (rows.sort_index() - eager_rows.sort_index()).abs().max() < 0.05


def test_a_slip_in_one_block_is_named_there_not_shared_with_its_siblings(stack_reference):
    result, port = _replay(stack_reference, Stack(gains=(1.0, 1.01, 1.0)))
    local = {site for site, verdict in _verdicts(result).items() if verdict == "LOCAL ERROR"}
    assert {site for site, _ in local} == {"blocks.1#0"}, result.local
    assert ("blocks.1#0", "forward") in local and ("blocks.1#0", "backward") in local
    assert port.calls.programs == 6   # gain 1.01 makes its own structure


def test_code_that_needs_concrete_values_is_replayed_eagerly(stack_reference):
    result, port = _replay(stack_reference, Stack(concrete=True))
    assert result.passed and not result.cannot_judge, result.local
    # the blocks (two shapes) and the root that calls them run eagerly; the fc, compiled
    assert port.calls.eager_shapes == 3 and port.calls.programs == 2
    bug, _ = _replay(stack_reference, Stack(gains=(1.01, 1.0, 1.0), concrete=True))
    local = {site for site, verdict in _verdicts(bug).items() if verdict == "LOCAL ERROR"}
    assert {site for site, _ in local} == {"blocks.0#0"}, bug.local



def test_a_site_the_mapping_leaves_unmatched_is_skipped_with_its_reason(stack_reference,
                                                                        tmp_path):
    mapping = tmp_path / "unmatched.map.toml"
    mapping.write_text(MAP.read_text() + '\n[[unmatched]]\nreference = "blocks.2"\n'
                       'why = "the port fuses it into its root"\n')
    port = Case(model=Stack(), inputs=(), loss_fn=lambda out: out.sum(), name="stack-port")
    result = replay(stack_reference, port, mapping=mapping, propagated=False)
    assert dict(result.skipped)["blocks.2#0"] == ("no port layer pairs with it (the port fuses "
                                                  "it into its root)")
    assert ("blocks.2.fc#0", "blocks.2.fc#0") in result.replayed
