"""Statistics of a user's own training loop, cheap enough to leave on (see docs/monitor.md).

``layerdiff.monitor`` is both this package and the function users call
(``with layerdiff.monitor(model, "run.h5") as m:``): the package is callable, as
``layerdiff.capture`` is (see :mod:`layerdiff.callable_module`).
"""

from layerdiff.callable_module import make_callable
from layerdiff.monitor.session import Monitor, monitor

__all__ = ["Monitor", "monitor"]

make_callable(__name__, monitor)
