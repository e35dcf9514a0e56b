"""The command line as a package (layerdiff/cli/): every command that the flat cli*.py files
had is still there, reached the three ways users start it, and the workflow a command runs is a
library call that writes what the command writes."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from layerdiff import open_trace
from layerdiff.capture.port import capture_port

ROOT = Path(__file__).resolve().parent.parent

# `layerdiff --help` before the split into layerdiff/cli/ (issue 30): none may go missing
COMMANDS = ["batch-independence", "bisect", "capture", "cases", "check", "demo", "determinism",
            "diff", "diverge", "gather", "golden", "health", "map-check", "map-suggest", "nan",
            "ranks", "replay", "session", "show", "swap"]

TRANSFORMER = "reference_models.transformer:reference"
TRANSFORMER_BUG = "reference_models.transformer_port:bug_softmax_axis"
TRANSFORMER_MAP = ROOT / "reference_models" / "transformer_port.map.toml"


def _listed(help_text: str) -> list[str]:
    lines = help_text.split("Commands:\n", 1)[1].splitlines()
    return [line.split()[0] for line in lines if line.startswith("  ") and line.strip()]


def test_python_dash_m_layerdiff_lists_every_command_there_was():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-m", "layerdiff", "--help"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("Usage: layerdiff ")  # the name, not __main__.py
    assert _listed(done.stdout) == COMMANDS


def test_the_command_line_starts_without_torch():
    """--help, a typo or a bad path answers at once: the heavy libraries load when a command
    runs, not when the group is built (the session's command once pulled in torch: 2-4 s)."""
    code = ("import sys, layerdiff.cli; print(' '.join(m for m in ('torch', 'pandas', 'h5py', "
            "'numpy', 'matplotlib') if m in sys.modules))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""


def test_the_console_script_and_the_import_name_the_same_group(run):
    from layerdiff import cli
    from layerdiff.cli import main

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))[
        "project"]["scripts"]
    module, _, name = scripts["layerdiff"].partition(":")
    assert getattr(__import__(module, fromlist=[name]), name) is cli.run  # main, quiet exit
    assert sorted(main.commands) == COMMANDS
    for command in COMMANDS:  # each one's help renders (its options and their help are intact)
        shown = run(command, "--help")
        assert shown.exit_code == 0 and shown.output.startswith("Usage: "), shown.output


def test_capture_port_writes_the_trace_that_capture_weights_from_writes(run, reference_traces,
                                                                         tmp_path):
    reference = str(reference_traces(TRANSFORMER))
    options = ["--steps", "1", "--summary"]
    by_command = tmp_path / "command.h5"
    result = run("capture", TRANSFORMER_BUG, "-o", by_command, "--weights-from", reference,
                 "--map", TRANSFORMER_MAP, *options)
    assert result.exit_code == 0, result.output
    said = []
    by_call = capture_port(TRANSFORMER_BUG, tmp_path / "call.h5", reference,
                           str(TRANSFORMER_MAP), steps=1, summary=True,
                           on_weights=lambda trace, report: said.append(report.summary()))
    assert f"weights from {reference}: {said[0]}" in result.output
    with open_trace(by_command) as command, open_trace(by_call) as call:
        assert call.index.equals(command.index)  # every record, bit for bit (digests)
        differs = {k for k in command.meta.keys() | call.meta.keys()
                   if command.meta.get(k) != call.meta.get(k)}
        assert differs <= {"created"}  # when it was captured, to the second
        weights = call.meta["weights"]
        assert weights["from"] == reference and weights["mapping"]["name"] == TRANSFORMER_MAP.name


def test_diff_writes_every_output_without_torch(reference_traces, tmp_path):
    """`layerdiff diff` of two stored traces needs h5py and numpy alone (a CI job that only
    compares), with its JSON, CSV and HTML outputs too: the one place that writes them for
    every command must not pull in a model-running result's module to tell them apart."""
    trace = str(reference_traces("tests.tiny_cases:tiny"))
    outputs = [tmp_path / name for name in ("d.json", "d.csv", "d.html")]
    code = ("import sys; from layerdiff.cli import main\n"
            "try: main(sys.argv[1:], prog_name='layerdiff')\n"
            "except SystemExit as exit: assert exit.code == 0, exit.code\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    command = ["diff", trace, trace, "--json", outputs[0], "--csv", outputs[1], "--html",
               outputs[2]]
    done = subprocess.run([sys.executable, "-c", code, *map(str, command)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert all(path.stat().st_size > 0 for path in outputs)
