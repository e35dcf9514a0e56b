"""Which layout joins each record of a multi-rank capture, and why.

Three sources, the first that speaks wins:

1. a ``[[shard]]`` rule of the mapping (the user's declaration: it also corrects the others);
2. the layout the capture recorded for a DTensor (rank meta ``layouts``: its mesh and
   placements, so FSDP2 and ``parallelize_module`` ports need no rule);
3. data parallelism the capture saw (FSDP2, DDP; rank meta ``data_parallel``): each rank ran
   its part of the batch when the model's first input differs across ranks. A forward record
   that differs across the ranks, or is as long along dim 0 as the rank's part of the batch
   (a causal mask expanded over the batch agrees on every rank), is cut along dim 0 in rank
   order; the loss, each rank's mean over its part, is a term of the whole's; a gradient of a
   tensor every rank holds whole (a position embedding's output) is a sum of the ranks' terms.
   Every rank's loss stands for 1/f of the whole's (f the gradient divide factor, by default
   the data-parallel size, that makes the averaged weight gradients the whole batch's), so the
   loss and the gradients of the activations are divided by f after the join. Any other
   record is rank 0's copy.

A partial sum's gradient is the reduced sum's, whole on every rank (the all-reduce's backward
hands each rank the same gradient), so a ``partial`` rule leaves the gradients replicated.

Records none of these cut are rank 0's copies (replicated). No torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.mapping import Mapping, ShardRule
from layerdiff.trace import schema
from layerdiff.trace.layout import Layout, LayoutError, Placement
from layerdiff.trace.reader import Trace

STAT_COLUMNS = ("min", "max", "mean", "std", "l2", "nan", "inf", "digest")
_ACTIVATIONS = ("input", "output", "grad_input", "grad_output")
_FORWARD_OF = {"grad_input": "input", "grad_output": "output"}


@dataclass(frozen=True)
class Join:
    """How one record's parts are joined: the layout, where it came from, and a factor the
    whole is multiplied by (data-parallel gradients: 1/f)."""

    layout: Layout
    why: str
    scale: float = 1.0
    # rules | capture (a DTensor's placements) | data parallel | reference shape
    source: str = "rules"

    def to_json(self) -> dict[str, Any]:
        return {**self.layout.to_json(), "why": self.why, "scale": self.scale}


def record_key(row: Any) -> tuple:
    return (int(row["step"]), row["pass"], row["site"], row["role"], row["arg"])


def declared_layout(mapping: Mapping, module: str, role: str, arg: str,
                    world: int) -> tuple[Layout | None, list[ShardRule]]:
    """The layout the mapping's ``[[shard]]`` rules declare for this tensor of port module
    ``module`` over a ``world``-rank job (None: no rule covers it), and the rules that
    decided it. Without a ``[mesh]`` one rule places it over every rank; with one, a rule per
    mesh dim (``over``), replicated over the dims no rule names."""
    found = mapping.shard_rules_by_mesh_dim(module, role, arg)
    if not found:
        return None, []
    rules = list(found.values())
    mesh = mapping.mesh or [("", world)]
    if math.prod(size for _, size in mesh) != world:
        raise TraceError(f"the [mesh] of {mapping.name} ({', '.join(f'{n} = {s}' for n, s in mesh)}"
                         f") holds {math.prod(size for _, size in mesh)} ranks; the capture "
                         f"has {world}")
    placements = tuple(_placement(found[name], size, role) if name in found else Placement(
        "replicate") for name, size in mesh)
    names = tuple(name for name, _ in mesh) if mapping.mesh else ()
    return Layout(tuple(size for _, size in mesh), tuple(range(world)), placements,
                  names), rules


def _placement(rule: ShardRule, size: int, role: str) -> Placement:
    kind = {"split": "shard"}.get(rule.layout, rule.layout)
    if kind == "partial" and role in _FORWARD_OF:
        # the gradient of a sum still to be reduced is the reduced sum's: whole on every rank
        # (the all-reduce's backward hands each rank the same gradient; DTensor's too)
        kind = "replicate"
    if kind == "experts" and len(rule.experts) != size:
        raise TraceError(f"{rule.describe()} lists the experts of {len(rule.experts)} ranks; "
                         f"the capture has {size}{' over ' + rule.over if rule.over else ''}: "
                         f"write the list for {size} ranks")
    return Placement(kind, rule.dim if kind not in ("partial", "replicate") else None,
                     experts=rule.experts)


def recorded_layouts(trace: Trace) -> dict[tuple[str, str, str], Layout]:
    """The DTensor layouts a rank file's capture recorded, by (site, role, arg)."""
    found = trace.meta.get("layouts")
    if not found:
        return {}
    try:
        table = [Layout.from_json(entry) for entry in found["table"]]
        return {(str(site), str(role), str(arg)): table[int(number)]
                for site, role, arg, number in found["records"]}
    except (KeyError, TypeError, ValueError, IndexError) as exc:
        raise TraceError(f"{trace.path}: the layouts its capture recorded cannot be read "
                         f"({exc}); capture it again") from exc


