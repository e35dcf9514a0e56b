"""An independent port of the translation transformer, written the way a modern codebase would:
a fused QKV projection held by the attention module itself (like torch.nn.MultiheadAttention's
``in_proj_weight``), heads split with one permute, ``scaled_dot_product_attention``, the
feed-forward as an ``nn.Sequential``, and one positional-encoding module called for source and
target (sites ``pos#0`` and ``pos#1``). Module names and structure differ from the reference's;
:func:`from_reference` is the weight mapping, written out.

Planted bugs, each one line away from a correct version (see the catalog for sites):
- ``bug_softmax_axis``: the hand-written attention kernel normalizes over queries, not keys;
- ``bug_missing_scale``: the hand-written kernel drops the 1/sqrt(d_k) scaling;
- ``bug_inverted_mask``: the hand-written kernel fills where the mask says *attend*
  (the nn.MultiheadAttention convention, True = masked, carried over by mistake);
- ``bug_head_split_reshape``: heads split with a reshape where a permute is needed, which mixes
  positions and batch elements;
- ``bug_layernorm_eps``: layer norms built with Keras's epsilon, 1e-3 instead of 1e-5.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case

from . import transformer
from .porting import port_case
from .transformer import PAD, Config, causal_mask

Kernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


# ---- attention kernels: (batch, heads, length, d_k) queries, keys, values; mask True = attend
def sdpa_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def manual_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  mask: torch.Tensor) -> torch.Tensor:
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~mask, -1e9)
    return scores.softmax(dim=-1) @ v


def softmax_axis_kernel(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(~mask, -1e9)
    return scores.softmax(dim=-2) @ v  # BUG: normalizes over queries


def missing_scale_kernel(q, k, v, mask):
    scores = q @ k.transpose(-2, -1)  # BUG: no 1/sqrt(d_k)
    scores = scores.masked_fill(~mask, -1e9)
    return scores.softmax(dim=-1) @ v


def inverted_mask_kernel(q, k, v, mask):
    scores = (q @ k.transpose(-2, -1)) * q.size(-1) ** -0.5
    scores = scores.masked_fill(mask, -1e9)  # BUG: True meant "masked" where this came from
    return scores.softmax(dim=-1) @ v


# ---- splitting (batch, length, parts * d_model) into `parts` tensors (batch, heads, length, d_k)
def permute_split(x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    batch, length, width = x.shape
    d_k = width // (parts * heads)
    return x.view(batch, length, parts, heads, d_k).permute(2, 0, 3, 1, 4).unbind(0)


def reshape_split(x: torch.Tensor, parts: int, heads: int) -> tuple[torch.Tensor, ...]:
    batch, length, width = x.shape
    d_k = width // (parts * heads)
    return x.reshape(parts, batch, heads, length, d_k).unbind(0)  # BUG: mixes the axes


Split = Callable[[torch.Tensor, int, int], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class PortOptions:
    """The choices a bug variant changes."""

    kernel: Kernel = sdpa_kernel
    split: Split = permute_split
    norm_eps: float = 1e-5


class Attention(nn.Module):
    """Multi-head attention with the q, k, v projections fused into one matrix."""

    def __init__(self, d_model: int, heads: int, opts: PortOptions) -> None:
        super().__init__()
        self.heads, self.opts = heads, opts
        self.in_proj_weight = nn.Parameter(torch.empty(3 * d_model, d_model))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * d_model))
        self.out_proj_weight = nn.Parameter(torch.empty(d_model, d_model))
        self.out_proj_bias = nn.Parameter(torch.empty(d_model))

    def forward(self, x: torch.Tensor, memory: torch.Tensor | None = None, *,
                mask: torch.Tensor) -> torch.Tensor:
        split, heads = self.opts.split, self.heads
        if memory is None:  # self-attention: one product gives q, k and v
            q, k, v = split(F.linear(x, self.in_proj_weight, self.in_proj_bias), 3, heads)
        else:  # cross-attention: q from x, k and v from the encoder's memory
            d_model = x.size(-1)
            w_q, w_kv = self.in_proj_weight.split([d_model, 2 * d_model])
            b_q, b_kv = self.in_proj_bias.split([d_model, 2 * d_model])
            (q,) = split(F.linear(x, w_q, b_q), 1, heads)
            k, v = split(F.linear(memory, w_kv, b_kv), 2, heads)
        context = self.opts.kernel(q, k, v, mask).transpose(1, 2).flatten(2)
        return F.linear(context, self.out_proj_weight, self.out_proj_bias)


class Block(nn.Module):
    """Post-norm encoder block (``cross=False``) or decoder block (``cross=True``)."""

    def __init__(self, cfg: Config, opts: PortOptions, *, cross: bool) -> None:
        super().__init__()
        self.self_attn = Attention(cfg.d_model, cfg.heads, opts)
        self.ln1 = nn.LayerNorm(cfg.d_model, eps=opts.norm_eps)
        if cross:
            self.cross_attn = Attention(cfg.d_model, cfg.heads, opts)
            self.ln_cross = nn.LayerNorm(cfg.d_model, eps=opts.norm_eps)
        self.mlp = nn.Sequential(nn.Linear(cfg.d_model, cfg.d_ff), nn.ReLU(),
                                 nn.Linear(cfg.d_ff, cfg.d_model))
        self.ln2 = nn.LayerNorm(cfg.d_model, eps=opts.norm_eps)

    def forward(self, x: torch.Tensor, self_mask: torch.Tensor,
                memory: torch.Tensor | None = None,
                memory_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = self.ln1(x + self.self_attn(x, mask=self_mask))
        if memory is not None:
            x = self.ln_cross(x + self.cross_attn(x, memory, mask=memory_mask))
        return self.ln2(x + self.mlp(x))


class SinusoidalPositions(nn.Module):
    """Adds sin/cos positions computed on the fly (the reference keeps a table)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        length, d_model = x.shape[-2:]
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d_model, 2, dtype=x.dtype) / d_model))
        angles = torch.arange(length, dtype=x.dtype).unsqueeze(1) * inv_freq
        return x + torch.stack([angles.sin(), angles.cos()], dim=-1).flatten(-2)


