"""End to end, the sharded ports of reference_models.sharded against their one-process
references: capture on 2 and 4 gloo ranks, ``layerdiff diff ref.h5 port.h5 [--map F]``, the
faithful ports pass and each planted bug's origin is its site (and, where only some ranks' parts
are wrong, those ranks), as reference_models.sharded.BUGS says.

The DTensor ports (fsdp, dtensor_tp) need no mapping: the capture records their layouts; the
others' mapping files declare zigzag, partial-sum and expert-placed parts
(tests/test_sharded_models.py checks the same ports by hand, without layerdiff's gather).
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from layerdiff.cli import main
from reference_models import sharded
from reference_models.sharded import BUGS, PORTS, WORLDS, map_file

pytestmark = [
    pytest.mark.slow,  # every case captured on 2 and on 4 ranks
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
]

REFERENCES = ("reference", "moe_reference")
CASES = [port.case for port in PORTS] + [bug.case for bug in BUGS]
REFERENCE_OF = {port.case: port.reference for port in PORTS}
PORT_OF = {**{port.case: port.case for port in PORTS}, **{bug.case: bug.port for bug in BUGS}}
# 4 ranks: the ports whose layout or bug reads differently there (the zigzag chunks are one
# position wide, the bug then wrong on ranks 1-3 only; the experts list is the world's own)
# and the DTensor ports' 4-way meshes; every case on 2
# and the 2-D (dp, tp) port, which runs on 4 ranks only
WORLDS_OF = {**{port.case: port.worlds for port in PORTS}, **{bug.case: bug.worlds for bug in BUGS}}
ON = {2: [case for case in CASES if 2 in WORLDS_OF[case]],
      4: ["zigzag_cp", "bug_zigzag_kv_order", "expert_parallel", "bug_expert_parallel_placement",
          "fsdp", "dtensor_tp", "fsdp_tp", "bug_fsdp_tp_activation", "bug_fsdp_tp_rank_shard"]}
# the one capture made by the command itself on each world (the others by one group of
# processes capturing every case in turn, as under torchrun: one start instead of eleven)
BY_COMMAND = "zigzag_cp"


def _capture_group(world: int, jobs: list[tuple[str, str, dict]]) -> None:
    import torch.multiprocessing as mp

    from tests.gloo import free_port
    from tests.rank_captures import _capture_each

    mp.start_processes(_capture_each, args=(world, free_port(), jobs), nprocs=world,
                       start_method="spawn")


@pytest.fixture(scope="module")
def traces(tmp_path_factory):
    """world -> (name -> trace): the references in one process, the world's cases on its
    ranks; each world captured when a test first asks for it."""
    made: dict[int, dict[str, str]] = {}

    def on(world: int) -> dict[str, str]:
        if world not in made:
            folder = tmp_path_factory.mktemp(f"sharded{world}")
            paths = {name: str(folder / f"{name}.h5") for name in [*REFERENCES, *ON[world]]}
            runner = CliRunner()
            for name in REFERENCES:
                done = runner.invoke(main, ["capture", f"{sharded.MODULE}:{name}", "-o",
                                            paths[name]])
                assert done.exit_code == 0, done.output
            done = runner.invoke(main, ["capture", f"{sharded.MODULE}:{BY_COMMAND}", "-o",
                                        paths[BY_COMMAND], "--nproc", str(world)])
            assert done.exit_code == 0, done.output
            _capture_group(world, [(f"{sharded.MODULE}:{case}", paths[case], {})
                                   for case in ON[world] if case != BY_COMMAND])
            made[world] = paths
        return made[world]
    return on


def layerdiff_diff(paths: dict[str, str], world: int, case: str, tmp_path) -> tuple[int, dict]:
    """``layerdiff diff REF PORT [--map F] --json OUT``: its exit code and JSON."""
    mapping = map_file(PORT_OF[case], world)
    out = tmp_path / "diff.json"
    args = ["diff", paths[REFERENCE_OF[PORT_OF[case]]], paths[case], "--json", str(out)]
    done = CliRunner().invoke(main, args + (["--map", str(mapping)] if mapping else []))
    assert done.exit_code in (0, 1), done.output
    return done.exit_code, json.loads(out.read_text())


def _on(cases: list[str]) -> list:
    return [pytest.param(world, case, id=f"{case}-world{world}")
            for world in WORLDS for case in cases if case in ON[world]]


@pytest.mark.parametrize(("world", "case"), _on([port.case for port in PORTS]))
def test_faithful_port_passes(traces, world, case, tmp_path):
    code, found = layerdiff_diff(traces(world), world, case, tmp_path)
    assert code == 0 and found["origins"] == [], found["origins"]
    assert found["meta"]["gathered"]["world_size"] == world


@pytest.mark.parametrize(("world", "case"), _on([bug.case for bug in BUGS]))
def test_planted_bug_is_found_at_its_site_and_ranks(traces, world, case, tmp_path):
    bug = next(bug for bug in BUGS if bug.case == case)
    code, found = layerdiff_diff(traces(world), world, case, tmp_path)
    assert code == 1
    origin = found["origins"][0]
    assert (origin["site"], origin["pass"], origin["role"], origin["step"]) == (
        bug.site, bug.pass_, bug.role, bug.step), origin
    assert origin["ranks"] == bug.wrong_ranks(world), origin


def test_a_dtensor_port_captured_under_torchrun_passes_and_its_bug_is_named(traces, tmp_path):
    """The real launcher, as users run it: `torchrun --nproc-per-node 2 -m layerdiff capture`
    (each rank writes its file, rank 0 the manifest), then the diff with no mapping."""
    import os
    import subprocess
    import sys

    from tests.gloo import free_port

    reference = traces(2)["reference"]
    for case, passes in (("dtensor_tp", True), ("bug_dtensor_tp_heads", False)):
        output = tmp_path / f"{case}.h5"
        done = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
             "--master-port", str(free_port()), "-m", "layerdiff", "capture",
             f"{sharded.MODULE}:{case}", "-o", str(output)],
            capture_output=True, text=True, timeout=300,
            env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert done.returncode == 0, done.stderr[-2000:]
        found = CliRunner().invoke(main, ["diff", reference, str(output)])
        assert found.exit_code == (0 if passes else 1), found.output
        if not passes:
            assert "origin: blocks.0.attn#0" in found.output


def test_a_2d_port_with_one_ranks_shard_loaded_otherwise_says_so(traces, tmp_path):
    """FSDP over dp with tensor parallelism inside (2 x 2): rank 3's kept shard of a weight
    scaled after fully_shard is whole in ranks 1 and 3's all-gathered tp part, yet named on
    rank 3 alone, as a loading slip on that rank (the reason), by its gradient's 2-D layout."""
    code, found = layerdiff_diff(traces(4), 4, "bug_fsdp_tp_rank_shard", tmp_path)
    assert code == 1
    origin = found["origins"][0]
    assert (origin["site"], origin["role"], origin["ranks"]) == ("blocks.1.mlp.fc#0", "weight", [3])
    assert origin["reason"].startswith("its weights differ before anything ran in rank 3's "
                                       "part only, while the other ranks' agree"), origin
    assert "each part whole on its data-parallel ranks" in origin["shards"], origin
    assert "a tensor-parallel module's the rank's tensor-parallel part" in origin["shards"]

