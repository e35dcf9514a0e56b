"""Capture under torch.distributed: one trace per rank, and a manifest published last.

layerdiff has no launcher of its own. Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` in the
environment) every process captures its rank; ``capture --nproc N`` spawns N local processes on
the gloo backend (tests, laptops). Either way the process group is initialised before the case
is built, so a case can read its rank and world size and build its shards.

Each rank writes ``NAME.rank<r>.h5``, a complete trace of its own with ``rank`` and
``world_size`` in its meta. When every rank's file is published, rank 0 writes ``NAME.h5``: a
summary trace with no records whose meta ``manifest`` names the rank files with their table
and meta digests (see :mod:`layerdiff.trace.manifest`). A rank that fails or is killed leaves
no manifest, so nothing incomplete is ever read as the whole run.

The last word of a capture is what is on disk. After a rank fails or Ctrl-C, the files are
looked at: a manifest this capture published that verifies (every rank file present, complete,
the one it names) is a capture that finished, whatever came after; otherwise the sentence names
the rank files that were published and the ``.partial`` files that hold what the others
recorded. A spawned rank starts with SIGINT ignored and handles it once it runs: Ctrl-C while
the ranks start, or into a rank, ends in that one sentence, never in the ranks' tracebacks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

from layerdiff.capture.port import capture_port
from layerdiff.errors import CaptureError, Interrupted, LayerdiffError, interrupt_inside
from layerdiff.trace.manifest import manifest_ranks, rank_path, write_manifest
from layerdiff.trace.published import Identity, file_identity, is_new, published_since

# How long ranks wait for each other at the end of a capture: longer than any file close.
BARRIER_TIMEOUT = timedelta(minutes=10)
# After one rank ended early (failed, interrupted): how long the others have to end on their
# own (they fail on its closed connections), then to stop after a SIGINT, before a SIGKILL.
SETTLE_SECONDS = 3.0
STOP_SECONDS = 15.0
# A spawned rank's exit status when it was interrupted or failed (its note says how).
_RANK_INTERRUPTED = 130
_RANK_FAILED = 2
# The note in the ranks' folder that tells a rank still starting to stop (see _stop).
_STOP = "stop"

def launched_world() -> tuple[int, int] | None:
    """(rank, world size) when this process was started by torchrun with more than one rank."""
    try:
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def capture_ranks(case: str, output: str | os.PathLike, *, nproc: int | None = None,
                  **options: Any) -> Path | None:
    """Capture the case ``case`` (its spec, built on each rank) on every rank with
    :func:`~layerdiff.capture.port.capture_port` (``options`` are its: ``weights_from``,
    ``mapping``, ``dtype``, ``steps``, ...), each rank into ``output``'s rank file, then publish
    the manifest at ``output``; returns its path on rank 0 (the launching process for --nproc),
    None on the other ranks. ``nproc`` None: the ranks torchrun started.

    A rank that failed, or Ctrl-C, after the manifest was published and verifies is a capture
    that finished (its path is returned). Otherwise raises :class:`CaptureError` (a rank
    failed) or :class:`Interrupted` (Ctrl-C), naming the rank files that were published and
    the ``.partial`` files that hold what the other ranks recorded."""
    if nproc is not None:
        return _spawn(nproc, case, output, options)
    found = launched_world()
    if found is None:
        raise CaptureError("capture_ranks needs --nproc or a torchrun launch")
    rank, world = found
    before = _identities(output, world)
    try:
        return _rank_main(rank, world, case, str(output), options, own_group=True)
    except BaseException as exc:
        if rank == 0 and _published(output, before):
            return Path(output)  # what failed came after the publish: the run is on disk
        if _interrupted(exc):
            raise Interrupted(f"interrupted: {_no_manifest(output, world, before)}") from None
        raise


def _spawn(nproc: int, case: str, output: str | os.PathLike, options: dict[str, Any]) -> Path:
    import torch.multiprocessing as mp

    before = _identities(output, nproc)
    port = _free_port()
    spawn = mp.get_context("spawn")
    processes: list[Any] = []
    interrupted = False
    interruptible = signal.getsignal(signal.SIGINT) is not signal.SIG_IGN
    with tempfile.TemporaryDirectory(prefix="layerdiff-ranks-") as notes:
        try:
            for rank in range(nproc):
                process = spawn.Process(target=_spawned, name=f"layerdiff rank {rank}",
                                        args=(rank, nproc, port, case, str(output), options,
                                              notes, os.getpid(), interruptible))
                with _interrupts_ignored_by_children():
                    process.start()
                    processes.append(process)
            ended = _wait(processes)
        except KeyboardInterrupt:
            interrupted, ended = True, None
        except BaseException:  # a rank that cannot be started: the others wait for it in vain
            with _interrupts_hurry(processes):
                _stop(processes, notes)
            raise
        try:
            with _interrupts_hurry(processes):
                return _last_word(output, nproc, processes, notes, before, interrupted, ended)
        except KeyboardInterrupt:  # one that came before the handler was in place
            with _interrupts_hurry(processes):
                return _last_word(output, nproc, processes, notes, before, True, ended)


def _last_word(output: str | os.PathLike, world: int, processes: list[Any], notes: str,
               before: dict[Path, Identity], interrupted: bool, ended: Any) -> Path:
    """Stop the ranks still running (after Ctrl-C, or one that ended early), then return the
    manifest where this capture published one that verifies; raise the sentence otherwise."""
    if interrupted or ended is not None:
        _stop(processes, notes)
    if not interrupted and ended is None:
        return Path(output)  # every rank finished: rank 0 published the manifest
    if _published(output, before):
        return Path(output)  # what failed or was interrupted came after the publish
    return _raise_no_manifest(output, world, before, interrupted, _first_note(notes), ended)


def _raise_no_manifest(output: str | os.PathLike, world: int, before: dict[Path, Identity],
                       interrupted: bool, first: tuple[int, str, str] | None,
                       ended: Any) -> Path:
    """Raise the sentence for a --nproc capture that published no manifest."""
    left = _no_manifest(output, world, before)
    if interrupted:
        raise Interrupted(f"interrupted: {left}")
    if first is not None:
        rank, how, said = first
        if how == "interrupted":
            raise Interrupted(f"interrupted: rank {rank} was interrupted; {left}")
        raise CaptureError(f"capture of {output} with --nproc {world}: rank {rank} failed "
                           f"({said}); {left}")
    code = ended.exitcode
    how = f"signal {_signal_name(-code)}" if code is not None and code < 0 else f"exit {code}"
    raise CaptureError(f"capture of {output} with --nproc {world}: rank "
                       f"{_rank_of(ended)} died ({how}); {left}")


def _spawned(rank: int, world: int, port: int, case: str, output: str,
             options: dict[str, Any], notes: str, parent: int, interruptible: bool) -> None:
    """One spawned rank. It started with SIGINT ignored (an interrupt while Python and torch
    loaded printed each rank's traceback) and handles it from here; a stop that
    :func:`_stop` meant for it meanwhile left a note, read here. How the rank ended is noted
    for :func:`_spawn` (which says it once) and is its exit status, never a traceback."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    code = 0
    try:
        if interruptible and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if hasattr(signal, "pthread_sigmask"):  # a rank may start with it blocked, too
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        _die_with_parent(signal.SIGINT if interruptible else signal.SIGTERM)
        # after the handler is in place: a stop sent before that left its note first
        if Path(notes, _STOP).exists() or os.getppid() != parent:
            raise KeyboardInterrupt
        _rank_main(rank, world, case, output, options, own_group=True, backend="gloo")
    except BaseException as exc:
        _ignore_interrupts()  # its work is over: a second Ctrl-C changes nothing
        how = "interrupted" if _interrupted(exc) else "failed"
        said = str(exc) if isinstance(exc, LayerdiffError) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(OSError):  # when this rank ended, and how, for _spawn
            Path(notes, str(rank)).write_text(f"{time.time_ns()}\n{how}\n{_last_line(said)}",
                                              encoding="utf-8")
        code = _RANK_INTERRUPTED if how == "interrupted" else _RANK_FAILED
    finally:
        _ignore_interrupts()
    sys.stdout.flush()
    if code:
        # A rank that ended early can leave gloo's threads of a collective its peer abandoned
        # still joinable; torch's C++ teardown at interpreter exit then aborts with "terminate
        # called without an active exception" on the terminal. Its file and note are done.
        sys.stderr.flush()
        os._exit(code)


def _interrupted(exc: BaseException) -> bool:
    """Whether an exception is the user's Ctrl-C (as itself, named, or wrapped on its way)."""
    return isinstance(exc, Interrupted) or interrupt_inside(exc) is not None


def _first_note(folder: str) -> tuple[int, str, str] | None:
    """(rank, "interrupted" or "failed", its error's last line) of the rank that ended first,
    if any noted it."""
    found = []
    for path in Path(folder).iterdir():
        with contextlib.suppress(OSError, ValueError):
            when, how, said = path.read_text(encoding="utf-8").split("\n", 2)
            found.append((int(when), int(path.name), how, said))
    return min(found)[1:] if found else None


def _wait(processes: list[Any]) -> Any:
    """Wait for the ranks: None when every one exited 0, else the first that did not."""
    from multiprocessing.connection import wait

    running = {process.sentinel: process for process in processes}
    while running:
        for sentinel in wait(list(running)):
            process = running.pop(sentinel)
            process.join()
            if process.exitcode != 0:
                return process
    return None


def _stop(processes: list[Any], notes: str) -> None:
    """End the ranks still running: at once a note that tells a rank still starting not to
    run; a moment to end on their own (a Ctrl-C at the terminal reached them too; a failed
    rank's peers fail on its closed connections); then SIGINT (each closes its .partial, as
    Ctrl-C does); then SIGKILL."""
    with contextlib.suppress(OSError):
        Path(notes, _STOP).touch()
    for grace, stop in ((SETTLE_SECONDS, None), (STOP_SECONDS, signal.SIGINT)):
        if stop is not None:
            for process in processes:
                if process.is_alive():
                    with contextlib.suppress(OSError):
                        os.kill(process.pid, stop)
        deadline = time.monotonic() + grace
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.kill()
        process.join()


@contextlib.contextmanager
def _interrupts_ignored_by_children() -> Iterator[None]:
    """SIGINT ignored while a rank process is created: that is the disposition a new program
    inherits, so the rank starts with it (see :func:`_spawned`). Blocked in this thread
    meanwhile, so that one which comes to this process is delivered after, not lost."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    masked = hasattr(signal, "pthread_sigmask")
    if masked:
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def _interrupts_hurry(processes: list[Any]) -> Iterator[None]:
    """While the ranks are stopped and the disk is looked at, Ctrl-C (again) kills the ranks
    still running instead of leaving this process with a traceback."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def hurry(signum: int, frame: object) -> None:
        for process in processes:
            with contextlib.suppress(Exception):
                if process.is_alive():
                    process.kill()

    previous = signal.signal(signal.SIGINT, hurry)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _ignore_interrupts() -> None:
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def _die_with_parent(number: int) -> None:
    """Linux: signal ``number`` to this rank when the process that spawned it dies (torch's
    spawn does the same with SIGINT, which closes the rank's .partial; SIGTERM where SIGINT is
    ignored), so a killed capture leaves no rank waiting for its peers."""
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL(None).prctl(1, number)  # PR_SET_PDEATHSIG


def _identities(output: str | os.PathLike, world: int) -> dict[Path, Identity]:
    """The files a capture to ``output`` writes, as they are before it starts."""
    from layerdiff.trace.h5file import partial_path

    paths = [Path(output), *(rank_path(output, rank) for rank in range(world))]
    return {path: file_identity(path) for path in [*paths, *map(partial_path, paths)]}


def _published(output: str | os.PathLike, before: dict[Path, Identity]) -> bool:
    """Whether this capture published the manifest at ``output`` (not the file that was there
    before it, which --force replaces only at the publish) and it verifies."""
    return is_new(output, before[Path(output)]) and manifest_ranks(output) is not None


def _no_manifest(output: str | os.PathLike, world: int, before: dict[Path, Identity]) -> str:
    """That no manifest was published at ``output``, and what this capture did leave: the
    rank files it published, the .partial files that hold what the other ranks recorded."""
    from layerdiff.trace.h5file import partial_path

    published, partial = [], []
    for rank in range(world):
        path = rank_path(output, rank)
        if published_since(path, before[path]):
            published.append(path)
        elif is_new(partial_path(path), before[partial_path(path)]):
            partial.append((rank, partial_path(path)))
    said = [f"no manifest was published at {output}"]
    if published:
        said.append(f"{_listed([str(p) for p in published])} "
                    f"{'was' if len(published) == 1 else 'were'} published")
    if partial:
        ranks = _listed([str(rank) for rank, _ in partial])
        files = _listed([str(path) for _, path in partial])
        said.append(f"{files} {'holds' if len(partial) == 1 else 'hold'} what rank"
                    f"{'' if len(partial) == 1 else 's'} {ranks} recorded up to there "
                    f"(layerdiff show {partial[0][1]} --allow-incomplete)")
    if not published and not partial:
        said.append("no rank recorded anything yet")
    return "; ".join(said)


def _listed(items: list[str]) -> str:
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}"


def _rank_of(process: Any) -> str:
    return process.name.rpartition(" ")[2]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return str(number)


def _rank_main(rank: int, world: int, case: str, output: str, options: dict[str, Any], *,
               own_group: bool, backend: str | None = None) -> Path | None:
    import torch
    import torch.distributed as dist

    started = False
    if own_group and not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=BARRIER_TIMEOUT)
        started = True
    try:
        mine = capture_port(case, rank_path(output, rank), rank=rank, world_size=world,
                            **options)
        # every rank's file is published before the manifest names them
        done = [None] * world
        dist.all_gather_object(done, str(mine))
        published = None
        if rank == 0:
            published = write_manifest(output, [Path(p) for p in done])
        dist.barrier()
        return published
    finally:
        if started:
            dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else text
