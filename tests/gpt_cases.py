"""A tiny GPT-2 two ways, for tied parameters: Hugging Face's layout against a nanoGPT-style port.

``reference`` is written the way Hugging Face's ``GPT2LMHeadModel`` is: ``Conv1D`` projections
(weight stored ``(in, out)``), hand-written causal attention over a registered mask buffer, a
tanh-approximated GELU module, and an ``lm_head`` whose weight *is* the token embedding's.
``port`` is an independent nanoGPT-style implementation: ``nn.Linear`` projections (weight
``(out, in)``), ``scaled_dot_product_attention(is_causal=True)``, a hand-written LayerNorm, and
the same tie made the other way round (``wte.weight = lm_head.weight``). The loss is
next-token cross-entropy, computed outside the model. ``tests/gpt_port.map.toml`` maps the two.

Planted bugs, each one line away from ``port``:
- ``port_bug_gelu_backward``: block 1's GELU has a right forward and a backward that drops the
  tanh derivative term;
- ``port_bug_causal_mask``: block 0's attention is not causal;
- ``port_bug_attn_scale``: block 0's attention scores are not scaled by 1/sqrt(head_dim).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0


@dataclass(frozen=True)
class GPTConfig:
    vocab: int = 64
    n_positions: int = 16
    n_embd: int = 32
    n_head: int = 4
    n_layer: int = 2
    batch: int = 4
    # Dropout modules are in place, but off: reference and port draw random numbers in a
    # different order, so with dropout on they could never agree.
    dropout: float = 0.0


# ---- the reference: Hugging Face GPT-2's layout
class Conv1D(nn.Module):
    """GPT-2's projection: a linear layer whose weight is stored transposed, ``(in, out)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        size_out = (*x.size()[:-1], self.nf)
        x = torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)
        return x.view(size_out)


