"""The text of every result type: ``render(result) -> str``, one module per family.

Results are data (``as_json``, ``__bool__`` is the verdict); their words live here, so a
producer below ``report/`` never writes text for people and every command writes numbers,
widths and clipping the same way (:mod:`layerdiff.report.text`).

``render`` finds the function by the result's class and imports its family's module only
then: rendering a diff must not import torch (the diagnostics' modules do), since a diff of
two stored traces needs h5py and numpy alone.
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

# the result's class (module.qualname) -> (findings module, function)
_RENDERERS: dict[str, tuple[str, str]] = {
    "layerdiff.compare.result.Diff": ("layerdiff.report.terminal", "format_diff"),
    "layerdiff.compare.result.Origin": (".diff", "describe_origin"),
    "layerdiff.ci.check.CheckResult": (".diff", "check_line"),
    "layerdiff.compare.ranks.RanksResult": (".ranks", "ranks_text"),
    "layerdiff.debug.nan.NanResult": (".debug", "nan_text"),
    "layerdiff.debug.diverge.DivergeResult": (".debug", "diverge_text"),
    "layerdiff.debug.batch.BatchResult": (".debug", "batch_text"),
    "layerdiff.debug.batch.Mixing": (".debug", "describe_mixing"),
    "layerdiff.debug.determinism.DeterminismResult": (".debug", "determinism_text"),
    "layerdiff.health.result.HealthResult": (".health", "health_text"),
    "layerdiff.debug.optimizer_update.UpdateEvidence": (".debug", "update_text"),
    "layerdiff.replay.mapcheck.MapCheck": (".replay", "mapcheck_text"),
    "layerdiff.replay.replay.ReplayResult": ("layerdiff.report.terminal", "format_replay"),
    "layerdiff.replay.swap.SwapResult": ("layerdiff.report.terminal", "format_swap"),
    "layerdiff.replay.bisect.BisectResult": ("layerdiff.report.terminal", "format_bisect"),
    "layerdiff.mapsuggest.result.MapSuggestion": (".other", "mapsuggest_text"),
    "layerdiff.weights.WeightsReport": (".other", "weights_text"),
}


def render(result: Any) -> str:
    """The text a person reads for ``result`` (any result type of layerdiff), fitted to the
    terminal's width. Raises TypeError for a type with no text."""
    for cls in type(result).__mro__:
        found = _RENDERERS.get(f"{cls.__module__}.{cls.__qualname__}")
        if found is not None:
            module, function = found
            return str(getattr(import_module(module, __name__), function)(result))
    raise TypeError(f"layerdiff has no text for a {type(result).__name__}")


__all__ = ["render"]
