"""Multi-rank capture: one trace per rank, a manifest published last, refused when a rank file
is missing or replaced, and no manifest when a rank fails; Ctrl-C into any of its processes
ends in one sentence that says what is on disk (issue 38, item 2)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest

from layerdiff import capture, diff, load_case, open_trace
from layerdiff.errors import TraceError
from reference_models import op_bugs
from tests import children
from tests.children import finished

REFERENCE = f"{op_bugs.MODULE}:reference"


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    from click.testing import CliRunner

    from layerdiff.cli import main

    out = tmp_path_factory.mktemp("ranks") / "port.h5"
    result = CliRunner().invoke(main, ["capture", REFERENCE, "-o", str(out), "--nproc", "2"])
    assert result.exit_code == 0, result.output
    return out


def test_each_rank_writes_its_trace_and_rank_zero_the_manifest(two_ranks, tmp_path):
    folder = two_ranks.parent
    assert sorted(p.name for p in folder.glob("*.h5")) == [
        "port.h5", "port.rank0.h5", "port.rank1.h5"]
    with open_trace(two_ranks) as trace:
        assert [p.name for p in trace.rank_paths] == ["port.rank0.h5", "port.rank1.h5"]
        assert trace.meta["manifest"]["world_size"] == 2
        assert (trace.meta["rank"], trace.meta["world_size"]) == (0, 2)
    with open_trace(folder / "port.rank1.h5") as rank1:
        assert rank1.meta["rank"] == 1
    # every record is replicated here: the manifest diffs as rank 0 against one process
    single = capture(load_case(REFERENCE), tmp_path / "single.h5")
    assert diff(single, two_ranks).passed


def test_a_missing_or_replaced_rank_file_is_refused_naming_the_rank(two_ranks, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(two_ranks.parent, copy)
    (copy / "port.rank1.h5").unlink()
    with pytest.raises(TraceError, match=r"rank 1's file .*port\.rank1\.h5: it is missing"):
        open_trace(copy / "port.h5")
    shutil.copy(copy / "port.rank0.h5", copy / "port.rank1.h5")
    with pytest.raises(TraceError, match=r"rank 1.s file .* was replaced or damaged"):
        open_trace(copy / "port.h5")


def test_a_rank_that_fails_leaves_no_manifest(run, tmp_path):
    out = tmp_path / "port.h5"
    result = run("capture", "tests.dist_cases:crash_on_rank_one", "-o", out, "--nproc", "2")
    assert result.exit_code == 2
    assert "rank 1 failed" in result.output and "no manifest was published" in result.output
    assert not out.exists()
    # what is on disk: rank 0 finished its file, rank 1's .partial holds what it recorded
    partial = tmp_path / "port.rank1.h5.partial"
    assert (f"; {tmp_path / 'port.rank0.h5'} was published; {partial} holds what rank 1 "
            f"recorded up to there (layerdiff show {partial} --allow-incomplete)") in result.output
    assert (tmp_path / "port.rank0.h5").exists() and partial.exists()


# --- Ctrl-C: the last word is what is on disk --------------------------------------------------

ROOT = Path(__file__).parent.parent

# The command, with Ctrl-C to its whole process group (as a terminal sends it) the moment its
# ranks are started: while each loads Python and torch, before any of them runs.
_AT_START = """
import os, signal, sys
import layerdiff.capture.distributed as distributed
wait = distributed._wait
def interrupted_wait(processes):
    os.killpg(os.getpgrp(), signal.SIGINT)
    return wait(processes)
