"""Acceptance tests for what a user trusts the diff with: the mapping travels with the port
trace, guessed names are refused rather than judged, a single-site bug deep in a model gives
exactly one origin, what cannot be judged is said so rather than blamed, the precision hint is
a command that works, and map-check through the command line."""

from __future__ import annotations

import hashlib
import json
import shlex
import shutil
import tomllib
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

from layerdiff import (
    Case,
    DiffError,
    capture,
    diff,
    load_case,
    load_weights,
    open_trace,
    seed_everything,
)
from layerdiff.cli import main
from layerdiff.compare.judge import Status, Verdict
from layerdiff.report.findings.diff import describe_origin
from layerdiff.report.terminal import format_diff
from reference_models.catalog import find
from tests import gpt_cases
from tests.deep_cases import softmax_backward_batch0

ROOT = Path(__file__).resolve().parent.parent
TRANSFORMER = "reference_models.transformer:reference"
TRANSFORMER_BUG = "reference_models.transformer_port:bug_softmax_axis"
TRANSFORMER_MAP = ROOT / "reference_models" / "transformer_port.map.toml"
GPT_MAP = ROOT / "tests" / "gpt_port.map.toml"
LOSS = "<loss>#0"


def _cli(*args):
    """The command line in-process (absolute paths only: usable from module fixtures)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def _origins(result) -> list[tuple]:
    return [(o.step, o.pass_, o.site, o.port_site, o.role, o.arg) for o in result.origins]


def _paragraph(output: str, start: str) -> str:
    """The line of the terminal report that starts with ``start``, with its wrapped
    continuation lines, joined into one."""
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(start))
    text = [lines[first].strip()]
    for line in lines[first + 1:]:
        if not line.startswith(" " * 10) or not line.strip():
            break
        text.append(line.strip())
    return " ".join(text)


# ---- 1. the mapping travels with the trace

@pytest.fixture(scope="module")
def mapped_port(reference_traces, tmp_path_factory):
    """The transformer port with a planted bug, captured by the command line with its weights
    loaded through a copy of the bundled mapping, which is then deleted: only the trace holds
    it. Returns (reference trace, port trace, the mapping's text)."""
    reference = reference_traces(TRANSFORMER)
    folder = tmp_path_factory.mktemp("mapped")
    mapping = folder / "captured.map.toml"
    shutil.copyfile(TRANSFORMER_MAP, mapping)
    text = mapping.read_text(encoding="utf-8")
    port = folder / "port.h5"
    result = _cli("capture", TRANSFORMER_BUG, "--weights-from", reference, "--map", mapping,
                  "-o", port)
    assert result.exit_code == 0, result.output
    mapping.unlink()
    return reference, port, text


def test_capture_records_the_mapping_text_and_its_hash(mapped_port):
    _, port, text = mapped_port
    with open_trace(port) as trace:
        recorded = trace.meta["weights"]["mapping"]
    assert recorded["text"] == text
    assert recorded["sha256"] == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert recorded["name"] == "captured.map.toml"


def test_diff_without_map_pairs_exactly_as_with_it(mapped_port):
    reference, port, _ = mapped_port
    recorded = diff(reference, port)
    given = diff(reference, port, mapping=TRANSFORMER_MAP)
    assert not recorded.passed
    assert _origins(recorded) == _origins(given)
    assert (recorded.origin.site, recorded.origin.port_site, recorded.origin.pass_) == (
        "encoder.layers.0.self_attn#0", "enc.0.self_attn#0", "forward")
    assert len(recorded.rows) == len(given.rows)
    pairs = ["site", "port_site", "role", "arg", "port_arg", "verdict"]
    assert recorded.rows[pairs].equals(given.rows[pairs])
    assert recorded.meta["warnings"] == given.meta["warnings"] == []


def test_cli_diff_says_the_mapping_was_recorded_at_capture(mapped_port, run):
    reference, port, _ = mapped_port
    result = run("diff", reference, port)
    assert result.exit_code == 1, result.output
    assert result.output.splitlines()[0].startswith(
        "FAIL  origin: encoder.layers.0.self_attn#0, forward output")
    mapping_line = _paragraph(result.output, "mapping ")
    assert "captured.map.toml" in mapping_line
    assert "recorded in port.h5 at capture" in mapping_line
    assert "warning" not in result.output


def test_a_map_with_the_same_text_elsewhere_gives_no_warning(mapped_port, run):
    reference, port, _ = mapped_port
    result = run("diff", reference, port, "--map", TRANSFORMER_MAP)
    assert result.exit_code == 1, result.output
    assert "warning" not in result.output


def test_a_map_whose_text_differs_warns_naming_both_and_is_followed(mapped_port, run,
                                                                     tmp_path):
    reference, port, text = mapped_port
    edited = tmp_path / "edited.map.toml"
    edited.write_text("# edited after capture\n" + text, encoding="utf-8")
    result = run("diff", reference, port, "--map", edited)
    assert result.exit_code == 1, result.output
    warning = _paragraph(result.output, "warning")
    assert "edited.map.toml" in warning and "captured.map.toml" in warning
    followed = diff(reference, port, mapping=edited)
    assert _origins(followed) == _origins(diff(reference, port))
    assert any("edited.map.toml" in w and "captured.map.toml" in w
               for w in followed.meta["warnings"])


def test_a_yaml_mapping_travels_the_same_way(mapped_port, run, tmp_path):
    reference, toml_port, _ = mapped_port
    mapping = tmp_path / "port.map.yaml"
    with TRANSFORMER_MAP.open("rb") as f:
        mapping.write_text(yaml.safe_dump(tomllib.load(f), sort_keys=False), encoding="utf-8")
    port = tmp_path / "yaml_port.h5"
    captured = run("capture", TRANSFORMER_BUG, "--weights-from", reference, "--map", mapping,
                   "-o", port)
    assert captured.exit_code == 0, captured.output
    with open_trace(port) as trace:
        recorded = trace.meta["weights"]["mapping"]
    assert recorded["name"] == "port.map.yaml"
    assert recorded["sha256"] == hashlib.sha256(mapping.read_bytes()).hexdigest()
    mapping.unlink()
    from_yaml = diff(reference, port)
    from_toml = diff(reference, toml_port)
    assert _origins(from_yaml) == _origins(from_toml)
    assert len(from_yaml.rows) == len(from_toml.rows)
    result = run("diff", reference, port)
    assert result.exit_code == 1
    assert "recorded in yaml_port.h5 at capture" in _paragraph(result.output, "mapping ")


# ---- 2. guessed names are refused

@pytest.fixture(scope="module")
def unmapped_port(reference_traces, tmp_path_factory):
    """The same port, its weights loaded through the mapping, captured with nothing recorded."""
    reference = reference_traces(TRANSFORMER)
    case = load_case(TRANSFORMER_BUG)
    load_weights(case.model, reference, TRANSFORMER_MAP)
    port = capture(case, tmp_path_factory.mktemp("unmapped") / "port.h5")
    return reference, port


def test_a_port_without_a_mapping_is_refused_not_guessed(unmapped_port):
    reference, port = unmapped_port
    with open_trace(port) as trace:
        assert not (trace.meta.get("weights") or {}).get("mapping")
    with pytest.raises(DiffError) as raised:
        diff(reference, port)
    message = str(raised.value)
    assert "the names differ" in message and "write a mapping" in message
    # given the mapping, the same traces are judged and the bug is found at its site
    assert diff(reference, port, mapping=TRANSFORMER_MAP).origin.port_site == find(
        TRANSFORMER_BUG).site


def test_cli_refuses_guessed_names_with_one_error_line(unmapped_port, run):
    reference, port = unmapped_port
    result = run("diff", reference, port)
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1, result.output
    assert lines[0].startswith("error:") and "the names differ" in lines[0]
    assert "write a mapping" in lines[0]
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)  # an exit, not an escaped exception


