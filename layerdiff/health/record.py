"""The one instrumented run the training checks share: ``steps`` optimizer steps of a case on
its own batch (its inputs), through :func:`layerdiff.capture.run_case` with an observer, and
forward hooks on the ReLU-family activations.

Per step it keeps the loss, each layer's gradient norm and each layer's update ratio
‖Δθ‖/‖θ‖ (a layer is a module holding parameters of its own; its parameters are taken
together, so a zero-initialised bias does not make a ratio of its own infinite), and which
units of each ReLU-family module fired. Of the first step it keeps the model's output, the
site that produced the logits, and the loss the case's loss function gives for the same output
with every logit -ln C (uniform over the C classes, whether the output is read as logits or as
log-probabilities): what a model that knows nothing scores.

The model's parameters, buffers and the random state are put back as they were afterwards: a
health check leaves the case as it found it. A step whose loss or gradients are not finite
ends the run (``stopped``): the ``nonfinite`` check says where that came from.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn

import layerdiff.rng as rng
from layerdiff.capture.modules import ModuleHooks, is_leaf, named_modules
from layerdiff.capture.run import run_case
from layerdiff.case import Case
from layerdiff.errors import CaptureError, LayerdiffError
from layerdiff.trace import schema

# Activations whose output is exactly zero where a unit does not fire: a unit can be dead.
# (GELU, SiLU, LeakyReLU never output exactly zero over a range, so no unit of theirs is.)
RELU_FAMILY = (nn.ReLU, nn.ReLU6, nn.Threshold)


@dataclass
class Units:
    """One ReLU-family module: which units ever gave a non-zero output, over every sample
    (and position) of every step."""

    site: str
    type: str
    axis: int                 # the axis of its output that holds the units
    fired: np.ndarray         # bool per unit
    rows: int                 # outputs per unit in one forward (samples x positions)

    @property
    def dead(self) -> int:
        return int((~self.fired).sum())


@dataclass
class Logits:
    """The model's logits at step 0: how many classes (their last axis), the site that
    produced them, and the case's loss for uniform logits (NaN when it could not be
    computed)."""

    classes: int
    site: str | None
    uniform_loss: float
    loss_reads_logits: bool   # False: uniform logits gave the very same loss (the model's own)


@dataclass
class Record:
    steps: int                                # steps recorded (the finite ones)
    asked: int
    losses: list[float]
    layers: dict[str, list[str]]              # layer path -> its parameters' names
    grad_norms: dict[str, list[float]]        # layer -> per step (NaN: no gradient)
    grad_rms: dict[str, list[float]]          # the same over sqrt(elements)
    update_ratios: dict[str, list[float]]     # layer -> per step (NaN: undefined)
    frozen: list[str]                         # requires_grad False
    absent: list[str]                         # requires_grad, but no gradient at any step
    unmoved: list[str]                        # a gradient, but the optimizer never moved it
    zero: list[str]                           # a gradient, exactly zero at every step
    units: list[Units]
    logits: Logits | None
    stopped: str | None = None                # why the run ended before ``asked`` steps
    trained: bool = True                      # False: no optimizer, one backward only
    order: dict[str, int] = field(default_factory=dict)  # module path -> first call's end
    initial: float | None = None              # step 0's loss (finite), whatever came after

    def layer_of(self, parameter: str) -> str:
        """The layer (module path) that holds ``parameter``."""
        return next((layer for layer, names in self.layers.items() if parameter in names),
                    parameter.rpartition(".")[0])
    notes: list[str] = field(default_factory=list)


class _Stop(Exception):
    """Ends the run at a non-finite step."""


class _Observer:
    """run_case's observer: reads gradients after backward and weights around each step."""

    phase = ""

    def __init__(self, model: nn.Module, trained: bool) -> None:
        self.trained = trained
        self.named = [(name, p) for name, p in model.named_parameters()]
        owners: dict[str, list[str]] = {}
        for path, module in named_modules(model):
            for name, _ in module.named_parameters(recurse=False):
                full = name if path == schema.ROOT_MODULE else f"{path}.{name}"
                owners.setdefault(path, []).append(full)
        known = {name for name, _ in self.named}
        self.layers = {path: [n for n in names if n in known] for path, names in owners.items()}
        self.layers = {path: names for path, names in self.layers.items() if names}
        self.index = {name: i for i, (name, _) in enumerate(self.named)}
        self.losses: list[float] = []
        self.grad_sq: list[list[float]] = []      # per step, per parameter (NaN: none)
        self.delta_sq: list[list[float]] = []
        self.weight_sq: list[list[float]] = []
        self.before: list[torch.Tensor] = []
        self.stopped: str | None = None
        self.initial: float | None = None   # step 0's loss, kept if its backward then fails

    def begin_step(self, step: int) -> None:
        if self.trained:
            self.before = [p.detach().clone() for _, p in self.named]

    def record_loss(self, loss: torch.Tensor) -> None:
        value = float(loss.detach().double().sum())
        if not math.isfinite(value):
            self.stopped = f"the loss is {value} at step {len(self.losses)}"
            raise _Stop
        self.losses.append(value)
        if self.initial is None:
            self.initial = value

    def after_backward(self) -> None:
        norms = [p.grad.detach().double().square().sum() if p.grad is not None else None
                 for _, p in self.named]
        present = [n for n in norms if n is not None]
        values = iter(torch.stack(present).tolist() if present else [])
        row = [next(values) if n is not None else math.nan for n in norms]
        if any(n is not None and not math.isfinite(v) for n, v in zip(norms, row, strict=True)):
            self.stopped = f"a gradient is not finite at step {len(self.losses) - 1}"
            self.losses.pop()
            raise _Stop
        self.grad_sq.append(row)

    def end_step(self, step: int) -> None:
        if not self.trained:
            return
        sums = torch.stack([torch.stack([(p.detach() - b).double().square().sum(),
                                         b.double().square().sum()])
                            for (_, p), b in zip(self.named, self.before, strict=True)])
        pairs = sums.tolist()
        if not all(math.isfinite(d) for d, _ in pairs):
            self.stopped = f"a weight is not finite after the optimizer step {step}"
            self.losses.pop()
            self.grad_sq.pop()
            raise _Stop
        self.delta_sq.append([d for d, _ in pairs])
        self.weight_sq.append([w for _, w in pairs])


