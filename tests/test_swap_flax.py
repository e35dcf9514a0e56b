"""Swap and bisect with a Flax NNX port (flax/in_torch.py): a port layer runs inside the
torch reference, its backward through the module's jax.vjp. The faithful bundled port swaps in
within tolerance layer by layer and whole; bisect names each bundled slip at its site; a Flax
layer's outputs and every gradient (inputs and parameters) are the ones JAX computes."""

from __future__ import annotations

import fnmatch
import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("flax")
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from torch.nn import functional as F

from layerdiff import Case, DiffError, load_case
from layerdiff.flax.in_torch import FlaxLayer, to_jax, to_torch
from layerdiff.mapping import Mapping
from layerdiff.replay import Swapper, bisect
from layerdiff.replay.swap import SwapOutcome
from reference_models import flax_mlp, flax_mlp_reference
from reference_models.catalog import FLAX

BUGS = [info for info in FLAX if info.kind == "bug"]
PORT = next(info for info in FLAX if info.kind == "port")


def _factory(spec):
    return lambda: load_case(spec)


@pytest.fixture(scope="module")
def faithful():
    return Swapper(_factory(PORT.reference), _factory(PORT.spec), PORT.mapping_path)


def test_every_layer_of_the_faithful_flax_port_swaps_in_within_tolerance(faithful):
    assert set(faithful.pairs) == {"proj_in", "block", "block.ln", "block.fc1", "block.act",
                                   "block.fc2", "ln_f", "head"}
    for module in faithful.pairs:
        result = faithful.run([module])
        assert result.outcome == SwapOutcome.WITHIN, result.describe()
    whole = faithful.run(faithful.leaves())
    assert whole.outcome == SwapOutcome.WITHIN, whole.describe()
    # the Flax layers' own gradients were judged, through the mapping's transpose
    judged = {row.what for row in whole.rows if row.judged}
    assert "weight_grad block.fc1.weight (port block.fc1.kernel), step 0" in judged
    assert "weight_grad ln_f.weight (port ln_f.scale), step 0" in judged


def test_the_faithful_flax_port_leaves_bisect_nothing_to_find(faithful):
    result = bisect(faithful)
    assert result and not result.culprits and len(result.probes) == 1


@pytest.mark.parametrize("info", BUGS, ids=[i.spec.split(":")[-1] for i in BUGS])
def test_bisect_names_each_planted_flax_slip_at_its_site(info):
    swapper = Swapper(_factory(info.reference), _factory(info.spec), info.mapping_path)
    result = bisect(swapper)
    assert result.reproduced and not result.cannot_judge
    culprits = [port for _, port in result.culprits]
    assert info.site.rpartition("#")[0] in culprits, culprits
    assert all(fnmatch.fnmatchcase(f"{c}#0", info.runs_in) for c in culprits), culprits
    if len(culprits) == 1:
        assert len(result.probes) <= 2 * math.ceil(math.log2(len(result.candidates))) + 4


def test_a_trained_flax_layer_moves_with_the_reference(faithful):
    """Two steps: the reference's SGD trains the Flax layer's parameters (torch parameters
    under the Flax names), so the second step's loss still matches."""
    result = faithful.run(["block"], steps=2)
    assert result.outcome == SwapOutcome.WITHIN, result.describe()
    assert len(result.losses) == 2 and result.losses[1][0] != result.losses[0][0]


def test_reference_layers_into_a_flax_port_are_refused_in_one_sentence(faithful):
    with pytest.raises(DiffError, match=r"^case reference_models\.flax_mlp:port is a Flax "
                       r"model, .*cannot run inside its computation \(--into port\); swap "
                       r"its layers into the reference instead$"):
        faithful.run(["block.fc1"], into="port")


def test_a_flax_reference_is_refused_in_one_sentence():
    with pytest.raises(DiffError, match=r"^case reference_models\.flax_mlp:port is a Flax "
                       r"model, .*the reference must be a torch model; give the torch model as "
                       r"the reference and \S+ as the port$"):
        Swapper(flax_mlp.port, flax_mlp_reference.reference)


class _Scaled(nnx.Module):
    """Tuple and dict outputs, an integer input, a keyword that is not a tensor."""

    def __init__(self) -> None:
        self.w = nnx.Param(jnp.asarray(np.arange(12, dtype=np.float32).reshape(3, 4) / 7))

    def __call__(self, x, ids, *, scale: float = 1.0, extra=None):
        y = jnp.tanh(x @ self.w[...]) * scale
        return y, {"ids": ids + 1, "sum": y.sum(axis=-1), "none": extra}


