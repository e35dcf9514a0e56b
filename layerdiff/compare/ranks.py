"""``check_ranks``: do the replicas of a multi-rank capture agree?

In a multi-rank capture (a manifest naming one trace per rank, see
:mod:`layerdiff.trace.manifest`) every tensor that no ``[[shard]]`` rule of the mapping covers
is replicated: every rank must hold the same copy. The diff against a single-process reference
compares rank 0's copy only, so a replica that goes its own way is invisible to it: a dropout
that draws from a per-rank generator, a gradient that was not all-reduced, a rank that missed a
broadcast. This check compares every other rank with rank 0, record by record.

Records match by (step, pass, site, role, argument) and their order among records with the same
key. By default they are compared bit for bit by the index digests alone: no tensor is read, so
the check costs the index tables. With a tolerance, the records whose digests differ are read
and judged by the diff's element rule (``|x_r - x_0| <= atol + rtol * |x_0|``, the per-dtype
defaults and a tolerance file's rules, :mod:`layerdiff.compare.judge`): the rounding of a
reduction whose order depends on the rank then passes. A NaN on one rank and not on the other is
out whatever the tolerance. Records without a digest are compared by their bytes (by their
statistics when the trace keeps no data for them). A record missing on a rank, or of another
kind, shape or dtype there, disagrees in every mode. The first disagreement in rank 0's
recording order (forward, then backward, as recorded) is the answer. No torch here.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.compare import judge
from layerdiff.compare.metrics import PairMetrics, Scratch
from layerdiff.compare.reading import Chunk, TensorRef, stream_pairs
from layerdiff.compare.tolerances import DEFAULTS, Tolerance, Tolerances
from layerdiff.errors import TraceError
from layerdiff.mapping import Mapping
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.joins import plan_joins, record_key, record_lookup
from layerdiff.trace.stats import record_rms

Progress = Callable[[int, int], None]  # (records done, records in all)
NEXT = 5  # disagreeing sites listed after the first
KEY = ["step", "pass", "site", "role", "arg"]
_COLUMNS = [*KEY, "seq", "kind", "dtype", "shape", "digest", "value", "segment", "l2"]
GRAD_ROLES = schema.GRAD_ROLES


class RanksVerdict(StrEnum):
    AGREE = "agree"
    DISAGREE = "disagree"


class Mode(StrEnum):
    BITWISE = "bitwise"       # by the index digests (bytes where a record has none)
    TOLERANCE = "tolerance"   # records whose digests differ read and judged


class Reason(StrEnum):
    """How a rank's copy of a record disagrees with rank 0's."""

    MISSING = "missing"        # the rank has no such record
    EXTRA = "extra"            # only the rank has it: rank 0 has none
    KIND = "kind"              # a tensor on one, a plain value on the other
    DTYPE = "dtype"
    SHAPE = "shape"
    BITS = "bits"              # other bytes (bit-for-bit mode)
    TOLERANCE = "tolerance"    # out of tolerance (tolerance mode)
    VALUE = "value"            # a plain value with other JSON
    STATISTICS = "statistics"  # no digest and no data: the index statistics differ


_Found = tuple[Reason, str, bool]  # how a rank's copy disagrees: reason, why, norms close


@dataclass(frozen=True)
class RankDetail:
    """How one rank's copy of a record disagrees with rank 0's."""

    rank: int
    reason: Reason
    why: str
    # other bits, but L2 norms as close as rounding leaves them: the difference may be the
    # rounding of a reduction whose order depends on the rank (--tolerance tells)
    norms_close: bool = False

    def as_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "reason": str(self.reason), "why": self.why,
                "norms_close": self.norms_close}


@dataclass
class Disagreement:
    """One replicated record whose copy on some ranks is not rank 0's."""

    step: int
    pass_: str
    site: str
    role: str
    arg: str
    details: list[RankDetail]

    @property
    def ranks(self) -> list[int]:
        """The ranks whose copy disagrees with rank 0's."""
        return [detail.rank for detail in self.details]

    def where(self) -> str:
        return f"{self.site} {self.role} {self.arg} (step {self.step}, {self.pass_})"

    def on(self) -> str:
        ranks = self.ranks
        return (f"rank {ranks[0]}" if len(ranks) == 1
                else "ranks " + ", ".join(str(r) for r in ranks))

    def as_json(self) -> dict[str, Any]:
        return {"site": self.site, "step": self.step, "pass": self.pass_, "role": self.role,
                "arg": self.arg, "ranks": self.ranks,
                "details": [detail.as_json() for detail in self.details]}


