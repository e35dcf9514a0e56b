"""Calls of ``module.forward(...)`` made directly, seen as module calls.

A parent that calls ``self.attention.forward(x)`` (as llama2.c's ``model.py`` does) skips
``Module.__call__`` and with it every forward hook, so the call would leave no site. While
capturing, each hooked module's ``forward`` is shadowed by an instance attribute that runs
layerdiff's own hooks (and only those: a hook of the model's own never ran on such a call and
must not start to) around the original ``forward``. A call through ``module(...)`` reaches the
same attribute from ``Module._call_impl``, whose hooks have already run: it goes straight
through, so nothing is recorded twice. Removing the wrappers restores whatever instance
attribute was there before (an accelerate hook's ``forward``, say).
"""

from __future__ import annotations

import functools
import sys
import types
import warnings
from types import CodeType
from typing import Any

from torch import nn

# the frames that call ``forward`` when a module is called as ``module(...)``: _call_impl
# itself (no hooks) and the function nested in it that runs the hooks around forward
_CALL_IMPL = frozenset([nn.Module._call_impl.__code__, *(
    const for const in nn.Module._call_impl.__code__.co_consts if isinstance(const, CodeType))])


class DirectCalls:
    """The ``forward`` wrappers of one capture, and the ids of the hooks they run."""

    def __init__(self) -> None:
        self.hook_ids: set[int] = set()
        # (module, whether it had an instance forward, that forward, the wrapper put in)
        self._wrapped: list[tuple[nn.Module, bool, Any, Any]] = []

    def own(self, handle: Any) -> Any:
        """Mark a hook (by its handle) as one a direct call runs too; returns the handle."""
        self.hook_ids.add(handle.id)
        return handle

    def wrap(self, module: nn.Module) -> None:
        """Shadow ``module.forward`` until :meth:`unwrap`."""
        had = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        hook_ids = self.hook_ids

        if had:   # someone's instance forward (an accelerate hook's): wrapped as it is
            @functools.wraps(previous)
            def forward(*args: Any, **kwargs: Any) -> Any:
                return _dispatch(module, previous, hook_ids, args, kwargs)
        else:
            # a method bound to the module, calling the class's forward of the module it is
            # bound to: a copy made while capturing (copy.deepcopy rebinds a bound method) runs
            # its own weights, not this module's
            @functools.wraps(type(module).forward)   # inspect.signature is unchanged
            def bound(this: nn.Module, *args: Any, **kwargs: Any) -> Any:
                return _dispatch(this, type(this).forward.__get__(this), hook_ids, args, kwargs)
            forward = types.MethodType(bound, module)

        module.__dict__["forward"] = forward
        self._wrapped.append((module, had, previous, forward))

    def unwrap(self) -> None:
        for module, had, previous, forward in reversed(self._wrapped):
            if module.__dict__.get("forward") is not forward:
                continue   # replaced since by someone else: theirs stays
            if had:
                module.__dict__["forward"] = previous
            else:
                del module.__dict__["forward"]
        self._wrapped.clear()
        self.hook_ids.clear()


def _dispatch(module: nn.Module, forward: Any, hook_ids: set[int], args: tuple,
              kwargs: dict) -> Any:
    if sys._getframe(2).f_code in _CALL_IMPL:   # module(...): its hooks have run
        return forward(*args, **kwargs)
    return _call_directly(module, forward, hook_ids, args, kwargs)


def _call_directly(module: nn.Module, forward: Any, ours: set[int], args: tuple,
                   kwargs: dict) -> Any:
    """What ``Module._call_impl`` does around ``forward``, with layerdiff's hooks alone (in the
    module's hook order, prepended ones first). They return nothing: the call is unchanged."""
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in ours:
            if hook_id in module._forward_pre_hooks_with_kwargs:
                hook(module, args, kwargs)
            else:
                hook(module, args)
    try:
        result = forward(*args, **kwargs)
    except Exception:
        for hook_id, hook in list(module._forward_hooks.items()):
            if hook_id in ours and hook_id in module._forward_hooks_always_called:
                try:
                    _run_forward_hook(module, hook_id, hook, args, kwargs, None)
                except Exception as exc:   # as torch does: the forward's error is the one
                    warnings.warn(f"forward hook raised after {type(module).__name__}.forward "
                                  f"raised: {exc}", stacklevel=2)
        raise
    for hook_id, hook in list(module._forward_hooks.items()):
        if hook_id in ours:
            _run_forward_hook(module, hook_id, hook, args, kwargs, result)
    return result


def _run_forward_hook(module: nn.Module, hook_id: int, hook: Any, args: tuple, kwargs: dict,
                      result: Any) -> None:
    if hook_id in module._forward_hooks_with_kwargs:
        hook(module, args, kwargs, result)
    else:
        hook(module, args, result)
