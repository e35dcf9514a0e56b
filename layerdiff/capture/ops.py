"""Op-level capture: the tensor operations a module's own code runs, recorded as op sites.

Inside every call of a module selected with ``--ops GLOB``, each torch function, tensor method
and operator its own ``forward`` runs (and each custom ``torch.autograd.Function``, under its
class name) is recorded like a module call: inputs, outputs, the gradient arriving at its
outputs and the gradient it sends to its inputs, under the op site
``<module site>/<op>#<k>`` (``blocks.0.attn#0/softmax#0``: the k-th ``softmax`` of that call).

How ops are seen and attributed:
- a :class:`torch.overrides.TorchFunctionMode`, on while a selected module's call runs, sees
  every torch-level call (operators arrive as their methods: ``a @ b`` is ``matmul``, ``x += y``
  is ``add_``); while it handles one, torch runs the call with the mode off, so what an op does
  inside is not seen again;
- custom autograd functions do not pass through the mode (their ``forward`` runs as plain ops
  under it), so ``Function.apply`` is wrapped while a capture with ops runs;
- a stack of frames, one per module call, pushed by a pre-hook that runs before every other
  and popped by a hook that runs after every other, says whose code runs: an op is recorded
  only when the innermost call is a selected module's and its own forward is running, so ops
  of a child module are the child's, and the recorder's own hooks are never seen as ops.

Parameters passed to an op are not recorded with it (the module records them once, as its
weights); arguments that are not tensors are not recorded. Views and metadata-only ops
(:data:`VIEW_OPS`) are skipped unless ``all_ops``; ops that return no tensor are never recorded.
"""

from __future__ import annotations

import fnmatch
import threading
from collections import Counter
from collections.abc import Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from functools import partial
from itertools import chain
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from layerdiff.capture.hooks import ModuleRecorder, flatten
from layerdiff.capture.modules import ModuleHooks, module_paths, named_modules
from layerdiff.errors import CaptureError
from layerdiff.trace import schema

# Skipped unless --ops-all: they return their input's own values, rearranged or relabelled, so
# an error cannot begin in them (a wrong index can: keep them with --ops-all to see it).
VIEW_OPS = frozenset({
    "view", "view_as", "reshape", "reshape_as", "transpose", "transpose_", "permute", "t",
    "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "expand_as", "contiguous",
    "split", "split_with_sizes", "chunk", "unbind", "narrow", "select", "getitem", "movedim",
    "moveaxis", "swapaxes", "swapdims", "as_strided", "detach", "detach_", "requires_grad_",
    "broadcast_to", "unfold", "diagonal", "real", "imag", "view_as_real", "view_as_complex",
})
# Never recorded: their outputs hold no values yet (uninitialised memory), or they are not ops.
_DESCRIPTORS = ("__get__", "__set__", "__delete__")
NEVER = frozenset({*_DESCRIPTORS,
    "empty", "empty_like", "new_empty", "empty_strided", "new_empty_strided", "backward",
    "register_hook", "retain_grad", "numpy", "tolist", "item", "data_ptr", "untyped_storage",
})
# Operators under their method names: ``a + b`` and ``torch.add(a, b)`` are one op.
_OPERATORS = {"truediv": "div", "floordiv": "floor_divide", "mod": "remainder",
              "and": "bitwise_and", "or": "bitwise_or", "xor": "bitwise_xor",
              "invert": "bitwise_not", "neg": "neg", "abs": "abs", "lshift": "bitwise_left_shift",
              "rshift": "bitwise_right_shift"}
_REFLECTED = frozenset({"add", "sub", "mul", "matmul", "div", "truediv", "floordiv", "mod", "pow",
                        "and", "or", "xor", "lshift", "rshift"})


def op_name(func: Any) -> str:
    """The name an op site carries: ``softmax``, ``add_``, ``div`` for ``a / b``, ``setitem``."""
    name = getattr(func, "__name__", None) or type(func).__name__
    if name in _DESCRIPTORS:
        return name                                  # x.T, x.shape: attributes, not ops
    if name.startswith("__") and name.endswith("__") and len(name) > 4:
        bare = name[2:-2]
        if bare.startswith("r") and bare[1:] in _REFLECTED:
            bare = bare[1:]                      # 2 * x is mul, like x * 2
            return _OPERATORS.get(bare, bare)
        if bare.startswith("i") and bare[1:] in _REFLECTED:
            return _OPERATORS.get(bare[1:], bare[1:]) + "_"     # x += y is add_
        return _OPERATORS.get(bare, bare)
    return name


