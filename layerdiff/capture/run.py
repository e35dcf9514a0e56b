"""Running a case: the training-step loop shared by plain runs and captures."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from layerdiff.capture.precision import autocast_context
from layerdiff.case import Case, check_loss_scale, check_scaled_loss, seed_everything
from layerdiff.errors import CaptureError


class StepObserver(Protocol):
    """What a capture needs to know about the loop; every method is optional to act on."""

    phase: str

    def begin_step(self, step: int) -> None: ...
    def record_loss(self, loss: torch.Tensor) -> None: ...
    def after_backward(self) -> None: ...
    def end_step(self, step: int) -> None: ...


@dataclass
class RunResult:
    losses: list[torch.Tensor]
    output: Any


def check_run_options(case: Case, steps: int, loss_scale: float) -> None:
    if steps < 1:
        raise CaptureError(f"--steps must be at least 1 (got {steps}) for case {case.name}")
    if steps > 1 and case.optimizer is None:
        raise CaptureError(f"case {case.name} has no optimizer, so it cannot run {steps} steps; "
                           "give the Case an optimizer or use --steps 1")
    widest = "float64" if any(param.dtype == torch.float64
                              for param in case.model.parameters()) else "float32"
    check_loss_scale(loss_scale, widest)


def step_context(case: Case) -> contextlib.AbstractContextManager:
    """The context the case's forward, loss and backward run in (``Case.step_context``)."""
    made = getattr(case, "step_context", None)
    return made() if made is not None else contextlib.nullcontext()


def run_case(case: Case, *, steps: int | None = None, loss_scale: float = 1.0,
             observer: StepObserver | None = None, autocast: str | None = None) -> RunResult:
    """Run ``steps`` training steps of ``case`` (its own count by default) from its seed.

    With ``loss_scale`` F the loss is multiplied by F before backward and the gradients are
    divided by F again before clipping and the optimizer step, so training is unaffected
    (bit for bit when F is a power of two). ``autocast`` ("bfloat16" or "float16") runs the
    forward and the loss under ``torch.autocast``.
    """
    steps = case.steps if steps is None else steps
    check_run_options(case, steps, loss_scale)
    seed_everything(case.seed)
    model = case.model
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = case.optimizer(params) if case.optimizer else None
    losses: list[torch.Tensor] = []
    output = None
    for step in range(steps):
        if observer:
            observer.begin_step(step)
            observer.phase = "forward"
        if optimizer is not None:
            optimizer.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        with step_context(case):
            with autocast_context(case, autocast):
                output = case.call_model()
                loss = case.loss_fn(output)
            if observer:
                observer.phase = "loss"
                observer.record_loss(loss)
                observer.phase = "backward"
            if loss_scale != 1.0:
                scaled = loss * loss_scale
                # both sums in one read: one wait for the device a step, not two
                sums = torch.stack([loss.detach().double().sum(),
                                    scaled.detach().double().sum()])
                check_scaled_loss(case.name, step, *sums.tolist(),
                                  str(scaled.dtype).removeprefix("torch."), loss_scale)
                scaled.backward()
            else:
                loss.backward()
        if observer:
            observer.after_backward()
            observer.phase = "optimizer step"
        if loss_scale != 1.0:
            for param in params:
                if param.grad is not None:
                    param.grad.div_(loss_scale)
        if case.clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, case.clip_grad_norm)
        if optimizer is not None:
            optimizer.step()
        losses.append(loss.detach())
        if observer:
            observer.end_step(step)
    return RunResult(losses, output)
