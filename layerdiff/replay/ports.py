"""What the mapping tools need of a port model: ``port_model(case)`` asks the case's framework
(:func:`layerdiff.framework.framework_of`) for a small object with what ``map-check`` and
``map-suggest`` need of a port model, whatever it is written in (:class:`PortModel`): its module
paths and classes, its tensors' names and shapes resolved through a mapping, a tensor set and
everything put back, one module run on the reference's recorded call (``replayer``), its case's
forward with every module call seen, and the arrays of what a module returned as numpy.

:class:`TorchModel` serves a ``torch.nn.Module``; :class:`layerdiff.flax.model.FlaxModel` a Flax
NNX module (JAX is imported only when one is made). A port that records itself is refused by its
framework in one sentence (:class:`~layerdiff.errors.CaseError`: exit 2 on the command line).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import numpy as np

from layerdiff.case import Case, seed_everything
from layerdiff.errors import CaseError
from layerdiff.framework import framework_of
from layerdiff.mapping import Mapping
from layerdiff.trace import Trace
from layerdiff.weights import Assignment

# hook(module path, class name, run, args, kwargs) -> what run(*args, **kwargs) returns
Hook = Callable[[str, str, Callable[..., Any], tuple, dict], Any]


class PortModel(Protocol):
    """What the mapping tools use of a port model (:class:`TorchModel` is the reference
    implementation; each framework gives its own through ``port_model``)."""

    framework: str
    name: str

    def modules(self) -> dict[str, str]: ...
    def resolve(self, reference: dict[str, np.ndarray],
                mapping: Mapping) -> list[Assignment]: ...
    def shapes(self) -> dict[str, tuple[int, ...]]: ...
    def buffers(self) -> set[str]: ...
    def ties(self) -> list[list[str]]: ...
    def set(self, name: str, value: np.ndarray) -> None: ...
    def restored(self) -> contextlib.AbstractContextManager[None]: ...
    def replayer(self, ref: Trace) -> Any: ...
    def leaves(self, value: Any) -> list[tuple[str, Any]]: ...
    def is_array(self, value: Any) -> bool: ...
    def arrays(self, value: Any) -> list[tuple[str, Any]]: ...
    def eps(self, value: Any) -> float: ...
    def layout_conversions(self) -> list[tuple[str, Callable[[tuple[int, ...]], Any]]]: ...
    def dense_layout(self, type_name: str) -> str | None: ...
    def watch(self, hook: Hook) -> Any: ...


def port_model(case: Any, command: str) -> PortModel:
    """The port model of ``case`` for ``command`` (named in the refusal), from its framework."""
    if not hasattr(case, "name") or isinstance(case, (str, bytes)):
        raise CaseError(f"{command} needs a layerdiff.Case whose model is a torch or Flax "
                        f"module (it loads weights into it and runs it), got "
                        f"{type(case).__name__}")
    return framework_of(case).port_model(case, command)


class TorchModel:
    """A torch port model (see the module's docstring)."""

    framework = "torch"

    def __init__(self, case: Case) -> None:
        self.case, self.model = case, case.model

    @property
    def name(self) -> str:
        return self.case.name or type(self.model).__name__

    def modules(self) -> dict[str, str]:
        from layerdiff.capture.modules import named_modules

        return {path: type(module).__name__ for path, module in named_modules(self.model)}

    def resolve(self, reference: dict[str, np.ndarray], mapping: Mapping) -> list[Assignment]:
        from layerdiff.weights import resolve_weights

        return resolve_weights(self.model, reference, mapping)

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The tensors a load sets (parameters, persistent buffers) and their shapes."""
        from layerdiff.weights import port_tensors

        return {name: tuple(t.shape) for name, t in port_tensors(self.model).items()}

    def buffers(self) -> set[str]:
        return {name for name, _ in self.model.named_buffers()}

    def ties(self) -> list[list[str]]:
        groups: dict[int, list[str]] = {}
        for name, tensor in self.model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(tensor), []).append(name)
        return [names for names in groups.values() if len(names) > 1]

    def set(self, name: str, value: np.ndarray) -> None:
        import torch

        from layerdiff.weights import port_tensors

        if not hasattr(self, "_targets"):
            self._targets = port_tensors(self.model)
        target = self._targets[name]
        with torch.no_grad():
            target.copy_(torch.from_numpy(np.array(value, order="C")).to(target.device,
                                                                           target.dtype))

    @contextlib.contextmanager
    def restored(self) -> Iterator[None]:
        from layerdiff.replay.torch_replay import restored

        with restored([*self.model.parameters(), *self.model.buffers()]):
            yield

    def replayer(self, ref: Trace) -> Any:
        from layerdiff.replay.torch_replay import TorchPort

        return TorchPort(self.model, ref)

    def leaves(self, value: Any) -> list[tuple[str, Any]]:
        """(path, leaf) of a call's arguments or return value, as capture flattens them."""
        from layerdiff.capture.hooks import flatten as torch_flatten

        return list(torch_flatten(value, ""))

    def is_array(self, value: Any) -> bool:
        import torch

        return torch.is_tensor(value)

    def arrays(self, value: Any) -> list[tuple[str, Any]]:
        """(path, leaf) of a module's return value: tensors as numpy arrays, None kept."""
        import torch

        from layerdiff.capture.hooks import flatten as torch_flatten

        return [(arg, _torch_numpy(leaf) if torch.is_tensor(leaf) else leaf)
                for arg, leaf in torch_flatten(value, "")]

    def eps(self, value: Any) -> float:
        """The largest machine epsilon of the floating tensors in ``value``."""
        import torch

        from layerdiff.capture.hooks import flatten as torch_flatten

        return max([torch.finfo(leaf.dtype).eps for _, leaf in torch_flatten(value, "")
                    if torch.is_tensor(leaf) and leaf.is_floating_point()], default=0.0)

    def layout_conversions(self) -> list[tuple[str, Callable[[tuple[int, ...]], Any]]]:
        """(conversion function, the shape it makes of a torch tensor's) for the layouts this
        framework keeps otherwise than torch: none."""
        return []

    def dense_layout(self, type_name: str) -> str | None:
        """How a dense layer of this class keeps its weight: torch's Linear (out, in)."""
        return "out_in" if type_name == "Linear" else None

    def watch(self, hook: Hook) -> Any:
        """The case's forward once, without gradients, every module call (``module(...)``
        and ``module.forward(...)`` alike: each module's ``forward`` is wrapped for the run)
        going through ``hook``."""
        import torch

        from layerdiff.capture.modules import named_modules

        saved = []

        def wrap(module, path):
            inner = module.forward
            name = type(module).__name__

            def forward(*args, **kwargs):
                return hook(path, name, inner, args, kwargs)
            return forward

        for path, module in named_modules(self.model):
            before = module.__dict__.get("forward")
            try:
                module.forward = wrap(module, path)
            except (AttributeError, TypeError, RuntimeError):
                continue  # a scripted module takes no new attributes: its calls go unseen
            saved.append((module, before))
        try:
            seed_everything(self.case.seed)
            with torch.no_grad():
                return self.case.call_model()
        finally:
            for module, before in saved:
                if before is None:
                    del module.forward
                else:
                    module.forward = before


def _torch_numpy(tensor: Any) -> np.ndarray:
    tensor = tensor.detach().cpu()
    narrow = tensor.is_floating_point() and tensor.element_size() < 4  # numpy has no bfloat16
    return (tensor.float() if narrow else tensor).numpy()
