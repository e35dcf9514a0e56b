"""Hugging Face's ``LlamaForCausalLM`` as a reference case: a tiny random config built in code.

No download: the config is written here (2 layers, hidden 64, 4 heads over 2 key/value heads, a
vocabulary of 128, tied embeddings), the weights are transformers' own initialization under a
fixed seed, and the loss is next-token cross-entropy on the logits. transformers is imported
inside the case functions, so this module imports without it (``pip install layerdiff[test]``
brings it).

- ``reference``: eager attention (``LlamaAttention`` returns ``(output, attn_weights)``);
- ``reference_sdpa``: the same weights with ``attn_implementation="sdpa"`` (the attention returns
  ``(output, None)``: no weights are recorded).

``reference_models/llama_port.py`` is an independent port of the same model, and
``reference_models/hf_llama.map.toml`` maps the two (see docs/porting-hf.md)::

    layerdiff capture reference_models.hf_llama:reference -o ref.h5 --loss-scale 1048576
    layerdiff capture reference_models.llama_port:port -o port.h5 \\
        --weights-from ref.h5 --map reference_models/hf_llama.map.toml
    layerdiff diff ref.h5 port.h5 --map reference_models/hf_llama.map.toml
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from layerdiff.errors import CaseError

SEED = 0


def require_transformers() -> Any:
    """transformers, or one sentence saying how to get it."""
    try:
        import transformers
    except ImportError:
        raise CaseError("the Hugging Face reference cases need transformers 5.x: "
                        "pip install 'layerdiff[test]' (or transformers>=5,<6)") from None
    return transformers


@dataclass(frozen=True)
class TinyLlama:
    """The one configuration both sides are built from (the port reads it too)."""

    vocab: int = 128
    dim: int = 64
    hidden_dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    batch: int = 4
    seq_len: int = 16

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


CONFIG = TinyLlama()


def make_batch(cfg: TinyLlama = CONFIG) -> tuple[torch.Tensor, torch.Tensor]:
    """(input token ids, next-token targets), each (batch, seq_len), drawn from the seed."""
    generator = torch.Generator().manual_seed(SEED)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.seq_len + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))


def hf_config(attn_implementation: str = "eager", cfg: TinyLlama = CONFIG) -> Any:
    """transformers' ``LlamaConfig`` for :data:`CONFIG`."""
    return require_transformers().LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.dim, intermediate_size=cfg.hidden_dim,
        num_hidden_layers=cfg.n_layers, num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_parameters={"rope_type": "default",
                                                     "rope_theta": cfg.rope_theta},
        tie_word_embeddings=True, use_cache=False, attention_dropout=0.0,
        attn_implementation=attn_implementation, dtype="float32")


def build_model(attn_implementation: str = "eager", cfg: TinyLlama = CONFIG) -> torch.nn.Module:
    """``LlamaForCausalLM`` with transformers' own random initialization under :data:`SEED`."""
    seed_everything(SEED)
    model = require_transformers().LlamaForCausalLM(hf_config(attn_implementation, cfg)).float()
    return model.train()  # dropout is 0: train mode changes nothing but is what capture runs


def _case(attn_implementation: str, name: str) -> Case:
    model = build_model(attn_implementation)
    inputs, targets = make_batch()

    def loss_fn(output: Any) -> torch.Tensor:
        return next_token_loss(output.logits, targets)

    return Case(model=model, inputs={"input_ids": inputs}, loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name)


def reference() -> Case:
    """HF LlamaForCausalLM, eager attention, GQA 4/2 heads, tied embeddings, batch 4 x 16."""
    return _case("eager", "reference_models.hf_llama:reference")


def reference_sdpa() -> Case:
    """As ``reference`` with SDPA attention: same weights, no attention weights returned."""
    return _case("sdpa", "reference_models.hf_llama:reference_sdpa")
