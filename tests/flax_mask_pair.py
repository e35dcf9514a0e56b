"""A tiny torch reference whose attention takes an additive float mask ``(B, 1, T, T)`` (0 where
a query may look, a large negative number where not: Hugging Face's layout), and a Flax NNX port
whose attention takes a boolean one ``(B, T, T)`` (True where it may look). No renaming turns
one into the other: the mapping names a call adapter (``mask_pair.map.toml`` beside this file).

Both attentions return ``(output, weights)``, the port's weights None (Hugging Face's eager
attention returns them; a port seldom keeps them). Cases: ``reference`` (torch), ``port`` (the
faithful Flax port), ``bug_scale`` (the port's attention scores scaled by ``1/head_dim``
instead of ``1/sqrt(head_dim)``). Adapters: the JAX one the mapping names, and the same
written with numpy and with torch, each returning the arrays of its own library.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from torch import nn
from torch.nn import functional as F

from layerdiff import Case

B, T, D, HEADS, CLASSES = 3, 6, 16, 2, 4
LENGTHS = (6, 4, 5)   # padded at the end: every query still sees key 0


def _inputs() -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((B, T, D)).astype(np.float32)
    pad = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]     # (B, T) True = a real token
    labels = rng.integers(0, CLASSES, size=(B,))
    return x, pad, labels


# ---- the torch reference

class TorchAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.out = nn.Linear(D, D)

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        b, t, d = hidden_states.shape
        q, k, v = self.qkv(hidden_states).split(d, dim=-1)
        q, k, v = (z.view(b, t, HEADS, d // HEADS).transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(-1, -2) / math.sqrt(d // HEADS) + attention_mask
        weights = scores.softmax(-1)
        y = (weights @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(y), weights          # Hugging Face's eager attention returns both


class TorchModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.attn = TorchAttention()
        self.head = nn.Linear(D, CLASSES)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None] & pad[:, None, :]
        mask = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        h = x + self.attn(self.ln(x), mask[:, None])[0]         # (B, 1, T, T) additive
        return self.head(h.mean(1))


def reference() -> Case:
    torch.manual_seed(0)
    x, pad, labels = _inputs()
    target = torch.from_numpy(labels)
    return Case(model=TorchModel(), inputs=(torch.from_numpy(x), torch.from_numpy(pad)),
                loss_fn=lambda out: F.cross_entropy(out, target), name="mask-reference")


# ---- the Flax port

class Attention(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, *, scale_bug: bool = False) -> None:
        self.qkv = nnx.Linear(D, 3 * D, rngs=rngs)
        self.out = nnx.Linear(D, D, rngs=rngs)
        self.scale_bug = scale_bug

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        b, t, d = x.shape
        q, k, v = jnp.split(self.qkv(x), 3, axis=-1)
        q, k, v = (z.reshape(b, t, HEADS, d // HEADS).transpose(0, 2, 1, 3) for z in (q, k, v))
        scale = (d // HEADS) if self.scale_bug else math.sqrt(d // HEADS)
        scores = q @ k.transpose(0, 1, 3, 2) / scale
        scores = jnp.where(mask[:, None], scores, jnp.finfo(scores.dtype).min)
        y = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return self.out(y), None             # the weights are not kept


class Model(nnx.Module):
    def __init__(self, *, scale_bug: bool = False) -> None:
        rngs = nnx.Rngs(0)
        self.ln = nnx.LayerNorm(D, epsilon=1e-5, use_fast_variance=False, rngs=rngs)
        self.attn = Attention(rngs, scale_bug=scale_bug)
        self.head = nnx.Linear(D, CLASSES, rngs=rngs)

    def __call__(self, x: jax.Array, pad: jax.Array) -> jax.Array:
        mask = jnp.tril(jnp.ones((T, T), dtype=bool))[None] & pad[:, None, :]   # (B, T, T)
        h = x + self.attn(self.ln(x), mask)[0]
        return self.head(h.mean(1))


def _port(name: str, **slips: bool) -> Case:
    x, pad, labels = _inputs()
    return Case(model=Model(**slips), inputs=(x, pad),
                loss_fn=lambda out: optax.softmax_cross_entropy_with_integer_labels(
                    out, jnp.asarray(labels)).mean(), name=name)


def port() -> Case:
    return _port("mask-port")


def bug_scale() -> Case:
    return _port("mask-port-bug-scale", scale_bug=True)


# ---- call adapters: the reference's (hidden_states, attention_mask) -> the port's (x, mask)

def mask_call(hidden_states, attention_mask):
    """JAX: the additive mask's 0 entries are the allowed ones; (B, 1, T, T) -> (B, T, T)."""
    return (hidden_states, jnp.asarray(attention_mask)[:, 0] == 0), {}


def mask_call_numpy(hidden_states, attention_mask):
    """The same with numpy (it needs concrete values: the replay runs it on the recorded
    ones), returning a numpy boolean array."""
    return (hidden_states, np.asarray(attention_mask)[:, 0] == 0), {}


def mask_call_torch(hidden_states, attention_mask):
    """The same with torch, returning a torch boolean tensor."""
    mask = torch.from_numpy(np.array(attention_mask))
    return (hidden_states, mask[:, 0] == 0), {}


# ---- a conversion function that fits the shapes and loads the wrong layout (for map-check)

def flip_rows(weight):
    """torch -> torch, as every conversion: the rows reversed (a wrong head order)."""
    return weight.flip(0)
