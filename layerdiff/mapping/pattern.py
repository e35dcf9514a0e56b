"""Name patterns in mapping files: a glob whose ``*`` captures, or a regular expression."""

from __future__ import annotations

import re


class Pattern:
    """A glob (``*`` captures) or a regular expression, matched against a whole name."""

    def __init__(self, text: str, *, regex: bool = False) -> None:
        self.text = text
        self.regex = regex
        source = text if regex else "".join(
            "(.*)" if part == "*" else re.escape(part) for part in re.split(r"(\*)", text))
        self._compiled = re.compile(source)

    @property
    def groups(self) -> int:
        return self._compiled.groups

    def match(self, name: str) -> tuple[str, ...] | None:
        found = self._compiled.fullmatch(name)
        return None if found is None else found.groups()

    def fill(self, template: str, groups: tuple[str, ...]) -> str:
        """The template with this pattern's captures put in (``*`` in order, or ``\\1``); a
        template without any names one fixed thing."""
        if self.regex:
            return re.sub(r"\\(\d+)", lambda m: groups[int(m.group(1)) - 1], template)
        if "*" not in template:
            return template
        parts = template.split("*")
        if len(parts) - 1 != len(groups):
            raise ValueError(f"'{template}' has {len(parts) - 1} '*' for {len(groups)} captures")
        return "".join(p + g for p, g in zip(parts, [*groups, ""], strict=True))

