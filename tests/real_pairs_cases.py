"""A tiny rotary-attention language model two ways, called the way real third-party code calls
its layers, for tests/test_real_pairs_diff.py.

``reference`` is written as Hugging Face 5.x writes a decoder: the model builds a float causal
mask and the rotary tables ``(cos, sin)`` of shape (1, T, head_dim) and calls each block
``block(h, attention_mask=mask, position_embeddings=(cos, sin))``; the block calls its
attention by keyword (``attn(hidden_states=..., attention_mask=..., position_embeddings=...)``)
and the attention returns ``(output, attention weights)``; the model returns a dict
``{"logits": ..., "loss": None}``, as a ``ModelOutput`` is recorded.

Two independent ports compute the same numbers:
- ``port_self``: every layer takes the hidden states alone (``attn(x)``, ``block(x)``): the
  attention builds its own causal mask and rotary tables; the model returns the logits tensor;
- ``port_freqs``: Meta-style: the model holds ``freqs_cos``/``freqs_sin`` of shape
  (T, head_dim/2) and calls ``block(x, freqs_cos, freqs_sin)`` and ``attn(x, freqs_cos,
  freqs_sin)``: port-only inputs that only a call adapter (:func:`attention_call`,
  :func:`block_call`) can make from the reference's arguments.
Planted bugs: ``*_bug_scale`` (block 0's attention scores not scaled), ``port_freqs_bug_rotary``
(block 1's rotation turns the wrong way), ``port_self_bug_mlp`` (block 0's MLP without its
activation), ``port_self_bug_norm`` (block 1's second norm with epsilon 1).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
VOCAB, DIM, HEADS, LAYERS, BATCH, LENGTH = 32, 16, 2, 2, 2, 8
HEAD_DIM = DIM // HEADS


def _tables(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(T, head_dim/2) cosines and sines of the rotary angles."""
    inverse = 1.0 / (10000.0 ** (torch.arange(0, HEAD_DIM, 2).float() / HEAD_DIM))
    angles = torch.outer(torch.arange(length).float(), inverse)
    return torch.cos(angles), torch.sin(angles)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float = 1.0
            ) -> torch.Tensor:
    """Rotate-half RoPE with (T, head_dim/2) tables on x (B, H, T, head_dim)."""
    first, second = x[..., :HEAD_DIM // 2], x[..., HEAD_DIM // 2:]
    sin = sign * sin
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)
        self.activation = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.up(x)
        return self.down(F.gelu(hidden) if self.activation else hidden)


