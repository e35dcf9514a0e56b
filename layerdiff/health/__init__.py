"""Training health of one case: the practitioners' trainability checklist as one call,
``layerdiff.health(case)`` (this package is callable, as ``layerdiff.capture`` is).

One module per family of checks (``loss``: initial-loss and overfit; ``norms``: gradient-flow
and update-ratio; ``units``: dead-units; ``reused``: nonfinite, batch-independence and
determinism through the debug commands' functions), the shared instrumented run
(``record``), the result types (``result``) and the runner (``runner``). docs/health.md names
every threshold and why.
"""

from layerdiff.callable_module import make_callable
from layerdiff.health.result import CHECKS, Check, HealthResult, Verdict
from layerdiff.health.runner import health

__all__ = ["CHECKS", "Check", "HealthResult", "Verdict", "health"]

make_callable(__name__, health)
