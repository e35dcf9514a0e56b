"""A capture that cannot finish ends cleanly (issue 28, items 5 and 6).

A full disk or a file size limit is one sentence and exit 2 with nothing left behind, never a
traceback or a signal; Ctrl-C always ends the process, at whatever moment it lands, and never
publishes a file that is not complete; a ``.partial`` the message recommends opening with
``--allow-incomplete`` opens; and the files a writer creates beside its output (``.partial``,
``.lock``) are never written through a planted symbolic link.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path

import h5py
import numpy as np
import pytest
import torch

from layerdiff import CaptureError, TraceWriter, capture, open_trace
from layerdiff.trace.h5file import TraceFile
from tests import children
from tests.children import finished, popen, two_at_a_time

ROOT = Path(__file__).parent.parent
MLP = "reference_models.mlp:reference"
TRANSFORMER = "reference_models.transformer:reference"


def _capture_under_limit(case: str, target: Path, kib: int) -> subprocess.CompletedProcess:
    """``ulimit -f`` as a user sets it (the shell's unit is KiB), then the capture."""
    return finished(
        ["bash", "-c", f'ulimit -f {kib}; exec "$0" -m layerdiff capture "$1" -o "$2"',
         sys.executable, case, str(target)],
        cwd=ROOT, timeout=300)


def _library_capture_under_limit(target: Path) -> subprocess.CompletedProcess:
    """The Python API under ``ulimit -f 1000``: a capture that raises, then a garbage
    collection and the interpreter's exit."""
    script = (
        "import gc, sys\n"
        "from layerdiff import capture\n"
        "from layerdiff.errors import CaptureError\n"
        "try:\n"
        f"    capture('reference_models.schedule_port:reference', {str(target)!r})\n"
        "except CaptureError as error:\n"
        "    print(error)\n"
        "gc.collect()\n"
        "print('lived')\n")
    return finished(["bash", "-c", 'ulimit -f 1000; exec "$0" -c "$1"', sys.executable,
                      script], cwd=ROOT, timeout=300)


# --- a full disk, a file size limit -----------------------------------------------------------

LIMITS = [
    (MLP, 16),            # before the file's skeleton is on disk (the first flush)
    (MLP, 120),           # late: the last segments, or the tables at the close (a 0.2 MiB file)
    (TRANSFORMER, 2048),  # in the middle of the tensor data (an 11 MiB file)
    # after five steps' flushes (a 1.0 MiB file): libhdf5 retried the failed metadata at exit
    # and crashed the process (SIGSEGV) before the writer stopped touching the file
    ("reference_models.schedule_port:reference", 1000),
]


@pytest.fixture(scope="module")
def limited(tmp_path_factory) -> dict[object, tuple[Future, Path]]:
    """The captures under a file size limit (``LIMITS``, and "library"): (outcome, folder)."""
    folders = children.folders(tmp_path_factory, [*LIMITS, "library"], "limited")
    jobs: dict[object, Callable] = {
        (case, kib): (lambda c=case, k=kib: _capture_under_limit(c, folders[c, k] / "t.h5", k))
        for case, kib in LIMITS}
    jobs["library"] = lambda: _library_capture_under_limit(folders["library"] / "t.h5")
    done = two_at_a_time(jobs)
    return {key: (done[key], folders[key]) for key in jobs}


@pytest.mark.parametrize("case, kib", LIMITS)
def test_a_file_size_limit_is_one_sentence_exit_2_and_nothing_left(limited, case, kib):
    outcome, folder = limited[case, kib]
    result, target = outcome.result(), folder / "t.h5"
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    lines = result.stderr.strip().splitlines()
    assert lines == [f"error: cannot write trace {target}: writing {target}.partial failed "
                     "(File too large: a file size limit (ulimit -f) was reached); nothing was "
                     "published; free space or choose another -o path"], result.stderr[-2000:]
    assert list(folder.iterdir()) == []  # no trace, no .partial, no .lock


def test_a_library_capture_over_the_file_size_limit_raises_and_the_process_lives_on(limited):
    """The Python API (no command line to end the process early): the capture raises its
    sentence, and the process goes on through a garbage collection and its exit. (A write
    libhdf5 fails leaves a file it will not close, whose objects, freed later, crashed the
    process: a segment the limit cannot take is now refused before libhdf5 writes it, and
    the objects of a file it will not close are kept.)"""
    outcome, folder = limited["library"]
    result = outcome.result()
    assert result.returncode == 0, (result.returncode, result.stderr[-2000:])
    assert "a file size limit (ulimit -f) was reached" in result.stdout
    assert result.stdout.strip().endswith("lived")
    assert list(folder.iterdir()) == []


def _failing_after(monkeypatch, calls: int, number: int) -> None:
    """h5py's dataset creation fails with ``number`` from its ``calls``-th call on."""
    original = h5py.Group.create_dataset
    count = {"n": 0}

    def create_dataset(self, *args, **kwargs):
        count["n"] += 1
        if count["n"] >= calls:
            raise OSError(number, f"Can't synchronously write data ({os.strerror(number)})")
        return original(self, *args, **kwargs)
    monkeypatch.setattr(h5py.Group, "create_dataset", create_dataset)


@pytest.mark.parametrize("calls", [1, 40])  # the tables' first column; a later tensor segment
def test_a_full_disk_in_a_writer_is_a_capture_error_and_frees_the_path(tmp_path, monkeypatch,
                                                                       calls):
    target = tmp_path / "t.h5"
    _failing_after(monkeypatch, calls, errno.ENOSPC)
    with (pytest.raises(CaptureError) as raised,
          TraceWriter(target, meta={"case": "full"}, queue_bytes=1 << 20) as writer):
        for _ in range(30):
            with writer.site("layer") as site:
                writer.record(site, "output", np.ones(300_000, np.float32))
            writer.step()
    assert str(raised.value) == (f"cannot write trace {target}: writing {target}.partial failed "
                                 "(No space left on device: the disk is full); nothing was "
                                 "published; free space or choose another -o path")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    with TraceWriter(target, meta={"case": "again"}) as writer:  # the lock was let go
        writer.record("a#0", "output", np.ones(3, np.float32))
    with open_trace(target) as trace:
        assert trace.complete and len(trace.index) == 1


def test_a_failed_rename_at_publish_is_one_sentence_and_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "t.h5"

    def refuse(*args):
        raise OSError(errno.ENOSPC, "No space left on device")
    writer = TraceWriter(target, meta={"case": "x"})
    writer.record("a#0", "output", np.ones(3, np.float32))
    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(CaptureError, match=r"renaming .*t\.h5\.partial to .*t\.h5 failed \(No "
                                           r"space left on device: the disk is full\)"):
        writer.close()
    assert list(tmp_path.iterdir()) == []


# --- Ctrl-C -----------------------------------------------------------------------------------

# Runs the capture command with SIGINT sent to itself whenever the writer reaches one of these
# points (a user pressing Ctrl-C again and again), so every stage of a capture is interrupted
# deterministically: the steps' checkpoints, the writer's segments, the close and the publish.
_INTERRUPTING = """
import os, signal, sys
from layerdiff.trace import h5file
points = sys.argv[1].split(",")
def interrupting(name):
    original = getattr(h5file.TraceFile, name)
    def wrapped(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)
    setattr(h5file.TraceFile, name, wrapped)
for point in points:
    if point != "replace":
        interrupting(point)
if "replace" in points:
    replace = os.replace
    def replacing(*args):
        os.kill(os.getpid(), signal.SIGINT)
        return replace(*args)
    h5file.os.replace = replacing
from layerdiff.cli import main
sys.argv = ["layerdiff", "capture", sys.argv[2], "-o", sys.argv[3]]
main()
"""


def _interrupted_capture(target: Path, points: str) -> subprocess.CompletedProcess:
    return finished([sys.executable, "-c", _INTERRUPTING, points, MLP, str(target)],
                     cwd=ROOT, timeout=60,
                     preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _check_interrupted(target: Path, result: subprocess.CompletedProcess) -> None:
    """Either the capture was complete (published, says so) or it says where the partial is,
    and that partial opens as the message says."""
    partial = Path(f"{target}.partial")
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    assert not Path(f"{target}.lock").exists()
    if result.stdout.startswith(f"wrote {target}"):
        # finished first; a Ctrl-C after that may still end the interpreter's exit (-SIGINT)
        assert result.returncode in (0, -signal.SIGINT) and not partial.exists()
        with open_trace(target) as trace:
            assert trace.complete and len(trace.index)
        return
    assert result.returncode in (130, -signal.SIGINT), result.stderr[-3000:]
    assert not target.exists()
    assert result.stderr.startswith(f"interrupted: no trace was published at {target}; ")
    if partial.exists():
        assert f"layerdiff show {partial} --allow-incomplete" in result.stderr
        with open_trace(partial, allow_incomplete=True) as trace:
            assert not trace.complete
            trace.index  # noqa: B018 - it reads


STAGES = ["flush", "write_segment", "append_rows", "close", "replace",
          "flush,write_segment,append_rows,close,replace"]


def _timed(job: Callable) -> tuple[object, float]:
    start = time.monotonic()
    return job(), time.monotonic() - start


@pytest.fixture(scope="module")
def at_stage(tmp_path_factory) -> dict[str, tuple[Future, Path]]:
    """The captures Ctrl-C'd at each of ``STAGES``: ((outcome, seconds), target)."""
    targets = children.targets(tmp_path_factory, STAGES, "stage")
    done = two_at_a_time({points: lambda p=points: _timed(
        lambda: _interrupted_capture(targets[p], p)) for points in STAGES})
    return {points: (done[points], targets[points]) for points in STAGES}


@pytest.mark.parametrize("points", STAGES)
def test_ctrl_c_at_any_stage_ends_the_capture_and_publishes_only_complete(at_stage, points):
    outcome, target = at_stage[points]
    result, seconds = outcome.result()
    assert seconds < 60
    _check_interrupted(target, result)
    if points in ("flush", "write_segment", "append_rows"):  # while the steps run
        assert result.returncode != 0 and Path(f"{target}.partial").exists()


def _ctrl_c_after(target: Path, delay: float) -> subprocess.CompletedProcess | None:
    """The capture command, Ctrl-C'd ``delay`` seconds after its file is created, as a user
    presses it; None if it hung after that."""
    process = popen(
        [sys.executable, "-m", "layerdiff", "capture", MLP, "-o", str(target)], cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while not Path(f"{target}.partial").exists() and process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            process.communicate()
            raise AssertionError(f"the capture made no {target}.partial in 60 s")
        time.sleep(0.001)
    time.sleep(delay)
    process.send_signal(signal.SIGINT)
    try:
        stdout, stderr = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        return None
    return subprocess.CompletedProcess([], process.returncode, stdout, stderr)


# from the file's creation to the end, sampled: each stage is also hit on purpose above
DELAYS = [0.0, 0.15, 0.5, 1.2, 1.8]


@pytest.fixture(scope="module")
def from_outside(tmp_path_factory) -> dict[float, tuple[Future, Path]]:
    """The captures Ctrl-C'd at each of ``DELAYS``: (outcome, target)."""
    targets = children.targets(tmp_path_factory, DELAYS, "outside")
    done = two_at_a_time({delay: lambda d=delay: _ctrl_c_after(targets[d], d)
                           for delay in DELAYS})
    return {delay: (done[delay], targets[delay]) for delay in DELAYS}


@pytest.mark.parametrize("delay", DELAYS)
def test_ctrl_c_from_outside_at_any_moment_ends_the_process(from_outside, delay):
    """As a user presses it: at delays from the file's creation to the end of the capture."""
    outcome, target = from_outside[delay]
    result = outcome.result()
    if result is None:
        pytest.fail(f"capture hung after Ctrl-C at {delay} s")
    _check_interrupted(target, result)


def test_ctrl_c_that_h5py_swallows_while_the_file_is_made_is_still_an_interrupt(
        tmp_path, monkeypatch):
    """Seen in CI: a Ctrl-C landing inside h5py's attribute conversion came out of it as
    ``TypeError: Operation not defined for data type class``, a traceback instead of an
    interrupt. The Ctrl-C is planted there the way h5py loses it."""
    def swallowed(self, meta, summary):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.01)  # the handler runs here, as it ran inside h5py's logging call
        except KeyboardInterrupt:
            pass
        raise TypeError("Operation not defined for data type class")

    monkeypatch.setattr(TraceFile, "_skeleton", swallowed)
    target = tmp_path / "t.h5"
    with pytest.raises(KeyboardInterrupt):
        TraceFile(target, {"case": "x"}, summary=False)
    assert list(tmp_path.iterdir()) == []
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


# --- planted symbolic links -------------------------------------------------------------------


@pytest.fixture
def victim(tmp_path):
    """A file an attacker would like destroyed, and a check that it was not."""
    path = tmp_path / "precious.h5"
    path.write_bytes(b"precious bytes\n" * 100)
    before = path.read_bytes()
    yield path
    assert path.read_bytes() == before
    assert not path.is_symlink()


@pytest.mark.parametrize("planted", [".partial", ".lock"])
def test_a_symlinked_partial_or_lock_is_never_written_through(tmp_path, victim, planted):
    target = tmp_path / "t.h5"
    Path(f"{target}{planted}").symlink_to(victim)
    with TraceWriter(target, meta={"case": "x"}) as writer:
        writer.record("a#0", "output", np.ones(3, np.float32))
    with open_trace(target) as trace:
        assert trace.complete
    assert not target.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.h5", "t.h5"]


def test_a_dangling_symlink_is_not_followed_to_create_a_file(tmp_path):
    target = tmp_path / "t.h5"
    for planted in (".partial", ".lock"):
        Path(f"{target}{planted}").symlink_to(tmp_path / f"created{planted}")
    file = TraceFile(target, {"case": "x"}, summary=False)
    file.close(complete=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.h5"]


def test_a_hard_linked_lock_is_not_truncated(tmp_path, victim):
    target = tmp_path / "t.h5"
    os.link(victim, f"{target}.lock")
    with TraceWriter(target, meta={"case": "x"}) as writer:
        writer.record("a#0", "output", np.ones(3, np.float32))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["precious.h5", "t.h5"]


def test_a_capture_through_the_cli_leaves_a_planted_link_target_alone(tmp_path, victim, run):
    target = tmp_path / "t.h5"
    Path(f"{target}.partial").symlink_to(victim)
    Path(f"{target}.lock").symlink_to(victim)
    assert run("capture", MLP, "-o", target).exit_code == 0
    with open_trace(target) as trace:
        assert trace.complete


def test_a_directory_where_the_partial_goes_is_one_sentence(tmp_path):
    target = tmp_path / "t.h5"
    Path(f"{target}.partial").mkdir()
    with pytest.raises(CaptureError, match=r"t\.h5\.partial is a directory; remove it, or "
                                           "choose another -o path"):
        TraceFile(target, {"case": "x"}, summary=False)
    assert not Path(f"{target}.lock").exists()


# --- a .partial cut in the middle of writing --------------------------------------------------


def _partial(tmp_path: Path, steps: int = 3) -> Path:
    """A .partial as a capture that stopped leaves it: tables and segments of ``steps`` steps."""
    writer = TraceWriter(tmp_path / "t.h5", meta={"case": "cut"}, queue_bytes=1 << 20)
    for _ in range(steps):
        for layer in range(4):
            with writer.site(f"layer{layer}") as site:
                writer.record(site, "output", np.arange(1000, dtype=np.float32) + layer)
        writer._recorder.flush()
        writer.step()
    writer.close(complete=False)
    return tmp_path / "t.h5.partial"


def _cut_table(partial: Path, table: str, grow: list[str], by: int) -> None:
    """What a kill between two columns' appends leaves: some columns ``by`` rows longer, those
    rows never written (their fill values)."""
    with h5py.File(partial, "r+") as h5:
        for name in grow:
            column = h5[table][name]
            column.resize((column.shape[0] + by,))


@pytest.mark.parametrize("table, grow", [("index", ["seq", "step", "pass"]),
                                         ("index", ["seq", "step", "pass", "site", "role"]),
                                         ("sites", ["step", "site"])])
def test_a_partial_cut_mid_table_append_opens_with_allow_incomplete(tmp_path, run, table, grow):
    partial = _partial(tmp_path)
    _cut_table(partial, table, grow, by=5)
    refused = run("show", partial)
    assert refused.exit_code == 2 and "--allow-incomplete" in refused.output
    result = run("show", partial, "--allow-incomplete")
    assert result.exit_code == 0, result.output
    assert "INCOMPLETE" in result.output and "layer3#0" in result.output
    assert (f"warning: {partial}: 5 rows of table /{table} that the capture was writing when "
            "it stopped are left out") in result.output
    with open_trace(partial, allow_incomplete=True) as trace:
        assert len(trace.index) == 12 and len(trace.sites) == 12
        for position in range(len(trace.index)):
            trace.read(position)  # every row kept reads, verified


def test_a_partial_whose_last_segment_was_cut_keeps_the_records_before_it(tmp_path, run):
    partial = _partial(tmp_path)
    with h5py.File(partial, "r+") as h5:
        last = sorted(h5["tensors"])[-1]
        del h5["tensors"][last]  # its rows were flushed, its data never reached the disk
    result = run("show", partial, "--allow-incomplete")
    assert result.exit_code == 0, result.output
    assert "records whose tensor data was cut off when the capture stopped are left out" in \
        result.output
    with open_trace(partial, allow_incomplete=True) as trace:
        assert 0 < len(trace.index) < 12
        for position in range(len(trace.index)):
            trace.read(position)


def test_a_partial_left_by_a_killed_writer_opens_as_the_message_says(tmp_path, run):
    """SIGKILL at moments through a writer's life: whatever the .partial holds, the message
    for it never recommends --allow-incomplete for a file that then does not open."""
    script = ("import sys, numpy as np\nfrom layerdiff import TraceWriter\n"
              "w = TraceWriter(sys.argv[1], meta={'case': 'loop'})\nprint('go', flush=True)\n"
              "while True:\n"
              "    for i in range(500):\n"
              "        with w.site(f'layer{i}') as s:\n"
              "            w.record(s, 'output', np.full(64, i, np.float32))\n"
              "    w._recorder.flush()\n    w.step()\n")

    def killed(target: Path, delay: float) -> None:
        writer = popen([sys.executable, "-c", script, str(target)], cwd=ROOT,
                        stdout=subprocess.PIPE, text=True)
        said = writer.stdout.readline().strip()
        time.sleep(delay)
        writer.kill()
        writer.communicate()
        assert said == "go"

    delays = [0.0, 0.02, 0.1, 0.3, 0.6]
    targets = [tmp_path / f"k{number}.h5" for number in range(len(delays))]
    done = two_at_a_time({target: lambda t=target, d=delay: killed(t, d)
                           for target, delay in zip(targets, delays, strict=True)})
    for target in targets:
        done[target].result()
        partial = Path(f"{target}.partial")
        told = run("show", target).output
        assert "--allow-incomplete" in told
        shown = run("show", partial, "--allow-incomplete")
        assert shown.exit_code == 0 or "--allow-incomplete" not in shown.output, shown.output


def _killed_after(target: Path, delay: float) -> None:
    """A six-step capture, SIGKILLed ``delay`` seconds after its file is created."""
    process = popen([sys.executable, "-m", "layerdiff", "capture",
                      "reference_models.schedule_port:reference", "-o", str(target)],
                     cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    partial = Path(f"{target}.partial")
    deadline = time.monotonic() + 60
    while not partial.exists() and process.poll() is None:
        if time.monotonic() > deadline:
            process.kill()
            process.communicate()
            raise AssertionError(f"the capture made no {partial} in 60 s")
        time.sleep(0.001)
    time.sleep(delay)
    process.kill()
    process.communicate()


KILL_DELAYS = [0.3, 1.0, 1.8]


@pytest.fixture(scope="module")
def killed_captures(tmp_path_factory) -> dict[float, tuple[Future, Path]]:
    """The captures SIGKILLed at each of ``KILL_DELAYS``: (outcome, target)."""
    targets = children.targets(tmp_path_factory, KILL_DELAYS, "killed")
    done = two_at_a_time({delay: lambda d=delay: _killed_after(targets[d], d)
                           for delay in KILL_DELAYS})
    return {delay: (done[delay], targets[delay]) for delay in KILL_DELAYS}


@pytest.mark.parametrize("delay", KILL_DELAYS)
def test_a_killed_capture_leaves_a_partial_that_opens_as_every_message_says(killed_captures,
                                                                             run, delay):
    """SIGKILL into a six-step capture; diff and show name the command that opens what it
    left, and that command opens it (or the file holds nothing yet, and says so)."""
    outcome, target = killed_captures[delay]
    outcome.result()
    partial = Path(f"{target}.partial")
    if target.exists():  # it finished first
        return
    advice = f"`layerdiff show {partial} --allow-incomplete`"
    for told in (run("diff", target, target), run("diff", partial, partial),
                 run("show", partial)):
        assert told.exit_code == 2 and advice in told.output, told.output
    shown = run("show", partial, "--allow-incomplete")
    assert shown.exit_code == 0 or "holds nothing yet" in shown.output, shown.output


def test_a_ctrl_c_swallowed_by_a_finalizer_is_delivered_again(capsys):
    """Python prints a KeyboardInterrupt raised in a finalizer as "Exception ignored" with a
    traceback, and goes on as if it never came; under interrupts_kept it ends the work."""
    from layerdiff.trace.signals import interrupts_kept

    class Finalized:
        def __del__(self):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt), interrupts_kept():
        Finalized()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # it is raised here, a moment later
            time.sleep(0.001)
        pytest.fail("the Ctrl-C was lost")
    assert "Traceback" not in capsys.readouterr().err


def test_a_ctrl_c_wrapped_by_the_model_on_its_way_is_an_interrupt(tmp_path):
    """Python 3.11 wraps an interrupt that lands in a class body (torch defines classes lazily,
    mid-run) in a RuntimeError: that is the user's Ctrl-C, not the model's error."""
    from layerdiff import Case

    class Wraps(torch.nn.Linear):
        def forward(self, x):
            try:
                raise KeyboardInterrupt
            except KeyboardInterrupt as exc:
                raise RuntimeError("Error calling __set_name__ on 'cached_property'") from exc

    case = Case(Wraps(4, 2), (torch.ones(3, 4),), lambda y: y.sum(), name="wraps")
    target = tmp_path / "t.h5"
    with pytest.raises(KeyboardInterrupt):
        capture(case, target)
    assert not target.exists() and Path(f"{target}.partial").exists()


def test_a_ctrl_c_during_teardown_prints_no_traceback():
    """After the command has said its result, a Ctrl-C during the interpreter's teardown
    (torch's atexit handlers) must not print 'Exception ignored ... KeyboardInterrupt'."""
    code = ("import atexit, os, signal, sys, time\n"
            "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(0.2)))\n"
            "sys.argv = ['layerdiff', '--version']\n"
            "from layerdiff.cli import run\n"
            "run()\n")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.stdout.startswith("layerdiff, version")
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.returncode == 0
