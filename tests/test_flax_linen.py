"""Flax Linen ports (layerdiff/flax/linen.py, layerdiff/flax/linen_replay.py): a Linen port of
a torch reference captured, diffed, replayed and map-checked as an NNX port is, its planted
slips named at their sites."""

from __future__ import annotations

import pytest

pytest.importorskip("flax")
import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn

from layerdiff import Case, diff, load_case
from layerdiff.capture.port import capture_port
from layerdiff.errors import CaptureError, CaseError
from layerdiff.replay import replay
from layerdiff.replay.mapcheck import map_check
from layerdiff.trace import open_trace
from layerdiff.trace.schema import Role
from tests import flax_linen_cases as cases
from tests.flax_linen_cases import CLASSES

MAP = "tests/flax_linen.map.toml"
UNTRANSPOSED = "tests/flax_linen_untransposed.map.toml"
TIED_MAP = "tests/flax_tied.map.toml"   # kernel, scale, embedding <- weight: any model


@pytest.fixture(scope="module")
def ref(reference_traces):
    return reference_traces("tests.flax_linen_cases:reference")


@pytest.fixture(scope="module")
def port_trace(ref, tmp_path_factory):
    return capture_port(cases.port(), tmp_path_factory.mktemp("linen") / "port.h5",
                        weights_from=ref, mapping=MAP, progress=False)


def _local(result) -> set[tuple[str, str]]:
    return {(row.port_site, row["pass"]) for _, row in result.local.iterrows()
            if row.verdict == "LOCAL ERROR"}


def test_faithful_linen_port_passes_its_diff_with_every_role_at_linen_sites(ref, port_trace):
    result = diff(ref, port_trace, mapping=MAP)
    assert result, result.origin
    with open_trace(port_trace) as trace:
        index = trace.index
        roles = set(index[index["site"] == "blocks_1.fc1#0"]["role"])
        sites = set(index["site"])
        assert trace.meta["framework"] == "flax"
    assert roles == {Role.INPUT, Role.OUTPUT, Role.WEIGHT, Role.GRAD_INPUT, Role.GRAD_OUTPUT,
                     Role.WEIGHT_GRAD}
    assert {"<root>#0", "proj_in#0", "blocks_0#0", "blocks_0.ln#0", "head#0"} <= sites


@pytest.mark.parametrize("make, mapping, site, port_site", [
    (cases.bug_layernorm_eps, MAP, "blocks.0.ln#0", "blocks_0.ln#0"),       # a layer's math
    (cases.port, UNTRANSPOSED, "blocks.1.fc1#0", "blocks_1.fc1#0"),          # the weights' load
])
def test_planted_slip_is_the_diffs_origin_at_its_site(ref, tmp_path, make, mapping, site,
                                                       port_site):
    trace = capture_port(make(), tmp_path / "bug.h5", weights_from=ref, mapping=mapping,
                         progress=False)
    result = diff(ref, trace, mapping=mapping)
    assert not result
    assert (result.origin.site, result.origin.pass_) == (site, "forward"), result.origin
    assert result.origin.port_site == port_site


def test_replay_passes_the_faithful_port_and_names_the_planted_layer_alone(ref):
    assert replay(ref, cases.port(), mapping=MAP)
    result = replay(ref, cases.bug_layernorm_eps(), mapping=MAP)
    assert not result
    assert _local(result) == {("blocks_0.ln#0", "forward"), ("blocks_0.ln#0", "backward")}


def test_map_check_passes_the_mapping_flags_the_untransposed_kernel_and_restores(ref):
    port = cases.port()
    before = port.params
    check = map_check(ref, port, mapping=MAP, sites=False)
    assert check.passed, [(e.port, e.status, e.note) for e in check.failing()]
    assert port.params is before
    check = map_check(ref, port, mapping=UNTRANSPOSED, sites=False)
    assert [(e.port, e.status) for e in check.failing()] == [
        ("blocks_1.fc1.kernel", "suspicious-transpose")]


def test_weights_load_is_functional_and_options_are_respected(ref, tmp_path):
    case = cases.port()
    before = case.params
    trace = capture_port(case, tmp_path / "two.h5", weights_from=ref, mapping=MAP,
                         progress=False, steps=2, include=("blocks_*",), loss_scale=1024.0)
    assert before["params"]["blocks_0"]["fc1"]["kernel"] is not case.params["params"][
        "blocks_0"]["fc1"]["kernel"]  # loaded, then stepped: replaced, never written into
    with open_trace(trace) as recorded:
        index = recorded.index
        modules = set(index["site"].str.partition("#")[0]) - {"<loss>"}
        assert recorded.meta["loss_scale"] == 1024.0
    assert modules == {"blocks_0", "blocks_0.ln", "blocks_0.fc1", "blocks_0.fc2", "blocks_1",
                       "blocks_1.ln", "blocks_1.fc1", "blocks_1.fc2"}
    assert set(index["step"]) == {0, 1}
    with pytest.raises(CaptureError, match=r"--include 'blocks\.0' matches no module"):
        capture_port(cases.port(), tmp_path / "none.h5", progress=False, include=("blocks.0",))


def test_a_linen_case_without_its_variables_is_refused_in_one_sentence():
    with pytest.raises(CaseError, match=r"Flax Linen module.*params=<its variables dict>"):
        Case(model=nn.Dense(CLASSES), inputs=(np.ones((2, 3), np.float32),),
             loss_fn=lambda y: jnp.sum(y))


@pytest.mark.slow
def test_a_tied_head_used_through_attend_in_the_roots_code_is_judged_as_for_nnx(
        reference_traces):
    """The root attends with tok's embedding after calling tok: no replayed call makes that
    part of the reference's recorded gradient, so it is set aside (or split with the
    reference case), never a local error at tok."""
    ref = reference_traces("tests.replay_alone_cases:gpt")
    alone = replay(ref, cases.tied_gpt(), mapping=TIED_MAP)
    assert alone, alone.local
    assert dict(alone.skipped)["tok#0 weight_grad embedding"].startswith(
        "cannot judge alone: tok.embedding is also used at <root>")
    split = replay(ref, cases.tied_gpt(), mapping=TIED_MAP,
                   reference_case=load_case("tests.replay_alone_cases:gpt"))
    assert split, split.local
    assert not split.skipped and split.notes == [
        "tok.embedding is also used at <root>: judged on what the calls of tok alone make, on "
        "both sides"]


class _Dropping(nn.Module):
    @nn.compact
    def __call__(self, x):
        return nn.Dropout(0.5, deterministic=False, name="drop")(nn.Dense(3, name="fc")(x))


def test_a_dropout_that_is_on_is_refused_in_one_sentence_naming_its_site(tmp_path):
    x = np.ones((2, 3), np.float32)
    model = _Dropping()
    variables = model.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, x)
    case = Case(model=model, params=variables, inputs=(x,), loss_fn=lambda y: jnp.sum(y),
                name="dropping")
    with pytest.raises(CaptureError, match=r"InvalidRngError.* inside site drop#0 .*"
                                           r"deterministic=True") as refused:
        capture_port(case, tmp_path / "drop.h5", progress=False)
    assert "\n" not in str(refused.value)
