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
   record is rank 0's copy. When data parallelism is one mesh dim (FSDP over ``dp``, tensor
   parallelism inside), a record is joined within rank 0's replica first (its recorded
   layout, or the reference's shapes), then across the replicas so.

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
            elif layout is not None and data is not None and data.within_replica(layout):
                # a DTensor over one data-parallel replica's ranks (tensor parallel inside
                # FSDP): its placements there, and the batch's across the replicas
                join = data.join(row, split, _recorded(layout))
            elif layout is not None:
                join = _recorded(layout)
            elif data is not None:
                inner = None
                if shapes is not None and len(data.replica) > 1:
                    inner = shapes.join(row, reference_shapes.get(record_key(row)), data)
                join = data.join(row, split, inner)
            if join is None and declared is None and layout is None and shapes is not None:
                join = shapes.join(row, reference_shapes.get(record_key(row)))
        plan.joins.append(join)
    return plan


def _recorded(layout: Layout) -> Join | None:
    return None if layout.replicated else Join(
        layout, "the DTensor placements recorded at capture", source="capture")


class _RankShapes:
    """A record no rule, recorded layout or batch places, cut as the reference's shape says: a
    DTensor port's plain local tensors (a GELU between a column- and a row-parallel layer, the
    attention weights of the rank's heads) are torch.chunk parts in rank order, like the
    DTensor they came from; the one dim where the parts' lengths add up to the reference's is
    the cut."""

    def __init__(self, ranks: list[Trace], lookups: list[dict[tuple, int]]) -> None:
        self.ranks, self.lookups = ranks, lookups

    def join(self, row: dict[str, Any], reference: str | None,
             data: _DataParallel | None = None) -> Join | None:
        """Over every rank; or, given ``data`` (more than one rank per data-parallel
        replica), over rank 0's replica, the batch dim taken as the data-parallel cut left it
        (what :meth:`_DataParallel.join` then joins across the replicas)."""
        if reference is None or reference == row["shape"]:
            return None
        whole = list(schema.parse_shape(reference))
        ranks = data.replica if data is not None else tuple(range(len(self.ranks)))
        parts = []
        for rank in ranks:
            position = self.lookups[rank].get(record_key(row))
            if position is None:
                return None
            parts.append(schema.parse_shape(self.ranks[rank].index["shape"].iloc[position]))
        if any(len(part) != len(whole) for part in parts):
            return None
        if data is not None and whole and data.batch and parts[0][0] * len(data.peers) == whole[0]:
            whole[0] = parts[0][0]
        apart = [d for d in range(len(whole)) if any(part[d] != whole[d] for part in parts)]
        if len(apart) != 1 or sum(part[apart[0]] for part in parts) != whole[apart[0]]:
            return None
        dim = apart[0]
        layout = Layout((len(ranks),), ranks, (Placement("shard", dim),))
        return Join(layout, f"the reference's shape ({reference}): the parts' lengths along dim "
                    f"{dim} add up to it, in rank order", source="reference shape")


