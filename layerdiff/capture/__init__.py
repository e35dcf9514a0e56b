"""Capture: record a run of a case into a trace (torch's hooks here; other frameworks' through
:mod:`layerdiff.framework`).

``layerdiff.capture`` is both this package and the function users call
(``layerdiff.capture(case, path)``): the module is callable, with the function's signature (see
:mod:`layerdiff.callable_module`), so that both spellings work.
"""

from layerdiff.callable_module import make_callable
from layerdiff.capture.entry import capture
from layerdiff.capture.run import RunResult, run_case

__all__ = ["RunResult", "capture", "run_case"]

make_callable(__name__, capture)
