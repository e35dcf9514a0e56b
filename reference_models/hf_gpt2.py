"""Hugging Face's ``GPT2LMHeadModel`` (transformers 5.x, eager attention) as a reference case.

A tiny random config built in code, no download: 2 layers, n_embd 32, 4 heads, vocab 64, 16
positions, dropout off, tied embeddings. It is the configuration of ``tests/gpt_cases.py``, and
the batch is drawn the way ``gpt_cases`` draws it (same seed, same tokens, same next-token
loss), so ``tests.gpt_cases:port`` (a nanoGPT-style port) and its planted bugs are ports of it.
``reference_models/hf_gpt2.map.toml`` maps the two with renames and the Conv1D transposes only.
transformers is imported inside the case functions, so this module imports without it::

    layerdiff capture reference_models.hf_gpt2:reference -o gpt2.h5 --loss-scale 1048576
    layerdiff capture tests.gpt_cases:port_bug_attn_scale -o port.h5 \\
        --weights-from gpt2.h5 --map reference_models/hf_gpt2.map.toml
    layerdiff diff gpt2.h5 port.h5 --map reference_models/hf_gpt2.map.toml

What transformers 5.x does that a nanoGPT port does not: every block is called as
``block(hidden_states, past_key_values, causal_mask, encoder_hidden_states, use_cache=...,
position_ids=...)`` with a 4-D additive float mask; the eager attention returns
``(output, attn_weights)`` whether asked or not; the model returns a ``ModelOutput`` holding
``logits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from layerdiff import Case, seed_everything

from .hf_llama import require_transformers

SEED = 0


@dataclass(frozen=True)
class TinyGPT2:
    """``tests.gpt_cases.GPTConfig``'s numbers."""

    vocab: int = 64
    n_positions: int = 16
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    batch: int = 4


CONFIG = TinyGPT2()


def hf_config(attn_implementation: str = "eager", cfg: TinyGPT2 = CONFIG) -> Any:
    return require_transformers().GPT2Config(
        vocab_size=cfg.vocab, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
        n_layer=cfg.n_layer, n_head=cfg.n_head, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
        bos_token_id=0, eos_token_id=0,  # inside the tiny vocabulary
        tie_word_embeddings=True, use_cache=False, attn_implementation=attn_implementation,
        dtype="float32")


def _case(attn_implementation: str, name: str) -> Case:
    transformers = require_transformers()
    cfg = CONFIG
    seed_everything(SEED)
    # drawn before the model, as tests.gpt_cases._build draws them: the same batch
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.n_positions + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = transformers.GPT2LMHeadModel(hf_config(attn_implementation)).float().train()

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Case(model=model, inputs={"input_ids": inputs}, loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name)


def reference() -> Case:
    """HF GPT2LMHeadModel, eager attention: 2 layers, n_embd 32, 4 heads, vocab 64, batch 4 x 16."""
    return _case("eager", "reference_models.hf_gpt2:reference")


def reference_sdpa() -> Case:
    """As ``reference`` with SDPA attention (the attention returns no weights)."""
    return _case("sdpa", "reference_models.hf_gpt2:reference_sdpa")
