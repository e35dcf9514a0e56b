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


# The command with Ctrl-C once the trace is published, while the capture lets go of its
# staging memory: the audit's "no trace was published ... nothing was recorded yet" over a
# published trace.
_AFTER_PUBLISH = """
import os, signal, sys, time
from layerdiff.capture.stage import Stager
release = Stager.release
def interrupted_release(self):
    release(self)
    os.kill(os.getpid(), signal.SIGINT)
    time.sleep(5)
Stager.release = interrupted_release
sys.argv = ["layerdiff", "capture", sys.argv[1], "-o", sys.argv[2]]
from layerdiff.cli import run
run()
"""


def test_ctrl_c_after_the_trace_was_published_says_it_was(tmp_path):
    from layerdiff import open_trace

    target = tmp_path / "t.h5"
    done = subprocess.run([sys.executable, "-c", _AFTER_PUBLISH, MLP, str(target)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120,
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith(f"wrote {target} (") and done.stderr == ""
    with open_trace(target) as trace:
        assert trace.complete


def test_ctrl_c_while_the_case_imports_is_one_line_and_exit_130(run, tmp_path):
    result = run("capture", "tests.ctrl_c_at_import:reference", "-o", tmp_path / "t.h5")
    assert result.exit_code == 130
    assert result.output == "interrupted: nothing was published\n"
    assert "Aborted" not in result.output and list(tmp_path.iterdir()) == []


def test_ctrl_c_a_library_turned_into_its_own_error_is_still_an_interrupt(run, tmp_path):
    result = run("capture", "tests.ctrl_c_caught_at_import:reference", "-o", tmp_path / "t.h5")
    assert result.exit_code == 130
    assert result.output == "interrupted: nothing was published\n"
    assert list(tmp_path.iterdir()) == []


# --- nothing useful would be recorded ---------------------------------------------------------


@pytest.mark.parametrize("args, said", [
    (["--exclude", "*"], "--exclude '*' leaves no module of MLP to record, so the trace would "
                         "hold nothing but the loss; module paths look like: <root>, fc1, "),
    (["--include", "fc*", "--exclude", "fc?"], "--include 'fc*' --exclude 'fc?' leave no "
                                               "module of MLP to record"),
    (["--loss-scale", "1e300"], "--loss-scale 1e+300 is larger than float32 can hold "
                                "(3.403e+38): the scaled loss and every gradient would be inf"),
    (["--loss-scale", "inf"], "--loss-scale must be a finite positive number (got inf)"),
])
def test_a_capture_that_would_record_nothing_useful_is_refused_before_it_runs(run, tmp_path,
                                                                              args, said):
    result = run("capture", MLP, "-o", tmp_path / "t.h5", *args)
    assert result.exit_code == 2, result.output
    assert result.output.startswith(f"error: {said}") and result.output.count("\n") == 1
    assert "2**20" in result.output or "module paths" in result.output
    assert list(tmp_path.iterdir()) == []


def test_a_loss_scale_that_overflows_the_loss_dtype_is_refused(run, tmp_path):
    """Representable as a number, but not in float16: the scaled loss is inf at step 0."""
    result = run("capture", MLP, "-o", tmp_path / "t.h5", "--dtype", "float16",
                 "--loss-scale", "1e30")
    assert result.exit_code == 2, result.output
    assert ("--loss-scale 1e+30 overflows the float16 loss at step 0" in result.output
            and "no trace was published" in result.output and "2**20" in result.output)
    assert result.output.count("\n") == 1 and not (tmp_path / "t.h5").exists()
    # in float64 the same product is finite: captured
    assert run("capture", MLP, "-o", tmp_path / "d.h5", "--dtype", "float64", "--loss-scale",
               "1e30").exit_code == 0


# --- an input that would be destroyed ---------------------------------------------------------


@pytest.fixture
def manifest(tmp_path):
    """A manifest of two small rank files, as a 2-rank capture leaves them."""
    import numpy as np

    from layerdiff import TraceWriter
    from layerdiff.trace.manifest import rank_path, write_manifest

    out = tmp_path / "port.h5"
    for rank in range(2):
        with TraceWriter(rank_path(out, rank), meta={"case": "x", "rank": rank,
                                                     "world_size": 2}) as writer:
            writer.record("a#0", "output", np.full(4, rank, np.float32))
    write_manifest(out, [rank_path(out, rank) for rank in range(2)])
    return out


@pytest.mark.parametrize("extra", [[], ["--nproc", "2"]])
def test_force_never_replaces_a_rank_file_a_manifest_names(run, manifest, extra):
    from layerdiff import open_trace

    rank1 = manifest.with_name("port.rank1.h5")
    before = rank1.read_bytes()
    result = run("capture", MLP, "-o", rank1, "--force", *extra)
    assert result.exit_code == 2, result.output
    assert result.output == (f"error: -o {rank1} is rank 1's file of the manifest {manifest}: "
                             "replacing it would break that manifest, even with --force; "
                             f"choose another path, or capture every rank again with -o "
                             f"{manifest}\n")
    assert rank1.read_bytes() == before
    with open_trace(manifest) as trace:  # still whole
        assert len(trace.rank_paths) == 2


def test_force_over_the_weights_it_reads_is_refused(run, manifest):
    rank0 = manifest.with_name("port.rank0.h5")
    result = run("capture", MLP, "-o", rank0, "--weights-from", rank0, "--force")
    assert result.exit_code == 2
    assert "is the --weights-from trace this command reads" in result.output


# --- a killed capture ------------------------------------------------------------------------


def test_a_capture_after_a_killed_one_takes_over_its_lock_and_partial(run, tmp_path):
    """SIGKILL leaves NAME.partial and NAME.lock (the kernel releases the lock's flock, nobody
    removes its file): the partial opens with --allow-incomplete beside the lock, and the next
    capture to the path takes both over and leaves only its trace."""
    import time

    from layerdiff import open_trace

    target = tmp_path / "t.h5"
    partial, lock = tmp_path / "t.h5.partial", tmp_path / "t.h5.lock"
    process = subprocess.Popen([sys.executable, "-m", "layerdiff", "capture",
                                "reference_models.schedule_port:reference", "-o", str(target)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    while not partial.exists() and process.poll() is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    time.sleep(0.3)
    process.kill()
    process.communicate()
    if target.exists():
        pytest.skip("the capture finished before the kill")
    assert partial.exists() and lock.exists()
    shown = run("show", partial, "--allow-incomplete")
    assert shown.exit_code == 0 or "holds nothing yet" in shown.output, shown.output
    assert "another capture" not in shown.output
    result = run("capture", MLP, "-o", target)
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]
    with open_trace(target) as trace:
        assert trace.complete


def test_a_sharded_case_loaded_in_one_process_says_to_capture_it_on_ranks(run, monkeypatch):
    """A DTensor port builds its device mesh from torch.distributed's environment, which the
    one-process commands do not set up: torch's error, then what to do."""
    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    result = run("map-suggest", "reference_models.tensor_parallel:reference",
                 "tests.dtensor_cases:tensor_parallel")
    assert result.exit_code == 2
    assert "tests.dtensor_cases:tensor_parallel" in result.output
    assert "capture it with --nproc N or under torchrun" in result.output
    assert "Traceback" not in result.output
