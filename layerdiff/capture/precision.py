"""Running a case in another precision: its model and inputs cast, or its forward autocast.

A *baseline* is the reference run the way the port runs (``capture REF_CASE --dtype bfloat16``):
the error it shows against the reference is the error that precision is allowed.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from layerdiff.case import Case
from layerdiff.errors import CaptureError

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
AUTOCAST_DTYPES = ("bfloat16", "float16")


def cast_case(case: Case, dtype: str) -> None:
    """Cast ``case``'s floating parameters and buffers and its floating inputs to ``dtype``
    (in place). Integer inputs (token ids) and what the loss function holds stay as they are."""
    if dtype not in DTYPES:
        raise CaptureError(f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    target = DTYPES[dtype]
    case.model.to(target)  # floating parameters and buffers only, as nn.Module.to does
    case.inputs = _cast(case.inputs, target)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(dtype) if value.is_floating_point() else value
    if isinstance(value, tuple):
        return tuple(_cast(v, dtype) for v in value)
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    if isinstance(value, dict):
        return {key: _cast(v, dtype) for key, v in value.items()}
    return value


def autocast_context(case: Case, dtype: str | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on the model's device for the forward and the loss, or nothing."""
    if dtype is None:
        return contextlib.nullcontext()
    if dtype not in AUTOCAST_DTYPES:
        raise CaptureError(f"--autocast {dtype!r} is not one of {', '.join(AUTOCAST_DTYPES)}")
    return torch.autocast(device_type=_device_type(case), dtype=DTYPES[dtype])


def _device_type(case: Case) -> str:
    """Where the model computes: its parameters', else its buffers', else its inputs' device."""
    for tensor in (*case.model.parameters(), *case.model.buffers()):
        return tensor.device.type
    values = case.inputs.values() if isinstance(case.inputs, dict) else case.inputs
    return next((v.device.type for v in values if isinstance(v, torch.Tensor)), "cpu")


def model_dtype(case: Case) -> str:
    """The dtype of the model's first floating parameter ('' when it has none)."""
    for param in case.model.parameters():
        if param.is_floating_point():
            return str(param.dtype).removeprefix("torch.")
    return ""
