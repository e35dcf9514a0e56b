"""layerdiff nan on Flax models: the first non-finite record named by step, pass, site and
origin through the capture's own call recorder, and the operation and source line that made
it by re-running the origin's one call under checkify."""

from pathlib import Path

import pytest

nnx = pytest.importorskip("flax.nnx")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

from layerdiff import Case  # noqa: E402
from layerdiff.debug.nan import find_nan  # noqa: E402
from layerdiff.report.findings.debug import nan_text  # noqa: E402

HERE = Path(__file__).resolve()


def line_of(marker: str) -> int:
    """The line of this file that carries ``marker`` in its comment."""
    lines = HERE.read_text(encoding="utf-8").splitlines()
    return next(n for n, line in enumerate(lines, 1) if line.rstrip().endswith(f"# {marker}"))


class Log(nnx.Module):
    """``log`` of a weight the optimizer lowers by 12 x 0.03 a step: 1, .64, .28, -.08 (step 3)."""

    def __init__(self):
        self.a = nnx.Param(jnp.array(1.0))

    def __call__(self, x):
        scale = jnp.log(self.a[...])  # planted log
        return x + self.a[...] + 0.0 * scale


class Root(nnx.Module):
    """A square root masked by where: finite forward, NaN gradient once the weight is
    negative (step 3)."""

    def __init__(self):
        self.a = nnx.Param(jnp.array(1.0))

    def __call__(self, x):
        a = self.a[...]
        root = jnp.where(a > 0, jnp.sqrt(a), 0.0)  # planted sqrt
        return x + a + 0.0 * root


class Unit(nnx.Module):
    """Each row divided by its norm: 0 / 0 for a row of zeros."""

    def __call__(self, x):
        return x / jnp.sqrt(jnp.sum(x * x, axis=-1, keepdims=True))  # planted div


class Direct(nnx.Module):
    def __init__(self, layer):
        self.layer = layer

    def __call__(self, x):
        return self.layer(x)


def direct(layer, *, jit=False, x=None):
    if x is None:
        x = jax.random.normal(jax.random.key(1), (3, 4))
    return Case(model=Direct(layer), inputs=(x,), loss_fn=jnp.sum, optimizer=optax.sgd(0.03),
                steps=6, name=type(layer).__name__.lower(), jit=jit)


class Boom(nnx.Module):
    """``exp`` of a weight the optimizer raises by 6 a step: 80, 86, 92 overflows float32."""

    def __init__(self):
        self.a = nnx.Param(jnp.array(80.0))

    def __call__(self, x):
        return x + jnp.exp(self.a[...]) * 0.0 + self.a[...]  # planted exp


@pytest.fixture(scope="module", params=[False, True], ids=["eager", "jit"])
def log_found(request, tmp_path_factory):
    # eager, the failing step is also written out: from the weights it started from
    output = None if request.param else tmp_path_factory.mktemp("nan") / "failing.h5"
    return find_nan(direct(Log(), jit=request.param), output=output)


def test_a_planted_log_is_named_at_its_site_step_and_line(log_found):
    result = log_found
    first = result.first
    assert (first.site, first.pass_, first.role, first.step, first.kind) == (
        "layer#0", "forward", "output", 3, "nan")
    assert result.origin.site == "layer#0" and result.origin.pass_ == "forward"
    assert result.steps_run == 4
    op = result.op
    assert (op.primitive, op.file, op.line, op.site) == ("log", str(HERE), line_of(
        "planted log"), "layer#0")
    assert result.producer.op == "log"
    assert result.as_json()["op"]["line"] == line_of("planted log")
    if result.trace is not None:
        from layerdiff.trace import open_trace

        with open_trace(result.trace) as trace:
            assert trace.meta["nan"]["step"] == 3
            weight = float(trace.read(trace.find(0, "layer#0", "weight", "a")))
        assert weight == pytest.approx(-0.08, abs=1e-5)  # step 3's, recorded as step 0
    assert nan_text(result).splitlines()[0] == (
        "first NaN: step 3 forward, site layer#0 output, made by `log` at "
        f"test_flax_nan.py:{line_of('planted log')}")


def test_a_nan_gradient_of_a_masked_sqrt_is_named_in_the_backward():
    result = find_nan(direct(Root()))
    first = result.first
    assert (first.site, first.pass_, first.step, first.kind) == ("layer#0", "backward", 3,
                                                                 "nan")
    assert result.origin.site == "layer#0" and result.origin.pass_ == "backward"
    # the vjp re-run names the square root of the negative weight the where masked
    assert (result.op.primitive, result.op.line, result.op.pass_) == (
        "sqrt", line_of("planted sqrt"), "backward")


def test_a_division_by_a_zero_norm_is_named_inside_a_model_at_step_0():
    x = jnp.zeros((3, 4)).at[0].set(1.0)  # rows 1 and 2 are zero after no layer: planted
    model = Direct(Unit())
    result = find_nan(Case(model=model, inputs=(x,), loss_fn=jnp.sum, steps=1, name="unit"))
    assert (result.first.site, result.first.step, result.first.pass_) == ("layer#0", 0,
                                                                          "forward")
    assert (result.op.primitive, result.op.line) == ("div", line_of("planted div"))


