"""Code a mapping names: a conversion (``transform = "pkg.module:function"``) or a call adapter
(``call = "pkg.module:function"``).

A mapping that names code runs it, with the same trust as a case file; reading a mapping
imports nothing (a name is only checked for its form). The code is imported when a load, a
diff, a replay or a swap first needs it, and a trace records each name with a digest of its
module's source, so a report can say which version of a conversion made the port's weights.
"""

from __future__ import annotations

import hashlib
import inspect
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from layerdiff import bundled
from layerdiff.errors import MappingError

_FORM = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


def is_code(name: str) -> bool:
    """Whether ``name`` has the form of a code reference, ``package.module:function``."""
    return _FORM.fullmatch(name) is not None


@dataclass(frozen=True)
class CodeRef:
    """``package.module:function`` named by a mapping rule (``where``: the file and line)."""

    spec: str
    where: str = "mapping"

    @property
    def module_name(self) -> str:
        return self.spec.partition(":")[0]

    @property
    def attribute(self) -> str:
        return self.spec.partition(":")[2]

    def resolve(self) -> Callable[..., Any]:
        """The function, imported now; a module that does not import, a missing name or a
        thing that cannot be called is refused in one sentence naming the rule."""
        if os.getcwd() not in sys.path and "" not in sys.path:
            sys.path.insert(0, os.getcwd())  # as for cases: code in the working directory imports
        try:
            module = bundled.import_module(self.module_name)
        except Exception as exc:
            raise MappingError(f"{self.where}: {self.spec!r}: module {self.module_name!r} does "
                               f"not import ({type(exc).__name__}: {exc}); check the name and "
                               "that it is on PYTHONPATH") from None
        target: Any = module
        for part in self.attribute.split("."):
            target = getattr(target, part, None)
            if target is None:
                names = sorted(n for n in vars(module) if not n.startswith("_")
                               and callable(getattr(module, n)))
                raise MappingError(f"{self.where}: {self.spec!r}: module {self.module_name!r} "
                                   f"has no {self.attribute!r}; it defines "
                                   f"{', '.join(names[:10]) or 'no functions'}")
        if not callable(target):
            raise MappingError(f"{self.where}: {self.spec!r} is a {type(target).__name__}, "
                               "not a function")
        return target

    def source_digest(self) -> str:
        """sha256 of the source of the module that holds the function ('' when it has none)."""
        module = bundled.import_module(self.module_name)
        try:
            source = inspect.getsource(module)
        except (OSError, TypeError):
            return ""
        return hashlib.sha256(source.encode()).hexdigest()

    def provenance(self) -> dict[str, str]:
        """What a trace records of it: the name and its module's source digest."""
        return {"function": self.spec, "source_sha256": self.source_digest()}
