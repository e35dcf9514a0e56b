"""Flax NNX models captured into layerdiff's trace: the six roles per layer, gradients equal to
JAX's own, weights set from a torch reference through a mapping, and a diff against that
reference that names a planted bug at its layer (issue 31, capture and weights)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

jax = pytest.importorskip("jax")
nnx = pytest.importorskip("flax.nnx")
optax = pytest.importorskip("optax")
import jax.numpy as jnp  # noqa: E402

import layerdiff  # noqa: E402
from layerdiff.capture.port import capture_port  # noqa: E402
from layerdiff.errors import CaptureError, MappingError  # noqa: E402
from layerdiff.trace import open_trace  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


class FlaxTiny(nnx.Module):
    """Linear -> LayerNorm -> gelu -> Linear, the layers named as the torch model's."""

    def __init__(self, *, epsilon: float = 1e-5, tanh_gelu: bool = False, seed: int = 0) -> None:
        rngs = nnx.Rngs(seed)
        self.tanh_gelu = tanh_gelu
        self.fc1 = nnx.Linear(4, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, epsilon=epsilon, rngs=rngs)
        self.fc2 = nnx.Linear(8, 3, rngs=rngs)

    def __call__(self, x):
        return self.fc2(jax.nn.gelu(self.norm(self.fc1(x)), approximate=self.tanh_gelu))


@jax.custom_vjp
def _wrong_backward(x):
    return x


_wrong_backward.defvjp(lambda x: (x, None), lambda _, g: (1.01 * g,))


class BackwardBugNorm(nnx.LayerNorm):
    """LayerNorm with the right forward and a backward 1% off (super().__call__: the class
    above it is patched too, and must give one site, not two)."""

    def __call__(self, x):
        return super().__call__(_wrong_backward(x))


class TorchTiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.fc1 = torch.nn.Linear(4, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.fc2 = torch.nn.Linear(8, 3)
        with torch.no_grad():  # LayerNorm's affine parameters away from 1 and 0: a real load
            self.norm.weight.uniform_(0.5, 1.5)
            self.norm.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.norm(self.fc1(x))))


MAPPING = """
[[param]]
port = "fc1.kernel"
reference = "fc1.weight"
transform = "transpose"

[[param]]
port = "fc2.kernel"
reference = "fc2.weight"
transform = "transpose"

[[param]]
port = "norm.scale"
reference = "norm.weight"
"""

# small inputs: LayerNorm's variance is small, so its epsilon matters well above rounding
X = (0.1 * np.random.default_rng(0).standard_normal((5, 4))).astype(np.float32)


def mean_square(y):
    return jnp.mean(y ** 2)


def flax_case(steps: int = 1, **model) -> layerdiff.Case:
    return layerdiff.Case(model=FlaxTiny(**model), inputs=(X,), loss_fn=mean_square,
                          optimizer=optax.sgd(0.1), steps=steps, name="flax_tiny")


def records(path) -> dict[tuple[int, str, str, str], np.ndarray]:
    with open_trace(path) as trace:
        return {(int(row["step"]), row["site"], row["role"], row["arg"]):
                np.asarray(trace.read(row)) for _, row in trace.index.iterrows()
                if row["kind"] == "tensor"}


@pytest.fixture
def torch_reference(tmp_path):
    case = layerdiff.Case(model=TorchTiny(), inputs=(torch.from_numpy(X),),
                          loss_fn=lambda y: (y ** 2).mean(), name="torch_tiny")
    return layerdiff.capture(case, tmp_path / "ref.h5")


@pytest.fixture
def mapping(tmp_path):
    path = tmp_path / "tiny.map.toml"
    path.write_text(MAPPING)
    return path


def test_every_layer_records_the_roles_a_torch_capture_does_with_its_shapes(tmp_path,
                                                                             torch_reference):
    port = records(layerdiff.capture(flax_case(), tmp_path / "port.h5"))
    ref = records(torch_reference)
    names = {"kernel": "weight", "scale": "weight"}
    flax_keys = {(site, role, names.get(arg, arg)): value.shape
                 for (_, site, role, arg), value in port.items()}
    torch_keys = {(site, role, arg): value.shape for (_, site, role, arg), value in ref.items()}
    assert set(flax_keys) == set(torch_keys)
    for key, shape in torch_keys.items():  # Linear's kernel is (in, out), torch's (out, in)
        assert flax_keys[key] == (shape[::-1] if key[1] in ("weight", "weight_grad")
                                  and key[0] != "norm#0" else shape), key
    for site in ("norm#0", "fc2#0"):
        assert {role for _, s, role, _ in port if s == site} == {
            "input", "output", "weight", "grad_output", "grad_input", "weight_grad"}
    # fc1's input is the case's input, which depends on no parameter: no grad_input (torch's
    # input does not require grad either)
    assert not any(s == "fc1#0" and role == "grad_input" for _, s, role, _ in port)


