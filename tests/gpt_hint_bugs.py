"""Bugs planted in the nanoGPT port of Hugging Face's GPT-2 (tests/gpt_cases.py against
reference_models/hf_gpt2.py, mapping reference_models/hf_gpt2.map.toml), written after the hint
rules of issue 29 were frozen, as a held-out check of the hints (tests/test_hints_heldout_gpt.py):
each function is a port with one mistake a port of GPT-2 really makes."""
from __future__ import annotations

import dataclasses
import types

from torch import nn
from torch.nn import functional as F

from layerdiff import Case
from tests import gpt_cases


def _port() -> Case:
    return dataclasses.replace(gpt_cases.port(), name="tests.gpt_hint_bugs")


def silu_block0() -> Case:
    case = _port()
    case.model.transformer.h[0].mlp.gelu = nn.SiLU()  # looks like GELU, is not
    return case


def no_residual_block1() -> Case:
    case = _port()
    block = case.model.transformer.h[1]

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return self.mlp(self.ln_2(x))  # the residual add dropped
    block.forward = types.MethodType(forward, block)
    return case


def ln_eps() -> Case:
    case = _port()
    case.model.transformer.h[1].ln_2.eps = 1e-2  # a TF-style epsilon, far off
    return case


def not_causal() -> Case:
    case = _port()
    case.model.transformer.h[0].attn.is_causal = False
    return case


def scale_twice() -> Case:
    case = _port()
    case.model.transformer.h[1].attn.scale = 1.0 / 8.0  # head_dim 8: 1/d, not 1/sqrt(d)
    return case


def qk_swapped() -> Case:
    case = _port()
    attn = case.model.transformer.h[0].attn

    def forward(self, x):
        B, T, C = x.size()
        k, q, v = self.c_attn(x).split(self.n_embd, dim=2)  # q and k swapped
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))
    attn.forward = types.MethodType(forward, attn)
    return case


def heads_merged_wrong() -> Case:
    case = _port()
    attn = case.model.transformer.h[1].attn

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.contiguous().view(B, T, C))  # no transpose back: heads scrambled
    attn.forward = types.MethodType(forward, attn)
    return case


def relu_mlp() -> Case:
    case = _port()
    case.model.transformer.h[1].mlp.gelu = nn.ReLU()
    return case


def gelu_erf() -> Case:
    case = _port()
    case.model.transformer.h[0].mlp.gelu = nn.GELU()  # erf where GPT-2 uses tanh
    return case
