"""layerdiff: find where a ported neural network first computes something different.

Importing ``layerdiff`` does not import torch: ``layerdiff.trace`` (and the diff) need only
h5py and numpy, so a port in another framework or a CI job that compares stored traces can use
them without torch. The torch-facing names load on first use.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

from layerdiff.errors import (
    CaptureError,
    CaseError,
    DiffError,
    LayerdiffError,
    MappingError,
    ToleranceError,
    TraceError,
)

__version__ = "0.1.0"

# name -> module that defines it, imported on first access (PEP 562).
_LAZY = {
    "Case": "layerdiff.case",
    "ExternalCase": "layerdiff.case",
    "load_case": "layerdiff.case",
    "seed_everything": "layerdiff.case",
    "run_case": "layerdiff.capture",
    "TraceWriter": "layerdiff.trace",
    "diff": "layerdiff.compare",
    "Diff": "layerdiff.compare",
    "Mapping": "layerdiff.compare",
    "Tolerances": "layerdiff.compare",
    "load_weights": "layerdiff.weights",
    "map_check": "layerdiff.mapcheck",
    "replay": "layerdiff.replay",
    "swap": "layerdiff.replay",
    "bisect": "layerdiff.replay",
    "Session": "layerdiff.replay",
    "open_trace": "layerdiff.trace",
}

__all__ = [
    "CaptureError", "Case", "CaseError", "Diff", "DiffError", "ExternalCase", "LayerdiffError",
    "Mapping", "MappingError", "Session", "ToleranceError", "Tolerances", "TraceError",
    "TraceWriter", "__version__", "bisect", "capture", "diff", "load_case", "load_weights",
    "map_check",
    "open_trace", "replay", "run_case", "seed_everything", "swap",
]


def __getattr__(name: str) -> Any:
    if name == "capture":
        return import_module("layerdiff.capture")
    if name in _LAZY:
        return getattr(import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'layerdiff' has no attribute {name!r}")
