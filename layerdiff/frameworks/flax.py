"""Flax behind the framework interface, NNX and Linen alike: every submodule call recorded
through custom-VJP taps (:mod:`layerdiff.flax.capture`; Linen's through its method interceptor,
:mod:`layerdiff.flax.linen`), weights set through a mapping (:mod:`layerdiff.flax.weights`; a
Linen case's ``params`` replaced), layers replayed as pure functions under ``jax.vjp``
(:mod:`layerdiff.flax.replay`, :mod:`layerdiff.flax.linen_replay`). JAX is imported
only once a Flax case is in hand.

Linen is dispatched here rather than given a framework of its own: both write the same trace
(meta ``framework = "flax"``), take the same options, mappings and call adapters (JAX arrays),
so a trace's framework names one implementation whichever API made the port."""

from __future__ import annotations

import os
import sys
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

    def owns(self, case: Any) -> bool:
        # a Flax module exists only once flax is imported: a torch model never pays for JAX
        model = getattr(case, "model", case)
        nnx, linen = sys.modules.get("flax.nnx"), sys.modules.get("flax.linen")
        return ((nnx is not None and isinstance(model, nnx.Module))
                or (linen is not None and isinstance(model, linen.Module)))

    def check_case(self, case: Any) -> None:
        if case.optimizer is not None and not (hasattr(case.optimizer, "init")
                                               and hasattr(case.optimizer, "update")):
            raise CaseError(f"case {case.name or '?'}: a Flax model's optimizer must be "
                            "an optax GradientTransformation (optax.sgd(0.1)), got "
                            f"{type(case.optimizer).__name__}")
        if _is_linen(case.model):
            from layerdiff.flax.linen import check_variables

            check_variables(case)
            if getattr(case, "jit", False):
                raise CaseError(f"case {case.name or '?'}: jit runs a Flax NNX port's step "
                                "under jax.jit; a Linen port's capture runs eagerly for now: "
                                "leave jit out")
        elif getattr(case, "params", None) is not None:
            raise CaseError(f"case {case.name or '?'}: {type(case.model).__name__} is a Flax "
                            "NNX module, which holds its own variables: leave the Case's "
                            "params out (it is for a Linen module's variables dict)")

    def cast(self, case: Any, dtype: str) -> None:
        if _is_linen(case.model):
            from layerdiff.flax.linen import cast_linen_case

            return cast_linen_case(case, dtype)
        from layerdiff.flax.capture import cast_nnx_case

        cast_nnx_case(case, dtype)

    def load_weights(self, case: Any, trace: str | os.PathLike, mapping: Any) -> WeightsReport:
        if _is_linen(case.model):
            from layerdiff.flax.linen import load_linen_weights

            return load_linen_weights(case, trace, mapping)
        from layerdiff.flax.weights import load_nnx_weights

        return load_nnx_weights(case.model, trace, mapping)

    def capture(self, case: Any, path: str | os.PathLike, options: CaptureOptions) -> Path:
        if _is_linen(case.model):
            from layerdiff.flax.linen import capture_linen

            return capture_linen(case, path, options)
        from layerdiff.flax.capture import capture_nnx

        return capture_nnx(case, path, options)

    def replay_port(self, case: Any, reference: Any, mapping: Any) -> Any:
        self.load_weights(case, reference.path, mapping)
        if _is_linen(case.model):
            from layerdiff.flax.linen import LinenGraph, jax_inputs, plain
            from layerdiff.flax.linen_replay import LinenPort

            graph = LinenGraph.of(case.model, plain(case.params), jax_inputs(case.inputs))
            return LinenPort(graph, lambda: case.params, reference)
        from layerdiff.flax.replay import FlaxPort

        port = FlaxPort(case.model, reference)
        port.watch_uses(case)
        return port

    def port_model(self, case: Any, command: str) -> Any:
        if _is_linen(case.model):
            from layerdiff.flax.linen_replay import LinenModel

            return LinenModel(case)
        from layerdiff.flax.model import FlaxModel

        return FlaxModel(case)

    def as_array(self, tensor: Any) -> Any:
        from layerdiff.flax.port import as_jax

        return as_jax(tensor)

    def run_checked(self, case: Any, writer: Any, steps: int) -> None:
        from layerdiff.flax.nan import run_checked

        run_checked(case, writer, steps, linen=_is_linen(case.model))

    def nan_op(self, case: Any, result: Any) -> Any:
        from layerdiff.flax.nan import nan_op

        return nan_op(case, result, linen=_is_linen(case.model))

    def swap_donor(self, case: Any) -> Any:
        if _is_linen(case.model):
            raise CaseError(f"case {case.name or '?'} is a Flax Linen model, whose layers "
                            "swap and bisect cannot run inside the torch reference yet (they "
                            "take Flax NNX and torch ports); run layerdiff replay to find the "
                            "layer whose own error it is")
        from layerdiff.flax.in_torch import FlaxDonor

        return FlaxDonor()


def _is_linen(model: Any) -> bool:
    # flax.linen is imported where a Linen module exists; an NNX case need not load it
    linen = sys.modules.get("flax.linen")
    return linen is not None and isinstance(model, linen.Module)


FRAMEWORK = FlaxFramework()