class NewGELUActivation(nn.Module):
    """GELU with the tanh approximation, written out as in the original GPT-2 code."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))


class GPT2Attention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.embed_dim, self.num_heads = cfg.n_embd, cfg.n_head
        self.head_dim = cfg.n_embd // cfg.n_head
        mask = torch.tril(torch.ones(cfg.n_positions, cfg.n_positions, dtype=torch.bool))
        self.register_buffer("bias", mask.view(1, 1, cfg.n_positions, cfg.n_positions),
                             persistent=False)
        self.c_attn = Conv1D(3 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def _split_heads(self, x: torch.Tensor) -> torch.Tensor:
        new_shape = (*x.size()[:-1], self.num_heads, self.head_dim)
        return x.view(new_shape).permute(0, 2, 1, 3)  # (batch, head, seq, head_dim)

    def _merge_heads(self, x: torch.Tensor) -> torch.Tensor:
        x = x.permute(0, 2, 1, 3).contiguous()
        return x.view((*x.size()[:-2], self.embed_dim))

    def _attn(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        attn_weights = torch.matmul(query, key.transpose(-1, -2))
        attn_weights = attn_weights / (value.size(-1) ** 0.5)
        query_length, key_length = query.size(-2), key.size(-2)
        causal_mask = self.bias[:, :, key_length - query_length: key_length, :key_length]
        attn_weights = attn_weights.masked_fill(~causal_mask,
                                                torch.finfo(attn_weights.dtype).min)
        attn_weights = nn.functional.softmax(attn_weights, dim=-1)
        attn_weights = self.attn_dropout(attn_weights)
        return torch.matmul(attn_weights, value)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        query, key, value = self.c_attn(hidden_states).split(self.embed_dim, dim=2)
        attn_output = self._attn(self._split_heads(query), self._split_heads(key),
                                 self._split_heads(value))
        attn_output = self.c_proj(self._merge_heads(attn_output))
        return self.resid_dropout(attn_output)


class GPT2MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = Conv1D(4 * cfg.n_embd, cfg.n_embd)
        self.c_proj = Conv1D(cfg.n_embd, 4 * cfg.n_embd)
        self.act = NewGELUActivation()
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states = self.act(self.c_fc(hidden_states))
        return self.dropout(self.c_proj(hidden_states))


class GPT2Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.attn = GPT2Attention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        self.mlp = GPT2MLP(cfg)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = residual + self.attn(self.ln_1(hidden_states))
        residual = hidden_states
        return residual + self.mlp(self.ln_2(hidden_states))


class GPT2Model(nn.Module):
    block_class: type[nn.Module] = GPT2Block  # tests/hf_cases.py puts its own block here

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleList(self.block_class(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd, eps=1e-5)
        for embedding in (self.wte, self.wpe):
            nn.init.normal_(embedding.weight, std=0.02)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # (seq,) position ids, broadcast over the batch when added to the token embeddings
        position_ids = torch.arange(input_ids.size(-1), device=input_ids.device)
        hidden_states = self.drop(self.wte(input_ids) + self.wpe(position_ids))
        for block in self.h:
            hidden_states = block(hidden_states)
        return self.ln_f(hidden_states)


class GPT2LMHeadModel(nn.Module):
    model_class: type[nn.Module] = GPT2Model

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.transformer = self.model_class(cfg)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.transformer.wte.weight  # tie_weights()

    def forward(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        return (self.lm_head(self.transformer(input_ids)),)  # return_dict=False


# ---- the port: nanoGPT's layout
class LayerNorm(nn.Module):
    """LayerNorm written out: mean and biased variance over the last axis."""

    def __init__(self, ndim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)
        var = (x - mean).pow(2).mean(dim=-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + self.eps) * self.weight + self.bias


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.attn_dropout = nn.Dropout(cfg.dropout)  # only the non-flash path uses it
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.n_head, self.n_embd, self.dropout = cfg.n_head, cfg.n_embd, cfg.dropout
        self.is_causal = True
        self.scale: float | None = None  # None: SDPA's default, 1/sqrt(head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0,
            is_causal=self.is_causal, scale=self.scale)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.gelu = nn.GELU(approximate="tanh")
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(cfg.vocab, cfg.n_embd),
            wpe=nn.Embedding(cfg.n_positions, cfg.n_embd),
            drop=nn.Dropout(cfg.dropout),
            h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
            ln_f=LayerNorm(cfg.n_embd),
        ))
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, None]:
        pos = torch.arange(0, idx.size(1), dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, None  # no targets given: the loss is the case's


# ---- planted bug: a GELU whose backward forgets the tanh's derivative
class _GELUDropsTanhGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))
        # BUG: d/dx 0.5 x (1 + tanh(u)) also has 0.5 x (1 - tanh(u)^2) du/dx
        return grad_output * 0.5 * (1.0 + torch.tanh(inner))


class CustomGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GELUDropsTanhGrad.apply(x)


# ---- cases
def _build(model_class: type[nn.Module], name: str, cfg: GPTConfig = GPTConfig()) -> Case:
    seed_everything(SEED)
    tokens = torch.randint(cfg.vocab, (cfg.batch, cfg.n_positions + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    model = model_class(cfg)

    def loss_fn(output: tuple) -> torch.Tensor:
        logits = output[0]
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name)


def reference() -> Case:
    """Hugging Face GPT-2's layout: 2 layers, d_model 32, 4 heads, vocab 64, batch 4 x 16."""
    return _build(GPT2LMHeadModel, "tests.gpt_cases:reference")


def port() -> Case:
    """nanoGPT's layout with its own initialization: load the reference's weights into it."""
    return _build(GPT, "tests.gpt_cases:port")


def _variant(name: str) -> Case:
    return dataclasses.replace(port(), name=f"tests.gpt_cases:{name}")


def port_bug_gelu_backward() -> Case:
    case = _variant("port_bug_gelu_backward")
    case.model.transformer.h[1].mlp.gelu = CustomGELU()  # BUG: wrong backward
    return case


def port_bug_causal_mask() -> Case:
    case = _variant("port_bug_causal_mask")
    case.model.transformer.h[0].attn.is_causal = False  # BUG: attends to the future
    return case


def port_bug_attn_scale() -> Case:
    case = _variant("port_bug_attn_scale")
    case.model.transformer.h[0].attn.scale = 1.0  # BUG: scores not divided by sqrt(head_dim)
    return case