def test_a_flax_layer_gives_jaxs_outputs_and_gradients_in_torchs_structure():
    module = _Scaled()
    layer = FlaxLayer(module, "scaled")
    assert [name for name, _ in layer.named_parameters()] == ["w"]
    x = torch.randn(2, 3, dtype=torch.float32, requires_grad=True)
    ids = torch.tensor([1, 2])
    y, rest = layer(x, ids, scale=2.5)
    assert rest["none"] is None and rest["ids"].tolist() == [2, 3]
    assert not rest["ids"].is_floating_point() and not rest["ids"].requires_grad
    (3 * y.sum() + (rest["sum"] ** 2).sum()).backward()

    def loss(w, xj):
        yj = jnp.tanh(xj @ w) * 2.5
        return 3 * yj.sum() + (yj.sum(axis=-1) ** 2).sum()

    gw, gx = jax.grad(loss, argnums=(0, 1))(module.w[...], to_jax(x))
    np.testing.assert_allclose(y.detach().numpy(), np.tanh(x.detach().numpy()
                                                           @ np.asarray(module.w[...])) * 2.5,
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(x.grad.numpy(), np.asarray(gx), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(layer.get_parameter("w").grad.numpy(), np.asarray(gw),
                               rtol=1e-6, atol=1e-6)


def test_bfloat16_crosses_by_its_bits():
    values = torch.randn(5, 7).to(torch.bfloat16)
    array = to_jax(values)
    assert array.dtype == jnp.bfloat16
    back = to_torch(array)
    assert back.dtype == torch.bfloat16 and torch.equal(back, values)


class _TiedTorch(torch.nn.Module):
    """A head tied to the token embedding (GPT-2's lm_head)."""

    def __init__(self) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(11, 8)
        self.lm_head = torch.nn.Linear(8, 11, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.wte(ids)))


class _Head(nnx.Module):
    def __init__(self, wte: nnx.Embed) -> None:
        self.wte = wte

    def __call__(self, x):
        return self.wte.attend(x)


class _TiedFlax(nnx.Module):
    """The port: its head module holds the embedding module and attends with it."""

    def __init__(self) -> None:
        self.wte = nnx.Embed(11, 8, rngs=nnx.Rngs(0))
        self.lm_head = _Head(self.wte)

    def __call__(self, ids):
        return self.lm_head(jnp.tanh(self.wte(ids)))


_IDS = np.random.default_rng(0).integers(0, 11, size=(3, 5))


def _tied_reference() -> Case:
    torch.manual_seed(0)
    targets = torch.from_numpy((_IDS + 1) % 11)
    return Case(model=_TiedTorch(), inputs=(torch.from_numpy(_IDS),),
                loss_fn=lambda out: F.cross_entropy(out.reshape(-1, 11), targets.reshape(-1)),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name="tied-ref")


def _tied_port() -> Case:
    targets = jnp.asarray((_IDS + 1) % 11)
    return Case(model=_TiedFlax(), inputs=(_IDS,), name="tied-port",
                loss_fn=lambda out: optax.softmax_cross_entropy_with_integer_labels(
                    out, targets).mean(), optimizer=optax.sgd(0.1))


def test_a_flax_head_tied_to_the_embedding_shares_the_references_parameter():
    """The swapped head's embedding is the host's tied parameter, so the embedding's gradient
    sums the head's use and the lookup's, as in the reference (a copy of its own would leave
    wte.weight's gradient without the head's part: a break)."""
    mapping = Mapping.from_text('version = 1\n[[param]]\nport = "*.embedding"\n'
                                'reference = "*.weight"\n', "tied.map.toml")
    swapper = Swapper(_tied_reference, _tied_port, mapping)
    # the head alone, and with the embedding swapped in before it (then both share it)
    for modules in (["lm_head"], ["wte", "lm_head"]):
        result = swapper.run(modules, steps=2)
        assert result.outcome == SwapOutcome.WITHIN, result.describe()
    assert any(row.what.startswith("weight_grad wte.weight") for row in result.rows)


@pytest.mark.slow
def test_an_independent_flax_ports_backward_only_slip_breaks_its_swap_in_gradients_alone():
    """The Gemma validation pair (tests/validation/): a norm whose forward is right and whose
    backward drops d(rsqrt)/dx breaks the reference through its weight gradients alone; an
    output projection called through the mapping's call adapter (which reshapes JAX arrays)
    swaps in within tolerance. (bisect names layers.1.pre_attention_norm in 7 probes.)"""
    pytest.importorskip("transformers")
    cases = "tests.validation.gemma_cases"
    mapping = Path(__file__).parent / "validation" / "gemma.map.toml"
    swapper = Swapper(_factory(f"{cases}:reference"), _factory(f"{cases}:bug_norm_backward"),
                      mapping)
    slip = swapper.run(["model.layers.1.input_layernorm"])
    assert slip.breaks, slip.describe()
    assert {r.role for r in slip.rows if r.judged and r.ratio > 1} == {"weight_grad"}
    adapted = swapper.run(["model.layers.0.self_attn.o_proj"])
    assert adapted.outcome == SwapOutcome.WITHIN, adapted.describe()
