"""A held-out Flax NNX port of Hugging Face's ``GPT2LMHeadModel``, written the way a porter
would write it from the transformers source, and the same port with classic slips planted.

The reference is ``transformers.GPT2LMHeadModel`` with a tiny random config (2 layers, n_embd
64, 4 heads, vocab 128, 32 positions, dropout 0, ``gelu_new``, tied lm head), eager attention.
The port keeps GPT-2's module names (``transformer.h.0.attn.c_attn``) and takes Flax's parameter
names: ``flax_heldout.map.toml`` sources them. GPT-2's ``Conv1D`` keeps its weight as
``(in, out)``, which is Flax's kernel layout already: no transpose.

The lm head is tied to ``wte`` in GPT-2; the port computes it as ``wte.attend`` would, through
an ``LMHead`` module holding the same ``nnx.Embed`` (a module held under two names), so it is a
site as torch's ``lm_head`` is.

Planted slips, one per case:
- ``bug_layernorm_eps``: ``nnx.LayerNorm``'s default epsilon 1e-6 in every LayerNorm;
- ``bug_gelu_erf``: the exact (erf) GELU where GPT-2's ``gelu_new`` is the tanh one;
- ``bug_attn_scale``: attention scores scaled by 1/head_dim instead of 1/sqrt(head_dim);
- ``bug_no_causal_mask``: the causal mask left out;
- ``bug_gelu_backward``: a ``jax.custom_vjp`` tanh GELU whose derivative leaves out the tanh
  term's own derivative (forward right, backward wrong).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch
from flax import nnx
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from reference_models.hf_gpt2 import TinyGPT2, hf_config
from reference_models.hf_llama import require_transformers

MODULE = "tests.flax_heldout"
SEED = 0
CONFIG = TinyGPT2(vocab=128, n_positions=32, n_embd=64, n_head=4, n_layer=2, batch=2)
EPS = 1e-5   # GPT2Config.layer_norm_epsilon


def _batch(cfg: TinyGPT2 = CONFIG) -> tuple[np.ndarray, np.ndarray]:
    """Token ids (batch, n_positions) and their next-token targets, the same on both sides."""
    rng = np.random.default_rng(SEED)
    tokens = rng.integers(0, cfg.vocab, size=(cfg.batch, cfg.n_positions + 1))
    return tokens[:, :-1].astype(np.int64), tokens[:, 1:].astype(np.int64)


# ---------------------------------------------------------------- the torch reference

def _padding_mask(cfg: TinyGPT2 = CONFIG) -> np.ndarray:
    """(batch, n_positions) 1/0: the second sequence's last 8 tokens are padding."""
    mask = np.ones((cfg.batch, cfg.n_positions), dtype=np.int64)
    mask[1, -8:] = 0
    return mask


def reference() -> Case:
    """HF GPT2LMHeadModel, eager attention: 2 layers, n_embd 64, 4 heads, vocab 128, 2 x 32."""
    return _reference("reference", masked=False)


def reference_masked() -> Case:
    """As ``reference``, called with an ``attention_mask`` padding the second sequence."""
    return _reference("reference_masked", masked=True)


