"""The sharded ports of :mod:`reference_models.sharded_model` that PyTorch's DTensor cuts:
FSDP2 data parallelism and tensor parallelism by ``parallelize_module``.

Their parameters (and, under tensor parallelism, the tensors the plan's hooks convert) are
DTensors, which carry their own layout: a capture records it, so these ports need no
``[[shard]]`` rules. Each rank builds the whole reference from the same seed, copies its
weights, then lets FSDP or the plan cut them; with no process group (world 1) the model is
left whole, and each port is the reference.

- ``fsdp``: every block wrapped with ``fully_shard``, then the root, over a 1-D mesh of the
  world; each rank runs its contiguous part of the batch (``inputs.chunk(W)[rank]``) with the
  mean loss of that part, and FSDP averages the gradients: with equal parts, the reference's.
  What each rank records of its part, measured: activations are its part of the batch (dim
  0), except the position embedding's output (positions, width), the same on every rank; the
  activations' gradients are W times the reference's part (each rank's loss is its part's
  mean; FSDP's averaging divides only the weights' gradients by W), and the position
  embedding's output gradient is W times the rank's term of a sum over the ranks.
- ``fsdp_same_batch``: the same, every rank running the whole batch.
- ``dtensor_tp``: in every block ``attn.q``/``k``/``v`` and ``mlp.fc`` column-parallel,
  ``attn.out`` and ``mlp.proj`` row-parallel (Megatron's pairs); the attention's code reads
  its local head count from the width of ``q``'s (local) output; ``fc`` hands its output on
  as a DTensor, so that ``act``'s records carry their layout too (:func:`tp_plan`).
- ``fsdp_tp``: 2-D parallelism as torchtitan's, on a (dp, tp) mesh of W/2 x 2 ranks (4 in the
  tests): every block ``parallelize_module``'d over ``tp`` by :func:`tp_plan`, then
  ``fully_shard`` over ``dp`` (each block, then the root); each dp replica (the ranks of one
  dp coordinate) runs its contiguous part of the batch. Over 4 gloo ranks, without layerdiff,
  its loss is the reference's (3.6966486, 3.6259489 against 3.6966486, 3.6259487).

Planted bugs, one line away:
- ``bug_fsdp_activation``: block 1's MLP computes ReLU where the reference has GELU; the diff
  should name ``blocks.1.mlp.act#0`` (forward, step 0), every rank's part of the batch wrong.
- ``bug_dtensor_tp_heads``: the attention views its projections as the model's 4 heads,
  not the rank's 4 / W: each rank splits its heads into narrower ones. Code between the
  attention's children, so the diff should name ``blocks.0.attn#0`` (forward, step 0); its
  output is replicated after ``out``'s all-reduce.
- ``bug_fsdp_tp_activation``: ``fsdp_tp`` with block 0's MLP computing ReLU for GELU, between
  the column- and the row-parallel layer: ``blocks.0.mlp.act#0`` (forward, step 0), every
  rank's part.
- ``bug_fsdp_tp_rank_shard``: ``fsdp_tp`` where, after ``fully_shard``, the last rank (rank 3:
  dp 1, tp 1) scales its kept shard (``_local_tensor``) of ``blocks.1.mlp.fc.weight`` by 1.01,
  a loading slip on one rank. Ranks 1 and 3 compute with the slipped tp part (all-gathered
  over dp); the diff should name the weight at ``blocks.1.mlp.fc#0`` (step 0) in rank 3's
  part only, by its gradient's 2-D layout.
"""

from __future__ import annotations

from torch import nn

from layerdiff import Case

from .sharded_model import (
    HEADS,
    MLP,
    Attention,
    Block,
    TinyGPT,
    copy_state,
    gpt_case,
    next_token_loss,
    rank_and_world,
    reference_parts,
)


def _mesh(world: int, name: str):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=(name,))


# ---- FSDP2


class ReluMLP(MLP):
    def __init__(self) -> None:
        super().__init__()
        self.act = nn.ReLU()  # BUG: the reference's MLP has GELU here


def _fsdp(name: str, same_batch: bool = False, bug_block: int | None = None) -> Case:
    rank, world = rank_and_world()
    reference, inputs, targets = reference_parts()
    model = TinyGPT(lambda index: Block(mlp=ReluMLP() if index == bug_block else MLP()))
    copy_state(model, reference)
    if not same_batch:  # data parallel: this rank's contiguous part of the batch
        inputs, targets = inputs.chunk(world)[rank], targets.chunk(world)[rank]
    if world > 1:
        from torch.distributed.fsdp import fully_shard

        mesh = _mesh(world, "dp")
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    return gpt_case(model, inputs, next_token_loss(targets), name)


