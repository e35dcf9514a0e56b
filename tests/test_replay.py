"""Replay: each port layer on the reference's own inputs finds the planted bug locally, at its
site and in its pass only, and exonerates the layers that merely pass an error on."""

from __future__ import annotations

import fnmatch
import json

import pytest
import torch

from layerdiff import DiffError, load_case
from layerdiff.errors import CaptureError
from layerdiff.replay import ReplayOutcome, replay
from layerdiff.trace.arguments import rebuild_call
from reference_models.catalog import CATALOG, find

CHECKED = [info for info in CATALOG if info.kind in ("port", "bug")]


@pytest.mark.parametrize("info", CHECKED, ids=[i.spec.split(".")[-1] for i in CHECKED])
def test_replay_finds_each_bug_locally_and_nothing_in_correct_ports(info, reference_traces):
    result = replay(reference_traces(info.reference), load_case(info.spec),
                    mapping=info.mapping_path)
    assert not result.cannot_judge
    table = result.local
    local = table[table["verdict"] == "LOCAL ERROR"]
    if info.kind == "port":
        assert result.passed and local.empty, local
        return
    assert info.site in set(local["port_site"])
    outside = [s for s in local["port_site"] if not fnmatch.fnmatchcase(s, info.runs_in)]
    assert not outside, f"local error outside the bug's code: {outside}"
    if info.pass_ == "backward":  # a backward-only bug is flagged in the backward only
        assert set(local["pass"]) == {"backward"}


def test_replay_exonerates_layers_that_only_pass_an_error_on(reference_traces):
    info = find("reference_models.mlp_port:bug_weight_not_transposed")
    table = replay(reference_traces(info.reference), load_case(info.spec)).local
    act2 = table[(table["port_site"] == "act2#0") & (table["pass"] == "forward")].iloc[0]
    assert act2["propagated"] > 1 and act2["local"] <= 1 and act2["verdict"] == "exonerated"


def test_the_reference_replayed_into_itself_has_no_local_error(reference_traces):
    """In particular an LSTM cell, whose c output also feeds its own h: the recorded gradient
    of c already holds that path and must not be counted twice."""
    ref = reference_traces("reference_models.convlstm:reference")
    result = replay(ref, load_case("reference_models.convlstm:reference"), propagated=False)
    assert result.passed and result.diff.rows["ratio"].max() < 0.01


def test_layers_that_draw_random_numbers_are_skipped_saying_why(reference_traces):
    result = replay(reference_traces("reference_models.mlp:reference"),
                    load_case("reference_models.mlp_port:port"), propagated=False)
    skipped = dict(result.skipped)
    assert "random" in skipped["drop#0"] and result.passed


def test_a_port_layer_that_raises_is_named_and_the_rest_replayed(reference_traces):
    case = load_case("reference_models.mlp_port:port")

    def broken(*args, **kwargs):
        raise RuntimeError("kernel not implemented")

    case.model.act2.forward = broken
    result = replay(reference_traces("reference_models.mlp:reference"), case,
                    propagated=False)
    failed = dict(result.cannot_judge)
    assert "kernel not implemented" in failed["act2#0"]
    assert "fc2#0" in set(result.diff.rows["site"])
    # a layer that raises is never within tolerance: the replay as a whole cannot judge
    assert result.outcome == "cannot-judge" and not result
    # the outcome is a ReplayOutcome, and its JSON the same plain string as before
    assert result.outcome is ReplayOutcome.CANNOT_JUDGE
    verdict = json.loads(json.dumps(result.as_json()))["verdict"]
    assert verdict == "cannot-judge" and type(verdict) is str


def test_replay_needs_tensors_not_a_summary(reference_traces):
    ref = reference_traces("reference_models.mlp:reference", summary=True)
    with pytest.raises(DiffError, match=r"summary trace.*without --summary"):
        replay(ref, load_case("reference_models.mlp_port:port"))


def test_a_site_glob_that_matches_nothing_is_refused(reference_traces):
    with pytest.raises(DiffError, match="matches no site"):
        replay(reference_traces("reference_models.mlp:reference"),
               load_case("reference_models.mlp_port:port"), sites=["decoder.*"])


def test_replay_of_selected_sites_only(reference_traces):
    result = replay(reference_traces("reference_models.mlp:reference"),
                    load_case("reference_models.mlp_port:port"), sites=["fc*"],
                    propagated=False)
    assert set(result.diff.rows["site"]) == {"fc1#0", "fc2#0"}


