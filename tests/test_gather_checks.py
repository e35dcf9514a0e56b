"""Gathering checks every rank file's bytes, in worker processes when asked: rank files written
by hand (no torch, no processes to launch) make a tensor-parallel layer's shards."""

from __future__ import annotations

import math

import h5py
import numpy as np
import pytest

from layerdiff import TraceWriter, diff
from layerdiff.errors import TraceError
from layerdiff.mapping import Mapping
from layerdiff.trace import gather as gather_module
from layerdiff.trace import open_trace, schema
from layerdiff.trace.manifest import rank_path, write_manifest

RULES = """
[[shard]]
site = "fc"
tensor = "weight"
dim = 0

[[shard]]
site = "fc"
tensor = "output"
dim = -1
"""


def _write(path, x, weight, out, meta):
    with TraceWriter(path, meta=meta) as writer, writer.site("fc", "Linear") as site:
        writer.record(site, "input", x)
        writer.record(site, "weight", weight, arg="weight")
        writer.record(site, "output", out)


@pytest.fixture
def ranks(tmp_path):
    """A column-parallel linear over 2 ranks, and the one-process reference of it."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    weight = rng.standard_normal((6, 8), dtype=np.float32)
    _write(tmp_path / "ref.h5", x, weight, x @ weight.T, {"case": "ref"})
    manifest = tmp_path / "port.h5"
    files = []
    for rank, part in enumerate(np.split(weight, 2)):
        files.append(rank_path(manifest, rank))
        _write(files[-1], x, part, x @ part.T, {"case": "port", "rank": rank, "world_size": 2})
    write_manifest(manifest, files)
    rules = tmp_path / "map.toml"
    rules.write_text(RULES)
    return tmp_path, rules


@pytest.mark.parametrize("workers", [1, 2])
def test_hand_written_shards_gather_to_the_reference(ranks, monkeypatch, workers):
    folder, rules = ranks
    monkeypatch.setattr(gather_module, "PARALLEL_MIN_BYTES", 0)  # use workers on tiny files
    done = gather_module.gather(folder / "port.h5", Mapping.load(rules), folder / "g.h5",
                                workers=workers)
    assert (done.records, done.sharded) == (3, 2)
    with open_trace(done.path) as trace:
        assert trace.index["shape"].tolist() == ["4,8", "6,8", "4,6"]
    assert diff(folder / "ref.h5", folder / "port.h5", mapping=rules).passed


@pytest.mark.parametrize("workers", [1, 2])
def test_a_damaged_rank_file_is_refused_naming_it(ranks, monkeypatch, workers):
    folder, rules = ranks
    monkeypatch.setattr(gather_module, "PARALLEL_MIN_BYTES", 0)
    damaged = folder / "port.rank1.h5"
    with open_trace(damaged) as trace:
        row = trace.find(0, "fc#0", "weight", "weight")
    with h5py.File(damaged, "r+") as h5:  # the manifest's digests cover tables, not data
        data = h5[schema.segment_name(int(row["segment"]))]
        data[int(row["offset"]) + 4] ^= 0x40
    with pytest.raises(TraceError, match=r"port\.rank1\.h5.*fc#0 weight weight"):
        gather_module.gather(folder / "port.h5", Mapping.load(rules), folder / "g.h5",
                             workers=workers)
    assert not (folder / "g.h5").exists()


def test_a_rank_whose_part_holds_equal_infinities_is_not_named(tmp_path):
    """The ranks whose part of a sharded origin is out are found by the one judge: the same
    infinity on both sides is a match there as everywhere (it was counted as out)."""
    from types import SimpleNamespace

    from layerdiff.compare.pair import PairReader
    from layerdiff.compare.rank_parts import _ranks_out
    from layerdiff.trace.layout import Layout, Placement

    ref_values = np.array([[np.inf, 1.0], [2.0, 3.0]], dtype=np.float32)
    port_values = ref_values.copy()
    port_values[1, 1] = 4.0  # rank 1's row (split along axis 0) is off; rank 0's agrees

    def write(name, values):
        with TraceWriter(tmp_path / name, meta={}) as writer, writer.site("fc") as site:
            writer.record(site, "output", values)
        return open_trace(tmp_path / name)

    origin = SimpleNamespace(step=0, pass_="forward", site="fc#0", port_site="fc#0",
                             role="output", arg="0", port_arg="0",
                             metrics={"rtol": 1.3e-6, "atol": 1e-5})
    with write("ref.h5", ref_values) as ref, write("port.h5", port_values) as port:
        split = Layout.one_dim(2, Placement("shard", 0))
        assert _ranks_out(origin, PairReader(ref, port), split) == [1]


@pytest.mark.parametrize("magnitude", [1e-200, 1.0, 1e160, 1e300])
def test_joined_statistics_hold_at_the_ends_of_float64s_range(magnitude):
    """A tensor gathered from its shards gets the statistics of the whole, from the parts'
    (their squares overflowed past 1e154 and raised OverflowError; underflowed near 1e-160)."""
    import pandas as pd

    from layerdiff.trace.gather import _combined
    from layerdiff.trace.stats import compute_stats

    whole = np.linspace(-1.0, 2.0, 64) * magnitude
    parts = [pd.Series({**compute_stats(half, "float64")._asdict(), "numel": half.size})
             for half in np.split(whole, 2)]
    joined, expected = _combined(parts), compute_stats(whole, "float64")
    for name in ("min", "max", "mean", "std", "l2"):
        assert math.isclose(joined[name], getattr(expected, name), rel_tol=1e-12), name


# ---- gathering without rules: the recorded mapping, or the rank files decide ---------------


def test_without_rules_a_sharded_world_is_refused_naming_the_rule_to_write(ranks):
    """No --map and nothing recorded: the weight differs across ranks, so it is cut (or the
    replicas diverged), and no gathered trace of rank 0's parts is written."""
    from click.testing import CliRunner

    from layerdiff.cli import main

    folder, _ = ranks
    with pytest.raises(TraceError, match=r"no mapping gives \[\[shard\]\] rules.*fc#0 weight "
                                         r"weight \(step 0\) differs across ranks \(its values "
                                         r"differ on rank 1\).*site = \"fc\", tensor = "
                                         r"\"weight\", dim = D"):
        gather_module.gather(folder / "port.h5", None, folder / "g.h5")
    assert not (folder / "g.h5").exists()
    done = CliRunner().invoke(main, ["gather", str(folder / "port.h5"), "-o",
                                     str(folder / "g.h5")])
    assert done.exit_code == 2 and "wrote" not in done.output, done.output
    assert "write a rule for it in a mapping file" in " ".join(done.output.split())
    assert not (folder / "g.h5").exists()
    # the diff has the reference: the parts add up to its shapes along one dim, and are cut so
    found = diff(folder / "ref.h5", folder / "port.h5", mapping=Mapping())
    assert found.passed and found.meta["gathered"]["sharded_records"] == 2


