"""A tiny torch reference (a pre-norm residual MLP of two blocks) and its Flax Linen port,
written as a Linen user writes one: ``nn.compact``, ``nn.Dense`` with its ``(in, out)``
kernel, blocks named ``blocks_0``, ``blocks_1`` (Linen names may hold no dot), the GELU
inline. ``flax_linen.map.toml`` says how torch's names become Linen's.

``bug_layernorm_eps``: ``blocks_0.ln`` with Linen's default epsilon, 1e-6 (torch's is 1e-5),
where its input's variance is ~0.006 (``proj_in``'s 0.02 init), so the output moves by ~1e-3
relative. ``flax_linen_untransposed.map.toml`` loads ``blocks_1.fc1``'s square kernel
without its transpose.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import torch
from flax import linen as nn
from torch import nn as tnn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, IN, WIDTH, CLASSES, BLOCKS = 8, 16, 32, 5, 2
TORCH_EPS = 1e-5


class TorchBlock(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = tnn.LayerNorm(WIDTH)
        self.fc1 = tnn.Linear(WIDTH, WIDTH)
        self.fc2 = tnn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.ln(x))))


class TorchMLP(tnn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj_in = tnn.Linear(IN, WIDTH)
        self.blocks = tnn.ModuleList(TorchBlock() for _ in range(BLOCKS))
        self.ln_f = tnn.LayerNorm(WIDTH)
        self.head = tnn.Linear(WIDTH, CLASSES)
        tnn.init.normal_(self.proj_in.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.proj_in(x)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _data() -> tuple[torch.Tensor, torch.Tensor]:
    seed_everything(SEED)
    x = torch.randn(BATCH, IN)
    return x, (x @ torch.randn(IN, CLASSES)).argmax(dim=1)


def reference() -> Case:
    seed_everything(SEED)
    model = TorchMLP()
    x, y = _data()
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
                seed=SEED, name="tests.flax_linen_cases:reference")


# ---- the Linen port

class Block(nn.Module):
    width: int
    ln_epsilon: float = TORCH_EPS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        h = nn.LayerNorm(epsilon=self.ln_epsilon, use_fast_variance=False, name="ln")(x)
        h = nn.gelu(nn.Dense(self.width, name="fc1")(h), approximate=False)
        return x + nn.Dense(self.width, name="fc2")(h)


class MLP(nn.Module):
    width: int = WIDTH
    classes: int = CLASSES
    first_ln_epsilon: float = TORCH_EPS

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        x = nn.Dense(self.width, name="proj_in")(x)
        for i in range(BLOCKS):
            x = Block(self.width, self.first_ln_epsilon if i == 0 else TORCH_EPS,
                      name=f"blocks_{i}")(x)
        x = nn.LayerNorm(epsilon=TORCH_EPS, use_fast_variance=False, name="ln_f")(x)
        return nn.Dense(self.classes, name="head")(x)


def _port(model: MLP, name: str) -> Case:
    x, y = (t.numpy() for t in _data())
    variables = model.init(jax.random.key(SEED), x)

    def loss(logits: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    return Case(model=model, params=variables, inputs=(x,), loss_fn=loss,
                optimizer=optax.sgd(0.1, momentum=0.9), seed=SEED,
                name=f"tests.flax_linen_cases:{name}")


def port() -> Case:
    return _port(MLP(), "port")


def bug_layernorm_eps() -> Case:
    return _port(MLP(first_ln_epsilon=1e-6), "bug_layernorm_eps")  # BUG: Linen's default


def as_numpy(tree: dict) -> dict:
    return jax.tree.map(np.asarray, tree)


# ---- a tied head: tests.replay_alone_cases:gpt (torch, ``x @ self.tok.weight.T`` in its
# root) ported to Linen as Linen ties one, ``tok.attend(x)`` in the root's own code

class TiedBlock(nn.Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        from tests.replay_alone_cases import DIM

        return x + jax.numpy.tanh(nn.Dense(DIM, name="fc")(x))


class TiedGPT(nn.Module):
    @nn.compact
    def __call__(self, idx: jax.Array) -> jax.Array:
        from tests.replay_alone_cases import DIM, VOCAB

        tok = nn.Embed(VOCAB, DIM, name="tok")
        x = TiedBlock(name="block")(tok(idx))
        x = nn.LayerNorm(epsilon=TORCH_EPS, use_fast_variance=False, name="norm")(x)
        return tok.attend(x)


def tied_gpt() -> Case:
    from tests.replay_alone_cases import VOCAB, _tokens

    tokens = _tokens().numpy()
    targets = np.asarray(torch.randint(0, VOCAB, tokens.shape,
                                       generator=torch.Generator().manual_seed(4)))
    model = TiedGPT()
    return Case(model=model, params=model.init(jax.random.key(SEED), tokens), inputs=(tokens,),
                loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
                    logits, targets).mean(), seed=SEED, name="tests.flax_linen_cases:tied_gpt")
