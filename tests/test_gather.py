"""A tensor-parallel port against its one-process reference: the ranks' shards are gathered by
the mapping's [[shard]] rules, the faithful port passes, a planted bug is found at its layer,
an error in one rank's shard names that rank, and bad rules are refused naming their line."""

from __future__ import annotations

import numpy as np
import pytest

from layerdiff import diff, open_trace
from layerdiff.errors import DiffError, MappingError, TraceError
from layerdiff.mapping import Mapping
from layerdiff.report.findings.diff import describe_origin
from layerdiff.trace.gather import gather
from reference_models import tensor_parallel as tp
from reference_models.catalog import find

pytestmark = pytest.mark.slow  # the 2-rank captures start two processes (a few seconds)
MAP = str(tp.MAP_FILE)


@pytest.fixture(scope="module")
def traces(rank_captures, tmp_path_factory):
    """One-process reference and 2-rank ports (full and summary), captured once for the
    session (tests/rank_captures.py)."""
    return {**{name: str(path) for name, path in rank_captures.items()},
            "folder": tmp_path_factory.mktemp("gather")}


def test_gathered_trace_holds_the_whole_tensors_of_the_reference(traces, tmp_path):
    done = gather(traces["port"], Mapping.load(MAP), tmp_path / "g.h5")
    assert (done.world_size, done.unused_rules) == (2, [])
    with open_trace(done.path) as port, open_trace(traces["reference"]) as ref:
        for site, role, arg in [("blocks.0.mlp.fc#0", "weight", "weight"),
                                ("blocks.0.mlp.proj#0", "weight", "weight"),
                                ("blocks.1.mlp.act#0", "output", "0"),
                                ("blocks.1.mlp.proj#0", "grad_input", "0")]:
            ours, theirs = port.find(0, site, role, arg), ref.find(0, site, role, arg)
            assert ours["shape"] == theirs["shape"]
            np.testing.assert_allclose(port.read(ours), ref.read(theirs), rtol=1e-5, atol=1e-6)
        assert port.meta["gathered"]["world_size"] == 2


def test_faithful_port_passes_and_the_bias_bug_is_found_at_its_layer(traces):
    assert diff(traces["reference"], traces["port"], mapping=MAP).passed
    found = diff(traces["reference"], traces["bias"], mapping=MAP)
    origin, info = found.origins[0], find(f"{tp.MODULE}:bug_bias_before_allreduce")
    assert (origin.site, origin.pass_, origin.role, origin.step) == (
        info.site, info.pass_, "output", 0)
    # proj's output is all-reduced: replicated, and the bias counts twice in every rank's copy
    assert origin.ranks == [0, 1] and origin.shards.startswith("replicated")
    assert "ranks 0, 1' copies" in describe_origin(origin)
    assert found.meta["gathered"]["world_size"] == 2


def test_an_error_in_one_ranks_shard_names_that_rank(traces):
    found = diff(traces["reference"], traces["rank_one"], mapping=MAP)
    origin = found.origins[0]
    assert (origin.site, origin.pass_, origin.role) == ("blocks.0.mlp.act#0", "forward",
                                                        "output")
    assert origin.ranks == [1]
    assert "rank 1's part" in describe_origin(origin)


def test_diverged_replicas_are_said_before_an_origin_they_cause(traces):
    # rank 1's dropout draws its own mask: the replicas split there, and the gathered
    # blocks.1.mlp.fc output (half of it computed on rank 1) is the first record out
    found = diff(traces["reference"], traces["dropout"], mapping=MAP)
    info = find(f"{tp.MODULE}:bug_dropout_per_rank")
    replicas = found.meta["replicas"]
    assert (replicas["site"], replicas["pass"], replicas["role"], replicas["ranks"]) == (
        info.site, info.pass_, "output", [1])
    assert found.origins[0].site == "blocks.1.mlp.fc#0" and found.origins[0].ranks == [1]
    from layerdiff.report.terminal import format_diff

    assert "RANKS replicated tensors differ across ranks, first at blocks.0.mlp.dropout#0" in (
        format_diff(found).replace("\n      ", " "))
    assert diff(traces["reference"], traces["port"], mapping=MAP).meta["replicas"] is None


def test_summary_ranks_gather_to_the_references_statistics(traces):
    assert diff(traces["reference_summary"], traces["port_summary"], mapping=MAP).passed
    with open_trace(traces["port_summary"]) as manifest:
        done = gather(manifest, Mapping.load(MAP), traces["folder"] / "gs.h5")
    with open_trace(done.path) as port, open_trace(traces["reference_summary"]) as ref:
        ours = port.find(0, "blocks.0.mlp.fc#0", "output", "0")
        theirs = ref.find(0, "blocks.0.mlp.fc#0", "output", "0")
        assert ours["shape"] == theirs["shape"] and ours["digest"] == ""
        for column in ("min", "max", "mean", "std", "l2"):
            assert ours[column] == pytest.approx(theirs[column], rel=1e-4, abs=1e-6)


def test_weights_from_loads_each_ranks_shard(traces):
    # the port's own weights differ (another seed): it passes only because each rank
    # loaded its part of the reference's weights through the shard rules
    assert diff(traces["reference"], traces["own_weights"], mapping=MAP).passed


def test_without_shard_rules_gather_refuses_and_the_diff_cuts_by_the_references_shapes(
        traces, tmp_path):
    """No rule cuts anything while fc's weight differs across ranks: `gather`, which has no
    reference, refuses to write rank 0's parts under the whole model's names; the diff cuts
    each such record along the one dim where the parts add up to the reference's shape (a
    Megatron split is torch.chunk's, in rank order), and says so."""
    from click.testing import CliRunner

    from layerdiff.cli import main

    done = CliRunner().invoke(main, ["gather", traces["port"], "-o", str(tmp_path / "g.h5")])
    assert done.exit_code == 2 and not (tmp_path / "g.h5").exists(), done.output
    said = " ".join(done.output.split())
    assert "blocks.0.mlp.fc#0" in said and "differs across ranks" in said
    assert "joined (" not in done.output
    found = diff(traces["reference"], traces["port"], mapping=Mapping())
    assert found.passed, found.origins
    assert any("were cut as the reference's shapes say" in w for w in found.meta["warnings"])


def test_a_rule_whose_dim_does_not_fit_is_refused_naming_it(traces, tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[[shard]]\nsite = "blocks.*.mlp.fc"\ntensor = "weight"\ndim = 5\n')
    with pytest.raises(TraceError, match=r"shard rule 1 \(line 1.*dim 5.*2 dimension"):
        gather(traces["port"], Mapping.load(bad), tmp_path / "g.h5")
    bad.write_text('[[shard]]\nsite = "blocks.*.mlp.fc#0"\ntensor = "weight"\ndim = 0\n')
    with pytest.raises(MappingError, match=r"bad.toml line 1: shard rule 1: site .* names a "
                                           r"call"):
        Mapping.load(bad)
    bad.write_text('[[shard]]\nsite = "fc"\ntensor = "weight"\ndimm = 0\n')
    with pytest.raises(MappingError, match=r"line 1: unknown key 'dimm'.*did you mean 'dim'"):
        Mapping.load(bad)


def test_a_multi_rank_reference_is_refused_with_what_to_do(traces):
    with pytest.raises(DiffError, match=r"manifest of a 2-rank capture; gather it"):
        diff(traces["port"], traces["port"], mapping=MAP)