def fsdp() -> Case:
    """The reference under FSDP2, each rank on its part of the batch."""
    return _fsdp("fsdp")


def fsdp_same_batch() -> Case:
    """The reference under FSDP2, every rank on the whole batch."""
    return _fsdp("fsdp_same_batch", same_batch=True)


def bug_fsdp_activation() -> Case:
    return _fsdp("bug_fsdp_activation", bug_block=1)


# ---- tensor parallel by parallelize_module


def tp_plan() -> dict:
    """Megatron's pairs in a block: q, k, v and fc column-parallel (their outputs the rank's
    heads / hidden features), out and proj row-parallel (their outputs all-reduced).

    fc hands on a DTensor (``use_local_output=False``), so the GELU module between fc and proj
    takes and returns one, whose layout a capture records. With the default (a plain tensor,
    the rank's part), act's records would be plain local parts that need a ``[[shard]]`` rule
    (``site = "blocks.*.mlp.act"``, ``dim = -1``): no DTensor says how they are cut. q, k and
    v hand on plain parts: the attention's own code takes them, no module records them."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
            "attn.v": ColwiseParallel(), "attn.out": RowwiseParallel(),
            "mlp.fc": ColwiseParallel(use_local_output=False), "mlp.proj": RowwiseParallel()}


class ModelHeadsAttention(Attention):
    def heads(self, x):
        # BUG: the model's head count, not the rank's: with W ranks each head is W times narrower
        return x.view(x.size(0), x.size(1), HEADS, -1).transpose(1, 2)


def _tensor_parallel(name: str, attention: type[Attention] = Attention) -> Case:
    _, world = rank_and_world()
    reference, inputs, targets = reference_parts()
    model = TinyGPT(lambda index: Block(attn=attention()))
    copy_state(model, reference)
    if world > 1:
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = _mesh(world, "tp")
        for block in model.blocks:
            parallelize_module(block, mesh, tp_plan())
    return gpt_case(model, inputs, next_token_loss(targets), name)


def dtensor_tp() -> Case:
    """The reference with every block's attention and MLP tensor-parallel (DTensor)."""
    return _tensor_parallel("dtensor_tp")


def bug_dtensor_tp_heads() -> Case:
    return _tensor_parallel("bug_dtensor_tp_heads", ModelHeadsAttention)


# ---- 2-D: FSDP2 over dp, tensor parallel inside each replica (torchtitan's 2-D parallelism)


def _fsdp_tp(name: str, bug_block: int | None = None, slip: str | None = None) -> Case:
    """On a (dp, tp) mesh of W/2 x 2 ranks: every block ``parallelize_module``'d over ``tp``
    (:func:`tp_plan`), then ``fully_shard`` over ``dp`` (each block, then the root); each dp
    replica runs its contiguous part of the batch. ``slip``: the parameter whose local shard
    the world's last rank scales by 1.01 after sharding (a loading slip on one rank)."""
    rank, world = rank_and_world()
    reference, inputs, targets = reference_parts()
    model = TinyGPT(lambda index: Block(mlp=ReluMLP() if index == bug_block else MLP()))
    copy_state(model, reference)
    if world > 1:
        import torch
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import parallelize_module

        if world % 2 or world < 4:
            raise ValueError(f"{name} runs on a (dp, tp) mesh with tp = 2 and dp >= 2: a "
                             f"world of 4, 6, ... ranks, not {world}")
        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], tp_plan())
        for block in model.blocks:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        replica, replicas = mesh["dp"].get_local_rank(), mesh["dp"].size()
        inputs, targets = inputs.chunk(replicas)[replica], targets.chunk(replicas)[replica]
        if slip is not None and rank == world - 1:
            with torch.no_grad():  # BUG: this rank's shard of the weight loaded 1% off
                model.get_parameter(slip)._local_tensor.mul_(1.01)
    return gpt_case(model, inputs, next_token_loss(targets), name)


def fsdp_tp() -> Case:
    """The reference under 2-D parallelism: tensor parallel over ``tp`` inside FSDP2 over
    ``dp``, each dp replica on its part of the batch."""
    return _fsdp_tp("fsdp_tp")


def bug_fsdp_tp_activation() -> Case:
    return _fsdp_tp("bug_fsdp_tp_activation", bug_block=0)


def bug_fsdp_tp_rank_shard() -> Case:
    return _fsdp_tp("bug_fsdp_tp_rank_shard", slip="blocks.1.mlp.fc.weight")