distributed._wait = interrupted_wait
sys.argv = ["layerdiff", *sys.argv[1:]]
from layerdiff.cli import run
run()
"""


def _interrupted_capture(case: str, out: Path, at_start: bool = False):
    """``layerdiff capture CASE -o OUT --nproc 2`` in a process group of its own (the cases
    send SIGINT to it), SIGINT handled as a terminal's is."""
    command = (["-c", _AT_START] if at_start else ["-m", "layerdiff"])
    done = finished([sys.executable, *command, "capture", case, "-o", str(out), "--nproc", "2"],
                    cwd=ROOT, timeout=300, start_new_session=True,
                    preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, \
        done.stderr[-3000:]
    assert "Aborted" not in done.stderr
    return done


AFTER_MANIFEST = ["interrupt_group_after_manifest", "interrupt_rank_one_after_manifest"]
MID_RUN = ["interrupt_group_mid_run", "interrupt_command_mid_run"]
AT_START = "at_start"


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory):
    """Each interrupted capture (the cases of tests/dist_cases.py, and REFERENCE interrupted
    as its ranks start), two commands at a time: (outcome, output path)."""
    keys = [*AFTER_MANIFEST, *MID_RUN, AT_START]
    outs = children.targets(tmp_path_factory, keys, "interrupted", "port.h5")
    jobs = {case: lambda c=case: _interrupted_capture(f"tests.dist_cases:{c}", outs[c])
            for case in [*AFTER_MANIFEST, *MID_RUN]}
    jobs[AT_START] = lambda: _interrupted_capture(REFERENCE, outs[AT_START], at_start=True)
    done = children.two_at_a_time(jobs)
    return {key: (done[key], outs[key]) for key in keys}


@pytest.mark.parametrize("case", AFTER_MANIFEST)
def test_ctrl_c_after_the_manifest_was_published_says_it_was(interrupted, case):
    outcome, out = interrupted[case]
    done = outcome.result()
    assert done.returncode == 0, done.stderr
    assert f"wrote manifest {out} naming 2 rank files" in done.stdout
    assert done.stderr == ""
    with open_trace(out) as trace:  # it verifies: both rank files, complete, the ones it names
        assert len(trace.rank_paths) == 2


@pytest.mark.parametrize("case", MID_RUN)
def test_ctrl_c_mid_run_is_one_sentence_naming_what_is_on_disk(interrupted, case):
    outcome, out = interrupted[case]
    done, folder = outcome.result(), out.parent
    assert done.returncode == 130
    assert done.stderr.count("\n") == 1, done.stderr
    partial = folder / "port.rank0.h5.partial"
    assert done.stderr.startswith(f"interrupted: no manifest was published at {out}; ")
    assert str(partial) in done.stderr and "--allow-incomplete" in done.stderr
    assert not out.exists() and partial.exists()
    # rank 1 runs on: it finished its file, or was stopped too; the sentence says which
    rank1 = folder / "port.rank1.h5"
    assert (f"{rank1} was published" in done.stderr) == rank1.exists()
    assert (f"{rank1}.partial" in done.stderr) == Path(f"{rank1}.partial").exists()
    with open_trace(partial, allow_incomplete=True) as trace:
        assert not trace.complete


def test_ctrl_c_while_the_ranks_start_is_one_line(interrupted):
    outcome, out = interrupted[AT_START]
    done = outcome.result()
    assert done.returncode == 130
    assert done.stderr == (f"interrupted: no manifest was published at {out}; no rank recorded "
                           "anything yet\n")
    assert list(out.parent.iterdir()) == []


def _torchrun_rank(rank: int, world: int, port: int, spec: str, output: str, said: str) -> None:
    """One rank as torchrun starts it (RANK, WORLD_SIZE in the environment): what
    capture_ranks returned or raised, written to ``said``.rank."""
    import os

    from layerdiff.capture.distributed import capture_ranks
    from layerdiff.errors import LayerdiffError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    try:
        outcome = f"returned {capture_ranks(spec, output, progress=False)}"
    except LayerdiffError as exc:
        outcome = f"raised {type(exc).__name__}: {exc}"
    Path(f"{said}.{rank}").write_text(outcome, encoding="utf-8")


def test_under_torchrun_rank_zero_interrupted_after_the_publish_returns_the_manifest(tmp_path):
    import torch.multiprocessing as mp

    from tests.gloo import free_port

    out, said = tmp_path / "port.h5", tmp_path / "said"
    mp.start_processes(_torchrun_rank, args=(2, free_port(), "tests.dist_cases:interrupt_rank_"
                                             "zero_after_manifest", str(out), str(said)),
                       nprocs=2, start_method="spawn")
    assert Path(f"{said}.0").read_text(encoding="utf-8") == f"returned {out}"
    assert Path(f"{said}.1").read_text(encoding="utf-8") == "returned None"
    with open_trace(out) as trace:
        assert len(trace.rank_paths) == 2
