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
        assert _ranks_out(origin, PairReader(ref, port), 0, 2) == [1]


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
