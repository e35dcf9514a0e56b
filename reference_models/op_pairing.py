"""Ports of the op-level language model (:mod:`reference_models.op_bugs`) whose attention runs
its own kernels in place of torch ops: op sites of other names, paired by position and shapes
or as a group (see :mod:`layerdiff.compare.op_alignment`), and bugs in those kernels' backward.

- ``custom_softmax_port``: the attention's ``softmax`` is the custom autograd function
  :class:`MySoftmax` (its own forward and backward, as a hand-written kernel would have): op site
  ``.../MySoftmax#0`` in ``softmax#0``'s place, paired by position;
- ``bug_custom_softmax_backward``: block 1's ``MySoftmax`` backward returns ``y * g``, the
  Jacobian's diagonal only (the ``- y (g . y)`` term forgotten); its forward is exact;
- ``fused_softmax_port``: scale, causal mask and softmax in one custom function
  :class:`FusedScaleMaskSoftmax` (Megatron's fused kernel's interface): one port op where the
  reference runs ``mul``, ``masked_fill``, ``softmax``, paired as a group;
- ``bug_fused_softmax_backward``: block 1's fused function's backward forgets the scale.

Same module and parameter names as the reference: weights load without a mapping.
"""

from __future__ import annotations

import torch

from layerdiff import Case

from . import op_bugs
from .porting import copy_state, port_case

MODULE = "reference_models.op_pairing"


class MySoftmax(torch.autograd.Function):
    """Softmax over the last axis with its backward written by hand: y (g - (g . y))."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = (x - x.amax(dim=-1, keepdim=True)).exp()
        y = y / y.sum(dim=-1, keepdim=True)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (y,) = ctx.saved_tensors
        return y * (grad - (grad * y).sum(dim=-1, keepdim=True))


class DiagonalBackward:
    """Namespace for the planted bug's function: it keeps the class name MySoftmax."""

    class MySoftmax(MySoftmax):
        @staticmethod
        def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
            (y,) = ctx.saved_tensors
            return y * grad  # BUG: y (g - (g . y)) belongs; this is the Jacobian's diagonal


class FusedScaleMaskSoftmax(torch.autograd.Function):
    """softmax(scale * x, with ``mask`` positions at -inf) in one call, backward by hand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
        y = torch.softmax((x * scale).masked_fill(mask, float("-inf")), dim=-1)
        ctx.save_for_backward(y)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (y,) = ctx.saved_tensors
        return ctx.scale * y * (grad - (grad * y).sum(dim=-1, keepdim=True)), None, None


class UnscaledBackward:
    """Namespace for the planted bug's fused function (same class name)."""

    class FusedScaleMaskSoftmax(FusedScaleMaskSoftmax):
        @staticmethod
        def backward(ctx, grad: torch.Tensor):
            (y,) = ctx.saved_tensors
            # BUG: the chain rule's factor ctx.scale is missing
            return y * (grad - (grad * y).sum(dim=-1, keepdim=True)), None, None


class CustomSoftmaxAttention(op_bugs.Attention):
    """The reference's attention with :class:`MySoftmax` for ``softmax``."""

    softmax = MySoftmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, op_bugs.HEADS, op_bugs.HEAD).transpose(1, 2)
                   for t in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) * self.scale
        scores = scores.masked_fill(self.future[:length, :length], float("-inf"))
        y = self.softmax.apply(scores) @ v
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class FusedSoftmaxAttention(op_bugs.Attention):
    """The reference's attention with scale, mask and softmax in one fused function."""

    fused = FusedScaleMaskSoftmax

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=2)
        q, k, v = (t.view(batch, length, op_bugs.HEADS, op_bugs.HEAD).transpose(1, 2)
                   for t in (q, k, v))
        probs = self.fused.apply(q @ k.transpose(-2, -1), self.future[:length, :length],
                                 self.scale)
        return self.proj((probs @ v).transpose(1, 2).reshape(batch, length, width))


def _port(attention: type, name: str, change=None) -> Case:
    def build(reference):
        model = copy_state(op_bugs.OpLM(attention), reference)
        if change is not None:
            change(model)
        return model
    return port_case(op_bugs.reference, build, f"{MODULE}:{name}")


def custom_softmax_port() -> Case:
    """Correct: attention softmax from the custom autograd function MySoftmax."""
    return _port(CustomSoftmaxAttention, "custom_softmax_port")


def bug_custom_softmax_backward() -> Case:
    def change(model: op_bugs.OpLM) -> None:
        model.blocks[1].attn.softmax = DiagonalBackward.MySoftmax  # BUG: its backward
    return _port(CustomSoftmaxAttention, "bug_custom_softmax_backward", change)


def fused_softmax_port() -> Case:
    """Correct: scale, mask and softmax from one fused autograd function."""
    return _port(FusedSoftmaxAttention, "fused_softmax_port")


def bug_fused_softmax_backward() -> Case:
    def change(model: op_bugs.OpLM) -> None:
        model.blocks[1].attn.fused = UnscaledBackward.FusedScaleMaskSoftmax  # BUG
    return _port(FusedSoftmaxAttention, "bug_fused_softmax_backward", change)
