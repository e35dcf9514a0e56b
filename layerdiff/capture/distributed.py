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
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from layerdiff.capture.port import capture_port, interrupt_names_partial
from layerdiff.errors import CaptureError
from layerdiff.trace.manifest import rank_path, write_manifest

# How long ranks wait for each other at the end of a capture: longer than any file close.
BARRIER_TIMEOUT = timedelta(minutes=10)


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

    Raises :class:`Interrupted` on Ctrl-C, naming what was recorded."""
    with interrupt_names_partial(output):
        if nproc is None:
            found = launched_world()
            if found is None:
                raise CaptureError("capture_ranks needs --nproc or a torchrun launch")
            rank, world = found
            return _rank_main(rank, world, case, str(output), options, own_group=True)
        return _spawn(nproc, case, output, options)


def _spawn(nproc: int, case: str, output: str | os.PathLike, options: dict[str, Any]) -> Path:
    import torch.multiprocessing as mp

    port = _free_port()
    with tempfile.TemporaryDirectory(prefix="layerdiff-ranks-") as failures:
        context = mp.start_processes(_spawned, args=(nproc, port, case, str(output), options,
                                                     failures),
                                     nprocs=nproc, join=False, start_method="spawn")
        try:
            while not context.join():
                pass
        except mp.ProcessRaisedException as exc:
            # the rank that failed first: the others fail after it, on its closed connections,
            # and whichever the join sees first is a race
            rank, said = _first_failure(failures) or (exc.error_index, _last_line(str(exc)))
            raise CaptureError(f"capture of {output} with --nproc {nproc}: rank {rank} failed "
                               f"({said}); no manifest was published") from None
        except mp.ProcessExitedException as exc:
            raise CaptureError(f"capture of {output} with --nproc {nproc}: rank "
                               f"{exc.error_index} died (exit {exc.exit_code}); no manifest was "
                               "published") from None
    return Path(output)


def _spawned(rank: int, world: int, port: int, case: str, output: str,
             options: dict[str, Any], failures: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        _rank_main(rank, world, case, output, options, own_group=True, backend="gloo")
    except BaseException as exc:
        with contextlib.suppress(OSError):  # when this rank failed, and how, for _spawn
            Path(failures, str(rank)).write_text(
                f"{time.time_ns()}\n{_last_line(f'{type(exc).__name__}: {exc}')}",
                encoding="utf-8")
        raise


def _first_failure(folder: str) -> tuple[int, str] | None:
    """(rank, its error's last line) of the rank whose failure came first, if any said."""
    found = []
    for path in Path(folder).iterdir():
        with contextlib.suppress(OSError, ValueError):
            when, _, said = path.read_text(encoding="utf-8").partition("\n")
            found.append((int(when), int(path.name), said))
    return min(found)[1:] if found else None


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
