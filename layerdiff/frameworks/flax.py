"""Flax NNX behind the framework interface: every submodule call recorded through custom-VJP
taps (:mod:`layerdiff.flax.capture`), weights set through a mapping
(:mod:`layerdiff.flax.weights`), layers replayed as pure functions under ``jax.vjp``
(:mod:`layerdiff.replay.flax_replay`). JAX is imported only once a Flax case is in hand."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from layerdiff.errors import CaseError

if TYPE_CHECKING:
    from layerdiff.options import CaptureOptions
    from layerdiff.weights import WeightsReport


class FlaxFramework:
    name = "flax"
    title = "a Flax model"
    records_itself = False

    def check_case(self, case: Any) -> None:
        if case.optimizer is not None and not (hasattr(case.optimizer, "init")
                                               and hasattr(case.optimizer, "update")):
            raise CaseError(f"case {case.name or '?'}: a Flax model's optimizer must be "
                            "an optax GradientTransformation (optax.sgd(0.1)), got "
                            f"{type(case.optimizer).__name__}")
        from flax import nnx

        if not isinstance(case.model, nnx.Module):
            raise CaseError(f"case {case.name or '?'}: {type(case.model).__name__} is a "
                            "Flax Linen module, which layerdiff does not capture (its "
                            "parameters live outside the module and its submodules exist "
                            "only during apply); port it to flax.nnx, or record it with "
                            "an ExternalCase")

    def cast(self, case: Any, dtype: str) -> None:
        from layerdiff.flax.capture import cast_nnx_case

        cast_nnx_case(case, dtype)

    def load_weights(self, case: Any, trace: str | os.PathLike, mapping: Any) -> WeightsReport:
        from layerdiff.flax.weights import load_nnx_weights

        return load_nnx_weights(case.model, trace, mapping)

    def capture(self, case: Any, path: str | os.PathLike, options: CaptureOptions) -> Path:
        from layerdiff.flax.capture import capture_nnx

        return capture_nnx(case, path, options)

    def replay_port(self, case: Any, reference: Any, mapping: Any) -> Any:
        from layerdiff.replay.flax_replay import FlaxPort

        self.load_weights(case, reference.path, mapping)
        port = FlaxPort(case.model, reference)
        port.watch_uses(case)
        return port

    def port_model(self, case: Any, command: str) -> Any:
        from layerdiff.replay.ports import FlaxModel

        return FlaxModel(case)

    def as_array(self, tensor: Any) -> Any:
        from layerdiff.flax.port import as_jax

        return as_jax(tensor)


FRAMEWORK = FlaxFramework()
