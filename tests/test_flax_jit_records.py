"""A jitted Flax capture records what the eager one does: the same sites, roles, arguments and
order, values within float rounding, over two steps (the second reuses the compiled step, whose
records leave it as extra outputs and batched callbacks, merged on the host in trace order).
A plain model (no callback at all: float, integer and boolean values packed into one output),
and a remat inside a scanned block (nested traces: one callback per event). The scanned stack
alone (one callback per layer and pass) is tests/test_flax_traced.py's
test_jit_records_what_eager_records."""

from __future__ import annotations

import numpy as np
import pytest

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
import jax.numpy as jnp  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.trace import open_trace  # noqa: E402
from tests.flax_traces import assert_same_records  # noqa: E402

D, LAYERS, VOCAB = 6, 2, 11
X = np.random.default_rng(1).standard_normal((3, D)).astype(np.float32)
IDS = np.array([[1, 4, 9], [0, 3, 10]], dtype=np.int32)
KEEP = np.array([True, False, True])


class Gelu(nnx.Module):
    def __call__(self, x):
        return jax.nn.gelu(x, approximate=False)


class Masked(nnx.Module):
    def __call__(self, y, keep):
        return jnp.where(keep[None, :, None], y, 0.0)


class Plain(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs)
        self.norm = nnx.LayerNorm(D, rngs=rngs)
        self.fc = nnx.Linear(D, D, rngs=rngs)
        self.act = Gelu()
        self.mask = Masked()
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, ids, keep):
        h = self.act(self.fc(self.norm(self.embed(ids))))
        return self.head(self.mask(h, keep))


class RematBlock(nnx.Module):
    def __init__(self, rngs: nnx.Rngs) -> None:
        self.fc = nnx.Linear(D, D, rngs=rngs)

    def __call__(self, x):
        return x + nnx.remat(lambda fc, x: jnp.tanh(fc(x)))(self.fc, x)


class RematStack(nnx.Module):
    def __init__(self) -> None:
        rngs = nnx.Rngs(0)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs: nnx.Rngs) -> RematBlock:
            return RematBlock(rngs)

        self.layers = make(rngs)
        self.head = nnx.Linear(D, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def run(x, block):
            return block(x)

        return self.head(run(x, self.layers))


def mean_square(y):
    return jnp.mean(y ** 2)


def plain_case():
    import optax

    return layerdiff.Case(model=Plain(), inputs=(IDS, KEEP), loss_fn=mean_square,
                          optimizer=optax.sgd(0.1), name="plain")


def remat_case():
    import optax

    return layerdiff.Case(model=RematStack(), inputs=(X,), loss_fn=mean_square,
                          optimizer=optax.sgd(0.1), name="remat_stack")


@pytest.mark.parametrize("make", [plain_case, remat_case], ids=["plain", "remat_in_scan"])
def test_a_jitted_capture_records_what_the_eager_one_does(tmp_path, make):
    paths = {}
    for jit in (False, True):
        case = make()
        case.jit = jit
        paths[jit] = layerdiff.capture(case, tmp_path / f"jit{jit}.h5", steps=2,
                                       progress=False)
    with open_trace(paths[False]) as eager, open_trace(paths[True]) as jitted:
        assert jitted.meta["jit"] is True
        assert list(eager.sites["site"]) == list(jitted.sites["site"])
        assert_same_records(eager, jitted)
        assert set(jitted.index["step"]) == {0, 1}
        assert {"grad_output", "grad_input", "weight_grad"} <= set(jitted.index["role"])
