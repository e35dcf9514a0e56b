"""The draft as data: its rules with their evidence and confidence, and its TOML text (the
file it writes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

UNSURE_BELOW = 0.5      # a guess with less confidence than this is marked UNSURE


@dataclass
class Suggestion:
    """One drafted rule: what it pairs, how sure, and the evidence."""

    kind: str                  # site | pair | param | unmatched-reference | unmatched-port |
    #                            unmatched-output (args: {"output": its path})
    reference: list[str]
    port: list[str]
    confidence: float
    evidence: list[str]
    transform: tuple[str, ...] = ("copy",)
    args: dict[str, str] = field(default_factory=dict)
    axis: int = 0
    adapter: str = ""          # site: why its call needs a call adapter (none when empty)
    outputs: dict[str, str] = field(default_factory=dict)  # site: reference -> port output

    @property
    def unsure(self) -> bool:
        return self.confidence < UNSURE_BELOW

    def as_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "reference": list(self.reference), "port": list(self.port),
                "confidence": round(self.confidence, 3), "unsure": self.unsure,
                "evidence": list(self.evidence), "transform": list(self.transform),
                "axis": self.axis, "args": dict(self.args), "adapter": self.adapter or None,
                "outputs": dict(self.outputs)}


@dataclass
class MapSuggestion:
    """The draft: its TOML text and the rules with their evidence. True when every port
    tensor got a source."""

    reference: str
    port: str
    text: str
    suggestions: list[Suggestion]
    tensor_sources: dict[str, list[str]]     # port tensor -> reference tensors the draft gives
    without_source: list[str]                # port tensors nothing in the draft gives

    def __bool__(self) -> bool:
        return not self.without_source

    @property
    def unsure(self) -> list[Suggestion]:
        return [s for s in self.suggestions if s.unsure]

    def as_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "port": self.port, "text": self.text,
                "suggestions": [s.as_json() for s in self.suggestions],
                "tensor_sources": self.tensor_sources, "without_source": self.without_source}

    def next_command(self, mapping_path: str, port_spec: str) -> str:
        return f"layerdiff map-check {self.reference} {port_spec} --map {mapping_path}"
