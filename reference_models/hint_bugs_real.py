"""Planted bugs for measuring the hints on the mistakes real ports have (issue 29), written
apart from the hint code they measure: each is the bug as a porter writes it, not an error
shaped to fit a hint.

Against the Hugging Face Llama (``reference_models.hf_llama:reference``), ports of
``reference_models.llama_port``:
- ``llama_no_rope_permutation`` (rotary): the faithful port loaded through a mapping that
  forgets the per-head row permutation of wq/wk (``hf_llama_noperm.map.toml``);
- ``llama_rope_theta`` (rotary): the port's rotary tables made with base 500000, not 10000;
- ``llama_gqa_tiled`` (permutation): key/value heads tiled (``repeat(1, 1, n_rep, 1)``) where
  each should be repeated in place (``repeat_interleave``);
- ``llama_relu_gate`` (activation): the feed-forward gate is ReLU, not SiLU.

Small models of their own (a reference and its buggy port, weights copied by name):
- ``residual_dropped`` (missing-term): a pre-norm block returns f(x) without the ``x +``;
- ``residual_dropped_in_loop`` (missing-term): the model's loop ``h = h + block(h)`` written
  ``h = block(h)``;
- ``layernorm_backward_batch`` (axis): a custom autograd LayerNorm whose backward takes its
  two means over the batch and the features instead of the features alone;
- ``embedding_padding_grad`` (mask): the embedding drops ``padding_idx``, so the padding row
  receives gradient;
- ``masked_pool_backward`` (mask): a masked mean-pool as a custom Function whose backward
  forgets the mask, so padding positions receive gradient;
- ``lstm_gate_order`` (permutation): a hand-written LSTM splits the gates as (i, f, o, g)
  where torch's weights hold (i, f, g, o);
- ``gru_gate_order`` (permutation): a hand-written GRU takes (z, r, n) where torch's weights
  hold (r, z, n);
- ``mlp_silu_for_gelu`` (activation): an activation module that is SiLU where GELU belongs.

:data:`BUGS` lists them as :class:`reference_models.hint_bugs.PlantedHint`.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

from . import llama_port
from .hint_bugs import PlantedHint
from .porting import copy_state

MODULE = "reference_models.hint_bugs_real"
HF = "reference_models.hf_llama:reference"


# ---- ports of the Hugging Face Llama

def _llama(name: str) -> Case:
    return dataclasses.replace(llama_port.port(), name=f"{MODULE}:{name}")


def llama_no_rope_permutation() -> Case:
    """The faithful port: its bug is the mapping it is loaded through."""
    return _llama("llama_no_rope_permutation")


def llama_rope_theta() -> Case:
    case = _llama("llama_rope_theta")
    args = case.model.params
    cos, sin = llama_port.precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len,
                                               500000.0)  # BUG: the config says 10000
    case.model.freqs_cos.copy_(cos)
    case.model.freqs_sin.copy_(sin)
    return case


def tile_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    return x if n_rep == 1 else x.repeat(1, 1, n_rep, 1)  # BUG: heads 0,1,0,1 not 0,0,1,1


class TiledKVAttention(llama_port.Attention):
    def forward(self, x, freqs_cos, freqs_sin):
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = self.rotary(xq, xk, freqs_cos, freqs_sin)
        xk, xv = tile_kv(xk, self.n_rep), tile_kv(xv, self.n_rep)
        xq, xk, xv = xq.transpose(1, 2), xk.transpose(1, 2), xv.transpose(1, 2)
        scores = self.scores(xq, xk) + self.mask[:, :, :seqlen, :seqlen]
        output = F.softmax(scores.float(), dim=-1).type_as(xq) @ xv
        return self.wo(output.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class ReLUGate(llama_port.FeedForward):
    def act(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x)  # BUG: Llama's gate is SiLU


def _llama_planted(name: str, path: str, cls: type[nn.Module]) -> Case:
    case = _llama(name)
    case.model.get_submodule(path).__class__ = cls
    return case


def llama_gqa_tiled() -> Case:
    return _llama_planted("llama_gqa_tiled", "layers.0.attention", TiledKVAttention)


def llama_relu_gate() -> Case:
    return _llama_planted("llama_relu_gate", "layers.1.feed_forward", ReLUGate)


# ---- a residual stack

WIDTH, BATCH, LENGTH = 24, 6, 8


class Block(nn.Module):
    def __init__(self, residual: bool = True) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(2 * WIDTH, WIDTH)
        self.residual = residual

    def branch(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(self.norm(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.branch(x) if self.residual else self.branch(x)


class Stack(nn.Module):
    """Blocks whose residual add is inside them (``inner``) or in this loop."""

    def __init__(self, inner: bool = True, loop_add: tuple[bool, ...] = (True, True, True)
                 ) -> None:
        super().__init__()
        self.inp = nn.Linear(WIDTH, WIDTH)
        self.blocks = nn.ModuleList(Block(residual=inner) for _ in range(3))
        self.inner, self.loop_add = inner, loop_add
        self.head = nn.Linear(WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block, add in zip(self.blocks, self.loop_add, strict=True):
            h = block(h) if self.inner or not add else h + block(h)
        return self.head(h)


def _small_case(model: nn.Module, name: str, inputs: tuple, targets: torch.Tensor) -> Case:
    def loss_fn(out: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.reshape(-1, out.shape[-1]), targets.reshape(-1))

    return Case(model=model, inputs=inputs, loss_fn=loss_fn, seed=0, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1), name=name)


def _stack_case(name: str, **kwargs) -> Case:
    seed_everything(0)
    model = Stack(**kwargs)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    y = torch.randint(0, 5, (BATCH, LENGTH))
    return _small_case(model, f"{MODULE}:{name}", (x,), y)


def stack_reference() -> Case:
    return _stack_case("stack_reference")


def stack_loop_reference() -> Case:
    return _stack_case("stack_loop_reference", inner=False)


def _ported(reference: Case, name: str, port: nn.Module) -> Case:
    return dataclasses.replace(reference, model=copy_state(port, reference.model),
                               name=f"{MODULE}:{name}")


def residual_dropped() -> Case:
    port = Stack()
    port.blocks[1].residual = False  # BUG: the block returns its branch alone
    return _ported(stack_reference(), "residual_dropped", port)


def residual_dropped_in_loop() -> Case:
    port = Stack(inner=False, loop_add=(True, False, True))  # BUG: h = block(h) in layer 1
    return _ported(stack_loop_reference(), "residual_dropped_in_loop", port)


# ---- a layer norm with a hand-written backward

class LayerNormFunction(torch.autograd.Function):
    """y = (x - mean) / sqrt(var + eps) * w + b over the last axis; ``reduce`` names the axes
    the backward's two means are taken over."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, reduce):
        mean = x.mean(-1, keepdim=True)
        rstd = torch.rsqrt(x.var(-1, unbiased=False, keepdim=True) + eps)
        xhat = (x - mean) * rstd
        ctx.save_for_backward(xhat, rstd, weight)
        ctx.reduce = reduce
        return xhat * weight + bias

    @staticmethod
    def backward(ctx, grad):
        xhat, rstd, weight = ctx.saved_tensors
        g = grad * weight
        axes = ctx.reduce
        dx = rstd * (g - g.mean(axes, keepdim=True)
                     - xhat * (g * xhat).mean(axes, keepdim=True))
        lead = tuple(range(grad.ndim - 1))
        return dx, (grad * xhat).sum(lead), grad.sum(lead), None, None