def test_parts_of_different_shapes_name_the_axis_they_are_cut_along(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    weight = rng.standard_normal((6, 8), dtype=np.float32)
    manifest, files = tmp_path / "port.h5", []
    for rank, part in enumerate((weight[:4], weight[4:])):  # an uneven split: 4 rows and 2
        files.append(rank_path(manifest, rank))
        _write(files[-1], x, part, x @ part.T, {"case": "port", "rank": rank, "world_size": 2})
    write_manifest(manifest, files)
    rules = tmp_path / "empty.toml"
    rules.write_text("version = 1\n")
    with pytest.raises(TraceError, match=r"empty.toml has no \[\[shard\]\] rules, but fc#0 "
                                         r"weight weight \(step 0\) differs across ranks "
                                         r"\(shape \(4,8\) on rank 0, \(2,8\) on rank 1\).*"
                                         r"dim = 0\)"):
        gather_module.gather(manifest, Mapping.load(rules), tmp_path / "g.h5")


def test_a_replicated_world_gathers_to_rank_zeros_copies_and_says_so(tmp_path):
    """Every record the same on every rank (data-parallel replicas on one batch): nothing to
    join, and rank 0's copies are the whole tensors; the diff against the reference passes."""
    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    weight = rng.standard_normal((6, 8), dtype=np.float32)
    _write(tmp_path / "ref.h5", x, weight, x @ weight.T, {"case": "ref"})
    manifest, files = tmp_path / "port.h5", []
    for rank in range(2):
        files.append(rank_path(manifest, rank))
        _write(files[-1], x, weight, x @ weight.T,
               {"case": "port", "rank": rank, "world_size": 2})
    write_manifest(manifest, files)
    done = gather_module.gather(manifest, None, tmp_path / "g.h5")
    assert (done.records, done.sharded) == (3, 0)
    assert done.notes == [f"every record of {manifest} is the same on all 2 ranks (shape, "
                          "dtype, digest): nothing is cut across ranks, and the gathered trace "
                          "is rank 0's copies, which are the whole tensors"]
    with open_trace(done.path) as trace:
        assert trace.index["shape"].tolist() == ["4,8", "6,8", "4,6"]
    found = diff(tmp_path / "ref.h5", manifest)
    assert found.passed and any("same on all 2 ranks" in w for w in found.meta["warnings"])


def test_without_map_the_mapping_the_capture_recorded_gives_the_rules(tmp_path):
    """capture --weights-from --map records the mapping in every rank file: gather takes its
    rules as the diff does (it joined nothing and wrote rank 0's parts)."""
    from click.testing import CliRunner

    from layerdiff.cli import main

    rng = np.random.default_rng(3)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    weight = rng.standard_normal((6, 8), dtype=np.float32)
    recorded = {"weights": {"from": "ref.h5",
                            "mapping": {"name": "port.map.toml", "text": RULES}}}
    manifest, files = tmp_path / "port.h5", []
    for rank, part in enumerate(np.split(weight, 2)):
        files.append(rank_path(manifest, rank))
        _write(files[-1], x, part, x @ part.T,
               {"case": "port", "rank": rank, "world_size": 2, **recorded})
    write_manifest(manifest, files)
    done = CliRunner().invoke(main, ["gather", str(manifest), "-o", str(tmp_path / "g.h5")])
    assert done.exit_code == 0, done.output
    assert ("3 records of 2 ranks, 2 joined (2 by the [[shard]] rules of port.map.toml "
            "(recorded in port.h5's rank files at capture))") in " ".join(done.output.split())
    with open_trace(tmp_path / "g.h5") as trace:
        assert trace.index["shape"].tolist() == ["4,8", "6,8", "4,6"]
        np.testing.assert_array_equal(trace.read(trace.find(0, "fc#0", "weight", "weight")),
                                      weight)


@pytest.mark.parametrize("summary", [False, True], ids=["data", "summary"])
def test_without_digests_the_ranks_bytes_or_statistics_decide(tmp_path, summary):
    """Rank files of a writer that computes no digests: their bytes are compared (a summary's
    statistics, where there are no bytes); the replicated input passes, the cut weight not."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 8), dtype=np.float32)
    weight = rng.standard_normal((6, 8), dtype=np.float32)
    manifest, files = tmp_path / "port.h5", []
    for rank, part in enumerate(np.split(weight, 2)):
        files.append(rank_path(manifest, rank))
        with TraceWriter(files[-1], meta={"rank": rank, "world_size": 2},
                         summary=summary) as writer, writer.site("fc", "Linear") as site:
            writer.record(site, "input", x)
            writer.record(site, "weight", part, arg="weight")
        with h5py.File(files[-1], "r+") as h5:  # as a writer that computes no digests leaves
            column = h5[f"{schema.INDEX_GROUP}/digest"]
            column[...] = np.array([""] * column.shape[0], dtype=object)
            del h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP)]
    write_manifest(manifest, files)
    with pytest.raises(TraceError, match=r"fc#0 weight weight \(step 0\) differs across ranks "
                                         r"\(its values differ on rank 1\)"):
        gather_module.gather(manifest, None, tmp_path / "g.h5")
