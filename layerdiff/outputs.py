"""Writing output files without ever destroying an input, and without leaving half a file.

Every report (JSON, CSV, HTML, JUnit) is written under a temporary name beside its target and
renamed over it only when complete, so an interrupted write leaves the old file or none, never
a torn one. Before a command writes anything, :func:`refuse_inputs` checks that no output path
is one of its inputs (``diff ref.h5 port.h5 --json ref.h5`` would otherwise replace the
reference trace with JSON).
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


def refuse_inputs(outputs: Mapping[str, PathLike | None],
                  inputs: Mapping[str, PathLike | None]) -> None:
    """Raise OutputError when an output path (by option name) is one of the inputs."""
    for option, output in outputs.items():
        if output is None or os.fspath(output) == "-":
            continue
        for what, given in inputs.items():
            if given is not None and os.fspath(given) != "-" and same_file(output, given):
                raise OutputError(f"{option} {output} is the {what} this command reads: writing "
                                  "it would destroy that input; choose another path")


def refuse_existing(path: PathLike, option: str, force: bool) -> None:
    """Raise OutputError when ``path`` exists and ``force`` was not given."""
    if not force and os.path.lexists(path):
        raise OutputError(f"{option} {path} already exists; pass --force to replace it, or "
                          "choose another path")


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
    # not mkstemp: its files are private (0600), and a report should get the usual mode
    temporary = target.with_name(f".{target.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        yield temporary
        os.replace(temporary, target)
    except OSError as exc:
        temporary.unlink(missing_ok=True)
        raise OutputError(f"cannot write {target}: {exc.strerror or exc}; check the disk and "
                          "the folder's permissions") from exc
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_text(path: PathLike, text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) through a temporary file; returns the path."""
    with replacing(path) as temporary:
        temporary.write_text(text, encoding="utf-8")
    return Path(path)
