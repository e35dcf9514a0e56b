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

Planted bugs, one line away:
- ``bug_fsdp_activation``: block 1's MLP computes ReLU where the reference has GELU; the diff
  should name ``blocks.1.mlp.act#0`` (forward, step 0), every rank's part of the batch wrong.
- ``bug_dtensor_tp_heads``: the attention views its projections as the model's 4 heads,
  not the rank's 4 / W: each rank splits its heads into narrower ones. Code between the
  attention's children, so the diff should name ``blocks.0.attn#0`` (forward, step 0); its
  output is replicated after ``out``'s all-reduce.
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