class FunctionLayerNorm(nn.LayerNorm):
    def __init__(self, width: int, reduce: tuple[int, ...]) -> None:
        super().__init__(width)
        self.reduce = reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return LayerNormFunction.apply(x, self.weight, self.bias, self.eps, self.reduce)


def layernorm_backward_batch() -> Case:
    reference = stack_reference()
    port = Stack()
    port.blocks[2].norm = FunctionLayerNorm(WIDTH, (0, -1))  # BUG: the batch axis too: (-1,)
    return _ported(reference, "layernorm_backward_batch", port)


# ---- padding

VOCAB, PAD = 20, 0


class MaskedPool(torch.autograd.Function):
    """The mean over the positions the mask keeps; ``forget`` drops the mask in backward."""

    @staticmethod
    def forward(ctx, x, keep, forget):
        weights = keep.to(x.dtype) / keep.sum(1, keepdim=True).to(x.dtype)
        ctx.save_for_backward(weights)
        ctx.forget = forget
        return (x * weights[..., None]).sum(1)

    @staticmethod
    def backward(ctx, grad):
        (weights,) = ctx.saved_tensors
        if ctx.forget:  # BUG: every position gets the gradient, padding included
            weights = torch.ones_like(weights) / weights.shape[1]
        return grad[:, None, :] * weights[..., None], None, None


class Pool(nn.Module):
    def __init__(self, forget: bool = False) -> None:
        super().__init__()
        self.forget = forget

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        return MaskedPool.apply(x, keep, self.forget)


