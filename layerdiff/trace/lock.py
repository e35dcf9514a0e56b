"""One writer per trace path: an exclusive lock taken before the ``.partial`` is created.

Two captures to one path would otherwise both write ``NAME.partial`` and both publish it: one
printed "wrote" over a file that cannot be read. The lock is ``flock`` on ``NAME.lock`` (POSIX;
the kernel releases it when its process dies, so a killed capture never blocks the next), which
holds the writer's process id so the second capture can say who has it. The lock file is removed
when the writer is done; a lock taken on a file that another writer removed meanwhile is taken
again on the new one.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

from layerdiff.errors import CaptureError

try:
    import fcntl
except ImportError:  # Windows: no flock; one writer per path is then the user's to keep
    fcntl = None


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
        while self._fd is None:
            try:
                fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:  # /proc, a read-only or full disk
                raise CaptureError(f"cannot write trace {self.path}: creating {self.file} "
                                   f"failed ({os.strerror(exc.errno or 0)}); choose another -o "
                                   "path") from exc
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
