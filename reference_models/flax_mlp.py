"""A Flax NNX port of ``reference_models.flax_mlp_reference`` (the pre-norm residual MLP), and
the same port with the classic PyTorch -> Flax slips planted, one per case.

Module names follow the reference (``proj_in``, ``block.ln``, ``block.fc1``, ``block.act``,
``block.fc2``, ``ln_f``, ``head``); parameters take Flax's names and layouts: a dense layer's
``kernel`` is ``(in, out)`` where torch's ``weight`` is ``(out, in)``, a LayerNorm's ``weight``
is its ``scale``. ``flax_mlp.map.toml`` says so for ``capture --weights-from --map`` and
``diff --map``. Each case holds the reference's weights already, copied in by hand the way the
mapping file does it, so a case compares with its reference as it stands.

The faithful port differs from a first draft in three places, each a case of its own:
- ``bug_layernorm_eps``: ``nnx.LayerNorm``'s default epsilon, 1e-6, where torch's is 1e-5;
- ``bug_gelu_tanh``: ``jax.nn.gelu``'s default ``approximate=True`` (tanh), where
  ``torch.nn.GELU`` is exact (erf);
- ``bug_kernel_not_transposed``: ``block.fc1``'s torch weight loaded as its kernel without the
  transpose; square, so it fits. ``flax_mlp_untransposed.map.toml`` is that mapping-file slip
  (``transform`` left out: a copy).

And a fourth the faithful port avoids without a case: ``nnx.LayerNorm``'s default
``use_fast_variance=True`` computes E[x^2] - E[x]^2, which cancels where the mean is large next
to the spread; torch computes the variance around the mean.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from layerdiff import Case

from . import flax_mlp_reference as ref_model
from .flax_mlp_reference import CLASSES, IN, WIDTH

MODULE = "reference_models.flax_mlp"
TORCH_LAYERNORM_EPS = 1e-5


@dataclass(frozen=True)
class Slips:
    """Which torch -> Flax slips a port makes (all False: the faithful port)."""

    layernorm_default_eps: bool = False
    gelu_tanh: bool = False
    kernel_not_transposed: bool = False   # block.fc1's weight copied in as its kernel


class GELU(nnx.Module):
    """GELU as a module of its own, so it is a site, as torch's ``nn.GELU`` is."""

    def __init__(self, approximate: bool) -> None:
        self.approximate = approximate

    def __call__(self, x: jax.Array) -> jax.Array:
        return jax.nn.gelu(x, approximate=self.approximate)


def _layer_norm(slips: Slips, rngs: nnx.Rngs) -> nnx.LayerNorm:
    if slips.layernorm_default_eps:
        return nnx.LayerNorm(WIDTH, rngs=rngs)  # BUG: Flax's default epsilon, 1e-6
    return nnx.LayerNorm(WIDTH, epsilon=TORCH_LAYERNORM_EPS, use_fast_variance=False, rngs=rngs)


class Block(nnx.Module):
    def __init__(self, slips: Slips, rngs: nnx.Rngs) -> None:
        self.ln = _layer_norm(slips, rngs)
        self.fc1 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)
        self.act = GELU(approximate=slips.gelu_tanh)  # BUG when True: jax.nn.gelu's default
        self.fc2 = nnx.Linear(WIDTH, WIDTH, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + self.fc2(self.act(self.fc1(self.ln(x))))


class PreNormMLP(nnx.Module):
    def __init__(self, slips: Slips = Slips(), *, rngs: nnx.Rngs) -> None:
        self.proj_in = nnx.Linear(IN, WIDTH, rngs=rngs)
        self.block = Block(slips, rngs)
        self.ln_f = _layer_norm(slips, rngs)
        self.head = nnx.Linear(WIDTH, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.head(self.ln_f(self.block(self.proj_in(x))))


# torch parameter -> (NNX parameter, transposed?): what flax_mlp.map.toml says, by hand
LINEARS = ("proj_in", "block.fc1", "block.fc2", "head")
LAYERNORMS = ("block.ln", "ln_f")


def torch_to_nnx_names() -> dict[str, tuple[str, bool]]:
    names = {}
    for linear in LINEARS:
        names[f"{linear}.weight"] = (f"{linear}.kernel", True)
        names[f"{linear}.bias"] = (f"{linear}.bias", False)
    for norm in LAYERNORMS:
        names[f"{norm}.weight"] = (f"{norm}.scale", False)
        names[f"{norm}.bias"] = (f"{norm}.bias", False)
    return names


def copy_from_torch(model: PreNormMLP, state: dict[str, np.ndarray],
                    slips: Slips = Slips()) -> PreNormMLP:
    """Set every parameter of ``model`` from the torch reference's ``state`` (name -> array)."""
    for torch_name, (nnx_name, transpose) in torch_to_nnx_names().items():
        value = np.asarray(state[torch_name])
        if transpose and not (slips.kernel_not_transposed and nnx_name == "block.fc1.kernel"):
            value = value.T
        owner_path, _, attr = nnx_name.rpartition(".")
        owner = model
        for part in owner_path.split("."):
            owner = getattr(owner, part)
        param = getattr(owner, attr)
        if param[...].shape != value.shape:
            raise ValueError(f"{nnx_name}: {value.shape} does not fit {param[...].shape}")
        param[...] = jnp.asarray(value, dtype=param[...].dtype)
    return model


@dataclass
class Parts:
    """The pieces of a case, for tests that run the model without a capture."""

    model: PreNormMLP
    x: np.ndarray
    labels: np.ndarray
    loss_fn: Callable[[jax.Array], jax.Array]


def parts(slips: Slips = Slips()) -> Parts:
    """The port with the reference's weights, inputs and loss (the reference case's, as numpy)."""
    torch_model, x, labels = ref_model.build()
    state = {name: t.detach().numpy() for name, t in torch_model.state_dict().items()}
    x, labels = x.numpy(), labels.numpy()
    model = copy_from_torch(PreNormMLP(slips, rngs=nnx.Rngs(ref_model.SEED)), state, slips)
    labels_jax = jnp.asarray(labels, dtype=jnp.int32)

    def loss_fn(logits: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels_jax).mean()

    return Parts(model, x, labels, loss_fn)


def _case(slips: Slips, name: str) -> Case:
    p = parts(slips)
    return Case(model=p.model, inputs=(p.x,), loss_fn=p.loss_fn, seed=ref_model.SEED, steps=1,
                optimizer=optax.sgd(0.1, momentum=0.9), name=f"{MODULE}:{name}")


def port() -> Case:
    """The faithful port: epsilon 1e-5, exact GELU, kernels transposed."""
    return _case(Slips(), "port")


def bug_layernorm_eps() -> Case:
    return _case(Slips(layernorm_default_eps=True), "bug_layernorm_eps")


def bug_gelu_tanh() -> Case:
    return _case(Slips(gelu_tanh=True), "bug_gelu_tanh")


def bug_kernel_not_transposed() -> Case:
    return _case(Slips(kernel_not_transposed=True), "bug_kernel_not_transposed")