def _unit_axis(output: torch.Tensor) -> int:
    """Channels-first for images and volumes (4 or more axes: N, C, ...), else the last axis
    (features of a (batch, features) or (batch, positions, features) tensor)."""
    return 1 if output.dim() >= 4 else output.dim() - 1


class _UnitsWatch:
    """Which units fired: the output of each ReLU-family module, and the first input of every
    other leaf module that no watched module produced (a ``F.relu`` in a module's own code
    shows there, at the call that reads it), the model's own inputs excepted."""

    def __init__(self, model: nn.Module, inputs: list[torch.Tensor]) -> None:
        self.hooks = ModuleHooks()
        self.units: dict[str, Units] = {}
        self.calls: dict[str, int] = {}
        self.inputs = {id(t) for t in inputs}
        self.relu_outputs: set[int] = set()
        for path, module in named_modules(model):
            if isinstance(module, RELU_FAMILY):
                self.hooks.after(module, self._output_hook(path, type(module).__name__))
            elif is_leaf(module):
                self.hooks.before(module, self._input_hook(path, type(module).__name__))

    def _site(self, path: str) -> str:
        number = self.calls.get(path, 0)
        self.calls[path] = number + 1
        return schema.site_name(path, number)

    def _output_hook(self, path: str, kind: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            site = self._site(path)
            if isinstance(output, torch.Tensor) and output.dim() >= 1:
                self.relu_outputs.add(id(output))
                self._fired(site, kind, output)
        return hook

    def _input_hook(self, path: str, kind: str):
        def hook(module: nn.Module, args: tuple) -> None:
            site = self._site(path)
            value = args[0] if args else None
            if (isinstance(value, torch.Tensor) and value.dim() >= 2
                    and value.is_floating_point() and id(value) not in self.relu_outputs
                    and id(value) not in self.inputs):
                self._fired(f"{site} input", f"input of {kind}", value)
        return hook

    def _fired(self, site: str, kind: str, output: torch.Tensor) -> None:
        axis = _unit_axis(output)
        moved = output.detach().movedim(axis, -1).reshape(-1, output.shape[axis])
        fired = (moved != 0).any(dim=0).cpu().numpy()
        entry = self.units.get(site)
        if entry is None or entry.fired.shape != fired.shape:
            self.units[site] = Units(site, kind, axis, fired, int(moved.shape[0]))
        else:
            entry.fired |= fired

    def next_step(self) -> None:
        self.calls.clear()
        self.relu_outputs.clear()


class _OutputSites:
    """Step 0's forward: which site returned which tensor, to name the logits' producer."""

    def __init__(self, model: nn.Module) -> None:
        self.hooks = ModuleHooks()
        self.made: dict[int, tuple[str, torch.Tensor]] = {}
        self.calls: dict[str, int] = {}
        self.order: dict[str, int] = {}   # module path -> when its first call ended
        for path, module in named_modules(model):
            self.hooks.after(module, self._hook(path))

    def _hook(self, path: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            number = self.calls.get(path, 0)
            self.calls[path] = number + 1
            self.order.setdefault(path, len(self.order))
            if isinstance(output, torch.Tensor) and id(output) not in self.made:
                self.made[id(output)] = (schema.site_name(path, number), output)
        return hook


def logits_of(output: Any) -> torch.Tensor | None:
    """The logits in a model's output: the output itself when a tensor, its ``logits`` field
    (Hugging Face outputs), or the first tensor of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    found = getattr(output, "logits", None)
    if isinstance(found, torch.Tensor):
        return found
    if isinstance(output, (tuple, list)):
        return next((item for item in output if isinstance(item, torch.Tensor)), None)
    return None


def _with_uniform_logits(output: Any) -> Any:
    found = logits_of(output)
    zero = torch.full_like(found, -math.log(found.shape[-1]))
    if isinstance(output, torch.Tensor):
        return zero
    if isinstance(getattr(output, "logits", None), torch.Tensor):
        copied = copy.copy(output)
        copied["logits"] = zero  # a ModelOutput: the field and the key together
        return copied
    items = list(output)
    first = next(i for i, item in enumerate(items) if isinstance(item, torch.Tensor))
    items[first] = zero
    return type(output)(items)


def record(case: Case, steps: int) -> Record:
    """Run ``case`` for ``steps`` steps on its batch, observed; see the module docstring.
    With no optimizer, one forward and backward (nothing is updated)."""
    model = case.model
    trained = case.optimizer is not None
    steps = steps if trained else 1
    observer = _Observer(model, trained)
    items = case.inputs.values() if isinstance(case.inputs, dict) else case.inputs
    units = _UnitsWatch(model, [t for t in items if isinstance(t, torch.Tensor)])
    sites = _OutputSites(model)
    seen: dict[str, Any] = {}

    def loss_fn(output: Any) -> Any:
        loss = case.loss_fn(output)
        if "output" not in seen:
            seen["output"] = output
            seen["loss"] = float(loss.detach().double().sum())
            seen["uniform"] = _uniform_loss(case, output)
            sites.hooks.remove()
        units.next_step()
        return loss

    observed = dataclasses.replace(case, loss_fn=loss_fn)
    saved = [(t, t.detach().clone()) for t in [*model.parameters(), *model.buffers()]]
    try:
        devices = rng.cuda_devices([t for t, _ in saved])
        with rng.preserved(devices), units.hooks, sites.hooks:
            try:
                run_case(observed, steps=steps, observer=observer)
            except _Stop:
                pass
            except LayerdiffError:
                raise
            except Exception as exc:
                raise CaptureError(f"case {case.name}: the model raised {type(exc).__name__}: "
                                   f"{exc} during the health run's step "
                                   f"{len(observer.losses)}") from exc
    finally:
        with torch.no_grad():
            for tensor, value in saved:
                tensor.copy_(value)
        model.zero_grad(set_to_none=True)
    logits = _logits(seen, sites)
    sites.made.clear()
    found = _assemble(observer, units, logits, steps, trained)
    found.order = dict(sites.order)
    found.initial = observer.initial
    return found


def _uniform_loss(case: Case, output: Any) -> float:
    if logits_of(output) is None:
        return math.nan
    try:
        with torch.no_grad():
            return float(case.loss_fn(_with_uniform_logits(output)).detach().double().sum())
    except Exception:  # a loss that cannot take a replaced output: not judged that way
        return math.nan


def _logits(seen: dict[str, Any], sites: _OutputSites) -> Logits | None:
    output = seen.get("output")
    found = logits_of(output) if output is not None else None
    if found is None or found.dim() < 1:
        return None
    made = sites.made.get(id(found))
    uniform = seen["uniform"]
    return Logits(int(found.shape[-1]), made[0] if made else None, uniform,
                  not (math.isfinite(uniform) and uniform == seen["loss"]))


def _assemble(observer: _Observer, units: _UnitsWatch, logits: Logits | None, asked: int,
              trained: bool) -> Record:
    done = len(observer.grad_sq)
    grads = np.array(observer.grad_sq, dtype=np.float64).reshape(done, len(observer.named))
    deltas = np.array(observer.delta_sq[:done], dtype=np.float64).reshape(-1, len(observer.named))
    weights = np.array(observer.weight_sq[:done], dtype=np.float64).reshape(-1,
                                                                            len(observer.named))
    sizes = np.array([p.numel() for _, p in observer.named], dtype=np.float64)
    frozen = [name for name, p in observer.named if not p.requires_grad]
    learning = np.array([p.requires_grad for _, p in observer.named], dtype=bool)
    absent = [name for i, (name, _) in enumerate(observer.named)
              if learning[i] and done and np.isnan(grads[:, i]).all()]
    zero = [name for i, (name, _) in enumerate(observer.named)
            if learning[i] and done and not np.isnan(grads[:, i]).all()
            and np.nan_to_num(grads[:, i]).max() == 0.0]
    unmoved = [name for i, (name, _) in enumerate(observer.named)
               if learning[i] and trained and len(deltas) and np.nan_to_num(grads[:, i]).max() > 0
               and deltas[:, i].max() == 0.0]
    grad_norms, grad_rms, ratios = {}, {}, {}
    for layer, names in observer.layers.items():
        cols = [observer.index[n] for n in names if learning[observer.index[n]]]
        if not cols:
            continue
        block = grads[:, cols]
        has = ~np.isnan(block)
        total = np.where(has, block, 0.0).sum(axis=1)
        counted = (has * sizes[cols]).sum(axis=1)
        norm = np.where(has.any(axis=1), np.sqrt(total), np.nan)
        grad_norms[layer] = norm.tolist()
        grad_rms[layer] = np.where(counted > 0, norm / np.sqrt(np.maximum(counted, 1)),
                                   np.nan).tolist()
        if trained and len(deltas):
            moved = np.sqrt(deltas[:, cols].sum(axis=1))
            size = np.sqrt(weights[:, cols].sum(axis=1))
            with np.errstate(divide="ignore", invalid="ignore"):
                ratios[layer] = np.where(size > 0, moved / size, np.nan).tolist()
    return Record(done, asked, list(observer.losses[:done]), observer.layers, grad_norms,
                  grad_rms, ratios, frozen, absent, unmoved, zero,
                  list(units.units.values()), logits, observer.stopped, trained)
