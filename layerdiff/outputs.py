"""Writing output files without ever destroying an input, and without leaving half a file.

Every report (JSON, CSV, HTML, JUnit) is written under a temporary name beside its target and
renamed over it only when complete, so an interrupted write leaves the old file or none, never
a torn one. Before a command writes anything, :func:`refuse_inputs` checks that no output path
is one of its inputs (``diff ref.h5 port.h5 --json ref.h5`` would otherwise replace the
reference trace with JSON), nor a file an input stands for: a manifest's rank files and the
gathered trace kept beside it (:mod:`layerdiff.trace.companions`).
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Iterator, Mapping
from pathlib import Path

from layerdiff.errors import OutputError

PathLike = str | os.PathLike


def same_file(a: PathLike, b: PathLike) -> bool:
    """Whether two paths name one file (symlinks and hard links included)."""
    try:
        return os.path.samefile(a, b)
    except OSError:  # one does not exist (yet): compare where they would be
        return Path(a).resolve() == Path(b).resolve()


def _given(path: PathLike | None) -> bool:
    return path is not None and os.fspath(path) != "-"


def refuse_inputs(outputs: Mapping[str, PathLike | None],
                  inputs: Mapping[str, PathLike | None], *, gathers: bool = True) -> None:
    """Raise OutputError when an output path (by option name) is one of the inputs or a file
    one of them stands for: a manifest's rank files and, for a command that ``gathers`` a
    multi-rank port (the diff and what runs it), the gathered trace it keeps beside the manifest
    (:func:`layerdiff.trace.companions.companions`). Also when an input is the gathered trace
    that the command would rewrite beside another input, a manifest."""
    from layerdiff.trace.companions import gathered_path

    outputs = {option: path for option, path in outputs.items() if _given(path)}
    inputs = {what: path for what, path in inputs.items() if _given(path)}
    for what, given in inputs.items():
        for option, output in outputs.items():
            if same_file(output, given):
                raise OutputError(f"{option} {output} is the {what} this command reads: "
                                  "writing it would destroy that input; choose another path")
    for what, given in inputs.items():
        # a manifest is opened only when something could be among its files
        cache = gathered_path(given)
        if not outputs and not (gathers and any(same_file(cache, other)
                                                for other in inputs.values())):
            continue
        for companion in _companions(given, gathers):
            for option, output in outputs.items():
                if same_file(output, companion.path):
                    raise OutputError(
                        f"{option} {output} is {companion.what} (the {what}), which this "
                        "command " + ("writes and reads back" if companion.rewritten else
                                      "reads")
                        + ": writing it would destroy that file; choose another path")
            for other_what, other in inputs.items():
                if companion.rewritten and same_file(companion.path, other):
                    raise OutputError(
                        f"the {other_what} {other} is {companion.what} (the {what}), which "
                        "this command rewrites when the rank files or shard rules differ from "
                        "the ones it was gathered from; copy it to another name and pass that")


def _companions(path: PathLike, gathers: bool) -> list:
    from layerdiff.trace.companions import companions

    return [c for c in companions(path) if gathers or not c.rewritten]


def refuse_existing(path: PathLike, option: str, force: bool) -> None:
    """Raise OutputError when ``path`` exists and ``force`` was not given."""
    if not force and os.path.lexists(path):
        raise OutputError(f"{option} {path} already exists; pass --force to replace it, or "
                          "choose another path")


def refuse_rank_file(path: PathLike, option: str, rewritten: PathLike | None = None) -> None:
    """Raise OutputError when ``path`` is a rank file that the manifest beside it names:
    replacing it, even with --force, breaks that manifest. ``rewritten`` is the manifest a
    multi-rank capture writes whole, with its rank files: those it may replace."""
    from layerdiff.trace.companions import manifest_of

    if not os.path.lexists(path):
        return
    found = manifest_of(path)
    if found is None or (rewritten is not None and same_file(found[0], rewritten)):
        return
    manifest, rank = found
    raise OutputError(f"{option} {path} is rank {rank}'s file of the manifest {manifest}: "
                      "replacing it would break that manifest, even with --force; choose "
                      f"another path, or capture every rank again with -o {manifest}")


def make_folder(path: PathLike, what: str) -> Path:
    """Create the folder ``path`` (and its parents) where it is missing; an OutputError naming
    ``what`` it is for (an option) when it cannot be (a read-only disk, a file in the way)."""
    folder = Path(path)
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the {what} folder {folder}: {exc.strerror or exc}; "
                          "choose a folder you can write to") from exc
    return folder


@contextlib.contextmanager
def replacing(path: PathLike) -> Iterator[Path]:
    """A temporary path beside ``path`` to write to; renamed over ``path`` when the block ends
    without error, removed when it raises. Creates the parent folder when it is missing."""
    target = Path(path)
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create the folder of {target}: {exc.strerror or exc}; "
                          "choose a folder you can write to") from exc
    temporary = _temporary_path(target)
    try:
        yield temporary
        os.replace(temporary, target)
    except OSError as exc:
        _discard(temporary)
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}; check the disk and "
                          "the folder's permissions") from exc
    except BaseException:
        _discard(temporary)
        raise


def _temporary_path(target: Path) -> Path:
    """A fresh hidden name beside ``target`` (not mkstemp: its files are private, 0600, and a
    report should get the usual mode). Its part of ``target``'s name is cut short so that a
    name the file system takes (255 bytes) still gives a temporary name it takes."""
    name = target.name
    while len(os.fsencode(name)) > 200:  # whole characters: the name stays decodable
        name = name[:-1]
    return target.with_name(f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def _discard(temporary: Path) -> None:
    """Remove a temporary file if it is there. On a read-only file system even removing a
    missing file fails (EROFS): the write's own error is what the user needs, not this one."""
    with contextlib.suppress(OSError):
        temporary.unlink(missing_ok=True)


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) through a temporary file; returns the path."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)
