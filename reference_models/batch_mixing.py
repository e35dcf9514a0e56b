"""A batch-mixing bug: attention that goes from batch-first to sequence-first with ``reshape``.

``torch.nn.MultiheadAttention`` takes ``(length, batch, d_model)`` unless built with
``batch_first=True``. Code written batch-first converts around it, and the slip is to do that with
``reshape(length, batch, d_model)`` (which keeps the memory order and only relabels it) instead of
``transpose(0, 1)``: the "sequence" the attention then runs over holds pieces of several samples,
so every sample's output depends on the others' inputs. Shapes all fit, the loss goes down, and
nothing fails until the model is evaluated one sample at a time.

The mixing is made in :class:`SeqFirstAttention`'s own code, around its child
``torch.nn.MultiheadAttention`` (which, given its sequence-first input, mixes nothing itself):
``layerdiff batch-independence`` should name ``blocks.0.attn#0``.

Sizes are chosen so that no dimension equals the batch size (6), which is how the check tells
the batch axis of a sequence-first tensor from its other axes.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

SEED = 0
BATCH, LENGTH, FEATURES, D_MODEL, HEADS, HIDDEN, CLASSES, BLOCKS = 6, 5, 4, 16, 2, 32, 3, 2


class SeqFirstAttention(nn.Module):
    """Self-attention over batch-first input through a sequence-first MultiheadAttention."""

    def __init__(self, d_model: int, heads: int, *, reshape: bool = False) -> None:
        super().__init__()
        self.mha = nn.MultiheadAttention(d_model, heads)  # batch_first=False: (L, B, D)
        self.reshape = reshape

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, d_model = x.shape
        if self.reshape:  # BUG: relabels the memory instead of moving the axes, both ways
            seq = x.reshape(length, batch, d_model)
            out, _ = self.mha(seq, seq, seq, need_weights=False)
            return out.reshape(batch, length, d_model)
        seq = x.transpose(0, 1)
        out, _ = self.mha(seq, seq, seq, need_weights=False)
        return out.transpose(0, 1)


class Block(nn.Module):
    def __init__(self, *, reshape: bool) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.attn = SeqFirstAttention(D_MODEL, HEADS, reshape=reshape)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.mlp = nn.Sequential(nn.Linear(D_MODEL, HIDDEN), nn.GELU(),
                                 nn.Linear(HIDDEN, D_MODEL))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class AttentionClassifier(nn.Module):
    """Sequences of feature vectors -> class logits: pre-norm attention blocks, mean pooling."""

    def __init__(self, *, reshape: bool = False) -> None:
        super().__init__()
        self.embed = nn.Linear(FEATURES, D_MODEL)
        self.blocks = nn.ModuleList(Block(reshape=reshape) for _ in range(BLOCKS))
        self.head = nn.Linear(D_MODEL, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h.mean(dim=1))


def _case(name: str, *, reshape: bool) -> Case:
    seed_everything(SEED)
    model = AttentionClassifier(reshape=reshape)
    x = torch.randn(BATCH, LENGTH, FEATURES)
    y = (x.sum(dim=(1, 2)) > 0).long() + (x[:, 0, 0] > 1).long()  # a learnable label
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, y),
                seed=SEED, steps=1,
                optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
                name=f"reference_models.batch_mixing:{name}")


def reference() -> Case:
    """The classifier with transpose: every sample is computed on its own."""
    return _case("reference", reshape=False)


def bug_reshape_seq_first() -> Case:
    """The same weights with reshape where transpose belonged: mixes samples."""
    return _case("bug_reshape_seq_first", reshape=True)