class _Projections(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(DIM, DIM)
        self.k = nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, DIM)
        self.o = nn.Linear(DIM, DIM)
        self.scale = 1.0 / math.sqrt(HEAD_DIM)
        self.sign = 1.0

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        b, t, _ = x.shape
        return tuple(p(x).view(b, t, HEADS, HEAD_DIM).transpose(1, 2)
                     for p in (self.q, self.k, self.v))

    def attend(self, q, k, v, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        weights = torch.softmax(q @ k.transpose(-1, -2) * self.scale + mask, dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(q.shape[0], q.shape[2], DIM)
        return self.o(out), weights


# ---- the reference: Hugging Face 5.x's way of calling
class RefAttention(_Projections):
    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                output_attentions: bool = False, **kwargs: Any
                ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = position_embeddings
        half = HEAD_DIM // 2
        q, k, v = self.heads(hidden_states)
        q = _rotate(q, cos[0, :, :half], sin[0, :, :half], self.sign)
        k = _rotate(k, cos[0, :, :half], sin[0, :, :half], self.sign)
        return self.attend(q, k, v, attention_mask)  # (output, weights), as eager HF


class RefBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = RefAttention()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_embeddings: tuple | None = None, use_cache: bool = False,
                **kwargs: Any) -> torch.Tensor:
        out, _ = self.attn(hidden_states=self.norm1(hidden_states),
                           attention_mask=attention_mask,
                           position_embeddings=position_embeddings, output_attentions=False)
        hidden_states = hidden_states + out
        return hidden_states + self.mlp(self.norm2(hidden_states))


class Reference(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(RefBlock() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> dict[str, Any]:
        b, t = input_ids.shape
        future = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)
        mask = torch.zeros(b, 1, t, t).masked_fill(future, torch.finfo(torch.float32).min)
        cos, sin = _tables(t)
        cos, sin = torch.cat([cos, cos], -1)[None], torch.cat([sin, sin], -1)[None]
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h, attention_mask=mask, position_embeddings=(cos, sin), use_cache=False)
        return {"logits": self.head(self.norm(h)), "loss": None}


# ---- port 1: every layer takes the hidden states alone
class SelfAttention(_Projections):
    def __init__(self) -> None:
        super().__init__()
        cos, sin = _tables(LENGTH)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.heads(x)
        q = _rotate(q, self.cos[:t], self.sin[:t], self.sign)
        k = _rotate(k, self.cos[:t], self.sin[:t], self.sign)
        mask = torch.zeros(t, t).masked_fill(
            torch.triu(torch.ones(t, t, dtype=torch.bool), 1), torch.finfo(torch.float32).min)
        return self.attend(q, k, v, mask)[0]


class SelfBlock(nn.Module):
    attention_class = SelfAttention

    def __init__(self) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(DIM)
        self.attn = self.attention_class()
        self.norm2 = nn.LayerNorm(DIM)
        self.mlp = MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PortSelf(nn.Module):
    block_class: type[nn.Module] = SelfBlock

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(self.block_class() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h)
        return self.head(self.norm(h))


# ---- port 2: Meta-style, the rotary tables passed down as port-only inputs
class FreqsAttention(_Projections):
    def forward(self, x: torch.Tensor, freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        q, k, v = self.heads(x)
        q = _rotate(q, freqs_cos, freqs_sin, self.sign)
        k = _rotate(k, freqs_cos, freqs_sin, self.sign)
        mask = torch.full((t, t), torch.finfo(torch.float32).min).triu(1)
        return self.attend(q, k, v, mask)[0]


class FreqsBlock(SelfBlock):
    attention_class = FreqsAttention

    def forward(self, x: torch.Tensor, freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), freqs_cos, freqs_sin)
        return x + self.mlp(self.norm2(x))


class PortFreqs(PortSelf):
    block_class = FreqsBlock

    def __init__(self) -> None:
        super().__init__()
        cos, sin = _tables(LENGTH)
        self.register_buffer("freqs_cos", cos, persistent=False)
        self.register_buffer("freqs_sin", sin, persistent=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        t = input_ids.shape[1]
        h = self.embed(input_ids)
        for block in self.layers:
            h = block(h, self.freqs_cos[:t], self.freqs_sin[:t])
        return self.head(self.norm(h))


# ---- call adapters (named by the mapping: call = "tests.real_pairs_cases:attention_call")
def _halves(position_embeddings: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = position_embeddings
    half = cos.shape[-1] // 2
    return cos[0, :, :half], sin[0, :, :half]


def attention_call(hidden_states=None, attention_mask=None, position_embeddings=None,
                   **kwargs: Any) -> tuple[tuple, dict]:
    """``attn(hidden_states=, attention_mask=, position_embeddings=(cos, sin))`` ->
    ``attn(x, freqs_cos, freqs_sin)``: the port builds its own mask."""
    return (hidden_states, *_halves(position_embeddings)), {}


def block_call(hidden_states, attention_mask=None, position_embeddings=None,
               **kwargs: Any) -> tuple[tuple, dict]:
    return (hidden_states, *_halves(position_embeddings)), {}


# ---- cases
def _case(model_class: type[nn.Module], name: str) -> Case:
    seed_everything(SEED)
    tokens = torch.randint(VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = model_class()

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output["logits"] if isinstance(output, dict) else output
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"tests.real_pairs_cases:{name}")


def reference() -> Case:
    return _case(Reference, "reference")


def port_self() -> Case:
    return _case(PortSelf, "port_self")


def port_freqs() -> Case:
    return _case(PortFreqs, "port_freqs")


def _bug(case: Case, name: str) -> Case:
    return dataclasses.replace(case, name=f"tests.real_pairs_cases:{name}")


def port_self_bug_scale() -> Case:
    case = _bug(port_self(), "port_self_bug_scale")
    case.model.layers[0].attn.scale = 1.0  # BUG: scores not divided by sqrt(head_dim)
    return case


def port_self_bug_mlp() -> Case:
    case = _bug(port_self(), "port_self_bug_mlp")
    case.model.layers[0].mlp.activation = False  # BUG: no GELU
    return case


def port_self_bug_norm() -> Case:
    case = _bug(port_self(), "port_self_bug_norm")
    case.model.layers[1].norm2.eps = 1.0  # BUG: epsilon 1 instead of 1e-5
    return case


def port_freqs_bug_scale() -> Case:
    case = _bug(port_freqs(), "port_freqs_bug_scale")
    case.model.layers[0].attn.scale = 1.0
    return case


def port_freqs_bug_rotary() -> Case:
    case = _bug(port_freqs(), "port_freqs_bug_rotary")
    case.model.layers[1].attn.sign = -1.0  # BUG: rotates the wrong way
    return case


# ---- a real Hugging Face GPT-2 (transformers 5.x, eager) against tests.gpt_cases' nanoGPT port
def hf_gpt2() -> Case:
    """transformers' own ``GPT2LMHeadModel`` (random weights, gpt_cases' sizes and batch)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests import gpt_cases

    cfg = gpt_cases.GPTConfig()
    seed_everything(gpt_cases.SEED)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.n_positions + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    config = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    config._attn_implementation = "eager"
    model = GPT2LMHeadModel(config)

    def loss_fn(output: Any) -> torch.Tensor:
        logits = output.logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=gpt_cases.SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name="tests.real_pairs_cases:hf_gpt2")
