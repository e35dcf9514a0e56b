"""Manifest traces: the one file that names the rank files of a multi-rank capture.

A manifest is a summary trace with no records whose meta holds ``manifest``::

    {"world_size": 2,
     "ranks": [{"rank": 0, "file": "port.rank0.h5",
                "digests": {"index": "...", "sites": "...", "meta": "..."}}, ...]}

``file`` is relative to the manifest's folder; the digests are the rank file's own table and
meta digests (root attributes its writer set at close), so a rank file replaced or damaged
after the capture is refused, naming the rank. No torch here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import h5py

from layerdiff.errors import TraceError
from layerdiff.trace import schema
from layerdiff.trace.attributes import read_root_attributes
from layerdiff.trace.guards import guard_global_heaps
from layerdiff.trace.published import is_complete

PRODUCER = "layerdiff.capture (manifest)"
_DIGESTS = {"index": schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP),
            "sites": schema.ATTR_TABLE_DIGEST.format(table=schema.SITES_GROUP),
            "meta": schema.ATTR_META_DIGEST}


def rank_path(output: str | os.PathLike, rank: int) -> Path:
    """``port.h5`` -> ``port.rank0.h5``."""
    path = Path(output)
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


def write_manifest(output: str | os.PathLike, rank_files: list[Path]) -> Path:
    """Publish the manifest of ``rank_files`` (rank order) at ``output``, after checking that
    each is a complete trace of its rank."""
    from layerdiff.trace.writer import TraceWriter

    ranks = []
    first_meta: dict[str, Any] = {}
    for rank, path in enumerate(rank_files):
        attrs = _rank_attributes(Path(output), rank, path)
        ranks.append({"rank": rank, "file": os.path.relpath(path, Path(output).parent),
                      "digests": {key: attrs.get(name) for key, name in _DIGESTS.items()}})
        if rank == 0:
            first_meta = schema.parse_meta(attrs.get(schema.ATTR_META), path)
    meta = {"manifest": {"world_size": len(rank_files), "ranks": ranks},
            "loss_scale": first_meta.get("loss_scale", 1.0)}
    meta.update({key: first_meta[key] for key in ("case", "steps") if key in first_meta})
    writer = TraceWriter(output, meta=meta, summary=True, producer=PRODUCER)
    return writer.close()


def rank_files(manifest_path: Path, manifest: Any) -> list[Path]:
    """The rank files a manifest names, each checked: present, a complete trace, the digests
    the manifest recorded. Raises :class:`TraceError` naming the rank otherwise."""
    if not (isinstance(manifest, dict) and isinstance(manifest.get("ranks"), list)
            and isinstance(manifest.get("world_size"), int)
            and len(manifest["ranks"]) == manifest["world_size"] >= 1):
        raise TraceError(f"{manifest_path}: its manifest does not list world_size rank files; "
                         "the file is damaged, capture again")
    paths = []
    for rank, entry in enumerate(manifest["ranks"]):
        if not (isinstance(entry, dict) and entry.get("rank") == rank
                and isinstance(entry.get("file"), str) and isinstance(entry.get("digests"), dict)):
            raise TraceError(f"{manifest_path}: its manifest entry for rank {rank} is damaged; "
                             "capture again")
        name = entry["file"]
        if os.path.isabs(name) or ".." in Path(name).parts or not re.fullmatch(r"[^\x00]+", name):
            raise TraceError(f"{manifest_path}: rank {rank}'s file {name!r} is not beside the "
                             "manifest; a manifest only names files in its own folder")
        path = manifest_path.parent / name
        attrs = _rank_attributes(manifest_path, rank, path)
        if _is_manifest(attrs, path):  # itself, or another: opening it would recurse
            raise TraceError(f"{manifest_path}: rank {rank}'s file {path} is itself a manifest "
                             "(a manifest names rank files, never a manifest); the file is "
                             "damaged or crafted, capture all ranks again")
        for key, attribute in _DIGESTS.items():
            if attrs.get(attribute) != entry["digests"].get(key):
                raise TraceError(f"{manifest_path}: rank {rank}'s file {path} is not the one the "
                                 f"capture wrote (its {key} digest differs): it was replaced or "
                                 "damaged; capture again")
        paths.append(path)
    return paths


def manifest_ranks(path: str | os.PathLike) -> list[Path] | None:
    """The rank files of the complete manifest at ``path``, each verified as a reader would
    (:func:`rank_files`); None where there is no such manifest, or it does not verify."""
    path = Path(path)
    try:
        with h5py.File(path, "r") as h5:
            guard_global_heaps(h5, path)
            attrs = read_root_attributes(h5, path)
        if not is_complete(attrs):
            return None
        meta = schema.parse_meta(attrs.get(schema.ATTR_META), path)
        return rank_files(path, meta["manifest"]) if "manifest" in meta else None
    except (OSError, TraceError):
        return None


def _is_manifest(attrs: dict[str, Any], path: Path) -> bool:
    """Whether root attributes are a manifest's (its meta holds ``manifest``)."""
    return "manifest" in schema.parse_meta(attrs.get(schema.ATTR_META), path)


def _rank_attributes(manifest_path: Path, rank: int, path: Path) -> dict[str, Any]:
    """A rank file's root attributes, after checking it is a complete trace."""
    if not path.is_file():
        partial = path.with_name(path.name + schema.PARTIAL_SUFFIX)
        why = (f"only {partial} is there: that rank did not finish" if partial.exists()
               else "it is missing")
        raise TraceError(f"{manifest_path}: rank {rank}'s file {path}: {why}; capture all ranks "
                         "again")
    try:
        with h5py.File(path, "r") as h5:
            guard_global_heaps(h5, path)
            attrs = read_root_attributes(h5, path)
    except OSError as exc:
        raise TraceError(f"{manifest_path}: rank {rank}'s file {path} cannot be read as HDF5 "
                         f"({exc}); capture all ranks again") from None
    if not is_complete(attrs):
        raise TraceError(f"{manifest_path}: rank {rank}'s file {path} is not a complete trace; "
                         "capture all ranks again")
    return attrs
