"""Torch capture: hooks that record a run of a case into a trace.

``layerdiff.capture`` is both this package and the function users call
(``layerdiff.capture(case, path)``): the module is made callable so that both spellings work.
"""

import sys
import types

from layerdiff.capture.run import RunResult, run_case
from layerdiff.capture.torch_capture import capture

__all__ = ["RunResult", "capture", "run_case"]


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return capture(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
