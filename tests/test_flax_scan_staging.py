"""Under jit, a scan body's records leave as the scan's outputs and its cotangents as the
gradients of zero sinks (layerdiff/flax/staging.py): a scan run in reverse (its layers in
the other order, its backward from layer 0) with an output of a layer nothing uses (no
grad_output there, as eager) records what the eager capture does, row for row."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.trace import open_trace  # noqa: E402
from tests.flax_traces import assert_same_records  # noqa: E402

D, LAYERS = 4, 3
X = np.random.default_rng(2).standard_normal((2, D)).astype(np.float32)


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(D, D, rngs=rngs)
        self.side = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        self.side(x)  # an output nothing uses: no cotangent reaches it
        return jnp.tanh(self.fc(x))


class Reversed(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> Block:
            return Block(rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry, reverse=True)
        def run(x, block):
            return block(x)

        return run(x, self.layers)


def test_a_reversed_scan_with_an_unused_output_records_what_eager_does(tmp_path):
    import optax

    paths = {}
    for jit in (False, True):
        case = layerdiff.Case(model=Reversed(), inputs=(X,), loss_fn=lambda y: jnp.mean(y ** 2),
                              optimizer=optax.sgd(0.1), name="reversed", jit=jit)
        paths[jit] = layerdiff.capture(case, tmp_path / f"jit{jit}.h5", steps=2,
                                       progress=False)
    with open_trace(paths[False]) as eager, open_trace(paths[True]) as jitted:
        assert_same_records(eager, jitted)
        sites = set(jitted.index["site"])
        assert "layers.2#0" in sites and "layers.0.side#0" in sites
        grads = jitted.index[jitted.index["role"] == "grad_output"]
        assert not any("side" in site for site in grads["site"])  # unused: no cotangent
        assert any("layers.0.fc" in site for site in grads["site"])