# ---- 3. exactly one origin for a single-site bug deep in a model

@pytest.mark.parametrize("strength", [1.0, 0.1, 0.02])
def test_a_deep_softmax_backward_bug_has_exactly_one_origin(strength, reference_traces,
                                                            tmp_path):
    reference = reference_traces(TRANSFORMER, loss_scale=1e6)
    port = capture(softmax_backward_batch0(layer=1, strength=strength), tmp_path / "p.h5",
                   loss_scale=1e6)
    result = diff(reference, port)
    assert not result.passed
    assert len(result.origins) == 1, [describe_origin(o) for o in result.origins]
    origin = result.origin
    assert (origin.site, origin.pass_, origin.step) == ("decoder.layers.1.self_attn#0",
                                                        "backward", 0)
    assert (result.rows["status"] == Status.ORIGIN).sum() >= 1
    assert (result.rows.loc[result.rows["pass"] == "forward", "verdict"] != Verdict.OUT).all()


@pytest.mark.parametrize("loss_scale", [1.0, 1e6])
def test_gpt_gelu_backward_bug_has_exactly_one_origin(loss_scale, reference_traces, tmp_path):
    reference = reference_traces("tests.gpt_cases:reference", loss_scale=loss_scale)
    case = gpt_cases.port_bug_gelu_backward()
    load_weights(case.model, reference, GPT_MAP)
    port = capture(case, tmp_path / "p.h5", loss_scale=loss_scale)
    result = diff(reference, port, mapping=GPT_MAP)
    assert len(result.origins) == 1, [describe_origin(o) for o in result.origins]
    origin = result.origin
    assert (origin.site, origin.port_site, origin.pass_) == (
        "transformer.h.1.mlp.act#0", "transformer.h.1.mlp.gelu#0", "backward")