class Classifier(nn.Module):
    def __init__(self, padding_idx: int | None = PAD, forget: bool = False,
                 pool_mask: bool = True) -> None:
        super().__init__()
        self.pool_mask = pool_mask
        self.embed = nn.Embedding(VOCAB, WIDTH, padding_idx=padding_idx)
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.pool = Pool(forget)
        self.head = nn.Linear(WIDTH, 3)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        keep = tokens != PAD if self.pool_mask else torch.ones_like(tokens, dtype=torch.bool)
        return self.head(self.pool(torch.tanh(self.proj(self.embed(tokens))), keep))


def classifier_reference(pool_mask: bool = True) -> Case:
    seed_everything(0)
    model = Classifier(pool_mask=pool_mask)
    lengths = torch.tensor([10, 7, 4, 9, 2, 6])
    tokens = torch.randint(1, VOCAB, (BATCH, 10))
    tokens[torch.arange(10)[None, :] >= lengths[:, None]] = PAD
    name = "classifier_reference" if pool_mask else "bag_reference"
    return _small_case(model, f"{MODULE}:{name}", (tokens,), torch.randint(0, 3, (BATCH,)))


def bag_reference() -> Case:
    """The classifier pooling every position, padding included (its pad row is zero and
    learns nothing: padding_idx)."""
    return classifier_reference(pool_mask=False)


def embedding_padding_grad() -> Case:
    # BUG: padding_idx dropped; the pad row (zero, as the reference's) now learns
    return _ported(bag_reference(), "embedding_padding_grad", Classifier(None, pool_mask=False))


def masked_pool_backward() -> Case:
    return _ported(classifier_reference(), "masked_pool_backward", Classifier(forget=True))


# ---- recurrent cells by hand

HIDDEN = 12


class Recurrent(nn.Module):
    def __init__(self, cell: nn.Module) -> None:
        super().__init__()
        self.rnn = cell
        self.head = nn.Linear(HIDDEN, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(x)[0])


class HandLSTM(nn.Module):
    """nn.LSTM's parameters (batch_first), the loop by hand with the gates split as ``order``."""

    def __init__(self, order: str = "ifgo") -> None:
        super().__init__()
        self.weight_ih_l0 = nn.Parameter(torch.empty(4 * HIDDEN, WIDTH))
        self.weight_hh_l0 = nn.Parameter(torch.empty(4 * HIDDEN, HIDDEN))
        self.bias_ih_l0 = nn.Parameter(torch.empty(4 * HIDDEN))
        self.bias_hh_l0 = nn.Parameter(torch.empty(4 * HIDDEN))
        self.order = order

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        h = x.new_zeros(x.shape[0], HIDDEN)
        c = x.new_zeros(x.shape[0], HIDDEN)
        outputs = []
        for t in range(x.shape[1]):
            gates = (F.linear(x[:, t], self.weight_ih_l0, self.bias_ih_l0)
                     + F.linear(h, self.weight_hh_l0, self.bias_hh_l0))
            parts = dict(zip(self.order, gates.chunk(4, 1), strict=True))
            c = torch.sigmoid(parts["f"]) * c + torch.sigmoid(parts["i"]) * torch.tanh(
                parts["g"])
            h = torch.sigmoid(parts["o"]) * torch.tanh(c)
            outputs.append(h)
        return torch.stack(outputs, 1), (h[None], c[None])


class HandGRU(nn.Module):
    def __init__(self, order: str = "rzn") -> None:
        super().__init__()
        self.weight_ih_l0 = nn.Parameter(torch.empty(3 * HIDDEN, WIDTH))
        self.weight_hh_l0 = nn.Parameter(torch.empty(3 * HIDDEN, HIDDEN))
        self.bias_ih_l0 = nn.Parameter(torch.empty(3 * HIDDEN))
        self.bias_hh_l0 = nn.Parameter(torch.empty(3 * HIDDEN))
        self.order = order

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = x.new_zeros(x.shape[0], HIDDEN)
        outputs = []
        for t in range(x.shape[1]):
            gi = dict(zip(self.order, F.linear(x[:, t], self.weight_ih_l0,
                                               self.bias_ih_l0).chunk(3, 1), strict=True))
            gh = dict(zip(self.order, F.linear(h, self.weight_hh_l0,
                                               self.bias_hh_l0).chunk(3, 1), strict=True))
            r = torch.sigmoid(gi["r"] + gh["r"])
            z = torch.sigmoid(gi["z"] + gh["z"])
            n = torch.tanh(gi["n"] + r * gh["n"])
            h = (1 - z) * n + z * h
            outputs.append(h)
        return torch.stack(outputs, 1), h[None]