def _in_place(name: str, kwargs: dict) -> bool:
    return (name.endswith("_") and not name.startswith("_")) or name == "setitem" \
        or kwargs.get("out") is not None


@dataclass(slots=True)
class _Frame:
    """One module call on the stack: whose code is running."""

    site: str | None = None       # the recorded module site, when its ops are recorded
    recording: bool = False       # its own forward is running (not its hooks, not a child)
    counts: Counter = field(default_factory=Counter)   # op name -> calls so far in this call


# The recorder whose capture runs in this thread: the wrapped Function.apply asks it. A context
# variable, so that two captures in two threads never see each other's.
_ACTIVE: ContextVar[OpRecorder | None] = ContextVar("layerdiff_op_recorder", default=None)
_APPLY_LOCK = threading.Lock()
_apply_users = 0
# Function.__dict__["apply"] as it was: a classmethod in torch 2.13, the C classmethod
# descriptor in 2.14 (which has no __func__); __get__(None, cls) binds either to cls
_original_apply: Any = None


def _recorded_apply(cls: type, *args: Any, **kwargs: Any) -> Any:
    recorder = _ACTIVE.get()
    if recorder is None:
        return _original_apply.__get__(None, cls)(*args, **kwargs)
    return recorder.custom_function(cls, args, kwargs)


def _wrap_apply() -> None:
    global _apply_users, _original_apply
    with _APPLY_LOCK:
        if _apply_users == 0:
            _original_apply = torch.autograd.Function.__dict__["apply"]
            torch.autograd.Function.apply = classmethod(_recorded_apply)
        _apply_users += 1


def _unwrap_apply() -> None:
    global _apply_users
    with _APPLY_LOCK:
        _apply_users -= 1
        if _apply_users == 0:
            torch.autograd.Function.apply = _original_apply


def select_op_modules(model: nn.Module, globs: Sequence[str],
                      recorded: Sequence[tuple[str, nn.Module]]) -> set[str]:
    """Module paths whose own ops are recorded; a glob that matches no module, or only modules
    the capture leaves out (--include / --exclude), is an error."""
    paths = module_paths(model)
    kept = {path for path, _ in recorded}
    chosen: set[str] = set()
    for glob in globs:
        matched = [path for path in paths if fnmatch.fnmatchcase(path, glob)]
        if not matched:
            raise CaptureError(f"--ops {glob!r} matches no module of {type(model).__name__}; "
                               f"module paths look like: {', '.join(paths[:8])}")
        inside = [path for path in matched if path in kept]
        if not inside:
            raise CaptureError(f"--ops {glob!r} matches only modules that --include/--exclude "
                               f"leave out ({', '.join(matched[:4])}); an op site nests under "
                               "its module's site, so record those modules too")
        chosen.update(inside)
    return chosen


class _Mode(TorchFunctionMode):
    def __init__(self, recorder: OpRecorder) -> None:
        super().__init__()
        self.recorder = recorder

    def __torch_function__(self, func, types, args=(), kwargs=None):
        frames = self.recorder.frames
        if frames and frames[-1].recording:
            return self.recorder.op(func, args, kwargs or {})
        return func(*args, **(kwargs or {}))


