"""One door to a port's framework (layerdiff/framework.py) and one options object for a
capture (layerdiff/options.py): each case is handed to the framework that runs it, options a
framework cannot honour are refused in one sentence naming them as the user wrote them, and
no stage outside a framework's own package tests for a framework by name."""

import re
from pathlib import Path

import pytest
import torch

from layerdiff import CaptureError, Case, CaseError
from layerdiff.capture import capture
from layerdiff.framework import framework_named, framework_of
from layerdiff.options import CaptureOptions
from tests.tiny_cases import numpy_port

PACKAGE = Path(__file__).resolve().parents[1] / "layerdiff"


def _torch_case() -> Case:
    torch.manual_seed(0)
    return Case(model=torch.nn.Linear(3, 2), inputs=(torch.randn(4, 3),),
                loss_fn=lambda out: out.sum(), name="linear")


def test_each_case_goes_to_the_framework_that_runs_it():
    assert framework_of(_torch_case()).name == "torch"
    assert framework_of(numpy_port()).name == "external"
    assert framework_of(numpy_port()).records_itself
    nnx = pytest.importorskip("flax.nnx")
    flax_case = Case(model=nnx.Linear(3, 2, rngs=nnx.Rngs(0)), inputs=(), loss_fn=sum)
    assert framework_of(flax_case).name == "flax"
    assert not framework_of(flax_case).records_itself
    assert framework_named("flax") is framework_of(flax_case)


def test_a_model_no_framework_takes_is_refused_naming_its_type():
    class Numpyish:
        pass

    with pytest.raises(CaseError, match=r"case odd: its model is a Numpyish, which no "
                                        r"framework layerdiff knows takes \(torch, flax\)"):
        Case(model=Numpyish(), inputs=(), loss_fn=sum, name="odd")
    with pytest.raises(CaseError, match=r"framework 'onnx'.*read it with the layerdiff"):
        framework_named("onnx")


def test_options_are_checked_once_when_made():
    with pytest.raises(CaptureError, match="--loss-scale must be a finite positive"):
        CaptureOptions(loss_scale=float("inf"))
    with pytest.raises(CaptureError, match=r"--full-around keeps tensor data .* --summary"):
        CaptureOptions(summary=True, full_around=("blocks.0",))
    with pytest.raises(CaptureError, match="--dtype 'float8' is not one of"):
        CaptureOptions(dtype="float8")
    with pytest.raises(TypeError, match=r"unknown capture option.*loss_scal\b"):
        CaptureOptions.of(loss_scal=2.0)
    options = CaptureOptions.of(include="blocks.*", record_steps=[2, 1])
    assert options.include == ("blocks.*",)  # a lone glob, not its characters
    assert options.record_steps == frozenset({1, 2})
    assert CaptureOptions.of(options, steps=3).include == ("blocks.*",)


def test_a_framework_refuses_what_it_cannot_honour_naming_the_flags(tmp_path):
    with pytest.raises(CaptureError) as refused:
        capture(numpy_port(), tmp_path / "port.h5", include=["blocks.*"], ops=["*"])
    message = str(refused.value)
    assert "records itself, so --include, --ops do not apply to it" in message
    assert not (tmp_path / "port.h5").exists()
    with pytest.raises(CaptureError, match="--matmul-precision applies to JAX models"):
        capture(_torch_case(), tmp_path / "ref.h5", matmul_precision="default")


def test_the_trace_meta_records_the_options_from_one_place(tmp_path):
    from layerdiff.trace import open_trace

    options = CaptureOptions(loss_scale=4.0, include=("<root>",), extra_meta={"note": "x"})
    with open_trace(capture(_torch_case(), tmp_path / "ref.h5", options)) as trace:
        meta = trace.meta
    assert {key: meta[key] for key in ("steps", "loss_scale", "summary", "include",
                                       "exclude", "dtype", "note")} == {
        "steps": 1, "loss_scale": 4.0, "summary": False, "include": ["<root>"],
        "exclude": [], "dtype": None, "note": "x"}


def test_no_stage_tests_for_a_framework_by_name():
    """Outside the framework packages no ``if``/``isinstance`` names flax, nnx, jax or
    ExternalCase: not even the door (each framework recognises its own models) nor the
    definition of a case."""
    found = []
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("flax", "frameworks"):
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if (re.search(r"\b(if|elif|isinstance)\b", line)
                    and re.search(r"flax|nnx|jax|ExternalCase", line)):
                found.append(f"{relative}:{number}: {line.strip()}")
    assert found == []


def test_options_a_framework_does_not_take_are_refused_when_the_case_is_made():
    with pytest.raises(CaseError, match=r"case t: jit is for a Flax model .*torch\.compile"):
        Case(model=torch.nn.Linear(3, 2), inputs=(), loss_fn=sum, jit=True, name="t")
    linen = pytest.importorskip("flax.linen")
    import jax

    dense = linen.Dense(2)
    params = dense.init(jax.random.key(0), jax.numpy.zeros((1, 3)))
    with pytest.raises(CaseError, match=r"case l: jit runs a Flax NNX port's step .* leave jit"):
        Case(model=dense, params=params, inputs=(), loss_fn=sum, jit=True, name="l")


def test_a_flax_model_that_raises_is_named_at_its_site_and_nothing_is_published(tmp_path):
    nnx = pytest.importorskip("flax.nnx")
    import jax.numpy as jnp

    class Broken(nnx.Module):
        def __call__(self, x):
            raise ValueError("shapes do not fit")

    class Model(nnx.Module):
        def __init__(self):
            self.fc = nnx.Linear(3, 2, rngs=nnx.Rngs(0))
            self.broken = Broken()

        def __call__(self, x):
            return self.broken(self.fc(x))

    case = Case(model=Model(), inputs=(jnp.ones((1, 3)),), loss_fn=jnp.sum, name="m")
    with pytest.raises(CaptureError, match=r"^case m: the model raised ValueError: shapes do "
                                           r"not fit inside site broken \(Broken\) during the "
                                           r"forward"):
        capture(case, tmp_path / "m.h5")
    assert not (tmp_path / "m.h5").exists()
