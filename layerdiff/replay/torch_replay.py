"""Replaying calls into a torch port's modules.

Each call gets the reference's recorded inputs (fresh leaf tensors, cloned before the call so
an in-place layer cannot touch them) and, for its backward, the reference's recorded output
gradients, through ``torch.autograd.grad`` so nothing accumulates into ``.grad``: a container's
replay does not add to its children's weight gradients. Buffers (batch-norm statistics) are
put back after each call. A call is run twice from different random seeds: a layer whose output
changes draws random numbers (dropout) and cannot be replayed exactly, so it is skipped, saying
why.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch import nn

from layerdiff.capture.hooks import flatten
from layerdiff.replay.arguments import map_argument, rebuild_call
from layerdiff.replay.recorded import RecordedCall, read_value
from layerdiff.trace import Trace, TraceWriter, schema

TORCH_DTYPES = {"bfloat16": torch.bfloat16}


class NotReplayable(Exception):
    """A call that cannot be replayed exactly (it draws random numbers)."""


class TorchPort:
    """A torch port's modules, replayed one recorded call at a time."""

    def __init__(self, model: nn.Module, ref: Trace) -> None:
        self.modules = {name or schema.ROOT_MODULE: module
                        for name, module in model.named_modules()}
        self.ref = ref
        self.device = next(model.parameters(), torch.empty(0)).device
        self._weights_recorded: set[str] = set()
        self._weight_grads: dict[str, tuple[str, dict[str, torch.Tensor]]] = {}

    def type_of(self, module: str) -> str:
        return type(self.modules[module]).__name__

    def replay(self, call: RecordedCall, site: str, args_map: dict[str, str],
               writer: TraceWriter) -> None:
        module_name = schema.split_site(site)[0]
        module = self.modules[module_name]
        values = self._inputs(call, args_map)
        for arg, value in values:
            writer.record(site, "input", _numpy(value), arg=arg)
        if module_name not in self._weights_recorded:
            self._weights_recorded.add(module_name)
            for tensors in (module._parameters, module._buffers):
                for name, tensor in tensors.items():
                    if tensor is not None:
                        writer.record(site, "weight", _numpy(tensor), arg=name, pass_="forward")
        wanted = {map_argument(a, args_map) for a in call.grad_input_args}
        leaves = {arg: value.detach().requires_grad_() for arg, value in values
                  if torch.is_tensor(value) and arg in wanted and value.is_floating_point()}
        outputs = self._run_twice(module, values, leaves)
        flat = list(flatten(outputs, ""))
        for arg, value in flat:
            writer.record(site, "output", _numpy(value), arg=arg)
        self._backward(call, site, module_name, module, flat, leaves, writer)

    def _inputs(self, call: RecordedCall, args_map: dict[str, str]) -> list[tuple[str, Any]]:
        values, seen = [], set()
        for arg, row in call.inputs:
            port_arg = map_argument(arg, args_map)
            if port_arg in seen:  # attn(x, x, x) -> attn(x): one argument
                continue
            seen.add(port_arg)
            value = read_value(self.ref, row)
            if isinstance(value, np.ndarray):
                value = torch.from_numpy(value).to(self.device, TORCH_DTYPES.get(row["dtype"]))
            values.append((port_arg, value))
        return values

    def _run_twice(self, module: nn.Module, values: list[tuple[str, Any]],
                   leaves: dict[str, torch.Tensor]) -> Any:
        def call(seed: int) -> Any:
            fresh = [(a, leaves[a].clone() if a in leaves else (
                v.clone() if torch.is_tensor(v) else v)) for a, v in values]
            args, kwargs = rebuild_call(fresh)
            with _random_seed(seed, self.device), _buffers_kept(module):
                return module(*args, **kwargs)

        outputs = call(1)
        with torch.no_grad():
            again = call(2)
        for (arg, a), (_, b) in zip(flatten(outputs, ""), flatten(again, ""), strict=True):
            if torch.is_tensor(a) and not torch.equal(a.detach(), b):
                raise NotReplayable(f"output {arg} changes with the random seed (the layer "
                                    "draws random numbers, as dropout does)")
        return outputs

    def _backward(self, call: RecordedCall, site: str, module_name: str, module: nn.Module,
                  flat: list[tuple[str, Any]], leaves: dict[str, torch.Tensor],
                  writer: TraceWriter) -> None:
        pairs = [(arg, value) for arg, value in flat if torch.is_tensor(value)
                 and value.requires_grad and arg in call.grad_outputs]
        if not pairs:
            return
        grads = []
        for arg, value in pairs:
            grad = read_value(self.ref, call.grad_outputs[arg])
            writer.record(site, "grad_output", grad, arg=arg)
            grad = torch.from_numpy(grad).to(value.device, value.dtype)
            grads.append(grad)
            # The recorded gradient of an output is everything that reached it, including what
            # came back through the layer's own later use of it (an LSTM cell's c feeds its h):
            # it replaces whatever arrives here, so that path is not counted twice.
            value.register_hook(lambda _arrived, grad=grad: grad)
        params = [(n, p) for n, p in module._parameters.items()
                  if p is not None and p.requires_grad]
        targets = list(leaves.values()) + [p for _, p in params]
        if not targets:
            return
        results = torch.autograd.grad([v for _, v in pairs], targets, grads, allow_unused=True)
        for arg, grad in zip(leaves, results[:len(leaves)], strict=True):
            if grad is not None:
                writer.record(site, "grad_input", _numpy(grad), arg=arg)
        _, sums = self._weight_grads.setdefault(module_name, (site, {}))
        for (name, _), grad in zip(params, results[len(leaves):], strict=True):
            if grad is not None:
                sums[name] = grad if name not in sums else sums[name] + grad

    def finish(self, writer: TraceWriter, complete: set[str]) -> None:
        """Weight gradients, summed over each module's calls as the reference records them;
        only for modules in ``complete`` (every call replayed), or the sums would differ."""
        for module, (site, sums) in self._weight_grads.items():
            if module in complete:
                for name, grad in sums.items():
                    writer.record(site, "weight_grad", _numpy(grad), arg=name)


def _numpy(value: Any) -> Any:
    if not torch.is_tensor(value):
        return value
    value = value.detach().cpu()
    if value.dtype == torch.bfloat16:
        value = value.float()  # TraceWriter stores numpy dtypes; compared at bfloat16's tolerance
    return value.numpy()


@contextmanager
def _random_seed(seed: int, device: torch.device) -> Iterator[None]:
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


@contextmanager
def _buffers_kept(module: nn.Module) -> Iterator[None]:
    """Put buffers (batch-norm running statistics) back as they were after the call."""
    saved = [(b, b.detach().clone()) for b in module.buffers()]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)
