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
from layerdiff.compare.pair import PairReader, origin_row
from layerdiff.errors import DiffError, LayerdiffError
from layerdiff.mapping import Mapping
from layerdiff.outputs import same_file
from layerdiff.trace import Trace, open_trace, schema
from layerdiff.trace.gather import gather, gather_key, gathered_path, up_to_date

MAX_ELEMENTS = 1 << 24  # tensors read whole to place an error; beyond, the rank is not named


def refuse_multi_rank_reference(ref: Trace) -> None:
    if len(ref.rank_paths) > 1:
        raise DiffError(f"reference {ref.path} is the manifest of a {len(ref.rank_paths)}-rank "
                        "capture; gather it into one trace first (layerdiff gather "
                        f"{ref.path} --map REF_SHARDS.toml -o reference.h5) and diff against "
                        "that")


@contextlib.contextmanager
def gathered(port: Trace, mapping: Mapping, *, workers: int | None = None,
             others: Sequence[Path] = ()) -> Iterator[tuple[Trace, list[str]]]:
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
    fresh = not up_to_date(path, key)
    if fresh:
        done = gather(port, mapping, path, workers=workers)  # refuses a gather of nothing
        warnings += done.unused_rules + done.notes
    with open_trace(path, verify=port.verify and not fresh) as trace:  # fresh: checked as read
        yield trace, warnings


def replica_disagreement(manifest: Trace, mapping: Mapping) -> dict | None:
    """The first replicated record whose copies differ across ranks (bit for bit, from the
    rank files' indexes: no tensor is read), as JSON, or None when every rank agrees. A diff
    that gathers diverged replicas joins parts computed from different inputs, so an origin
    after this record may be its consequence."""
    from layerdiff.compare.ranks import check_ranks

    found = check_ranks(manifest, mapping=mapping)
    if not found.found:
        return None
    first = found.first
    return {**first.as_json(), "where": first.where(), "on": first.on(),
            "disagreeing": found.disagreeing}


def attach_ranks(origins: list[R.Origin], reader: PairReader, mapping: Mapping) -> None:
    """Set ``ranks`` on each origin whose port record was cut across ranks: the ranks whose
    part holds out-of-tolerance elements (the pair read through ``reader``, as the diff
    compared it)."""
    port = reader.port
    world = int((port.meta.get("gathered") or {}).get("world_size", 1))
    if world < 2 or port.summary or reader.ref.summary:
        return
    modules = dict(zip(port.sites["site"], port.sites["module"], strict=True))
    for origin in origins:
        site = origin.port_site or origin.site
        module = modules.get(site) or schema.split_site(site)[0]
        rule = mapping.shard_rule(module, origin.role, origin.port_arg)
        if rule is None:
            continue
        with contextlib.suppress(LayerdiffError, ValueError):
            origin.ranks = _ranks_out(origin, reader, rule.dim, world)


def _ranks_out(origin: R.Origin, reader: PairReader, dim: int, world: int) -> list[int] | None:
    """The ranks whose equal part along ``dim`` of the port's record holds an element out of
    tolerance; None where the record is not the port's as stored (sliced or transposed: the
    rule's dim is the stored layout's), or too large to read whole."""
    row = origin_row(origin)
    ref_row, port_row = reader.records(row)
    plan = reader.plan(row)
    if ref_row is None or port_row is None or ref_row["shape"] != port_row["shape"] or max(
            int(ref_row["numel"]), int(port_row["numel"])) > MAX_ELEMENTS or (
            plan is not None and (plan.ref_slice or plan.port_slice or plan.transpose_port
                                  or plan.match == "converted")):
        return None
    ref_values, port_values = reader.read(row)  # float64, the port's gradients rescaled
    dim %= max(ref_values.ndim, 1)
    if ref_values.ndim == 0 or ref_values.shape[dim] % world:
        return None
    rtol, atol = (float(origin.metrics.get(k) or 0.0) for k in ("rtol", "atol"))
    out = ~(judge.element_ratios(ref_values, port_values, rtol, atol) <= 1.0)  # the one rule
    parts = np.split(np.moveaxis(out, dim, 0), world)
    return [rank for rank, part in enumerate(parts) if part.any()]
