"""An independent Llama in plain PyTorch, written the way Meta-style ports (llama2.c's
``model.py``) are, as the port of ``reference_models.hf_llama:reference``.

What makes it a real port rather than a copy of Hugging Face's code:
- rotary embeddings act on *interleaved* pairs ``(x[2i], x[2i+1])`` (Meta's layout), with
  ``freqs_cos``/``freqs_sin`` of shape ``(T, head_dim/2)`` computed once as buffers; Hugging Face
  rotates halves ``(x[i], x[i + head_dim/2])``, so q/k projection rows must be permuted per head
  on load (``reference_models/hf_llama_convert.py``);
- a causal ``mask`` buffer, registered persistent, added to the scores in a hand-written attention;
- the block calls ``self.attention.forward(...)`` and ``self.feed_forward.forward(...)``
  directly, and its signature is ``(x, freqs_cos, freqs_sin)``;
- names: ``tok_embeddings``, ``layers.N.attention.wq``, ``feed_forward.w1/w2/w3``,
  ``attention_norm``, ``ffn_norm``, ``norm``, ``output``; ``tok_embeddings.weight`` *is*
  ``output.weight``; the model returns the logits as a plain tensor.

Planted bugs, each a small subclass put on one module of ``port()``:
- ``port_bug_attention``: layer 1's attention scales scores by 1/head_dim, not 1/sqrt(head_dim);
- ``port_bug_mlp``: layer 0's feed-forward uses GELU where Llama uses SiLU;
- ``port_bug_norm``: layer 1's ffn_norm takes the mean of |x|, not of x**2;
- ``port_bug_rotary``: layer 0's attention rotates with the wrong sign of sin.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

from .hf_llama import CONFIG, SEED, TinyLlama, make_batch, next_token_loss


@dataclass
class ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = 2
    vocab_size: int = 128
    hidden_dim: int | None = 128
    multiple_of: int = 32
    norm_eps: float = 1e-5
    max_seq_len: int = 64
    rope_theta: float = 10000.0
    dropout: float = 0.0


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of position * frequency, each (end, dim // 2): one frequency per pair."""
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device).float()
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def reshape_for_broadcast(freqs: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """(T, hd/2) -> (1, T, 1, hd/2) against x of (B, T, H, hd/2)."""
    shape = [d if i in (1, x.ndim - 1) else 1 for i, d in enumerate(x.shape)]
    return freqs.view(shape)


def apply_rotary_emb(xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor,
                     freqs_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate each interleaved pair (x[2i], x[2i+1]) by position * frequency i."""
    xq_r, xq_i = xq.float().reshape(*xq.shape[:-1], -1, 2).unbind(-1)
    xk_r, xk_i = xk.float().reshape(*xk.shape[:-1], -1, 2).unbind(-1)
    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)
    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos
    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, T, n_kv_heads, hd) -> (B, T, n_kv_heads * n_rep, hd), each kv head repeated."""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (x[:, :, :, None, :].expand(bs, slen, n_kv_heads, n_rep, head_dim)
            .reshape(bs, slen, n_kv_heads * n_rep, head_dim))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        assert args.n_heads % self.n_kv_heads == 0
        self.n_local_heads = args.n_heads
        self.n_local_kv_heads = self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)
        self.attn_dropout = nn.Dropout(args.dropout)
        self.resid_dropout = nn.Dropout(args.dropout)
        self.dropout = args.dropout
        # the non-flash path's causal mask: -inf above the diagonal, a persistent buffer
        mask = torch.full((1, 1, args.max_seq_len, args.max_seq_len), float("-inf"))
        self.register_buffer("mask", torch.triu(mask, diagonal=1))

    def rotary(self, xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor,
               freqs_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)

    def scores(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        return torch.matmul(xq, xk.transpose(2, 3)) / math.sqrt(self.head_dim)

    def forward(self, x: torch.Tensor, freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = self.rotary(xq, xk, freqs_cos, freqs_sin)
        xk = repeat_kv(xk, self.n_rep)  # grouped-query attention: share each kv head
        xv = repeat_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = self.scores(xq, xk)
        scores = scores + self.mask[:, :, :seqlen, :seqlen]
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        scores = self.attn_dropout(scores)
        output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.resid_dropout(self.wo(output))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int | None, multiple_of: int,
                 dropout: float) -> None:
        super().__init__()
        if hidden_dim is None:
            hidden_dim = int(2 * (4 * dim) / 3)
            hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.dropout = nn.Dropout(dropout)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.silu(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.w2(self.act(self.w1(x)) * self.w3(x)))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs) -> None:
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args.dim, args.hidden_dim, args.multiple_of,
                                        args.dropout)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x: torch.Tensor, freqs_cos: torch.Tensor,
                freqs_sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention.forward(self.attention_norm(x), freqs_cos, freqs_sin)
        return h + self.feed_forward.forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs) -> None:
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.dropout = nn.Dropout(params.dropout)
        self.layers = nn.ModuleList(TransformerBlock(i, params) for i in range(params.n_layers))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.tok_embeddings.weight = self.output.weight  # weight tying
        freqs_cos, freqs_sin = precompute_freqs_cis(params.dim // params.n_heads,
                                                    params.max_seq_len, params.rope_theta)
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)
        self.apply(self._init_weights)
        for name, param in self.named_parameters():
            if name.endswith(("w3.weight", "wo.weight")):
                nn.init.normal_(param, mean=0.0, std=0.02 / math.sqrt(2 * params.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        _bsz, seqlen = tokens.shape
        h = self.dropout(self.tok_embeddings(tokens))
        freqs_cos = self.freqs_cos[:seqlen]
        freqs_sin = self.freqs_sin[:seqlen]
        for layer in self.layers:
            h = layer(h, freqs_cos, freqs_sin)
        return self.output(self.norm(h))


def model_args(cfg: TinyLlama = CONFIG) -> ModelArgs:
    return ModelArgs(dim=cfg.dim, n_layers=cfg.n_layers, n_heads=cfg.n_heads,
                     n_kv_heads=cfg.n_kv_heads, vocab_size=cfg.vocab, hidden_dim=cfg.hidden_dim,
                     norm_eps=cfg.norm_eps, max_seq_len=cfg.max_seq_len,
                     rope_theta=cfg.rope_theta)


# ---- cases
def port() -> Case:
    """The faithful port, with its own initialization: load the reference's weights into it."""
    seed_everything(SEED)
    model = Transformer(model_args()).train()
    inputs, targets = make_batch()
    return Case(model=model, inputs=(inputs,),
                loss_fn=lambda logits: next_token_loss(logits, targets), seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name="reference_models.llama_port:port")


def _variant(name: str) -> Case:
    return dataclasses.replace(port(), name=f"reference_models.llama_port:{name}")


class AttentionScaleBug(Attention):
    def scores(self, xq: torch.Tensor, xk: torch.Tensor) -> torch.Tensor:
        return torch.matmul(xq, xk.transpose(2, 3)) / self.head_dim  # BUG: not sqrt(head_dim)


class FeedForwardGELUBug(FeedForward):
    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)  # BUG: Llama's gate is SiLU


class RMSNormAbsBug(RMSNorm):
    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.abs().mean(-1, keepdim=True) + self.eps)  # BUG: |x|, not x**2