class TransformerPort(nn.Module):
    def __init__(self, cfg: Config, opts: PortOptions | None = None) -> None:
        super().__init__()
        opts = opts or PortOptions()
        self.scale = math.sqrt(cfg.d_model)
        self.embed_src = nn.Embedding(cfg.vocab, cfg.d_model, padding_idx=PAD)
        self.embed_tgt = nn.Embedding(cfg.vocab, cfg.d_model, padding_idx=PAD)
        self.pos = SinusoidalPositions()
        self.enc = nn.ModuleList(Block(cfg, opts, cross=False) for _ in range(cfg.layers))
        self.dec = nn.ModuleList(Block(cfg, opts, cross=True) for _ in range(cfg.layers))
        self.out = nn.Linear(cfg.d_model, cfg.vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        # masks as (batch, 1, 1 | tgt, src) booleans, True = attend, like the reference's
        src_mask = (src != PAD)[:, None, None, :]
        tgt_mask = (tgt != PAD)[:, None, None, :] & causal_mask(tgt.size(1), tgt.device)
        x = self.pos(self.embed_src(src) * self.scale)
        for block in self.enc:
            x = block(x, src_mask)
        y = self.pos(self.embed_tgt(tgt) * self.scale)
        for block in self.dec:
            y = block(y, tgt_mask, x, src_mask)
        return self.out(y).log_softmax(dim=-1)


def from_reference(port: TransformerPort, ref: transformer.Transformer) -> TransformerPort:
    """Load the reference's weights into the port: the mapping between them, written out."""
    ref_state = ref.state_dict()
    state: dict[str, torch.Tensor] = {}

    def attention(port_prefix: str, ref_prefix: str) -> None:
        parts = [f"{ref_prefix}.w_{p}" for p in "qkv"]
        state[f"{port_prefix}.in_proj_weight"] = torch.cat([ref_state[f"{p}.weight"]
                                                            for p in parts])
        state[f"{port_prefix}.in_proj_bias"] = torch.cat([ref_state[f"{p}.bias"] for p in parts])
        state[f"{port_prefix}.out_proj_weight"] = ref_state[f"{ref_prefix}.w_o.weight"]
        state[f"{port_prefix}.out_proj_bias"] = ref_state[f"{ref_prefix}.w_o.bias"]

    def copy(port_name: str, ref_name: str) -> None:
        for leaf in ("weight", "bias"):
            if f"{ref_name}.{leaf}" in ref_state:
                state[f"{port_name}.{leaf}"] = ref_state[f"{ref_name}.{leaf}"]

    copy("embed_src", "src_embed.lut")
    copy("embed_tgt", "tgt_embed.lut")
    copy("out", "generator.proj")
    for side, ref_side in (("enc", "encoder"), ("dec", "decoder")):
        for i, _ in enumerate(getattr(port, side)):
            p, r = f"{side}.{i}", f"{ref_side}.layers.{i}"
            attention(f"{p}.self_attn", f"{r}.self_attn")
            copy(f"{p}.ln1", f"{r}.norm1")
            copy(f"{p}.mlp.0", f"{r}.ffn.w_1")
            copy(f"{p}.mlp.2", f"{r}.ffn.w_2")
            if side == "dec":
                attention(f"{p}.cross_attn", f"{r}.cross_attn")
                copy(f"{p}.ln_cross", f"{r}.norm2")
                copy(f"{p}.ln2", f"{r}.norm3")
            else:
                copy(f"{p}.ln2", f"{r}.norm2")
    port.load_state_dict(state, strict=True)
    return port


def _case(name: str, opts: PortOptions | None = None) -> Case:
    return port_case(transformer.reference,
                     lambda ref: from_reference(TransformerPort(Config(), opts), ref),
                     f"reference_models.transformer_port:{name}")


def port() -> Case:
    """The port as it should be: fused QKV and scaled_dot_product_attention."""
    return _case("port")


def port_manual() -> Case:
    """The port with the attention kernel written out by hand (correct)."""
    return _case("port_manual", PortOptions(kernel=manual_kernel))


def bug_softmax_axis() -> Case:
    return _case("bug_softmax_axis", PortOptions(kernel=softmax_axis_kernel))


def bug_missing_scale() -> Case:
    return _case("bug_missing_scale", PortOptions(kernel=missing_scale_kernel))


def bug_inverted_mask() -> Case:
    return _case("bug_inverted_mask", PortOptions(kernel=inverted_mask_kernel))


def bug_head_split_reshape() -> Case:
    return _case("bug_head_split_reshape", PortOptions(split=reshape_split))


def bug_layernorm_eps() -> Case:
    return _case("bug_layernorm_eps", PortOptions(norm_eps=1e-3))
