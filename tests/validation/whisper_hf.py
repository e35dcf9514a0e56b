"""The reference of the encoder-decoder validation pair: transformers' own
``WhisperForConditionalGeneration`` (a tiny random config, eager attention), unedited.

Its weights are re-drawn at a trained model's scale: Hugging Face's std 0.02 leaves every
activation so small that a planted bug hides inside float32's absolute tolerance.
"""

from __future__ import annotations

import torch
from torch import nn

from layerdiff import seed_everything

D_MODEL, HEADS, ENC_LAYERS, DEC_LAYERS, N_MELS, N_AUDIO_CTX, N_TEXT_CTX, VOCAB = (
    32, 2, 2, 2, 8, 8, 12, 48)
SEED = 0


def build_reference() -> nn.Module:
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    config = WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=N_MELS, d_model=D_MODEL,
        encoder_layers=ENC_LAYERS, decoder_layers=DEC_LAYERS,
        encoder_attention_heads=HEADS, decoder_attention_heads=HEADS,
        encoder_ffn_dim=4 * D_MODEL, decoder_ffn_dim=4 * D_MODEL,
        max_source_positions=N_AUDIO_CTX, max_target_positions=N_TEXT_CTX,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    config._attn_implementation = "eager"
    seed_everything(SEED)
    model = WhisperForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if not param.requires_grad:  # the encoder's sinusoidal table stays as built
                continue
            if param.dim() >= 2:
                param.normal_(0.0, param[0].numel() ** -0.5)
            elif "layer_norm" in name and name.endswith("weight"):
                param.normal_(1.0, 0.1)
            else:
                param.normal_(0.0, 0.1)
    model.eval()  # dropout is 0 anyway; eval keeps HF from any training-only path
    return model
