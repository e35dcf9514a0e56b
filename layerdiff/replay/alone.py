"""The part of a reference parameter's recorded gradient that its modules' calls alone make.

A weight also used outside its modules' calls (a tied head ``x @ self.tok.weight.T`` in the
root's code) has one recorded gradient, the total over every use. Replaying a port module
alone makes only its calls' part. With the reference case in hand, the reference's modules
are replayed the same way (their recorded inputs, their recorded output gradients, every
recorded call of the step, through ``autograd.grad``), so the recorded total splits into what
those calls make and the rest; the port's module-alone gradient plus that rest is what the
diff compares with the total, so the comparison judges exactly what the calls make.

:func:`split_outside` is the one decision for every port framework (torch's and Flax NNX's
replay): split that total where the reference case is given and the mapping moves the tensor
unchanged or transposed, else set the weight gradient aside as "cannot judge alone", naming
where else it is used. Never a local error for a use the module's call does not make.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class Split:
    """What a port's module-alone weight gradient is compared as, where its parameter is also
    used outside the calls that make it."""

    rest: np.ndarray | None  # to add to the port's gradient, in its layout; None: set aside
    line: str                # the note to say (split), or why it is set aside


def split_outside(full: str, users: list[str], outside: list[str], partners: list[str],
                  shape: tuple[int, ...], reference_alone: ReferenceAlone | None,
                  source: Any) -> Split:
    """The decision for port parameter ``full`` (``tok.embedding``), whose gradient the calls
    of port modules ``users`` make and whose code at ``outside`` (port module paths) also
    uses it: ``rest``, the part of the reference's recorded total that the reference's
    ``partners`` (the modules those calls replayed; the parameter's holder first) do not make
    alone, in the port's ``shape``; or why it cannot be compared. ``source`` is the mapping's
    [[param]] source of ``full`` (None: the same name at the partner)."""
    users_text = ", ".join(users)
    if reference_alone is None:
        why = ("give the reference case (--reference-case) to compare what the calls alone "
               "make on both sides")
    else:
        try:
            name, to_port = _reference_name(full, source, partners)
            rest = to_port(reference_alone.outside_part(partners, name))
            if rest.shape != tuple(shape):
                raise CannotSplit(f"the reference's {full} gradient is {rest.shape}, the "
                                  f"port's {tuple(shape)}")
        except CannotSplit as exc:
            why = str(exc)
        else:  # one line: the terminal clips a note to its width
            return Split(rest, f"{full} is also used at {', '.join(outside)}: judged on what "
                               f"the calls of {users_text} alone make, on both sides")
    return Split(None, (
        f"cannot judge alone: {full} is also used at {', '.join(outside)} (in that module's "
        f"own code, outside the calls of {users_text}); the reference's recorded gradient "
        "sums that use too, which the module's call alone does not make, so it is not "
        f"compared (its outputs and input gradients are): {why}"))


def _reference_name(full: str, source: Any, partners: list[str]
                    ) -> tuple[str, Callable[[np.ndarray], np.ndarray]]:
    """The reference parameter's name at ``partners[0]`` and how its gradient takes the
    port's layout: the port's own name unchanged without a [[param]] rule; a rule that copies
    or transposes one whole reference tensor, undone the same way; any other, refused."""
    if not partners:
        raise CannotSplit(f"no replayed call of the port's {full.rpartition('.')[0]} has a "
                          "reference partner")
    if source is None:
        return full.rpartition(".")[2], lambda array: array
    if source.transforms not in (("copy",), ("transpose",)) or source.parts != 1 or len(
            source.reference) != 1:
        raise CannotSplit(f"the mapping makes it from {', '.join(source.reference)} through "
                          f"{' then '.join(source.transforms)} ({source.where}), which a split "
                          "does not undo")
    reference = source.reference[0]
    prefix = "" if partners[0] == schema.ROOT_MODULE else partners[0] + "."
    if not reference.startswith(prefix) or not reference[len(prefix):]:
        raise CannotSplit(f"the mapping makes it from {reference} ({source.where}), which the "
                          f"reference's {partners[0]} does not hold")
    if source.transforms == ("transpose",):
        return reference[len(prefix):], lambda array: array.T
    return reference[len(prefix):], lambda array: array


def as_like(array: np.ndarray, like: torch.Tensor) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(array)).to(like.device, like.dtype)
