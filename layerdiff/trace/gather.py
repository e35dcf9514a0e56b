"""Gathering a multi-rank capture into one trace, as if one process had run the whole model.

A tensor-parallel port's rank files each hold their own part of a sharded tensor (a column-
parallel weight's rows, an activation's slice of the features) and a whole copy of every other
tensor. :func:`gather` writes one trace in the same format: each record a ``[[shard]]`` rule of
the mapping covers is the ranks' parts joined along the rule's dim (rank order), every other
record is rank 0's copy, the sites table and execution order are rank 0's. Everything that
reads one trace (the diff, its origins and hints, reports, ``show``) then works unchanged.

The rules are the mapping given, else the one the capture recorded in the rank files
(``--weights-from --map``), as the diff takes them. When no rule cuts any record, the rank files
decide: if every record is the same on every rank (shape, dtype, digest), the world replicated
everything and rank 0's copies are the whole tensors; if one differs, it is cut across ranks
(or the replicas diverged) and gather refuses, naming it and the ``[[shard]]`` rule to write,
rather than write rank 0's parts under the whole model's names.

Summary rank files hold no tensors: a gathered summary record's statistics are combined from
the parts' (min of mins, counts added, mean and spread from the parts' sums), with no digest.
Which records a rule cut is kept in the meta (``gathered``), so a report can name the rank whose
part holds an error. No torch here.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from layerdiff.errors import TraceError
from layerdiff.mapping import Mapping
from layerdiff.trace import schema
from layerdiff.trace.companions import gathered_path  # noqa: F401  (imported from here too)
from layerdiff.trace.digest import DIGEST_NAME, digest_bytes
from layerdiff.trace.h5file import TraceFile
from layerdiff.trace.joins import (
    Join,
    differs,
    layout_error,
    plan_joins,
    record_key,
    record_lookup,
)
from layerdiff.trace.layout import LayoutError, scaled_bits
from layerdiff.trace.reader import Trace, open_trace
from layerdiff.trace.stats import Stats, tensor_stats
from layerdiff.trace.verify import describe

PRODUCER = "layerdiff.gather"
GATHER_VERSION = 6  # raise when a gathered trace's contents change: kept ones are then redone
SEGMENT_BYTES = 64 << 20  # tensors packed per segment, as a capture packs them
Progress = Callable[[int, int], None]  # (records done, records total)


@dataclass
class Gathered:
    """What :func:`gather` wrote: the trace, and what the rules did."""

    path: Path
    world_size: int
    records: int
    sharded: int
    unused_rules: list[str] = field(default_factory=list)  # rules that cut no record
    mapping: str = "no mapping"  # where the rules came from
    notes: list[str] = field(default_factory=list)  # what the user should know (one line each)
    by: dict[str, int] = field(default_factory=dict)  # records joined, by what said how


def gather_key(manifest: Trace, mapping: Mapping) -> str:
    """What a gathered trace was made from: the rank files (their table and meta digests, which
    the manifest records and checks each rank file against), the rules, and how this version
    of gather joins them."""
    rules = [mapping.mesh, *((r.site.text, r.tensor, r.dim, r.layout, r.experts, r.over)
                             for r in mapping.shard_rules)]
    text = json.dumps([GATHER_VERSION, manifest.meta.get("manifest"), rules], sort_keys=True,
                      default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def shapes_key(reference_shapes: dict[tuple, str] | None) -> str:
    """What reference shapes a gather was given ('' for none)."""
    if not reference_shapes:
        return ""
    return hashlib.sha256(json.dumps(sorted((list(k), v) for k, v in reference_shapes.items())
                                     ).encode()).hexdigest()


def up_to_date(path: Path, key: str, reference_shapes: dict[tuple, str] | None = None) -> bool:
    """Whether ``path`` is a complete gathered trace made with ``key``, by this user, that the
    reference's shapes would not change (no record differed across ranks unplaced, or it was
    made with the same shapes): a link, or a file another user put there (the key is no
    secret, and the fallback folder is the shared temporary one), is gathered again (and
    replaced, not written through)."""
    try:
        status = os.lstat(path)
    except OSError:
        return False
    if not stat.S_ISREG(status.st_mode) or (hasattr(os, "geteuid")
                                            and status.st_uid != os.geteuid()):
        return False
    try:
        with open_trace(path) as trace:
            made = trace.meta.get("gathered") or {}
    except TraceError:
        return False
    return made.get("key") == key and (not made.get("unplaced") or made.get(
        "reference_shapes") == shapes_key(reference_shapes))


def gather(manifest: str | os.PathLike | Trace, mapping: Mapping | None,
           output: str | os.PathLike, *, progress: Progress | None = None,
           workers: int | None = None,
           reference_shapes: dict[tuple, str] | None = None) -> Gathered:
    """Write the one-process view of the multi-rank capture ``manifest`` at ``output``.

    ``mapping`` None takes the mapping the capture recorded in the rank files (``capture
    --weights-from --map``), else none. When no ``[[shard]]`` rule cuts any record and a record
    differs across ranks (shape, dtype or digest), raises :class:`TraceError` naming it and the
    rule to write; when none differs, every record is replicated and the trace is rank 0's
    (said in ``notes``).

    ``workers`` processes (default: every core but this one) check the rank files' bytes against
    digests and statistics while this process joins and writes, when there is enough data to
    pay for starting them (:data:`PARALLEL_MIN_BYTES`). Raises :class:`TraceError` naming the
    rank, the record and the rule when the ranks' parts cannot be joined (a record missing on
    a rank, parts of other shapes or dtypes), or a rank file's bytes are damaged.

    ``reference_shapes`` (shape text by (step, pass, site, role, arg), the diff's reference):
    a record nothing else places whose parts' lengths along one dim add up to the reference's
    is cut there (see :mod:`layerdiff.trace.joins`)."""
    notes: list[str] = []
    source = Path(manifest.path if isinstance(manifest, Trace) else manifest)
    with _opened(manifest, mapping) as (ranks, key, mapping), _Checks(workers) as checks:
        first = ranks[0]
        index = first.index.sort_values("seq", kind="stable")
        modules = _modules(first.sites)
        lookups = [record_lookup(rank.index) for rank in ranks]
        plan = plan_joins(ranks, index, modules, mapping, lookups, reference_shapes)
        joins = plan.joins
        cut = [i for i, join in enumerate(joins) if join is not None]
        if not cut and len(ranks) > 1:
            notes.append(_all_replicated(ranks, index, lookups, modules, mapping, source))
        unplaced = 0
        if cut and len(ranks) > 1:
            unplaced, said = _unplaced(ranks, index, joins, lookups, source)
            notes += said
        checks.start(ranks, index, [index.iloc[i] for i in cut], lookups)
        meta = dict(first.meta)
        for name in ("rank", "manifest"):
            meta.pop(name, None)
        meta["gathered"] = {
            "manifest": str(source), "world_size": len(ranks), "mapping": mapping.name,
            "rules": [rule.describe() for rule in mapping.shard_rules],
            "sharded_records": len(cut), "key": key,  # what up_to_date compares
            "unplaced": unplaced, "reference_shapes": shapes_key(reference_shapes),
            "layouts": _layouts_used(index, joins)}  # where each record's parts lie
        meta["world_size"] = 1
        meta["tensor_digest"] = DIGEST_NAME  # joined records are digested here
        writer = _Packer(TraceFile(output, meta, first.summary))
        try:
            rows, dropped = [], 0
            total = len(index)
            for number, (row, join) in enumerate(zip(index.to_dict("records"), joins,
                                                     strict=True)):
                if join is None:
                    rows.append(writer.copy(row, first))
                else:
                    joined = writer.join(row, join, ranks, lookups)
                    if joined is None:
                        dropped += 1
                    else:
                        rows.append(joined)
                if progress is not None and number % 64 == 0:
                    progress(number, total)
            writer.finish(rows, first.sites)
            checks.wait()
            path = writer.file.close(True)
        except BaseException:
            writer.file.abandon()
            raise
        if progress is not None:
            progress(total, total)
    if dropped:
        notes.append(f"{dropped} record(s) of {source} are partial sums in summary rank files: "
                     "a sum's statistics cannot be combined from its terms', so they are left "
                     "out of the gathered trace (capture without --summary to compare them)")
    guessed = sum(1 for join in joins if join is not None and join.source == "reference shape")
    if guessed:
        notes.append(f"{guessed} record(s) of {source} that no rule or recorded layout places "
                     "were cut as the reference's shapes say (along the one dim where the "
                     "ranks' parts add up to it, in rank order); if a tensor is cut otherwise "
                     "(zigzag, experts), write its [[shard]] rule (docs/distributed.md)")
    used = plan.used_rules
    unused = [f"{rule.describe()} cut no record of {source}: check its site glob (port "
              "module paths) and tensor name"
              for rule in mapping.shard_rules if id(rule) not in used]
    by: dict[str, int] = {}
    for join in joins:
        if join is not None:
            said = {"rules": f"the [[shard]] rules of {_mapping_name(mapping)}",
                    "capture": "the DTensor placements recorded at capture",
                    "data parallel": "the data-parallel batch",
                    "reference shape": "the reference's shapes"}[join.source]
            by[said] = by.get(said, 0) + 1
    return Gathered(Path(path), len(ranks), len(index), len(cut), unused,
                    _mapping_name(mapping), notes, by)


def _mapping_name(mapping: Mapping) -> str:
    return f"{mapping.name} ({mapping.origin})" if mapping.origin else mapping.name


def _unplaced(ranks: list[Trace], index: pd.DataFrame, joins: list[Join | None],
              lookups: list[dict[tuple, int]], source: Path) -> tuple[int, list[str]]:
    """How many records nothing places differ across ranks (cut, or replicas that diverged:
    they are written as rank 0's copies), and a note on them."""
    rows = [None, *(trace.index.to_dict("records") for trace in ranks[1:])]
    found = []
    for row, join in zip(index.to_dict("records"), joins, strict=True):
        if join is not None or row["kind"] != "tensor":
            continue
        key = record_key(row)
        if any((position := lookups[rank].get(key)) is not None
               and differs(ranks[0], row, ranks[rank], rows[rank][position], rank)
               for rank in range(1, len(ranks))):
            found.append(row)
    if not found:
        return 0, []
    return len(found), [
        f"{len(found)} record(s) of {source} differ across ranks and no rule or recorded "
        f"layout places them, first {describe(found[0])}: the gathered trace holds rank 0's "
        "copies under the whole model's names; if they are cut (a DTensor port's plain local "
        "parts), the diff cuts them by its reference's shapes, or write their [[shard]] rules; "
        "if not, `layerdiff ranks` finds where the replicas diverged (docs/distributed.md)"]


def _all_replicated(ranks: list[Trace], index: pd.DataFrame, lookups: list[dict[tuple, int]],
                    modules: dict[str, str], mapping: Mapping, source: Path) -> str:
    """What to say of a world whose records no rule cut: every record the same on every rank
    (shape, dtype, and digest, or bytes where there is none): all replicated, rank 0's copies
    are the whole tensors. Raises TraceError naming the first record that differs: cut across
    ranks (or diverged), it would be gathered as rank 0's part under the whole's name."""
    rows = [None, *(trace.index.to_dict("records") for trace in ranks[1:])]  # ~100 us a .iloc
    for row in index.to_dict("records"):
        if row["kind"] != "tensor":
            continue
        key = (int(row["step"]), row["pass"], row["site"], row["role"], row["arg"])
        for rank in range(1, len(ranks)):
            position = lookups[rank].get(key)
            if position is None:
                continue  # no evidence of a cut: a record missing on a rank stays rank 0's
            other = rows[rank][position]
            how = differs(ranks[0], row, ranks[rank], other, rank)
            if how:
                raise TraceError(_unjoined(row, other, how, modules, mapping, source))
    return (f"every record of {source} is the same on all {len(ranks)} ranks (shape, dtype, "
            "digest): nothing is cut across ranks, and the gathered trace is rank 0's copies, "
            "which are the whole tensors")


def _unjoined(row: dict[str, Any], other: dict[str, Any], how: str, modules: dict[str, str],
              mapping: Mapping, source: Path) -> str:
    """The refusal of a gather that would join nothing: the record, and the rule to write."""
    module = modules.get(row["site"]) or schema.split_site(row["site"])[0]
    role, arg = row["role"], row["arg"]
    if role in ("weight", "weight_grad"):
        tensor = arg
    else:
        side = "input" if role in ("input", "grad_input") else "output"
        tensor = side if arg == "0" else f"{side}.{arg}"
    shapes = schema.parse_shape(row["shape"]), schema.parse_shape(other["shape"])
    apart = [axis for axis, (a, b) in enumerate(zip(*shapes, strict=True)) if a != b] if len(
        shapes[0]) == len(shapes[1]) else []
    known = len(apart) == 1  # the parts' shapes differ along one axis: the cut's
    if mapping.shard_rules:
        rules = f"no [[shard]] rule of {_mapping_name(mapping)} cuts any record"
    elif mapping.path is not None:
        rules = f"{_mapping_name(mapping)} has no [[shard]] rules"
    else:
        rules = "no mapping gives [[shard]] rules (none given with --map, none recorded " \
                "at capture)"
    return (f"{source}: {rules}, but {describe(row)} differs across ranks ({how}): it is cut "
            f"across them (or the replicas diverged: `layerdiff ranks {source}` tells), and a "
            "gathered trace would hold rank 0's part under the whole model's name; write a "
            "rule for it in a mapping file "
            f"([[shard]] site = \"{module}\", tensor = \"{tensor}\", "
            + (f"dim = {apart[0]}" if known else "dim = D: the axis it is cut along")
            + ") and pass it with --map FILE (docs/distributed.md)")


PARALLEL_MIN_BYTES = 256 << 20  # below, starting worker processes costs more than it saves
TASK_BYTES = 64 << 20           # records per worker task


class _Checks:
    """The rank files' tensors checked against their index rows in worker processes, while
    the caller reads them unchecked; :meth:`wait` raises the first damage found."""

    def __init__(self, workers: int | None) -> None:
        # by default every core but the one this process joins and writes on
        self.workers = workers if workers is not None else (os.cpu_count() or 1) - 1
        self.pool = None
        self.futures: list = []

    def __enter__(self) -> _Checks:
        return self

    def start(self, ranks: list[Trace], index: pd.DataFrame, cut: list[pd.Series],
              lookups: list[dict[tuple, int]]) -> None:
        if not ranks[0].verify or self.workers < 2:
            return
        wanted = [np.flatnonzero(ranks[0].index["segment"].to_numpy() >= 0).tolist()]
        for lookup in lookups[1:]:
            wanted.append([lookup[(int(r["step"]), r["pass"], r["site"], r["role"], r["arg"])]
                           for r in cut if r["segment"] >= 0])
        tasks = [(str(trace.path), chunk) for trace, positions in zip(ranks, wanted, strict=True)
                 for chunk in _chunks(trace.index["nbytes"], positions)]
        if sum(int(ranks[r].index["nbytes"].iloc[p].sum()) for r, p in enumerate(wanted)) < (
                PARALLEL_MIN_BYTES):
            return
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor

        self.pool = ProcessPoolExecutor(min(self.workers, len(tasks)),
                                        mp_context=multiprocessing.get_context("spawn"))
        self.futures = [self.pool.submit(_check_records, path, chunk) for path, chunk in tasks]
        for trace in ranks:  # the workers check the bytes: read them unchecked here
            trace.verify = False

    def wait(self) -> None:
        for future in self.futures:
            future.result()  # a worker's TraceError, raised here

    def __exit__(self, *exc: object) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)


def _chunks(nbytes: pd.Series, positions: list[int]) -> list[list[int]]:
    chunks, current, size = [], [], 0
    for position in positions:
        current.append(position)
        size += int(nbytes.iloc[position])
        if size >= TASK_BYTES:
            chunks.append(current)
            current, size = [], 0
    return chunks + ([current] if current else [])


def _check_records(path: str, positions: list[int]) -> None:
    """A worker's task: read these records of one rank file, checking each."""
    with open_trace(path) as trace:
        for position in positions:
            trace.read(position, raw=True)


class _opened:
    """The rank files of a manifest, open (given as a path or an open manifest trace)."""

    def __init__(self, manifest: str | os.PathLike | Trace, mapping: Mapping | None) -> None:
        self.manifest = manifest
        self.traces: list[Trace] = []
        self.mapping = mapping

    def __enter__(self) -> tuple[list[Trace], str, Mapping]:
        given = self.manifest
        trace = given if isinstance(given, Trace) else open_trace(given)
        try:
            if not trace.rank_paths:
                raise TraceError(f"{trace.path} is a one-process trace, not the manifest of a "
                                 "multi-rank capture; there is nothing to gather")
            self.traces = [open_trace(path, verify=trace.verify) for path in trace.rank_paths]
            if self.mapping is None:  # the diff's choice: the mapping the capture recorded
                self.mapping = Mapping.recorded(
                    self.traces[0].meta, f"{trace.path.name}'s rank files") or Mapping()
            key = gather_key(trace, self.mapping)
        except BaseException:
            self.__exit__()
            raise
        finally:
            if not isinstance(given, Trace):
                trace.close()
        return self.traces, key, self.mapping

    def __exit__(self, *exc: object) -> None:
        for trace in self.traces:
            trace.close()


def _modules(sites: pd.DataFrame) -> dict[str, str]:
    return dict(zip(sites["site"], sites["module"], strict=True))


def _layouts_used(index: pd.DataFrame, joins: list[Join | None]) -> dict[str, list]:
    """The gathered trace's record of how each joined record's parts lay on the ranks (the
    form of a capture's ``layouts``, with why and the scale): the diff names ranks from it."""
    table: list[dict[str, Any]] = []
    numbers: dict[str, int] = {}
    records, seen = [], set()
    for row, join in zip(index.to_dict("records"), joins, strict=True):
        if join is None or (row["site"], row["role"], row["arg"]) in seen:
            continue
        seen.add((row["site"], row["role"], row["arg"]))
        entry = join.to_json()
        text = json.dumps(entry, sort_keys=True)
        if text not in numbers:
            numbers[text] = len(table)
            table.append(entry)
        records.append([row["site"], row["role"], row["arg"], numbers[text]])
    return {"table": table, "records": records}


class _Packer:
    """Packs tensors into segments of the output and builds its index rows."""

    def __init__(self, file: TraceFile) -> None:
        self.file = file
        self._buffer = np.empty(SEGMENT_BYTES, np.uint8)  # reused: no copy grows or reallocates
        self._used = 0

    def _place(self, raw: np.ndarray) -> tuple[int, int]:
        """(segment, offset) where ``raw`` (uint8) will lie."""
        if self._used + raw.nbytes > self._buffer.size:
            self._flush()
            if raw.nbytes > self._buffer.size:  # a tensor larger than a segment: its own
                segment = self.file.write_segment(raw)
                return segment, 0
        offset = self._used
        end = offset + raw.nbytes
        self._used = end + (-raw.nbytes % schema.ALIGN)
        self._buffer[offset:end] = raw
        self._buffer[end:self._used] = 0  # padding: zeros, as a capture writes
        return self.file.segments, offset

    def _flush(self) -> None:
        if self._used:
            self.file.write_segment(self._buffer[:self._used])
            self._used = 0

    def copy(self, row: dict[str, Any], trace: Trace) -> dict[str, Any]:
        if row["kind"] != "tensor":
            return row
        if trace.digest_algorithm != DIGEST_NAME and row["digest"]:
            # a rank file of an older layerdiff: its digest follows the other definition
            row = {**row, "digest": digest_bytes(trace.read(pd.Series(row), raw=True))
                   if row["segment"] >= 0 else ""}
        if row["segment"] < 0:
            return row
        raw = trace.read(pd.Series(row), raw=True)
        segment, offset = self._place(raw.reshape(-1).view(np.uint8))
        return {**row, "segment": segment, "offset": offset}

    def join(self, row: dict[str, Any], join: Join, ranks: list[Trace],
             lookups: list[dict[tuple, int]]) -> dict[str, Any] | None:
        """The record joined from the ranks' parts as ``join`` says; None for a summary's
        partial sum (its statistics cannot be combined from its terms')."""
        key = record_key(row)
        parts = {}
        for rank in join.layout.ranks:
            position = lookups[rank].get(key) if rank < len(lookups) else None
            if position is None:
                raise TraceError(f"{ranks[min(rank, len(ranks) - 1)].path}: rank {rank} has no "
                                 f"{describe(row)}, which rank 0 has and {join.why} cuts "
                                 "across ranks; the ranks ran different code: capture them "
                                 "again")
            part = ranks[rank].index.iloc[position]
            if part["dtype"] != row["dtype"]:
                raise TraceError(f"{ranks[rank].path}: rank {rank}'s {describe(row)} is "
                                 f"{part['dtype']} and rank 0's {row['dtype']}; parts of one "
                                 f"tensor ({join.why}) have one dtype")
            parts[rank] = part
        if row["segment"] < 0:  # summary: statistics combined, no data
            if join.layout.reduces:
                return None
            shapes = {rank: np.empty(schema.parse_shape(p["shape"]), np.bool_)
                      for rank, p in parts.items()}
            whole = self._unshard(join, shapes, "bool", row, ranks)
            combined = Stats(*_combined(list(parts.values())).values())
            return {**self._shaped(row, whole.shape), **_scaled(combined, join.scale)._asdict()}
        arrays = {rank: ranks[rank].read(part, raw=True) for rank, part in parts.items()}
        whole = self._unshard(join, arrays, row["dtype"], row, ranks)
        if join.scale != 1.0:
            whole = scaled_bits(whole, row["dtype"], join.scale)
        stats = tensor_stats(whole, row["dtype"])
        segment, offset = self._place(whole.reshape(-1).view(np.uint8))
        return {**self._shaped(row, whole.shape), **stats._asdict(), "segment": segment,
                "offset": offset}

    @staticmethod
    def _unshard(join: Join, parts: dict[int, np.ndarray], dtype: str, row: dict[str, Any],
                 ranks: list[Trace]) -> np.ndarray:
        try:
            return join.layout.unshard(parts, dtype)
        except LayoutError as error:
            raise layout_error(error, ranks[0].path, row, join) from None

    @staticmethod
    def _shaped(row: dict[str, Any], shape: tuple[int, ...]) -> dict[str, Any]:
        numel = math.prod(shape)
        itemsize = schema.numpy_dtype(row["dtype"]).itemsize
        return {**row, "shape": schema.format_shape(tuple(shape)), "numel": numel,
                "nbytes": numel * itemsize}

    def finish(self, rows: list[dict[str, Any]], sites: pd.DataFrame) -> None:
        self._flush()
        columns = {name: [row[name] for row in rows] for name in schema.INDEX_COLUMNS}
        self.file.append_rows(schema.INDEX_GROUP, columns)
        self.file.append_rows(schema.SITES_GROUP,
                              {name: sites[name].tolist() for name in schema.SITES_COLUMNS})


def _scaled(found: Stats, scale: float) -> Stats:
    """Statistics of the whole multiplied by ``scale`` (> 0)."""
    if scale == 1.0:
        return found
    return found._replace(min=found.min * scale, max=found.max * scale,
                          mean=found.mean * scale, std=found.std * scale, l2=found.l2 * scale)


def _combined(parts: list[pd.Series]) -> dict[str, Any]:
    """Statistics of the joined tensor from its parts' (population std over finite values)."""
    counts = [int(p["numel"]) - int(p["nan"]) - int(p["inf"]) for p in parts]
    finite = sum(counts)
    nan, inf = sum(int(p["nan"]) for p in parts), sum(int(p["inf"]) for p in parts)
    lows = [float(p["min"]) for p in parts]
    highs = [float(p["max"]) for p in parts]
    lo = math.nan if all(math.isnan(v) for v in lows) else float(np.nanmin(lows))
    hi = math.nan if all(math.isnan(v) for v in highs) else float(np.nanmax(highs))
    if not finite:
        return Stats(lo, hi, math.nan, math.nan, math.nan, nan, inf, "")._asdict()
    used = [(n, float(p["mean"]), float(p["std"])) for n, p in zip(counts, parts, strict=True)
            if n]
    # the parts' sums, relative to a power of two near their largest mean or spread: no square
    # leaves float64's range, for values near 1e308 or near its smallest (stats.py's scaled sums)
    big = max(max(abs(mean), std) for _, mean, std in used)
    scale = math.ldexp(1.0, math.frexp(big)[1]) if 0 < big < math.inf else 1.0
    total = sum(n * (mean / scale) for n, mean, _ in used)
    squares = sum(n * ((std / scale) ** 2 + (mean / scale) ** 2) for n, mean, std in used)
    mean_s = total / finite
    mean = min(max(mean_s * scale, lo), hi)
    std = math.sqrt(max(squares / finite - mean_s * mean_s, 0.0)) * scale
    l2 = math.nan if nan else (math.inf if inf else math.sqrt(squares) * scale)
    return Stats(lo, hi, mean, std, l2, nan, inf, "")._asdict()