class RotarySignBug(Attention):
    def rotary(self, xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor,
               freqs_sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return apply_rotary_emb(xq, xk, freqs_cos, -freqs_sin)  # BUG: rotates the wrong way


def _planted(name: str, module_path: str, bug_class: type[nn.Module]) -> Case:
    case = _variant(name)
    module = case.model.get_submodule(module_path)
    module.__class__ = bug_class  # same parameters and buffers, one method changed
    return case


def port_bug_attention() -> Case:
    """Layer 1's attention scales its scores by 1/head_dim (forward, layers.1.attention)."""
    return _planted("port_bug_attention", "layers.1.attention", AttentionScaleBug)


def port_bug_mlp() -> Case:
    """Layer 0's feed-forward gates with GELU instead of SiLU (forward, layers.0.feed_forward)."""
    return _planted("port_bug_mlp", "layers.0.feed_forward", FeedForwardGELUBug)


def port_bug_norm() -> Case:
    """Layer 1's ffn_norm divides by sqrt(mean |x|), not the RMS (forward, layers.1.ffn_norm)."""
    return _planted("port_bug_norm", "layers.1.ffn_norm", RMSNormAbsBug)


def port_bug_rotary() -> Case:
    """Layer 0's attention rotates q and k by -angle (forward, layers.0.attention)."""
    return _planted("port_bug_rotary", "layers.0.attention", RotarySignBug)
