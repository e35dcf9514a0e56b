"""One recorded step: the hooks' records (sites, roles, statistics' slots) and, for a marked
step, copies of the tensors themselves.

The hooks append plain tuples (no statistics yet, no strings built per tensor beyond the site
name); the step's statistics come from its :class:`StepStatistics` once the step is over.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from layerdiff.monitor.tensor_stats import StepStatistics, dtype_name, supported
from layerdiff.trace.schema import Pass, Role

# (pass, site, role, arg, slot, dtype, shape, host copy or None)
Record = tuple[str, str, str, str, int, str, tuple[int, ...], "np.ndarray | None"]


@dataclass
class StepRecord:
    """What one recorded step left: records in the order they were taken, the sites' rows
    (enter and exit as positions in ``records``), and the statistics per slot."""

    step: int
    records: list[Record] = field(default_factory=list)
    sites: list[dict[str, Any]] = field(default_factory=list)
    stats: list[Any] = field(default_factory=list)
    full: bool = False


class StepRecorder:
    """The state of the step being recorded: call counts, the open calls, the identity cache
    that gives a tensor recorded again (a layer's input that is its predecessor's output) the
    slot it already has, and the parameters' owners."""

    def __init__(self, stats: StepStatistics, owners: dict[int, tuple[str, str]],
                 step: int, full_sites: Any = None) -> None:
        self.stats = stats
        self.owners = owners  # id(parameter) -> (owner module path, name within it)
        self.record = StepRecord(step, full=full_sites is not None)
        self._full_sites = full_sites  # None: no data kept; else a predicate on module paths
        self.calls: dict[str, int] = {}
        self.stack: list[tuple[str, str, str, int, int]] = []  # site, module, type, call, enter
        # id(tensor) -> (tensor, its _version when taken, slot); the tensor is held so that its
        # id cannot be reused by another tensor within the step
        self._seen: dict[int, tuple[torch.Tensor, int, int]] = {}
        self.weights_taken = False
        self._weight_slots: dict[int, int] = {}   # id(parameter) -> slot
        self._first_site: dict[str, str] = {}     # module path -> its first site this step
        self._gradients: list[tuple[torch.nn.Parameter, int, np.ndarray | None]] = []

    # ---- tensors ----
    def slot(self, tensor: torch.Tensor) -> int:
        seen = self._seen.get(id(tensor))
        version = tensor._version
        if seen is not None and seen[0] is tensor and seen[1] == version:
            return seen[2]
        slot = self.stats.add(tensor)
        self._seen[id(tensor)] = (tensor, version, slot)
        return slot

    def keeps(self, module: str) -> bool:
        return self._full_sites is not None and self._full_sites(module)

    def add(self, pass_: str, site: str, role: str, arg: str, tensor: torch.Tensor,
            slot: int, module: str) -> None:
        data = (_host_copy(tensor) if self._full_sites is not None and self._full_sites(module)
                else None)
        self.record.records.append((pass_, site, role, arg, slot, dtype_name(tensor.dtype),
                                    tuple(tensor.shape), data))

    def tensors(self, pass_: str, site: str, role: str, module: str, values: Any,
                prefix: str = "") -> None:
        """Record every supported tensor in ``values`` (a tensor, or a tuple/list/dict of them,
        one level deep), under argument paths '0', '1', 'mask' as a capture names them."""
        if isinstance(values, torch.Tensor):
            items = ((prefix or "0", values),)
        elif isinstance(values, (tuple, list)):
            items = ((f"{prefix}{i}", v) for i, v in enumerate(values))
        elif isinstance(values, dict):
            items = ((f"{prefix}{k}", v) for k, v in values.items())
        else:
            items = ((f"{prefix}{k}", v) for k, v in _fields(values))
        for arg, value in items:
            if isinstance(value, torch.Tensor) and supported(value):
                self.add(pass_, site, role, arg, value, self.slot(value), module)

    # ---- parameters ----
    def take_weights(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Every parameter's statistics, once per step, as the forward first sees them."""
        self.weights_taken = True
        chosen = [param for _, param in params if supported(param)]
        for param, slot in zip(chosen, self.stats.add_many(chosen), strict=True):
            self._weight_slots[id(param)] = slot

    def weights_of(self, module_path: str, site: str, own: dict[str, Any]) -> None:
        """The weight records of a module's own parameters, at its first call of the step."""
        self._first_site.setdefault(module_path, site)
        for name, param in own.items():
            if param is None or self.owners.get(id(param)) != (module_path, name):
                continue  # a tied weight is recorded once, at its owner
            slot = self._weight_slots.pop(id(param), None)
            if slot is not None:
                self.add(Pass.FORWARD, site, Role.WEIGHT, name, param, slot, module_path)

    def uncalled_weights(self, params: list[tuple[str, torch.nn.Parameter]], root_site: str,
                         root_path: str) -> None:
        """Parameters whose owner was never called this step: at the root's call, by full
        name (the root's own names are full names)."""
        for full_name, param in params:
            slot = self._weight_slots.pop(id(param), None)
            if slot is not None:
                self.add(Pass.FORWARD, root_site, Role.WEIGHT, full_name, param, slot,
                         root_path)

    def take_gradients(self, params: list[tuple[str, torch.nn.Parameter]]) -> None:
        """Every parameter's gradient as the backward left it (the last backward of the step
        counts, as a capture records the gradient the optimizer sees)."""
        chosen = [param for _, param in params
                  if param.grad is not None and supported(param.grad)]
        slots = self.stats.add_many([param.grad for param in chosen])
        self._gradients = []
        for param, slot in zip(chosen, slots, strict=True):
            owner = self.owners.get(id(param))
            keep = owner is not None and self.keeps(owner[0])
            self._gradients.append((param, slot, _host_copy(param.grad) if keep else None))

    @property
    def has_gradients(self) -> bool:
        return bool(self._gradients)

    def close_gradients(self, root_site: str) -> None:
        """The weight_grad records, last parameter first: the order in which a backward
        completes them, roughly (the diff's backward order of sites)."""
        for param, slot, data in reversed(self._gradients):
            module, name = self.owners.get(id(param), ("", ""))
            site = self._first_site.get(module)
            arg = name
            if site is None:  # never called: at the root by its full name
                site, arg = root_site, f"{module}.{name}" if module else name
            self.record.records.append((Pass.BACKWARD, site, Role.WEIGHT_GRAD, arg, slot,
                                        dtype_name(param.dtype), tuple(param.shape), data))
        self._gradients = []

    def forward_done(self) -> None:
        """The outermost call returned: the identity cache's tensors may be freed."""
        self._seen.clear()

    def finish(self) -> StepRecord:
        self.stats.finish()
        self.record.stats = self.stats.results
        self._seen.clear()
        return self.record


def _fields(value: Any) -> list[tuple[str, Any]]:
    """The tensors of an output object with attributes (a Hugging Face ModelOutput is a dict;
    a dataclass or named tuple of tensors): nothing else is looked into."""
    if hasattr(value, "_asdict"):
        return list(value._asdict().items())
    fields = getattr(value, "__dataclass_fields__", None)
    if fields:
        return [(name, getattr(value, name, None)) for name in fields]
    return []


def _host_copy(tensor: torch.Tensor) -> np.ndarray:
    """The tensor's bytes on the host, as a trace stores them (raw bits for bfloat16)."""
    copy = tensor.detach().to("cpu", copy=True).contiguous()
    if copy.dtype == torch.bfloat16:
        return copy.view(torch.uint16).numpy() if hasattr(torch, "uint16") else \
            copy.view(torch.int16).numpy().view(np.uint16)
    return copy.numpy()