@dataclass
class RanksResult:
    """Whether the replicated records of a multi-rank capture agree on every rank; ``found``
    when some rank's copy of one disagrees with rank 0's."""

    manifest: str
    world_size: int
    mode: Mode
    mapping: str                  # the mapping the shard rules came from ("" for none)
    shard_rules: int
    records: int                  # replicated records compared (rank 0's and any extra)
    sharded: int                  # records a shard rule covers: not compared
    disagreeing: int              # replicated records where some rank disagrees
    per_rank: dict[int, int]      # rank -> records where its copy disagrees
    first: Disagreement | None
    next: list[Disagreement]      # the next few disagreeing site calls (first record each)
    read: int = 0                 # record pairs whose data was read
    within: int = 0               # tolerance mode: other bits, within tolerance
    tolerance: str = ""           # how tolerance mode judged ("" bit for bit)
    warnings: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def found(self) -> bool:
        return self.first is not None

    @property
    def verdict(self) -> RanksVerdict:
        return RanksVerdict.DISAGREE if self.found else RanksVerdict.AGREE

    def as_json(self) -> dict[str, Any]:
        return {"manifest": self.manifest, "verdict": str(self.verdict), "found": self.found,
                "world_size": self.world_size, "mode": str(self.mode),
                "tolerance": self.tolerance or None, "mapping": self.mapping or None,
                "shard_rules": self.shard_rules,
                "first": self.first.as_json() if self.first else None,
                "records": self.records, "sharded": self.sharded,
                "disagreeing": self.disagreeing,
                "per_rank": {str(rank): count for rank, count in self.per_rank.items()},
                "next": [d.as_json() for d in self.next], "read": self.read,
                "within": self.within, "warnings": list(self.warnings),
                "seconds": round(self.seconds, 3)}


def check_ranks(port: str | os.PathLike | Trace, *,
                mapping: str | os.PathLike | Mapping | None = None,
                tolerance: bool | str | os.PathLike | Tolerances | None = False,
                progress: Progress | None = None,
                reference_shapes: dict[tuple, str] | None = None) -> RanksResult:
    """Compare every rank's replicated records with rank 0's; see :class:`RanksResult`.

    ``port`` is the manifest of a multi-rank capture (``capture --nproc N`` or under
    torchrun). ``mapping`` (a file or :class:`Mapping`) gives the ``[[shard]]`` rules that say
    which tensors are cut across ranks; without one, the mapping the capture recorded
    (``--weights-from --map``), else none: every tensor is then taken as replicated.
    ``tolerance`` False compares bit for bit by the index digests; True judges records whose
    bits differ with the per-dtype default tolerances; a tolerance file or
    :class:`Tolerances` with those. ``progress(done, total)`` counts records.
    ``reference_shapes`` (the diff's reference): records whose parts add up to the
    reference's shape are cut, not replicated, as the diff's gather takes them.
    Raises :class:`TraceError` when ``port`` is not a manifest, or a rank file is missing or
    damaged (naming the rank).
    """
    started = time.perf_counter()
    tolerances = _tolerances(tolerance)
    with contextlib.ExitStack() as stack:
        manifest = port if isinstance(port, Trace) else stack.enter_context(open_trace(port))
        if not manifest.rank_paths:
            raise TraceError(_not_a_manifest(manifest))
        # the manifest reads as rank 0: its index, sites and data are rank 0's file's
        ranks = [manifest, *(stack.enter_context(open_trace(path, verify=manifest.verify))
                             for path in manifest.rank_paths[1:])]
        comparer = _Comparer(ranks, manifest.rank_paths, _mapping(mapping, manifest),
                             tolerances, progress, reference_shapes)
        result = comparer.run()
    result.manifest = str(manifest.path)
    result.seconds = time.perf_counter() - started
    return result


def _tolerances(given: bool | str | os.PathLike | Tolerances | None) -> Tolerances | None:
    if given is None or given is False:
        return None
    if given is True:
        return Tolerances()
    return Tolerances.build(given)


