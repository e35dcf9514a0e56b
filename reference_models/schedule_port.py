"""A learning-rate schedule bug: the port's step schedule switches one step early.

The reference trains the MLP with SGD (momentum 0.9) at learning rate 0.1 and drops it tenfold
after ``MILESTONE`` optimizer steps, the way ``torch.optim.lr_scheduler.MultiStepLR`` does when
``scheduler.step()`` follows ``optimizer.step()``. The port is the independent MLP port
(:mod:`reference_models.mlp_port`) trained with the same schedule, read one step ahead: the slip a
training loop makes when it steps the scheduler *before* the optimizer (PyTorch before 1.1 did
it this way; optax and Keras count steps from the update that is about to happen).

Every forward and backward agrees up to and including step ``MILESTONE - 1``; only that step's
optimizer update differs, so the first records out of tolerance are the weights at the start of
step ``MILESTONE``: what ``layerdiff diverge`` should find.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

import torch
from torch import nn

from layerdiff import Case

from . import mlp, mlp_port

LR, MOMENTUM, GAMMA = 0.1, 0.9, 0.1
MILESTONE = 3  # the reference's first update at the lower rate is the one of step 3
STEPS = 6


class StepScheduleSGD(torch.optim.SGD):
    """SGD whose learning rate is ``lr * gamma ** (milestones passed)``, set inside ``step()``.

    A Case has one optimizer factory and the step loop calls only ``step()``, so the schedule
    lives here. ``lookahead`` 1 reads the schedule one update ahead: the port's bug.
    """

    def __init__(self, params: Iterable[nn.Parameter], *, lr: float, momentum: float,
                 milestones: tuple[int, ...], gamma: float, lookahead: int = 0) -> None:
        super().__init__(params, lr=lr, momentum=momentum)
        self.base_lr, self.milestones, self.gamma = lr, milestones, gamma
        self.lookahead = lookahead
        self.updates = 0

    def rate(self, update: int) -> float:
        """The learning rate of update number ``update`` (from 0)."""
        return self.base_lr * self.gamma ** sum(update >= m for m in self.milestones)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        for group in self.param_groups:
            group["lr"] = self.rate(self.updates + self.lookahead)
        self.updates += 1
        return super().step(closure)


def schedule(lookahead: int = 0) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    return lambda params: StepScheduleSGD(params, lr=LR, momentum=MOMENTUM,
                                          milestones=(MILESTONE,), gamma=GAMMA,
                                          lookahead=lookahead)


def _scheduled(case: Case, name: str, lookahead: int = 0) -> Case:
    return dataclasses.replace(case, steps=STEPS, optimizer=schedule(lookahead),
                               name=f"reference_models.schedule_port:{name}")


def reference() -> Case:
    """The MLP trained for 6 steps, learning rate 0.1 dropping to 0.01 from step 3."""
    return _scheduled(mlp.reference(), "reference")


def port() -> Case:
    """The MLP port with the same schedule (correct)."""
    return _scheduled(mlp_port.port(), "port")


def bug_schedule_early() -> Case:
    """The MLP port whose schedule drops the rate one step early (at step 2's update)."""
    return _scheduled(mlp_port.port(), "bug_schedule_early", lookahead=1)
