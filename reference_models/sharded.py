"""Sharded ports of one-process references, each with a planted bug one line away (issue 43).

Every port runs over the ranks of ``torch.distributed`` (rank and world size read when the case
is built; world 1, the reference itself, when no process group is initialised), on worlds of 2
and 4 (``fsdp_tp``, a 2 x 2 mesh, and its bugs on 4 only: :attr:`ShardedPort.worlds`), and
keeps the reference's module names. Gathered by its layout, each faithful port's records are the
reference's within float32 rounding.

========================  ===============================  =======================================
case                      how it is cut                    its layout, written down by
========================  ===============================  =======================================
``fsdp``                  FSDP2 ``fully_shard``, batch     DTensor parameters (capture), batch
                          split over the ranks             split (``data_parallel`` meta)
``fsdp_same_batch``       the same, whole batch per rank   the same, activations replicated
``dtensor_tp``            ``parallelize_module``: q/k/v,   DTensor (capture)
                          fc colwise; out, proj rowwise
``fsdp_tp``               2-D (dp, tp) mesh, 4 ranks only: DTensor 2-D placements (capture),
                          ``dtensor_tp``'s plan over tp,   batch split over dp
                          FSDP2 over dp, batch over dp     (``data_parallel`` meta groups)
``partial_sum``           hand-written row-parallel proj   ``sharded_partial_sum.map.toml``
                          recorded before its all-reduce
``zigzag_cp``             sequence in 2W chunks, rank i    ``sharded_zigzag_cp.map.toml``
                          chunks i and 2W-1-i
``expert_parallel``       experts round-robin over ranks   ``sharded_expert_parallel.map.toml``
                                                           (W=2), ``...expert_parallel.w4...`` (4)
========================  ===============================  =======================================

The references: :func:`reference` (a tiny GPT, :mod:`.sharded_model`) for all but
``expert_parallel``, whose reference is :func:`moe_reference` (:mod:`.sharded_moe`).
:data:`BUGS` lists each planted bug with the record the diff should name as its origin.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .sharded_dtensor import (
    bug_dtensor_tp_heads,
    bug_fsdp_activation,
    bug_fsdp_tp_activation,
    bug_fsdp_tp_rank_shard,
    dtensor_tp,
    fsdp,
    fsdp_same_batch,
    fsdp_tp,
)
from .sharded_manual import bug_partial_sum_unreduced, bug_zigzag_kv_order, partial_sum, zigzag_cp
from .sharded_model import MODULE, reference
from .sharded_moe import bug_expert_parallel_placement, expert_parallel, moe_reference

__all__ = [
    "BUGS", "PORTS", "PlantedShardBug", "ShardedPort", "bug_dtensor_tp_heads",
    "bug_expert_parallel_placement", "bug_fsdp_activation", "bug_fsdp_tp_activation",
    "bug_fsdp_tp_rank_shard", "bug_partial_sum_unreduced", "bug_zigzag_kv_order",
    "dtensor_tp", "expert_parallel", "fsdp", "fsdp_same_batch", "fsdp_tp", "map_file",
    "moe_reference", "partial_sum", "reference", "zigzag_cp",
]

HERE = Path(__file__).parent
WORLDS = (2, 4)


def map_file(case: str, world: int) -> Path | None:
    """The mapping file (its ``[[shard]]`` rules) of port ``case`` on ``world`` ranks; None for
    the DTensor ports, whose capture records their layouts. A world with an experts list of its
    own has a file of its own (``.w<W>.map.toml``)."""
    for name in (f"sharded_{case}.w{world}.map.toml", f"sharded_{case}.map.toml"):
        if (HERE / name).exists():
            return HERE / name
    return None


@dataclass(frozen=True)
class ShardedPort:
    """A faithful port and the reference it is compared with."""

    case: str        # function name in this module
    reference: str   # its reference's function name
    worlds: tuple[int, ...] = WORLDS  # the world sizes it runs on

    @property
    def spec(self) -> str:
        return f"{MODULE}:{self.case}"


PORTS: tuple[ShardedPort, ...] = (
    ShardedPort("fsdp", "reference"),
    ShardedPort("fsdp_same_batch", "reference"),
    ShardedPort("dtensor_tp", "reference"),
    ShardedPort("partial_sum", "reference"),
    ShardedPort("zigzag_cp", "reference"),
    ShardedPort("expert_parallel", "moe_reference"),
    ShardedPort("fsdp_tp", "reference", (4,)),
)


@dataclass(frozen=True)
class PlantedShardBug:
    """A planted bug of a sharded port and the record the diff should name as its origin."""

    case: str
    port: str        # the faithful port it is one line away from (its mapping is the same)
    site: str
    pass_: str
    role: str
    step: int
    # world size -> the ranks whose part of the origin record (or whose copy, where it is
    # replicated) is wrong, where only some are; a world missing here: every rank's
    ranks: dict[int, tuple[int, ...]]
    description: str = ""
    worlds: tuple[int, ...] = WORLDS  # the world sizes it runs on (its port's)

    @property
    def spec(self) -> str:
        return f"{MODULE}:{self.case}"

    def wrong_ranks(self, world: int) -> list[int]:
        """The ranks the diff should name for the origin on ``world`` ranks (its
        ``origins[].ranks``)."""
        return list(self.ranks.get(world, range(world)))


BUGS: tuple[PlantedShardBug, ...] = (
    PlantedShardBug(
        "bug_fsdp_activation", "fsdp", "blocks.1.mlp.act#0", "forward", "output", 0, {},
        "block 1's MLP computes ReLU where the reference has GELU (every rank's part of the "
        "batch)"),
    PlantedShardBug(
        "bug_dtensor_tp_heads", "dtensor_tp", "blocks.0.attn#0", "forward", "output", 0, {},
        "the attention views its rank's q/k/v as the model's 4 heads, W times narrower, not "
        "as its 4/W heads; the output is replicated after out's all-reduce"),
    PlantedShardBug(
        "bug_partial_sum_unreduced", "partial_sum", "blocks.0.mlp#0", "forward", "output", 0,
        {}, "block 0's MLP returns proj's partial sum without the all-reduce: proj's record is "
        "right (partial), the MLP's replicated output is rank 0's term only"),
    PlantedShardBug(
        "bug_zigzag_kv_order", "zigzag_cp", "blocks.0.attn#0", "forward", "output", 0,
        {4: (1, 2, 3)},
        "the gathered keys and values are left in rank order, masked as if in sequence order: "
        "on 4 ranks rank 0's part is right (its positions 0 and 7 see the right keys), on 2 "
        "ranks rank 0's position 6 is wrong too"),
    PlantedShardBug(
        "bug_expert_parallel_placement", "expert_parallel", "moe.experts#0", "forward",
        "output", 0, {},
        "each rank holds the round-robin experts' weights but applies the routing weights of "
        "a contiguous block of experts"),
    PlantedShardBug(
        "bug_fsdp_tp_activation", "fsdp_tp", "blocks.0.mlp.act#0", "forward", "output", 0, {},
        "block 0's MLP computes ReLU where the reference has GELU, between the column- and the "
        "row-parallel layer: every rank's part (its features of its replica's batch)",
        worlds=(4,)),
    PlantedShardBug(
        "bug_fsdp_tp_rank_shard", "fsdp_tp", "blocks.1.mlp.fc#0", "forward", "weight", 0,
        {4: (3,)},
        "after fully_shard, rank 3 (dp 1, tp 1) scales its kept shard of blocks.1.mlp.fc's "
        "weight by 1.01: a loading slip on one rank, in the tp part ranks 1 and 3 all-gather",
        worlds=(4,)),
)
