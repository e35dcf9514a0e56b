"""Flax NNX ports whose output head reads the token embedding from the root's own code
(``self.tok.attend(x)``, no call of ``tok``), against torch references whose head is the same
weight (tests/test_replay_alone_flax.py).

The tiny pair: ``tests.replay_alone_cases:gpt`` (torch, ``x @ self.tok.weight.T`` in its
root) and :class:`TinyGPT` here, its port, with the same module names. Planted bugs, one per
case, both in the embedding's own lookup (its ``__call__``; the head is right):
``bug_lookup`` scales the looked-up rows by 1.01, ``bug_lookup_grad`` sends 1.01x the right
gradient into the table.

The real pair: Hugging Face's ``GPT2LMHeadModel`` (its ``lm_head`` an ``nn.Linear`` tied to
``wte``) against ``tests.flax_heldout``'s port with its ``LMHead`` module removed and the root
calling ``self.transformer.wte.attend(x)`` itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from layerdiff import Case
from tests import flax_heldout
from tests.replay_alone_cases import DIM, VOCAB, _tokens

MODULE = "tests.flax_tied_cases"


def _targets():
    import torch

    return jnp.asarray(torch.randint(0, VOCAB, (2, 6),
                                     generator=torch.Generator().manual_seed(4)).numpy())


@jax.custom_vjp
def _grad_scaled(table: jax.Array) -> jax.Array:
    return table


_grad_scaled.defvjp(lambda table: (table, None), lambda _, grad: (grad * 1.01,))


class _Embed(nnx.Embed):
    def __init__(self, bug: str, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.bug = bug

    def __call__(self, inputs: jax.Array) -> jax.Array:
        if self.bug == "lookup":  # BUG: the looked-up rows scaled
            return super().__call__(inputs) * 1.01
        if self.bug == "lookup_grad":  # BUG: the lookup's gradient into the table scaled
            return jnp.take(_grad_scaled(self.embedding[...]), inputs, axis=0)
        return super().__call__(inputs)


class _Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(DIM, DIM, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return x + jnp.tanh(self.fc(x))


class TinyGPT(nnx.Module):
    """The head is the token embedding's ``attend``, called from the root's own code."""

    def __init__(self, bug: str = "", *, rngs: nnx.Rngs) -> None:
        self.tok = _Embed(bug, VOCAB, DIM, rngs=rngs)
        self.block = _Block(rngs)
        self.norm = nnx.LayerNorm(DIM, epsilon=1e-5, use_fast_variance=False, rngs=rngs)

    def __call__(self, idx: jax.Array) -> jax.Array:
        return self.tok.attend(self.norm(self.block(self.tok(idx))))


def _gpt(bug: str, name: str) -> Case:
    targets = _targets()
    return Case(model=TinyGPT(bug, rngs=nnx.Rngs(0)), inputs=(_tokens().numpy(),), seed=0,
                loss_fn=lambda logits: optax.softmax_cross_entropy_with_integer_labels(
                    logits, targets).mean(), name=f"{MODULE}:{name}")


def gpt() -> Case:
    return _gpt("", "gpt")


def gpt_bug_lookup() -> Case:
    return _gpt("lookup", "gpt_bug_lookup")


def gpt_bug_lookup_grad() -> Case:
    return _gpt("lookup_grad", "gpt_bug_lookup_grad")


class HeadInRootGPT2(flax_heldout.GPT2LMHeadModel):
    """The held-out GPT-2 port with no lm head module: the root attends with wte itself."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        del self.lm_head

    def __call__(self, input_ids: jax.Array, attention_mask: jax.Array | None = None
                 ) -> jax.Array:
        x = self.transformer(input_ids, attention_mask=attention_mask)
        return self.transformer.wte.attend(x)


def gpt2_head_in_root() -> Case:
    case = flax_heldout.port()
    case.model = HeadInRootGPT2(flax_heldout.CONFIG, rngs=nnx.Rngs(flax_heldout.SEED))
    case.name = f"{MODULE}:gpt2_head_in_root"
    return case
