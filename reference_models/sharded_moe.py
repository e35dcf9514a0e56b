"""A small mixture-of-experts classifier and its expert-parallel port.

``moe_reference``: ``inp`` (8 -> 8 features), ``moe`` (a ``router`` picking the top 2 of 8
experts per token, their probabilities renormalised, and ``experts``: each a GELU MLP 8 -> 16
-> 8 whose weights are stacked in ``w1`` (experts, 8, 16) and ``w2`` (experts, 16, 8)), a
residual, and ``head`` (8 -> 4 classes); cross-entropy on 16 tokens, 2 SGD steps.

``experts`` returns every expert's output for every token, weighted by that token's routing
weight for it (zero where the router did not pick it): a tensor (experts, tokens, 8) whose sum
over dim 0 is the layer's output. Every expert runs on every token (dense; the widths are tiny),
so the record's shape does not depend on the routing.

``expert_parallel`` (``sharded_expert_parallel.map.toml`` for 2 ranks,
``sharded_expert_parallel.w4.map.toml`` for 4): the experts placed round-robin, rank r holding
experts r, r + W, r + 2W, ... in that order along dim 0 of ``w1``, ``w2`` and its output (not
a contiguous split: cutting the reference's tensors into W equal parts would pair them with
the wrong experts). The tokens and the router are replicated; each rank computes its experts'
outputs, sums them, and the sums are all-reduced (Megatron's ``f`` at the experts' inputs and
``g`` after their sum, so every input gradient is the whole one).

Planted bug, one line away: ``bug_expert_parallel_placement`` holds the round-robin experts'
weights but takes their routing weights as if it held a contiguous block (rank r: experts
r*E/W ... (r+1)*E/W - 1): a rank computes with other experts' weights than the ones the
router's weights it applies are for. The experts' weights and inputs are right; their output
is not, on every rank: the diff should name ``moe.experts#0`` (forward, step 0).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, seed_everything
from layerdiff.errors import CaseError

from .sharded_model import LR, MODULE, rank_and_world
from .tensor_parallel import copy_to_parallel, reduce_from_parallel

TOKENS, FEATURES, DIM, HIDDEN, EXPERTS, TOP_K, CLASSES, STEPS = 16, 8, 8, 16, 8, 2, 4, 2
SEED = 1


def round_robin(rank: int, world: int, experts: int = EXPERTS) -> list[int]:
    """The experts rank ``rank`` holds, in their order along the stacked dim."""
    if experts % world:
        raise CaseError(f"case {MODULE}:expert_parallel: {experts} experts do not split into "
                        f"{world} equal parts; run it on a world size dividing {experts}")
    return list(range(rank, experts, world))


def contiguous(rank: int, world: int, experts: int = EXPERTS) -> list[int]:
    per_rank = experts // world
    return list(range(rank * per_rank, (rank + 1) * per_rank))


class Experts(nn.Module):
    """The experts ``ids`` (global indices, in their order along dim 0 of the weights)."""

    def __init__(self, ids: list[int], world: int = 1) -> None:
        super().__init__()
        self.ids, self.world = ids, world
        self.w1 = nn.Parameter(torch.randn(len(ids), DIM, HIDDEN) / DIM**0.5)
        self.w2 = nn.Parameter(torch.randn(len(ids), HIDDEN, DIM) / HIDDEN**0.5)

    def forward(self, x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(tokens, dim), (tokens, all experts) -> (my experts, tokens, dim)."""
        x, weights = copy_to_parallel(x, self.world), copy_to_parallel(weights, self.world)
        hidden = F.gelu(torch.einsum("td,edh->eth", x, self.w1))
        out = torch.einsum("eth,ehd->etd", hidden, self.w2)
        return out * weights[:, self.ids].T.unsqueeze(-1)

    def extra_repr(self) -> str:
        return f"ids={self.ids}"


class MoE(nn.Module):
    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = experts

    def routing_weights(self, x: torch.Tensor) -> torch.Tensor:
        """(tokens, experts): each token's top-2 probabilities, renormalised, 0 elsewhere."""
        probs = F.softmax(self.router(x), dim=-1)
        top, index = probs.topk(TOP_K, dim=-1)
        return torch.zeros_like(probs).scatter(-1, index, top / top.sum(-1, keepdim=True))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts(x, self.routing_weights(x)).sum(0)
        return reduce_from_parallel(out, self.experts.world)


class MoENet(nn.Module):
    def __init__(self, experts: Experts) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, DIM)
        self.moe = MoE(experts)
        self.head = nn.Linear(DIM, CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        return self.head(h + self.moe(h))


def _parts() -> tuple[MoENet, torch.Tensor, torch.Tensor]:
    seed_everything(SEED)
    model = MoENet(Experts(list(range(EXPERTS))))
    return model, torch.randn(TOKENS, FEATURES), torch.randint(0, CLASSES, (TOKENS,))


def _case(model: nn.Module, x: torch.Tensor, targets: torch.Tensor, name: str) -> Case:
    return Case(model=model, inputs=(x,), loss_fn=lambda logits: F.cross_entropy(logits, targets),
                seed=SEED, steps=STEPS, optimizer=lambda params: torch.optim.SGD(params, lr=LR),
                name=f"{MODULE}:{name}")


def moe_reference() -> Case:
    """The mixture-of-experts classifier, every expert in one process."""
    return _case(*_parts(), "moe_reference")


def _expert_parallel(name: str, computes_as: Callable[[int, int], list[int]] = round_robin) -> Case:
    rank, world = rank_and_world()
    reference, x, targets = _parts()
    held = round_robin(rank, world)
    model = MoENet(Experts(computes_as(rank, world), world))
    state = reference.state_dict()
    for leaf in ("w1", "w2"):
        state[f"moe.experts.{leaf}"] = state[f"moe.experts.{leaf}"][held]
    model.load_state_dict(state, strict=True)
    return _case(model, x, targets, name)


def expert_parallel() -> Case:
    """The experts placed round-robin over the ranks, tokens replicated."""
    return _expert_parallel("expert_parallel")


def bug_expert_parallel_placement() -> Case:
    return _expert_parallel("bug_expert_parallel_placement", contiguous)  # BUG: not round_robin
