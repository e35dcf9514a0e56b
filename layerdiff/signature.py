"""A layer's call signature as plain data: what capture records and what replay binds against.

Capture writes each module type's ``forward`` signature into the trace's meta (``signatures``)
so that replay and swap, which see only the recorded call, know which of the reference's
arguments were parameters with defaults. Defaults are kept as JSON text (``"null"``,
``"false"``, ``"1e-05"``) so that reading a trace never builds an object; a default that is
not plain data is kept as "has a default, unknown value". Pure Python: capture, replay and
non-torch ports all use it.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerdiff.errors import DiffError

KINDS = ("positional_only", "positional", "keyword_only", "var_positional", "var_keyword")
POSITIONAL = ("positional_only", "positional")
VARIADIC = ("var_positional", "var_keyword")

_KIND_OF = {
    inspect.Parameter.POSITIONAL_ONLY: "positional_only",
    inspect.Parameter.POSITIONAL_OR_KEYWORD: "positional",
    inspect.Parameter.KEYWORD_ONLY: "keyword_only",
    inspect.Parameter.VAR_POSITIONAL: "var_positional",
    inspect.Parameter.VAR_KEYWORD: "var_keyword",
}


def json_text(value: Any) -> str | None:
    """``value`` as JSON text, or None when it is not plain data (NaN included: not JSON)."""
    try:
        return json.dumps(value, allow_nan=False)
    except (TypeError, ValueError, RecursionError):
        return None


@dataclass(frozen=True)
class Parameter:
    """One parameter: its name, kind (one of ``KINDS``) and default as JSON text."""

    name: str
    kind: str
    has_default: bool
    default: str | None  # JSON text; None when there is no default or it is not plain data

    @property
    def positional(self) -> bool:
        """Whether a positional argument can fill it."""
        return self.kind in POSITIONAL

    @property
    def variadic(self) -> bool:
        return self.kind in VARIADIC

    def describe(self) -> str:
        prefix = {"var_positional": "*", "var_keyword": "**"}.get(self.kind, "")
        if not self.has_default:
            return prefix + self.name
        shown = "..." if self.default is None else repr(json.loads(self.default))
        return f"{self.name}={shown}"


@dataclass(frozen=True)
class Signature:
    """A callable's parameters in order, and a name for messages (``Attention.forward``)."""

    params: tuple[Parameter, ...]
    name: str

    @classmethod
    def of(cls, fn: Callable[..., Any]) -> Signature | None:
        """The signature of ``fn`` (a bound method has lost ``self``), or None when Python
        cannot tell (some builtins and extension functions)."""
        try:
            found = inspect.signature(fn)
        except (TypeError, ValueError):
            return None
        params = tuple(_parameter(p) for p in found.parameters.values())
        return cls(params, _name_of(fn))

    # ---- views replay binds against
    @property
    def positional(self) -> tuple[Parameter, ...]:
        """The parameters a positional argument can fill, in order."""
        return tuple(p for p in self.params if p.positional)

    @property
    def var_positional(self) -> bool:
        return any(p.kind == "var_positional" for p in self.params)

    @property
    def var_keyword(self) -> bool:
        return any(p.kind == "var_keyword" for p in self.params)

    def named(self, name: str) -> Parameter | None:
        """The named (not ``*args``/``**kwargs``) parameter called ``name``."""
        return next((p for p in self.params if p.name == name and not p.variadic), None)

    def describe(self) -> str:
        """``Attention.forward(x, mask=None, *args, **kwargs)``, for messages."""
        parts: list[str] = []
        for number, param in enumerate(self.params):
            if param.kind == "keyword_only" and not any(
                    p.kind in ("keyword_only", "var_positional") for p in self.params[:number]):
                parts.append("*")  # keyword-only parameters after a bare star
            parts.append(param.describe())
            if param.kind == "positional_only" and (
                    number + 1 == len(self.params)
                    or self.params[number + 1].kind != "positional_only"):
                parts.append("/")
        return f"{self.name}({', '.join(parts)})"

    # ---- as stored in a trace's meta
    def as_json(self) -> dict[str, Any]:
        """``{"name": ..., "params": [[name, kind, has_default, default JSON], ...]}``."""
        return {"name": self.name,
                "params": [[p.name, p.kind, p.has_default, p.default] for p in self.params]}

    @classmethod
    def from_json(cls, data: Any, where: str = "a trace's meta") -> Signature:
        """A signature as ``as_json`` wrote it; it comes from a file, so it is checked."""
        if not isinstance(data, dict) or not isinstance(data.get("name"), str) \
                or not isinstance(data.get("params"), list):
            raise DiffError(f"{where}: a signature must be an object with 'name' (a string) and "
                            f"'params' (a list), got {_cut(repr(data))}")
        return cls(tuple(_checked(entry, data["name"], where) for entry in data["params"]),
                   data["name"])


def _parameter(param: inspect.Parameter) -> Parameter:
    has_default = param.default is not inspect.Parameter.empty
    return Parameter(param.name, _KIND_OF[param.kind], has_default,
                     json_text(param.default) if has_default else None)


def _name_of(fn: Callable[..., Any]) -> str:
    """``Class.method`` for a method; a function defined inside another loses the
    ``outer.<locals>.`` part, which says nothing to a user."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) \
        or type(fn).__name__
    return name.rsplit(".<locals>.", 1)[-1]


def _checked(entry: Any, name: str, where: str) -> Parameter:
    """One ``[name, kind, has_default, default]`` entry, or a DiffError saying what is wrong."""
    ok = isinstance(entry, list) and len(entry) == 4 and isinstance(entry[0], str) \
        and entry[1] in KINDS and isinstance(entry[2], bool) \
        and (entry[3] is None or isinstance(entry[3], str))
    if ok and entry[3] is not None:
        try:
            json.loads(entry[3])
        except ValueError:
            ok = False
    if not ok:
        raise DiffError(f"{where}: the signature of {name} has a malformed parameter "
                        f"{_cut(repr(entry))}; each must be [name, kind (one of "
                        f"{', '.join(KINDS)}), has_default (true/false), default JSON text "
                        "or null]")
    return Parameter(entry[0], entry[1], entry[2], entry[3])


def _cut(text: str, size: int = 60) -> str:
    return text if len(text) <= size else text[:size - 3] + "..."
