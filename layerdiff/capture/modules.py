"""A torch model's modules by path, and hooks on them that all come off together.

Every part that watches a model's calls (capture and its op sites, find-nan through capture's
recorder, batch independence, swap, replay, map-suggest) walks ``model.named_modules()`` the
same way: registration order, each module object once, the root named
:data:`schema.ROOT_MODULE` so that its site reads ``<root>#0`` like any other. That order is
the trace's contract (``docs/trace-format.md``: sites of one call are numbered per module path,
tied weights are owned by the first module in it): one walk keeps every part naming the same
module the same way.

:class:`ModuleHooks` holds every hook handle a part registers in one list and removes them all
at once, also when the run in between raised (it is a context manager), so no hook outlives
the run that put it in. With a :class:`DirectCalls` it marks each hook as one that a direct
``module.forward(...)`` call runs too, and undoes the ``forward`` wrappers it put in.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from types import TracebackType
from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle

from layerdiff.capture.direct import DirectCalls
from layerdiff.trace import schema

# hook(path, module, args, kwargs) before a call; hook(path, module, args, kwargs, output) after
BeforeCall = Callable[[str, nn.Module, tuple, dict], None]
AfterCall = Callable[[str, nn.Module, tuple, dict, Any], None]


def named_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Every module of ``model`` as ``(path, module)``, in registration order, each module
    object once (torch's ``named_modules()``), the root under :data:`schema.ROOT_MODULE`."""
    return [(path or schema.ROOT_MODULE, module) for path, module in model.named_modules()]


def module_paths(model: nn.Module) -> list[str]:
    """The paths of :func:`named_modules`, in the same order."""
    return [path for path, _ in named_modules(model)]


def is_leaf(module: nn.Module) -> bool:
    """A module with no child modules: its own code does all of its work (a container's calls
    its children too)."""
    return next(iter(module.children()), None) is None


def get_module(model: nn.Module, path: str) -> nn.Module:
    """The module at ``path`` (a path from :func:`named_modules`: the root by its name too)."""
    return model if path == schema.ROOT_MODULE else model.get_submodule(path)


class ModuleHooks:
    """Hooks on a model's modules, held in one handle list and removed together.

    ``direct``: the hooks are run by direct ``module.forward(...)`` calls as well (see
    :mod:`layerdiff.capture.direct`); :meth:`wrap_forward` puts the wrapper in that does it.
    :meth:`remove` (or leaving the ``with`` block) takes the wrappers this object put in out
    first, then every hook, in the order they were registered.
    """

    def __init__(self, direct: DirectCalls | None = None) -> None:
        self.direct = direct
        self._handles: list[RemovableHandle] = []
        self._wrapped = False

    def __len__(self) -> int:
        return len(self._handles)

    def add(self, handle: RemovableHandle) -> RemovableHandle:
        """Hold a handle registered elsewhere (a backward hook, a tensor's): removed with the
        rest. Marked for direct calls too when ``direct`` was given."""
        if self.direct is not None:
            self.direct.own(handle)
        self._handles.append(handle)
        return handle

    def before(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False,
               prepend: bool = False) -> RemovableHandle:
        """A forward pre-hook on ``module`` (``hook(module, args[, kwargs])``)."""
        return self.add(module.register_forward_pre_hook(hook, with_kwargs=with_kwargs,
                                                         prepend=prepend))

    def after(self, module: nn.Module, hook: Callable[..., Any], *, with_kwargs: bool = False,
              prepend: bool = False, always_call: bool = False) -> RemovableHandle:
        """A forward hook on ``module`` (``hook(module, args[, kwargs], output)``);
        ``always_call``: run it even when the forward raised."""
        return self.add(module.register_forward_hook(hook, with_kwargs=with_kwargs,
                                                     prepend=prepend, always_call=always_call))

    def wrap_forward(self, module: nn.Module) -> None:
        """Let a direct ``module.forward(...)`` call run this object's hooks (needs
        ``direct``); undone by :meth:`remove`."""
        if self.direct is None:
            raise ValueError("ModuleHooks.wrap_forward needs the DirectCalls given at creation")
        self.direct.wrap(module)
        self._wrapped = True

    def remove(self) -> None:
        """Take every wrapper and hook out; safe to call twice."""
        if self._wrapped and self.direct is not None:
            self.direct.unwrap()
            self._wrapped = False
        handles, self._handles = self._handles, []
        for handle in handles:
            handle.remove()

    def __enter__(self) -> ModuleHooks:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.remove()


def hook_every_call(model: nn.Module, before: BeforeCall, after: AfterCall, *,
                    direct_calls: bool = False) -> ModuleHooks:
    """``before`` and ``after`` around every call of every module of ``model``, each told the
    module's path (:func:`named_modules`). ``direct_calls``: a module called as
    ``child.forward(...)`` (llama2.c's model) is seen too. Use as a context manager: the hooks
    come off when the block ends, however it ends. A hook must return None (a pre-hook's value
    would replace the call's arguments)."""
    hooks = ModuleHooks(DirectCalls() if direct_calls else None)
    try:
        for path, module in named_modules(model):
            hooks.before(module, partial(before, path), with_kwargs=True)
            hooks.after(module, partial(after, path), with_kwargs=True)
            if direct_calls:
                hooks.wrap_forward(module)
    except BaseException:
        hooks.remove()
        raise
    return hooks
