"""The text of the small results: a drafted mapping, a weights load."""

from __future__ import annotations

from layerdiff.mapsuggest.result import MapSuggestion
from layerdiff.weights import WeightsReport


def mapsuggest_text(result: MapSuggestion) -> str:
    """The draft itself: its TOML, the evidence in its comments."""
    return result.text


def weights_text(report: WeightsReport) -> str:
    """'loaded 12 port tensors from the reference (cast ...); ...'."""
    return report.summary()


__all__ = ["mapsuggest_text", "weights_text"]
