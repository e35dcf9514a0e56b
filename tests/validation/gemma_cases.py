"""Cases of the Gemma validation pair: transformers' ``GemmaForCausalLM`` (the reference, its
own loss with labels) against the gemma-library-style Flax NNX port in ``gemma_nnx.py``, the
faithful port and one case per planted slip."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import torch

from layerdiff import Case
from tests.validation import gemma_nnx as nnx_gemma
from tests.validation.gemma_reference import (
    BATCH,
    FFN,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    SEED,
    SEQ,
    VOCAB,
    build_reference,
    token_batch,
)

MODULE = "tests.validation.gemma_cases"
LR = 0.1


def reference() -> Case:
    """HF GemmaForCausalLM; the loss is the model's own (labels = the tokens, shifted inside)."""
    ids = torch.from_numpy(token_batch())
    return Case(model=build_reference(), inputs={"input_ids": ids, "labels": ids},
                loss_fn=lambda output: output.loss, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                name=f"{MODULE}:reference")


def _port(name: str, slips: nnx_gemma.Slips | None = None) -> Case:
    from flax import nnx

    slips = slips or nnx_gemma.Slips()

    config = nnx_gemma.TransformerConfig(num_embed=VOCAB, embed_dim=HIDDEN, hidden_dim=FFN,
                                         num_heads=HEADS, num_kv_heads=KV_HEADS,
                                         head_dim=HEAD_DIM, num_layers=LAYERS)
    ids = token_batch()
    targets = jnp.asarray(ids[:, 1:], dtype=jnp.int32)
    positions = np.broadcast_to(np.arange(SEQ), (BATCH, SEQ)).copy()
    mask = np.asarray(nnx_gemma.causal_attention_mask(BATCH, SEQ))

    def loss_fn(output: Any) -> jax.Array:   # HF's causal-LM loss: next token, mean
        logits = output[0]
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], targets).mean()

    model = nnx_gemma.Transformer(config, slips, rngs=nnx.Rngs(SEED))
    return Case(model=model,
                inputs={"last_tokens": ids, "positions": positions, "cache": None,
                        "attention_mask": mask},
                loss_fn=loss_fn, seed=SEED, steps=1, optimizer=optax.sgd(LR),
                name=f"{MODULE}:{name}")


def port() -> Case:
    """The faithful port."""
    return _port("port")


# ---------------------------------------------------------------- the mapping's code

def q_kernel(w: torch.Tensor) -> torch.Tensor:
    """HF q_proj.weight (N*H, D) -> q_einsum.w (N, D, H)."""
    return w.reshape(HEADS, HEAD_DIM, HIDDEN).permute(0, 2, 1)


def kv_kernel(w: torch.Tensor) -> torch.Tensor:
    """[k_proj.weight; v_proj.weight] (2*K*H, D) -> kv_einsum.w (2, K, D, H)."""
    return w.reshape(2, KV_HEADS, HEAD_DIM, HIDDEN).permute(0, 1, 3, 2)


def out_kernel(w: torch.Tensor) -> torch.Tensor:
    """o_proj.weight transposed (N*H, D) -> attn_vec_einsum.w (N, H, D)."""
    return w.reshape(HEADS, HEAD_DIM, HIDDEN)


def gating_kernel(w: torch.Tensor) -> torch.Tensor:
    """[gate_proj.weight; up_proj.weight] (2*F, D) -> gating_einsum (2, D, F)."""
    return w.reshape(2, FFN, HIDDEN).permute(0, 2, 1)


def _positions(position_ids: Any, batch: int, seq: int) -> jax.Array:
    return jnp.broadcast_to(jnp.asarray(position_ids), (batch, seq))


def _allowed(additive_mask: Any) -> jax.Array:
    """HF's additive (B, 1, T, S) mask, 0 where allowed -> the port's boolean (B, T, S)."""
    return jnp.asarray(additive_mask)[:, 0] == 0


def block_call(hidden_states: Any, attention_mask: Any = None, position_ids: Any = None,
               **_: Any) -> tuple[tuple, dict]:
    """GemmaDecoderLayer(hidden_states, attention_mask=, position_ids=, ...) ->
    Block(x, segment_pos, cache, attn_mask)."""
    b, t = hidden_states.shape[:2]
    return (hidden_states, _positions(position_ids, b, t), None, _allowed(attention_mask)), {}


def attention_call(hidden_states: Any = None, position_embeddings: Any = None,
                   attention_mask: Any = None, position_ids: Any = None,
                   **_: Any) -> tuple[tuple, dict]:
    """GemmaAttention(hidden_states=, attention_mask=, position_ids=, ...) ->
    Attention(x, segment_pos, cache, attn_mask)."""
    b, t = hidden_states.shape[:2]
    return (hidden_states, _positions(position_ids, b, t), None, _allowed(attention_mask)), {}


def root_call(input_ids: Any = None, labels: Any = None, **_: Any) -> tuple[tuple, dict]:
    """GemmaForCausalLM(input_ids=, labels=) -> Transformer(last_tokens, positions, cache,
    attention_mask): positions 0..T-1 and the causal mask, as the port's case builds them."""
    b, t = input_ids.shape
    return (input_ids, _positions(jnp.arange(t), b, t), None,
            nnx_gemma.causal_attention_mask(b, t)), {}


def q_call(x: Any) -> tuple[tuple, dict]:
    """q_proj(x) -> q_einsum(equation, x)."""
    return ("BTD,NDH->BTNH", x), {}


def out_call(x: Any) -> tuple[tuple, dict]:
    """o_proj(x (B, T, N*H)) -> attn_vec_einsum(equation, x (B, T, N, H))."""
    b, t = x.shape[:2]
    return ("BTNH,NHD->BTD", jnp.reshape(x, (b, t, HEADS, HEAD_DIM))), {}


# ---------------------------------------------------------------- one planted slip per case

def bug_norm_offset() -> Case:
    """layers.0.pre_ffw_norm multiplies by scale, not (1 + scale)."""
    return _port("bug_norm_offset", nnx_gemma.Slips(norm_without_offset="layers.0.pre_ffw_norm"))


def bug_embed_unscaled() -> Case:
    """Embedder.encode without the sqrt(dim) factor (called from the root)."""
    return _port("bug_embed_unscaled", nnx_gemma.Slips(embed_unscaled=True))


def bug_rope_reversed() -> Case:
    """RoPE rotating the other way in layer 1's attention."""
    return _port("bug_rope_reversed", nnx_gemma.Slips(rope_reversed_layer=1))


def bug_gelu_erf() -> Case:
    """The exact (erf) GELU in layer 0's FeedForward, where Gemma's is tanh."""
    return _port("bug_gelu_erf", nnx_gemma.Slips(gelu_erf_layer=0))


def bug_norm_backward() -> Case:
    """layers.1.pre_attention_norm: right forward, a backward that drops d(rsqrt)/dx."""
    return _port("bug_norm_backward",
                 nnx_gemma.Slips(norm_wrong_grad="layers.1.pre_attention_norm"))


def bug_softcap() -> Case:
    """Attention logits soft-capped at 50 (Gemma 2's) in layer 0, where Gemma 1 has none."""
    return _port("bug_softcap", nnx_gemma.Slips(softcap_layer=0))