@dataclass
class JoinPlan:
    """For each row of rank 0's index (in its order), how its parts join, or None: rank 0's
    copy is the whole; and the ``[[shard]]`` rules that decided some record (by ``id``)."""

    joins: list[Join | None]
    used_rules: set[int]


def record_lookup(index: pd.DataFrame) -> dict[tuple, int]:
    """A rank file's index positions by :func:`record_key`."""
    keys = zip(*(index[column] for column in ("step", "pass", "site", "role", "arg")),
               strict=True)
    return {(int(k[0]), *k[1:]): position for position, k in enumerate(keys)}


def plan_joins(ranks: list[Trace], index: pd.DataFrame, modules: dict[str, str],
               mapping: Mapping, lookups: list[dict[tuple, int]],
               reference_shapes: dict[tuple, str] | None = None) -> JoinPlan:
    """How each row of rank 0's ``index`` (sorted by seq) is joined from the ranks' parts.
    ``reference_shapes`` (the diff's reference, by :func:`record_key`) lets a record nothing
    else places be cut along the one dim where its parts' shapes sum to the reference's."""
    world = len(ranks)
    shapes = _RankShapes(ranks, lookups) if reference_shapes else None
    recorded = recorded_layouts(ranks[0])
    data = _DataParallel.of(ranks, index, lookups) if world > 1 else None
    rows = index.to_dict("records")
    plan = JoinPlan([], set())
    split: dict[tuple, bool] = {}  # data parallel: (step, site, forward role, arg) -> cut
    for row in rows:
        join = None
        if row["kind"] == "tensor":
            module = modules.get(row["site"]) or schema.split_site(row["site"])[0]
            declared, rules = declared_layout(mapping, module, row["role"], row["arg"], world)
            layout = recorded.get((row["site"], row["role"], row["arg"]))
            if declared is not None:
                plan.used_rules.update(id(rule) for rule in rules)
                join = None if declared.replicated else Join(
                    declared, "; ".join(rule.describe() for rule in rules))
            elif layout is not None:
                join = None if layout.replicated else Join(
                    layout, "the DTensor placements recorded at capture", source="capture")
            elif data is not None:
                join = data.join(row, split)
            if join is None and declared is None and layout is None and shapes is not None:
                join = shapes.join(row, reference_shapes.get(record_key(row)))
        plan.joins.append(join)
    return plan


class _RankShapes:
    """A record no rule, recorded layout or batch places, cut as the reference's shape says: a
    DTensor port's plain local tensors (a GELU between a column- and a row-parallel layer, the
    attention weights of the rank's heads) are torch.chunk parts in rank order, like the
    DTensor they came from; the one dim where the parts' lengths add up to the reference's is
    the cut."""

    def __init__(self, ranks: list[Trace], lookups: list[dict[tuple, int]]) -> None:
        self.ranks, self.lookups = ranks, lookups

    def join(self, row: dict[str, Any], reference: str | None) -> Join | None:
        if reference is None or reference == row["shape"]:
            return None
        whole = schema.parse_shape(reference)
        parts = []
        for rank, trace in enumerate(self.ranks):
            position = self.lookups[rank].get(record_key(row))
            if position is None:
                return None
            parts.append(schema.parse_shape(trace.index["shape"].iloc[position]))
        if any(len(part) != len(whole) for part in parts):
            return None
        apart = [d for d in range(len(whole)) if any(part[d] != whole[d] for part in parts)]
        if len(apart) != 1 or sum(part[apart[0]] for part in parts) != whole[apart[0]]:
            return None
        dim = apart[0]
        layout = Layout.one_dim(len(self.ranks), Placement("shard", dim))
        return Join(layout, f"the reference's shape ({reference}): the parts' lengths along dim "
                    f"{dim} add up to it, in rank order", source="reference shape")


