"""``capture(case, path)``: the one function every command and library call captures through.

It makes the options object once and hands the case to its framework
(:func:`layerdiff.framework.framework_of`): torch's hooks, Flax's taps, or a port that records
itself.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import fields
from pathlib import Path
from typing import Any

from layerdiff.case import load_case
from layerdiff.framework import framework_of
from layerdiff.options import CaptureOptions


def capture(case: Any, path: str | os.PathLike, options: CaptureOptions | None = None,
            **given: Any) -> Path:
    """Run ``case`` (a Case, an ExternalCase, or a spec such as ``"my_models:reference"``)
    with every selected module call recorded into the trace at ``path``.

    ``options`` is a :class:`~layerdiff.options.CaptureOptions`; keywords (``loss_scale=2**20``,
    ``include=["blocks.*"]``) make one, or replace fields of the one given. Records inputs,
    outputs, weights (each step), the gradients arriving at and leaving each call, and weight
    gradients (before the optimizer step). The options:

    - ``include`` / ``exclude``: globs over module paths (``<root>`` is the model itself);
    - ``loss_scale`` multiplies the loss before backward (recorded gradients are amplified;
      training is not); ``steps`` overrides the case's own count;
    - ``summary`` keeps statistics only; ``weights=False`` records no weights;
      ``queue_bytes`` caps the memory that staged tensors may take; ``progress`` shows a bar;
    - ``dtype`` casts the model's floating parameters and buffers and the case's floating
      inputs first; ``autocast`` runs the forward under ``torch.autocast`` in that dtype: both
      are how a baseline is made (the reference run the way a port runs);
    - ``extra_meta`` is recorded in the trace's meta as given (``weights``: where the weights
      came from and the mapping used);
    - ``record_steps``: the only steps recorded (the others run unrecorded), listed in the
      meta as ``recorded_steps``;
    - ``ops``: globs over module paths whose own code is recorded op by op (op sites
      ``<module site>/<op>#<k>``, see :mod:`layerdiff.capture.ops`); ``ops_all`` keeps the
      views and metadata ops skipped by default;
    - ``full_around`` keeps tensor data only for the modules named (paths, globs or sites),
      everything inside them and their ``radius`` nearest siblings on each side; every other
      record keeps its statistics (the second phase of a two-phase capture);
      ``data_modules`` keeps tensor data for exactly the modules named (what a later diff must
      read element by element and no more); with ``full_around``, the two sets are kept
      together;
    - ``force_routing`` (see :func:`layerdiff.capture.routes.forcer_from`) makes every
      router's top-k take the routes another trace recorded; its ``forced()`` says what that
      changed;
    - ``matmul_precision``: JAX's matmul precision during a Flax capture ("float32", pinned
      by default; "default" for the framework's own).

    A framework refuses, in one sentence, the options that do not apply to it (a Flax case
    takes no ``--ops``; a case that records itself no ``--dtype``).

    Returns the published path. Raises :class:`~layerdiff.errors.CaptureError` with a sentence
    for the user when the model raises (naming the site) or the file cannot be written;
    nothing incomplete is ever published under ``path``.
    """
    if isinstance(case, str):  # a spec, 'module:function', as on the command line
        case = load_case(case)
    return framework_of(case).capture(case, path, CaptureOptions.of(options, **given))


def _with_options_signature(function: Any) -> Any:
    """``function(case, path, options=None, **given)`` shown with every capture option as a
    keyword (``help()``, notebooks' completion): the options are ``CaptureOptions``' fields,
    one list kept in one place."""
    head = list(inspect.signature(function).parameters.values())[:-1]  # all but **given
    keywords = [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                  default=f.default_factory() if callable(f.default_factory)
                                  else f.default, annotation=f.type)
                for f in fields(CaptureOptions)]
    function.__signature__ = inspect.Signature(head + keywords)
    return function


_with_options_signature(capture)
