"""Capturing a port with the reference's weights: the workflow behind ``layerdiff capture PORT
--weights-from REFERENCE [--map FILE]``, as one library call.

    from layerdiff.capture.port import capture_port
    capture_port("reference_models.mlp_port:port", "port.h5", weights_from="reference.h5")

The order matters and is kept here once: build the case (under torch.distributed, after the
process group exists, so that it can build its rank's shard), cast it to ``dtype`` (before the
weights, so that loading says what it cast), load the reference's weights through the mapping,
then capture with the weights' provenance (the reference trace, the mapping's text and the code
of its conversions) in the trace's meta, where ``diff`` finds the mapping again.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from layerdiff.case import Case, ExternalCase
from layerdiff.errors import CaptureError, Interrupted
from layerdiff.framework import framework_of
from layerdiff.options import CaptureOptions
from layerdiff.trace.published import file_identity, published_since
from layerdiff.weights import WeightsReport

# Told where the weights came from and what loading them did, before the capture starts.
OnWeights = Callable[[str | os.PathLike, WeightsReport], None]
# Told the published trace and the seconds the capture took (rank 0's only, under ranks).
OnWritten = Callable[[Path, float], None]


def capture_port(case: Case | ExternalCase | str, output: str | os.PathLike,
                 weights_from: str | os.PathLike | None = None,
                 mapping: str | os.PathLike | None = None,
                 options: CaptureOptions | None = None, *,
                 rank: int | None = None, world_size: int | None = None,
                 on_weights: OnWeights | None = None, on_written: OnWritten | None = None,
                 force_routing: str | os.PathLike | None = None,
                 on_forced: Callable[[str], None] | None = None, **given: Any) -> Path:
    """Capture ``case`` into ``output``, with its weights loaded from the reference trace
    ``weights_from`` first (through ``mapping`` where names differ); returns the published path.

    ``case`` is a case or its spec (``package.module:name``, loaded here). ``options`` (a
    :class:`~layerdiff.options.CaptureOptions`, or keywords that make or amend one) are
    :func:`layerdiff.capture.capture`'s; the progress bar is on unless they turn it off.
    ``options.dtype`` casts the model and its inputs before the weights are loaded (a
    baseline). ``rank`` and ``world_size`` are recorded in the trace's meta (one rank's file
    of a multi-rank capture, see :func:`layerdiff.capture.distributed.capture_ranks`); the
    progress display and ``on_written`` are rank 0's only.

    ``force_routing`` is a trace whose recorded mixture-of-experts routes every router of this
    run takes (:mod:`layerdiff.capture.routes`; its routers declared by ``mapping`` or
    detected); ``on_forced`` is told, in one clause, what that changed.

    Raises :class:`CaptureError` for a mapping without ``weights_from`` or a case that records
    itself (layerdiff cannot set its weights), and :class:`Interrupted` on Ctrl-C, naming the
    partial file that holds what was recorded; a Ctrl-C that came once the trace was published
    (while the capture let go of its memory) is a capture that finished.
    """
    from layerdiff.capture import capture
    from layerdiff.case import load_case

    if mapping is not None and weights_from is None:
        raise CaptureError(f"the mapping {mapping} says how to load a reference's weights; "
                           "give the reference trace to load them from as well")
    if options is None:  # a bar by default, as on the command line
        given = {"progress": True, **given}
    options = CaptureOptions.of(options, **given)
    if isinstance(case, str):
        case = load_case(case)
    if options.dtype:  # before the weights, so that loading says what it cast
        framework_of(case).cast(case, options.dtype)
    extra_meta = (_load_reference_weights(case, weights_from, mapping, on_weights)
                  if weights_from else {})
    if rank is not None:
        extra_meta.update(rank=rank, world_size=world_size)
    changes: dict[str, Any] = {"extra_meta": {**options.extra_meta, **extra_meta},
                               "progress": options.progress and not rank}
    if force_routing is not None:
        from layerdiff.capture.routes import forcer_from
        from layerdiff.mapping import Mapping

        changes["force_routing"] = forcer_from(
            force_routing, Mapping.load(mapping) if mapping is not None else None)
    options = replace(options, **changes)
    start = time.perf_counter()
    before = file_identity(output)
    try:
        with interrupt_names_partial(output):
            path = capture(case, output, options)
    except Interrupted:
        if not published_since(output, before):
            raise
        path = Path(output)  # the Ctrl-C came after the publish: the trace is complete
    if not rank and on_written is not None:
        on_written(path, time.perf_counter() - start)
    if on_forced is not None and force_routing is not None:
        from layerdiff.capture.routes import describe

        on_forced(describe(options.force_routing.forced()))
    return path


def _load_reference_weights(case: Case | ExternalCase, trace: str | os.PathLike,
                            mapping: str | os.PathLike | None,
                            on_weights: OnWeights | None) -> dict[str, Any]:
    """Load the weights; returns what the trace's meta records of it (the mapping's text)."""
    from layerdiff.capture.torch_capture import weights_meta
    from layerdiff.weights import conversions_provenance

    report = framework_of(case).load_weights(case, trace, mapping)
    if on_weights is not None:
        on_weights(trace, report)
    meta = weights_meta(trace, mapping)
    if mapping is not None:  # which code made the port's weights, beside the mapping's text
        meta["weights"]["conversions"] = conversions_provenance(mapping)
    return meta


@contextlib.contextmanager
def interrupt_names_partial(output: str | os.PathLike) -> Iterator[None]:
    """Ctrl-C during a capture: an :class:`Interrupted` that says where what was recorded is,
    and how to look at it."""
    from layerdiff.trace.h5file import partial_path

    try:
        yield
    except KeyboardInterrupt:
        partial = partial_path(output)
        left = (f"{partial} holds what was recorded up to there (layerdiff show {partial} "
                "--allow-incomplete)" if partial.exists() else "nothing was recorded yet")
        raise Interrupted(f"interrupted: no trace was published at {output}; {left}") from None