def _not_a_manifest(trace: Trace) -> str:
    rank, world = trace.meta.get("rank"), trace.meta.get("world_size")
    if isinstance(rank, int) and isinstance(world, int) and world > 1:
        stem = trace.path.name.replace(f".rank{rank}", "", 1)
        return (f"{trace.path} is rank {rank}'s file of a {world}-rank capture, not its "
                f"manifest: `ranks` compares every rank's file, so pass the manifest "
                f"({trace.path.with_name(stem)}) that the capture published beside it")
    return (f"{trace.path} is a one-process trace: `ranks` compares the replicas of a "
            "multi-rank capture, so it needs that capture's manifest (capture with --nproc N, "
            "or under torchrun, and pass the -o file)")


def _mapping(given: str | os.PathLike | Mapping | None, rank0: Trace) -> Mapping:
    """The mapping whose shard rules apply: the one given, else the one rank 0's capture
    recorded (--weights-from --map), else none."""
    if isinstance(given, Mapping):
        return given
    if given is not None:
        return Mapping.load(given)
    return Mapping.recorded(rank0.meta, f"{rank0.path.name}'s rank files") or Mapping()


class _Comparer:
    """Each rank r > 0 against rank 0: the index first, data only where it must be read."""

    def __init__(self, ranks: list[Trace], paths: list[Path], mapping: Mapping,
                 tolerances: Tolerances | None, progress: Progress | None,
                 reference_shapes: dict[tuple, str] | None = None) -> None:
        self.ranks, self.paths, self.mapping = ranks, paths, mapping
        self.tolerances = tolerances
        self.progress = progress
        self.read = self.within = 0
        self.done = self.total = 0
        self.scratch = Scratch()  # one set of metric work arrays for every pair

        # what gather joins (a [[shard]] rule, a DTensor's recorded placements, the data-
        # parallel batch) is not expected to agree across ranks; everything else is
        first = ranks[0]
        index = first.index.sort_values("seq", kind="stable")
        plan = plan_joins(ranks, index, dict(zip(first.sites["site"], first.sites["module"],
                                                 strict=True)), mapping,
                          [record_lookup(trace.index) for trace in ranks], reference_shapes)
        self.joined = {record_key(row) for row, join in zip(index.to_dict("records"),
                                                            plan.joins, strict=True) if join}
        self.used_rules = plan.used_rules

    def run(self) -> RanksResult:
        base = self._keyed(self.ranks[0])
        replicated = base[~base["sharded"]]
        self.total = len(replicated) * (len(self.ranks) - 1)
        found: list[dict[str, Any]] = []
        extra: set[tuple] = set()
        for rank in range(1, len(self.ranks)):
            found.extend(self._compare(rank, base, extra))
        disagreements = _group(found)
        per_rank = {rank: 0 for rank in range(1, len(self.ranks))}
        for disagreement in disagreements:
            for rank in disagreement.ranks:
                per_rank[rank] += 1
        first = disagreements[0] if disagreements else None
        following: list[Disagreement] = []
        seen = {(first.step, first.pass_, first.site)} if first else set()
        for disagreement in disagreements[1:]:
            if len(following) == NEXT:
                break
            call = (disagreement.step, disagreement.pass_, disagreement.site)
            if call not in seen:  # one line per site call, not per argument
                seen.add(call)
                following.append(disagreement)
        mode = Mode.BITWISE if self.tolerances is None else Mode.TOLERANCE
        return RanksResult(
            manifest="", world_size=len(self.ranks), mode=mode,
            mapping=self._mapping_name(),
            shard_rules=len(self.mapping.shard_rules), records=len(replicated) + len(extra),
            sharded=int(base["sharded"].sum()), disagreeing=len(disagreements),
            per_rank=per_rank, first=first, next=following, read=self.read,
            within=self.within, tolerance=self._describe_tolerance(),
            warnings=self._warnings())

    def _mapping_name(self) -> str:
        if not self.mapping.shard_rules:
            return ""
        origin = f" ({self.mapping.origin})" if self.mapping.origin else ""
        return f"{self.mapping.name}{origin}"

    def _describe_tolerance(self) -> str:
        if self.tolerances is None:
            return ""
        if self.tolerances.rules or self.tolerances.rtol is not None \
                or self.tolerances.atol is not None:
            return "per-dtype defaults, with " + ", ".join(filter(None, [
                f"--rtol {self.tolerances.rtol:g}" if self.tolerances.rtol is not None else "",
                f"--atol {self.tolerances.atol:g}" if self.tolerances.atol is not None else "",
                f"rules of {self.tolerances.path.name}" if self.tolerances.path else ""]))
        return "per-dtype defaults"

    def _warnings(self) -> list[str]:
        warnings = [f"{rule.describe()} covers no record of rank 0's trace: check its site "
                    "glob (port module paths) and tensor name"
                    for rule in self.mapping.shard_rules if id(rule) not in self.used_rules]
        if len(self.ranks) == 1:
            warnings.append("the capture has one rank: there are no replicas to compare")
        return warnings

    # ---- the index

    def _keyed(self, trace: Trace) -> pd.DataFrame:
        """The index columns that decide, with each row's position, its order among rows of
        the same key, and whether a shard rule covers it."""
        index = trace.index
        frame = index[_COLUMNS].copy()
        if trace.digest_algorithm != self.ranks[0].digest_algorithm:
            frame["digest"] = ""  # digests of another definition: compare the bytes
        frame["pos"] = np.arange(len(index))
        frame["occurrence"] = frame.groupby(KEY, sort=False).cumcount()
        frame["sharded"] = [
            (int(step), pass_, site, role, arg) in self.joined
            for step, pass_, site, role, arg in zip(frame["step"], frame["pass"], frame["site"],
                                                    frame["role"], frame["arg"], strict=True)]
        return frame

    def _compare(self, rank: int, base: pd.DataFrame, extra: set[tuple]) -> list[dict]:
        other = self._keyed(self.ranks[rank])
        merged = base.merge(other, on=[*KEY, "occurrence"], how="outer", suffixes=("", "_r"),
                            indicator=True, sort=False)
        side = merged["_merge"].to_numpy()
        left, right = side != "right_only", side != "left_only"
        sharded = np.where(left, merged["sharded"].to_numpy(dtype=object),
                           merged["sharded_r"].to_numpy(dtype=object)).astype(bool)
        merged = merged[~sharded]
        left, right = left[~sharded], right[~sharded]
        # plain arrays: a pandas row lookup costs ~100 us, too much per record of a large model
        column = {name: merged[name].to_numpy() for name in merged.columns}
        found: list[dict[str, Any]] = []

        def add(i: int, reason: Reason, why: str, close: bool = False) -> None:
            seq = column["seq"][i] if left[i] else column["seq_r"][i]
            found.append({"step": int(column["step"][i]), "seq": int(seq),
                          "occurrence": int(column["occurrence"][i]),
                          **{k: str(column[k][i]) for k in KEY[1:]},
                          "detail": RankDetail(rank, reason, why, close)})

        for i in np.flatnonzero(left & ~right):
            add(i, Reason.MISSING, f"rank {rank} has no such record")
        for i in np.flatnonzero(right & ~left):
            extra.add((int(column["step"][i]), *(str(column[k][i]) for k in KEY[1:]),
                       int(column["occurrence"][i])))
            add(i, Reason.EXTRA, f"only rank {rank} has it (rank 0 has no such record)")
        both = left & right
        kind = both & (column["kind"] != column["kind_r"])
        tensor = both & ~kind & (column["kind"] == "tensor")
        value = both & ~kind & (column["kind"] != "tensor") & (column["value"]
                                                               != column["value_r"])
        dtype = tensor & (column["dtype"] != column["dtype_r"])
        shape = tensor & ~dtype & (column["shape"] != column["shape_r"])
        same_layout = tensor & ~dtype & ~shape
        with_digests = same_layout & (column["digest"] != "") & (column["digest_r"] != "")
        bits = with_digests & (column["digest"] != column["digest_r"])
        unknown = same_layout & ~with_digests  # no digest on a side: read what there is
        for i in np.flatnonzero(kind):
            add(i, Reason.KIND, f"a {column['kind'][i]} on rank 0, a {column['kind_r'][i]} on "
                f"rank {rank}")
        for i in np.flatnonzero(value):
            add(i, Reason.VALUE, f"value {_short(column['value'][i])} on rank 0, "
                f"{_short(column['value_r'][i])} on rank {rank}")
        for i in np.flatnonzero(dtype):
            add(i, Reason.DTYPE, f"{column['dtype'][i]} on rank 0, {column['dtype_r'][i]} on "
                f"rank {rank}")
        for i in np.flatnonzero(shape):
            add(i, Reason.SHAPE, f"shape ({column['shape'][i]}) on rank 0, "
                f"({column['shape_r'][i]}) on rank {rank}")
        to_read = unknown
        if self.tolerances is None:
            for i in np.flatnonzero(bits):
                add(i, *_bits(rank, column["l2"][i], column["l2_r"][i], column["dtype"][i]))
        else:
            to_read = unknown | bits
        self.total += int((right & ~left).sum())  # records rank 0 lacks count too
        self._advance(len(merged) - int(to_read.sum()))
        reading = np.flatnonzero(to_read)
        judged = self._read_and_judge(rank, column["pos"][reading].astype(np.int64),
                                      column["pos_r"][reading].astype(np.int64))
        for i, verdict in zip(reading, judged, strict=True):
            if verdict is not None:
                add(i, *verdict)
        return found

    def _advance(self, records: int) -> None:
        self.done += records
        if self.progress is not None:
            self.progress(min(self.done, self.total), self.total)

    # ---- the data

    def _read_and_judge(self, rank: int, positions: np.ndarray,
                        positions_r: np.ndarray) -> list[_Found | None]:
        """Each record read on both ranks (or, with no data, its statistics): None where the
        copies agree, else the reason and what to say. Streamed as the diff streams its pairs
        (reads ahead on a thread, bounded memory, every byte checked against its index row)."""
        zero, other = self.ranks[0], self.ranks[rank]
        rows = zero.index.iloc[positions].to_dict("records")
        rows_r = other.index.iloc[positions_r].to_dict("records")
        verdicts: list[_Found | None] = [None] * len(rows)
        streamed, judges = [], []
        for number, (a, b) in enumerate(zip(rows, rows_r, strict=True)):
            if min(int(a["segment"]), int(b["segment"])) < 0:
                verdicts[number] = self._judge_statistics(rank, a, b)
                self._advance(1)
                continue
            streamed.append((number, _tensor(a, zero.verify), _tensor(b, other.verify)))
            judges.append(_BitsJudge() if self.tolerances is None else _ToleranceJudge(
                self._tolerance(a), int(a["numel"]), self.scratch))
        self.read += len(streamed)
        pairs = [(first, second) for _, first, second in streamed]
        for chunk in stream_pairs(zero.segments(), other.segments(), pairs):
            number, first, _ = streamed[chunk.pair]
            judges[chunk.pair].update(chunk)
            if chunk.last:
                verdict = judges[chunk.pair].verdict(rank, rows[number], rows_r[number],
                                                     first.shape)
                if verdict is True:
                    self.within += 1
                elif verdict is not None:
                    verdicts[number] = verdict
                self._advance(1)
        return verdicts

    def _judge_statistics(self, rank: int, a: dict, b: dict) -> _Found | None:
        """No data on a side (a summary trace) and no digest: its statistics are all there
        is. Bit for bit they must be equal; with a tolerance, within it."""
        first, second = _statistics(a), _statistics(b)
        if self.tolerances is None:
            if np.array_equal(first, second, equal_nan=True):
                return None
            return Reason.STATISTICS, (f"statistics differ, no data to read (L2 norm "
                                       f"{float(a['l2']):.6g} on rank 0, "
                                       f"{float(b['l2']):.6g} on rank {rank})"), False
        tolerance = self._tolerance(a)
        ratio = judge.statistics_ratio(first[:5], second[:5], tolerance.rtol, tolerance.atol,
                                       ref_counts=(int(a["nan"]), int(a["inf"])),
                                       port_counts=(int(b["nan"]), int(b["inf"])))
        if judge.within(ratio) and int(a["nan"]) == int(b["nan"]) \
                and int(a["inf"]) == int(b["inf"]):
            return None
        return Reason.STATISTICS, (f"statistics out of tolerance, no data to read "
                                   f"({_times(ratio)} the tolerance, {tolerance.describe()})"), \
            False

    def _tolerance(self, row: dict) -> Tolerance:
        assert self.tolerances is not None
        tolerance = self.tolerances.lookup(row["site"], row["role"], row["arg"], row["dtype"])
        scale = self.ranks[0].loss_scale
        if row["role"] in GRAD_ROLES and scale != 1.0:
            # as the diff does: gradients, and their rounding, are amplified by the loss scale
            tolerance = Tolerance(tolerance.rtol, tolerance.atol * scale,
                                  f"{tolerance.source}; atol x loss scale {scale:g}",
                                  tolerance.kind)
        return tolerance


