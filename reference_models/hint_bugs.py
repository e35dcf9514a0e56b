"""Planted bugs for the likely-cause hints (``layerdiff.compare.hints``): one or more per kind
of mistake the other bundled ports lack, each one line away from a correct port.

Over the bundled models:
- ``mlp_sign_backward`` (sign): ``act1`` is a ReLU with a hand-written backward whose sign is
  flipped;
- ``mlp_bias_twice`` (missing-term, its mirror): ``fc2`` adds its bias twice, once in
  ``F.linear`` and again by hand;
- ``mlp_bf16_layer`` (precision): ``fc1`` runs in bfloat16 and casts its output back to float32;
- ``cnn_sum_pool`` (scale): global pooling sums where the reference averages;
- ``cnn_batchnorm_eps`` (epsilon): the residual block's first batch norm uses epsilon 1e-3;
- ``convlstm_gate_order`` (permutation): the numpy ConvLSTM's gate convolution writes its
  output channels in (i, f, o, g) order, the layout code written for ONNX- or Keras-style
  weights keeps, while the cell splits them in the reference's (i, f, g, o) order;
- ``transformer_mask_ignored`` (mask): the attention kernel is never given the padding mask.

And a small causal language model (``causal_reference``: embedding, one pre-norm block with
GPT-style attention whose kernel is a module of its own, ``attn.core``, a linear head), its
correct port ``causal_port`` (the kernel from ``scaled_dot_product_attention``) and two planted
bugs in the kernel:
- ``causal_mask_off_by_one`` (mask): the causal mask made with ``tril(diagonal=1)``, so each
  position also sees the next token;
- ``causal_heads_merged_by_reshape`` (transpose): heads merged back with a reshape where
  ``transpose(1, 2)`` then reshape belonged.

:data:`BUGS` lists them with the site where the diff should find each and the hint kind
expected there (``scripts/hint_rates.py`` measures the hint over them and the catalog's bugs).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, ExternalCase, seed_everything

from . import cnn, cnn_port, mlp, mlp_port, transformer, transformer_port
from .convlstm_numpy import NumpyConvLSTM, external_case
from .porting import copy_state, port_case

MODULE = "reference_models.hint_bugs"


@dataclass(frozen=True)
class PlantedHint:
    """A planted bug and the hint its origin should carry."""

    spec: str
    reference: str
    site: str                   # the port's site where the diff finds the origin
    pass_: str                  # forward | backward
    kind: str                   # the hint kind expected
    description: str
    mapping: str | None = None  # the mapping file beside this module, if the names differ


# ---- the MLP

class SignFlippedReLU(cnn_port.ReLUFunction):
    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return -cnn_port.ReLUFunction.backward(ctx, grad)  # BUG: the sign of the derivative


class SignFlippedReLUModule(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return SignFlippedReLU.apply(x)


class BiasTwiceDense(mlp_port.Dense):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: F.linear adds the bias already (a kernel ported with its bias epilogue)
        return F.linear(x, self.weight, self.bias) + self.bias


class BFloat16Dense(mlp_port.Dense):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: computed in bfloat16 (a kernel with no float32 path), cast back to float32
        return F.linear(x.bfloat16(), self.weight.bfloat16(), self.bias.bfloat16()).float()


def _mlp(name: str, **changes: nn.Module) -> Case:
    def build(ref: nn.Module) -> nn.Module:
        port = mlp_port.MLPPort()
        for attribute, module in changes.items():
            setattr(port, attribute, module)
        return copy_state(port, ref)

    return port_case(mlp.reference, build, f"{MODULE}:{name}")


def mlp_sign_backward() -> Case:
    return _mlp("mlp_sign_backward", act1=SignFlippedReLUModule())


def mlp_bias_twice() -> Case:
    return _mlp("mlp_bias_twice", fc2=BiasTwiceDense(mlp.HIDDEN, mlp.HIDDEN))


def mlp_bf16_layer() -> Case:
    return _mlp("mlp_bf16_layer", fc1=BFloat16Dense(mlp.IN, mlp.HIDDEN))


# ---- the CNN

class SumPool(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=(2, 3), keepdim=True)  # BUG: a sum where the reference averages


def _cnn(name: str, change) -> Case:
    def build(ref: nn.Module) -> nn.Module:
        port = cnn_port.CNNPort()
        change(port)
        return copy_state(port, ref)

    return port_case(cnn.reference, build, f"{MODULE}:{name}")


def cnn_sum_pool() -> Case:
    return _cnn("cnn_sum_pool", lambda port: setattr(port, "gap", SumPool()))


def cnn_batchnorm_eps() -> Case:
    return _cnn("cnn_batchnorm_eps", lambda port: setattr(
        port.block, "bn1", cnn_port.BatchNorm(cnn.WIDTH, eps=1e-3)))  # BUG: 1e-5 in the reference


# ---- the numpy ConvLSTM

class GateOrderConvLSTM(NumpyConvLSTM):
    """The gate convolution writes its output channels in (i, f, o, g) order; the cell (the
    reference's code) splits them as (i, f, g, o)."""

    def _conv(self, cols: np.ndarray, weight: np.ndarray, bias: np.ndarray,
              height: int, width: int) -> np.ndarray:
        out = super()._conv(cols, weight, bias, height, width)
        if weight.shape[0] != 4 * self.params["head.weight"].shape[1]:
            return out  # the read-out convolution
        i, f, g, o = np.split(out, 4, axis=1)
        return np.concatenate([i, f, o, g], axis=1)  # BUG: another gate layout


def convlstm_gate_order() -> ExternalCase:
    return external_case(GateOrderConvLSTM, f"{MODULE}:convlstm_gate_order")


# ---- the translation transformer

def unmasked_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    mask: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)  # BUG: the mask is never passed on


