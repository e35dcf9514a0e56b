"""The Case: everything needed to run a model reproducibly, and how to load one from a spec."""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import math
import os
import pkgutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from layerdiff import bundled
from layerdiff.errors import CaptureError, CaseError
from layerdiff.framework import framework_of
from layerdiff.rng import seed_everything  # noqa: F401  (a case seeds with it: public here too)

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


class CaseBase:
    """What every kind of case is: :func:`is_case` asks for this, never for a kind."""


@dataclass
class Case(CaseBase):
    """A model, its inputs, its loss, and the seed and steps to run it with.

    ``inputs`` is a tuple of positional arguments or a dict of keyword arguments for
    ``model(...)``. ``loss_fn`` takes the model's output and returns a scalar tensor.
    ``optimizer`` builds the optimizer from the parameters; it is required when ``steps > 1``.
    ``clip_grad_norm``, when set, clips the (unscaled) gradients before each optimizer step.

    ``model`` may also be a Flax NNX module (``flax.nnx.Module``): then ``inputs`` are numpy
    or JAX arrays, ``loss_fn`` returns a scalar JAX array, and ``optimizer`` is an optax
    ``GradientTransformation`` (``optax.sgd(0.1)``), not a factory; ``capture`` records it
    through :mod:`layerdiff.flax.capture`. Telling the two apart never imports JAX.
    ``params`` is a Flax Linen module's variables dict (``model.init(...)``'s), which a
    Linen ``model`` needs beside it (:mod:`layerdiff.flax.linen`); None for every other model.
    ``step_context``, when set, makes the context manager each training step's forward, loss
    and backward run in, as the model's own loop runs them (torch's ``loss_parallel``, whose
    backward fails outside it).
    """

    model: nn.Module | Any
    inputs: tuple | dict
    loss_fn: Callable[[Any], Any]
    seed: int = 0
    steps: int = 1
    optimizer: OptimizerFactory | Any | None = None
    clip_grad_norm: float | None = None
    name: str = ""
    params: Any = None
    jit: bool = False  # a Flax model's step (forward and backward) run under jax.jit
    step_context: Callable[[], contextlib.AbstractContextManager] | None = None

    def __post_init__(self) -> None:
        framework_of(self).check_case(self)  # a model no framework takes: refused here
        if not isinstance(self.inputs, (tuple, dict)):
            raise CaseError(f"case {self.name or '?'}: inputs must be a tuple of positional "
                            f"arguments or a dict of keyword arguments, got "
                            f"{type(self.inputs).__name__}")

    @property
    def framework(self) -> str:
        """The name of the model's framework: ``"torch"``, ``"flax"``."""
        return framework_of(self).name

    def call_model(self) -> Any:
        """Run the model's forward on the case's inputs."""
        if isinstance(self.inputs, dict):
            return self.model(**self.inputs)
        return self.model(*self.inputs)


@dataclass
class ExternalCase(CaseBase):
    """A port that is not a torch module (numpy, JAX, a C++ binding): it records itself.

    ``run(writer, steps=..., loss_scale=...)`` runs the port's training steps on the case's
    inputs and records each site into ``writer`` (a :class:`layerdiff.TraceWriter`), calling
    ``writer.step()`` between steps and multiplying its loss gradient by ``loss_scale``.

    ``layers``, optional, maps module paths to per-site callables (``forward`` and
    ``backward``, see :mod:`layerdiff.replay.numpy_replay`), so that replay can run the port's
    layers one by one on the reference's inputs.
    """

    run: Callable[..., None]
    seed: int = 0
    steps: int = 1
    name: str = ""
    layers: dict[str, Any] | None = None


def is_case(value: Any) -> bool:
    """Whether ``value`` is a case: a Case, or an ExternalCase that records itself."""
    return isinstance(value, CaseBase)


def _case_names(module: Any) -> list[str]:
    """What could be a case in ``module``: its own public functions and Case objects."""
    return sorted(name for name, value in vars(module).items() if not name.startswith("_") and (
        is_case(value)
        or (inspect.isfunction(value) and value.__module__ == module.__name__)))


def _close_modules(name: str) -> list[str]:
    """Modules beside the one that failed whose names are close to it (a typo)."""
    parent, _, leaf = name.rpartition(".")
    try:
        where = importlib.import_module(parent).__path__ if parent else None
    except (ImportError, AttributeError):
        return []
    siblings = [info.name for info in pkgutil.iter_modules(where)]
    close = difflib.get_close_matches(leaf, siblings, n=3, cutoff=0.6)
    return [f"{parent}.{found}" if parent else found for found in close]


def _needs_ranks(exc: Exception) -> str:
    """Advice when a case failed for want of a process group (a sharded port's device mesh)."""
    text = str(exc)
    if not any(sign in text for sign in ("RANK expected", "process group has not been "
                                         "initialized", "init_process_group")):
        return ""
    return ("; the case builds a model sharded over torch.distributed ranks: capture it with "
            "--nproc N or under torchrun (replay, swap, bisect, diverge, map-suggest and "
            "map-check run one process and cannot build it; docs/distributed.md)")


