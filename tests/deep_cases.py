"""Ports of the bundled transformer with one bug deep inside, for origin finding: errors from
it reach everything after it in backward, below tolerance per element, and add up."""

from __future__ import annotations

import torch

from layerdiff import Case
from reference_models import transformer


class _SoftmaxBatch0Backward(torch.autograd.Function):
    """Softmax whose backward is right for batch element 0 only: it uses element 0's
    probabilities for the whole batch (a broadcast slip in a hand-written kernel)."""

    @staticmethod
    def forward(ctx, scores: torch.Tensor, strength: float) -> torch.Tensor:
        probs = scores.softmax(dim=-1)
        ctx.strength = strength
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (probs,) = ctx.saved_tensors
        # BUG: batch element 0's probabilities leak into the others' (all of them at 1.0)
        probs = torch.lerp(probs, probs[:1].expand_as(probs), ctx.strength)
        return probs * (grad - (grad * probs).sum(dim=-1, keepdim=True)), None


class _BuggyAttention(transformer.MultiHeadAttention):
    strength = 1.0

    def forward(self, query, key, value, *, mask):
        q = self._split(self.w_q(query))
        k = self._split(self.w_k(key))
        v = self._split(self.w_v(value))
        scores = q @ k.transpose(-2, -1) / self.d_k ** 0.5
        scores = scores.masked_fill(mask == 0, -1e9)
        attention = self.dropout(_SoftmaxBatch0Backward.apply(scores, self.strength))
        context = (attention @ v).transpose(1, 2).contiguous()
        return self.w_o(context.view(query.size(0), -1, self.heads * self.d_k))


def softmax_backward_batch0(layer: int = 1, strength: float = 1.0) -> Case:
    """The reference with decoder layer ``layer``'s self-attention softmax backward broken."""
    case = transformer.reference()
    attn = case.model.decoder.layers[layer].self_attn
    attn.__class__ = _BuggyAttention
    attn.strength = strength
    case.name = "tests.deep_cases:softmax_backward_batch0"
    return case
