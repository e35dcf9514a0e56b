"""What every bundled port shares: a port case is its reference case with the model swapped."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import nn

from layerdiff import Case


def port_case(reference: Callable[[], Case], build_port: Callable[[nn.Module], nn.Module],
              name: str) -> Case:
    """The reference case (same inputs, loss, seed, optimizer) running a port instead.

    ``build_port`` gets the reference model and returns the port holding the reference's
    weights, so a port case compares with its reference as it stands. (Once mapping files
    exist, ``layerdiff capture --weights-from`` does the same from a trace.)
    """
    case = reference()
    with torch.no_grad():
        model = build_port(case.model)
    return dataclasses.replace(case, model=model, name=name)


def copy_state(target: nn.Module, source: nn.Module) -> nn.Module:
    """Load ``source``'s parameters and buffers into ``target`` with the same names."""
    target.load_state_dict(source.state_dict(), strict=True)
    return target
