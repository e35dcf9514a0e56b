"""A small GPT-style causal LM and its Megatron-style tensor-parallel port, for multi-rank capture.

``reference``: token and position embeddings, two pre-norm blocks ``blocks.<i>`` (``ln1``,
``attn``, ``ln2``, ``mlp``), a final norm ``ln_f`` and a linear ``head``; next-token
cross-entropy on 4 sequences of 8 tokens, 2 SGD steps. Each ``mlp`` is ``fc`` (d -> 4d),
``act`` (GELU), ``proj`` (4d -> d) and ``dropout`` (p = 0.1, on), as in GPT-2's MLP.

``port``: the same model split Megatron-style over the ranks of ``torch.distributed`` (world
size 1, rank 0 when no process group is initialised, so it also runs in one process). Every
module and parameter keeps the reference's name; in each block's MLP

- ``fc`` is column-parallel: rank r holds rows ``r*4d/W ... (r+1)*4d/W`` of the weight and
  bias, so its output (and ``act``'s input and output) is rank r's slice of the last dim;
- ``proj`` is row-parallel: rank r holds the matching columns of the weight and computes a
  partial sum, all-reduced across ranks; the bias (replicated) is added once, after it;
- Megatron's conjugate functions keep the gradients right: ``f`` at ``fc``'s input (forward
  identity, backward all-reduce of the partial input gradients) and ``g`` at ``proj``'s output
  (forward all-reduce, backward identity), both inside those modules' forward, so every
  module's input and output gradients are either whole and replicated or one rank's slice.

Everything else is replicated, and ``dropout`` acts only on replicated tensors (``proj``'s
reduced output). Each rank builds the whole reference from the same seed and keeps its slices
(:func:`shard_state`, driven by the mapping's shard rules), so no weight loading is needed.

Dropout draws from a generator of its own (like Megatron's RNG tracker), seeded on every call
from the default generator, which every rank seeds with the case's seed: replicas draw the same
mask, and the reference draws the same masks as the port.

Planted bugs, each one line away from ``port``, in block 0 only:
- ``bug_bias_before_allreduce`` (forward, found by ``diff`` at ``blocks.0.mlp.proj#0``):
  ``proj`` adds its bias on every rank before the all-reduce, so it counts W times;
- ``bug_dropout_per_rank`` (forward, found by ``ranks`` at ``blocks.0.mlp.dropout#0``): the
  dropout's generator is seeded with seed + rank (the generator meant for sharded tensors used
  on a replicated one), so replicas disagree from the dropout's output on. Rank 0 draws what the
  reference draws.

:data:`BUGS` lists them with the record where each shows; :data:`MAP_FILE`
(``tensor_parallel.map.toml``) is the port's mapping: its ``[[shard]]`` rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from layerdiff.errors import CaseError
from layerdiff.mapping import Mapping

from .porting import port_case

MODULE = "reference_models.tensor_parallel"

VOCAB, WIDTH, HEADS, LENGTH, BATCH, BLOCKS, STEPS = 48, 32, 4, 8, 4, 2, 2
HIDDEN = 4 * WIDTH
DROPOUT = 0.1
SEED = 0


# What the port shards, as the [[shard]] rules of its mapping file (the file a user passes to
# `diff --map`); every other tensor is replicated. A rule on a parameter covers its gradient; on
# input / output, the gradients of those arguments.
MAP_FILE = Path(__file__).with_name("tensor_parallel.map.toml")


def mapping() -> Mapping:
    """The port's mapping: same names as the reference, and its shard rules."""
    return Mapping.load(MAP_FILE)


def shard_rules_toml() -> str:
    """The mapping file's text (its ``[[shard]]`` tables)."""
    return MAP_FILE.read_text(encoding="utf-8")


@dataclass(frozen=True)
class PlantedParallelBug:
    """A planted bug of the tensor-parallel port and the record where it first shows."""

    spec: str
    site: str          # the port's site of that record
    pass_: str         # forward | backward
    role: str          # the record's role
    found_by: str      # diff (against the reference, ranks gathered) | ranks (replica check)
    ranks: tuple[int, ...] | None  # for `ranks`: the ranks that disagree, with a world of 2
    description: str


