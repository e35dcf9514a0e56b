"""Names from a trace made safe to print: control characters written as visible escapes.

A trace comes from whoever made it; a site named ``"\\x1b[2J"`` printed raw clears the user's
terminal, and other escape sequences can retitle it, hide text or fake lines. Every C0
control (newline and tab included: a name is one line), DEL and every C1 control becomes
``\\xNN`` (``\\x1b[2J``), which no terminal interprets.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_BUT_LINES = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")  # keeps \t and \n


def visible(text: str) -> str:
    """``text`` with each control character as ``\\xNN``."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def visible_lines(text: str) -> str:
    """``text`` with each control character but newline and tab as ``\\xNN``: for messages
    whose own lines are meant, that may quote a name from a trace."""
    return _CONTROL_BUT_LINES.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


def make_visible(table: pd.DataFrame, columns: tuple[str, ...]) -> None:
    """:func:`visible` applied to columns of names, in place. A column none of whose distinct
    names holds a control character (every trace layerdiff wrote) is left as it is: the cost
    is one look at each distinct name."""
    for column in columns:
        names = table[column].unique()
        if any(isinstance(n, str) and _CONTROL.search(n) for n in names):
            table[column] = table[column].map(lambda n: visible(n) if isinstance(n, str) else n)


def printable(format_text: Callable[..., str]) -> Callable[..., str]:
    """A report's text with no control character but its own newlines: names are made
    visible as a trace is read, and this catches what else a trace's meta put in (a mapping's
    name, a case, a warning quoting either), so no escape sequence reaches a terminal."""
    @functools.wraps(format_text)
    def format_printable(*args, **kwargs) -> str:
        return visible_lines(format_text(*args, **kwargs))
    return format_printable
