"""The one-process reference the sharded ports of :mod:`reference_models.sharded` are cut from.

A tiny GPT: token and position embeddings (``embed``, ``pos``), two pre-norm blocks
``blocks.<i>`` (``ln1``, ``attn`` with ``q``, ``k``, ``v``, ``out``; ``ln2``, ``mlp`` with
``fc``, ``act``, ``proj``), a final norm ``ln_f`` and a ``head``; next-token cross-entropy on 4
sequences of 8 tokens, 2 SGD steps. Widths are tiny (16 wide, 4 heads of 4, MLP 64) and chosen
so that worlds of 2 and 4 divide every cut: the batch (data parallel), the heads and the MLP
(tensor parallel), and the sequence in 2W chunks (context parallel, 8 / 8 = 1 token a chunk).

No dropout: a port that sees another part of the batch, or a part of the sequence, would draw
other masks. Only ``fc`` has a bias, so a row-parallel ``proj`` or ``out`` needs no rule for
where its bias is added.

Attention takes the query and key positions explicitly (:meth:`Attention.attend`): the
reference passes ``0..L-1`` for both, a context-parallel port passes its own tokens' positions
and the gathered keys', so both compute the same causal mask with the same code.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything

MODULE = "reference_models.sharded"

VOCAB, WIDTH, HEADS, LENGTH, BATCH, BLOCKS, STEPS = 32, 16, 4, 8, 4, 2, 2
HEAD_DIM = WIDTH // HEADS
HIDDEN = 4 * WIDTH
SEED = 0
LR = 0.1


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) when no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class Attention(nn.Module):
    """Causal multi-head self-attention from separate ``q``, ``k``, ``v`` projections and an
    ``out`` projection. The head count is read from the projections' width (``-1`` in the
    view), so a tensor-parallel port whose ``q`` returns its rank's heads runs this code."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(WIDTH, WIDTH, bias=False)
        self.k = nn.Linear(WIDTH, WIDTH, bias=False)
        self.v = nn.Linear(WIDTH, WIDTH, bias=False)
        self.out = nn.Linear(WIDTH, WIDTH, bias=False)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, length, heads * HEAD_DIM) -> (batch, heads, length, HEAD_DIM)."""
        return x.view(x.size(0), x.size(1), -1, HEAD_DIM).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """Attention of the queries at positions ``q_pos`` over the keys at ``k_pos`` (each key
        seen by the queries at or after it), back to (batch, length, width)."""
        mask = q_pos[:, None] >= k_pos[None, :]
        y = F.scaled_dot_product_attention(self.heads(q), self.heads(k), self.heads(v),
                                           attn_mask=mask)
        return y.transpose(1, 2).reshape(q.size(0), q.size(1), -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(x.size(1), device=x.device)
        return self.out(self.attend(self.q(x), self.k(x), self.v(x), positions, positions))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.act = nn.GELU()
        self.proj = nn.Linear(HIDDEN, WIDTH, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, attn: nn.Module | None = None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = attn if attn is not None else Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = mlp if mlp is not None else MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


BlockFactory = Callable[[int], Block]


class TinyGPT(nn.Module):
    """``block(i)`` builds block ``i`` (a port swaps in its own attention or MLP there)."""

    def __init__(self, block: BlockFactory = lambda index: Block()) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(block(index) for index in range(BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return torch.arange(tokens.size(1), device=tokens.device)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos(self.positions(tokens))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def reference_parts() -> tuple[TinyGPT, torch.Tensor, torch.Tensor]:
    """The reference model and its fixed batch (inputs, targets): 4 sequences of 8 tokens,
    drawn after the model, from the case's seed. Every port builds these first, the same on
    every rank, and keeps its part."""
    seed_everything(SEED)
    model = TinyGPT()
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    return model, tokens[:, :-1], tokens[:, 1:]


def next_token_loss(targets: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """Mean cross-entropy of the logits against ``targets``."""
    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))
    return loss_fn


def gpt_case(model: nn.Module, inputs: torch.Tensor, loss_fn: Callable[[torch.Tensor],
             torch.Tensor], name: str) -> Case:
    """The reference's training run (seed, steps, SGD) on ``model``."""
    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=SEED, steps=STEPS,
                optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                name=f"{MODULE}:{name}")


def reference() -> Case:
    """Next-token prediction on a fixed random batch: 4 sequences of 8 tokens, 2 SGD steps."""
    model, inputs, targets = reference_parts()
    return gpt_case(model, inputs, next_token_loss(targets), "reference")


def copy_state(target: nn.Module, source: nn.Module,
               cut: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, t: t) -> nn.Module:
    """Load ``source``'s parameters into ``target`` under the same names, each through
    ``cut(name, tensor)`` (a port's part of it)."""
    state = {name: cut(name, tensor) for name, tensor in source.state_dict().items()}
    target.load_state_dict(state, strict=True)
    return target
