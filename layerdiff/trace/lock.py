"""One writer per trace path: an exclusive lock taken before the ``.partial`` is created.

Two captures to one path would otherwise both write ``NAME.partial`` and both publish it: one
printed "wrote" over a file that cannot be read. The lock is ``flock`` on ``NAME.lock`` (POSIX;
the kernel releases it when its process dies, so a killed capture never blocks the next), which
holds the writer's process id so the second capture can say who has it. The lock file is removed
when the writer is done; a lock taken on a file that another writer removed meanwhile is taken
again on the new one.

The lock file is opened without following a symbolic link, and only a plain file of one name is
written: an artifact folder unpacked from a tar may hold a ``NAME.lock`` that is a link (or a
hard link) to another file, which truncating and writing a process id into would destroy. Such
a name is no lock any writer made; it is removed (which never touches what it points to).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path

from layerdiff.errors import CaptureError

try:
    import fcntl
except ImportError:  # Windows: no flock; one writer per path is then the user's to keep
    fcntl = None


_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
# a name re-planted faster than it is removed: give up after this many removals
_STALE_TRIES = 8


def lock_path(path: str | os.PathLike) -> Path:
    return Path(f"{os.fspath(path)}.lock")


class WriterLock:
    """Held while a trace is written to ``path``; ``release`` ends it."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.file = lock_path(path)
        self._fd: int | None = None
        if fcntl is None:
            return
        what = f"cannot write trace {self.path}"
        stale = 0
        while self._fd is None:
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT | _NOFOLLOW, 0o644)
            except OSError as exc:
                if exc.errno == errno.ELOOP and stale < _STALE_TRIES:  # a symbolic link
                    stale += 1
                    remove_stale(self.file, what)
                    continue
                # /proc, a read-only or full disk
                raise CaptureError(f"{what}: creating {self.file} failed "
                                   f"({os.strerror(exc.errno or 0)}); choose another -o "
                                   "path") from exc
            if not _plain_file(fd):  # a hard link to another file, a FIFO, a device
                os.close(fd)
                if stale >= _STALE_TRIES:
                    raise CaptureError(f"{what}: {self.file} is not a plain file and keeps "
                                       "coming back; remove it, or choose another -o path")
                stale += 1
                remove_stale(self.file, what)
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                holder = _read_pid(fd)
                os.close(fd)
                raise CaptureError(
                    f"another capture{f' (process {holder})' if holder else ''} is writing "
                    f"{self.path} ({self.file} is locked); wait for it to finish, or choose "
                    "another -o path") from None
            if _same_file(fd, self.file):
                self._fd = fd
            else:  # the previous holder removed the file between our open and our lock
                os.close(fd)
        os.ftruncate(self._fd, 0)
        os.write(self._fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            self.file.unlink()  # before unlocking: a waiting writer then re-opens a new file
        os.close(self._fd)
        self._fd = None


def remove_stale(path: Path, what: str) -> None:
    """Remove what a stopped writer (or a planted link) left at ``path``: a file or a symbolic
    link (removing a link never touches its target). ``what`` starts the sentence when it
    cannot be removed."""
    try:
        if stat.S_ISDIR(os.lstat(path).st_mode):
            raise CaptureError(f"{what}: {path} is a directory; remove it, or choose another -o "
                               "path")
        path.unlink()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise CaptureError(f"{what}: {path} is left from an earlier run and cannot be removed "
                           f"({os.strerror(exc.errno or 0)}); remove it, or choose another -o "
                           "path") from exc


def _plain_file(fd: int) -> bool:
    """A regular file with one name: what this lock creates, and nothing else's data."""
    info = os.fstat(fd)
    return stat.S_ISREG(info.st_mode) and info.st_nlink == 1


def _read_pid(fd: int) -> int | None:
    try:
        text = os.pread(fd, 32, 0).decode("ascii", "replace").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.path.samestat(os.fstat(fd), os.stat(path))
    except OSError:
        return False
