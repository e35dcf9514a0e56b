"""Child processes a test waits on, started two at a time.

Many tests run a command in a child process of its own and only wait for it: one core waits
while the child works on the other. A module fixture starts such children together, two at a
time, and each test checks its own child's outcome (every case keeps its own process).
"""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

_STARTING = threading.Lock()  # one child forked at a time (preexec_fn runs Python in the child)


def popen(command: list[str], **options: Any) -> subprocess.Popen:
    """subprocess.Popen, one at a time across the threads of :func:`two_at_a_time`."""
    with _STARTING:
        return subprocess.Popen(command, **options)


def finished(command: list[str], timeout: float, **options: Any) -> subprocess.CompletedProcess:
    """subprocess.run(capture_output=True, text=True, timeout=timeout), through :func:`popen`."""
    process = popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                    **options)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def two_at_a_time(jobs: dict[Any, Callable[[], Any]]) -> dict[Any, Future]:
    """Run ``jobs`` (key: a function of no arguments that runs a child process), two at a time,
    to their end; returns their futures by key. A test reads its own with ``.result()``, which
    raises what its job raised."""
    with ThreadPoolExecutor(max_workers=2) as pool:
        return {key: pool.submit(job) for key, job in jobs.items()}


def folders(tmp_path_factory: Any, keys: list, name: str) -> dict[Any, Path]:
    """A new temporary folder for each key."""
    return {key: tmp_path_factory.mktemp(name) for key in keys}


def targets(tmp_path_factory: Any, keys: list, name: str, file: str = "t.h5") -> dict[Any, Path]:
    """For each key, ``file`` in a new temporary folder of its own (not created)."""
    return {key: folder / file for key, folder in folders(tmp_path_factory, keys, name).items()}
