"""Moving weights from a reference trace into a port, through the same mapping the diff uses.

``load_weights(port_model, "ref.h5", mapping="port.map.toml")`` sets every parameter and buffer
of the port from the reference's ``weight`` records of step 0: renamed, transposed, split or
concatenated as the mapping says, shape-checked, cast to the port's dtype.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from layerdiff.compare.mapping import Mapping, ParamSource
from layerdiff.compare.records import param_name
from layerdiff.errors import MappingError
from layerdiff.trace import open_trace, schema


@dataclass
class WeightsReport:
    loaded: dict[str, list[str]] = field(default_factory=dict)  # port name -> reference names
    unused: list[str] = field(default_factory=list)             # reference tensors not used

    def summary(self) -> str:
        text = f"loaded {len(self.loaded)} port tensors from the reference"
        if self.unused:
            shown = ", ".join(self.unused[:4]) + (" ..." if len(self.unused) > 4 else "")
            text += f"; {len(self.unused)} reference tensors unused ({shown})"
        return text


def load_weights(model: nn.Module, trace_path: str | os.PathLike,
                 mapping: str | os.PathLike | Mapping | None = None) -> WeightsReport:
    """Set ``model``'s parameters and buffers from the reference trace's step-0 weights.

    Raises :class:`MappingError` naming both sides when a shape does not fit, and listing the
    port tensors that nothing in the reference provides.
    """
    path = Path(trace_path)
    return load_weights_from(model, _reference_weights(path), mapping, source=str(path))


def state_arrays(model: nn.Module) -> dict[str, np.ndarray]:
    """A live model's parameters and buffers as numpy, by name (a reference without a trace)."""
    return {name: _to_numpy(tensor) for name, tensor in model.state_dict().items()}


def load_weights_from(model: nn.Module, reference: dict[str, np.ndarray],
                      mapping: str | os.PathLike | Mapping | None = None, *,
                      source: str = "the reference") -> WeightsReport:
    """Set ``model``'s parameters and buffers from ``reference`` (name -> array) through
    ``mapping``; see :func:`load_weights`."""
    mapping = mapping if isinstance(mapping, Mapping) else (
        Mapping.load(mapping) if mapping is not None else Mapping())
    partner = _module_partners(model, reference, mapping)
    report = WeightsReport()
    missing: list[str] = []
    persistent = set(model.state_dict())  # buffers registered persistent=False are the port's
    targets = dict(model.named_parameters())
    targets.update((n, b) for n, b in model.named_buffers() if n in persistent)
    values: dict[str, np.ndarray] = {}
    for name, tensor in targets.items():
        found = mapping.param_source(name, partner) or ParamSource([name])
        if not all(ref in reference for ref in found.reference):
            missing.append(name)
            continue
        value = _combine(found, reference)
        if tuple(value.shape) != tuple(tensor.shape):
            raise MappingError(
                f"weights from {source}: port {name} has shape {tuple(tensor.shape)} but "
                f"reference {' + '.join(found.reference)} gives {tuple(value.shape)} "
                f"({found.transform}); fix the [[param]] rule in {mapping.name}")
        values[name] = value
        report.loaded[name] = found.reference
    if missing:
        shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
        raise MappingError(f"weights from {source}: nothing in the reference gives port "
                           f"{shown} ({len(missing)} tensors); add [[site]] or [[param]] rules "
                           f"to {mapping.name if mapping.path else 'a mapping file (--map)'}")
    with torch.no_grad():
        for name, value in values.items():
            target = targets[name]
            target.copy_(torch.from_numpy(np.array(value, order="C")).to(target.dtype))
    used = {ref for refs in report.loaded.values() for ref in refs}
    report.unused = sorted(set(reference) - used)
    return report


def _to_numpy(tensor: torch.Tensor) -> np.ndarray:
    tensor = tensor.detach().cpu()
    return (tensor.float() if tensor.dtype == torch.bfloat16 else tensor).numpy()


def _reference_weights(path: Path) -> dict[str, np.ndarray]:
    with open_trace(path) as trace:
        if trace.summary:
            raise MappingError(f"{path} is a summary trace: it has no tensor data to take "
                               "weights from; capture the reference without --summary")
        index = trace.index
        rows = index[(index["role"] == "weight") & (index["step"] == index["step"].min())]
        if rows.empty:
            raise MappingError(f"{path} records no weights (was it captured with "
                               "--no-weights?); capture the reference with weights")
        return {param_name(row["site"], row["arg"]): np.array(trace.read(row))
                for _, row in rows.iterrows()}


def _module_partners(model: nn.Module, reference: dict[str, np.ndarray],
                     mapping: Mapping) -> dict[str, str]:
    """Port module -> reference module, by explicit pairs, exact names and rename rules."""
    port_modules = {name for name, _ in model.named_modules() if name}
    ref_modules = {name.rpartition(".")[0] for name in reference}
    partner: dict[str, str] = {}
    for ref_site, port_site in mapping.pairs.items():
        partner[schema.split_site(port_site)[0]] = schema.split_site(ref_site)[0]
    for module in sorted(ref_modules):
        renamed = mapping.rename(module)
        target = module if module in port_modules else (renamed[0] if renamed else None)
        if target in port_modules:
            partner.setdefault(target, module)
    return partner


def _combine(source: ParamSource, reference: dict[str, np.ndarray]) -> np.ndarray:
    parts = [reference[name] for name in source.reference]
    if source.transform == "concat":
        return np.concatenate(parts, axis=source.axis)
    if source.transform == "split":
        return np.split(parts[0], source.parts, axis=source.axis)[source.part]
    if source.transform == "transpose":
        return parts[0].T
    return parts[0]
