#!/usr/bin/env python
"""Flax capture overhead, side by side in one run: each case's bare step (the same model's
``jax.vjp`` forward and backward and its optimizer update, nothing recorded) against
``layerdiff.capture`` of it, eager and under ``jax.jit`` (``Case.jit``).

Two ratios per mode: a one-step run as a user runs it (the capture with its file opened,
written and published; under jit both sides trace and compile once), and a later step of a
``--steps`` run (timed from one step's end to the next: under jit, the compiled step reused).
The best of ``--repeats`` (this machine's noise only ever adds), the bare and captured runs
interleaved so that machine drift hits both.

    python scripts/bench_flax_capture.py
    python scripts/bench_flax_capture.py --cases tests.test_flax_traced:port_case  # nnx.scan
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

DEFAULT_CASES = [
    "reference_models.flax_mlp:port",
    "tests.validation.gemma_cases:port",
]


def bare_run(case: Any, steps: int, jit: bool, ticks: list[float]) -> None:
    """What capture runs, less the recording: the model split, each step's copy merged, one
    jax.vjp and its backward (under jax.jit when asked), the optax update; ``ticks`` gets
    the time at each step's end."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax
    from flax import nnx

    model, tx = case.model, case.optimizer
    inputs = jax.tree.map(lambda v: jnp.asarray(v) if isinstance(v, np.ndarray) else v,
                          case.inputs)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    opt_state = tx.init(params) if tx is not None else None

    def step(params: Any, rest: Any, inputs: Any) -> tuple[Any, Any, Any]:
        def forward(params: Any) -> tuple[Any, Any]:
            copy = nnx.merge(graphdef, params, rest, copy=True)
            output = copy(**inputs) if isinstance(inputs, dict) else copy(*inputs)
            return case.loss_fn(output), nnx.state(copy, nnx.Not(nnx.Param))

        loss, backward, rest = jax.vjp(forward, params, has_aux=True)
        (grads,) = backward(jnp.ones((), loss.dtype))
        return loss, grads, rest

    run = jax.jit(step) if jit else step
    with jax.default_matmul_precision("float32"):
        for _ in range(steps):
            _, grads, rest = run(params, rest, inputs)
            jax.block_until_ready(grads)
            if tx is not None:
                updates, opt_state = tx.update(grads, opt_state, params)
                params = optax.apply_updates(params, updates)
            ticks.append(time.perf_counter())
    nnx.update(model, params, rest)


def timed(spec: str, steps: int, jit: bool, capture: bool, directory: Path
          ) -> tuple[float, list[float]]:
    """The whole run's time, and each step's after the first (from the step ends: the
    capture's progress bar advances once a step)."""
    import layerdiff
    import layerdiff.flax.capture as flax_capture

    case = layerdiff.load_case(spec)
    case.jit = jit
    ticks: list[float] = []
    gc.collect()
    start = time.perf_counter()
    if capture:
        progress = flax_capture.StepProgress

        class Ticking(progress):
            def advance(self, *args: Any, **kwargs: Any) -> None:
                ticks.append(time.perf_counter())
                super().advance(*args, **kwargs)

        flax_capture.StepProgress = Ticking
        try:
            layerdiff.capture(case, directory / "trace.h5", steps=steps, progress=False)
        finally:
            flax_capture.StepProgress = progress
    else:
        bare_run(case, steps, jit, ticks)
    total = time.perf_counter() - start
    return total, [b - a for a, b in itertools.pairwise(ticks)]


def measure(spec: str, steps: int, repeats: int, directory: Path) -> dict[str, float]:
    kinds = [(jit, capture) for jit in (False, True) for capture in (False, True)]
    runs: dict[tuple[bool, bool], list[float]] = {kind: [] for kind in kinds}
    later: dict[tuple[bool, bool], list[float]] = {kind: [] for kind in kinds}
    timed(spec, 1, False, True, directory)  # imports, first compilations: not measured
    timed(spec, 1, True, True, directory)
    for _ in range(repeats):
        for jit, capture in kinds:
            runs[(jit, capture)].append(timed(spec, 1, jit, capture, directory)[0])
            later[(jit, capture)].extend(timed(spec, steps, jit, capture, directory)[1])
    row = {}
    for jit in (False, True):
        mode = "jit" if jit else "eager"
        bare1, cap1 = min(runs[(jit, False)]), min(runs[(jit, True)])
        bare_n, cap_n = min(later[(jit, False)]), min(later[(jit, True)])
        row[f"{mode} bare 1-step run ms"] = bare1 * 1e3
        row[f"{mode} x 1-step run"] = cap1 / bare1
        row[f"{mode} bare later step ms"] = bare_n * 1e3
        row[f"{mode} x later step"] = cap_n / bare_n
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=DEFAULT_CASES)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    columns = None
    with tempfile.TemporaryDirectory() as directory:
        for spec in args.cases:
            row = measure(spec, args.steps, args.repeats, Path(directory))
            if columns is None:
                columns = list(row)
                print("| case | " + " | ".join(columns) + " |")
                print("| --- | " + " | ".join("---:" for _ in columns) + " |")
            print(f"| {spec} | " + " | ".join(
                f"{row[c]:.1f}" if c.endswith("ms") else f"{row[c]:.2f}" for c in columns)
                + " |", flush=True)


if __name__ == "__main__":
    main()
