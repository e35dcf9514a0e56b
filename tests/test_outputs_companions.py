"""No output destroys a file a command reads, a multi-rank capture's included (issue 28, item 6).

A manifest (``port.h5``) stands for its rank files (``port.rank0.h5``, ...), which every
command that reads it reads, and for the gathered trace a diff keeps beside it
(``port.gathered.h5``). No output may be one of them, and no input may be the gathered trace
the diff would rewrite. The gathered trace is reused while nothing changed. Manifests are
written here with the trace writer (no processes): the commands only see files.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from layerdiff import TraceWriter, diff
from layerdiff.trace.manifest import rank_path, write_manifest

X = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)


def _write(path, value, meta=None) -> None:
    with TraceWriter(path, meta=meta or {}) as writer, writer.site("fc") as site:
        writer.record(site, "input", X)
        writer.record(site, "output", value)


def _manifest(folder, value=X, world: int = 2):
    """``folder/port.h5``: the manifest of ``world`` rank files, each holding ``value``."""
    out = folder / "port.h5"
    for rank in range(world):
        _write(rank_path(out, rank), value, {"rank": rank, "world_size": world})
    write_manifest(out, [rank_path(out, rank) for rank in range(world)])
    return out


@pytest.fixture
def pair(tmp_path):
    """A one-process reference and a 2-rank port that agree."""
    reference = tmp_path / "ref.h5"
    _write(reference, X)
    return reference, _manifest(tmp_path)


def _refused(result, *words: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.output.startswith("error: ") and result.output.count("\n") == 1, result.output
    assert "Traceback" not in result.output
    for word in words:
        assert word in result.output, result.output


def _unchanged(paths) -> dict:
    return {str(p): p.read_bytes() for p in paths}


@pytest.mark.parametrize("option", ["--json", "--csv", "--html"])
def test_a_diff_report_onto_a_rank_file_is_refused_and_the_rank_file_kept(pair, run, option):
    reference, port = pair
    target = rank_path(port, 1)
    before = _unchanged([target])
    _refused(run("diff", reference, port, option, target), f"rank 1's file of the manifest {port}")
    assert _unchanged([target]) == before


def test_a_diff_report_onto_the_gathered_trace_is_refused(pair, run):
    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    _refused(run("diff", reference, port, "--json", cache), "gathered trace kept beside")
    assert not cache.exists()


def test_show_html_onto_a_rank_file_is_refused(pair, run):
    _, port = pair
    target = rank_path(port, 0)
    before = _unchanged([target])
    _refused(run("show", port, "--html", target), "rank 0's file")
    assert _unchanged([target]) == before


def test_ranks_json_onto_a_rank_file_is_refused(pair, run):
    _, port = pair
    target = rank_path(port, 1)
    before = _unchanged([target])
    _refused(run("ranks", port, "--json", target), "rank 1's file")
    assert _unchanged([target]) == before


def test_gather_onto_a_rank_file_is_refused(pair, run):
    _, port = pair
    target = rank_path(port, 0)
    before = _unchanged([target])
    _refused(run("gather", port, "-o", target), "rank 0's file")
    assert _unchanged([target]) == before


def test_gather_replaces_an_existing_file_only_with_force(pair, run, tmp_path):
    _, port = pair
    target = tmp_path / "notes.txt"
    target.write_text("mine", encoding="utf-8")
    _refused(run("gather", port, "-o", target), "--force")
    assert target.read_text(encoding="utf-8") == "mine"
    done = run("gather", port, "-o", target, "--force")
    assert done.exit_code == 0, done.output
    assert target.read_bytes()[:8] == b"\x89HDF\r\n\x1a\n"


def test_gather_may_write_the_trace_the_diff_would_keep(pair, run):
    # by hand, where the diff keeps it: the diff then reuses it
    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    assert run("gather", port, "-o", cache).exit_code == 0
    stamp = os.stat(cache).st_mtime_ns, os.stat(cache).st_ino
    assert run("diff", reference, port).exit_code == 0
    assert (os.stat(cache).st_mtime_ns, os.stat(cache).st_ino) == stamp


def test_a_diff_against_the_ports_own_gathered_trace_is_refused(pair, run):
    # the diff would rewrite its own reference, then compare it with itself and pass
    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    _write(cache, X * 2)  # not the gathered trace: another trace that happens to be named so
    before = _unchanged([cache])
    _refused(run("diff", cache, port), f"the reference trace {cache} is the gathered trace",
             "copy it to another name")
    assert _unchanged([cache]) == before
    _refused(run("diff", reference, port, "--baseline", cache), "baseline trace")


def test_outputs_elsewhere_and_one_process_traces_are_not_refused(pair, run, tmp_path):
    reference, port = pair
    report = tmp_path / "out" / "report.json"
    result = run("diff", reference, port, "--json", report)
    assert result.exit_code == 0, result.output
    assert json.loads(report.read_text(encoding="utf-8"))["verdict"] == "pass"
    # a one-process trace named like a manifest's rank file is only itself
    _write(tmp_path / "solo.h5", X)
    assert run("show", tmp_path / "solo.h5", "--html", tmp_path / "solo.rank0.h5").exit_code == 0


# --- the gathered trace is reused while nothing changed -----------------------------------------


def test_the_gathered_trace_is_reused_while_nothing_changed(pair):
    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    assert diff(reference, port).passed
    stamp = os.stat(cache).st_mtime_ns, os.stat(cache).st_ino
    assert diff(reference, port).passed
    assert (os.stat(cache).st_mtime_ns, os.stat(cache).st_ino) == stamp


def test_the_gathered_trace_is_redone_when_the_ranks_were_captured_again(pair):
    from layerdiff.errors import TraceError

    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    assert diff(reference, port).passed
    stamp = os.stat(cache).st_mtime_ns, os.stat(cache).st_ino
    # one rank file replaced under the same manifest: refused, never the kept trace of the old
    kept = rank_path(port, 1).read_bytes()
    rank_path(port, 1).unlink()
    _write(rank_path(port, 1), X + 1, {"rank": 1, "world_size": 2})
    with pytest.raises(TraceError, match="rank 1's file"):
        diff(reference, port)
    rank_path(port, 1).write_bytes(kept)
    for rank in range(2):  # captured again, with a bug this time
        rank_path(port, rank).unlink()
    port.unlink()
    _manifest(port.parent, X + 1)
    found = diff(reference, port)
    assert not found.passed  # the new ranks were compared, not the kept trace of the old
    assert (os.stat(cache).st_mtime_ns, os.stat(cache).st_ino) != stamp


def test_a_gathered_trace_that_is_a_link_or_another_users_is_not_trusted(pair, tmp_path):
    # its key is no secret: a link planted beside the manifest (an artifact folder received
    # as a tar keeps links), or a file another user left in the shared temporary folder
    reference, port = pair
    cache = port.with_name("port.gathered.h5")
    assert diff(reference, port).passed
    elsewhere = tmp_path / "elsewhere.h5"
    cache.rename(elsewhere)
    cache.symlink_to(elsewhere)
    before = elsewhere.read_bytes()
    assert diff(reference, port).passed
    assert not cache.is_symlink() and elsewhere.read_bytes() == before  # replaced, not written
    if os.geteuid() == 0:  # only root can give a file to another user
        os.chown(cache, 65534, 65534)
        assert diff(reference, port).passed
        assert os.stat(cache).st_uid == 0


def test_a_multi_rank_capture_never_writes_a_rank_file_over_the_weights_it_loads(pair, run):
    # --force replaces outputs, never inputs
    _, port = pair
    source = rank_path(port, 1)
    before = _unchanged([source])
    _refused(run("capture", "reference_models.mlp:reference", "--nproc", "2", "-o", port,
                 "--weights-from", source, "--force"), "-o's rank 1 file")
    assert _unchanged([source]) == before


def test_the_library_diff_never_rewrites_its_own_reference(pair):
    from layerdiff.errors import DiffError

    _, port = pair
    cache = port.with_name("port.gathered.h5")
    _write(cache, X * 2)
    before = _unchanged([cache])
    with pytest.raises(DiffError, match="copy it to another name"):
        diff(cache, port)
    assert _unchanged([cache]) == before
