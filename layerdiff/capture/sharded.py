"""Sharded tensors in a torch capture: each rank records its own part of a DTensor, and writes
down how the ranks' parts make the whole (its *layout*), for the gather to put them together.

A ``torch.distributed.tensor.DTensor`` (FSDP2's sharded parameters and their gradients, tensor
parallel weights and activations) is recorded as this rank's local tensor: no collective runs
while capturing, and the bytes are the ones this rank computed with. Its layout (the device
mesh, the global ranks at each mesh position, one placement per mesh dim, the global shape) is
collected per record and written at the end of the capture into the rank file's meta key
``"layouts"``, in the form ``layerdiff.trace.layout`` reads (docs/distributed.md).
A plain tensor that is a DTensor's local part under another name (what tensor parallelism hands
the modules between its layers) gets that DTensor's layout (:class:`Aliases`).

Data parallelism (FSDP2's ``fully_shard``, ``DistributedDataParallel``) is written into meta key
``"data_parallel"``: which ranks hold replicas of the model, the factor the summed gradients are
divided by, and what a weight and a weight-gradient record of such a model mean.

Nothing here imports ``torch.distributed.tensor``: a process that never imported it holds no
DTensor, so a plain capture pays no import and one type check per tensor.
"""

from __future__ import annotations

import sys
import weakref
from collections import OrderedDict
from typing import Any

import torch
from torch import nn

