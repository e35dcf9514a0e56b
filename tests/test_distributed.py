"""Multi-rank capture: one trace per rank, a manifest published last, refused when a rank file
is missing or replaced, and no manifest when a rank fails."""

from __future__ import annotations

import pytest

from layerdiff import capture, diff, load_case, open_trace
from layerdiff.errors import TraceError
from reference_models import op_bugs

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
