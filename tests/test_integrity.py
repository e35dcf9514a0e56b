"""What is read is verified, and no output destroys an input (issue 17, parts 1 and 3).

A damaged trace must never pass: a flipped byte in tensor data, an edited statistic, a missing
segment and a complete flag that is not exactly True are each refused with one sentence naming
the file and the record. And no command may write over a file it reads.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import types

import h5py
import hypothesis.extra.numpy as hnp
import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import given, settings

import layerdiff
from layerdiff import Tolerances, TraceError, capture, diff, load_case, open_trace
from layerdiff.errors import OutputError
from layerdiff.outputs import replacing, write_text
from layerdiff.trace import schema
from layerdiff.trace.stats import compute_stats
from layerdiff.trace.verify import RecordCheck
from layerdiff.weights import load_weights

MLP = "reference_models.mlp:reference"
MLP_PORT = "reference_models.mlp_port:port"


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """A reference trace, a copy of it (every digest agrees) and a port trace (none agrees)."""
    folder = tmp_path_factory.mktemp("integrity")
    ref = capture(load_case(MLP), folder / "ref.h5")
    port_case = load_case(MLP_PORT)
    load_weights(port_case.model, ref)
    port = capture(port_case, folder / "port.h5")
    return ref, port


def _copy(source, folder, name):
    target = folder / name
    shutil.copyfile(source, target)
    return target


def _stored(path):
    """Index rows of tensors with data, as plain dicts."""
    with open_trace(path) as trace:
        index = trace.index
        return index[(index["kind"] == "tensor") & (index["segment"] >= 0)].to_dict("records")


def _flip(path, row, at: int) -> None:
    with h5py.File(path, "r+") as h5:
        data = h5[schema.segment_name(int(row["segment"]))]
        position = int(row["offset"]) + at
        data[position] = data[position] ^ 0x40


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("against", ["copy", "port"])
def test_a_flipped_data_byte_is_refused_naming_file_and_record(traces, tmp_path, against):
    ref, port = traces
    # the copy: every digest agrees, so nothing would be read without verification
    other = _copy(ref if against == "copy" else port, tmp_path, "bad.h5")
    row = next(r for r in _stored(other) if r["role"] == "output" and r["nbytes"] > 64)
    _flip(other, row, 8)
    with pytest.raises(TraceError) as caught:
        diff(ref, other)
    message = str(caught.value)
    assert str(other) in message and row["site"] in message and "digest" in message


def test_every_sampled_byte_flip_in_tensor_data_is_caught(traces, tmp_path):
    """120 single-byte flips at random places inside tensors: none may pass."""
    ref, _ = traces
    rows = _stored(ref)
    rng = np.random.default_rng(17)
    bad = _copy(ref, tmp_path, "bad.h5")
    pristine = bad.read_bytes()
    for _ in range(120):
        row = rows[rng.integers(len(rows))]
        bad.write_bytes(pristine)
        _flip(bad, row, int(rng.integers(row["nbytes"])))
        with pytest.raises(TraceError, match="digest"):
            diff(ref, bad)


def test_no_verify_skips_the_check_and_says_what_it_risks(traces, tmp_path, run):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    _flip(bad, _stored(bad)[3], 0)
    refused = run("diff", ref, bad)
    assert refused.exit_code == 2
    assert refused.output.count("\n") == 1 and "digest" in refused.output
    assert run("diff", ref, bad, "--no-verify").exit_code == 0
    assert "--no-verify" in run("diff", "--help").output


def test_an_edited_statistic_is_refused_naming_the_statistic(traces, tmp_path):
    """Without the table digest (a trace from another writer, or from before it), the check of
    what is read against its statistics still names the statistic that is wrong."""
    ref, port = traces
    bad = _copy(port, tmp_path, "bad.h5")
    rows = _stored(bad)
    target = next(i for i, r in enumerate(rows) if r["role"] == "output")
    with h5py.File(bad, "r+") as h5:
        del h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP)]
        column = h5[f"{schema.INDEX_GROUP}/max"]
        values = column[:]
        seq = rows[target]["seq"]
        position = int(np.flatnonzero(h5[f"{schema.INDEX_GROUP}/seq"][:] == seq)[0])
        values[position] *= 1.5
        column[:] = values
    with pytest.raises(TraceError, match=r"index statistics .*\(max: index says"):
        diff(ref, bad)


def test_trace_read_checks_the_bytes_it_returns(traces, tmp_path):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    row = _stored(bad)[0]
    _flip(bad, row, 0)
    with open_trace(bad) as trace, pytest.raises(TraceError, match="digest"):
        trace.read(trace.index.iloc[0] if trace.index.iloc[0]["seq"] == row["seq"] else
                   trace.index[trace.index["seq"] == row["seq"]].iloc[0])
    with open_trace(bad, verify=False) as trace:  # asked for: the damaged bytes come back
        assert trace.read(trace.index[trace.index["seq"] == row["seq"]].iloc[0]).size


def test_a_segment_the_index_names_but_the_file_lacks_is_refused(traces, tmp_path):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with h5py.File(bad, "r+") as h5:
        del h5[schema.segment_name(0)]
    with pytest.raises(TraceError, match="segment 0, which the file lacks"):
        diff(ref, bad)


def test_a_segment_of_the_wrong_kind_is_refused_naming_a_record_it_holds(traces, tmp_path):
    """The opening check of every segment names what the index puts there, though it builds
    that sentence only for the segment it refuses."""
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with h5py.File(bad, "r+") as h5:
        segments = sorted(h5[schema.TENSORS_GROUP])
        last = segments[-1]
        del h5[f"{schema.TENSORS_GROUP}/{last}"]
        h5.create_dataset(f"{schema.TENSORS_GROUP}/{last}", data=np.zeros((4, 4), np.uint8))
    with pytest.raises(TraceError, match=rf"segment {int(last)} \(the index puts .+ there\) "
                                         "is not a 1-D uint8 dataset"):
        diff(ref, bad)


@pytest.mark.parametrize("flag", ["false", "no", np.nan, 1, "True"])
def test_a_complete_flag_that_is_not_exactly_true_means_incomplete(traces, tmp_path, flag):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with h5py.File(bad, "r+") as h5:
        h5.attrs[schema.ATTR_COMPLETE] = flag
    with pytest.raises(TraceError, match="incomplete"):
        open_trace(bad)


@pytest.mark.parametrize("scale", [0.0, -1.0, float("nan"), "big"])
def test_an_impossible_loss_scale_is_refused(traces, tmp_path, scale):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with open_trace(ref) as trace:
        meta = dict(trace.meta, loss_scale=scale)
    with h5py.File(bad, "r+") as h5:
        h5.attrs[schema.ATTR_META] = __import__("json").dumps(meta)
        del h5.attrs[schema.ATTR_META_DIGEST]  # as from another writer: the value is refused
    with pytest.raises(TraceError, match="loss scale"):
        open_trace(bad)


def test_a_summary_diff_still_checks_the_full_side(traces, tmp_path):
    ref, _ = traces
    summary = capture(load_case(MLP), tmp_path / "summary.h5", summary=True)
    assert diff(ref, summary).passed
    bad = _copy(ref, tmp_path, "bad.h5")
    _flip(bad, _stored(bad)[5], 1)
    with pytest.raises(TraceError, match="digest"):
        diff(bad, summary)


# --- outputs never destroy inputs -------------------------------------------------------------


@pytest.mark.parametrize("option,target", [("--json", "ref"), ("--csv", "ref"),
                                           ("--html", "port")])
def test_a_report_onto_an_input_trace_is_refused_and_the_input_kept(traces, tmp_path, run,
                                                                    option, target):
    ref, port = traces
    before = {name: _sha(path) for name, path in (("ref", ref), ("port", port))}
    result = run("diff", ref, port, option, {"ref": ref, "port": port}[target])
    assert result.exit_code == 2
    assert "would destroy" in result.output and result.output.count("\n") == 1
    assert {name: _sha(path) for name, path in (("ref", ref), ("port", port))} == before


def test_a_report_through_another_name_of_the_input_is_refused(traces, tmp_path, run):
    ref, port = traces
    alias = tmp_path / "alias.h5"
    alias.symlink_to(ref)
    before = _sha(ref)
    assert run("diff", ref, port, "--json", alias).exit_code == 2
    assert _sha(ref) == before


def test_check_refuses_junit_onto_its_golden(traces, run):
    ref, _ = traces
    before = _sha(ref)
    result = run("check", MLP, ref, "--junit", ref)
    assert result.exit_code == 2 and "golden trace" in result.output
    assert _sha(ref) == before


def test_capture_refuses_to_write_over_the_trace_it_loads_weights_from(traces, run):
    ref, _ = traces
    before = _sha(ref)
    result = run("capture", MLP_PORT, "-o", ref, "--weights-from", ref, "--force")
    assert result.exit_code == 2 and "--weights-from trace" in result.output
    assert _sha(ref) == before


def test_capture_onto_an_existing_file_needs_force(tmp_path, run):
    target = tmp_path / "t.h5"
    target.write_text("precious")
    refused = run("capture", MLP, "-o", target)
    assert refused.exit_code == 2 and "--force" in refused.output
    assert target.read_text() == "precious"
    assert run("capture", MLP, "-o", target, "--force").exit_code == 0
    assert open_trace(target).complete


def test_a_report_goes_into_a_folder_it_creates(traces, tmp_path, run):
    ref, port = traces
    target = tmp_path / "new" / "deeper" / "diff.json"
    assert run("diff", ref, port, "--json", target).exit_code in (0, 1)
    assert target.read_text().startswith("{")


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "report.json"
    write_text(target, "old\n")
    with pytest.raises(RuntimeError), replacing(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("renderer failed")
    assert target.read_text() == "old\n"
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_an_unwritable_folder_is_one_sentence(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OutputError, match="cannot create the folder"):
        write_text(blocker / "sub" / "x.json", "{}")


# --- the check never refuses good data ---------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(values=hnp.arrays(st.sampled_from([np.float32, np.float64, np.float16]),
                         st.integers(0, 300),
                         elements=st.floats(width=16, allow_nan=True, allow_infinity=True)),
       offset=st.floats(-1e4, 1e4, width=16), pieces=st.integers(1, 7))
def test_the_check_accepts_what_the_writer_computed_fed_in_any_pieces(values, offset, pieces):
    """Whatever the values (NaN, Inf, all equal, far from zero) and however the bytes are cut
    into chunks, the statistics the writer computed pass the reader's check."""
    values = (values + values.dtype.type(offset)).astype(values.dtype)
    stats = compute_stats(values, values.dtype.name)
    row = dict(stats._asdict(), site="s#0", role="output", arg="0", step=0,
               dtype=values.dtype.name)
    check = RecordCheck(row, "t.h5")
    for part in np.array_split(values, pieces):
        check.update(part.view(np.uint8))
    check.finish()  # raises when it disagrees