def test_nan_in_the_inputs_is_found_with_no_operation_to_name():
    x = jnp.full((3, 4), jnp.nan)
    result = find_nan(Case(model=Direct(Unit()), inputs=(x,), loss_fn=jnp.sum, name="unit"))
    assert (result.first.site, result.first.role) == ("<root>#0", "input")
    assert result.origin is None
    assert result.op.primitive is None
    assert "the case's inputs hold it" in result.op.note
    assert "operation: not named: no site's own code made it" in nan_text(result)


def test_a_finite_flax_model_reports_nothing():
    # the weight falls 1, .64, .28: finite for the first three steps
    result = find_nan(direct(Log()), steps=3)
    assert not result.found and result.op is None
    # inputs, weight and outputs of both sites, the loss, two grad_outputs, the weight_grad
    assert result.steps_run == 3 and result.records_per_step == 9


def test_a_nan_from_an_overflow_is_named_at_the_operation_that_overflowed():
    result = find_nan(Case(model=Direct(Boom()), inputs=(jnp.ones((3, 4)),),
                           loss_fn=lambda out: -jnp.sum(out), optimizer=optax.sgd(0.5),
                           steps=4, name="boom"))
    assert (result.first.site, result.first.step, result.first.kind) == ("layer#0", 2, "nan")
    # checkify names the mul that made inf * 0 a NaN; the Inf it came from is the exp
    assert (result.op.primitive, result.op.line) == ("exp", line_of("planted exp"))
    assert "which `mul` at test_flax_nan.py" in result.op.note


def test_a_linen_model_is_checked_and_its_operation_not_named_yet():
    linen = pytest.importorskip("flax.linen")

    class Gate(linen.Module):
        @linen.compact
        def __call__(self, x):
            a = self.param("a", lambda key: jnp.array(1.0))
            return x + a + 0.0 * jnp.log(a)

    class Net(linen.Module):
        @linen.compact
        def __call__(self, x):
            return Gate(name="gate")(x)

    x = jax.random.normal(jax.random.key(1), (3, 4))
    net = Net()
    result = find_nan(Case(model=net, params=net.init(jax.random.key(0), x), inputs=(x,),
                           loss_fn=jnp.sum, optimizer=optax.sgd(0.03), steps=6, name="net"))
    assert (result.first.site, result.first.step, result.first.role) == ("gate#0", 3,
                                                                         "output")
    assert result.origin.site == "gate#0"
    assert result.op.primitive is None and "a Linen module's call is not re-run" in (
        result.op.note)


@pytest.mark.slow
def test_a_nan_made_inside_a_flax_layer_is_named_at_flax_s_line():
    class Normed(nnx.Module):
        def __init__(self):
            # a negative epsilon: rsqrt of a negative variance + epsilon
            self.norm = nnx.LayerNorm(4, epsilon=-10.0, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.norm(x)

    x = jax.random.normal(jax.random.key(1), (2, 4))
    result = find_nan(Case(model=Normed(), inputs=(x,), loss_fn=jnp.sum, name="normed"))
    assert result.first.site == "norm#0"
    op = result.op
    # no line of the user's runs inside the call: Flax's own line, not the caller of find_nan
    assert op.primitive == "rsqrt" and op.file.endswith("normalization.py")
    assert op.library is None


@pytest.mark.slow
def test_a_layer_of_an_nnx_scan_stack_is_named_with_its_operation():
    class Layer(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return jnp.log(self.fc(x))  # planted in a stack

    class Stacked(nnx.Module):
        def __init__(self):
            @nnx.split_rngs(splits=2)
            @nnx.vmap(in_axes=(0,), out_axes=0)
            def make(rngs):
                return Layer(rngs)

            self.layers = make(nnx.Rngs(0))

        def __call__(self, x):
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
            def body(layer, x):
                return layer(x)

            return body(self.layers, x)

    model = Stacked()
    # layer 0 takes logs of values near 100, layer 1 of values near -100
    model.layers.fc.kernel[...] = model.layers.fc.kernel[...] * 0.01
    model.layers.fc.bias[...] = jnp.array([[100.0] * 4, [-100.0] * 4])
    result = find_nan(Case(model=model, inputs=(jnp.ones((2, 4)),), loss_fn=jnp.sum,
                           name="stacked"))
    # the layer's record came through a callback of the scan body: it, not the root's output
    # recorded after it in eager code, is the first
    assert (result.first.site, result.first.role) == ("layers.1#0", "output")
    assert result.origin.site == "layers.1#0"
    # re-run on layer 1's slice of the stacked weights (layer 0's makes no NaN)
    assert (result.op.primitive, result.op.line) == ("log", line_of("planted in a stack"))


class Between(nnx.Module):
    def __init__(self):
        self.a = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
        self.b = nnx.Linear(4, 4, rngs=nnx.Rngs(1))

    def __call__(self, x):
        return self.b(jnp.sqrt(self.a(x)))  # planted between


def test_a_nan_made_between_submodules_is_named_in_the_container_s_code():
    result = find_nan(Case(model=Direct(Between()), inputs=(jnp.ones((2, 4)) * -1.0,),
                           loss_fn=jnp.sum, name="between"))
    assert (result.first.site, result.first.role) == ("layer.b#0", "input")
    assert (result.op.site, result.op.primitive, result.op.line) == (
        "layer#0", "sqrt", line_of("planted between"))
    text = " ".join(nan_text(result).split())  # the headline wraps
    assert text.startswith("first NaN: step 0 forward, site layer.b#0 input, made by `sqrt` in "
                           "layer#0's own code at test_flax_nan.py:"
                           f"{line_of('planted between')} ")
