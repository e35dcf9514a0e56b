"""``layerdiff.monitor``: summary statistics of a user's own training loop, every K steps.

    with layerdiff.monitor(model, "run.h5", every=10) as m:
        for batch in loader:
            loss = loss_fn(model(batch)); loss.backward(); opt.step(); opt.zero_grad()
            m.step()                  # or monitor(..., optimizer=opt) and no m.step()

On a recorded step the monitor's hooks take statistics (tensor_stats.py) of every module
call's inputs and outputs, every parameter as the forward first sees it and every parameter's
gradient once it has accumulated. Between recorded steps no hook is installed at all: hooks
are registered when a recorded step begins and removed when the next step is not recorded, so
the other steps run the model's own code alone. The last ``window`` recorded steps are kept (a
few hundred numbers per module call: memory, not disk, until the end) and written at the end
as one trace (write.py) that ``layerdiff diff``, ``show`` and the browser read.
"""

from __future__ import annotations

import fnmatch
import os
import platform
from collections import deque
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch

from layerdiff.errors import CaptureError
from layerdiff.monitor.steps import StepRecord, StepRecorder
from layerdiff.monitor.tensor_stats import StepStatistics
from layerdiff.monitor.write import write_steps
from layerdiff.trace.schema import ROOT_MODULE, Pass, Role
from layerdiff.trace.writer import base_meta, check_writable