# --- failures are sentences ---------------------------------------------------------------------


def test_a_trace_path_the_system_refuses_is_one_sentence(run):
    result = run("capture", MLP, "-o", "/proc/layerdiff-test.h5")
    assert result.exit_code == 2
    assert result.output.startswith("error: cannot write trace /proc/layerdiff-test.h5")
    assert "Traceback" not in result.output and result.output.count("\n") == 1


def test_a_queue_larger_than_memory_is_refused_before_anything_is_written(run, tmp_path):
    target = tmp_path / "t.h5"
    result = run("capture", MLP, "-o", target, "--queue-mib", 10**8)
    assert result.exit_code == 2 and "--queue-mib" in result.output
    assert list(tmp_path.iterdir()) == []  # no .partial left behind


def test_a_negative_margin_is_refused(run, tmp_path):
    result = run("golden", MLP, "-o", tmp_path / "g.h5", "--calibrate", 2, "--margin", -1)
    assert result.exit_code == 2 and "--margin" in result.output


# --- one writer per path ------------------------------------------------------------------------


def test_a_second_writer_to_the_same_path_is_refused_and_the_first_publishes(tmp_path):
    from layerdiff import CaptureError, TraceWriter

    target = tmp_path / "t.h5"
    first = TraceWriter(target, meta={"case": "first"})
    first.record("a#0", "output", np.ones(4, np.float32))
    with pytest.raises(CaptureError, match=rf"another capture \(process {os.getpid()}\) is "
                                           "writing"):
        TraceWriter(target, meta={"case": "second"})
    first.close()
    with open_trace(target) as trace:  # the first writer's file, whole
        assert trace.meta["case"] == "first" and len(trace.index) == 1
    assert not (tmp_path / "t.h5.lock").exists()
    with TraceWriter(target, meta={"case": "third"}) as again:  # the lock was let go
        again.record("a#0", "output", np.ones(4, np.float32))