BUGS: tuple[PlantedParallelBug, ...] = (
    PlantedParallelBug(
        f"{MODULE}:bug_bias_before_allreduce", "blocks.0.mlp.proj#0", "forward", "output",
        "diff", None,
        "the row-parallel proj adds its bias on every rank before the all-reduce, so the "
        "reduced output holds it world-size times"),
    PlantedParallelBug(
        f"{MODULE}:bug_dropout_per_rank", "blocks.0.mlp.dropout#0", "forward", "output",
        "ranks", (1,),
        "the MLP's dropout generator is seeded with seed + rank, so the replicas of a "
        "replicated tensor draw different masks"),
)


def rank_and_world() -> tuple[int, int]:
    """This process's rank and the world size; (0, 1) when no process group is initialised."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- Megatron's conjugate communication functions


class CopyToParallel(torch.autograd.Function):
    """``f``: forward identity; backward all-reduce (sum) of the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad)
        return grad


class ReduceFromParallel(torch.autograd.Function):
    """``g``: forward all-reduce (sum) of the ranks' partial sums; backward identity (every
    rank's partial sum took the whole output gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


def copy_to_parallel(x: torch.Tensor, world: int) -> torch.Tensor:
    return CopyToParallel.apply(x) if world > 1 else x


def reduce_from_parallel(x: torch.Tensor, world: int) -> torch.Tensor:
    return ReduceFromParallel.apply(x) if world > 1 else x


def _part(size: int, world: int, what: str) -> int:
    if size % world:
        raise CaseError(f"case {MODULE}:port: {what} has {size} features, which do not split "
                        f"into {world} equal parts; run it on a world size dividing {size}")
    return size // world


class ColumnParallelLinear(nn.Module):
    """``y[..., rank's part] = x W_r^T + b_r``: rank r's rows of the weight and bias."""

    def __init__(self, in_features: int, out_features: int, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        part = _part(out_features, world, "fc's output")
        self.weight = nn.Parameter(torch.empty(part, in_features))
        self.bias = nn.Parameter(torch.zeros(part))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(copy_to_parallel(x, self.world), self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world={self.world}, shard={tuple(self.weight.shape)}"


class RowParallelLinear(nn.Module):
    """``y = sum over ranks of x_r W_r^T, + b``: rank r's columns of the weight; the bias is
    replicated and added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, rank: int, world: int) -> None:
        super().__init__()
        self.rank, self.world = rank, world
        part = _part(in_features, world, "proj's input")
        self.weight = nn.Parameter(torch.empty(out_features, part))
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_parallel(F.linear(x, self.weight), self.world) + self.bias

    def extra_repr(self) -> str:
        return f"rank={self.rank}, world={self.world}, shard={tuple(self.weight.shape)}"


