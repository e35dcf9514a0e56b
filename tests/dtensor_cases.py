"""Ports of the tensor-parallel test model sharded by torch's own DTensor APIs (loaded by spec in
spawned rank processes): FSDP2's ``fully_shard``, tensor parallelism by ``parallelize_module``,
and DDP. Each holds the reference's weights and trains on the reference's batch on every rank."""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from layerdiff import Case
from reference_models import tensor_parallel as tp
from reference_models.porting import port_case


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _copy(reference: nn.Module) -> nn.Module:
    model = tp.TinyGPT()
    model.load_state_dict(reference.state_dict())
    return model


def _fully_sharded(name: str, divide_factor: float | None = None) -> Case:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def build(reference: nn.Module) -> nn.Module:
        model = _copy(reference)
        mesh = init_device_mesh("cpu", (_world(),))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        if divide_factor is not None:
            for module in model.modules():
                if hasattr(module, "set_gradient_divide_factor"):
                    module.set_gradient_divide_factor(divide_factor)
                    # gloo has no pre-multiplied sum: FSDP sums, then divides itself
                    module.set_force_sum_reduction_for_comms(True)
        return model

    return port_case(tp.reference, build, f"tests.dtensor_cases:{name}")


def fsdp() -> Case:
    """Each block and the root ``fully_shard``-ed over every rank (FSDP2's defaults)."""
    return _fully_sharded("fsdp")


def fsdp_divide_by_four() -> Case:
    """:func:`fsdp` with the gradients divided by 4 instead of the world size."""
    return _fully_sharded("fsdp_divide_by_four", 4.0)


def tensor_parallel() -> Case:
    """Each block's MLP split by ``parallelize_module``: ``fc`` column-wise, ``proj`` row-wise."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    def build(reference: nn.Module) -> nn.Module:
        model = _copy(reference)
        mesh = init_device_mesh("cpu", (_world(),), mesh_dim_names=("tp",))
        for block in model.blocks:
            parallelize_module(block.mlp, mesh, {"fc": ColwiseParallel(),
                                                 "proj": RowwiseParallel()})
        return model

    return port_case(tp.reference, build, "tests.dtensor_cases:tensor_parallel")


def loss_parallel() -> Case:
    """:func:`tensor_parallel` with the head column-parallel, its logits left cut along the
    vocabulary (a ``Shard(-1)`` DTensor), and the loss and backward under torch's
    ``loss_parallel()``, as torchtitan trains (``step_context``)."""
    import dataclasses

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from torch.distributed.tensor.parallel import loss_parallel as context

    case = tensor_parallel()
    mesh = case.model.blocks[0].mlp.fc.weight.device_mesh
    parallelize_module(case.model, mesh, {"head": ColwiseParallel(
        output_layouts=Shard(-1), use_local_output=False)})
    return dataclasses.replace(case, name="tests.dtensor_cases:loss_parallel",
                               step_context=context)


def ddp() -> Case:
    """The model in ``DistributedDataParallel`` (gradients all-reduced and averaged)."""
    from torch.nn.parallel import DistributedDataParallel

    def build(reference: nn.Module) -> nn.Module:
        return DistributedDataParallel(_copy(reference))

    return port_case(tp.reference, build, "tests.dtensor_cases:ddp")


def sequence_parallel() -> Case:
    """torchtitan's sequence-parallel plan on the tiny GPT: the token embedding row-parallel
    with its output cut along the sequence (``Shard(1)``), the norms ``SequenceParallel``, each
    MLP's ``fc`` column- and ``proj`` row-parallel with the sequence gathered before them and cut
    again after ``proj``, and the head column-parallel on the gathered sequence.

    Three things of the model (left as it is) need the plan adapted: the position embedding's
    output is added to the token embedding's sequence part, so it is row-parallel too, cut along
    its positions (``Shard(0)``); attention's fused ``qkv`` is viewed as a fixed number of heads,
    so it stays replicated on the gathered sequence and only its ``proj`` is row-parallel; the
    MLP's dropout draws its mask for the shape it is given, so it runs on the gathered sequence
    (the reference's mask) and its output is cut again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleInputOutput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    def gathered(local: bool) -> PrepareModuleInput:
        return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                  use_local_output=local)

    def build(reference: nn.Module) -> nn.Module:
        model = _copy(reference)
        mesh = init_device_mesh("cpu", (_world(),), mesh_dim_names=("tp",))
        parallelize_module(model, mesh, {
            "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "pos": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),
            "ln_f": SequenceParallel(),
            "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
        for block in model.blocks:
            parallelize_module(block, mesh, {
                "ln1": SequenceParallel(),
                "attn": gathered(local=True),
                "attn.proj": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                "ln2": SequenceParallel(),
                "mlp": gathered(local=False),
                "mlp.fc": ColwiseParallel(),
                "mlp.proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp.dropout": PrepareModuleInputOutput(
                    input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                    use_local_input=True, output_layouts=(Replicate(),),
                    desired_output_layouts=(Shard(1),), use_local_output=True)})
        return model

    return port_case(tp.reference, build, "tests.dtensor_cases:sequence_parallel")