def _group(found: list[dict[str, Any]]) -> list[Disagreement]:
    """The ranks' disagreements, one per record, in rank 0's recording order (a record only
    another rank has is placed by that rank's order)."""
    records: dict[tuple, tuple[tuple[int, int], Disagreement]] = {}
    for item in found:
        key = (item["step"], item["pass"], item["site"], item["role"], item["arg"],
               item["occurrence"])
        if key not in records:
            records[key] = ((item["step"], item["seq"]), Disagreement(
                item["step"], item["pass"], item["site"], item["role"], item["arg"], []))
        records[key][1].details.append(item["detail"])
    ordered = sorted(records.values(), key=lambda entry: entry[0])
    for _, disagreement in ordered:
        disagreement.details.sort(key=lambda detail: detail.rank)
    return [disagreement for _, disagreement in ordered]


def _tensor(row: dict[str, Any], verify: bool) -> TensorRef:
    return TensorRef(int(row["segment"]), int(row["offset"]), int(row["nbytes"]), row["dtype"],
                     schema.parse_shape(row["shape"]), check=row if verify else None)


class _BitsJudge:
    """Bit for bit, chunk by chunk (decoded bfloat16 widens exactly: equal bits stay equal)."""

    def __init__(self) -> None:
        self.same = True

    def update(self, chunk: Chunk) -> None:
        self.same = self.same and np.array_equal(chunk.ref.view(np.uint8),
                                                 chunk.port.view(np.uint8))

    def verdict(self, rank: int, a: dict, b: dict,
                shape: tuple[int, ...]) -> _Found | None:
        return None if self.same else _bits(rank, a["l2"], b["l2"], a["dtype"])