def _reference(name: str, masked: bool) -> Case:
    transformers = require_transformers()
    seed_everything(SEED)
    inputs, targets = _batch()
    model = transformers.GPT2LMHeadModel(hf_config("eager", CONFIG)).float().train()
    targets_t = torch.from_numpy(targets)

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets_t.reshape(-1))

    feed = {"input_ids": torch.from_numpy(inputs)}
    if masked:
        feed["attention_mask"] = torch.from_numpy(_padding_mask())
    return Case(model=model, inputs=feed, loss_fn=loss_fn,
                seed=SEED, steps=1, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{MODULE}:{name}")


# ---------------------------------------------------------------- the Flax port

@dataclass(frozen=True)
class Slips:
    """Which slips a port makes (all False: the faithful port)."""

    layernorm_default_eps: bool = False
    gelu_erf: bool = False
    attn_scale_1_over_d: bool = False
    no_causal_mask: bool = False
    gelu_backward: bool = False


def gelu_new(x: jax.Array) -> jax.Array:
    """HF's NewGELUActivation: 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))."""
    return 0.5 * x * (1.0 + jnp.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


@jax.custom_vjp
def gelu_new_wrong_grad(x: jax.Array) -> jax.Array:
    return gelu_new(x)


def _gelu_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return gelu_new(x), x


def _gelu_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # BUG: d/dx [0.5 x (1 + tanh(u))] without the 0.5 x sech^2(u) u' term
    u = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)
    return (g * 0.5 * (1.0 + jnp.tanh(u)),)


gelu_new_wrong_grad.defvjp(_gelu_fwd, _gelu_bwd)


class NewGELU(nnx.Module):
    def __init__(self, slips: Slips) -> None:
        self.slips = slips

    def __call__(self, x: jax.Array) -> jax.Array:
        if self.slips.gelu_erf:
            return jax.nn.gelu(x, approximate=False)   # BUG: GPT-2's gelu_new is the tanh form
        if self.slips.gelu_backward:
            return gelu_new_wrong_grad(x)
        return gelu_new(x)


def _layer_norm(d: int, slips: Slips, rngs: nnx.Rngs) -> nnx.LayerNorm:
    if slips.layernorm_default_eps:
        return nnx.LayerNorm(d, use_fast_variance=False, rngs=rngs)   # BUG: epsilon 1e-6
    return nnx.LayerNorm(d, epsilon=EPS, use_fast_variance=False, rngs=rngs)


class Attention(nnx.Module):
    def __init__(self, cfg: TinyGPT2, slips: Slips, rngs: nnx.Rngs) -> None:
        d = cfg.n_embd
        self.n_head = cfg.n_head
        self.slips = slips
        self.c_attn = nnx.Linear(d, 3 * d, rngs=rngs)
        self.c_proj = nnx.Linear(d, d, rngs=rngs)
        self.attn_dropout = nnx.Dropout(0.0, deterministic=True)
        self.resid_dropout = nnx.Dropout(0.0, deterministic=True)

    def __call__(self, x: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        b, t, d = x.shape
        hd = d // self.n_head
        q, k, v = jnp.split(self.c_attn(x), 3, axis=-1)

        def heads(a: jax.Array) -> jax.Array:
            return a.reshape(b, t, self.n_head, hd).transpose(0, 2, 1, 3)

        q, k, v = heads(q), heads(k), heads(v)
        scale = 1.0 / hd if self.slips.attn_scale_1_over_d else 1.0 / math.sqrt(hd)
        scores = (q @ k.transpose(0, 1, 3, 2)) * scale
        if not self.slips.no_causal_mask:
            causal = jnp.tril(jnp.ones((t, t), dtype=bool))
            scores = jnp.where(causal, scores, jnp.finfo(scores.dtype).min)
        if attention_mask is not None:  # (batch, keys): 1 attends, 0 is padding
            keep = attention_mask[:, None, None, :].astype(bool)
            scores = jnp.where(keep, scores, jnp.finfo(scores.dtype).min)
        probs = self.attn_dropout(jax.nn.softmax(scores, axis=-1))
        out = (probs @ v).transpose(0, 2, 1, 3).reshape(b, t, d)
        return self.resid_dropout(self.c_proj(out))


class MLP(nnx.Module):
    def __init__(self, cfg: TinyGPT2, slips: Slips, rngs: nnx.Rngs) -> None:
        d = cfg.n_embd
        self.c_fc = nnx.Linear(d, 4 * d, rngs=rngs)
        self.c_proj = nnx.Linear(4 * d, d, rngs=rngs)
        self.act = NewGELU(slips)
        self.dropout = nnx.Dropout(0.0, deterministic=True)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.dropout(self.c_proj(self.act(self.c_fc(x))))


class Block(nnx.Module):
    def __init__(self, cfg: TinyGPT2, slips: Slips, rngs: nnx.Rngs) -> None:
        self.ln_1 = _layer_norm(cfg.n_embd, slips, rngs)
        self.attn = Attention(cfg, slips, rngs)
        self.ln_2 = _layer_norm(cfg.n_embd, slips, rngs)
        self.mlp = MLP(cfg, slips, rngs)

    def __call__(self, x: jax.Array, attention_mask: jax.Array | None = None) -> jax.Array:
        x = x + self.attn(self.ln_1(x), attention_mask=attention_mask)
        return x + self.mlp(self.ln_2(x))


class Transformer(nnx.Module):
    def __init__(self, cfg: TinyGPT2, slips: Slips, rngs: nnx.Rngs) -> None:
        self.wte = nnx.Embed(cfg.vocab, cfg.n_embd, rngs=rngs)
        self.wpe = nnx.Embed(cfg.n_positions, cfg.n_embd, rngs=rngs)
        self.drop = nnx.Dropout(0.0, deterministic=True)
        self.h = nnx.List([Block(cfg, slips, rngs) for _ in range(cfg.n_layer)])
        self.ln_f = _layer_norm(cfg.n_embd, slips, rngs)

    def __call__(self, input_ids: jax.Array,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        positions = jnp.arange(input_ids.shape[-1])[None, :]
        x = self.drop(self.wte(input_ids) + self.wpe(positions))
        for block in self.h:
            x = block(x, attention_mask=attention_mask)
        return self.ln_f(x)


class LMHead(nnx.Module):
    """GPT-2's lm_head: tied to wte, so it holds the embedding and attends with it."""

    def __init__(self, wte: nnx.Embed) -> None:
        self.wte = wte

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.wte.attend(x)


class GPT2LMHeadModel(nnx.Module):
    def __init__(self, cfg: TinyGPT2, slips: Slips = Slips(), *, rngs: nnx.Rngs) -> None:
        self.transformer = Transformer(cfg, slips, rngs)
        self.lm_head = LMHead(self.transformer.wte)

    def __call__(self, input_ids: jax.Array,
                 attention_mask: jax.Array | None = None) -> jax.Array:
        return self.lm_head(self.transformer(input_ids, attention_mask=attention_mask))


def _port(slips: Slips, name: str, masked: bool = False) -> Case:
    inputs, targets = _batch()
    targets_j = jnp.asarray(targets, dtype=jnp.int32)

    def loss_fn(logits: jax.Array) -> jax.Array:
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets_j).mean()

    model = GPT2LMHeadModel(CONFIG, slips, rngs=nnx.Rngs(SEED))
    feed = {"input_ids": inputs}
    if masked:
        feed["attention_mask"] = _padding_mask()
    return Case(model=model, inputs=feed, loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=optax.sgd(0.1), name=f"{MODULE}:{name}")


def port() -> Case:
    """The faithful port."""
    return _port(Slips(), "port")


def port_masked() -> Case:
    """The faithful port, called with the padding mask."""
    return _port(Slips(), "port_masked", masked=True)


def bug_layernorm_eps() -> Case:
    return _port(Slips(layernorm_default_eps=True), "bug_layernorm_eps")


def bug_gelu_erf() -> Case:
    return _port(Slips(gelu_erf=True), "bug_gelu_erf")


def bug_attn_scale() -> Case:
    return _port(Slips(attn_scale_1_over_d=True), "bug_attn_scale")


def bug_no_causal_mask() -> Case:
    return _port(Slips(no_causal_mask=True), "bug_no_causal_mask")


def bug_gelu_backward() -> Case:
    return _port(Slips(gelu_backward=True), "bug_gelu_backward")