def test_gradients_are_jaxs_own(tmp_path):
    case = flax_case()
    model = nnx.clone(case.model)  # as it was: the capture's optimizer step changes the case's
    params = nnx.state(model, nnx.Param)
    scale = 1024.0
    port = records(layerdiff.capture(case, tmp_path / "port.h5", loss_scale=scale))

    x = jnp.asarray(X)
    h1 = model.fc1(x)
    h2 = model.norm(h1)
    g = jax.nn.gelu(h2, approximate=False)
    y = model.fc2(g)
    d_y = jax.grad(lambda y: mean_square(y) * scale)(y)
    d_g = jax.vjp(model.fc2, g)[1](d_y)[0]
    d_h2 = jax.vjp(lambda h: jax.nn.gelu(h, approximate=False), h2)[1](d_g)[0]
    d_h1 = jax.vjp(model.norm, h1)[1](d_h2)[0]
    expected = {("<root>#0", "grad_output"): d_y, ("fc2#0", "grad_output"): d_y,
                ("fc2#0", "grad_input"): d_g, ("norm#0", "grad_output"): d_h2,
                ("norm#0", "grad_input"): d_h1, ("fc1#0", "grad_output"): d_h1}
    for (site, role), value in expected.items():
        np.testing.assert_allclose(port[(0, site, role, "0")], value, rtol=1e-5,
                                   atol=1e-6 * float(jnp.abs(value).max()))

    def loss(model):
        return mean_square(model(x)) * scale

    grads = nnx.grad(loss)(model)
    for path, variable in nnx.to_flat_state(grads):
        site, name = f"{path[0]}#0", path[1]
        value = variable.get_value()
        np.testing.assert_allclose(port[(0, site, "weight_grad", name)], value, rtol=1e-5,
                                   atol=1e-6 * float(jnp.abs(value).max()))
    # the forward is the model's own, bit for bit: the taps change nothing
    np.testing.assert_array_equal(port[(0, "<root>#0", "output", "0")], y)
    np.testing.assert_array_equal(port[(0, "norm#0", "output", "0")], h2)
    # the loss is recorded unscaled, the weights as they were
    np.testing.assert_allclose(port[(0, "<loss>#0", "output", "0")], mean_square(y),
                               rtol=1e-6)
    for path, variable in nnx.to_flat_state(params):
        np.testing.assert_array_equal(port[(0, f"{path[0]}#0", "weight", path[1])],
                                      variable.get_value())


def test_steps_update_the_weights_with_the_optax_optimizer_unscaled(tmp_path):
    plain = records(layerdiff.capture(flax_case(steps=2), tmp_path / "a.h5"))
    scaled = records(layerdiff.capture(flax_case(steps=2), tmp_path / "b.h5", loss_scale=64.0))
    for name in ("kernel", "bias"):
        before = plain[(0, "fc1#0", "weight", name)]
        grad = plain[(0, "fc1#0", "weight_grad", name)]
        after = plain[(1, "fc1#0", "weight", name)]
        assert not np.array_equal(before, after)
        np.testing.assert_allclose(after, before - 0.1 * grad, rtol=1e-6, atol=1e-7)
        # a loss scale amplifies the recorded gradients, not the training (a power of two:
        # bit for bit)
        np.testing.assert_array_equal(scaled[(0, "fc1#0", "weight_grad", name)], 64.0 * grad)
        np.testing.assert_array_equal(scaled[(1, "fc1#0", "weight", name)], after)


def test_a_faithful_port_with_the_references_weights_has_no_origin(tmp_path, torch_reference,
                                                                   mapping):
    port = capture_port(flax_case(), tmp_path / "port.h5", weights_from=torch_reference,
                        mapping=mapping, progress=False)
    result = layerdiff.diff(torch_reference, port)
    assert result.origins == [], result.origins
    assert result.passed
    assert result.unmatched.empty or not len(result.undeclared_sites())
    with open_trace(port) as trace:
        assert trace.meta["matmul_precision"] == "float32"
        assert trace.meta["weights"]["mapping"]["name"] == "tiny.map.toml"


@pytest.mark.parametrize(("bug", "site"), [
    ({"epsilon": 1e-6}, "norm#0"),    # torch's LayerNorm has 1e-5
    # jax.nn.gelu's default is the tanh approximation, torch's the exact erf; the gelu is in
    # the model's own code between its children: the root is where it is
    ({"tanh_gelu": True}, "<root>#0")])
def test_a_planted_bug_is_named_at_its_layer_and_pass(tmp_path, torch_reference, mapping,
                                                      bug, site):
    port = capture_port(flax_case(**bug), tmp_path / "port.h5",
                        weights_from=torch_reference, mapping=mapping, progress=False)
    result = layerdiff.diff(torch_reference, port)
    assert not result.passed
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [(site, "forward", "output")]


