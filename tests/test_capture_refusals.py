"""A capture that would record nothing useful, or destroy an input, is one sentence and exit 2
before it runs; Ctrl-C at its very start is one line and exit 130 (issue 38, item 5)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
MLP = "reference_models.mlp:reference"

# The command run with one module's import interrupted, as a Ctrl-C in the first half second
# lands: in the import of the command's own modules, or of what its group loads to run it.
_INTERRUPTED_IMPORT = """
import sys
interrupted = sys.argv[1]
class Interrupting:
    def find_spec(self, name, path=None, target=None):
        if name == interrupted:
            raise KeyboardInterrupt
sys.meta_path.insert(0, Interrupting())
sys.argv = ["layerdiff", "capture", sys.argv[2], "-o", sys.argv[3]]
from layerdiff.cli import run
run()
"""


@pytest.mark.parametrize("module", ["layerdiff.cli.ci", "layerdiff.trace.signals"])
def test_ctrl_c_while_the_command_loads_is_one_line_and_exit_130(tmp_path, module):
    target = tmp_path / "t.h5"
    done = subprocess.run([sys.executable, "-c", _INTERRUPTED_IMPORT, module, MLP, str(target)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 130, done.stderr[-3000:]
    assert done.stderr == "interrupted: nothing was published\n"
    assert list(tmp_path.iterdir()) == []


def test_ctrl_c_while_the_case_imports_is_one_line_and_exit_130(run, tmp_path):
    result = run("capture", "tests.ctrl_c_at_import:reference", "-o", tmp_path / "t.h5")
    assert result.exit_code == 130
    assert result.output == "interrupted: nothing was published\n"
    assert "Aborted" not in result.output and list(tmp_path.iterdir()) == []
