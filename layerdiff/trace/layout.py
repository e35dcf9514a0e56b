"""How the ranks' parts of one record make the whole tensor: a layout over a mesh of ranks.

A layout is what DTensor calls a spec: a mesh of ranks (its sizes, the global rank at each
position, row-major) and one placement per mesh dim. A capture writes the layout of every
record that was a DTensor (meta ``layouts``); a mapping's ``[[shard]]`` rule declares one for
code that does not use DTensor. :meth:`Layout.unshard` joins the parts into the tensor the
one-process model computed; :meth:`Layout.part_index` says which elements of that tensor a
rank's part holds, so an error can be placed on a rank.

Placements:

- ``shard`` (dim): torch.chunk's split, coordinate c holding chunk c (DTensor's ``Shard``);
- ``replicate``: every coordinate holds the whole;
- ``partial`` (reduce sum / avg / max / min): every coordinate holds a term still to be reduced
  (DTensor's ``Partial``: a row-parallel layer's output before its all-reduce);
- ``zigzag`` (dim): cut into 2R equal chunks, coordinate i holding chunks i and 2R-1-i, in that
  order (context parallelism balancing causal attention);
- ``experts`` (dim, experts): coordinate c holds the experts ``experts[c]`` (global indices),
  stacked along dim in that order;
- ``strided_shard`` (dim, split_factor): DTensor's ``_StridedShard`` (FSDP over a tensor-
  parallel shard): cut into size x split_factor equal chunks, coordinate c holding chunks
  c, c + size, ... in that order.

The mesh dims are joined innermost first, as DTensor cuts them outermost first. No torch here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from layerdiff.trace import schema

KINDS = ("shard", "replicate", "partial", "zigzag", "experts", "strided_shard")
REDUCES = ("sum", "avg", "max", "min")
_CUTS = ("shard", "zigzag", "experts", "strided_shard")


class LayoutError(ValueError):
    """A layout that cannot be read, or parts it cannot join (the message says why)."""


@dataclass(frozen=True)
class Placement:
    """How one mesh dim places a tensor (see the module docstring)."""

    kind: str
    dim: int | None = None
    reduce: str = "sum"
    experts: tuple[tuple[int, ...], ...] = ()
    split_factor: int = 1

    @property
    def cuts(self) -> bool:
        """Whether the coordinates hold different elements (not copies or terms of the whole)."""
        return self.kind in _CUTS

    def describe(self) -> str:
        if self.kind == "shard":
            return f"split along dim {self.dim}"
        if self.kind == "zigzag":
            return f"zigzag along dim {self.dim}"
        if self.kind == "experts":
            held = ", ".join(str(list(ids)) for ids in self.experts)
            return f"experts {held} along dim {self.dim}"
        if self.kind == "partial":
            return f"partial {self.reduce}"
        if self.kind == "strided_shard":
            return f"strided split along dim {self.dim} (split factor {self.split_factor})"
        return "replicated"

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"kind": self.kind}
        if self.dim is not None:
            data["dim"] = self.dim
        if self.kind == "partial":
            data["reduce"] = self.reduce
        if self.kind == "experts":
            data["experts"] = [list(ids) for ids in self.experts]
        if self.kind == "strided_shard":
            data["split_factor"] = self.split_factor
        return data

    @classmethod
    def from_json(cls, data: Any) -> Placement:
        if not isinstance(data, dict) or data.get("kind") not in KINDS:
            raise LayoutError(f"a placement must be an object with a kind of {', '.join(KINDS)}; "
                              f"got {data!r}")
        kind = data["kind"]
        dim = data.get("dim")
        if kind in _CUTS and not isinstance(dim, int):
            raise LayoutError(f"a {kind} placement needs an integer dim; got {dim!r}")
        reduce = data.get("reduce", "sum")
        if reduce not in REDUCES:
            raise LayoutError(f"a partial placement reduces by one of {', '.join(REDUCES)}; "
                              f"got {reduce!r}")
        experts = data.get("experts") or []
        if kind == "experts" and not (isinstance(experts, list) and all(
                isinstance(ids, list) and all(isinstance(i, int) for i in ids)
                for ids in experts)):
            raise LayoutError(f"an experts placement lists each rank's expert indices "
                              f"([[0, 2], [1, 3]]); got {experts!r}")
        return cls(kind, dim if kind != "replicate" else None, reduce,
                   tuple(tuple(ids) for ids in experts), int(data.get("split_factor", 1)))


@dataclass(frozen=True)
class Layout:
    """Placements of one record over a mesh of ranks."""

    mesh: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[Placement, ...]
    names: tuple[str, ...] = ()
    shape: tuple[int, ...] | None = None  # the whole tensor's, where the capture knew it

    def __post_init__(self) -> None:
        if len(self.placements) != len(self.mesh) or math.prod(self.mesh) != len(self.ranks):
            raise LayoutError(f"a mesh of sizes {list(self.mesh)} needs one placement per "
                              f"dim and {math.prod(self.mesh)} ranks; got "
                              f"{len(self.placements)} placement(s) and {len(self.ranks)} ranks")
        for placement, size in zip(self.placements, self.mesh, strict=True):
            if placement.kind == "experts" and len(placement.experts) != size:
                raise LayoutError(f"an experts placement over {size} ranks lists "
                                  f"{len(placement.experts)} ranks' experts")

    @classmethod
    def one_dim(cls, world: int, placement: Placement) -> Layout:
        """A placement over every rank of a ``world``-rank job, in rank order."""
        return cls((world,), tuple(range(world)), (placement,))

    @property
    def replicated(self) -> bool:
        return all(p.kind == "replicate" for p in self.placements)

    @property
    def reduces(self) -> bool:
        """Whether some mesh dim holds partial terms (the record precedes a reduction)."""
        return any(p.kind == "partial" for p in self.placements)

    def describe(self) -> str:
        """E.g. ``split along dim 0 over tp (2 ranks)``; a mesh dim per clause."""
        clauses = []
        for number, (placement, size) in enumerate(zip(self.placements, self.mesh,
                                                       strict=True)):
            name = self.names[number] if number < len(self.names) and self.names[number] else ""
            over = f" over {name} ({size} ranks)" if name else f" over {size} ranks"
            clauses.append(placement.describe() + over)
        return ", ".join(clauses)

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"mesh": list(self.mesh), "names": list(self.names),
                                "ranks": list(self.ranks),
                                "placements": [p.to_json() for p in self.placements]}
        if self.shape is not None:
            data["shape"] = list(self.shape)
        return data

    @classmethod
    def from_json(cls, data: Any) -> Layout:
        if not isinstance(data, dict):
            raise LayoutError(f"a layout must be an object; got {data!r}")
        try:
            mesh = tuple(int(s) for s in data["mesh"])
            ranks = tuple(int(r) for r in data["ranks"])
            placements = tuple(Placement.from_json(p) for p in data["placements"])
            names = tuple(str(n) for n in data.get("names") or ())
            shape = data.get("shape")
            shape = None if shape is None else tuple(int(s) for s in shape)
        except (KeyError, TypeError, ValueError) as exc:
            if isinstance(exc, LayoutError):
                raise
            raise LayoutError(f"a layout needs mesh, ranks and placements; got {data!r}") from exc
        return cls(mesh, ranks, placements, names, shape)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        return tuple(int(c) for c in np.unravel_index(self.ranks.index(rank), self.mesh))

    # ---- joining the parts

    def unshard(self, parts: Mapping[int, np.ndarray], dtype: str) -> np.ndarray:
        """The whole tensor from each rank's part (``parts[rank]``, stored bits of ``dtype``,
        as a trace reads them raw). Raises :class:`LayoutError` naming what does not fit."""
        missing = [rank for rank in self.ranks if rank not in parts]
        if missing:
            raise LayoutError(f"no part from rank(s) {missing}")
        grid = {self.coordinate(rank): parts[rank] for rank in self.ranks}
        for axis in reversed(range(len(self.mesh))):
            placement = self.placements[axis]
            joined = {}
            for prefix in np.ndindex(*self.mesh[:axis]):
                terms = [grid[(*prefix, c)] for c in range(self.mesh[axis])]
                joined[tuple(int(p) for p in prefix)] = _join(placement, terms, dtype)
            grid = joined
        return np.ascontiguousarray(grid[()])

    def part_index(self, rank: int, shape: Sequence[int]) -> tuple[np.ndarray, ...] | None:
        """Per dim of the whole ``shape``, the indices rank ``rank``'s part holds (for
        ``np.ix_``); None where no cut places any element on one rank alone (replicated, or
        partial: every rank's term adds to every element)."""
        if not any(p.cuts for p in self.placements):
            return None
        index = [np.arange(size) for size in shape]
        for placement, size, c in zip(self.placements, self.mesh, self.coordinate(rank),
                                      strict=True):
            if not placement.cuts:
                continue
            dim = _axis(placement.dim, len(shape))
            index[dim] = index[dim][_held(placement, size, c, len(index[dim]))]
        return tuple(index)


def _axis(dim: int | None, ndim: int) -> int:
    if dim is None or not -ndim <= dim < ndim:
        raise LayoutError(f"dim {dim} of a tensor with {ndim} dimension(s)")
    return dim % ndim


def _chunk_bounds(length: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk's cut of ``length`` into ``parts`` (the last ones short or empty)."""
    size = -(-length // parts) if length else 0
    return [(min(i * size, length), min((i + 1) * size, length)) for i in range(parts)]


def _held(placement: Placement, size: int, c: int, length: int) -> np.ndarray:
    """The positions along the cut dim (of ``length``) that coordinate ``c`` holds, in the
    order its part stores them."""
    if placement.kind == "shard":
        start, end = _chunk_bounds(length, size)[c]
        return np.arange(start, end)
    if placement.kind == "zigzag":
        if length % (2 * size):
            raise LayoutError(f"zigzag over {size} ranks cuts a length into {2 * size} equal "
                              f"chunks; {length} is not a multiple of {2 * size}")
        chunk = length // (2 * size)
        first, second = c, 2 * size - 1 - c
        return np.concatenate([np.arange(first * chunk, (first + 1) * chunk),
                               np.arange(second * chunk, (second + 1) * chunk)])
    if placement.kind == "experts":
        count = sum(len(ids) for ids in placement.experts)
        if length % count:
            raise LayoutError(f"{count} experts do not divide a length of {length}")
        rows = length // count
        return np.concatenate([np.arange(e * rows, (e + 1) * rows)
                               for e in placement.experts[c]] or [np.arange(0)])
    if placement.kind == "strided_shard":
        # DTensor's _StridedShard: cut into size x split_factor equal chunks, coordinate c
        # holding chunks c, c + size, ... (FSDP's dim-0 shard of a tensor-parallel shard)
        pieces = size * placement.split_factor
        if length % pieces:
            raise LayoutError(f"a strided split over {size} ranks (split factor "
                              f"{placement.split_factor}) cuts a length into {pieces} equal "
                              f"chunks; {length} is not a multiple of {pieces}")
        chunk = length // pieces
        return np.concatenate([np.arange((c + k * size) * chunk, (c + k * size + 1) * chunk)
                               for k in range(placement.split_factor)])
    raise LayoutError(f"a {placement.describe()} placement cannot be joined")


def _join(placement: Placement, terms: list[np.ndarray], dtype: str) -> np.ndarray:
    """One mesh dim's parts (coordinate order) joined into what the next-outer dim cut."""
    if placement.kind == "replicate":
        return terms[0]
    if placement.kind == "partial":
        return _reduce(placement.reduce, terms, dtype)
    first = terms[0]
    dim = _axis(placement.dim, first.ndim)
    for term in terms[1:]:
        if term.ndim != first.ndim or any(a != b for axis, (a, b) in enumerate(
                zip(term.shape, first.shape, strict=True)) if axis != dim):
            raise LayoutError(f"parts of shapes {tuple(first.shape)} and {tuple(term.shape)} "
                              f"differ outside dim {placement.dim}, along which the "
                              f"{placement.kind} placement joins them")
    if placement.kind == "shard":
        return np.concatenate(terms, axis=dim)
    if placement.kind == "experts":
        counted = sorted(e for ids in placement.experts for e in ids)
        if counted != list(range(len(counted))):
            raise LayoutError(f"an experts placement must hold each of experts 0..N-1 on "
                              f"exactly one rank; it holds {counted}")
        length = sum(term.shape[dim] for term in terms)
    else:
        lengths = {term.shape[dim] for term in terms}
        if len(lengths) != 1:
            raise LayoutError(f"a {placement.kind} placement's parts have one length along "
                              f"dim {placement.dim}; got {sorted(lengths)}")
        length = lengths.pop() * len(terms)
    whole = np.empty((*first.shape[:dim], length, *first.shape[dim + 1:]), first.dtype)
    moved = np.moveaxis(whole, dim, 0)
    for c, term in enumerate(terms):
        held = _held(placement, len(terms), c, length)
        if len(held) != term.shape[dim]:
            raise LayoutError(f"rank part {c} of a {placement.describe()} placement has "
                              f"{term.shape[dim]} rows along dim {placement.dim}; it should "
                              f"hold {len(held)}")
        moved[held] = np.moveaxis(term, dim, 0)
    return whole


def _reduce(how: str, terms: list[np.ndarray], dtype: str) -> np.ndarray:
    """Partial terms reduced as the collective would, in float64 for floating dtypes and
    rounded once to ``dtype`` (the stored bits, as the terms are)."""
    bfloat16 = dtype == "bfloat16"
    values = [schema.bfloat16_to_float32(t) if bfloat16 else t for t in terms]
    floating = bfloat16 or np.issubdtype(values[0].dtype, np.floating)
    stack = np.stack([v.astype(np.float64) if floating else v for v in values])
    if how == "sum":
        total = stack.sum(axis=0)
    elif how == "avg":
        total = stack.mean(axis=0)
    elif how == "max":
        total = stack.max(axis=0)
    else:
        total = stack.min(axis=0)
    if bfloat16:
        return _bfloat16_bits(total.astype(np.float32))
    return total.astype(terms[0].dtype)


def _bfloat16_bits(values: np.ndarray) -> np.ndarray:
    """float32 values rounded to bfloat16 (to nearest, ties to even), as stored bits."""
    bits = values.view(np.uint32).astype(np.uint64)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(values)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def scaled_bits(raw: np.ndarray, dtype: str, factor: float) -> np.ndarray:
    """A tensor's stored bits (as a trace reads them raw) multiplied by ``factor``, rounded
    once to ``dtype``; other than floating dtypes are returned as they are."""
    if dtype == "bfloat16":
        return _bfloat16_bits((schema.bfloat16_to_float32(raw) * factor).astype(np.float32))
    if not np.issubdtype(raw.dtype, np.floating):
        return raw
    return (raw.astype(np.float64) * factor).astype(raw.dtype)
