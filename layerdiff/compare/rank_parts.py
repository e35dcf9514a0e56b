"""Multi-rank ports in the diff: gather the ranks into one trace, then name the rank of an error.

The diff compares a gathered trace (:mod:`layerdiff.trace.gather`) like any other. For an origin
whose record a ``[[shard]]`` rule cut, the out-of-tolerance elements are located in the ranks'
parts (equal parts along the rule's dim, rank order): an error in one rank's part only points
at that rank's shard (its slice of a weight, an off-by-one in its offset), an error in every
part at the layer's code.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from layerdiff.compare import judge
from layerdiff.compare import result as R
from layerdiff.compare.origins import TOLERANCE
from layerdiff.compare.pair import PairReader, origin_row
from layerdiff.errors import DiffError, LayerdiffError
from layerdiff.mapping import Mapping
from layerdiff.outputs import same_file
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.gather import gather, gather_key, gathered_path, up_to_date
from layerdiff.trace.layout import Layout

MAX_ELEMENTS = 1 << 24  # tensors read whole to place an error; beyond, the rank is not named


def refuse_multi_rank_reference(ref: Trace) -> None:
    if len(ref.rank_paths) > 1:
        raise DiffError(f"reference {ref.path} is the manifest of a {len(ref.rank_paths)}-rank "
                        "capture; gather it into one trace first (layerdiff gather "
                        f"{ref.path} --map REF_SHARDS.toml -o reference.h5) and diff against "
                        "that")


@contextlib.contextmanager
def gathered(port: Trace, mapping: Mapping, *, workers: int | None = None,
             others: Sequence[Path] = (), shapes: dict[tuple, str] | None = None
             ) -> Iterator[tuple[Trace, list[str]]]:
    """The one-trace view of a multi-rank ``port``, and warnings for the user. It is kept
    beside the manifest (``port.gathered.h5``, reused while the rank files and shard rules are
    the same), so that reports can read it after the diff; in the system's temporary folder
    where the manifest's folder is not writable. Raises DiffError when that is one of the
    ``others`` traces the diff reads (it would rewrite its own reference). Raises TraceError
    when no rule cuts a record that differs across ranks (:func:`gather`)."""
    warnings: list[str] = []
    path, key = gathered_path(port.path), gather_key(port, mapping)
    if not os.access(path.parent, os.W_OK):
        path = Path(tempfile.gettempdir()) / f"layerdiff-{key[:12]}-{path.name}"
        warnings.append(f"{port.path.parent} is not writable: the gathered trace is {path}")
    for other in others:
        if same_file(path, other):
            raise DiffError(f"{other} is the gathered trace kept beside the manifest {port.path}, "
                            "which the diff rewrites from its rank files: copy it to another "
                            "name and diff against that")
    fresh = not up_to_date(path, key, shapes)
    if fresh:
        done = gather(port, mapping, path, workers=workers,  # refuses a gather of nothing
                      reference_shapes=shapes)
        warnings += done.unused_rules + done.notes
    with open_trace(path, verify=port.verify and not fresh) as trace:  # fresh: checked as read
        yield trace, warnings


def reference_shapes(reference: Trace) -> dict[tuple, str]:
    """The reference's tensor shapes by record key: what a DTensor port's plain local parts
    are cut from (layerdiff.trace.joins)."""
    index = reference.index
    tensors = index[index["kind"] == "tensor"]
    return {(int(step), pass_, site, role, arg): shape for step, pass_, site, role, arg, shape
            in zip(tensors["step"], tensors["pass"], tensors["site"], tensors["role"],
                   tensors["arg"], tensors["shape"], strict=True)}


def replica_disagreement(manifest: Trace, mapping: Mapping,
                         shapes: dict[tuple, str] | None = None) -> dict | None:
    """The first replicated record whose copies differ across ranks (bit for bit, from the
    rank files' indexes: no tensor is read), as JSON, or None when every rank agrees. A diff
    that gathers diverged replicas joins parts computed from different inputs, so an origin
    after this record may be its consequence."""
    from layerdiff.compare.ranks import check_ranks

    found = check_ranks(manifest, mapping=mapping, reference_shapes=shapes)
    if not found.found:
        return None
    first = found.first
    return {**first.as_json(), "where": first.where(), "on": first.on(),
            "disagreeing": found.disagreeing}


def attach_ranks(origins: list[R.Origin], reader: PairReader) -> None:
    """Set ``ranks`` and ``shards`` on each origin of a gathered port: for a record whose parts
    were joined (a ``[[shard]]`` rule, a DTensor's placements, the data-parallel batch), the
    ranks whose part holds out-of-tolerance elements; for a replicated record, the ranks whose
    own copy is out of tolerance (the diff compared rank 0's). The pair is read through
    ``reader``, as the diff compared it."""
    port = reader.port
    gathered = port.meta.get("gathered") or {}
    world = int(gathered.get("world_size", 1))
    if world < 2 or port.summary or reader.ref.summary:
        return
    joined = _joined_layouts(gathered)
    for origin in origins:
        site = origin.port_site or origin.site
        found = joined.get((site, origin.role, origin.port_arg))
        with contextlib.suppress(LayerdiffError, ValueError, OSError):
            kept = joined.get((site, "weight_grad", origin.port_arg))
            if origin.role == "weight" and kept is not None and (
                    found is None or set(kept[0].ranks) > set(found[0].ranks)):
                # a weight FSDP all-gathered before the module ran (whole on every rank, or
                # a tensor-parallel rank's whole part), kept between steps in shards laid out
                # as its gradient's: a slip in one rank's shard is that rank's
                origin.ranks = _ranks_out(origin, reader, kept[0])
                computed = ("whole on every rank" if found is None else
                            f"{found[0].describe()}, each part whole on its data-parallel ranks")
                origin.shards = (f"{computed} (all-gathered for the module's forward); "
                                 "between steps each rank keeps its shard, laid out as the "
                                 f"gradient's: {kept[0].describe()}")
            elif found is not None:
                layout, why = found
                origin.ranks = _ranks_out(origin, reader, layout)
                origin.shards = _shards_sentence(layout, why)
            else:
                origin.ranks = _copies_out(origin, reader, gathered.get("manifest"), world)
                origin.shards = (f"replicated: each of the {world} ranks holds the whole "
                                 "tensor; the diff compared rank 0's copy")
        origin.shards = ". ".join(filter(None, [origin.shards, _data_parallel(port, origin)]))
        _one_rank_loaded_otherwise(origin, world)


def _one_rank_loaded_otherwise(origin: R.Origin, world: int) -> None:
    """A weight that differs before anything ran on some ranks' parts only: those ranks
    loaded or made their part otherwise, which giving the port the reference's weights as a
    whole does not explain."""
    if (origin.role != "weight" or origin.step != 0 or not origin.ranks
            or len(origin.ranks) >= world or origin.reason != TOLERANCE.weights[0]):
        return
    if len(origin.ranks) == 1:
        where, who = f"rank {origin.ranks[0]}'s part", f"rank {origin.ranks[0]} loaded or made its"
    else:
        where = f"the parts of ranks {', '.join(map(str, origin.ranks))}"
        who = "those ranks loaded or made their"
    origin.reason = (f"its weights differ before anything ran in {where} only, while the other "
                     f"ranks' agree with the reference's: {who} part otherwise (a checkpoint "
                     "shard on the wrong rank, a rank-dependent init, a slip in the code that "
                     "cuts the weight)")


def _data_parallel(port: Trace, origin: R.Origin) -> str:
    """What a weight or weight-gradient record of a data-parallel capture means (the capture
    says: FSDP's all-gathered weight, its reduce-scattered gradient)."""
    said = port.meta.get("data_parallel")
    if not isinstance(said, dict):
        return ""
    meaning = said.get({"weight": "weights", "weight_grad": "weight_grads"}.get(origin.role, ""))
    return f"The {origin.role} records of this capture are {meaning}." if meaning else ""


def _joined_layouts(gathered: dict) -> dict[tuple[str, str, str], tuple[Layout, str]]:
    found = gathered.get("layouts") or {}
    table = [(Layout.from_json(entry), str(entry.get("why", "")))
             for entry in found.get("table", [])]
    return {(site, role, arg): table[number]
            for site, role, arg, number in found.get("records", [])}


def _shards_sentence(layout: Layout, why: str) -> str:
    """How the record lies on the ranks, and where it stands to their collectives."""
    text = f"joined across the ranks: {layout.describe()} ({why})"
    if layout.reduces:
        return (text + "; the record is a partial result before its reduction across the "
                "ranks (the all-reduce or reduce-scatter after it): every rank's term adds to "
                "every element, so no one rank is named")
    return text


def _comparable(origin: R.Origin, reader: PairReader) -> tuple[np.ndarray, np.ndarray] | None:
    """The origin's (reference, port) values as the diff compared them, when the port's are
    its record as stored (not sliced, transposed or converted) and small enough to read."""
    row = origin_row(origin)
    ref_row, port_row = reader.records(row)
    plan = reader.plan(row)
    if ref_row is None or port_row is None or ref_row["shape"] != port_row["shape"] or max(
            int(ref_row["numel"]), int(port_row["numel"])) > MAX_ELEMENTS or (
            plan is not None and (plan.ref_slice or plan.port_slice or plan.transpose_port
                                  or plan.match == "converted")):
        return None
    return reader.read(row)  # float64, the port's gradients rescaled


def _out(origin: R.Origin, ref_values: np.ndarray, port_values: np.ndarray) -> np.ndarray:
    rtol, atol = (float(origin.metrics.get(k) or 0.0) for k in ("rtol", "atol"))
    return ~(judge.element_ratios(ref_values, port_values, rtol, atol) <= 1.0)  # the one rule


def _ranks_out(origin: R.Origin, reader: PairReader, layout: Layout) -> list[int] | None:
    """The ranks whose part of the joined record holds an element out of tolerance; None
    where no part is one rank's alone (partial terms) or the record cannot be read as
    stored."""
    values = _comparable(origin, reader)
    if values is None:
        return None
    out = _out(origin, *values)
    found = []
    for rank in layout.ranks:
        index = layout.part_index(rank, out.shape)
        if index is None:
            return None
        if out[np.ix_(*index)].any():
            found.append(rank)
    return found


def _copies_out(origin: R.Origin, reader: PairReader, manifest: str | None,
                world: int) -> list[int] | None:
    """The ranks whose own copy of a replicated record is out of tolerance against the
    reference (rank 0's is the one the diff compared)."""
    values = _comparable(origin, reader)
    if values is None or not manifest:
        return None
    ref_values, port_values = values
    found = [0] if _out(origin, ref_values, port_values).any() else []
    row = origin_row(origin)
    _, port_row = reader.records(row)
    with open_trace(manifest) as ranks:
        paths = ranks.rank_paths
    for rank, path in enumerate(paths[1:world], start=1):
        with open_trace(path) as trace:
            index = trace.index
            match = index[(index["step"] == port_row["step"]) & (index["pass"] == port_row[
                "pass"]) & (index["site"] == port_row["site"]) & (index["role"] == port_row[
                    "role"]) & (index["arg"] == port_row["arg"])]
            if match.empty:
                continue
            copy = match.iloc[0]
            if copy["digest"] and copy["digest"] == port_row["digest"]:
                wrong = bool(found and found[0] == 0)  # rank 0's bytes: rank 0's verdict
            else:
                values = trace.read(copy).astype(np.float64).reshape(port_values.shape)
                if origin.role in schema.GRAD_ROLES:
                    values = values * reader.grad_factor  # at the reference's loss scale
                wrong = bool(_out(origin, ref_values, values).any())
            if wrong:
                found.append(rank)
    return found