def _recurrent_reference(kind: str) -> Case:
    seed_everything(0)
    cell = (nn.LSTM if kind == "lstm" else nn.GRU)(WIDTH, HIDDEN, batch_first=True)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _small_case(Recurrent(cell), f"{MODULE}:{kind}_reference", (x,),
                       torch.randint(0, 4, (BATCH, LENGTH)))


def lstm_reference() -> Case:
    return _recurrent_reference("lstm")


def gru_reference() -> Case:
    return _recurrent_reference("gru")


def lstm_gate_order() -> Case:
    # BUG: (i, f, o, g), the order of Keras/ONNX-style code, where torch's is (i, f, g, o)
    return _ported(lstm_reference(), "lstm_gate_order", Recurrent(HandLSTM("ifog")))


def gru_gate_order() -> Case:
    # BUG: update gate first, (z, r, n), where torch's weights hold (r, z, n)
    return _ported(gru_reference(), "gru_gate_order", Recurrent(HandGRU("zrn")))


# ---- an activation module

class ActMLP(nn.Module):
    def __init__(self, act: nn.Module | None = None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = act or nn.GELU()
        self.fc2 = nn.Linear(2 * WIDTH, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def act_mlp_reference() -> Case:
    seed_everything(0)
    x = torch.randn(BATCH, LENGTH, WIDTH)
    return _small_case(ActMLP(), f"{MODULE}:act_mlp_reference", (x,),
                       torch.randint(0, 5, (BATCH, LENGTH)))


def mlp_silu_for_gelu() -> Case:
    return _ported(act_mlp_reference(), "mlp_silu_for_gelu", ActMLP(nn.SiLU()))  # BUG: GELU


# ---- the list

def _bug(name: str, reference: str, site: str, pass_: str, kind: str, description: str,
         mapping: str | None = None) -> PlantedHint:
    return PlantedHint(f"{MODULE}:{name}", reference, site, pass_, kind, description, mapping)


LLAMA_MAP = "hf_llama.map.toml"
BUGS: list[PlantedHint] = [
    _bug("llama_no_rope_permutation", HF, "layers.0.attention#0", "forward", "rotary",
         "HF q/k rows loaded without the rotate-half -> interleaved permutation",
         "hf_llama_noperm.map.toml"),
    _bug("llama_rope_theta", HF, "layers.0.attention#0", "forward", "rotary",
         "rotary tables made with base 500000 where the config says 10000", LLAMA_MAP),
    _bug("llama_gqa_tiled", HF, "layers.0.attention#0", "forward", "permutation",
         "key/value heads tiled instead of repeated in place", LLAMA_MAP),
    _bug("llama_relu_gate", HF, "layers.1.feed_forward#0", "forward", "activation",
         "the feed-forward gate is ReLU, not SiLU", LLAMA_MAP),
    _bug("residual_dropped", f"{MODULE}:stack_reference", "blocks.1#0", "forward",
         "missing-term", "a block returns its branch without the residual add"),
    _bug("residual_dropped_in_loop", f"{MODULE}:stack_loop_reference", "<root>#0", "forward",
         "missing-term", "the model's loop h = h + block(h) written h = block(h)"),
    _bug("layernorm_backward_batch", f"{MODULE}:stack_reference", "blocks.2.norm#0",
         "backward", "axis", "a custom LayerNorm backward that reduces over the batch too"),
    _bug("embedding_padding_grad", f"{MODULE}:bag_reference", "embed#0", "backward",
         "mask", "the embedding without padding_idx: the pad row receives gradient"),
    _bug("masked_pool_backward", f"{MODULE}:classifier_reference", "pool#0", "backward",
         "mask", "a masked mean-pool whose backward forgets the mask"),
    _bug("lstm_gate_order", f"{MODULE}:lstm_reference", "rnn#0", "forward", "permutation",
         "a hand-written LSTM splitting the gates (i, f, o, g) against torch's (i, f, g, o)"),
    _bug("gru_gate_order", f"{MODULE}:gru_reference", "rnn#0", "forward", "permutation",
         "a hand-written GRU taking (z, r, n) against torch's (r, z, n)"),
    _bug("mlp_silu_for_gelu", f"{MODULE}:act_mlp_reference", "act#0", "forward", "activation",
         "SiLU where the reference's activation is GELU"),
]
