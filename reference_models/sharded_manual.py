"""Hand-written sharded ports of :mod:`reference_models.sharded_model` (no DTensor): the ranks
hold plain tensors, so their mapping files say how the parts make the whole.

- ``partial_sum`` (``sharded_partial_sum.map.toml``): each block's MLP Megatron-style, ``fc``
  column-parallel (Megatron's ``f`` inside it) and ``proj`` row-parallel, but ``proj`` returns
  its rank's partial sum and the MLP all-reduces it after ``proj`` returns: ``proj``'s output
  record is a ``partial`` sum. Its gradient is not: the all-reduce's backward hands every rank
  the whole output gradient, so ``proj``'s ``grad_output`` is replicated (a partial tensor's
  gradient is replicated, as DTensor's ``Partial`` and ``Replicate`` are each other's duals).
- ``zigzag_cp`` (``sharded_zigzag_cp.map.toml``): context parallelism. The sequence is cut into
  2W chunks and rank i runs chunks i and 2W-1-i, in that order, from the embeddings to the
  logits (every causal rank then has about the same work). Each attention all-gathers the
  keys and values, puts the chunks back in sequence order and masks by the true positions. The
  loss is each rank's sum over its tokens, over the whole count, all-reduced; every parameter's
  gradient is all-reduced (summed) as it is accumulated.

Planted bugs, one line away:
- ``bug_partial_sum_unreduced``: block 0's MLP returns ``proj``'s partial sum without the
  all-reduce. ``proj``'s record is still right (a partial sum); the MLP's output, replicated,
  holds rank 0's part only: the diff should name ``blocks.0.mlp#0`` (forward, step 0), code
  between its children.
- ``bug_zigzag_kv_order``: the attention concatenates the gathered keys and values in rank
  order (chunks 0, 2W-1, 1, 2W-2, ...) and masks them as if they were in sequence order. A query
  sees the right keys only where the first keys in rank order are its own: rank 0's first chunk
  (chunk 0 comes first), and the last position (every key, and the order of the keys does not
  change a softmax). The diff should name ``blocks.0.attn#0`` (forward, step 0; code between
  ``k``/``v`` and ``out``): on 4 ranks (chunks of one position) the parts of ranks 1, 2 and 3
  only; on 2 ranks (chunks of two) every rank's part (rank 0's at position 6 only).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from layerdiff import Case
from layerdiff.errors import CaseError

from .sharded_model import (
    HIDDEN,
    LENGTH,
    MLP,
    MODULE,
    VOCAB,
    WIDTH,
    Attention,
    Block,
    TinyGPT,
    copy_state,
    gpt_case,
    next_token_loss,
    rank_and_world,
    reference_parts,
)
from .tensor_parallel import copy_to_parallel, reduce_from_parallel


def _part(size: int, world: int, what: str, case: str) -> int:
    if size % world:
        raise CaseError(f"case {MODULE}:{case}: {what} has {size} elements, which do not split "
                        f"into {world} equal parts; run it on a world size dividing {size}")
    return size // world


# ---- partial_sum: a row-parallel layer whose partial sum its parent reduces


class ColumnParallelLinear(nn.Module):
    """Rank r's rows of the weight and bias; Megatron's ``f`` at its input, so its input's
    gradient is the all-reduced, whole one."""

    def __init__(self, in_features: int, out_features: int, world: int) -> None:
        super().__init__()
        self.world = world
        part = _part(out_features, world, "fc's output", "partial_sum")
        self.weight = nn.Parameter(torch.empty(part, in_features))
        self.bias = nn.Parameter(torch.empty(part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(x, self.world), self.weight, self.bias)


class PartialLinear(nn.Module):
    """Rank r's input columns of the weight: its output is rank r's term of the sum over the
    ranks, which the caller reduces."""

    def __init__(self, in_features: int, out_features: int, world: int) -> None:
        super().__init__()
        part = _part(in_features, world, "proj's input", "partial_sum")
        self.weight = nn.Parameter(torch.empty(out_features, part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class PartialSumMLP(MLP):
    def __init__(self, world: int) -> None:
        super().__init__()
        self.world = world
        self.fc = ColumnParallelLinear(WIDTH, HIDDEN, world)
        self.proj = PartialLinear(HIDDEN, WIDTH, world)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel(self.proj(self.act(self.fc(x))), self.world)


class UnreducedMLP(PartialSumMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))  # BUG: proj's partial sum is never all-reduced


def _cut_mlp(rank: int, world: int) -> Callable[[str, torch.Tensor], torch.Tensor]:
    """Rank ``rank``'s part of a reference tensor, by name: fc's rows, proj's columns."""
    def cut(name: str, tensor: torch.Tensor) -> torch.Tensor:
        if name.endswith(("mlp.fc.weight", "mlp.fc.bias")):
            return tensor.chunk(world, 0)[rank]
        if name.endswith("mlp.proj.weight"):
            return tensor.chunk(world, 1)[rank]
        return tensor
    return cut