class OpRecorder:
    """Records the ops of the selected modules' own code through ``hooks`` (the capture's
    :class:`ModuleRecorder`: same stager, step, site rows and backward hooks)."""

    def __init__(self, model: nn.Module, hooks: ModuleRecorder, globs: Sequence[str], *,
                 all_ops: bool = False) -> None:
        self.model = model
        self.hooks = hooks
        self.selected = select_op_modules(model, globs, hooks.modules)
        self.skipped = NEVER if all_ops else NEVER | VIEW_OPS
        self.frames: list[_Frame] = []
        self._names: dict[Any, str] = {}     # func -> op name (one lookup per distinct func)
        # a module called as child.forward(...) runs these hooks too
        self._hooks = ModuleHooks(hooks.direct)
        self._mode = _Mode(self)
        self._depth = 0      # selected calls running: the mode is on while any is
        self._token = None

    # ---- lifecycle: attach after the ModuleRecorder, so these hooks wrap its hooks ----
    def attach(self) -> None:
        hooks = self._hooks
        try:
            for path, module in named_modules(self.model):
                hooks.before(module, self._push, prepend=True)
                if path in self.selected:
                    hooks.before(module, self._start)
                    hooks.after(module, self._stop, prepend=True, always_call=True)
                hooks.after(module, self._pop, always_call=True)
        except BaseException:   # no hook outlives a failed attach
            hooks.remove()
            raise
        _wrap_apply()
        self._token = _ACTIVE.set(self)

    def detach(self) -> None:
        if self._token is None:
            return
        while self._depth:   # a forward that raised left the mode on
            self._leave()
        _ACTIVE.reset(self._token)
        self._token = None
        _unwrap_apply()
        self._hooks.remove()
        self.frames.clear()

    def begin_step(self) -> None:
        self.frames.clear()   # a step that raised may have left frames behind

    # ---- frames ----
    def _push(self, module: nn.Module, args: tuple) -> None:
        self.frames.append(_Frame())

    # The mode is on only while a selected call runs: every torch call under it pays a Python
    # dispatch (measured: 3-4 us), and a step makes thousands outside the selected modules.
    def _start(self, module: nn.Module, args: tuple) -> None:
        hooks = self.hooks
        if hooks.recording and hooks.open and self.frames:
            frame = self.frames[-1]
            frame.site, frame.recording = hooks.open[-1].site, True
            if self._depth == 0:
                self._mode.__enter__()
            self._depth += 1

    def _stop(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.frames and self.frames[-1].recording:
            self.frames[-1].recording = False
            self._leave()

    def _leave(self) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(None, None, None)

    def _pop(self, module: nn.Module, args: tuple, output: Any) -> None:
        if self.frames:
            self.frames.pop()

    # ---- recording ----
    def _name(self, func: Any) -> str:
        name = self._names.get(func)
        if name is None:
            name = self._names[func] = op_name(func)
        return name

    def op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """Run one torch-level call of a recorded module's own code, recording it."""
        name = self._name(func)
        if name in self.skipped:
            return func(*args, **kwargs)
        return self._record(self.frames[-1], name, partial(func, *args, **kwargs), args,
                            kwargs)

    def custom_function(self, cls: type, args: tuple, kwargs: dict) -> Any:
        """``cls.apply(*args, **kwargs)``, recorded as op ``cls.__name__`` when a recorded
        module's own code calls it; the ops of its forward are its own, not recorded."""
        apply = partial(_original_apply.__get__(None, cls), *args, **kwargs)
        frames = self.frames
        if not (frames and frames[-1].recording):
            return apply()
        # The mode is on here (apply does not pass through it): a frame that records nothing
        # hides the ops of the function's forward and the copies that record it.
        frame = frames[-1]
        frames.append(_Frame())
        try:
            return self._record(frame, cls.__name__, apply, args, kwargs)
        finally:
            frames.pop()

    def _record(self, frame: _Frame, name: str, call: Any, args: tuple, kwargs: dict) -> Any:
        hooks = self.hooks
        inputs = [(arg, value) for arg, value in chain(
            flatten(args, ""), *(flatten(v, k) for k, v in kwargs.items()))
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter)]
        k = frame.counts[name]
        site = schema.op_site_name(frame.site, name, k)
        opened = hooks.open_call(site, schema.split_site(site)[0], k, name, frame.site)
        in_place = _in_place(name, kwargs)
        if in_place:  # the op changes its input: record it before it runs
            hooks.record_inputs(opened, inputs)
        result = call()
        outputs = [(arg, value) for arg, value in flatten(result, "")
                   if isinstance(value, torch.Tensor)]
        if result is None and name == "setitem" and args:
            outputs = [("0", args[0])]
        if not outputs:
            return result   # size(), dim(), bool(): not an op on values
        frame.counts[name] = k + 1
        if not in_place:  # unchanged by the op: recorded now, with its outputs
            hooks.record_inputs(opened, inputs)
        hooks.finish_call(opened, outputs)
        return result