def test_a_capture_to_a_path_another_process_writes_names_that_process(tmp_path, run):
    target = tmp_path / "t.h5"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\n"
         "from layerdiff.trace.lock import WriterLock\n"
         f"lock = WriterLock({str(target)!r}); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = run("capture", MLP, "-o", target)
        assert result.exit_code == 2
        assert f"another capture (process {holder.pid}) is writing {target}" in result.output
        assert not target.exists() and not (tmp_path / "t.h5.partial").exists()
    finally:
        holder.kill()
        holder.wait()
    assert run("capture", MLP, "-o", target).exit_code == 0  # a killed holder blocks nothing


# --- interrupted and killed captures -------------------------------------------------------------

_SLOW_CASE = "reference_models.transformer:reference_large"


def _start_capture(target, **popen):
    return subprocess.Popen([sys.executable, "-m", "layerdiff", "capture", _SLOW_CASE, "-o",
                             str(target), "--steps", "3"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **popen)


def _wait_for(path, timeout=120.0):
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.001)


@pytest.mark.slow
def test_ctrl_c_exits_130_naming_the_partial_and_how_to_open_it(tmp_path):
    import signal

    target = tmp_path / "t.h5"
    # SIGINT as a terminal sends it (a background test runner may have it ignored)
    capture_process = _start_capture(
        target, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    _wait_for(tmp_path / "t.h5.partial")
    time.sleep(1.0)  # into the run (an interrupt within the file's first microseconds is
    capture_process.send_signal(signal.SIGINT)  # the next test's case)
    output, _ = capture_process.communicate(timeout=120)
    # 130, or ended by the SIGINT itself (Python re-raises it when an interrupt reaches the
    # top): a shell reports both as 130
    assert capture_process.returncode in (130, -signal.SIGINT), output
    partial = tmp_path / "t.h5.partial"
    assert (f"interrupted: no trace was published at {target}; {partial} holds what was "
            f"recorded up to there (layerdiff show {partial} --allow-incomplete)") in output
    assert "Aborted" not in output and "Traceback" not in output
    assert not target.exists() and not (tmp_path / "t.h5.lock").exists()
    with open_trace(partial, allow_incomplete=True) as trace:
        assert not trace.complete


def test_a_partial_killed_before_it_wrote_anything_says_so(tmp_path, run):
    partial = tmp_path / "t.h5.partial"
    for content in (b"", b"\x89HDF\r\n\x1a\n" + bytes(88), None):  # empty, a bare superblock,
        if content is None:                                          # no attributes yet
            partial.unlink()
            h5py.File(partial, "w").close()
        else:
            partial.write_bytes(content)
        result = run("show", partial, "--allow-incomplete")
        assert result.exit_code == 2
        assert "holds nothing yet" in result.output and "capture again" in result.output


def test_a_partial_is_readable_from_its_first_moment(tmp_path):
    """The writer puts the skeleton on disk before any record: a SIGKILL right after the
    .partial appears still leaves a file that opens and lists nothing."""
    from layerdiff import TraceWriter

    writer = TraceWriter(tmp_path / "t.h5", meta={"case": "x"})
    try:
        with open_trace(tmp_path / "t.h5.partial", allow_incomplete=True) as trace:
            assert not trace.complete and trace.index.empty
    finally:
        writer.close()


def test_traces_of_different_models_are_exit_2_saying_what_differs(reference_traces, run):
    mlp = reference_traces(MLP)
    cnn = reference_traces("reference_models.cnn:reference")
    result = run("diff", mlp, cnn)
    assert result.exit_code == 2
    assert "traces of different models or inputs" in result.output
    assert "(16,32) in the reference and (8,3,16,16) in the port" in result.output


def test_a_tolerance_rule_that_matches_nothing_gets_a_warning(reference_traces, tmp_path, run):
    ref = reference_traces(MLP)
    rules = tmp_path / "tol.toml"
    rules.write_text('version = 1\n[[rule]]\nsite = "fc1*"\nrtol = 1e-3\n'
                     '[[rule]]\nsite = "fcc9*"\natol = 1\n', encoding="utf-8")
    result = diff(ref, ref, tolerances=rules)
    assert result.passed
    assert result.meta["warnings"] == [
        "tol.toml rule 2 (line 5) matched no compared record (site 'fcc9*', role '*', arg '*', "
        "dtype '*'): check its globs"]
    assert "matched no compared record" in run("diff", ref, ref, "--tolerances", rules).output


def test_a_diff_renders_as_html_in_a_notebook(traces, monkeypatch):
    """In IPython, ``import layerdiff`` registers the diff's HTML with the display (by the
    class's name: compare/ does not import report/, so a Diff has no _repr_html_)."""
    ref, port = traces
    registered = {}

    class HtmlFormatter:
        def for_type_by_name(self, module, name, function):
            registered[(module, name)] = function

    display = types.SimpleNamespace(formatters={"text/html": HtmlFormatter()})
    shell = types.SimpleNamespace(display_formatter=display)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    layerdiff._show_in_notebooks()
    same = diff(ref, ref)
    show = registered[(type(same).__module__, type(same).__qualname__)]
    shown = show(same)
    assert ">PASS<" in shown and "0 out of tolerance" in shown
    # the port differs from the reference by rounding: zero tolerance puts those rows out
    bad = diff(ref, port, tolerances=Tolerances(rtol=0, atol=0))
    html = show(bad)
    assert ">FAIL<" in html and "<table" in html and "origins:" in html
    assert bad.failing().iloc[0]["site"] in html


def test_a_full_disk_is_one_sentence_and_exit_2(tmp_path):
    """A file size limit stands in for a full disk: the same failed write, at a known size."""
    import resource

    target = tmp_path / "t.h5"

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    result = subprocess.run([sys.executable, "-m", "layerdiff", "capture",
                             "reference_models.transformer:reference", "-o", str(target)],
                            preexec_fn=limit, capture_output=True, text=True, timeout=300)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "File too large" in lines[0] and "Traceback" not in lines[0]
    # nothing published, and nothing left: what a failed write leaves is cut at an unknown point
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("table, column", [("index", "arg"), ("index", "step"),
                                           ("sites", "enter_seq")])
def test_an_edited_table_cell_is_refused_by_the_table_digest(traces, tmp_path, table, column):
    """Edits that leave a well-formed trace (another argument name, another step) are caught
    by the digest the writer leaves over each table's values."""
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with h5py.File(bad, "r+") as h5:
        dataset = h5[f"{table}/{column}"]
        if dataset.dtype.kind == "O":
            dataset[0] = "x"
        else:
            dataset[0] = dataset[0] + 1
    with pytest.raises(TraceError, match=f"table /{table} does not match the digest"):
        diff(ref, bad)
    with open_trace(bad, verify=False) as trace:  # asked not to verify: read as it is
        assert len(trace.index)


def test_a_mapping_site_rule_that_matches_nothing_gets_a_warning(reference_traces, tmp_path):
    ref = reference_traces(MLP)
    mapping = tmp_path / "m.toml"
    mapping.write_text('version = 1\n[[site]]\nreference = "fc*"\nport = "fc*"\n'
                       '[[site]]\nreference = "encoder.*"\nport = "enc.*"\n', encoding="utf-8")
    warnings = diff(ref, ref, mapping=mapping).meta["warnings"]
    assert warnings == ["m.toml site rule 2 (line 5) matched no reference module (reference "
                        "'encoder.*'): check its pattern"]


def test_an_edited_meta_is_refused_by_its_digest(traces, tmp_path):
    ref, _ = traces
    bad = _copy(ref, tmp_path, "bad.h5")
    with open_trace(ref) as trace:
        meta = dict(trace.meta, case="someone_else:case")
    with h5py.File(bad, "r+") as h5:
        h5.attrs[schema.ATTR_META] = __import__("json").dumps(meta)
    with pytest.raises(TraceError, match="meta attribute does not match the digest"):
        open_trace(bad)