def transformer_mask_ignored() -> Case:
    opts = transformer_port.PortOptions(kernel=unmasked_kernel)
    return port_case(transformer.reference, lambda ref: transformer_port.from_reference(
        transformer_port.TransformerPort(transformer.Config(), opts), ref),
        f"{MODULE}:transformer_mask_ignored")


# ---- a small causal language model

VOCAB, WIDTH, HEADS, LENGTH, BATCH = 32, 32, 4, 10, 6


class AttentionCore(nn.Module):
    """The attention kernel as a module of its own, as ports to custom kernels have it:
    (batch, length, width) q, k, v -> heads split, causal softmax(q k^T / sqrt(d)) v, merged."""

    def __init__(self, diagonal: int = 0, merge_by_reshape: bool = False) -> None:
        super().__init__()
        self.diagonal = diagonal
        self.merge_by_reshape = merge_by_reshape

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, length, width = q.shape
        q, k, v = (t.view(batch, length, HEADS, width // HEADS).transpose(1, 2)
                   for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(width // HEADS)
        causal = torch.ones(length, length, dtype=torch.bool, device=q.device).tril(
            self.diagonal)
        y = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1) @ v
        if self.merge_by_reshape:
            return y.reshape(batch, length, width)  # BUG: the heads axis is still before length
        return y.transpose(1, 2).reshape(batch, length, width)


class SDPACore(nn.Module):
    """The same kernel from torch's fused attention (the correct port)."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, length, width = q.shape
        q, k, v = (t.view(batch, length, HEADS, width // HEADS).transpose(1, 2)
                   for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return y.transpose(1, 2).reshape(batch, length, width)


class CausalSelfAttention(nn.Module):
    """GPT-style: one fused q, k, v projection, the kernel, the output projection."""

    def __init__(self, core: nn.Module | None = None) -> None:
        super().__init__()
        self.c_attn = nn.Linear(WIDTH, 3 * WIDTH)
        self.core = core or AttentionCore()
        self.c_proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.c_attn(x).split(x.size(-1), dim=2)
        return self.c_proj(self.core(q, k, v))


class CausalLM(nn.Module):
    def __init__(self, attention: CausalSelfAttention | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Parameter(torch.randn(LENGTH, WIDTH) * 0.1)
        self.ln = nn.LayerNorm(WIDTH)
        self.attn = attention or CausalSelfAttention()
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.size(1)]
        return self.head(x + self.attn(self.ln(x)))


def causal_reference() -> Case:
    """Next-token prediction on a fixed random batch: 6 sequences of 10 tokens."""
    seed_everything(0)
    model = CausalLM()
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=0, steps=1,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{MODULE}:causal_reference")


def _causal(name: str, core: nn.Module) -> Case:
    case = causal_reference()
    port = copy_state(CausalLM(CausalSelfAttention(core)), case.model)
    return dataclasses.replace(case, model=port, name=f"{MODULE}:{name}")


def causal_port() -> Case:
    """The correct port: the kernel from scaled_dot_product_attention(is_causal=True)."""
    return _causal("causal_port", SDPACore())


def causal_mask_off_by_one() -> Case:
    return _causal("causal_mask_off_by_one", AttentionCore(diagonal=1))  # BUG: 0


def causal_heads_merged_by_reshape() -> Case:
    return _causal("causal_heads_merged_by_reshape", AttentionCore(merge_by_reshape=True))


def _bug(name: str, reference: str, site: str, pass_: str, kind: str, description: str,
         mapping: str | None = None) -> PlantedHint:
    return PlantedHint(f"{MODULE}:{name}", reference, site, pass_, kind, description, mapping)


BUGS: list[PlantedHint] = [
    _bug("mlp_sign_backward", "reference_models.mlp:reference", "act1#0", "backward", "sign",
         "ReLU with a hand-written backward whose sign is flipped"),
    _bug("mlp_bias_twice", "reference_models.mlp:reference", "fc2#0", "forward",
         "missing-term", "a Linear layer that adds its bias twice (in F.linear and by hand)"),
    _bug("mlp_bf16_layer", "reference_models.mlp:reference", "fc1#0", "forward", "precision",
         "one Linear layer computed in bfloat16 and cast back to float32"),
    _bug("cnn_sum_pool", "reference_models.cnn:reference", "gap#0", "forward", "scale",
         "global pooling sums where the reference averages"),
    _bug("cnn_batchnorm_eps", "reference_models.cnn:reference", "block.bn1#0", "forward",
         "epsilon", "a batch norm with epsilon 1e-3 instead of 1e-5"),
    _bug("convlstm_gate_order", "reference_models.convlstm:reference", "cell.conv#0",
         "forward", "permutation",
         "numpy ConvLSTM whose gate convolution writes the gates in (i, f, o, g) order while "
         "the cell splits them as (i, f, g, o)"),
    _bug("transformer_mask_ignored", "reference_models.transformer:reference",
         "enc.0.self_attn#0", "forward", "mask",
         "the attention kernel is never given the padding mask", "transformer_port.map.toml"),
    _bug("causal_mask_off_by_one", f"{MODULE}:causal_reference", "attn.core#0", "forward",
         "mask", "causal mask made with tril(diagonal=1): each position sees the next token"),
    _bug("causal_heads_merged_by_reshape", f"{MODULE}:causal_reference", "attn.core#0",
         "forward", "transpose",
         "attention heads merged with a reshape where transpose + reshape belonged"),
]
