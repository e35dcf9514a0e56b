"""Hugging Face ``LlamaForCausalLM`` (tiny random config, eager attention, GQA, tied embeddings)
against a small independent llama2.c-style port, for ``map-suggest``'s measurements.

The port is written the way Karpathy's llama2.c ``model.py`` is: ``tok_embeddings``,
``layers.N.attention.wq/wk/wv/wo``, ``feed_forward.w1/w2/w3``, ``attention_norm``, ``ffn_norm``,
``norm``, ``output`` tied to the embedding, ``freqs_cos``/``freqs_sin`` buffers (not part of the
state), interleaved rotary pairs (so its q/k rows are in another order than Hugging Face's), and
its attention and feed-forward called through ``.forward()``. No transformers code is used.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

DIM, LAYERS, HEADS, KV_HEADS, VOCAB, HIDDEN, SEQ, BATCH = 64, 2, 4, 2, 128, 176, 12, 2


def _tokens() -> tuple[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return (torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),)


def _loss(logits) -> torch.Tensor:
    logits = logits.logits if hasattr(logits, "logits") else logits
    return logits.float().pow(2).mean()


def reference() -> Case:
    from transformers import LlamaConfig, LlamaForCausalLM

    seed_everything(0)
    config = LlamaConfig(hidden_size=DIM, intermediate_size=HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                         vocab_size=VOCAB, max_position_embeddings=64, rms_norm_eps=1e-5,
                         tie_word_embeddings=True, attn_implementation="eager")
    model = LlamaForCausalLM(config).eval()
    return Case(model=model, inputs=_tokens(), loss_fn=_loss, name="hf_llama")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    pairs = x.float().reshape(*x.shape[:-1], -1, 2)
    re, im = pairs.unbind(-1)
    cos, sin = cos[None, :, None, :], sin[None, :, None, :]
    return torch.stack([re * cos - im * sin, re * sin + im * cos], -1).flatten(3).type_as(x)


class Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.wq = nn.Linear(DIM, HEADS * self.head_dim, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cos, freqs_sin):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, HEADS, self.head_dim)
        k = self.wk(x).view(b, t, KV_HEADS, self.head_dim)
        v = self.wv(x).view(b, t, KV_HEADS, self.head_dim)
        q, k = _rotary(q, freqs_cos, freqs_sin), _rotary(k, freqs_cos, freqs_sin)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=2)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=2)
        q, k, v = (z.transpose(1, 2) for z in (q, k, v))
        scores = q @ k.transpose(2, 3) / math.sqrt(self.head_dim)
        scores = scores + torch.full((t, t), float("-inf")).triu(1)
        out = F.softmax(scores.float(), dim=-1).type_as(q) @ v
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1 = nn.Linear(DIM, HIDDEN, bias=False)
        self.w2 = nn.Linear(HIDDEN, DIM, bias=False)
        self.w3 = nn.Linear(DIM, HIDDEN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention = Attention()
        self.feed_forward = FeedForward()
        self.attention_norm = RMSNorm(DIM, 1e-5)
        self.ffn_norm = RMSNorm(DIM, 1e-5)

    def forward(self, x, freqs_cos, freqs_sin):
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock() for _ in range(LAYERS))
        self.norm = RMSNorm(DIM, 1e-5)
        self.output = nn.Linear(DIM, VOCAB, bias=False)
        self.tok_embeddings.weight = self.output.weight
        head_dim = DIM // HEADS
        freqs = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(64).float(), freqs)
        self.register_buffer("freqs_cos", torch.cos(angles), persistent=False)
        self.register_buffer("freqs_sin", torch.sin(angles), persistent=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        cos, sin = self.freqs_cos[:tokens.shape[1]], self.freqs_sin[:tokens.shape[1]]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def port() -> Case:
    seed_everything(0)
    return Case(model=Transformer().eval(), inputs=_tokens(), loss_fn=_loss, name="llama_port")


# What each port tensor must come from (the tie makes output.weight tok_embeddings.weight).
def right_sources() -> dict[str, str]:
    right = {"tok_embeddings.weight": "model.embed_tokens.weight",
             "norm.weight": "model.norm.weight"}
    names = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
             "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
             "feed_forward.w1": "mlp.gate_proj", "feed_forward.w2": "mlp.down_proj",
             "feed_forward.w3": "mlp.up_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    for n in range(LAYERS):
        for port_name, ref_name in names.items():
            right[f"layers.{n}.{port_name}.weight"] = f"model.layers.{n}.{ref_name}.weight"
    return right


def gpt2_reference() -> Case:
    """Hugging Face ``GPT2LMHeadModel`` with ``tests.gpt_cases``' sizes and tokens (eager
    attention, dropout off), against ``tests.gpt_cases:port`` (nanoGPT's layout)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from tests import gpt_cases

    cfg = gpt_cases.GPTConfig()
    case = gpt_cases.port()   # its tokens and loss; the model is replaced
    seed_everything(0)
    config = GPT2Config(vocab_size=cfg.vocab, n_positions=cfg.n_positions, n_embd=cfg.n_embd,
                        n_layer=cfg.n_layer, n_head=cfg.n_head, resid_pdrop=0.0,
                        embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")
    model = GPT2LMHeadModel(config).eval()
    return Case(model=model, inputs=case.inputs, loss_fn=lambda out: case.loss_fn((out.logits,)),
                name="hf_gpt2")


def gpt2_right_sources() -> dict[str, tuple[str, str]]:
    """nanoGPT port tensor -> (Hugging Face tensor, transform)."""
    from tests import gpt_cases

    right = {"transformer.wte.weight": ("transformer.wte.weight", "copy"),
             "transformer.wpe.weight": ("transformer.wpe.weight", "copy"),
             "transformer.ln_f.weight": ("transformer.ln_f.weight", "copy"),
             "transformer.ln_f.bias": ("transformer.ln_f.bias", "copy")}
    for n in range(gpt_cases.GPTConfig().n_layer):
        for leaf in ("ln_1.weight", "ln_1.bias", "ln_2.weight", "ln_2.bias",
                     "attn.c_attn.bias", "attn.c_proj.bias", "mlp.c_fc.bias", "mlp.c_proj.bias"):
            right[f"transformer.h.{n}.{leaf}"] = (f"transformer.h.{n}.{leaf}", "copy")
        for leaf in ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight",
                     "mlp.c_proj.weight"):
            right[f"transformer.h.{n}.{leaf}"] = (f"transformer.h.{n}.{leaf}", "transpose")
    return right


class FusedAttention(Attention):
    """gpt-fast's layout: one ``wqkv`` projection, q, k and v rows stacked."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.head_dim = DIM // HEADS
        self.wqkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * self.head_dim, bias=False)
        self.wo = nn.Linear(HEADS * self.head_dim, DIM, bias=False)

    def forward(self, x, freqs_cos, freqs_sin):
        b, t, _ = x.shape
        kv = KV_HEADS * self.head_dim
        q, k, v = self.wqkv(x).split([DIM, kv, kv], dim=-1)
        q = q.reshape(b, t, HEADS, self.head_dim)
        k, v = k.reshape(b, t, KV_HEADS, self.head_dim), v.reshape(b, t, KV_HEADS, self.head_dim)
        q, k = _rotary(q, freqs_cos, freqs_sin), _rotary(k, freqs_cos, freqs_sin)
        k = k.repeat_interleave(HEADS // KV_HEADS, dim=2)
        v = v.repeat_interleave(HEADS // KV_HEADS, dim=2)
        out = F.scaled_dot_product_attention(*(z.transpose(1, 2) for z in (q, k, v)),
                                             is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


def fused_port() -> Case:
    """The port with gpt-fast's fused ``wqkv`` in each attention."""
    case = port()
    for layer in case.model.layers:
        layer.attention = FusedAttention()
    return Case(model=case.model, inputs=case.inputs, loss_fn=case.loss_fn, name="llama_fused")


def fused_right_sources() -> dict[str, list[str]]:
    right = {name: [ref] for name, ref in right_sources().items()
             if not any(f"attention.w{x}." in name for x in "qkv")}
    for n in range(LAYERS):
        right[f"layers.{n}.attention.wqkv.weight"] = [
            f"model.layers.{n}.self_attn.{x}_proj.weight" for x in "qkv"]
    return right
