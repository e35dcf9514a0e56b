"""Replay into a Flax NNX port (layerdiff/flax/replay.py): each NNX module run on the
torch reference's recorded inputs, its backward through jax.vjp on the recorded output
gradients, judged as a torch port's replay is."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch
from torch import nn
from torch.nn import functional as F

pytest.importorskip("flax")
import jax
import jax.numpy as jnp
from flax import nnx

from layerdiff import Case, capture, seed_everything
from layerdiff.errors import CaseError, MappingError
from layerdiff.mapping import Mapping
from layerdiff.replay import replay
from reference_models import flax_mlp
from reference_models.catalog import HERE, find

MAP = HERE / "flax_mlp.map.toml"   # kernel <- weight transposed, scale <- weight: any model


def _port_case(model, name: str):
    """A Case of an NNX model; before layerdiff.Case takes one (issue 31's capture part), a
    stand-in with the two fields replay reads."""
    try:
        return Case(model=model, inputs=(), loss_fn=lambda out: out.sum(), name=name)
    except CaseError:
        return types.SimpleNamespace(model=model, name=name)


def _local(result):
    table = result.local
    return {(row.port_site, row["pass"]): row.verdict for _, row in table.iterrows()}


# ---- a tiny torch reference: a gate called twice with a keyword mask, a norm, a head

class TorchGate(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, *, mask):
        return self.proj(x) * mask


class TorchTiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = TorchGate()
        self.drop = nn.Dropout(0.0)
        self.norm = nn.LayerNorm(8)
        self.out = nn.Linear(8, 3)

    def forward(self, x, mask):
        h = self.gate(torch.tanh(self.gate(x, mask=mask)), mask=mask)
        return self.out(self.norm(self.drop(h)))


class Gate(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.proj = nnx.Linear(8, 8, rngs=rngs)

    def __call__(self, x, *, mask):
        return self.proj(x) * mask


class Tiny(nnx.Module):
    def __init__(self, *, epsilon: float = 1e-5, dropout: float = 0.0) -> None:
        rngs = nnx.Rngs(0)
        self.gate = Gate(rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)
        self.norm = nnx.LayerNorm(8, epsilon=epsilon, use_fast_variance=False, rngs=rngs)
        self.out = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x, mask):
        h = self.gate(jnp.tanh(self.gate(x, mask=mask)), mask=mask)
        return self.out(self.norm(self.drop(h)))


@pytest.fixture(scope="module")
def tiny_reference(tmp_path_factory):
    seed_everything(0)
    model = TorchTiny()
    x = torch.randn(4, 8)
    mask = (torch.rand(4, 8) > 0.3).float()
    labels = torch.tensor([0, 1, 2, 1])
    case = Case(model=model, inputs=(x, mask), loss_fn=lambda out: F.cross_entropy(out, labels),
                name="tiny-reference")
    return capture(case, tmp_path_factory.mktemp("ref") / "tiny.h5")


def test_faithful_nnx_port_is_within_everywhere_both_passes(tiny_reference, tmp_path):
    result = replay(tiny_reference, _port_case(Tiny(), "tiny"), mapping=MAP,
                    propagated=False, output=tmp_path / "replay.h5")
    assert result.passed and not result.cannot_judge and not result.skipped
    verdicts = _local(result)
    assert set(verdicts.values()) == {"within"}
    # both calls of the gate, with the keyword mask, forward and backward
    assert {("gate#0", "forward"), ("gate#1", "backward"), ("gate.proj#1", "backward")} <= set(
        verdicts)
    rows = result.diff.rows
    mask_rows = rows[(rows["site"] == "gate#1") & (rows["role"] == "input")]
    assert set(mask_rows["arg"]) == {"0", "mask"}
    # proj's weight gradient sums its two calls, as the reference's does, through the
    # mapping's transpose; and every call sent x its gradient
    grads = rows[(rows["role"] == "weight_grad") & (rows["site"] == "gate.proj#0")]
    assert set(grads["arg"]) == {"weight", "bias"} and (grads["ratio"] <= 1).all()
    assert ((rows["role"] == "grad_input") & (rows["site"] == "gate#1")).any()


def test_a_planted_nnx_layer_is_named_local_error_and_the_rest_within(tiny_reference):
    # Keras's epsilon on a LayerNorm whose input has variance ~0.01: its own error
    result = replay(tiny_reference, _port_case(Tiny(epsilon=1e-3), "tiny-eps"), mapping=MAP,
                    propagated=False)
    assert not result.passed
    verdicts = _local(result)
    local = {site for site, verdict in verdicts.items() if verdict == "LOCAL ERROR"}
    assert ("norm#0", "forward") in local
    assert {site for site, _ in local} == {"norm#0"}
    assert verdicts[("out#0", "forward")] == "within"  # the head gets the reference's input


def test_a_kernel_loaded_without_its_transpose_is_named_at_its_layer(reference_traces):
    info = find("reference_models.flax_mlp:bug_kernel_not_transposed")
    reference = reference_traces(info.reference)
    result = replay(reference, _port_case(flax_mlp.parts().model, "flax-mlp"),
                    mapping=info.mapping_path, propagated=False)
    local = {site for site, verdict in _local(result).items() if verdict == "LOCAL ERROR"}
    assert local == {("block.fc1#0", "forward"), ("block.fc1#0", "backward")}


def test_a_module_that_draws_random_numbers_is_skipped_saying_why(tiny_reference):
    result = replay(tiny_reference, _port_case(Tiny(dropout=0.5), "tiny-dropout"),
                    mapping=MAP, propagated=False)
    skipped = dict(result.skipped)
    assert "drop#0" in skipped and "random numbers" in skipped["drop#0"]
    # a pass says how many sites it judged, and how many it skipped
    from layerdiff.report.terminal import format_replay

    assert result.passed
    replayed, left = len(result.replayed), len(result.skipped_sites)
    assert left >= 1 and "drop#0" in result.skipped_sites
    assert format_replay(result).splitlines()[0] == (
        f"PASS  no replayed layer has a local error ({replayed} of {replayed + left} sites "
        f"replayed; {left} skipped)")


def test_a_parameter_the_mapping_cannot_source_is_refused_in_one_sentence(tiny_reference):
    """The same sentence as for a torch port (layerdiff.weights): the file, the parameters, the
    fix in the mapping or in the port."""
    with pytest.raises(MappingError, match=r"^weights from \S+tiny\.h5: nothing in the reference "
                       r"gives port .*norm\.scale.*; add \[\[site\]\] or \[\[param\]\] rules "
                       r"to a mapping file \(--map\), or look at the port: [^\n]*$"):
        replay(tiny_reference, _port_case(Tiny(), "tiny"), mapping=Mapping(), propagated=False)


def _random_state(model) -> list[np.ndarray]:
    return [np.asarray(jax.random.key_data(node[...]) if isinstance(node, nnx.RngKey)
                       else node[...])
            for _, node in nnx.iter_graph(model) if isinstance(node, nnx.RngState)]


def test_replay_leaves_the_port_models_random_streams_as_they_were(tiny_reference):
    model = Tiny(dropout=0.5)
    before = _random_state(model)
    replay(tiny_reference, _port_case(model, "tiny-dropout"), mapping=MAP, propagated=False)
    after = _random_state(model)
    assert before and all(np.array_equal(a, b) for a, b in zip(before, after, strict=True))


def test_a_bfloat16_reference_is_replayed_in_bfloat16(tmp_path):
    """A bfloat16 input is stored widened; the NNX layer gets it back in bfloat16, so its own
    rounding is what a bfloat16 port makes, judged at bfloat16's tolerance."""
    seed_everything(0)
    model = nn.Sequential()
    model.add_module("out", nn.Linear(8, 3))
    model = model.to(torch.bfloat16)
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    reference = capture(Case(model=model, inputs=(x,), loss_fn=lambda out: out.float().sum(),
                             name="bf16"), tmp_path / "bf16.h5")

    seen = []

    class Port(nnx.Module):
        def __init__(self) -> None:
            self.out = nnx.Linear(8, 3, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
                                  rngs=nnx.Rngs(0))

        def __call__(self, x):
            seen.append(jnp.dtype(x.dtype))
            return self.out(x)

    result = replay(reference, _port_case(Port(), "bf16-port"), mapping=MAP, propagated=False)
    assert seen and set(seen) == {jnp.dtype(jnp.bfloat16)}
    assert result.passed, result.local


class TorchSelfAttention(nn.Module):
    """attn(x, x, x): one tensor three times, its gradient recorded once under "0"."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, query, key, value):
        scores = (self.q(query) @ key.transpose(-2, -1)).softmax(-1)
        return scores @ value


class SelfAttention(nnx.Module):
    def __init__(self) -> None:
        self.q = nnx.Linear(8, 8, rngs=nnx.Rngs(0))

    def __call__(self, query, key, value):
        return jax.nn.softmax(self.q(query) @ jnp.swapaxes(key, -2, -1), axis=-1) @ value


class Holder(nnx.Module):
    def __init__(self) -> None:
        self.inp = nnx.Linear(8, 8, rngs=nnx.Rngs(1))
        self.attn = SelfAttention()

    def __call__(self, x):
        h = self.inp(x)
        return self.attn(h, h, h)


class TorchHolder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 8)
        self.attn = TorchSelfAttention()

    def forward(self, x):
        h = self.inp(x)
        return self.attn(h, h, h)


def test_one_tensor_passed_three_times_gets_its_whole_gradient(tmp_path):
    seed_everything(0)

    x = torch.randn(2, 5, 8)
    reference = capture(Case(model=TorchHolder(), inputs=(x,), loss_fn=lambda out: out.sum(),
                             name="self-attention"), tmp_path / "attn.h5")
    result = replay(reference, _port_case(Holder(), "attn-port"), mapping=MAP,
                    propagated=False)
    assert result.passed, result.local
    rows = result.diff.rows
    grad = rows[(rows["site"] == "attn#0") & (rows["role"] == "grad_input")]
    assert list(grad["arg"]) == ["0"]
