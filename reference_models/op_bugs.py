"""A small GPT-style language model whose arithmetic lives in its modules' own code, for op-level
capture (``layerdiff capture --ops``): bugs between a module's children, named at the op.

``reference``: token and position embeddings, two pre-norm blocks ``blocks.<i>`` (``ln1``,
``attn``, ``ln2``, ``mlp``; the residual adds in the block's own forward), a final norm and a
linear head; next-token cross-entropy, 2 SGD steps. ``attn`` holds only its projections
(``qkv``, ``proj``) as children and computes attention in its own forward as functional ops:
heads split by view + transpose, ``q @ k^T``, one multiplication by ``1/sqrt(d_head)``,
``masked_fill`` with a registered causal buffer, ``softmax(dim=-1)``, ``@ v``, heads merged.
``mlp`` applies the custom autograd function :class:`SquaredReLU` (``relu(x)**2``, backward
``grad * 2 relu(x)``) between its ``fc`` and ``out`` Linear children.

``port``: a correct port written differently, with the same module and parameter names (weights
load without a mapping): attention from ``scaled_dot_product_attention(is_causal=True)``, so its
op list has no matmul, mul, masked_fill or softmax; its own ``SquaredReLU`` function.

Planted bugs, each the reference with one line changed, in one block only:
- ``bug_softmax_axis`` (forward): block 0's softmax over the query axis (dim -2);
- ``bug_scale_1_over_d`` (forward): block 0's scores multiplied by 1/d_head, not 1/sqrt(d_head);
- ``bug_custom_backward`` (backward): block 1's ``SquaredReLU`` backward drops the factor 2 for
  every batch element but the first; its forward is exact.

:data:`BUGS` gives for each the module site where module-level capture finds it (the module, an
origin "in its own code") and the op site where op capture should.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

from .porting import copy_state, port_case

MODULE = "reference_models.op_bugs"

VOCAB, WIDTH, HEADS, LENGTH, BATCH, BLOCKS, STEPS = 40, 32, 4, 10, 4, 2, 2
HEAD = WIDTH // HEADS


@dataclass(frozen=True)
class PlantedOpBug:
    """A planted bug in a module's own code, and where each level of capture should find it."""

    spec: str
    module_site: str    # the origin with module-level capture: the module, "in its own code"
    op_site: str        # the origin with `--ops` on that module: the op
    pass_: str          # forward | backward
    description: str


# ---- the reference


class SquaredReLU(torch.autograd.Function):
    """relu(x)**2, with its derivative 2 relu(x) written by hand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        positive = F.relu(x)
        ctx.save_for_backward(positive)
        return positive**2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (positive,) = ctx.saved_tensors
        return grad * 2 * positive


class WrongBackward:
    """Namespace for the planted bug's function, so that it keeps the class name SquaredReLU
    (op sites are named by it) beside the reference's."""

    class SquaredReLU(SquaredReLU):
        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            (positive,) = ctx.saved_tensors
            grad_input = grad * 2 * positive
            grad_input[1:] /= 2  # BUG: the factor 2 lost for every batch element but the first
            return grad_input


class Attention(nn.Module):
    """Causal multi-head self-attention computed in this module's own forward."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)
        # True above the diagonal: the future positions that each query must not see
        self.register_buffer("future", torch.ones(LENGTH, LENGTH, dtype=torch.bool).triu(1),
                             persistent=False)
        self.scale = 1 / math.sqrt(HEAD)
        self.softmax_dim = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, HEADS, HEAD).transpose(1, 2) for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
        y = scores.softmax(dim=self.softmax_dim) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    act = SquaredReLU  # an autograd.Function (not a module): it runs in this module's own code

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, 4 * WIDTH)
        self.out = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.act.apply(self.fc(x)))


class Block(nn.Module):
    def __init__(self, attention: type[nn.Module] = Attention,
                 mlp: type[nn.Module] = MLP) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = mlp()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class OpLM(nn.Module):
    def __init__(self, attention: type[nn.Module] = Attention,
                 mlp: type[nn.Module] = MLP) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(Block(attention, mlp) for _ in range(BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def reference() -> Case:
    """Next-token prediction on a fixed random batch: 4 sequences of 10 tokens, 2 SGD steps."""
    seed_everything(0)
    model = OpLM()
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=0, steps=STEPS,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{MODULE}:reference")


# ---- the correct port


class PortFunctions:
    """Namespace for the port's own SquaredReLU (the same class name as the reference's)."""

    class SquaredReLU(torch.autograd.Function):
        """max(x, 0) squared; the derivative from the input kept, not the activation."""

        @staticmethod
        def forward(ctx, x: torch.Tensor) -> torch.Tensor:
            ctx.save_for_backward(x)
            return x.clamp(min=0).square()

        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            (x,) = ctx.saved_tensors
            return 2 * x.clamp(min=0) * grad


class SDPAAttention(nn.Module):
    """The same attention from torch's fused kernel: no scores, scale, mask or softmax ops."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, HEADS, HEAD).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        return self.proj(y.permute(0, 2, 1, 3).reshape(batch, length, width))


class PortMLP(MLP):
    act = PortFunctions.SquaredReLU


def port() -> Case:
    """The correct port: SDPA attention and its own SquaredReLU, the reference's names."""
    return port_case(reference, lambda ref: copy_state(OpLM(SDPAAttention, PortMLP), ref),
                     f"{MODULE}:port")


# ---- the planted bugs: the reference with one line changed


def _bug(name: str, change) -> Case:
    case = reference()
    change(case.model)
    case.name = f"{MODULE}:{name}"
    return case


def bug_softmax_axis() -> Case:
    def change(model: OpLM) -> None:
        model.blocks[0].attn.softmax_dim = -2  # BUG: the query axis; -1 (the keys) belongs
    return _bug("bug_softmax_axis", change)


def bug_scale_1_over_d() -> Case:
    def change(model: OpLM) -> None:
        model.blocks[0].attn.scale = 1 / HEAD  # BUG: 1 / math.sqrt(HEAD) belongs
    return _bug("bug_scale_1_over_d", change)


def bug_custom_backward() -> Case:
    def change(model: OpLM) -> None:
        model.blocks[1].mlp.act = WrongBackward.SquaredReLU  # BUG: wrong past batch element 0
    return _bug("bug_custom_backward", change)


BUGS: list[PlantedOpBug] = [
    PlantedOpBug(f"{MODULE}:bug_softmax_axis", "blocks.0.attn#0", "blocks.0.attn#0/softmax#0",
                 "forward", "block 0's attention softmax over the query axis (dim -2) instead "
                 "of the key axis, in the attention module's own code"),
    PlantedOpBug(f"{MODULE}:bug_scale_1_over_d", "blocks.0.attn#0", "blocks.0.attn#0/mul#0",
                 "forward", "block 0's attention scores multiplied by 1/d_head instead of "
                 "1/sqrt(d_head), in the attention module's own code"),
    PlantedOpBug(f"{MODULE}:bug_custom_backward", "blocks.1.mlp#0",
                 "blocks.1.mlp#0/SquaredReLU#0", "backward",
                 "block 1's custom autograd SquaredReLU whose backward drops the factor 2 for "
                 "every batch element but the first; its forward is exact"),
]
