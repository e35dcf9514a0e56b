"""What ``reference_models/hf_llama.map.toml`` names as code: the RoPE row permutation and the
call adapters between Hugging Face's Llama and the Meta-style port (``llama_port.py``).

**Conversion.** Rotary embeddings rotate pairs of a head's dimensions. Meta's layout pairs
neighbours, ``(2i, 2i+1)``; Hugging Face's pairs halves, ``(i, i + head_dim/2)``. Attention scores
are the same either way as long as q and k are laid out alike, so converting checkpoints permutes
the *rows* of ``wq`` and ``wk`` within each head (``convert_llama_weights_to_hf.py``'s ``permute``
goes Meta -> HF). :func:`hf_to_meta_qk` is the way this mapping needs: HF row ``i`` of a head goes
to Meta row ``2i``, row ``i + head_dim/2`` to ``2i+1``. The head count follows from the tensor's
rows, so one function serves ``wq`` (4 heads) and ``wk`` (2 key/value heads). A weight gradient
is permuted the same way (the permutation is linear in the rows).

**Call adapters.** Hugging Face calls ``LlamaAttention`` as ``self_attn(hidden_states=...,
attention_mask=..., position_ids=..., past_key_values=..., use_cache=...,
position_embeddings=(cos, sin))`` with ``cos``/``sin`` of shape ``(B or 1, T, head_dim)`` in the
rotate-half layout (the ``head_dim/2`` frequencies written twice). The port's ``Attention`` takes
``(x, freqs_cos, freqs_sin)`` of shape ``(T, head_dim/2)``. :func:`attention_call` builds the
port's call from the reference's; :func:`block_call` does the same for
``LlamaDecoderLayer(hidden_states, ...)`` -> ``TransformerBlock(x, freqs_cos, freqs_sin)``.
The causal mask is dropped: the port adds its own.
"""

from __future__ import annotations

from typing import Any

import torch

HEAD_DIM = 16  # reference_models.hf_llama.CONFIG.head_dim: 64 / 4 heads


def _check_rows(tensor: torch.Tensor) -> int:
    rows = tensor.shape[0]
    if rows % HEAD_DIM or HEAD_DIM % 2:
        raise ValueError(f"a q/k projection of {rows} rows is not whole heads of {HEAD_DIM}")
    return rows // HEAD_DIM


def hf_to_meta_qk(tensor: torch.Tensor) -> torch.Tensor:
    """HF's q/k projection (rows rotate-half per head) -> Meta's (rows interleaved per head)."""
    heads = _check_rows(tensor)
    rest = tensor.shape[1:]
    return (tensor.reshape(heads, 2, HEAD_DIM // 2, *rest).transpose(1, 2)
            .reshape(tensor.shape))


def meta_to_hf_qk(tensor: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`hf_to_meta_qk` (what convert_llama_weights_to_hf's permute does)."""
    heads = _check_rows(tensor)
    rest = tensor.shape[1:]
    return (tensor.reshape(heads, HEAD_DIM // 2, 2, *rest).transpose(1, 2)
            .reshape(tensor.shape))


def rotary_halves(position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's ``(cos, sin)``, each (B or 1, T, head_dim) with the frequencies written twice ->
    Meta's ``(freqs_cos, freqs_sin)``, each (T, head_dim/2)."""
    if not (isinstance(position_embeddings, (tuple, list)) and len(position_embeddings) == 2):
        raise ValueError("position_embeddings must be (cos, sin) as Hugging Face passes them; "
                         f"got {type(position_embeddings).__name__}")
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    # every batch row holds the same positions here (position_ids = arange): take the first
    return cos[0, :, :half], sin[0, :, :half]


def _hidden_states(args: tuple, kwargs: dict) -> torch.Tensor:
    if "hidden_states" in kwargs:
        return kwargs["hidden_states"]
    if args:
        return args[0]
    raise ValueError("the reference call passed no hidden_states")


def _position_embeddings(args: tuple, kwargs: dict, position: int) -> Any:
    if "position_embeddings" in kwargs:
        return kwargs["position_embeddings"]
    if len(args) > position:
        return args[position]
    raise ValueError("the reference call passed no position_embeddings: the port's rotary "
                     "tables cannot be made from it")


def attention_call(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """``LlamaAttention(hidden_states, position_embeddings, attention_mask, ...)`` ->
    ``Attention(x, freqs_cos, freqs_sin)``."""
    freqs_cos, freqs_sin = rotary_halves(_position_embeddings(args, kwargs, 1))
    return (_hidden_states(args, kwargs), freqs_cos, freqs_sin), {}


def block_call(*args: Any, **kwargs: Any) -> tuple[tuple, dict]:
    """``LlamaDecoderLayer(hidden_states, attention_mask, position_ids, past_key_values,
    use_cache, position_embeddings, ...)`` -> ``TransformerBlock(x, freqs_cos, freqs_sin)``."""
    freqs_cos, freqs_sin = rotary_halves(_position_embeddings(args, kwargs, 5))
    return (_hidden_states(args, kwargs), freqs_cos, freqs_sin), {}
