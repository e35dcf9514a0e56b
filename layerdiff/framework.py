"""The one door through which layerdiff reaches a port's framework.

A framework -- torch, Flax, a port that records itself -- implements :class:`Framework`: the
few things the stages need of it. Capture, replay, swap, map-suggest and map-check ask
``framework_of(case)`` once and talk to what it returns; none of them names a framework.

Adding a framework is one entry in ``_FRAMEWORKS`` below (its name and the module that
implements the interface) and that module, under ``layerdiff/frameworks/`` (see
docs/adding-a-framework.md), whose ``owns`` recognises its models without importing the
framework. The implementing modules import no framework at module level, so asking them costs
nothing and a torch user never loads JAX.

This is the one place a lower floor reaches a higher one: by the implementing module's name,
as a plug-in is found, not by an import.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Protocol

from layerdiff.errors import CaseError

if TYPE_CHECKING:  # names for the signatures only: nothing here imports them at run time
    import os
    from pathlib import Path


class Framework(Protocol):
    """What a framework gives the stages. ``case`` is the user's case object, whatever its
    framework; ``trace`` a reference trace (a path or a :class:`~layerdiff.trace.Trace`);
    ``mapping`` a mapping file, a loaded mapping, or None."""

    name: str  # "torch", "flax", "external": recorded in a trace's meta
    title: str  # how a refusal names such a case: "a Flax model"
    # True for a port that runs and records itself: layerdiff neither runs its model nor sets
    # its weights, and a tool that must (diverge's optimizer rerun, a swap host) leaves it out
    records_itself: bool

    def owns(self, case: Any) -> bool:
        """Whether ``case`` (a case, or a bare model) is this framework's, without importing
        the framework: a module that is not yet imported cannot have made the model."""

    def check_case(self, case: Any) -> None:
        """Refuse, in one sentence, a case this framework cannot run (when it is made)."""

    def cast(self, case: Any, dtype: str) -> None:
        """Cast the model's floating weights and the case's floating inputs to ``dtype``."""

    def load_weights(self, case: Any, trace: str | os.PathLike, mapping: Any) -> Any:
        """Set the model's weights from a reference trace through ``mapping``; returns a
        :class:`~layerdiff.weights.WeightsReport`."""

    def capture(self, case: Any, path: str | os.PathLike, options: Any) -> Path:
        """Run the case with every selected call recorded into a trace at ``path``
        (``options``: a :class:`~layerdiff.options.CaptureOptions`); returns the path."""

    def replay_port(self, case: Any, reference: Any, mapping: Any) -> Any:
        """The port, weights loaded from ``reference`` (a Trace), as replay calls it: one
        layer at a time on recorded arguments (:class:`~layerdiff.replay.calling.PortBackend`)."""

    def port_model(self, case: Any, command: str) -> Any:
        """What map-suggest and map-check need of the port model (its module paths, tensors,
        one module run on a recorded call): see :mod:`layerdiff.replay.ports`. ``command``
        names the tool in a refusal."""

    def as_array(self, tensor: Any) -> Any:
        """A recorded tensor (a torch tensor) as this framework's own array, for the call
        adapters of a mapping, which rebuild a port layer's arguments."""

    def run_checked(self, case: Any, writer: Any, steps: int) -> None:
        """Run the case's ``steps`` training steps with every record sent to ``writer``, a
        stand-in for a :class:`~layerdiff.trace.TraceWriter` that checks each value as it
        arrives (``layerdiff nan``); what ``writer`` raises goes up unchanged. A model is
        trained in place and left where the run stopped. (Torch cases are hooked by nan
        itself.)"""

    def nan_op(self, case: Any, result: Any) -> Any:
        """The operation and source line that made ``result``'s first NaN (a
        :class:`~layerdiff.debug.nan.NanResult`), by re-running its origin's one call, or
        None where the framework cannot re-run a call (its note then says so)."""

    def swap_donor(self, case: Any) -> Any:
        """How its layers run inside a torch reference for swap and bisect: None where they
        go in as they are (torch modules; a self-recording port's per-site callables), else an
        object with ``module_paths``, ``observe``, ``leaf_paths``, ``load_arrays`` and
        ``layer`` (see :class:`layerdiff.flax.in_torch.FlaxDonor`)."""


# name -> the module implementing it, asked in this order whether a case's model is its own
# (``owns``: by ``sys.modules``, importing nothing; the modules themselves import no framework
# at module level). The last takes a case with no model that runs and records itself.
_FRAMEWORKS: dict[str, str] = {
    "torch": "layerdiff.frameworks.torch",
    "flax": "layerdiff.frameworks.flax",
    "external": "layerdiff.frameworks.external",
}


def framework_of(case: Any) -> Framework:
    """The framework of ``case`` (a Case, an ExternalCase, or a bare model), or a
    :class:`CaseError` naming what the model is when no framework takes it."""
    for module in _FRAMEWORKS.values():
        framework = _implementation(module)
        if framework.owns(case):
            return framework
    model = getattr(case, "model", case)
    name = getattr(case, "name", "") or "?"
    known = ", ".join(name for name in _FRAMEWORKS if name != "external")
    raise CaseError(f"case {name}: its model is a {type(model).__name__}, which no framework "
                    f"layerdiff knows takes ({known}); give a torch.nn.Module or a Flax "
                    "module, or an ExternalCase that records itself")


def framework_named(name: str) -> Framework:
    """The framework a trace's meta names (``"torch"`` where it names none)."""
    if name not in _FRAMEWORKS:
        raise CaseError(f"a trace names framework {name!r}, which this layerdiff does not know "
                        f"({', '.join(_FRAMEWORKS)}); read it with the layerdiff that made it")
    return _implementation(_FRAMEWORKS[name])


def _implementation(module: str) -> Framework:
    return importlib.import_module(module).FRAMEWORK
