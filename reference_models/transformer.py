"""An encoder-decoder translation transformer in the style of "Attention Is All You Need".

Written the way the classic PyTorch implementations are: separate q/k/v/o projections, heads
split by view + transpose, scores scaled by 1/sqrt(d_k), padding and causal masks applied with
masked_fill, post-norm residual sublayers, sinusoidal positions, log-softmax output, NLL loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

PAD = 0
SEED = 0


@dataclass(frozen=True)
class Config:
    vocab: int = 50
    d_model: int = 64
    heads: int = 4
    d_ff: int = 128
    layers: int = 2
    # Dropout modules are in place, but off: a port draws random numbers in another order, so
    # with dropout on, reference and port could never agree. Turn it on to test capture itself.
    dropout: float = 0.0
    batch: int = 8
    src_len: int = 12
    tgt_len: int = 12
    max_len: int = 256


class PositionalEncoding(nn.Module):
    def __init__(self, d_model: int, max_len: int, dropout: float) -> None:
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        table = torch.zeros(max_len, d_model)
        table[:, 0::2] = torch.sin(position * div)
        table[:, 1::2] = torch.cos(position * div)
        self.register_buffer("table", table)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(x + self.table[: x.size(1)])


class Embedding(nn.Module):
    """Token embedding scaled by sqrt(d_model), as in the paper."""

    def __init__(self, vocab: int, d_model: int) -> None:
        super().__init__()
        self.lut = nn.Embedding(vocab, d_model, padding_idx=PAD)
        self.scale = math.sqrt(d_model)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lut(tokens) * self.scale


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.d_k = d_model // heads
        self.w_q = nn.Linear(d_model, d_model)
        self.w_k = nn.Linear(d_model, d_model)
        self.w_v = nn.Linear(d_model, d_model)
        self.w_o = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def _split(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape
        return x.view(batch, length, self.heads, self.d_k).transpose(1, 2)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *,
                mask: torch.Tensor) -> torch.Tensor:
        q = self._split(self.w_q(query))
        k = self._split(self.w_k(key))
        v = self._split(self.w_v(value))
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.d_k)
        scores = scores.masked_fill(mask == 0, -1e9)  # mask: (batch, 1 | tgt, src), 1 = attend
        attention = self.dropout(scores.softmax(dim=-1))
        context = (attention @ v).transpose(1, 2).contiguous()
        return self.w_o(context.view(query.size(0), -1, self.heads * self.d_k))


class FeedForward(nn.Module):
    def __init__(self, d_model: int, d_ff: int, dropout: float) -> None:
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, mask=src_mask)))
        return self.norm2(x + self.dropout(self.ffn(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.dropout)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.heads, cfg.dropout)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.dropout)
        self.norm1 = nn.LayerNorm(cfg.d_model)
        self.norm2 = nn.LayerNorm(cfg.d_model)
        self.norm3 = nn.LayerNorm(cfg.d_model)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
        x = self.norm1(x + self.dropout(self.self_attn(x, x, x, mask=tgt_mask)))
        x = self.norm2(x + self.dropout(self.cross_attn(x, memory, memory, mask=src_mask)))
        return self.norm3(x + self.dropout(self.ffn(x)))


class Encoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(EncoderLayer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor, src_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return x


class Decoder(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.layers))

    def forward(self, x: torch.Tensor, memory: torch.Tensor, src_mask: torch.Tensor,
                tgt_mask: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x, memory, src_mask, tgt_mask)
        return x


class Generator(nn.Module):
    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.log_softmax(self.proj(x), dim=-1)


def causal_mask(length: int, device: torch.device | str = "cpu") -> torch.Tensor:
    return torch.tril(torch.ones(length, length, dtype=torch.bool, device=device))


class Transformer(nn.Module):
    def __init__(self, cfg: Config) -> None:
        super().__init__()
        self.src_embed = Embedding(cfg.vocab, cfg.d_model)
        self.tgt_embed = Embedding(cfg.vocab, cfg.d_model)
        self.src_pos = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.dropout)
        self.tgt_pos = PositionalEncoding(cfg.d_model, cfg.max_len, cfg.dropout)
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)
        self.generator = Generator(cfg.d_model, cfg.vocab)
        for param in self.parameters():  # Xavier, as the reference implementations do
            if param.dim() > 1:
                nn.init.xavier_uniform_(param)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        src_mask = (src != PAD).unsqueeze(1)                              # (batch, 1, src)
        tgt_mask = (tgt != PAD).unsqueeze(1) & causal_mask(tgt.size(1), tgt.device)  # (b, tgt, tgt)
        memory = self.encoder(self.src_pos(self.src_embed(src)), src_mask.unsqueeze(1))
        out = self.decoder(self.tgt_pos(self.tgt_embed(tgt)), memory, src_mask.unsqueeze(1),
                           tgt_mask.unsqueeze(1))
        return self.generator(out)


def make_batch(cfg: Config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A copy-and-reverse translation task with padded tails: (src, tgt_in, tgt_out)."""
    src = torch.randint(3, cfg.vocab, (cfg.batch, cfg.src_len))
    lengths = torch.randint(cfg.src_len // 2, cfg.src_len + 1, (cfg.batch,))
    lengths[0] = cfg.src_len  # at least one full-length sequence
    positions = torch.arange(cfg.src_len)
    src = src.masked_fill(positions >= lengths.unsqueeze(1), PAD)
    tgt = torch.full((cfg.batch, cfg.tgt_len + 1), PAD)
    tgt[:, 0] = 1  # begin-of-sequence
    for row in range(cfg.batch):
        tokens = src[row, : lengths[row]].flip(0)[: cfg.tgt_len]
        tgt[row, 1: 1 + len(tokens)] = tokens
    return src, tgt[:, :-1], tgt[:, 1:]


def build(cfg: Config, *, steps: int = 1, name: str) -> Case:
    seed_everything(SEED)
    model = Transformer(cfg)
    src, tgt_in, tgt_out = make_batch(cfg)

    def loss_fn(log_probs: torch.Tensor) -> torch.Tensor:
        return F.nll_loss(log_probs.reshape(-1, cfg.vocab),
                          tgt_out.reshape(-1).to(log_probs.device), ignore_index=PAD)

    return Case(model=model, inputs=(src, tgt_in), loss_fn=loss_fn, seed=SEED, steps=steps,
                optimizer=lambda params: torch.optim.Adam(params, lr=1e-3), name=name)


def reference() -> Case:
    """d_model 64, 4 heads, 2+2 layers, batch 8, length 12: captures in about a second."""
    return build(Config(), name="reference_models.transformer:reference")


def reference_steps() -> Case:
    """The reference over 3 optimizer steps."""
    return build(Config(), steps=3, name="reference_models.transformer:reference_steps")


def reference_large() -> Case:
    """Benchmark size: d_model 256, 8 heads, 4+4 layers, batch 8, length 128."""
    cfg = Config(d_model=256, heads=8, d_ff=1024, layers=4, src_len=128, tgt_len=128)
    return build(cfg, name="reference_models.transformer:reference_large")