def load_case(spec: str) -> Case | ExternalCase:
    """Import ``package.module:attr`` and return the Case it names.

    ``attr`` is a Case, or a callable taking no arguments that returns one.
    """
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CaseError(f"case spec {spec!r} is not of the form package.module:name; "
                        "for example reference_models.transformer:reference")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())  # like `python -m`: cases in the working directory import
    try:
        module = bundled.import_module(module_name)
    except ModuleNotFoundError as exc:
        close = _close_modules(module_name) if exc.name == module_name else []
        raise CaseError(f"case spec {spec!r}: module {module_name!r} does not import "
                        f"({exc}); "
                        + (f"did you mean {' or '.join(close)}?" if close else
                           "check the spelling and that it is on PYTHONPATH")) from exc
    except Exception as exc:
        raise CaseError(f"case spec {spec!r}: importing {module_name!r} raised "
                        f"{type(exc).__name__}: {exc}") from exc
    try:
        target = getattr(module, attr)
    except AttributeError:
        names = _case_names(module)
        close = difflib.get_close_matches(attr, names, n=3, cutoff=0.5)
        ordered = close + [name for name in names if name not in close]
        raise CaseError(f"case spec {spec!r}: module {module_name!r} has no case {attr!r}; "
                        + (f"did you mean {' or '.join(close)}? " if close else "")
                        + (f"its cases: {', '.join(ordered[:12])}"
                           + (" ..." if len(ordered) > 12 else "")
                           if ordered else "it defines no case")) from None
    if is_case(target):
        case = target
    elif callable(target):
        try:
            case = target()
        except CaseError:
            raise
        except Exception as exc:
            raise CaseError(f"case spec {spec!r}: calling {attr}() raised "
                            f"{type(exc).__name__}: {exc}" + _needs_ranks(exc)) from exc
        if not is_case(case):
            raise CaseError(f"case spec {spec!r}: {attr}() returned {type(case).__name__}, "
                            "not a layerdiff.Case")
    else:
        raise CaseError(f"case spec {spec!r}: {attr} is a {type(target).__name__}, "
                        "not a layerdiff.Case or a function returning one")
    if not case.name:
        case.name = spec
    return case


# The largest finite value of each floating dtype a loss is computed in (numpy's finfo, without
# importing a framework for it).
_LARGEST = {"float64": 1.7976931348623157e308, "float32": 3.4028234663852886e38,
            "bfloat16": 3.3895313892515355e38, "float16": 65504.0}
_INSTEAD = "use a power of two that leaves room, such as 2**20 (1048576)"


def check_loss_scale(loss_scale: float, widest: str = "float32") -> None:
    """Refuse a ``--loss-scale`` that records nothing useful: not a finite positive number,
    or beyond what ``widest`` (the widest floating dtype the model computes in) can hold, so
    that the scaled loss and every gradient would be inf."""
    if not (math.isfinite(loss_scale) and loss_scale > 0):
        raise CaptureError(f"--loss-scale must be a finite positive number (got {loss_scale}); "
                           f"{_INSTEAD}")
    largest = _LARGEST.get(widest, _LARGEST["float32"])
    if loss_scale > largest:
        raise CaptureError(f"--loss-scale {loss_scale:g} is larger than {widest} can hold "
                           f"({largest:.4g}): the scaled loss and every gradient would be inf, "
                           f"so nothing useful would be recorded; {_INSTEAD}")


def check_scaled_loss(name: str, step: int, loss: float, scaled: float, dtype: str,
                      loss_scale: float) -> None:
    """Refuse a scaled loss that overflowed where the loss itself was finite: every gradient
    from it would be inf or NaN (a loss that is already not finite is the model's, recorded)."""
    if math.isfinite(loss) and not math.isfinite(scaled):
        raise CaptureError(f"case {name}: --loss-scale {loss_scale:g} overflows the {dtype} loss "
                           f"at step {step} ({loss:g} times {loss_scale:g} is {scaled} in "
                           f"{dtype}), so every gradient recorded from it would be inf or NaN; "
                           f"no trace was published; {_INSTEAD}")


def nothing_selected(include: Sequence[str], exclude: Sequence[str], model: str,
                     paths: Sequence[str]) -> str:
    """The sentence for a capture's --include/--exclude globs that leave no module of
    ``model`` to record (``paths`` are its module paths)."""
    globs = " ".join([*(f"--include {p!r}" for p in include),
                      *(f"--exclude {p!r}" for p in exclude)])
    return (f"{globs} leave{'s' if len(include) + len(exclude) == 1 else ''} no module of "
            f"{model} to record, so the trace would hold nothing but the loss; module paths "
            f"look like: {', '.join(paths[:8])}; narrow the --exclude globs")