def test_a_planted_backward_bug_is_named_in_the_backward_at_its_layer(tmp_path,
                                                                     torch_reference, mapping):
    case = flax_case()
    case.model.norm = BackwardBugNorm(8, epsilon=1e-5, rngs=nnx.Rngs(3))
    port = capture_port(case, tmp_path / "port.h5", weights_from=torch_reference,
                        mapping=mapping, progress=False)
    with open_trace(port) as trace:
        assert list(trace.sites["site"]).count("norm#0") == 1
        assert "norm#1" not in set(trace.sites["site"])
    result = layerdiff.diff(torch_reference, port)
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [
        ("norm#0", "backward", "grad_input")]


def test_a_mapping_that_misses_a_parameter_is_refused_in_one_sentence(tmp_path,
                                                                      torch_reference):
    partial = tmp_path / "partial.map.toml"
    partial.write_text(MAPPING.replace('port = "norm.scale"\nreference = "norm.weight"\n',
                                       'port = "norm.bias"\nreference = "norm.bias"\n'))
    with pytest.raises(MappingError) as refused:
        capture_port(flax_case(), tmp_path / "port.h5", weights_from=torch_reference,
                     mapping=partial, progress=False)
    message = str(refused.value)
    assert "norm.scale" in message and "partial.map.toml" in message and "\n" not in message
    assert not (tmp_path / "port.h5").exists()


def test_a_kernel_without_its_transpose_is_refused_naming_both_shapes(tmp_path,
                                                                      torch_reference):
    wrong = tmp_path / "wrong.map.toml"
    wrong.write_text(MAPPING.replace('transform = "transpose"\n', "", 1))
    with pytest.raises(MappingError, match=r"fc1\.kernel has shape \(4, 8\) but reference "
                                           r"fc1\.weight gives \(8, 4\)"):
        capture_port(flax_case(), tmp_path / "port.h5", weights_from=torch_reference,
                     mapping=wrong, progress=False)


def test_the_conv_layout_conversion_gives_flax_the_torch_kernel():
    from layerdiff.flax.layouts import conv_kernel

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 5, kernel_size=(3, 2), bias=False)
    flax_conv = nnx.Conv(3, 5, kernel_size=(3, 2), padding="VALID", use_bias=False,
                         rngs=nnx.Rngs(0))
    flax_conv.kernel.set_value(jnp.asarray(conv_kernel(conv.weight.detach()).numpy()))
    image = torch.randn(2, 3, 6, 7)
    expected = conv(image).detach().numpy()
    got = np.asarray(flax_conv(jnp.asarray(image.permute(0, 2, 3, 1).numpy())))
    np.testing.assert_allclose(got.transpose(0, 3, 1, 2), expected, rtol=1e-5, atol=1e-5)


def test_matmul_precision_is_recorded_and_can_be_the_frameworks_default(tmp_path):
    path = layerdiff.capture(flax_case(), tmp_path / "port.h5", matmul_precision="default")
    with open_trace(path) as trace:
        assert trace.meta["matmul_precision"] == "default"
        assert trace.meta["producer"] == "layerdiff.capture (flax)"
    with pytest.raises(CaptureError, match="--matmul-precision 'fast' is not one of"):
        layerdiff.capture(flax_case(), tmp_path / "other.h5", matmul_precision="fast")


