"""Swap and bisect: a port layer inside the reference shows whether it alone breaks training,
and bisect finds the culprit layers in about log2(n) probes."""

from __future__ import annotations

import fnmatch
import json
import math

import pytest
import torch

from layerdiff import DiffError, load_case
from layerdiff.compare.tolerances import Tolerances
from layerdiff.replay import Swapper, bisect, swap
from reference_models import mlp, mlp_port
from reference_models.catalog import CATALOG, find

BUGS = [info for info in CATALOG if info.kind == "bug"]
PORTS = [info for info in CATALOG if info.kind == "port"]
SLOW = {"transformer"}  # five bugs each in six attention or ten norm layers: ~15 s a search


def _factory(spec):
    return lambda: load_case(spec)


def _marks(info):
    return [pytest.mark.slow] if info.model in SLOW else []


@pytest.mark.parametrize("info", [pytest.param(i, marks=_marks(i)) for i in BUGS],
                         ids=[i.spec.split(".")[-1] for i in BUGS])
def test_bisect_finds_each_planted_bug_and_only_its_layers(info):
    swapper = Swapper(_factory(info.reference), _factory(info.spec), info.mapping_path)
    result = bisect(swapper)
    assert result.reproduced
    culprits = [port for _, port in result.culprits]
    assert info.site.rpartition("#")[0] in culprits
    assert all(fnmatch.fnmatchcase(f"{c}#0", info.runs_in) or
               fnmatch.fnmatchcase(info.site, f"{c}#*") for c in culprits), culprits
    if len(culprits) == 1:  # one culprit: about log2 of the candidates, plus the checks
        # (everything, the leaves, the containers when the leaves are within, the culprit)
        assert len(result.probes) <= 2 * math.ceil(math.log2(len(result.candidates))) + 4


@pytest.mark.parametrize("info", PORTS, ids=[i.spec.split(".")[-1] for i in PORTS])
def test_every_correct_port_layer_swapped_in_keeps_the_reference_within(info):
    swapper = Swapper(_factory(info.reference), _factory(info.spec), info.mapping_path)
    result = swapper.run(swapper.leaves())
    assert not result.breaks, result.describe()


class _TanhGELU(torch.nn.Module):
    def forward(self, x):  # the tanh approximation: 1e-3 off the erf GELU
        return torch.nn.functional.gelu(x, approximate="tanh")


def _two_bugs():
    case = mlp_port.bug_weight_not_transposed()
    case.model.act2 = _TanhGELU()
    return case


def test_bisect_finds_two_independent_culprits():
    result = bisect(Swapper(mlp.reference, _two_bugs))
    assert [port for _, port in result.culprits] == ["fc2", "act2"]


def test_swap_reports_loss_outputs_and_gradients():
    result = swap(mlp.reference, mlp_port.bug_weight_not_transposed, ["fc2"])
    assert result.breaks and result.steps == 1
    whats = " ".join(r.what for r in result.rows)
    assert "loss, step 0" in whats and "output 0" in whats
    assert "weight_grad fc2.weight (port fc2.weight)" in whats
    assert result.losses[0][0] != result.losses[0][1]


def test_a_correct_layer_swapped_in_changes_nothing_beyond_tolerance():
    result = swap(mlp.reference, mlp_port.port, ["fc1", "act2", "head"])
    assert not result.breaks and result.ratio < 0.1


def test_the_reference_layer_inside_the_port_confirms_the_fix():
    """--into port: with the reference's fc2 in the buggy port, it matches the reference."""
    fixed = swap(mlp.reference, mlp_port.bug_weight_not_transposed, ["fc2"], into="port")
    assert not fixed.breaks
    wrong_layer = swap(mlp.reference, mlp_port.bug_weight_not_transposed, ["fc1"], into="port")
    assert wrong_layer.breaks


def test_a_numpy_layer_goes_in_through_an_autograd_function():
    info = find("reference_models.convlstm_numpy:bug_accumulator_not_zeroed")
    broken = swap(_factory(info.reference), _factory(info.spec), ["cell.conv"])
    assert broken.breaks and broken.steps == 3  # trains: clipping and SGD, three steps
    correct = swap(_factory(info.reference), _factory("reference_models.convlstm_numpy:port"),
                   ["cell.conv", "head"])
    assert not correct.breaks


