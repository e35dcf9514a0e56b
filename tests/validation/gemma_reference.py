"""The reference of the Gemma validation pair: transformers' own ``GemmaForCausalLM``, a tiny
random config (hidden 32, 2 layers, 2 heads, 1 kv head, head_dim 16, vocab 64), eager
attention, with its weights re-drawn at a trained model's scale (HF's std 0.02 keeps every
activation so small that float32's absolute tolerance hides real bugs).

Gemma's RMSNorm multiplies by ``(1 + weight)``: its weights are offsets, drawn small.
"""

from __future__ import annotations

import numpy as np
import torch

VOCAB = 64
HIDDEN = 32
LAYERS = 2
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 16
FFN = 64
SEQ = 8
BATCH = 2
SEED = 0


def token_batch() -> np.ndarray:
    """Token ids (BATCH, SEQ): the same on both sides; labels are the ids themselves (HF shifts)."""
    return np.random.default_rng(SEED).integers(0, VOCAB, size=(BATCH, SEQ)).astype(np.int64)


def build_reference() -> torch.nn.Module:
    """``GemmaForCausalLM`` in float32, train mode, weights at a trained model's scale."""
    from transformers import GemmaConfig, GemmaForCausalLM

    config = GemmaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN,
                         num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                         num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                         max_position_embeddings=64, attention_dropout=0.0,
                         pad_token_id=0, bos_token_id=2, eos_token_id=1)
    config._attn_implementation = "eager"
    torch.manual_seed(SEED)
    model = GemmaForCausalLM(config).float().train()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            else:   # the RMSNorms' (1 + w) offsets
                param.normal_(0.0, 0.1)
    return model