# ---- 4. what cannot be judged is said so, not blamed

class _Net(nn.Module):
    def __init__(self, fc2: type[nn.Module] = nn.Linear) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.fc2 = fc2(8, 3)

    def forward(self, x: torch.Tensor):
        return self.fc2(torch.relu(self.fc1(x)))


class _DictPort(_Net):
    """Returns its output under another structure, two tensors of one shape (which of them is
    the reference's is a guess), and scales it in its own code after its last child: nothing
    records that product but the model's output, which has no partner."""

    def forward(self, x: torch.Tensor):
        logits = self.fc2(torch.relu(self.fc1(x)))
        return {"logits": logits * 1.5, "unscaled": logits}


class _OneTensorDictPort(_Net):
    """Returns its one output in a dict, scaled in its own code after its last child."""

    def forward(self, x: torch.Tensor):
        return {"logits": self.fc2(torch.relu(self.fc1(x))) * 1.5}


class _WeightGradTimes(torch.autograd.Function):
    """A linear layer whose weight gradient is 1.5 times too large (its input gradient is
    right)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        return x @ weight.t() + bias

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return grad @ weight, 1.5 * grad.t() @ x, grad.sum(0)


class _WrongWeightGradLinear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _WeightGradTimes.apply(x, self.weight, self.bias)


def _tiny_case(model_class: type[nn.Module], pick=lambda out: out, **kwargs) -> Case:
    seed_everything(0)
    model = model_class(**kwargs)
    x, y = torch.randn(5, 6), torch.arange(5) % 3
    return Case(model=model, inputs=(x,), loss_fn=lambda out: F.cross_entropy(pick(out), y),
                seed=0)


@pytest.fixture
def restructured(tmp_path):
    reference = capture(_tiny_case(_Net), tmp_path / "ref.h5")
    port = capture(_tiny_case(_DictPort, lambda out: out["logits"]), tmp_path / "port.h5")
    return diff(reference, port)


def test_a_loss_whose_input_has_no_partner_is_not_named_an_origin(restructured):
    result = restructured
    assert not result.passed
    loss = result.rows[result.rows["site"] == LOSS]
    assert (loss["verdict"] == Verdict.OUT).all() and len(loss)
    assert (loss["status"] == Status.CANNOT_JUDGE).all()
    assert LOSS not in {o.site for o in result.origins}
    # every paired forward record is identical: nothing else can be named either
    assert result.origins == [] and result.origin is None
    unpaired = result.unmatched[result.unmatched["site"] == "<root>#0"]
    assert {"output", "grad_output"} <= set(unpaired["role"])


def test_a_dict_holding_one_tensor_pairs_with_the_plain_output_and_names_the_root(tmp_path):
    reference = capture(_tiny_case(_Net), tmp_path / "ref.h5")
    port = capture(_tiny_case(_OneTensorDictPort, lambda out: out["logits"]),
                   tmp_path / "port.h5")
    result = diff(reference, port)
    root = result.rows[(result.rows["site"] == "<root>#0") & (result.rows["role"] == "output")]
    assert list(root["port_arg"]) == ["logits"]
    assert [(o.site, o.pass_, o.role) for o in result.origins] == [
        ("<root>#0", "forward", "output")]
    assert "own code" in result.origin.reason


def test_the_terminal_report_says_it_cannot_judge(restructured):
    text = format_diff(restructured)
    assert text.startswith("FAIL")
    assert "origin:" not in text.splitlines()[0]
    assert "cannot judge" in text and LOSS in text


def test_the_cannot_judge_verdict_line_is_a_readable_sentence(restructured):
    first = format_diff(restructured).splitlines()[0]
    assert len(first) <= 100
    assert f"cannot judge {LOSS}, which holds the first record out" in first
    assert "…" not in first


def test_a_weight_gradient_whose_incoming_gradient_is_declared_unmatched_is_not_an_origin(
        tmp_path):
    reference = capture(_tiny_case(_Net), tmp_path / "ref.h5")
    port = capture(_tiny_case(_Net, fc2=_WrongWeightGradLinear), tmp_path / "port.h5")
    plain = diff(reference, port)  # paired, the wrong weight gradient is an origin at its site
    assert [(o.site, o.role) for o in plain.origins] == [("fc2#0", "weight_grad")]

    mapping = tmp_path / "m.toml"
    mapping.write_text('version = 1\n\n[[unmatched]]\nreference = "fc2"\n'
                       'why = "the port computes fc2 in a fused kernel"\n', encoding="utf-8")
    result = diff(reference, port, mapping=mapping)
    assert not result.passed
    assert result.origins == []
    rows = result.rows
    grads = rows[(rows["site"] == "fc2#0") & (rows["role"] == "weight_grad")]
    out = grads[grads["verdict"] == Verdict.OUT]
    assert list(out["arg"]) == ["weight"]
    assert (out["status"] == Status.CANNOT_JUDGE).all()
    unmatched = result.unmatched
    declared = unmatched[(unmatched["side"] == "reference") & (unmatched["site"] == "fc2#0")]
    assert list(declared["declared"]) == [True]
    assert "cannot judge" in format_diff(result)


# ---- 5. the precision hint is the command that makes the baseline

def _float16_port(reference: Path, path: Path, **options) -> Path:
    case = load_case("reference_models.mlp_port:port")
    load_weights(case.model, reference)
    return capture(case, path, dtype="float16", **options)


def _options(tokens: list[str]) -> dict[str, str]:
    return {tokens[i]: tokens[i + 1] for i in range(3, len(tokens) - 1, 2)}


@pytest.mark.parametrize("options, flags", [
    ({}, {"--steps": "1"}),
    ({"steps": 2, "loss_scale": 1024.0}, {"--steps": "2", "--loss-scale": "1024"}),
], ids=["defaults", "steps-and-loss-scale"])
def test_precision_hint_is_the_command_that_makes_the_baseline(options, flags, run, tmp_path):
    spec = "reference_models.mlp:reference"
    reference = capture(load_case(spec), tmp_path / "ref.h5", **options)
    port = _float16_port(reference, tmp_path / "port16.h5", **options)
    plain = diff(reference, port)
    hint = plain.meta["precision"]
    assert (hint["reference"], hint["port"]) == ("float32", "float16")
    tokens = shlex.split(hint["capture"])
    assert tokens[:3] == ["layerdiff", "capture", spec]
    given = _options(tokens)
    baseline = Path(given.pop("-o"))
    assert given == {"--dtype": "float16", **flags}

    made = run(*tokens[1:])
    assert made.exit_code == 0, made.output
    with open_trace(baseline) as trace, open_trace(reference) as ref:
        assert trace.meta["dtype"] == "float16"
        assert trace.meta["steps"] == ref.meta["steps"]
        assert trace.loss_scale == ref.loss_scale
    judged = run(*shlex.split(hint["diff"])[1:])
    assert judged.exit_code == 0, judged.output
    assert diff(reference, port, baseline=baseline).passed


def test_precision_hint_reproduces_a_reference_run_shorter_than_its_case(run, tmp_path):
    spec = "reference_models.convlstm:reference"
    assert load_case(spec).steps == 3
    reference = capture(load_case(spec), tmp_path / "ref.h5", steps=1)
    port = capture(load_case(spec), tmp_path / "port16.h5", dtype="float16", steps=1)
    hint = diff(reference, port).meta["precision"]
    tokens = shlex.split(hint["capture"])
    made = run(*tokens[1:])
    assert made.exit_code == 0, made.output
    with open_trace(_options(tokens)["-o"]) as baseline:
        assert baseline.meta["steps"] == 1


def test_the_hint_with_a_recorded_mapping_runs_as_given(reference_traces, run, tmp_path):
    """A float16 port whose mapping was recorded at capture: the hint's diff needs no --map."""
    from layerdiff.capture.torch_capture import weights_meta

    reference = capture(gpt_cases.reference(), tmp_path / "ref.h5", loss_scale=1024.0)
    case = gpt_cases.port()
    load_weights(case.model, reference, GPT_MAP)
    port = capture(case, tmp_path / "port16.h5", dtype="float16", loss_scale=1024.0,
                   extra_meta=weights_meta(reference, GPT_MAP))
    hint = diff(reference, port).meta["precision"]
    assert "--map" not in hint["diff"]
    assert run(*shlex.split(hint["capture"])[1:]).exit_code == 0
    judged = run(*shlex.split(hint["diff"])[1:])
    assert judged.exit_code == 0, judged.output
    assert "recorded in port16.h5 at capture" in judged.output