def test_a_numpy_port_without_layers_cannot_be_replayed(reference_traces):
    from tests.tiny_cases import numpy_port

    with pytest.raises(CaptureError, match="per-site layers"):
        replay(reference_traces("reference_models.mlp:reference"), numpy_port())


def test_calls_are_rebuilt_from_argument_paths():
    x, h, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    args, kwargs = rebuild_call([("0", x), ("1.0", h), ("1.1", c), ("mask", None),
                                 ("cfg.mode", "train"), ("opts", {"a": 1})])
    assert args[0] is x and args[1] == (h, c)
    assert kwargs == {"mask": None, "cfg": {"mode": "train"}, "opts": {"a": 1}}


def test_cli_replay_exit_codes(run, reference_traces, tmp_path):
    ref = reference_traces("reference_models.cnn:reference")
    bad = run("replay", ref, "reference_models.cnn_port:bug_relu_backward_batch", "--json",
              tmp_path / "r.json")
    assert bad.exit_code == 1
    assert bad.output.startswith("FAIL  local error in 1 site(s): block.act#0 (backward)")
    assert max(len(line) for line in bad.output.splitlines()) <= 100
    good = run("replay", ref, "reference_models.cnn_port:port")
    assert good.exit_code == 0 and good.output.startswith("PASS")
    assert run("replay", tmp_path / "missing.h5", "reference_models.cnn_port:port"
               ).exit_code == 2





def test_weight_gradients_are_compared_only_when_every_call_was_replayed(reference_traces):
    ref = reference_traces("reference_models.convlstm:reference")
    result = replay(ref, load_case("reference_models.convlstm:reference"),
                    sites=["cell.conv#2"], propagated=False)
    assert result.passed
    assert "weight_grad" not in set(result.diff.rows["role"])
    assert any("1 of 6 calls replayed" in why for _, why in result.skipped)


def test_self_attention_called_as_attn_x_x_x_replays_into_itself_cleanly(reference_traces):
    """nn.MultiheadAttention(x, x, x): the reference records x's whole gradient once (all three
    uses); replay must give the three arguments one leaf, or it measures the query's part."""
    from layerdiff import load_case, replay

    ref = reference_traces("reference_models.batch_mixing:reference")
    result = replay(ref, load_case("reference_models.batch_mixing:reference"))
    assert result, result.local
    judged = result.diff.rows
    grads = judged[(judged["site"] == "blocks.0.attn.mha#0") & (judged["role"] == "grad_input")]
    assert len(grads) == 1 and grads.iloc[0]["ratio"] <= 1


_NAN_PORT = (
    "import torch\n"
    "from reference_models import mlp_port\n"
    "class NaNGELU(torch.nn.Module):\n"
    "    def forward(self, x):  # a kernel that writes NaN into the first three columns\n"
    "        y = torch.nn.functional.gelu(x)\n"
    "        return torch.cat([torch.full_like(y[:, :3], float('nan')), y[:, 3:]], dim=1)\n"
    "def port():\n"
    "    case = mlp_port.port()\n"
    "    case.model.act2 = NaNGELU()\n"
    "    return case\n")


def test_a_port_layer_whose_output_is_nan_fails_and_is_never_taken_for_randomness(
        run, reference_traces, tmp_path, monkeypatch):
    """Each call runs twice to tell dropout apart; NaN == NaN is false, so a NaN at the same
    places in both runs once passed for randomness and the layer was skipped (exit 0)."""
    (tmp_path / "nan_port.py").write_text(_NAN_PORT)
    monkeypatch.syspath_prepend(str(tmp_path))
    ref = reference_traces("reference_models.mlp:reference")
    result = replay(ref, load_case("nan_port:port"), propagated=False)
    assert "act2#0" not in dict(result.skipped), result.skipped
    assert not result.cannot_judge and not result and result.outcome == "fail"
    local = result.local
    failed = set(local[local["verdict"] == "LOCAL ERROR"]["port_site"])
    assert "act2#0" in failed, local
    said = run("replay", ref, "nan_port:port")
    assert said.exit_code == 1 and said.output.startswith("FAIL"), said.output
    assert "act2#0" in said.output.splitlines()[0]
    # dropout is still told apart: its output changes with the seed, and it is finite
    assert "random" in dict(result.skipped)["drop#0"]
