"""The part of a reference parameter's recorded gradient that its modules' calls alone make.

A weight also used outside its modules' calls (a tied head ``x @ self.tok.weight.T`` in the
root's code) has one recorded gradient, the total over every use. Replaying a port module
alone makes only its calls' part. With the reference case in hand, the reference's modules
are replayed the same way (their recorded inputs, their recorded output gradients, every
recorded call of the step, through ``autograd.grad``), so the recorded total splits into what
those calls make and the rest; the port's module-alone gradient plus that rest is what the
diff compares with the total, so the comparison judges exactly what the calls make.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.replay.recorded import RecordedCall, read_array, recorded_calls
from layerdiff.trace import Trace, TraceWriter, schema
from layerdiff.trace.schema import Role


class CannotSplit(Exception):
    """The reference's recorded gradient cannot be split (said in one sentence)."""


class ReferenceAlone:
    """The reference model (holding the trace's weights), its modules replayed alone."""

    def __init__(self, model: nn.Module, ref: Trace,
                 make_port: Callable[[nn.Module, Trace], Any]) -> None:
        """``make_port(model, ref)``: a replayer of ``model``'s modules (``TorchPort``)."""
        from layerdiff.weights import load_weights

        load_weights(model, ref.path)
        self.model = model
        self.ref = ref
        self._make_port = make_port
        self._calls: dict[str, list[RecordedCall]] = {}
        for call in recorded_calls(ref):
            self._calls.setdefault(call.module, []).append(call)

    def outside_part(self, modules: list[str], name: str) -> np.ndarray:
        """The recorded gradient of ``modules[0]``'s parameter ``name`` less what every
        recorded call of ``modules`` (reference module paths) makes of it alone."""
        full = schema.param_name(schema.site_name(modules[0], 0), name)
        holder = self.model if modules[0] == schema.ROOT_MODULE else (
            self.model.get_submodule(modules[0]))
        param = holder._parameters.get(name)
        if param is None:
            raise CannotSplit(f"the reference's {modules[0]} holds no parameter {name!r}")
        total = self._recorded_total(full)
        port = self._make_port(self.model, self.ref)
        with tempfile.TemporaryDirectory(prefix="layerdiff-alone-") as tmp, \
                TraceWriter(Path(tmp) / "alone.h5", meta={"steps": 1},
                            producer="layerdiff.replay") as writer:
            for module in modules:
                for call in self._calls.get(module, []):
                    number = schema.split_site(call.site)[1]
                    site = writer.enter(module, type(self._module(module)).__name__,
                                        call=number)
                    try:
                        port.replay(call, site, {}, writer)
                    except Exception as exc:
                        raise CannotSplit(f"the reference's {call.site} could not be replayed "
                                          f"({type(exc).__name__}: {exc})") from exc
                    finally:
                        writer.exit(site)
        alone = port.gradient(param)
        if alone is None:
            raise CannotSplit(f"the reference's calls of {', '.join(modules)} make no "
                              f"gradient of {full}")
        if alone.layout is not torch.strided:  # an nn.Embedding(sparse=True)'s gradient
            alone = alone.to_dense()
        return total - alone.detach().cpu().double().numpy()

    def _module(self, path: str) -> nn.Module:
        return self.model if path == schema.ROOT_MODULE else self.model.get_submodule(path)

    def _recorded_total(self, full: str) -> np.ndarray:
        names = {full}
        for shared in self.ref.meta.get("shared_parameters") or []:
            if isinstance(shared, dict) and full in (shared.get("users") or []):
                names.add(str(shared.get("name")))
        rows = self.ref.records(0, role=Role.WEIGHT_GRAD, kind="tensor")
        for _, row in rows.iterrows():
            if schema.param_name(row["site"], row["arg"]) in names:
                return read_array(self.ref, row).astype(np.float64)
        raise CannotSplit(f"the reference's trace records no gradient of {full}")


def as_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device, like.dtype)