# ---- 6. map-check through the command line

MLP = "reference_models.mlp:reference"


def test_map_check_names_the_weight_loaded_the_wrong_way_round(run, reference_traces):
    reference = reference_traces(MLP)
    result = run("map-check", reference, "reference_models.mlp_port:bug_weight_not_transposed")
    assert result.exit_code == 1, result.output
    flagged = [line for line in result.output.splitlines() if "suspicious" in line]
    assert len(flagged) == 1 and flagged[0].startswith("fc2.weight ")
    assert result.output.rstrip().splitlines()[-1].startswith("FAIL")


def test_map_check_json_on_stdout(run, reference_traces):
    reference = reference_traces(MLP)
    result = run("map-check", reference, "reference_models.mlp_port:bug_weight_not_transposed",
                 "--json", "-")
    assert result.exit_code == 1
    report = json.loads(result.output)
    assert report["verdict"] == "fail"
    statuses = {entry["port"]: entry["status"] for entry in report["entries"]}
    assert statuses.pop("fc2.weight") == "suspicious-transpose"
    assert set(statuses.values()) == {"ok"}


def test_map_check_passes_the_correct_port(run, reference_traces):
    reference = reference_traces(MLP)
    result = run("map-check", reference, "reference_models.mlp_port:port")
    assert result.exit_code == 0, result.output
    assert result.output.rstrip().splitlines()[-1].startswith("PASS")
    report = json.loads(run("map-check", reference, "reference_models.mlp_port:port",
                            "--json", "-").output)
    assert report["verdict"] == "pass"
