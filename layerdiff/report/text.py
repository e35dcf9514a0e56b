"""The terminal's text kit, one copy: the width every command's text fits, how a number is
written, and how a line too long for the width is cut or wrapped.

Every renderer of results in text (findings, the diff table, show, map-check) uses these, so a
number reads the same in every command and no line passes 100 columns.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable

WIDTH = 100
ELLIPSIS = "…"


def number(value: float | None, digits: int = 4, *, missing: str = "-",
           nan: str | None = None) -> str:
    """`digits` significant digits; ±inf as 'inf'/'-inf'; None as `missing`, NaN as `nan`
    (`missing` unless given: a loss that is NaN says so, a cell with no value does not)."""
    if value is None:
        return missing
    value = float(value)
    if math.isnan(value):
        return missing if nan is None else nan
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    return f"{value:.{digits}g}"


def clip(text: str, width: int = WIDTH) -> str:
    """The start of a sentence too long for the width: its start says what it is."""
    return text if len(text) <= width else text[: width - 1] + ELLIPSIS


def clip_left(text: str, width: int = WIDTH) -> str:
    """The end of a long site or parameter name, which says most: '…layers.3.attn.w_q'."""
    return text if len(text) <= width else ELLIPSIS + text[len(text) - width + 1:]


def clip_middle(text: str, width: int = WIDTH) -> str:
    """Both ends of a long line, for lines whose start and end both matter."""
    if len(text) <= width:
        return text
    keep = width - 1
    return text[: keep // 2] + ELLIPSIS + text[len(text) - (keep - keep // 2):]


def wrap(text: str, width: int = WIDTH, indent: str = "", hanging: str | None = None) -> list[str]:
    """`text` as lines of at most `width`; the lines after the first indented by `hanging`
    (two spaces more than `indent` unless given)."""
    follow = indent + "  " if hanging is None else hanging
    return textwrap.wrap(text, width, initial_indent=indent, subsequent_indent=follow) or [indent]


def wrap_lines(lines: Iterable[str], width: int = WIDTH) -> list[str]:
    """Each line wrapped to the width, its continuation indented two spaces."""
    out: list[str] = []
    for line in lines:
        out.extend(textwrap.wrap(line, width, subsequent_indent="  ") or [""])
    return out


def shape(dims: Iterable[int]) -> str:
    """(4,16,64): a tensor's shape as the trace index writes it."""
    return "(" + ",".join(str(d) for d in dims) + ")"


def ranges(indices: list[int]) -> str:
    """[1, 2, 3, 7] -> '1-3, 7'."""
    parts, start = [], None
    for i, value in enumerate(indices):
        if start is None:
            start = value
        if i + 1 == len(indices) or indices[i + 1] != value + 1:
            parts.append(str(start) if start == value else f"{start}-{value}")
            start = None
    return ", ".join(parts)


__all__ = ["ELLIPSIS", "WIDTH", "clip", "clip_left", "clip_middle", "number", "ranges", "shape",
           "wrap", "wrap_lines"]