# the DTensor module, once something imported it (it is imported by whoever builds one)
_DTENSOR_MODULE = "torch.distributed.tensor"


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor (a parameter holding one is one too)."""
    module = sys.modules.get(_DTENSOR_MODULE)
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: Any) -> torch.Tensor:
    """This rank's part of a DTensor, detached: what ``to_local()`` returns outside autograd
    (no node is added to the graph, no collective runs).

    A row-parallel embedding's output is a masked partial sum: the rows of tokens whose
    embeddings another rank holds are looked up at a clamped id and zeroed only by the
    reduction. Its part is recorded with them zeroed, as the reduction adds it."""
    local = tensor._local_tensor.detach()
    for placement in tensor.placements:
        mask = getattr(getattr(placement, "mask_buffer", None), "data", None)
        if mask is not None:
            local = local.clone()
            local[mask] = 0
    return local


def module_type_name(module: nn.Module) -> str:
    """The name of the module's class as the model defines it: ``fully_shard`` swaps a module's
    class for a subclass ``FSDP<Name>`` of ``FSDPModule`` and it, which a one-process
    reference does not have."""
    kind = type(module)
    fsdp = sys.modules.get("torch.distributed.fsdp")
    module_type = getattr(fsdp, "FSDPModule", None)
    if module_type is not None and isinstance(module, module_type):
        for base in kind.__bases__:
            if not issubclass(base, module_type):
                return base.__name__
    return kind.__name__


def placement_json(placement: Any, ndim: int) -> dict[str, Any]:
    """One DTensor placement in the trace's words: shard (dim), strided_shard (dim,
    split_factor), replicate, partial (reduce)."""
    name = type(placement).__name__
    if name == "_StridedShard":   # checked first: it is (or was) a subclass of Shard
        return {"kind": "strided_shard", "dim": _dim(placement.dim, ndim),
                "split_factor": int(placement.split_factor)}
    if placement.is_shard():
        return {"kind": "shard", "dim": _dim(placement.dim, ndim)}
    if placement.is_replicate():
        return {"kind": "replicate"}
    if placement.is_partial():
        return {"kind": "partial", "reduce": _REDUCE.get(str(placement.reduce_op),
                                                           str(placement.reduce_op))}
    return {"kind": name}   # a placement this version does not know: the gather refuses it


# DTensor's reduce op names (``Partial.reduce_op``) in the trace's words
_REDUCE = {"sum": "sum", "avg": "avg", "max": "max", "min": "min",
           "SUM": "sum", "AVG": "avg", "MAX": "max", "MIN": "min"}


def _dim(dim: int, ndim: int) -> int:
    """A tensor dim counted from the front (DTensor accepts Shard(-1))."""
    return dim + ndim if dim < 0 and ndim else dim


def layout_json(tensor: Any) -> dict[str, Any]:
    """A DTensor's layout: mesh sizes, mesh dim names, the global rank at each mesh position
    (row-major), its placements (outermost mesh dim first) and its global shape."""
    mesh = tensor.device_mesh
    names = mesh.mesh_dim_names or ("",) * mesh.ndim
    shape = list(tensor.shape)
    return {"mesh": list(mesh.shape), "names": [name or "" for name in names],
            "ranks": [int(rank) for rank in mesh.mesh.flatten().tolist()],
            "placements": [placement_json(p, len(shape)) for p in tensor.placements],
            "shape": shape}


class Layouts:
    """The layouts of one capture's DTensor records: a table of distinct layouts and, per
    (site, role, arg), the index of its layout. A record keeps its first layout; one whose
    layout differs at a later step is listed in ``varied``."""

    def __init__(self) -> None:
        self.table: list[dict[str, Any]] = []
        self.rows: dict[tuple[str, str, str], int] = {}
        self.varied: dict[tuple[str, str, str], None] = {}
        self._index: dict[Any, int] = {}   # (mesh, placements, shape) -> table index

    def add(self, site: str, role: str, arg: str, tensor: Any) -> int:
        """Note the layout of the DTensor recorded as (site, role, arg); its table index."""
        spec = tensor._spec
        key = (spec.mesh, spec.placements, tuple(spec.shape))
        index = self._index.get(key)
        if index is None:
            layout = layout_json(tensor)
            if layout in self.table:   # the same layout under an equal mesh object
                index = self.table.index(layout)
            else:
                index = len(self.table)
                self.table.append(layout)
            self._index[key] = index
        self.note(site, role, arg, index)
        return index

    def note(self, site: str, role: str, arg: str, index: int) -> None:
        """Note that (site, role, arg) has the layout at ``index`` of the table."""
        row = (site, role, arg)
        first = self.rows.setdefault(row, index)
        if first != index:
            self.varied[row] = None

    def meta(self) -> dict[str, Any]:
        """The meta keys to write (none when no record was a DTensor)."""
        if not self.rows:
            return {}
        found: dict[str, Any] = {"layouts": {
            "table": self.table,
            "records": [[site, role, arg, index] for (site, role, arg), index
                        in self.rows.items()]}}
        if self.varied:
            found["layouts_varied"] = [list(row) for row in self.varied]
        return found


class Aliases:
    """Plain records that are a DTensor's local part under another name, given its layout.

    Tensor parallelism hands the modules between its layers plain local tensors: with
    ``ColwiseParallel(use_local_output=True)`` a GELU between a column- and a row-parallel
    Linear takes the column-parallel output after ``to_local()`` and returns what
    ``RowwiseParallel`` wraps with ``DTensor.from_local(..., Shard(-1))``; their gradients
    likewise. Such a plain tensor is the same memory, seen the same way (storage, offset,
    shape, strides, dtype), at the same version, as a DTensor's local part recorded before or
    after it: it IS that rank's part of the DTensor, so the DTensor's layout says how the
    ranks' parts of it make the whole (``to_local`` and ``from_local`` assert exactly that).
    Except a partial one: torch.distributed's in-place collectives change a tensor's bytes
    without counting a version, and ``dist.all_reduce`` of a partial local part in place is
    how code makes it whole; its plain records keep no layout (replicated, as before).

    Only recent records are kept (``size`` of each kind: an alias is recorded next to its
    DTensor, a module's input after the output that feeds it), by a weak reference to their
    storage: a storage freed since cannot be matched, though a new one reuses its address.
    """

    def __init__(self, layouts: Layouts, size: int = 32) -> None:
        self.layouts = layouts
        self.size = size
        # identity -> (weak reference to the storage, layout index) of DTensor local parts
        self._parts: OrderedDict[tuple, tuple[weakref.ref, int]] = OrderedDict()
        # identity -> (weak reference to the storage, [(site, role, arg)]) of plain records
        self._plain: OrderedDict[tuple, tuple[weakref.ref, list]] = OrderedDict()
        self._partial: dict[int, bool] = {}   # layout index -> whether a placement is partial

    def part(self, tensor: Any, index: int) -> None:
        """A DTensor with layout ``index`` was recorded: the plain records of its local part
        seen before get its layout, and those seen after it will."""
        partial = self._partial.get(index)
        if partial is None:
            partial = self._partial[index] = any(
                p["kind"] == "partial" for p in self.layouts.table[index]["placements"])
        if partial:
            return
        found = _identity(tensor._local_tensor)
        if found is None:
            return
        key, storage = found
        earlier = self._plain.pop(key, None)
        if earlier is not None and earlier[0]() is storage:
            for row in earlier[1]:
                self.layouts.note(*row, index)
        _put(self._parts, key, (weakref.ref(storage), index), self.size)

    def plain(self, site: str, role: str, arg: str, tensor: torch.Tensor) -> None:
        """A plain tensor was recorded as (site, role, arg)."""
        found = _identity(tensor)
        if found is None:
            return
        key, storage = found
        part = self._parts.get(key)
        if part is not None and part[0]() is storage:
            self.layouts.note(site, role, arg, part[1])
            return
        earlier = self._plain.get(key)
        if earlier is not None and earlier[0]() is storage:
            earlier[1].append((site, role, arg))
        else:
            _put(self._plain, key, (weakref.ref(storage), [(site, role, arg)]), self.size)


def _identity(tensor: torch.Tensor) -> tuple[tuple, Any] | None:
    """How a tensor sees its memory (storage address, offset, shape, strides, dtype, version)
    and its storage; None for a tensor with no storage or no version counter."""
    if tensor.layout is not torch.strided or tensor.is_inference():
        return None
    try:
        # one Python object per live storage: a weak reference to it dies with the storage
        storage = tensor.untyped_storage()
        address = storage.data_ptr()
    except (RuntimeError, NotImplementedError):
        # a subclass with no storage of its own, as the AsyncCollectiveTensor a sequence-
        # parallel redistribute leaves as a DTensor's local part ("invalid python storage")
        return None
    return ((address, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(),
             tensor.dtype, tensor._version), storage)


def _put(recent: OrderedDict, key: tuple, value: tuple, size: int) -> None:
    recent[key] = value
    recent.move_to_end(key)
    if len(recent) > size:
        recent.popitem(last=False)


# what a weight and a weight-gradient record mean under each kind of data parallelism
_FULLY_SHARD_WEIGHTS = ("unsharded: the whole weight each module computed with (after FSDP's "
                        "all-gather)")
# FSDP over one mesh dim of the world (tensor parallelism inside each replica): the all-gather
# makes a tensor-parallel weight its rank's tensor-parallel part, not the whole
_FULLY_SHARD_WEIGHTS_OF_DIM = ("unsharded over the data-parallel ranks: the weight each module "
                               "computed with (after FSDP's all-gather), whole, or a "
                               "tensor-parallel module's the rank's tensor-parallel part")
_FULLY_SHARD_GRADS = ("reduced: each rank's shard of the gradient after FSDP's "
                      "reduce-scatter")
_DDP_WEIGHTS = "replicated: every rank holds the whole weight"
_DDP_GRADS = ("reduced: the whole gradient, averaged over the ranks by DDP's all-reduce")


def data_parallel_meta(model: nn.Module) -> dict[str, Any] | None:
    """What the capture writes under meta ``"data_parallel"`` for a model with FSDP2
    (``fully_shard``) modules or a ``DistributedDataParallel`` in it; None for any other."""
    # looked up, not imported: a process that never imported them holds none (and importing
    # FSDP costs a plain capture 0.6 s)
    fsdp = getattr(sys.modules.get("torch.distributed.fsdp"), "FSDPModule", None)
    ddp = getattr(sys.modules.get("torch.nn.parallel"), "DistributedDataParallel", None)
    if fsdp is None and ddp is None:
        return None
    for module in model.modules():
        if fsdp is not None and isinstance(module, fsdp):
            return _fully_shard_meta(model, fsdp)
        if ddp is not None and isinstance(module, ddp):
            import torch.distributed as dist

            group = module.process_group
            ranks = dist.get_process_group_ranks(group)
            return {"how": "ddp", "ranks": ranks, "gradient_divide_factor": len(ranks),
                    "weights": _DDP_WEIGHTS, "weight_grads": _DDP_GRADS}
    return None


def _fully_shard_meta(model: nn.Module, fsdp: type) -> dict[str, Any]:
    """FSDP2's data-parallel ranks and gradient divide factor, read from its parameter groups
    (a factor set by ``set_gradient_divide_factor`` is theirs; unset, FSDP divides by the
    data-parallel size: the shard group's times the replicate group's under HSDP)."""
    ranks: list[int] | None = None
    factors: list[float] = []
    for module in model.modules():
        if not isinstance(module, fsdp):
            continue
        try:   # FSDP2's own state (torch 2.6 to 2.13 keep it there)
            groups = module._get_fsdp_state()._fsdp_param_groups
        except AttributeError:
            groups = []
        for group in groups:
            info = group.mesh_info
            size = getattr(info, "shard_mesh_size", 1) * getattr(info, "replicate_mesh_size", 1)
            factor = getattr(group, "gradient_divide_factor", None)
            factors.append(float(size if factor is None else factor))
            if ranks is None:
                ranks = [int(rank) for rank in info.mesh.mesh.flatten().tolist()]
    # ranks unknown (a torch that keeps FSDP's state elsewhere): an empty list, not a guess
    found: dict[str, Any] = {"how": "fully_shard", "ranks": ranks or []}
    if factors:
        distinct = sorted(set(factors))
        factor = distinct[0] if len(distinct) == 1 else distinct
        found["gradient_divide_factor"] = (int(factor) if isinstance(factor, float)
                                           and factor.is_integer() else factor)
    import torch.distributed as dist

    of_dim = bool(ranks) and dist.is_initialized() and len(ranks) < dist.get_world_size()
    found.update(weights=_FULLY_SHARD_WEIGHTS_OF_DIM if of_dim else _FULLY_SHARD_WEIGHTS,
                 weight_grads=_FULLY_SHARD_GRADS)
    return found