class _ToleranceJudge:
    """The diff's metrics and element rule, chunk by chunk; True for other bits within
    tolerance."""

    def __init__(self, tolerance: Tolerance, numel: int, scratch: Scratch) -> None:
        self.tolerance = tolerance
        self.metrics = PairMetrics(tolerance.rtol, tolerance.atol, numel, ulp_scale=None,
                                   scratch=scratch)
        self.same = True

    def update(self, chunk: Chunk) -> None:
        self.same = self.same and np.array_equal(chunk.ref.view(np.uint8),
                                                 chunk.port.view(np.uint8))
        self.metrics.update(chunk.ref, chunk.port, chunk.start)

    def verdict(self, rank: int, a: dict, b: dict,
                shape: tuple[int, ...]) -> _Found | bool | None:
        found = self.metrics.result(shape)
        if judge.within(found["ratio"]):
            return None if self.same else True
        index = found["worst_index"]
        where = f" at [{index}]" if index not in ("", "()") else ""
        return Reason.TOLERANCE, (
            f"out of tolerance: max |diff| {found['max_abs']:.3g}, {_times(found['ratio'])} "
            f"the tolerance{where}, {self.tolerance.describe()}"), False


def _bits(rank: int, l2: float, l2_rank: float, dtype: str) -> _Found:
    """A bit difference, and whether the norms are as close as rounding leaves them (within
    a few times the dtype's default rtol, at least 1e-3)."""
    l2, l2_rank = float(l2), float(l2_rank)
    limit = max(1e-3, 3 * DEFAULTS.get(dtype, (0.0, 0.0))[0]) * max(abs(l2), abs(l2_rank))
    close = bool(abs(l2 - l2_rank) <= limit) or (math.isnan(l2) and math.isnan(l2_rank))
    return Reason.BITS, f"bits differ (L2 norm {l2:.6g} on rank 0, {l2_rank:.6g} on rank " \
        f"{rank})", close


def _statistics(row: dict) -> np.ndarray:
    """min, max, mean, std and rms (per-element quantities the element tolerance applies to),
    then the L2 norm and the NaN and Inf counts."""
    rms = record_rms(row)
    return np.array([*(float(row[c]) for c in ("min", "max", "mean", "std")), rms,
                     float(row["l2"]), float(row["nan"]), float(row["inf"])])


def _short(text: str, limit: int = 40) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _times(ratio: float) -> str:
    return "infinitely over" if not math.isfinite(ratio) else f"{ratio:.3g} times"


__all__ = ["Disagreement", "Mode", "RankDetail", "RanksResult", "RanksVerdict", "Reason",
           "check_ranks"]
