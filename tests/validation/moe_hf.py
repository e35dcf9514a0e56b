"""The reference of the mixture-of-experts validation pair: transformers' own
``MixtralForCausalLM`` (5.x: its ``MixtralExperts`` keeps the experts stacked, ``gate_up_proj``
(E, 2I, D) and ``down_proj`` (E, D, I)), from a tiny random config, its weights drawn at a
trained model's scale (HF's std 0.02 would hide bugs below float32's atol)."""

from __future__ import annotations

import torch

from layerdiff import seed_everything

SEED = 0
VOCAB, DIM, FFN, LAYERS, HEADS, KV_HEADS, EXPERTS, TOP_K, MAX_POS = 64, 32, 48, 2, 2, 1, 4, 2, 64
EPS = 1e-5


def mixtral():
    """A ``MixtralForCausalLM``, eager attention and eager experts (5.x picks ``grouped_mm``
    for the experts by default; eager runs the per-expert loop its modeling file shows), no
    router aux loss (``output_router_logits`` stays False)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    config = MixtralConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=FFN,
                           num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                           num_key_value_heads=KV_HEADS, num_local_experts=EXPERTS,
                           num_experts_per_tok=TOP_K, max_position_embeddings=MAX_POS,
                           rms_norm_eps=EPS, rope_parameters={"rope_theta": 10000.0,
                                                              "rope_type": "default"},
                           tie_word_embeddings=False, attention_dropout=0.0)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    seed_everything(SEED)
    model = MixtralForCausalLM(config)
    with torch.no_grad():  # a trained model's scale: fan-in scaled matrices, norms near 1
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0.0, param.shape[-1] ** -0.5)
            else:
                param.normal_(1.0, 0.1)
    return model
