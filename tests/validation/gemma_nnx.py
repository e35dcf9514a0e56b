"""An independent Flax NNX Gemma (v1), written the way google-deepmind's ``gemma`` library
writes its NNX transformer (``transformer.py``, ``modules.py``, ``layers.py``,
``positional_embeddings.py``): its names, parameter layouts and call conventions, not Hugging
Face's.

- ``Transformer`` holds ``embedder``, ``layers`` (a list of ``Block``) and ``final_norm``; its
  call takes ``(last_tokens, positions, cache, attention_mask)`` and returns ``(logits, cache)``.
- ``Embedder`` keeps ``input_embedding`` (vocab, dim); ``encode`` scales by sqrt(dim) and
  ``decode`` attends with the same table (the tied head). Both are methods the root calls.
- ``Attention`` projects through ``Einsum`` modules: ``q_einsum`` (heads, dim, head_dim),
  ``kv_einsum`` (2, kv_heads, dim, head_dim), ``attn_vec_einsum`` (heads, head_dim, dim); each
  is called with its equation first, and q is (B, T, N, H). RoPE is split-half; grouped-query
  attention by reshaping q into (kv_heads, groups). Blocks and attention return
  ``(cache, output)``.
- ``RMSNorm`` keeps ``scale`` and multiplies by ``(1 + scale)``.
- ``FeedForward`` keeps ``gating_einsum`` (2, dim, ffn) and ``linear`` (ffn, dim) as its own
  parameters, with a tanh-GELU gate.

``Slips`` plants one bug at one place (all off: the faithful port).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx

K_MASK = -2.3819763e38   # the gemma library's large negative logit for masked positions


@dataclasses.dataclass(frozen=True)
class TransformerConfig:
    num_embed: int
    embed_dim: int
    hidden_dim: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    max_wavelength: int = 10_000


@dataclasses.dataclass(frozen=True)
class Slips:
    """One planted bug each; a site is named by the layer it sits in."""

    norm_without_offset: str | None = None   # e.g. "layers.0.pre_ffw_norm": normed * scale
    embed_unscaled: bool = False              # encode() without the sqrt(dim) factor
    rope_reversed_layer: int | None = None    # RoPE rotating the other way in this layer
    gelu_erf_layer: int | None = None         # exact (erf) GELU in this layer's FeedForward
    norm_wrong_grad: str | None = None        # an RMSNorm whose backward drops d(rsqrt)/dx
    softcap_layer: int | None = None          # attention logits soft-capped at 50 in this layer


# ---------------------------------------------------------------- layers.py

class Einsum(nnx.Module):
    """A parameterised einsum: the equation comes with the call."""

    def __init__(self, shape: tuple[int, ...], *, rngs: nnx.Rngs) -> None:
        self.w = nnx.Param(nnx.initializers.normal()(rngs.params(), shape))

    def __call__(self, eqn: str, x: jax.Array) -> jax.Array:
        return jnp.einsum(eqn, x, self.w.value)


def _rms(x: jax.Array) -> jax.Array:
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(var + 1e-06)


@jax.custom_vjp
def _rms_wrong_grad(x: jax.Array) -> jax.Array:
    return _rms(x)


def _rms_wrong_fwd(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _rms(x), x


def _rms_wrong_bwd(x: jax.Array, g: jax.Array) -> tuple[jax.Array]:
    # the normalizing factor treated as a constant: its own derivative is dropped
    var = jnp.mean(jnp.square(x), axis=-1, keepdims=True)
    return (g * jax.lax.rsqrt(var + 1e-06),)


_rms_wrong_grad.defvjp(_rms_wrong_fwd, _rms_wrong_bwd)


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs, offset: bool = True,
                 wrong_grad: bool = False) -> None:
        self.scale = nnx.Param(nnx.initializers.zeros_init()(rngs.params(), (dim,)))
        self.offset = offset
        self.wrong_grad = wrong_grad

    def __call__(self, x: jax.Array) -> jax.Array:
        normed = _rms_wrong_grad(x) if self.wrong_grad else _rms(x)
        scale = jnp.expand_dims(self.scale.value, axis=range(len(x.shape) - 1))
        return normed * (1 + scale) if self.offset else normed * scale


# ---------------------------------------------------------------- positional_embeddings.py

def apply_rope(inputs: jax.Array, positions: jax.Array, head_dim: int,
               max_wavelength: int = 10_000, reverse: bool = False) -> jax.Array:
    """Split-half rotary embedding of (B, T, N, H) inputs at positions (B, T)."""
    fraction = 2 * jnp.arange(0, head_dim // 2) / head_dim
    timescale = max_wavelength**fraction
    sinusoid_inp = positions[..., jnp.newaxis] / timescale[jnp.newaxis, jnp.newaxis, :]
    sinusoid_inp = sinusoid_inp[..., jnp.newaxis, :]
    sin = jnp.sin(sinusoid_inp)
    cos = jnp.cos(sinusoid_inp)
    if reverse:
        sin = -sin
    first_half, second_half = jnp.split(inputs, 2, axis=-1)
    first_part = first_half * cos - second_half * sin
    second_part = second_half * cos + first_half * sin
    return jnp.concatenate([first_part, second_part], axis=-1).astype(inputs.dtype)


# ---------------------------------------------------------------- modules.py

class Embedder(nnx.Module):
    def __init__(self, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs,
                 scaled: bool = True) -> None:
        self.input_embedding = nnx.Param(
            nnx.initializers.normal()(rngs.params(), (vocab_size, embed_dim)))
        self.embed_dim = embed_dim
        self.scaled = scaled

    def encode(self, x: jax.Array) -> jax.Array:
        x = self.input_embedding.value[(x,)]
        if self.scaled:
            x *= jnp.sqrt(self.embed_dim).astype(x.dtype)
        return x

    def decode(self, x: jax.Array) -> jax.Array:
        return jnp.dot(x, self.input_embedding.value.T)


class Attention(nnx.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, features: int, head_dim: int, *,
                 rngs: nnx.Rngs, max_wavelength: int = 10_000, rope_reversed: bool = False,
                 attn_logits_soft_cap: float | None = None) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.query_pre_attn_scalar = head_dim**-0.5
        self.max_wavelength = max_wavelength
        self.rope_reversed = rope_reversed
        self.attn_logits_soft_cap = attn_logits_soft_cap
        self.q_einsum = Einsum((num_heads, features, head_dim), rngs=rngs)
        self.kv_einsum = Einsum((2, num_kv_heads, features, head_dim), rngs=rngs)
        self.attn_vec_einsum = Einsum((num_heads, head_dim, features), rngs=rngs)

    @property
    def use_gqa(self) -> bool:
        return self.num_kv_heads != self.num_heads

    def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: dict | None,
                 attn_mask: jax.Array) -> tuple[dict | None, jax.Array]:
        query_proj = self.q_einsum("BTD,NDH->BTNH", x)
        key_proj, value_proj = self.kv_einsum("BSD,CKDH->CBSKH", x)

        query_proj = apply_rope(query_proj, segment_pos, self.head_dim, self.max_wavelength,
                                reverse=self.rope_reversed)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos, self.head_dim, self.max_wavelength,
                              reverse=self.rope_reversed)

        if self.use_gqa:
            b, t, kg, h = query_scaled.shape
            query_scaled = query_scaled.reshape(
                (b, t, self.num_kv_heads, int(kg / self.num_kv_heads), h))
            logits = jnp.einsum("BTKGH,BSKH->BTKGS", query_scaled, key_proj)
            b, t, k, g, s = logits.shape
            logits = logits.reshape((b, t, k * g, s))
        else:
            logits = jnp.einsum("BTNH,BSNH->BTNS", query_scaled, key_proj)

        if self.attn_logits_soft_cap is not None:
            logits = jnp.tanh(logits / self.attn_logits_soft_cap)
            logits = logits * self.attn_logits_soft_cap

        padded_logits = jnp.where(jnp.expand_dims(attn_mask, -2), logits, K_MASK)
        probs = jax.nn.softmax(padded_logits, axis=-1).astype(key_proj.dtype)

        if self.use_gqa:
            b, t, kg, h = probs.shape
            probs = probs.reshape((b, t, self.num_kv_heads, int(kg / self.num_kv_heads), h))
            encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, value_proj)
            b, t, k, g, h = encoded.shape
            encoded = encoded.reshape((b, t, k * g, h))
        else:
            encoded = jnp.einsum("BTNS,BSNH->BTNH", probs, value_proj)

        attn_output = self.attn_vec_einsum("BTNH,NHD->BTD", encoded)
        return cache, attn_output


class FeedForward(nnx.Module):
    def __init__(self, features: int, hidden_dim: int, *, rngs: nnx.Rngs,
                 gelu_erf: bool = False) -> None:
        self.gating_einsum = nnx.Param(
            nnx.initializers.normal()(rngs.params(), (2, features, hidden_dim)))
        self.linear = nnx.Param(nnx.initializers.normal()(rngs.params(), (hidden_dim, features)))
        self.gelu_erf = gelu_erf

    def __call__(self, x: jax.Array) -> jax.Array:
        ff_gate = jnp.dot(x, self.gating_einsum.value[0])
        gate_value = nnx.gelu(ff_gate, approximate=not self.gelu_erf)
        ff1 = jnp.dot(x, self.gating_einsum.value[1])
        activations = gate_value * ff1
        return jnp.dot(activations, self.linear.value)


class Block(nnx.Module):
    def __init__(self, config: TransformerConfig, index: int, slips: Slips, *,
                 rngs: nnx.Rngs) -> None:
        def norm(name: str) -> RMSNorm:
            where = f"layers.{index}.{name}"
            return RMSNorm(config.embed_dim, rngs=rngs,
                           offset=slips.norm_without_offset != where,
                           wrong_grad=slips.norm_wrong_grad == where)

        self.pre_attention_norm = norm("pre_attention_norm")
        self.attn = Attention(config.num_heads, config.num_kv_heads, config.embed_dim,
                              config.head_dim, rngs=rngs, max_wavelength=config.max_wavelength,
                              rope_reversed=slips.rope_reversed_layer == index,
                              attn_logits_soft_cap=50.0 if slips.softcap_layer == index else None)
        self.pre_ffw_norm = norm("pre_ffw_norm")
        self.mlp = FeedForward(config.embed_dim, config.hidden_dim, rngs=rngs,
                               gelu_erf=slips.gelu_erf_layer == index)

    def __call__(self, x: jax.Array, segment_pos: jax.Array, cache: dict | None,
                 attn_mask: jax.Array) -> tuple[dict | None, jax.Array]:
        inputs_normalized = self.pre_attention_norm(x)
        cache, attn_output = self.attn(inputs_normalized, segment_pos, cache, attn_mask)
        attn_output += x
        outputs = self.pre_ffw_norm(attn_output)
        outputs = self.mlp(outputs)
        outputs += attn_output
        return cache, outputs


# ---------------------------------------------------------------- transformer.py

class Transformer(nnx.Module):
    def __init__(self, config: TransformerConfig, slips: Slips = Slips(), *,
                 rngs: nnx.Rngs) -> None:
        self.embedder = Embedder(config.num_embed, config.embed_dim, rngs=rngs,
                                 scaled=not slips.embed_unscaled)
        self.layers = nnx.List([Block(config, i, slips, rngs=rngs)
                                for i in range(config.num_layers)])
        self.final_norm = RMSNorm(config.embed_dim, rngs=rngs,
                                  offset=slips.norm_without_offset != "final_norm",
                                  wrong_grad=slips.norm_wrong_grad == "final_norm")

    def __call__(self, last_tokens: jax.Array, positions: jax.Array, cache: dict | None,
                 attention_mask: jax.Array) -> tuple[jax.Array, dict | None]:
        new_cache = None if cache is None else {}
        x = self.embedder.encode(last_tokens)
        for i, layer in enumerate(self.layers):
            layer_cache = cache[f"layer_{i}"] if cache else None
            layer_cache, x = layer(x, positions, layer_cache, attention_mask)
            if cache is not None:
                new_cache[f"layer_{i}"] = layer_cache
        x = self.final_norm(x)
        logits = self.embedder.decode(x)
        return logits, new_cache


def causal_attention_mask(batch: int, seq: int) -> jax.Array:
    """(B, T, S) booleans: True where position t may attend to s (s <= t)."""
    return jnp.broadcast_to(jnp.tril(jnp.ones((seq, seq), dtype=bool)), (batch, seq, seq))