class _DataParallel:
    """The batch split of a data-parallel capture (see the module docstring). Data parallelism
    may span the world (FSDP, DDP, HSDP) or be one mesh dim of it (FSDP over ``dp`` with tensor
    parallelism inside each replica): then the ranks at rank 0's place in each data-parallel
    group make its replica, whose parts a recorded layout (or the reference's shapes) joins
    first, and the replicas' wholes are joined as the batch says."""

    def __init__(self, ranks: list[Trace], lookups: list[dict[tuple, int]], factor: float,
                 groups: dict[int, tuple[int, ...]]) -> None:
        self.ranks, self.lookups, self.factor = ranks, lookups, factor
        self.groups = groups                 # rank -> its data-parallel group, in rank order
        self.peers = groups[0]               # rank 0's group: the batch's parts, in order
        self.replica = tuple(sorted({group[0] for group in groups.values()}))
        # the index rows of rank 0's peers, the only ranks the batch is judged against
        self.rows = {rank: ranks[rank].index.to_dict("records") for rank in self.peers[1:]}
        self.batch = 0  # rank 0's part of the batch; 0: every rank ran the whole

    @classmethod
    def of(cls, ranks: list[Trace], index: pd.DataFrame,
           lookups: list[dict[tuple, int]]) -> _DataParallel | None:
        groups = _groups(ranks)
        if groups is None:
            return None
        seen = ranks[0].meta["data_parallel"]
        factor = seen.get("gradient_divide_factor") or len(groups[0])
        found = cls(ranks, lookups, float(factor), groups)
        found.batch = found._local_batch(index)
        return found

    def within_replica(self, layout: Layout) -> bool:
        """Whether a recorded layout spans ranks of rank 0's replica only (one place in
        their data-parallel groups), as tensor parallelism inside FSDP records."""
        return len(self.replica) > 1 and len(
            {self.groups[rank].index(rank) for rank in layout.ranks}) == 1

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
        """Whether a data-parallel peer of rank 0 holds other values of the record."""
        key = record_key(row)
        for rank in self.peers[1:]:
            position = self.lookups[rank].get(key)
            if position is not None and differs(self.ranks[0], row, self.ranks[rank],
                                                self.rows[rank][position], rank):
                return True
        return False

    def join(self, row: dict[str, Any], split: dict[tuple, bool],
             inner: Join | None = None) -> Join | None:
        """The record's join across the data-parallel ranks, around ``inner``: how rank 0's
        replica's parts join (None: rank 0's copy is the replica's whole)."""
        role = row["role"]
        if role not in _ACTIVATIONS:
            return inner  # weights and their gradients: the capture's layouts or replicated
        backward = role in _FORWARD_OF
        if row["site"] == schema.LOSS_SITE:
            return self._join(Placement("partial"), "each rank's loss over its part of the "
                              "batch", 1.0 / self.factor, inner) if self.differs(row) else inner
        if not backward:
            shape = schema.parse_shape(row["shape"])
            # per-example: it differs across ranks, or it is as long as the rank's batch part
            # (a causal mask expanded over the batch agrees on every rank and is still cut)
            cut = bool(shape) and (self.differs(row) or (self.batch > 1
                                                         and shape[0] == self.batch))
            split[(int(row["step"]), row["site"], role, row["arg"])] = cut
            return self._join(Placement("shard", 0), "the data-parallel batch",
                              inner=inner) if cut else inner
        forward = split.get((int(row["step"]), row["site"], _FORWARD_OF[role], row["arg"]))
        if forward:
            return self._join(Placement("shard", 0), "the data-parallel batch", 1 / self.factor,
                              inner)
        if self.differs(row):  # the gradient of a tensor every rank holds whole
            return self._join(Placement("partial"), "the gradient terms of the data-parallel "
                              "batch", 1.0 / self.factor, inner)
        return inner

    def _join(self, placement: Placement, why: str, scale: float = 1.0,
              inner: Join | None = None) -> Join:
        size = len(self.peers)
        scaled = f", divided by {self.factor:g} (the gradient divide factor)" if scale != 1 else ""
        why = f"{why} (data parallel over {size} ranks{scaled})"
        if inner is None and len(self.replica) == 1:
            layout = Layout((size,), self.peers, (placement,), ("data parallel",))
            return Join(layout, why, scale, "data parallel")
        within = inner.layout if inner is not None else Layout(
            (len(self.replica),), self.replica, (Placement("replicate"),))
        ranks = tuple(self.groups[rank][i] for i in range(size) for rank in within.ranks)
        names = within.names or ("",) * len(within.mesh)
        layout = Layout((size, *within.mesh), ranks, (placement, *within.placements),
                        ("data parallel", *names))
        # a join that guessed within the replica is still a guess (gather says so)
        guessed = inner is not None and inner.source == "reference shape"
        return Join(layout, f"{why}; within a replica, {inner.why}" if inner else why, scale,
                    "reference shape" if guessed else "data parallel")


def _groups(ranks: list[Trace]) -> dict[int, tuple[int, ...]] | None:
    """Each rank's data-parallel group (meta ``data_parallel``), when every rank's capture saw
    one and the groups cut the world into equal parts; None otherwise."""
    world = len(ranks)
    groups: dict[int, tuple[int, ...]] = {}
    for rank, trace in enumerate(ranks):
        seen = trace.meta.get("data_parallel")
        members = seen.get("ranks") if isinstance(seen, dict) else None
        if not members or rank not in members:
            return None
        groups[rank] = tuple(sorted(int(member) for member in members))
    sizes = {len(group) for group in groups.values()}
    if len(sizes) != 1 or any(groups[member] != group for group in groups.values()
                              for member in group) or len(groups[0]) < 2:
        return None
    return groups if world % sizes.pop() == 0 else None


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
