"""The monitor's window of steps, written as one trace through the trace's own recorder.

Statistics go in as the index rows of a summary trace (the row's ``segment`` is -1); a marked
step's tensors go through the recorder's ring as a capture's do, so the file is a summary trace
when no step in it is marked and, when one is, a trace whose other records hold statistics
only, as ``capture --full-around`` writes. Written under a temporary name and published at the
end, or left ``.partial`` (refused unless asked) when the run did not finish.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from layerdiff.monitor.steps import StepRecord
from layerdiff.monitor.tensor_stats import resolve
from layerdiff.trace.recorder import Recorder


def write_steps(path: Path, steps: Iterable[StepRecord], meta: dict[str, Any], *,
                complete: bool, queue_bytes: int = 64 * 2**20) -> Path:
    """Write ``steps`` in order; returns the path written (``.partial`` unless complete)."""
    steps = list(steps)
    full = any(record.full for record in steps)
    recorder = Recorder(path, {**meta, "summary": not full}, summary=not full,
                        queue_bytes=queue_bytes)
    try:
        for record in steps:
            _write_step(recorder, record)
            recorder.checkpoint()
    except BaseException:
        recorder.close(complete=False)
        raise
    return recorder.close(complete)


def _write_step(recorder: Recorder, record: StepRecord) -> None:
    base = recorder.seq
    for pass_, site, role, arg, slot, dtype, shape, data in record.records:
        if data is None:
            recorder.submit(record.step, pass_, site, role, arg, dtype, shape,
                            stats=resolve(record.stats[slot]))
        else:  # a marked step: the bytes too; the recorder takes their statistics and digest
            _stage(recorder, record.step, pass_, site, role, arg, dtype, shape, data)
    for row in record.sites:
        recorder.submit_site({
            "step": record.step, "site": row["site"], "module": row["module"],
            "call": row["call"], "type": row["type"], "parent": row["parent"],
            "enter_seq": base + row["enter"],
            "exit_seq": base + row["exit"] if row["exit"] >= 0 else -1})


def _stage(recorder: Recorder, step: int, pass_: str, site: str, role: str, arg: str,
           dtype: str, shape: tuple[int, ...], data: np.ndarray) -> None:
    raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
    if raw.size > recorder.max_staged:
        recorder.submit(step, pass_, site, role, arg, dtype, shape, nbytes=raw.size,
                        array=raw)
        return
    offset = recorder.reserve(raw.size)
    recorder.ring.buffer[offset:offset + raw.size] = raw
    recorder.submit(step, pass_, site, role, arg, dtype, shape, offset=offset,
                    nbytes=raw.size)
