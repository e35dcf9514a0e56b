"""Name patterns in mapping files: a glob whose ``*`` captures, or a regular expression."""

from __future__ import annotations

import re


class Pattern:
    """A glob (``*`` captures) or a regular expression, matched against a whole name.

    A glob is matched by :func:`glob_captures`, in time linear in the name for each literal
    part, never by a regular expression: a mapping recorded in a trace comes from whoever made
    the trace, and ``(.*)`` per ``*`` backtracks for hours on a pattern like ``****...Z``."""

    def __init__(self, text: str, *, regex: bool = False) -> None:
        self.text = text
        self.regex = regex
        self._parts = text.split("*")
        self._compiled = re.compile(text) if regex else None

    @property
    def groups(self) -> int:
        return self._compiled.groups if self._compiled is not None else len(self._parts) - 1

    def match(self, name: str) -> tuple[str, ...] | None:
        if self._compiled is None:
            return glob_captures(self._parts, name)
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


def glob_captures(parts: list[str], name: str) -> tuple[str, ...] | None:
    """What each ``*`` of the glob ``'*'.join(parts)`` matched in the whole of ``name``, or
    None when it does not match.

    The captures are those of the regular expression with a greedy ``(.*)`` per ``*`` (each
    ``*`` as long as the ones after it allow, adjacent ``**`` giving the first all), found
    without backtracking: the literal parts between stars are placed from the right, each at
    its last occurrence before the next one. That placement is the latest each part can take
    with the later ones still fitting, which is what greedy stars choose in order; one
    ``rfind`` per part, so at most len(name) * len(pattern) steps."""
    if len(parts) == 1:
        return () if name == parts[0] else None
    head, *middle, tail = parts
    end = len(name) - len(tail)
    if end < len(head) or not name.startswith(head) or not name.endswith(tail):
        return None
    starts: list[int] = []
    limit = end
    for literal in reversed(middle):
        at = name.rfind(literal, len(head), limit)
        if at < 0:
            return None
        starts.append(at)
        limit = at
    starts.reverse()
    captures, position = [], len(head)
    for literal, at in zip(middle, starts, strict=True):
        captures.append(name[position:at])
        position = at + len(literal)
    captures.append(name[position:end])
    return tuple(captures)
