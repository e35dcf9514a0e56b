"""layerdiff: find where a ported neural network first computes something different.

Importing ``layerdiff`` does not import torch: ``layerdiff.trace`` (and the diff) need only
h5py and numpy, so a port in another framework or a CI job that compares stored traces can use
them without torch. The torch-facing names load on first use (PEP 562), as the real objects:
``inspect.signature(layerdiff.diff)`` and ``help`` show their parameters, and ``dir(layerdiff)``
lists every public name (``__all__``), loaded or not.

``layerdiff.capture`` and ``layerdiff.replay`` are subpackages and the functions users call:
the packages are callable, with the functions' signatures (see
:mod:`layerdiff.callable_module`), so ``layerdiff.capture(case, path)`` and
``layerdiff.replay(reference, port)`` work whatever was imported first; ``from
layerdiff.capture import capture`` gives the plain function.
"""

from __future__ import annotations

import sys
from importlib import import_module
from typing import Any

from layerdiff.errors import (
    CaptureError,
    CaseError,
    DiffError,
    Interrupted,
    LayerdiffError,
    MappingError,
    OutputError,
    ToleranceError,
    TraceError,
)

__version__ = "0.1.0"

# name -> module that defines it, imported on first access (PEP 562). The attribute is the
# object itself, so ``inspect.signature(layerdiff.diff)`` and ``help`` show the real thing.
_LAZY = {
    "Case": "layerdiff.case",
    "ExternalCase": "layerdiff.case",
    "load_case": "layerdiff.case",
    "seed_everything": "layerdiff.case",
    "run_case": "layerdiff.capture",
    "RunResult": "layerdiff.capture",
    "Trace": "layerdiff.trace",
    "TraceWriter": "layerdiff.trace",
    "open_trace": "layerdiff.trace",
    "Role": "layerdiff.trace.schema",
    "Pass": "layerdiff.trace.schema",
    "diff": "layerdiff.compare",
    "Diff": "layerdiff.compare",
    "Origin": "layerdiff.compare",
    "Tolerance": "layerdiff.compare",
    "Tolerances": "layerdiff.compare",
    "Verdict": "layerdiff.compare.judge",
    "Status": "layerdiff.compare.judge",
    "Mapping": "layerdiff.mapping",
    "load_weights": "layerdiff.weights",
    "WeightsReport": "layerdiff.weights",
    "map_check": "layerdiff.replay.mapcheck",
    "MapCheck": "layerdiff.replay.mapcheck",
    "suggest_mapping": "layerdiff.mapsuggest",
    "MapSuggestion": "layerdiff.mapsuggest",
    "ReplayResult": "layerdiff.replay",
    "swap": "layerdiff.replay",
    "Swapper": "layerdiff.replay",
    "SwapResult": "layerdiff.replay",
    "bisect": "layerdiff.replay",
    "BisectResult": "layerdiff.replay",
    "Session": "layerdiff.replay",
    "render": "layerdiff.report.findings",
    "Monitor": "layerdiff.monitor",
}

# Subpackages that are also their main function (see layerdiff.callable_module): the attribute
# is always the callable package, whatever was imported first.
_CALLABLE_PACKAGES = ("capture", "health", "monitor", "replay")

__all__ = [  # every name in _LAZY and _CALLABLE_PACKAGES, the errors and __version__
    "BisectResult", "CaptureError", "Case", "CaseError", "Diff", "DiffError", "ExternalCase",
    "Interrupted", "LayerdiffError", "MapCheck", "MapSuggestion", "Mapping", "MappingError",
    "Monitor", "Origin", "OutputError", "Pass", "ReplayResult", "Role", "RunResult", "Session",
    "Status", "SwapResult", "Swapper", "Tolerance", "ToleranceError", "Tolerances", "Trace",
    "TraceError", "TraceWriter", "Verdict", "WeightsReport", "__version__", "bisect", "capture",
    "diff", "health", "load_case", "load_weights", "map_check", "monitor", "open_trace", "render",
    "replay", "run_case", "seed_everything", "suggest_mapping", "swap",
]


def __getattr__(name: str) -> Any:
    if name in _CALLABLE_PACKAGES:
        return import_module(f"layerdiff.{name}")
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layerdiff' has no attribute {name!r}")


def __dir__() -> list[str]:
    """The public names, loaded or not, so that tab completion finds ``diff``, ``swap``..."""
    return sorted({*globals(), *__all__})


def _show_in_notebooks() -> None:
    """Have IPython (Jupyter) show a :class:`Diff` as HTML: its verdict, origins and first
    failing rows. Registered by the class's name, so nothing loads until a diff is shown; the
    HTML is :func:`layerdiff.report.findings.diff.notebook_html`'s (compare/ does not import
    report/, so the diff has no ``_repr_html_`` of its own)."""
    ipython = sys.modules.get("IPython")  # already loaded in a notebook; never imported here
    shell = getattr(ipython, "get_ipython", lambda: None)() if ipython is not None else None
    if shell is None:
        return
    html = shell.display_formatter.formatters["text/html"]
    html.for_type_by_name("layerdiff.compare.result", "Diff", _notebook_html)


def _notebook_html(diff: Any) -> str:
    from layerdiff.report.findings.diff import notebook_html

    return notebook_html(diff)


_show_in_notebooks()
