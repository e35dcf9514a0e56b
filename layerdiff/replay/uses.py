"""Where a torch port uses each parameter outside its own modules' calls.

The reference records a parameter's gradient once a step, as a total over every use: the
calls of the modules holding it, and code elsewhere that reads it (a tied output head
``x @ self.tok.weight.T`` in the parent's forward). Replay runs a module alone, so the part
of that total made outside the module's calls is not in what it computes. This finds those
uses: one forward of the whole port on its case's inputs, every torch function watched
(``TorchFunctionMode``) with the stack of module calls it runs in (each module's ``forward``
wrapped on its instance, put back after), and a parameter passed to a function while no
module holding it is being called is used outside, in the innermost module then called.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

import layerdiff.rng as rng


class _Watch(TorchFunctionMode):
    def __init__(self, holders: dict[int, set[str]], stack: list[str],
                 found: dict[int, list[str]]) -> None:
        super().__init__()
        self.holders, self.stack, self.found = holders, stack, found

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if func in _NO_GRADIENT or not any(isinstance(out, torch.Tensor)
                                           for out in tree_leaves(result)):
            return result  # reading its dtype, shape or device is no use a gradient flows from
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                holders = self.holders.get(id(leaf))
                if holders is not None and self.stack and not holders.intersection(self.stack):
                    where = self.found.setdefault(id(leaf), [])
                    if self.stack[-1] not in where:
                        where.append(self.stack[-1])
        return result


# tensors made from a parameter that no gradient flows back through
_NO_GRADIENT = {torch.Tensor.detach, torch.Tensor.data.__get__}


def outside_uses(model: nn.Module, modules: dict[str, nn.Module], call: Callable[[], Any],
                 devices: list[int],
                 restored: Callable[[Iterable[torch.Tensor]], AbstractContextManager[None]]
                 ) -> dict[int, list[str]]:
    """Parameter (by ``id``) -> the module paths whose own code uses it while no module
    holding it is being called, from one forward ``call()`` of ``model`` (no gradient; the
    random generators put back, and the buffers by ``restored``)."""
    unique: dict[int, tuple[str, nn.Module]] = {}
    for name, module in modules.items():  # a module reachable by two paths: its first
        unique.setdefault(id(module), (name, module))
    holders: dict[int, set[str]] = {}
    for name, module in unique.values():
        for param in module._parameters.values():
            if param is not None:
                holders.setdefault(id(param), set()).add(name)
    stack: list[str] = []
    found: dict[int, list[str]] = {}

    def watched(name: str, forward: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            stack.append(name)
            try:
                return forward(*args, **kwargs)
            finally:
                stack.pop()
        return run

    # each module's forward, watched on the instance: a module called through
    # ``child.forward(...)`` (which runs no module hooks) is seen all the same
    wrapped: list[tuple[nn.Module, Any]] = []  # (module, its own instance forward or None)
    try:
        for name, module in unique.values():
            own = module.__dict__.get("forward")
            module.forward = watched(name, module.forward)
            wrapped.append((module, own))
        with rng.preserved(devices), restored(model.buffers()), torch.no_grad(), \
                _Watch(holders, stack, found):
            call()
    finally:  # only what was wrapped, however far the wrapping got
        for module, own in wrapped:
            if own is None:
                del module.forward
            else:
                module.forward = own
    return found