class _DataParallel:
    """The batch split of a data-parallel capture (see the module docstring)."""

    def __init__(self, ranks: list[Trace], lookups: list[dict[tuple, int]],
                 factor: float) -> None:
        self.ranks, self.lookups, self.factor = ranks, lookups, factor
        self.rows = [None, *(trace.index.to_dict("records") for trace in ranks[1:])]
        self.world = len(ranks)
        self.batch = 0  # rank 0's part of the batch; 0: every rank ran the whole

    @classmethod
    def of(cls, ranks: list[Trace], index: pd.DataFrame,
           lookups: list[dict[tuple, int]]) -> _DataParallel | None:
        seen = ranks[0].meta.get("data_parallel")
        if not isinstance(seen, dict) or sorted(seen.get("ranks") or []) != list(
                range(len(ranks))):
            return None  # none seen, or a data-parallel group that is not the whole world
        factor = seen.get("gradient_divide_factor") or len(ranks)
        found = cls(ranks, lookups, float(factor))
        found.batch = found._local_batch(index)
        return found

    def _local_batch(self, index: pd.DataFrame) -> int:
        """Rank 0's part of the batch (the outermost call's first input's dim 0) when the ranks
        ran different parts (that input differs across them); 0 when every rank ran the whole
        batch, or the model's input cannot tell."""
        sites = self.ranks[0].sites
        outer = sites[(sites["parent"] == "") & (sites["site"] != schema.LOSS_SITE)]
        if outer.empty:
            return 0
        first = index[(index["site"] == outer["site"].iloc[0]) & (index["role"] == "input")
                      & (index["kind"] == "tensor")]
        if first.empty:
            return 0
        row = first.iloc[0].to_dict()
        shape = schema.parse_shape(row["shape"])
        return int(shape[0]) if shape and self.differs(row) else 0

    def differs(self, row: dict[str, Any]) -> bool:
        key = record_key(row)
        for rank in range(1, self.world):
            position = self.lookups[rank].get(key)
            if position is not None and differs(self.ranks[0], row, self.ranks[rank],
                                                self.rows[rank][position], rank):
                return True
        return False

    def join(self, row: dict[str, Any], split: dict[tuple, bool]) -> Join | None:
        role = row["role"]
        if role not in _ACTIVATIONS:
            return None  # weights and their gradients: the capture's layouts or replicated
        backward = role in _FORWARD_OF
        if row["site"] == schema.LOSS_SITE:
            return self._join(Placement("partial"), "each rank's loss over its part of the "
                              "batch", 1.0 / self.factor) if self.differs(row) else None
        if not backward:
            shape = schema.parse_shape(row["shape"])
            # per-example: it differs across ranks, or it is as long as the rank's batch part
            # (a causal mask expanded over the batch agrees on every rank and is still cut)
            cut = bool(shape) and (self.differs(row) or (self.batch > 1
                                                         and shape[0] == self.batch))
            split[(int(row["step"]), row["site"], role, row["arg"])] = cut
            return self._join(Placement("shard", 0), "the data-parallel batch") if cut else None
        forward = split.get((int(row["step"]), row["site"], _FORWARD_OF[role], row["arg"]))
        if forward:
            return self._join(Placement("shard", 0), "the data-parallel batch", 1 / self.factor)
        if self.differs(row):  # the gradient of a tensor every rank holds whole
            return self._join(Placement("partial"), "the gradient terms of the data-parallel "
                              "batch", 1.0 / self.factor)
        return None

    def _join(self, placement: Placement, why: str, scale: float = 1.0) -> Join:
        layout = Layout((self.world,), tuple(range(self.world)), (placement,), ("data parallel",))
        scaled = f", divided by {self.factor:g} (the gradient divide factor)" if scale != 1 else ""
        return Join(layout, f"{why} (data parallel over {self.world} ranks{scaled})", scale,
                    "data parallel")


def differs(first: Trace, row: dict[str, Any], trace: Trace, other: dict[str, Any],
            rank: int) -> str:
    """How rank ``rank``'s copy of a record differs from rank 0's, or ''."""
    if other["shape"] != row["shape"]:
        return f"shape ({row['shape']}) on rank 0, ({other['shape']}) on rank {rank}"
    if other["dtype"] != row["dtype"]:
        return f"{row['dtype']} on rank 0, {other['dtype']} on rank {rank}"
    if (row["digest"] and other["digest"]
            and first.digest_algorithm == trace.digest_algorithm):
        same = row["digest"] == other["digest"]
    elif row["segment"] >= 0 and other["segment"] >= 0:
        same = np.array_equal(first.read(pd.Series(row), raw=True).reshape(-1).view(np.uint8),
                              trace.read(pd.Series(other), raw=True).reshape(-1).view(
                                  np.uint8))
    else:  # summaries without digests: their statistics
        same = all(_same_number(row[c], other[c]) for c in STAT_COLUMNS if c != "digest")
    return "" if same else f"its values differ on rank {rank}"


def _same_number(a: Any, b: Any) -> bool:
    return bool(a == b) or (isinstance(a, float) and isinstance(b, float)
                            and math.isnan(a) and math.isnan(b))


def layout_error(error: LayoutError, path: Any, row: dict[str, Any], join: Join) -> TraceError:
    """A join that failed, in one sentence naming the record and where its layout came from."""
    from layerdiff.trace.verify import describe

    return TraceError(f"{path}: {describe(row)} cannot be joined as {join.layout.describe()} "
                      f"({join.why}): {error}; check the layout (docs/distributed.md)")
