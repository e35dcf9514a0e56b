"""Cases of the encoder-decoder validation pair: transformers' ``WhisperForConditionalGeneration``
(``whisper_hf``) against an OpenAI-layout port (``whisper_openai``), and five planted bugs, each
in one place, switched on here without editing either model.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from layerdiff import Case, seed_everything
from tests.validation import whisper_openai as w
from tests.validation.whisper_hf import (
    D_MODEL,
    DEC_LAYERS,
    ENC_LAYERS,
    HEADS,
    N_AUDIO_CTX,
    N_MELS,
    N_TEXT_CTX,
    SEED,
    VOCAB,
    build_reference,
)

BATCH, TEXT_LEN, START = 2, 6, 1


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    seed_everything(SEED + 1)  # the same batch for every model
    mel = torch.randn(BATCH, N_MELS, 2 * N_AUDIO_CTX)
    labels = torch.randint(3, VOCAB, (BATCH, TEXT_LEN))
    tokens = torch.cat([torch.full((BATCH, 1), START), labels[:, :-1]], dim=1)  # shifted right
    return mel, labels, tokens


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


def reference() -> Case:
    mel, labels, _ = _data()
    return Case(model=build_reference(), inputs={"input_features": mel, "labels": labels},
                loss_fn=lambda out: out.loss, seed=SEED, steps=1, optimizer=_sgd,
                name="tests.validation.whisper_cases:reference")


def port() -> Case:
    mel, labels, tokens = _data()
    seed_everything(SEED)
    dims = w.ModelDimensions(N_MELS, N_AUDIO_CTX, D_MODEL, HEADS, ENC_LAYERS,
                             VOCAB, N_TEXT_CTX, D_MODEL, HEADS, DEC_LAYERS)
    model = w.Whisper(dims)

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))

    return Case(model=model, inputs=(mel, tokens), loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=_sgd, name="tests.validation.whisper_cases:port")


def _bug(name: str) -> Case:
    case = port()
    return dataclasses.replace(case, name=f"tests.validation.whisper_cases:{name}")


# ---- (a) the cross-attention's scale: 1/sqrt(d) on q and k each (1/d overall), decoder block 1
class WrongScaleAttention(w.MultiHeadAttention):
    def qkv_attention(self, q, k, v, mask=None):
        _, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.5  # BUG: -0.5 on each side, not -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3) * scale
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 3, 1) * scale
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        qk = q @ k
        if mask is not None:
            qk = qk + mask[:n_ctx, :n_ctx]
        w_ = F.softmax(qk.float(), dim=-1).to(q.dtype)
        return (w_ @ v).permute(0, 2, 1, 3).flatten(start_dim=2), qk.detach()


def bug_cross_scale() -> Case:
    case = _bug("bug_cross_scale")
    case.model.decoder.blocks[1].cross_attn.__class__ = WrongScaleAttention
    return case


# ---- (b) the tanh GELU in encoder block 1's MLP (a leaf)
def bug_gelu_tanh() -> Case:
    case = _bug("bug_gelu_tanh")
    case.model.encoder.blocks[1].mlp[1] = nn.GELU(approximate="tanh")
    return case


# ---- (b') the encoder's conv2 pads by replicating the edge instead of zeros (a leaf)
def bug_conv2_padding() -> Case:
    case = _bug("bug_conv2_padding")
    case.model.encoder.conv2.padding_mode = "replicate"
    return case


# ---- (c) a LayerNorm epsilon slip: decoder block 1's mlp_ln with eps 1e-3, not 1e-5
def bug_ln_eps() -> Case:
    case = _bug("bug_ln_eps")
    case.model.decoder.blocks[1].mlp_ln.eps = 1e-3
    return case


# ---- (d) backward only: decoder block 0's GELU as a custom function whose backward drops a term
class _GeluWrongGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        cdf = 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0)))
        return grad * cdf  # BUG: d/dx x*Phi(x) = Phi(x) + x*phi(x); the x*phi(x) term is lost


class GeluWrongGrad(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GeluWrongGrad.apply(x)


def bug_backward() -> Case:
    case = _bug("bug_backward")
    case.model.decoder.blocks[0].mlp[1] = GeluWrongGrad()
    return case


# ---- (e) the residual around the cross-attention dropped in decoder block 0 (its own code)
class NoCrossResidualBlock(w.ResidualAttentionBlock):
    def forward(self, x, xa=None, mask=None, kv_cache=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn:
            x = self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]  # BUG: no x +
        x = x + self.mlp(self.mlp_ln(x))
        return x


def bug_residual() -> Case:
    case = _bug("bug_residual")
    case.model.decoder.blocks[0].__class__ = NoCrossResidualBlock
    return case


# ---- call adapters named in whisper.map.toml: what no renaming can say
def _causal_mask() -> torch.Tensor:
    """The port's own causal mask buffer: -inf above the diagonal, (n_text_ctx, n_text_ctx)."""
    return torch.full((N_TEXT_CTX, N_TEXT_CTX), float("-inf")).triu_(1)


def root_call(input_features: torch.Tensor, labels: torch.Tensor, **_: Any
              ) -> tuple[tuple, dict]:
    """HF takes the labels and shifts them right itself; OpenAI's model takes the tokens."""
    tokens = torch.cat([torch.full_like(labels[:, :1], START), labels[:, :-1]], dim=1)
    return (input_features, tokens), {}


def decoder_block_call(hidden_states: torch.Tensor, attention_mask: Any = None,
                       encoder_hidden_states: torch.Tensor | None = None, *_: Any, **__: Any
                       ) -> tuple[tuple, dict]:
    """HF's decoder layer gets a (B, 1, T, T) additive mask; OpenAI's block its (T_max, T_max)
    buffer, which it slices."""
    return (hidden_states, encoder_hidden_states), {"mask": _causal_mask().to(hidden_states)}


def decoder_self_attn_call(hidden_states: torch.Tensor, *_: Any, **__: Any
                           ) -> tuple[tuple, dict]:
    return (hidden_states,), {"mask": _causal_mask().to(hidden_states)}