def _partial_sum(name: str, bug_block: int | None = None) -> Case:
    rank, world = rank_and_world()
    reference, inputs, targets = reference_parts()
    model = TinyGPT(lambda index: Block(
        mlp=(UnreducedMLP if index == bug_block else PartialSumMLP)(world)))
    copy_state(model, reference, _cut_mlp(rank, world))
    return gpt_case(model, inputs, next_token_loss(targets), name)


def partial_sum() -> Case:
    """Every block's MLP row-parallel with the all-reduce in the MLP, after proj returns."""
    return _partial_sum("partial_sum")


def bug_partial_sum_unreduced() -> Case:
    return _partial_sum("bug_partial_sum_unreduced", bug_block=0)


# ---- zigzag_cp: context parallelism over 2W chunks of the sequence


def zigzag_positions(rank: int, world: int, length: int = LENGTH) -> torch.Tensor:
    """The sequence positions rank ``rank`` holds: chunk ``rank`` then chunk 2W-1-rank of the
    sequence cut into 2W equal chunks."""
    chunk = _part(length, 2 * world, "the sequence", "zigzag_cp")
    starts = (rank * chunk, (2 * world - 1 - rank) * chunk)
    return torch.cat([torch.arange(start, start + chunk) for start in starts])


def sequence_order(world: int) -> list[int]:
    """Where sequence chunk j lies among the ranks' chunks concatenated in rank order (rank r's
    two chunks at 2r and 2r+1)."""
    return [2 * j if j < world else 2 * (2 * world - 1 - j) + 1 for j in range(2 * world)]


class AllGather(torch.autograd.Function):
    """Every rank's part, concatenated in rank order along ``dim``; backward: the gradient of
    the whole is summed over the ranks (each used every part) and each rank keeps its part's."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        ctx.dim = dim
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        return grad.chunk(dist.get_world_size(), ctx.dim)[dist.get_rank()], None


class ZigzagAttention(Attention):
    """Queries of this rank's chunks over every key: keys and values all-gathered and put back
    in sequence order, masked by true positions."""

    def __init__(self, rank: int, world: int) -> None:
        super().__init__()
        self.world = world
        self.positions = zigzag_positions(rank, world)

    def in_sequence_order(self, x: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return x
        chunks = AllGather.apply(x, 1).chunk(2 * self.world, 1)
        return torch.cat([chunks[index] for index in sequence_order(self.world)], 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.q(x), self.in_sequence_order(self.k(x)), self.in_sequence_order(self.v(x))
        keys = torch.arange(LENGTH, device=x.device)
        return self.out(self.attend(q, k, v, self.positions, keys))


class RankOrderAttention(ZigzagAttention):
    def in_sequence_order(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: the gathered chunks left in rank order (0, 2W-1, 1, 2W-2, ...)
        return AllGather.apply(x, 1) if self.world > 1 else x


class ZigzagGPT(TinyGPT):
    """The reference on this rank's chunks of the sequence (tokens in, logits out)."""

    def __init__(self, rank: int, world: int, attention: type[ZigzagAttention]) -> None:
        super().__init__(lambda index: Block(attn=attention(rank, world)))
        self.mine = zigzag_positions(rank, world)

    def positions(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.mine

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return super().forward(tokens[:, self.mine])


def zigzag_loss(targets: torch.Tensor, world: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The mean cross-entropy over every rank's tokens: this rank's sum over the whole count,
    all-reduced (backward identity: each rank's sum takes the loss's gradient)."""
    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        mine = F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1), reduction="sum")
        return reduce_from_parallel(mine / (targets.numel() * world), world)
    return loss_fn


def _all_reduce_gradients(model: nn.Module) -> None:
    """Each parameter's gradient summed over the ranks as soon as it is accumulated: each rank
    computed only its tokens' terms."""
    for param in model.parameters():
        param.register_post_accumulate_grad_hook(lambda p: dist.all_reduce(p.grad))


def _zigzag(name: str, attention: type[ZigzagAttention]) -> Case:
    rank, world = rank_and_world()
    reference, inputs, targets = reference_parts()
    model = copy_state(ZigzagGPT(rank, world, attention), reference)
    if world > 1:
        _all_reduce_gradients(model)
    mine = targets[:, zigzag_positions(rank, world)]
    return gpt_case(model, inputs, zigzag_loss(mine, world), name)


def zigzag_cp() -> Case:
    """The reference with its sequence cut zigzag over the ranks."""
    return _zigzag("zigzag_cp", ZigzagAttention)


def bug_zigzag_kv_order() -> Case:
    return _zigzag("bug_zigzag_kv_order", RankOrderAttention)
