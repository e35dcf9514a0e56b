"""A second set of planted bugs for the hints of issue 29, written after the hint rules and
measured once, with no rule changed after (scripts/hint_rates.py --heldout; docs/diff.md has
the outcome). Each is the same class of mistake as one of reference_models/hint_bugs_real.py in
another model, layout or place, so that the rates say how general the rules are:

- ``llama_rotary_q_only`` (rotary): the port rotates q but not k;
- ``llama_rope_offset``: positions counted from 1 (a cache offset off by one). Not a bug a
  diff can see: RoPE's scores depend on q and k's relative position only, so every output
  agrees; only the rotary tables differ (kept as a case, not measured);
- ``gqa_tiled`` (permutation): a GQA attention with no rotary embedding tiles its kv heads;
- ``conv_relu_for_gelu_tanh`` (activation): a conv net's activation module is ReLU where the
  reference's is tanh-GELU, on (batch, channels, h, w) tensors;
- ``gated_sigmoid_for_silu`` (activation): a gated MLP's gate uses sigmoid(x) for x sigmoid(x);
- ``rmsnorm_backward_batch`` (axis): a custom RMS norm whose backward's mean is over the batch
  and the features;
- ``lstm_seq_first_gate_order`` (permutation): a sequence-first LSTM by hand reading the gates
  (f, i, g, o);
- ``attention_residual_dropped`` (missing-term): a block whose attention sublayer lost its
  ``x +`` while its MLP sublayer kept it;
- ``token_mask_backward`` (mask): a token mask applied by a custom Function whose backward
  lets gradient through to the padding positions.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

from . import llama_port
from .hint_bugs import PlantedHint
from .hint_bugs_real import HF, HIDDEN, LLAMA_MAP
from .porting import copy_state

MODULE = "reference_models.hint_bugs_heldout"
WIDTH, BATCH, LENGTH = 32, 4, 10


def _case(model: nn.Module, name: str, x: torch.Tensor, classes: int,
          targets: tuple[int, ...] | None = None) -> Case:
    y = torch.randint(0, classes, targets or x.shape[:2])

    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))

    return Case(model=model, inputs=(x,), loss_fn=loss_fn, seed=0, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{MODULE}:{name}")


def _ported(reference: Case, name: str, port: nn.Module) -> Case:
    return dataclasses.replace(reference, model=copy_state(port, reference.model),
                               name=f"{MODULE}:{name}")


# ---- Llama rotary


class RotateQOnly(llama_port.Attention):
    def rotary(self, xq, xk, freqs_cos, freqs_sin):
        xq_rotated, _ = llama_port.apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)
        return xq_rotated, xk  # BUG: k is never rotated


def _llama(name: str, path: str, cls: type[nn.Module]) -> Case:
    case = dataclasses.replace(llama_port.port(), name=f"{MODULE}:{name}")
    case.model.get_submodule(path).__class__ = cls
    return case


def llama_rotary_q_only() -> Case:
    return _llama("llama_rotary_q_only", "layers.0.attention", RotateQOnly)


def llama_rope_offset() -> Case:
    case = dataclasses.replace(llama_port.port(), name=f"{MODULE}:llama_rope_offset")
    cos, sin = case.model.freqs_cos.clone(), case.model.freqs_sin.clone()
    case.model.freqs_cos[:-1].copy_(cos[1:])  # BUG: position p rotated as p + 1
    case.model.freqs_sin[:-1].copy_(sin[1:])
    return case


# ---- grouped-query attention without rotation


class GQA(nn.Module):
    def __init__(self, heads: int = 8, kv_heads: int = 2, tile: bool = False) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.tile = heads, kv_heads, tile
        self.d = WIDTH // heads
        self.q = nn.Linear(WIDTH, WIDTH)
        self.k = nn.Linear(WIDTH, kv_heads * self.d)
        self.v = nn.Linear(WIDTH, kv_heads * self.d)
        self.o = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        q = self.q(x).view(b, length, self.heads, self.d).transpose(1, 2)
        k = self.k(x).view(b, length, self.kv_heads, self.d).transpose(1, 2)
        v = self.v(x).view(b, length, self.kv_heads, self.d).transpose(1, 2)
        rep = self.heads // self.kv_heads
        if self.tile:  # BUG: kv heads 0,1,0,1,... where each belongs to rep query heads
            k, v = k.repeat(1, rep, 1, 1), v.repeat(1, rep, 1, 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, length, WIDTH))


class GQAModel(nn.Module):
    def __init__(self, tile: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.attn = GQA(tile=tile)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.attn(h))


def gqa_reference() -> Case:
    seed_everything(1)
    return _case(GQAModel(), "gqa_reference", torch.randn(BATCH, LENGTH, WIDTH), 5)


def gqa_tiled() -> Case:
    return _ported(gqa_reference(), "gqa_tiled", GQAModel(tile=True))


# ---- activations


class ConvNet(nn.Module):
    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.act = act or nn.GELU(approximate="tanh")
        self.conv2 = nn.Conv2d(8, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.conv2(self.act(self.conv1(x))).mean((2, 3))[:, None, :]


def conv_reference() -> Case:
    seed_everything(2)
    return _case(ConvNet(), "conv_reference", torch.randn(BATCH, 3, 8, 8), 4, (BATCH, 1))


def conv_relu_for_gelu_tanh() -> Case:
    return _ported(conv_reference(), "conv_relu_for_gelu_tanh", ConvNet(nn.ReLU()))


class GatedMLP(nn.Module):
    def __init__(self, sigmoid_gate: bool = False) -> None:
        super().__init__()
        self.gate = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.up = nn.Linear(WIDTH, 2 * WIDTH, bias=False)
        self.down = nn.Linear(2 * WIDTH, WIDTH, bias=False)
        self.sigmoid_gate = sigmoid_gate

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        g = self.gate(x)
        act = torch.sigmoid(g) if self.sigmoid_gate else g * torch.sigmoid(g)  # BUG: no g *
        return self.down(act * self.up(x))


class GatedModel(nn.Module):
    def __init__(self, sigmoid_gate: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.mlp = GatedMLP(sigmoid_gate)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + self.mlp(self.norm(x)))


def gated_reference() -> Case:
    seed_everything(3)
    return _case(GatedModel(), "gated_reference", torch.randn(BATCH, LENGTH, WIDTH), 5)


def gated_sigmoid_for_silu() -> Case:
    return _ported(gated_reference(), "gated_sigmoid_for_silu", GatedModel(sigmoid_gate=True))


# ---- an RMS norm with a hand-written backward


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, axes):
        rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x * rstd, rstd, weight)
        ctx.axes = axes
        return x * rstd * weight

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        gw = grad * weight
        dx = rstd * (gw - xhat * (gw * xhat).mean(ctx.axes, keepdim=True))
        return dx, (grad * xhat).sum(tuple(range(grad.ndim - 1))), None, None


class RMSNorm(nn.Module):
    def __init__(self, axes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(WIDTH) + 0.1 * torch.randn(WIDTH))
        self.axes = axes

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.axes is None:  # the reference: autograd's own backward
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return RMSNormFunction.apply(x, self.weight, 1e-6, self.axes)


class NormModel(nn.Module):
    def __init__(self, axes: tuple[int, ...] | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.norm = RMSNorm(axes)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.norm(self.inp(x))))


def norm_reference() -> Case:
    seed_everything(4)
    return _case(NormModel(), "norm_reference", torch.randn(BATCH, LENGTH, WIDTH), 5)


def rmsnorm_backward_batch() -> Case:
    return _ported(norm_reference(), "rmsnorm_backward_batch", NormModel((0, -1)))


# ---- a sequence-first LSTM by hand


class SeqFirstLSTM(nn.Module):
    def __init__(self, order: str = "ifgo") -> None:
        super().__init__()
        self.weight_ih_l0 = nn.Parameter(torch.empty(4 * HIDDEN, WIDTH))
        self.weight_hh_l0 = nn.Parameter(torch.empty(4 * HIDDEN, HIDDEN))
        self.bias_ih_l0 = nn.Parameter(torch.empty(4 * HIDDEN))
        self.bias_hh_l0 = nn.Parameter(torch.empty(4 * HIDDEN))
        self.order = order

    def forward(self, x: torch.Tensor):
        h = x.new_zeros(x.shape[1], HIDDEN)
        c = torch.zeros_like(h)
        out = []
        for step in x:  # (length, batch, features)
            z = step @ self.weight_ih_l0.T + self.bias_ih_l0 + h @ self.weight_hh_l0.T \
                + self.bias_hh_l0
            gates = dict(zip(self.order, z.chunk(4, -1), strict=True))
            c = gates["f"].sigmoid() * c + gates["i"].sigmoid() * gates["g"].tanh()
            h = gates["o"].sigmoid() * c.tanh()
            out.append(h)
        return torch.stack(out), (h[None], c[None])


class SeqModel(nn.Module):
    def __init__(self, rnn: nn.Module) -> None:
        super().__init__()
        self.rnn = rnn
        self.head = nn.Linear(HIDDEN, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x.transpose(0, 1))[0].transpose(0, 1))


def lstm_seq_first_reference() -> Case:
    seed_everything(5)
    model = SeqModel(nn.LSTM(WIDTH, HIDDEN))
    return _case(model, "lstm_seq_first_reference", torch.randn(BATCH, LENGTH, WIDTH), 3)


def lstm_seq_first_gate_order() -> Case:
    # BUG: (f, i, g, o), forget gate first
    return _ported(lstm_seq_first_reference(), "lstm_seq_first_gate_order",
                   SeqModel(SeqFirstLSTM("figo")))


# ---- a block whose attention sublayer lost its residual


class Block(nn.Module):
    def __init__(self, attention_residual: bool = True) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = nn.MultiheadAttention(WIDTH, 4, batch_first=True)
        self.ln2 = nn.LayerNorm(WIDTH)
        self.fc = nn.Linear(WIDTH, WIDTH)
        self.attention_residual = attention_residual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        a = self.attn(h, h, h, need_weights=False)[0]
        x = x + a if self.attention_residual else a  # BUG when False
        return x + self.fc(F.gelu(self.ln2(x)))


class BlockModel(nn.Module):
    def __init__(self, attention_residual: bool = True) -> None:
        super().__init__()
        self.block = Block(attention_residual)
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def block_reference() -> Case:
    seed_everything(6)
    return _case(BlockModel(), "block_reference", torch.randn(BATCH, LENGTH, WIDTH), 5)


def attention_residual_dropped() -> Case:
    return _ported(block_reference(), "attention_residual_dropped", BlockModel(False))


# ---- a token mask whose backward leaks to padding


class LeakyMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep):
        return x * keep[..., None].to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None  # BUG: the padding positions get gradient


class TokenMask(nn.Module):
    def __init__(self, leaky: bool = False) -> None:
        super().__init__()
        self.leaky = leaky

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        if self.leaky:
            return LeakyMask.apply(x, keep)
        return x * keep[..., None].to(x.dtype)


class Tagger(nn.Module):
    def __init__(self, leaky: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(30, WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.mask = TokenMask(leaky)
        self.head = nn.Linear(WIDTH, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.proj(self.embed(tokens)))
        h = self.mask(h, tokens != 0)
        return self.head(h + h.mean(1, keepdim=True))


def tagger_reference() -> Case:
    seed_everything(7)
    tokens = torch.randint(1, 30, (BATCH, LENGTH))
    lengths = torch.tensor([10, 6, 8, 3])
    tokens[torch.arange(LENGTH)[None, :] >= lengths[:, None]] = 0
    return _case(Tagger(), "tagger_reference", tokens, 4)


def token_mask_backward() -> Case:
    return _ported(tagger_reference(), "token_mask_backward", Tagger(leaky=True))


def _bug(name: str, reference: str, kind: str, description: str,
         mapping: str | None = None) -> PlantedHint:
    return PlantedHint(f"{MODULE}:{name}", reference, "", "", kind, description, mapping)


BUGS: list[PlantedHint] = [
    _bug("llama_rotary_q_only", HF, "rotary", "q rotated, k not", LLAMA_MAP),
    _bug("gqa_tiled", f"{MODULE}:gqa_reference", "permutation", "kv heads tiled, no rotary"),
    _bug("conv_relu_for_gelu_tanh", f"{MODULE}:conv_reference", "activation",
         "ReLU for tanh-GELU in a conv net"),
    _bug("gated_sigmoid_for_silu", f"{MODULE}:gated_reference", "activation",
         "a gate of sigmoid(x) for x sigmoid(x)"),
    _bug("rmsnorm_backward_batch", f"{MODULE}:norm_reference", "axis",
         "an RMS norm backward whose mean is over the batch too"),
    _bug("lstm_seq_first_gate_order", f"{MODULE}:lstm_seq_first_reference", "permutation",
         "a sequence-first LSTM reading (f, i, g, o)"),
    _bug("attention_residual_dropped", f"{MODULE}:block_reference", "missing-term",
         "the attention sublayer's residual add dropped"),
    _bug("token_mask_backward", f"{MODULE}:tagger_reference", "mask",
         "a token mask whose backward lets gradient through to padding"),
]
