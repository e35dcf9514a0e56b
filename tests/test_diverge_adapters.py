"""diverge on pairs whose mapping names code: call adapters (the port's call rebuilt from the
reference's recorded arguments) and conversions (a parameter made by a function). The statistics
runs keep tensor data for exactly what that code reads; the printed follow-up commands carry the
mapping, and run as printed.

Pairs: tests.real_pairs_cases' reference (Hugging Face's way of calling) against its Meta-style
port ``port_freqs`` (port-only ``freqs_cos``/``freqs_sin`` inputs, made by call adapters), and
the bundled Hugging Face Llama against its Meta-style port (call adapters and the q/k row
permutation ``hf_to_meta_qk``)."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import numpy as np
import pytest
import torch

from layerdiff.debug.diverge import Cause, data_needed, diverge
from layerdiff.debug.optimizer_update import WEIGHT_DECAY
from layerdiff.report.diverge_html import render_diverge_html
from layerdiff.report.findings import render
from layerdiff.trace import open_trace
from tests import real_pairs_cases as cases
from tests.test_real_pairs_diff import ADAPTERS

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parent.parent
LLAMA_MAP = ROOT / "reference_models" / "hf_llama.map.toml"


@pytest.fixture
def adapters(tmp_path) -> Path:
    path = tmp_path / "adapters.map.toml"
    path.write_text(ADAPTERS, encoding="utf-8")
    return path


def _checked(result):
    json.dumps(result.as_json(), allow_nan=False)
    # a line over 100 columns holds one word a shell command cannot break (a long temporary
    # path, as pytest-xdist's workers make them)
    assert all(len(line) <= 100 or len(line.rstrip(" \\").split()) == 1
               for line in render(result).splitlines())
    return result


def _kept(path: Path) -> set[str]:
    """The sites whose records hold tensor data (the loss aside)."""
    with open_trace(path) as trace:
        index = trace.index
        return set(index[(index["segment"] >= 0) & (index["site"] != "<loss>#0")]["site"])


def _commands(text: str, after: str) -> list[list[str]]:
    """The shell commands printed after the line ending with ``after``, unwrapped."""
    block = text.split(after, 1)[1].split("\n\n", 1)[0]
    lines = [line for line in block.replace("\\\n", " ").splitlines() if line.startswith("  ")]
    return [shlex.split(line) for line in lines if line.strip().startswith("layerdiff ")]


# ---- a port that turns its rotation the wrong way from its third call after its weights
# were loaded: a bug that only appears after a few steps (a warm-up path that switches to
# another kernel, say). diverge runs each side from its starting weights, loaded.
class LateRotaryAttention(cases.FreqsAttention):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def _load_from_state_dict(self, *args, **kwargs):
        self.calls = 0
        return super()._load_from_state_dict(*args, **kwargs)

    def forward(self, x, freqs_cos, freqs_sin):
        self.calls += 1
        self.sign = -1.0 if self.calls > 2 else 1.0  # BUG from step 2 on
        return super().forward(x, freqs_cos, freqs_sin)


def _late_rotary_port():
    case = dataclasses.replace(cases.port_freqs(), name="port_freqs_late_rotary", steps=4)
    case.model.layers[1].attn = LateRotaryAttention()
    return case


# ---- what the statistics runs keep

def test_the_data_kept_is_what_the_call_adapters_read(adapters):
    plan = data_needed(cases.reference(), cases.port_freqs(), adapters)
    assert plan.reference == plan.port == {"layers.0", "layers.1", "layers.0.attn",
                                           "layers.1.attn"}
    assert "call adapters" in plan.note and "tests.real_pairs_cases:block_call" in plan.note
    assert data_needed(cases.reference(), cases.port_self(), None).options("port") == {
        "summary": True}  # a mapping without code: statistics only, as before
    # a port that records itself cannot keep data for some modules only: all of it, said
    from layerdiff import ExternalCase

    external = data_needed(cases.reference(), ExternalCase(run=lambda *a, **k: None,
                                                            name="numpy port"), adapters)
    assert external.options("port") == {"summary": False}
    assert external.options("reference")["data_modules"] == sorted(plan.reference)
    assert "keeps all its tensor data" in external.note


def test_the_faithful_port_with_call_adapters_does_not_diverge(adapters, tmp_path):
    reference = dataclasses.replace(cases.reference(), steps=3)
    port = dataclasses.replace(cases.port_freqs(), steps=3)
    result = _checked(diverge(reference, port, mapping=adapters, steps=3,
                              output_dir=tmp_path / "out"))
    assert result.golden and not result.found and result.cause is None
    assert all(row.out == 0 for row in result.per_step)
    # the adapted inputs were judged element by element (against the golden band too)
    adapted = result.summary_diff.rows[result.summary_diff.rows["match"] == "adapted"]
    assert set(adapted["port_arg"]) >= {"1", "2"} and set(adapted["step"]) == {0, 1, 2}
    assert adapted["ratio"].notna().all()
    # tensor data only where the adapters read it; statistics everywhere else
    sites = {"layers.0#0", "layers.1#0", "layers.0.attn#0", "layers.1.attn#0"}
    for name in ("reference_summary", "port_summary", "golden_summary"):
        assert _kept(result.traces[name]) == sites, name
    assert any("keep tensor data of 4 reference and 4 port modules" in n for n in result.notes)


def test_a_forward_bug_from_step_2_is_found_there_through_the_adapters(adapters, tmp_path):
    result = _checked(diverge(dataclasses.replace(cases.reference(), steps=4),
                              _late_rotary_port(), mapping=adapters, steps=4,
                              output_dir=tmp_path / "out", golden=False))
    assert result.first_step == 2 and result.cause == Cause.FORWARD
    assert (result.origin.site, result.origin.pass_) == ("layers.1.attn#0", "forward")
    # the update that ended step 1 was rerun and is the reference's
    assert result.optimizer_update is not None and not result.optimizer_update
    assert "--map" in result.step_command and str(adapters) in result.step_command
    page = render_diverge_html(result)
    assert "diff of that step" in page and "note: the statistics runs keep" in page


def test_a_port_with_another_weight_decay_is_the_optimizer_at_step_1(adapters, tmp_path):
    port = dataclasses.replace(
        cases.port_freqs(), steps=3,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.1, weight_decay=0.01))
    result = _checked(diverge(dataclasses.replace(cases.reference(), steps=3), port,
                              mapping=adapters, steps=3, output_dir=tmp_path / "out",
                              golden=False))
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    assert result.optimizer_step == 0
    kinds = {p.kind for p in result.optimizer_update.differing}
    assert kinds == {WEIGHT_DECAY}


# ---- the command line: exit codes and the printed commands, run as printed

def test_the_cli_finds_the_late_bug_and_its_printed_diff_runs(adapters, tmp_path, run,
                                                               monkeypatch):
    monkeypatch.setattr(cases, "port_freqs_late_rotary", _late_rotary_port, raising=False)
    out = tmp_path / "out"
    result = run("diverge", "tests.real_pairs_cases:reference",
                 "tests.real_pairs_cases:port_freqs_late_rotary", "--map", adapters,
                 "--steps", "4", "--no-golden", "-o", out)
    assert result.exit_code == 1, result.output
    assert "first diverging step: 2" in result.output
    assert "note: the statistics runs keep tensor data" in result.output
    [command] = _commands(result.output, "see every record of that step:")
    assert command[:2] == ["layerdiff", "diff"] and "--map" in command
    printed = run(*command[1:])
    assert printed.exit_code == 1, printed.output  # it finds the bug; not refused (2)
    assert "FAIL  origin: layers.1.attn#0" in printed.output


def test_the_diffs_printed_ops_commands_carry_the_mapping_and_run(adapters, tmp_path, run):
    ref, port = tmp_path / "ref.h5", tmp_path / "port.h5"
    assert run("capture", "tests.real_pairs_cases:reference", "-o", ref).exit_code == 0
    captured = run("capture", "tests.real_pairs_cases:port_freqs_bug_scale", "-o", port,
                   "--weights-from", ref, "--map", adapters)
    assert captured.exit_code == 0, captured.output
    result = run("diff", ref, port, "--map", adapters)
    assert result.exit_code == 1 and "FAIL  origin: layers.0.attn#0" in result.output
    commands = _commands(result.output, "name the op:")
    assert [c[:2] for c in commands] == [["layerdiff", "capture"]] * 2 + [["layerdiff", "diff"]]
    assert commands[1][commands[1].index("--map") + 1] == str(adapters)  # the port's load
    assert commands[2][commands[2].index("--map") + 1] == str(adapters)  # and the diff
    for command in commands[:2]:
        done = run(*command[1:])
        assert done.exit_code == 0, done.output
    named = run(*commands[2][1:])
    assert named.exit_code == 1, named.output
    assert "FAIL  origin: layers.0.attn#0/" in named.output  # an op inside the attention


def test_a_summary_diff_through_adapters_and_its_printed_full_commands_run(adapters, tmp_path,
                                                                         run):
    """Statistics only at an adapted site: the inputs the adapter passes through unchanged are
    judged by their statistics (found by running it on meta tensors), what it makes is listed
    as not compared; the diff names the one origin and its --full-around commands run."""
    ref, full, port = tmp_path / "ref.h5", tmp_path / "refw.h5", tmp_path / "port.h5"
    assert run("capture", "tests.real_pairs_cases:reference", "-o", ref,
               "--summary").exit_code == 0
    assert run("capture", "tests.real_pairs_cases:reference", "-o", full).exit_code == 0
    captured = run("capture", "tests.real_pairs_cases:port_freqs_bug_scale", "-o", port,
                   "--summary", "--weights-from", full, "--map", adapters)
    assert captured.exit_code == 0, captured.output
    result = run("diff", ref, port, "--map", adapters, "--json", tmp_path / "d.json")
    assert result.exit_code == 1, result.output
    found = json.loads((tmp_path / "d.json").read_text())
    assert [o["site"] for o in found["origins"]] == ["layers.0.attn#0"]  # layers.1's input
    # (passed through by the adapter) is judged, so layers.1.attn is no second origin
    commands = _commands(result.output, "element-wise error and likely cause:")
    assert [c[:2] for c in commands] == [["layerdiff", "capture"]] * 2 + [["layerdiff", "diff"]]
    port_command = commands[1]
    assert port_command[port_command.index("--weights-from") + 1] == str(full)
    assert commands[2][commands[2].index("--map") + 1] == str(adapters)
    for command in commands[:2]:
        done = run(*command[1:])
        assert done.exit_code == 0, done.output
    named = run(*commands[2][1:])
    assert named.exit_code == 1, named.output
    assert "FAIL  origin: layers.0.attn#0, forward output" in named.output
    assert "likely cause: scale" in named.output  # element-wise now


def test_statistics_only_at_an_adapted_site_pairs_what_passes_through(adapters, tmp_path):
    from layerdiff import diff, load_weights
    from layerdiff.capture import capture

    ref = capture(cases.reference(), tmp_path / "ref.h5", summary=True)
    full = capture(cases.reference(), tmp_path / "full.h5")
    case = cases.port_freqs()
    load_weights(case.model, full, adapters)
    port = capture(case, tmp_path / "port.h5", summary=True)
    result = diff(ref, port, mapping=adapters)
    assert result, result.failing()
    rows = result.rows[result.rows["match"] == "adapted"]
    judged = set(zip(rows["site"], rows["role"], rows["port_arg"], strict=True))
    assert {("layers.0.attn#0", "input", "0"), ("layers.1#0", "input", "0"),
            ("layers.0.attn#0", "grad_input", "0")} <= judged
    unmatched = result.unmatched
    made = unmatched[(unmatched["side"] == "port") & (unmatched["site"] == "layers.0.attn#0")
                     & (unmatched["role"] == "input") & (unmatched["arg"] == "1")]
    assert len(made) == 1 and "kept statistics only" in made.iloc[0]["reason"]


# ---- the Hugging Face Llama against its Meta-style port (slow: a few seconds a step)

transformers = pytest.importorskip("transformers")


def _llama(port_optimizer=None, steps: int = 2):
    from reference_models import hf_llama, llama_port

    reference = dataclasses.replace(hf_llama.reference(), steps=steps)
    port = dataclasses.replace(llama_port.port(), steps=steps)
    if port_optimizer is not None:
        port = dataclasses.replace(port, optimizer=port_optimizer, name="llama port, decayed")
    return reference, port


def test_the_hf_llama_and_its_port_do_not_diverge_through_adapters_and_conversion(run,
                                                                                   tmp_path):
    out = tmp_path / "out"
    result = run("diverge", "reference_models.hf_llama:reference",
                 "reference_models.llama_port:port", "--map", LLAMA_MAP, "--steps", "2",
                 "--no-golden", "-o", out, "--json", tmp_path / "d.json")
    assert result.exit_code == 0, result.output
    found = json.loads((tmp_path / "d.json").read_text())
    assert not found["found"] and found["notes"]
    with open_trace(out / "reference.summary.h5") as trace:
        index = trace.index
        kept = set(index[index["segment"] >= 0]["site"])
    assert {"model.layers.0#0", "model.layers.0.self_attn#0",
            "model.layers.0.self_attn.q_proj#0", "model.layers.1.self_attn.k_proj#0"} <= kept
    assert "model.layers.0.mlp#0" not in kept and "lm_head#0" not in kept


def test_an_hf_llama_port_with_weight_decay_names_step_1_and_the_converted_weights(tmp_path):
    reference, port = _llama(lambda p: torch.optim.SGD(p, lr=0.1, weight_decay=0.01))
    result = _checked(diverge(reference, port, mapping=LLAMA_MAP, steps=2,
                              output_dir=tmp_path, golden=False))
    assert result.first_step == 1 and result.cause == Cause.OPTIMIZER
    decayed = {p.port for p in result.optimizer_update.differing if p.kind == WEIGHT_DECAY}
    # the q/k projections the conversion made are among them, judged through it
    assert {"layers.0.attention.wq.weight", "layers.1.attention.wk.weight"} <= decayed
    assert all(np.isfinite(p.decay) for p in result.optimizer_update.differing)
    assert f"--map {LLAMA_MAP}" in result.step_command


# ---- the capture option it stands on

def test_capture_keeps_data_for_exactly_the_modules_named(tmp_path):
    from layerdiff import CaptureError
    from layerdiff.capture import capture
    from reference_models import mlp

    path = capture(mlp.reference(), tmp_path / "t.h5", data_modules=["fc1"])
    assert _kept(path) == {"fc1#0"}
    with open_trace(path) as trace:
        assert trace.meta["data_modules"] == ["fc1"] and not trace.summary
    with pytest.raises(CaptureError, match="names no module fc9"):
        capture(mlp.reference(), tmp_path / "u.h5", data_modules=["fc9"])
    with pytest.raises(CaptureError, match="summary"):
        capture(mlp.reference(), tmp_path / "v.h5", data_modules=["fc1"], summary=True)