def test_a_site_in_neither_model_is_refused_with_examples():
    with pytest.raises(DiffError, match=r"has no layer in both models.*fc1"):
        swap(mlp.reference, mlp_port.port, ["decoder.attn"])


def test_cli_swap_and_bisect(run, tmp_path):
    swapped = run("swap", "reference_models.mlp:reference",
                  "reference_models.mlp_port:bug_weight_not_transposed", "--site", "fc2#0")
    assert swapped.exit_code == 1 and swapped.output.startswith("BREAKS")
    found = run("bisect", "reference_models.mlp:reference",
                "reference_models.mlp_port:bug_weight_not_transposed", "--json",
                tmp_path / "b.json")
    assert found.exit_code == 1
    assert "probe   1  breaks" in found.output and "culprits: fc2 (" in found.output
    report = json.loads((tmp_path / "b.json").read_text())
    assert report["culprits"] == [{"reference": "fc2", "port": "fc2"}]
    assert len(report["probes"]) >= 2 and {"swapped", "breaks"} <= set(report["probes"][0])
    clean = run("bisect", "reference_models.mlp:reference", "reference_models.mlp_port:port")
    assert clean.exit_code == 0 and "nothing to find" in clean.output
    bad = run("swap", "reference_models.mlp:reference", "no.such:case", "--site", "fc2")
    assert bad.exit_code == 2 and "Traceback" not in bad.output


def test_the_reference_attention_goes_into_the_port_with_its_arguments_repeated():
    """attn(x, mask=m) in the port calls the reference's attn(x, x, x, mask=m)."""
    info = find("reference_models.transformer_port:port")
    result = swap(_factory(info.reference), _factory(info.spec),
                  ["decoder.layers.0.self_attn", "decoder.layers.0.cross_attn",
                   "decoder.layers.1"], mapping=info.mapping_path, into="port")
    assert not result.breaks, result.describe()
    assert "in the port" in result.describe()


def test_cases_given_as_objects_are_copied_for_every_run():
    result = swap(mlp.reference(), mlp_port.port(), ["fc2"])
    assert not result.breaks and result.ratio < 0.1


def test_a_numpy_layer_whose_module_has_parameters_inside_cannot_be_judged():
    result = swap(_factory("reference_models.convlstm:reference"),
                  _factory("reference_models.convlstm_numpy:port"), ["cell"])
    assert result.outcome == "cannot-judge" and not result and not result.breaks
    assert result.not_swapped[0][0] == "cell"
    assert "parameters inside its children" in result.not_swapped[0][1]


def _bfloat16_port():
    case = mlp_port.port()
    case.model.to(torch.bfloat16)
    return case


def test_a_port_layer_in_another_dtype_is_called_in_its_own():
    """A bfloat16 port layer inside the float32 reference: inputs are cast to bfloat16 on the
    way in and outputs back to float32, so it runs (not 'cannot judge'), and the error is
    bfloat16 rounding: out at float32's tolerance, within at bfloat16's."""
    strict = swap(mlp.reference, _bfloat16_port, ["fc2"])
    assert strict.outcome == "breaks" and not strict.not_swapped
    loose = swap(mlp.reference, _bfloat16_port, ["fc2"],
                 tolerances=Tolerances(rtol=1.6e-2, atol=1e-2))
    assert loose.outcome == "within", loose.describe()


def test_a_swap_report_leads_with_what_was_judged(run):
    within = run("swap", "reference_models.mlp:reference", "reference_models.mlp_port:port",
                 "--site", "fc1")
    assert within.exit_code == 0, within.output
    assert "every judged record (8: loss, outputs, weight gradients) is identical" in (
        within.output)
    assert "(reported" not in within.output  # no weight moved: nothing unjudged to show
    broken = run("swap", "reference_models.mlp:reference",
                 "reference_models.mlp_port:bug_gelu_tanh", "--site", "act2")
    lines = broken.output.splitlines()
    judged = lines.index("largest differences (x tolerance):")
    reported = next(i for i, line in enumerate(lines) if line.startswith("weights after"))
    assert judged < reported and "weight_grad" in lines[judged + 2]