class Monitor:
    """A monitored training loop (see the module's docstring); use :func:`monitor`."""

    def __init__(self, model: torch.nn.Module, path: str | os.PathLike, *, every: int = 1,
                 window: int = 100, optimizer: torch.optim.Optimizer | None = None,
                 name: str | None = None, inputs: bool = True) -> None:
        if not isinstance(model, torch.nn.Module):
            raise CaptureError(f"monitor: the model is a {type(model).__name__}, not a "
                               "torch.nn.Module; pass the module you train")
        for label, value in (("every", every), ("window", window)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise CaptureError(f"monitor: {label}={value!r} is not a whole number of steps "
                                   "of at least 1")
        check_writable(path)
        self.path = Path(path)
        self.every = every
        self.window = window
        self.name = name or type(model).__name__
        # the inputs' statistics let the diff tell a site's own error from what came into it;
        # without them it names the first site out, and may name later ones too
        self.inputs = bool(inputs)
        self.step_number = 0  # the training step now running, from 0
        self._model = model
        self._optimizer = optimizer
        self._steps: deque[StepRecord] = deque(maxlen=window)
        self._dropped = 0
        self._marks: dict[int, Callable[[str], bool]] = {}
        self._stats = StepStatistics()
        self._current: StepRecorder | None = None
        self._handles: list[Any] = []
        self._closed: Path | None = None
        self._modules = [(path or ROOT_MODULE, module, type(module).__name__,
                          dict(module._parameters))
                         for path, module in model.named_modules()]
        self._params = [(n, p) for n, p in model.named_parameters()]
        self._owners = _owners(model)
        self._step_hook = (optimizer.register_step_post_hook(self._optimizer_stepped)
                           if optimizer is not None else None)
        self._begin()

    # ---- the loop's side ----
    def step(self) -> None:
        """The training step is over (after the optimizer's step): the next one begins."""
        if self._optimizer is not None:
            raise CaptureError("monitor: this monitor counts steps from its optimizer's "
                               "step(); leave out m.step() (or do not pass optimizer=)")
        self._advance()

    def mark(self, steps: int = 1, sites: Sequence[str] | None = None) -> None:
        """Keep this step in full (its tensors, not only their statistics), and the
        ``steps`` - 1 after it: the step now running if it has recorded nothing yet (mark
        before the forward), else the next. ``sites``: module paths or globs whose tensors
        are kept (default every module)."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise CaptureError(f"monitor.mark: steps={steps!r} is not a whole number of at "
                               "least 1")
        keeps = _site_predicate(sites)
        started = self._current is not None and self._current.record.records
        first = self.step_number + (1 if started else 0)
        for step in range(first, first + steps):
            self._marks[step] = keeps
        if not started:
            self._end(keep=False)  # begin the current step again, now in full
            self._begin()

    def close(self, complete: bool = True) -> Path:
        """Write the window: published under its name when ``complete``, else left
        ``NAME.partial`` (a loop that raised), which readers refuse unless asked."""
        if self._closed is not None:
            return self._closed
        if self._step_hook is not None:
            self._step_hook.remove()
        if self._current is not None and self._current.record.records:
            self._end(keep=True, finished=complete)
        else:
            self._end(keep=False)
        self._remove_hooks()
        self._closed = write_steps(self.path, self._steps, self._meta(), complete=complete)
        return self._closed

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(complete=exc_type is None)

    # ---- steps ----
    def _records(self, step: int) -> bool:
        return step % self.every == 0 or step in self._marks

    def _optimizer_stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._advance()

    def _advance(self) -> None:
        if self._closed is not None:
            raise CaptureError(f"monitor: {self.path} was already written; step() after the "
                               "with block records nothing")
        self._end(keep=True)
        self.step_number += 1
        self._begin()

    def _begin(self) -> None:
        step = self.step_number
        if not self._records(step):
            self._remove_hooks()
            return
        self._stats.reset()
        self._current = StepRecorder(self._stats, self._owners, step, self._marks.get(step))
        if not self._handles:
            self._install_hooks()

    def _end(self, *, keep: bool, finished: bool = True) -> None:
        """Finish the current recorded step (kept in the window when ``keep``); hooks stay
        installed while the next step is recorded too (installing costs more than a step of a
        small model)."""
        current, self._current = self._current, None
        if current is None:
            return
        if not keep:
            return
        if current.record.full and not current.record.records and not current.stack:
            # mark() came after this step's forward, which ran unhooked (a step off the
            # grid): the mark is the next step's, as mark() promises; this one saw no call
            self._mark_next(current.record.step)
            return
        self._marks.pop(current.record.step, None)
        if not current.has_gradients:  # no backward seen through the model's output
            current.take_gradients(self._params)
        current.close_gradients(f"{ROOT_MODULE}#0")
        for site, module, type_name, call, enter, parent in reversed(current.stack):
            current.record.sites.append(_site_row(site, module, type_name, call, parent,
                                                  enter, -1))  # a call that raised
        if len(self._steps) == self._steps.maxlen:
            self._dropped += 1
        self._steps.append(current.finish())
        if not self._records(self.step_number + 1) or not finished:
            self._remove_hooks()

    def _mark_next(self, step: int) -> None:
        """Move ``step``'s mark one step on: after the marks that follow it (mark(steps=N))."""
        keeps = self._marks.pop(step)
        later = step + 1
        while later in self._marks:
            later += 1
        self._marks[later] = keeps

    # ---- hooks (installed on recorded steps only) ----
    def _install_hooks(self) -> None:
        handles = self._handles
        for path, module, type_name, own in self._modules:
            handles.append(module.register_forward_pre_hook(
                partial(self._pre, path, type_name, own), with_kwargs=True))
            handles.append(module.register_forward_hook(partial(self._post, path)))

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _pre(self, path: str, type_name: str, own: dict[str, Any], module: torch.nn.Module,
             args: tuple, kwargs: dict) -> None:
        current = self._current
        if current is None:
            return
        if not current.weights_taken:
            current.take_weights(self._params)
        call = current.calls.get(path, 0)
        current.calls[path] = call + 1
        site = f"{path}#{call}"
        parent = current.stack[-1][0] if current.stack else ""
        current.stack.append((site, path, type_name, call, len(current.record.records), parent))
        if call == 0:
            current.weights_of(path, site, own)
        if self.inputs:
            current.tensors(Pass.FORWARD, site, Role.INPUT, path, args)
            if kwargs:
                current.tensors(Pass.FORWARD, site, Role.INPUT, path, kwargs)

    def _post(self, path: str, module: torch.nn.Module, args: tuple, output: Any) -> None:
        current = self._current
        if current is None or not current.stack or current.stack[-1][1] != path:
            return
        site, _, type_name, call, enter, parent = current.stack.pop()
        current.tensors(Pass.FORWARD, site, Role.OUTPUT, path, output)
        if not current.stack:  # the outermost call
            if call == 0:
                current.uncalled_weights(self._params, site, path)
            current.forward_done()
            self._watch_backward(output)
        current.record.sites.append(_site_row(site, path, type_name, call, parent, enter,
                                              len(current.record.records)))

    def _watch_backward(self, output: Any) -> None:
        """A hook on the outermost call's output: when a backward reaches it, the gradients
        are taken once that backward is over (one callback, not a hook per parameter)."""
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(self._backward_started)

    def _backward_started(self, grad: torch.Tensor) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        if self._current is not None:
            self._current.take_gradients(self._params)

    # ---- the file ----
    def _meta(self) -> dict[str, Any]:
        meta = base_meta("layerdiff.monitor")
        first = next(self._model.parameters(), None)
        meta["versions"]["torch"] = torch.__version__
        meta.update({
            "case": self.name,
            "seed": None,
            "device": str(first.device) if first is not None else "cpu",
            "steps": self.step_number,
            "machine": platform.machine(),
            "num_threads": torch.get_num_threads(),
            "model_dtype": str(first.dtype).removeprefix("torch.") if first is not None
            else None,
            "uncalled_weights": "root",
            "recorded_steps": [record.step for record in self._steps],
            "monitor": {"every": self.every, "window": self.window, "inputs": self.inputs,
                        "dropped_steps": self._dropped,
                        "full_steps": [r.step for r in self._steps if r.full]},
        })
        return meta


def monitor(model: torch.nn.Module, path: str | os.PathLike, *, every: int = 1,
            window: int = 100, optimizer: torch.optim.Optimizer | None = None,
            name: str | None = None, inputs: bool = True) -> Monitor:
    """Monitor ``model``'s training loop into the trace ``path``: statistics of every module
    call's inputs and outputs, every parameter and its gradient, every ``every`` steps,
    keeping the last ``window`` recorded steps. Use as a context manager; call ``m.step()``
    after each optimizer step, or pass ``optimizer=`` to count its steps. ``m.mark()`` keeps a
    step's tensors in full. ``inputs=False`` leaves out the calls' inputs (cheaper; the diff
    then cannot tell a site's own error from what came into it). See docs/monitor.md."""
    return Monitor(model, path, every=every, window=window, optimizer=optimizer, name=name,
                   inputs=inputs)


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    """The first tensor of an output that a backward can reach."""
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else (
        output if isinstance(output, (tuple, list)) else ())
    for value in values:
        if isinstance(value, torch.Tensor) and value.requires_grad:
            return value
    return None


def _site_row(site: str, module: str, type_name: str, call: int, parent: str, enter: int,
              exit_: int) -> dict[str, Any]:
    return {"site": site, "module": module, "call": call, "type": type_name,
            "parent": parent, "enter": enter, "exit": exit_}


def _owners(model: torch.nn.Module) -> dict[int, tuple[str, str]]:
    """Each parameter's owner: the first module in named_modules() order holding it, and its
    name there (a capture records a tied weight once, at that module)."""
    owners: dict[int, tuple[str, str]] = {}
    for path, module in model.named_modules():
        for name, param in module._parameters.items():
            if param is not None and id(param) not in owners:
                owners[id(param)] = (path or ROOT_MODULE, name)
    return owners


def _site_predicate(sites: Sequence[str] | None) -> Callable[[str], bool]:
    if sites is None:
        return lambda module: True
    if isinstance(sites, str):
        sites = [sites]
    globs = [s.rpartition("#")[0] if "#" in s else s for s in sites]
    return lambda module: any(fnmatch.fnmatchcase(module, g) for g in globs)