class BiasBeforeAllReduce(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # BUG: the bias added on every rank before the all-reduce: it counts world-size times
        return reduce_from_parallel(F.linear(x, self.weight, self.bias), self.world)


# ---- the model


class TrackedDropout(nn.Module):
    """Inverted dropout from a generator of its own, seeded on every call with a number drawn
    from the default generator plus ``offset``: with the same default seed on every rank and
    offset 0 every replica draws the same mask (Megatron's RNG tracker keeps a per-rank
    generator for dropout on sharded tensors only)."""

    def __init__(self, p: float, offset: int = 0) -> None:
        super().__init__()
        self.p, self.offset = p, offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0:
            return x
        seed = int(torch.randint(0, 2**62, ()))
        generator = torch.Generator(device=x.device).manual_seed(seed + self.offset)
        keep = torch.rand(x.shape, generator=generator, device=x.device) >= self.p
        return x * keep / (1 - self.p)

    def extra_repr(self) -> str:
        return f"p={self.p}, offset={self.offset}"


class Attention(nn.Module):
    """Causal multi-head self-attention (replicated in the port)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(WIDTH, 3 * WIDTH)
        self.proj = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, width = x.shape
        heads = self.qkv(x).view(batch, length, 3, HEADS, width // HEADS).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(heads[0], heads[1], heads[2], is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, length, width))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(WIDTH, HIDDEN)
        self.act = nn.GELU()
        self.proj = nn.Linear(HIDDEN, WIDTH)
        self.dropout = TrackedDropout(DROPOUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.proj(self.act(self.fc(x))))


class ParallelMLP(MLP):
    """The MLP with ``fc`` column-parallel and ``proj`` row-parallel over ``world`` ranks."""

    def __init__(self, rank: int, world: int, proj: type[RowParallelLinear] = RowParallelLinear,
                 dropout_offset: int = 0) -> None:
        super().__init__()
        self.fc = ColumnParallelLinear(WIDTH, HIDDEN, rank, world)
        self.proj = proj(HIDDEN, WIDTH, rank, world)
        self.dropout = TrackedDropout(DROPOUT, dropout_offset)


class Block(nn.Module):
    def __init__(self, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(WIDTH)
        self.attn = Attention()
        self.ln2 = nn.LayerNorm(WIDTH)
        self.mlp = mlp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, mlp: Callable[[int], nn.Module] = lambda index: MLP()) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.pos = nn.Embedding(LENGTH, WIDTH)
        self.blocks = nn.ModuleList(Block(mlp(index)) for index in range(BLOCKS))
        self.ln_f = nn.LayerNorm(WIDTH)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = self.embed(tokens) + self.pos(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def reference() -> Case:
    """Next-token prediction on a fixed random batch: 4 sequences of 8 tokens, 2 SGD steps."""
    seed_everything(SEED)
    model = TinyGPT()
    tokens = torch.randint(0, VOCAB, (BATCH, LENGTH + 1))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def loss_fn(logits: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1))

    return Case(model=model, inputs=(inputs,), loss_fn=loss_fn, seed=SEED, steps=STEPS,
                optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{MODULE}:reference")


# ---- the port


def shard_of(tensor: torch.Tensor, dim: int, rank: int, world: int) -> torch.Tensor:
    """Rank ``rank``'s part of ``tensor`` cut into ``world`` equal parts along ``dim``."""
    return tensor.chunk(world, dim)[rank]


def shard_state(port: nn.Module, reference: nn.Module, rank: int, world: int) -> nn.Module:
    """Load into ``port`` rank ``rank``'s shards of ``reference``'s parameters and buffers (the
    same names; the shard rules say which are cut and along which dim)."""
    source, rules = reference.state_dict(), mapping()
    state = {}
    for name, tensor in source.items():
        module, _, leaf = name.rpartition(".")
        rule = rules.shard_rule(module, "weight", leaf)
        state[name] = shard_of(tensor, rule.dim, rank, world) if rule else tensor
    port.load_state_dict(state, strict=True)
    return port


def _port(name: str, mlp: Callable[[int, int, int], nn.Module]) -> Case:
    """The reference case running the tensor-parallel model whose block ``i`` MLP is
    ``mlp(i, rank, world)``, holding this rank's shards of the reference's weights."""
    rank, world = rank_and_world()

    def build(ref: nn.Module) -> nn.Module:
        model = TinyGPT(lambda index: mlp(index, rank, world))
        return shard_state(model, ref, rank, world)

    return port_case(reference, build, f"{MODULE}:{name}")


def port() -> Case:
    """The faithful tensor-parallel port (any world size dividing 128)."""
    return _port("port", lambda index, rank, world: ParallelMLP(rank, world))


def bug_bias_before_allreduce() -> Case:
    return _port("bug_bias_before_allreduce", lambda index, rank, world: ParallelMLP(
        rank, world, proj=BiasBeforeAllReduce if index == 0 else RowParallelLinear))


def bug_dropout_per_rank() -> Case:
    return _port("bug_dropout_per_rank", lambda index, rank, world: ParallelMLP(
        rank, world, dropout_offset=rank if index == 0 else 0))  # BUG: seed + rank
