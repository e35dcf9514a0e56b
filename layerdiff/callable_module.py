"""Packages that are also their main function: ``layerdiff.capture(...)``,
``layerdiff.replay(...)``.

``layerdiff.capture`` is a subpackage, and Python binds a subpackage to its parent's attribute
as soon as it is imported (by anyone), so a function of the same name cannot stay there
reliably. Instead the package itself is made callable: calling it calls the function, and its
``__signature__`` is the function's, so ``inspect.signature`` and ``help`` show the real
parameters. ``from layerdiff.capture import capture`` gives the plain function.
"""

from __future__ import annotations

import inspect
import sys
import types
from collections.abc import Callable
from typing import Any


class CallableModule(types.ModuleType):
    """A module whose calls go to its ``__call_target__``."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__call_target__(*args, **kwargs)


def make_callable(module_name: str, function: Callable[..., Any]) -> None:
    """Make the (already imported) module ``module_name`` call ``function`` when called."""
    module = sys.modules[module_name]
    module.__class__ = CallableModule
    module.__call_target__ = function
    module.__signature__ = inspect.signature(function)
