"""The bundled reference models, ports and planted bugs, under either of their two names.

In a source checkout they are the top-level folder ``reference_models/``, and every case,
mapping and document names them so (``reference_models.transformer:reference``). An installed
layerdiff must not claim a name that generic in its users' environments (their own
``reference_models`` package would shadow it, or be shadowed), so the package ships them as
``layerdiff.reference_models``. :func:`import_module` takes the checkout's name and imports
whichever is there: the top-level module when it exists (a checkout, or a user's own package of
that name, which then wins: they typed it), else the installed one.
"""

from __future__ import annotations

import importlib
from types import ModuleType

NAME = "reference_models"
INSTALLED = "layerdiff.reference_models"


def import_module(name: str) -> ModuleType:
    """``importlib.import_module(name)``, with ``reference_models.X`` falling back to the
    installed ``layerdiff.reference_models.X`` when the top-level package or its module ``X``
    is not there; the first error is raised when neither imports."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if not _names_bundled(name) or not (exc.name and _names_bundled(exc.name)):
            raise
        installed = INSTALLED + name[len(NAME):]
        try:
            return importlib.import_module(installed)
        except ModuleNotFoundError:
            raise exc from None


def _names_bundled(name: str) -> bool:
    return name == NAME or name.startswith(NAME + ".")
