"""Torch behind the framework interface: hooks on ``torch.nn.Module`` calls
(:mod:`layerdiff.capture.torch_capture`), weights set through a mapping
(:mod:`layerdiff.weights`), layers replayed by :class:`~layerdiff.replay.torch_replay.TorchPort`."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerdiff.errors import CaseError

if TYPE_CHECKING:
    from layerdiff.options import CaptureOptions
    from layerdiff.weights import WeightsReport


class TorchFramework:
    name = "torch"
    title = "a torch model"
    records_itself = False

    def owns(self, case: Any) -> bool:
        nn = sys.modules.get("torch.nn")
        return nn is not None and isinstance(getattr(case, "model", case), nn.Module)

    def check_case(self, case: Any) -> None:
        if getattr(case, "jit", False) or getattr(case, "params", None) is not None:
            which = "jit" if getattr(case, "jit", False) else "params"
            raise CaseError(f"case {case.name or '?'}: {which} is for a Flax model (jit runs its "
                            "step under jax.jit; params holds a Linen module's variables); a "
                            "torch model holds its own parameters and compiles itself "
                            "(torch.compile in the case)")

    def cast(self, case: Any, dtype: str) -> None:
        from layerdiff.capture.precision import cast_case

        cast_case(case, dtype)

    def load_weights(self, case: Any, trace: str | os.PathLike, mapping: Any) -> WeightsReport:
        from layerdiff.weights import load_weights

        return load_weights(case.model, trace, mapping)

    def capture(self, case: Any, path: str | os.PathLike, options: CaptureOptions) -> Path:
        from layerdiff.capture.torch_capture import capture_torch

        return capture_torch(case, path, options)

    def replay_port(self, case: Any, reference: Any, mapping: Any) -> Any:
        from layerdiff.replay.torch_replay import TorchPort

        self.load_weights(case, reference.path, mapping)
        port = TorchPort(case.model, reference)
        port.watch_uses(case.model, case.call_model)
        return port

    def port_model(self, case: Any, command: str) -> Any:
        from layerdiff.replay.ports import TorchModel

        return TorchModel(case)

    def as_array(self, tensor: Any) -> Any:
        return tensor

    def run_checked(self, case: Any, writer: Any, steps: int) -> None:
        # nan hooks a torch model's modules itself (layerdiff.debug.nan._TorchWatch)
        raise CaseError(f"case {case.name or '?'} is a torch model, which nan checks through "
                        "its own hooks, not through a checking writer")

    def nan_op(self, case: Any, result: Any) -> None:
        return None  # op-level capture could say; not done yet

    def swap_donor(self, case: Any) -> None:
        return None  # its layers go into a torch reference as they are


FRAMEWORK = TorchFramework()
