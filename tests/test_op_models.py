"""The op-level language model (reference_models/op_bugs.py) under module-level capture: the
reference repeats itself, its SDPA port passes, and each bug in a module's own code is found at
that module, in the right pass, at step 0, as a fault in its own code between its children."""

from __future__ import annotations

import pytest
import torch

from layerdiff import capture, diff, load_case, load_weights
from layerdiff.report.findings.diff import describe_origin
from reference_models import op_bugs

REFERENCE = f"{op_bugs.MODULE}:reference"
BUGS = {bug.spec.rpartition(":")[2]: bug for bug in op_bugs.BUGS}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return capture(load_case(REFERENCE), tmp_path_factory.mktemp("op_models") / "ref.h5")


def _port_trace(spec: str, reference, path):
    """``capture SPEC --weights-from REF``: the case given the reference trace's weights."""
    case = load_case(spec)
    report = load_weights(case.model, reference, None)
    assert set(report.loaded) == set(case.model.state_dict())  # no mapping needed
    return capture(case, path)


def test_reference_against_itself_passes(reference, tmp_path):
    again = capture(load_case(REFERENCE), tmp_path / "again.h5")
    result = diff(reference, again)
    assert result.passed and not result.origins and result.first_failing_step is None
    assert float(result.rows["ratio"].max()) == 0.0  # bit for bit: two steps, both passes
    assert set(result.rows["step"]) == {0, 1}


def test_sdpa_port_passes_against_explicit_attention(reference, tmp_path):
    result = diff(reference, _port_trace(f"{op_bugs.MODULE}:port", reference, tmp_path / "p.h5"))
    assert result.passed and not result.origins, [describe_origin(o) for o in result.origins]
    assert result.undeclared_sites().empty  # every module pairs; only the mask buffer has none
    assert set(result.unmatched["arg"]) == {"future"}
    assert float(result.rows["ratio"].max()) > 0  # really computed another way


@pytest.mark.parametrize("name", sorted(BUGS))
def test_bug_in_a_modules_own_code_is_found_at_that_module(reference, tmp_path, name):
    planted = BUGS[name]
    result = diff(reference, _port_trace(planted.spec, reference, tmp_path / "bug.h5"))
    assert not result.passed
    origin = result.origin
    assert (origin.site, origin.pass_, origin.step) == (planted.module_site, planted.pass_, 0)
    assert [o.site for o in result.origins] == [planted.module_site]  # one block only
    own = "own code" if planted.pass_ == "forward" else "own backward code"
    assert f"so the fault is in its {own} between its children" in origin.reason
    assert planted.op_site.startswith(planted.module_site + "/")


def test_custom_backward_bug_is_exact_forward_and_wrong_past_the_first_element(
        reference, tmp_path):
    planted = BUGS["bug_custom_backward"]
    result = diff(reference, _port_trace(planted.spec, reference, tmp_path / "bug.h5"))
    rows = result.rows
    step0_forward = rows[(rows["step"] == 0) & (rows["pass"] == "forward")]
    assert float(step0_forward["ratio"].max()) == 0.0
    within, *others = result.origin.metrics["batch_ratio"]
    assert within <= 1 and min(others) > 1


# ---- a model of this test's own: a bug in a block's own code, the residual taken after the norm


class NormedResidualBlock(op_bugs.Block):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        x = h + self.attn(h)  # BUG: the residual is x, not its normed value
        return x + self.mlp(self.ln2(x))


def test_residual_from_the_normed_value_is_found_at_the_block(reference, tmp_path):
    case = load_case(REFERENCE)
    model = op_bugs.OpLM()
    model.blocks[1] = NormedResidualBlock()
    case.model = model
    load_weights(case.model, reference, None)
    result = diff(reference, capture(case, tmp_path / "residual.h5"))
    origin = result.origin
    assert (origin.site, origin.pass_, origin.step) == ("blocks.1#0", "forward", 0)
    assert "fault is in its own code between its children" in origin.reason