def test_a_module_made_during_the_call_is_refused_in_one_sentence(tmp_path):
    # (layers stacked by nnx.vmap and run by nnx.scan are captured: tests/test_flax_traced.py)
    class MakesOne(nnx.Module):
        def __init__(self) -> None:
            self.fc = nnx.Linear(4, 4, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return nnx.Linear(4, 4, rngs=nnx.Rngs(1))(self.fc(x))

    case = layerdiff.Case(model=MakesOne(), inputs=(X,), loss_fn=mean_square, name="makes")
    with pytest.raises(CaptureError, match=r"made during the call") as refused:
        layerdiff.capture(case, tmp_path / "port.h5")
    assert "\n" not in str(refused.value)


def test_a_torch_capture_never_imports_jax(tmp_path):
    code = (
        "import sys, torch, layerdiff\n"
        "case = layerdiff.Case(model=torch.nn.Linear(3, 2), inputs=(torch.ones(2, 3),),\n"
        "                      loss_fn=lambda y: y.sum())\n"
        f"layerdiff.capture(case, {str(tmp_path / 't.h5')!r})\n"
        "import layerdiff.capture.port, layerdiff.weights, layerdiff.compare\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax', 'optax')))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=tmp_path)
    assert out.stdout.strip() == "[]"


def faithful_port() -> layerdiff.Case:
    """The case the command line names (tests.test_flax_capture:faithful_port)."""
    return flax_case()


def test_the_command_line_captures_a_flax_port_with_the_references_weights(
        tmp_path, torch_reference, mapping, run):
    port = tmp_path / "port.h5"
    result = run("capture", "tests.test_flax_capture:faithful_port", "-o", port,
                 "--weights-from", torch_reference, "--map", mapping)
    assert result.exit_code == 0, result.output
    assert "loaded 6 port tensors from the reference" in result.output
    result = run("diff", torch_reference, port)
    assert result.exit_code == 0, result.output

    partial = tmp_path / "partial.map.toml"
    partial.write_text(MAPPING.replace('[[param]]\nport = "fc2.kernel"\nreference = '
                                       '"fc2.weight"\ntransform = "transpose"\n', ""))
    result = run("capture", "tests.test_flax_capture:faithful_port", "-o", tmp_path / "x.h5",
                 "--weights-from", torch_reference, "--map", partial)
    assert result.exit_code == 2
    assert "fc2.kernel" in result.output and len(result.output.strip().splitlines()) == 1


def test_dtype_casts_the_parameters_and_inputs_and_float64_needs_x64(tmp_path):
    path = layerdiff.capture(flax_case(), tmp_path / "bf16.h5", dtype="bfloat16")
    with open_trace(path) as trace:
        rows = trace.index
        assert set(rows[rows["role"].isin(["weight", "input", "output"])]["dtype"]) == {
            "bfloat16"}
        assert trace.meta["dtype"] == "bfloat16" and trace.meta["model_dtype"] == "bfloat16"
    if not jax.config.jax_enable_x64:
        with pytest.raises(CaptureError, match="needs JAX's 64-bit mode"):
            layerdiff.capture(flax_case(), tmp_path / "f64.h5", dtype="float64")


def test_a_linen_module_is_refused_in_one_sentence():
    linen = pytest.importorskip("flax.linen")
    with pytest.raises(layerdiff.CaseError, match="Flax Linen module") as refused:
        layerdiff.Case(model=linen.Dense(3), inputs=(X,), loss_fn=mean_square)
    assert "\n" not in str(refused.value)


def test_include_narrows_the_sites_and_summary_keeps_statistics_only(tmp_path):
    path = layerdiff.capture(flax_case(), tmp_path / "port.h5", include=["fc2"], summary=True)
    with open_trace(path) as trace:
        assert set(trace.index["site"]) == {"fc2#0", "<loss>#0"}
        assert trace.summary and (trace.index["segment"] < 0).all()
        assert list(trace.index[trace.index["role"] == "weight"]["arg"]) == ["kernel", "bias"]
    with pytest.raises(CaptureError, match="--include 'fc3' matches no module"):
        layerdiff.capture(flax_case(), tmp_path / "other.h5", include=["fc3"])


def test_a_module_held_under_two_names_is_one_module_and_its_variables_are_shared(tmp_path):
    class Tied(nnx.Module):
        def __init__(self) -> None:
            self.first = nnx.Linear(4, 4, rngs=nnx.Rngs(0))
            self.second = self.first    # the same layer twice, as torch's tied modules

        def __call__(self, x):
            return self.second(self.first(x))

    case = layerdiff.Case(model=Tied(), inputs=(X,), loss_fn=mean_square, name="tied")
    with open_trace(layerdiff.capture(case, tmp_path / "tied.h5")) as trace:
        assert list(trace.sites["site"]) == ["<root>#0", "first#0", "first#1", "<loss>#0"]
        assert len(trace.records(0, role="weight")) == 2   # recorded once, at its first call
        assert {"name": "first.kernel", "users": ["first.kernel", "second.kernel"]} in \
            trace.meta["shared_parameters"]


def test_options_that_would_record_nothing_useful_are_refused_as_for_torch(tmp_path):
    """Globs that leave no module, a loss scale float32 cannot hold, and one the float32 loss
    overflows at step 0: one sentence each, no trace (issue 38, item 5)."""
    with pytest.raises(CaptureError, match=r"--exclude '\*' leaves no module of the Flax model "
                                           "to record"):
        layerdiff.capture(flax_case(), tmp_path / "a.h5", exclude=["*"])
    with pytest.raises(CaptureError, match=r"--loss-scale 1e\+300 is larger than float32 can "
                                           "hold"):
        layerdiff.capture(flax_case(), tmp_path / "b.h5", loss_scale=1e300)
    large = flax_case()
    large.loss_fn = lambda y: mean_square(y) + 1000.0
    with pytest.raises(CaptureError, match=r"--loss-scale 1e\+38 overflows the float32 loss at "
                                           r"step 0 .*2\*\*20"):
        layerdiff.capture(large, tmp_path / "c.h5", loss_scale=1e38)
    assert not any(tmp_path.glob("*.h5"))
