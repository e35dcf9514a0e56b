"""The files a trace path stands for besides itself: what a command reading it also reads, and
what it may write beside it.

The manifest of a multi-rank capture (``port.h5``) is read through its rank files
(``port.rank0.h5``, ...), and a diff keeps the ranks gathered into one trace beside it
(``port.gathered.h5``), rewritten whenever it is out of date. So no output of a command may be
one of these (``diff ref.h5 port.h5 --json port.rank0.h5`` would destroy rank 0's file), and no
input may be the gathered trace that another input's diff would rewrite
(``diff port.gathered.h5 port.h5``). :func:`layerdiff.outputs.refuse_inputs` checks both with
:func:`companions`. No torch here.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from layerdiff.errors import LayerdiffError


@dataclass(frozen=True)
class Companion:
    """One file a trace path stands for: ``what`` it is, phrased to follow "is"."""

    path: Path
    what: str
    rewritten: bool  # a command may write it (the gathered trace), not only read it


def gathered_path(manifest: str | os.PathLike) -> Path:
    """Where the diff keeps a manifest's gathered trace: ``port.h5`` -> ``port.gathered.h5``."""
    manifest = Path(manifest)
    return manifest.with_name(f"{manifest.stem}.gathered{manifest.suffix}")


def companions(path: str | os.PathLike) -> list[Companion]:
    """The rank files and the gathered trace of ``path`` when it is the manifest of a
    multi-rank capture; nothing for a one-process trace, or a path that is no readable trace
    (a mapping file, a missing or damaged file: the command that reads it says so itself,
    before it writes anything)."""
    from layerdiff.trace.reader import open_trace  # h5py: only for commands that check

    try:
        with open_trace(path, verify=False) as trace:  # checks the rank files the manifest names
            ranks = list(trace.rank_paths)
    except LayerdiffError:
        return []
    if not ranks:
        return []
    named = f"the manifest {os.fspath(path)}"
    return [*(Companion(rank_file, f"rank {rank}'s file of {named}", False)
              for rank, rank_file in enumerate(ranks)),
            Companion(gathered_path(path), f"the gathered trace kept beside {named}", True)]


def manifest_of(path: str | os.PathLike) -> tuple[Path, int] | None:
    """(the manifest, the rank) when ``path`` is a rank file that the manifest beside it names
    (``port.rank1.h5`` of ``port.h5``, checked as a reader checks it); None otherwise."""
    path = Path(path)
    found = re.fullmatch(r"(.+)\.rank(\d+)", path.stem)
    if found is None:
        return None
    manifest = path.with_name(f"{found.group(1)}{path.suffix}")
    if not manifest.is_file():
        return None
    for companion in companions(manifest):
        if not companion.rewritten and _same(companion.path, path):
            return manifest, int(found.group(2))
    return None


def _same(a: Path, b: Path) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return False
