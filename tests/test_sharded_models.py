"""The bundled sharded ports (reference_models.sharded) against their one-process references,
checked by hand on local gloo ranks, with no layerdiff gather: each rank's records joined by the
layouts of the port's mapping file (tests/sharded_ranks.py reads them with tomllib), so these
checks hold the ports and their mapping files, whatever layerdiff's gather does.

The faithful ports match their references within float32 rounding, their sharded records are
really cut (a plain split would not join them), and each planted bug first shows where
reference_models.sharded.BUGS says, in the ranks' parts it says.
"""

from __future__ import annotations

import tomllib

import pytest
import torch

from reference_models import sharded
from reference_models.sharded_manual import sequence_order, zigzag_positions
from reference_models.sharded_moe import round_robin
from tests.gloo import needs_gloo
from tests.sharded_ranks import join, max_errors, record, rule_for, run_ranks, shard_rules

# the embeddings' inputs are integers: their full backward hooks see no input gradient
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")

MODULE = sharded.MODULE
MANUAL = ["partial_sum", "bug_partial_sum_unreduced", "zigzag_cp", "bug_zigzag_kv_order",
          "expert_parallel", "bug_expert_parallel_placement"]
DTENSOR = ["fsdp", "fsdp_same_batch", "bug_fsdp_activation", "dtensor_tp",
           "bug_dtensor_tp_heads"]
FOUR = ["zigzag_cp", "bug_zigzag_kv_order", "expert_parallel"]
BUGS = {bug.case: bug for bug in sharded.BUGS}
REFERENCE_OF = {port.case: port.reference for port in sharded.PORTS}

# What the DTensor ports cut, for this hand check only (their captures record it themselves).
# FSDP: every activation is the rank's part of the batch, except the position embedding's
# (positions, width), the same on every rank.
FSDP_RULES = [{"site": "pos", "tensor": "output", "layout": "replicate"},
              {"site": "*", "tensor": "input", "dim": 0},
              {"site": "*", "tensor": "output", "dim": 0}]
# tensor parallel: q, k and v's outputs (ColwiseParallel hands on local parts); every other
# cut tensor here is a DTensor, recorded whole by this check
TP_RULES = [{"site": f"blocks.*.attn.{site}", "tensor": "output", "dim": -1}
            for site in ("q", "k", "v")]


def port_of(case: str) -> str:
    return BUGS[case].port if case in BUGS else case


def rules_of(case: str, world: int) -> list[dict]:
    port = port_of(case)
    if port.startswith("fsdp"):
        return FSDP_RULES if port == "fsdp" else []
    if port == "dtensor_tp":
        return TP_RULES
    return shard_rules(sharded.map_file(port, world))


def forward_keys(records: dict, step: int = 0) -> list[tuple]:
    """The forward records of one step, in the order they were made."""
    return [key for key in records if key[0] == step and key[2] in ("input", "output")]


def first_wrong(runs: list[dict], reference: dict, rules: list[dict]) -> tuple:
    """The first forward record of step 0 whose joined parts are not the reference's."""
    for key in forward_keys(reference["records"]):
        if not torch.allclose(join(runs, key, rules), reference["records"][key], atol=1e-5):
            return key
    raise AssertionError("every forward record of step 0 matches the reference")


@pytest.fixture(scope="module")
def references() -> dict[tuple[str, bool], dict]:
    """Each reference's records, with and without the modules' backward hooks."""
    return {(name, backward): record(getattr(sharded, name)(), backward)
            for name in ("reference", "moe_reference") for backward in (True, False)}


def reference_for(references: dict, case: str) -> dict:
    backward = case not in DTENSOR  # the DTensor ports are recorded forward and weight grads
    return references[(REFERENCE_OF[port_of(case)], backward)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    specs = [(f"{MODULE}:{case}", True) for case in MANUAL]
    specs += [(f"{MODULE}:{case}", False) for case in DTENSOR]
    runs = run_ranks(specs, 2, tmp_path_factory.mktemp("sharded2"))
    return {spec.partition(":")[2]: result for spec, result in runs.items()}


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict[str, list[dict]]:
    runs = run_ranks([(f"{MODULE}:{case}", True) for case in FOUR], 4,
                     tmp_path_factory.mktemp("sharded4"))
    return {spec.partition(":")[2]: result for spec, result in runs.items()}


# ---- one process, and the mapping files


@pytest.mark.parametrize("case", [*MANUAL, *DTENSOR])
def test_every_port_in_one_process_is_its_reference(case, references):
    """World 1 (no process group): each port, its bug included, computes the reference (the
    bugs here only show with more than one rank, except the FSDP one, in its own code)."""
    reference = references[(REFERENCE_OF[port_of(case)], True)]
    port = record(getattr(sharded, case)())
    assert port["records"].keys() == reference["records"].keys()
    errors = max_errors([port], reference, [])
    if case == "bug_fsdp_activation":
        assert first_wrong([port], reference, []) == (0, "blocks.1.mlp.act", "output", 0)
    else:
        assert max(errors.values()) < 1e-6, max(errors.items(), key=lambda item: item[1])


def test_zigzag_positions_and_their_sequence_order():
    assert zigzag_positions(0, 2).tolist() == [0, 1, 6, 7]
    assert zigzag_positions(1, 2).tolist() == [2, 3, 4, 5]
    assert zigzag_positions(3, 4).tolist() == [3, 4]
    held = torch.cat([zigzag_positions(rank, 4) for rank in range(4)])   # rank order
    chunks = held.chunk(8)
    assert torch.cat([chunks[i] for i in sequence_order(4)]).tolist() == list(range(8))


@pytest.mark.parametrize("world", sharded.WORLDS)
def test_mapping_files_use_the_contract_keys_and_the_ports_placement(world):
    for port in ("partial_sum", "zigzag_cp", "expert_parallel"):
        path = sharded.map_file(port, world)
        rules = tomllib.loads(path.read_text(encoding="utf-8"))["shard"]
        for rule in rules:
            assert set(rule) <= {"site", "tensor", "dim", "layout", "experts"}, (path, rule)
            assert rule.get("layout", "split") in {"split", "zigzag", "partial", "replicate",
                                                   "experts"}
            if rule.get("layout") == "experts":
                assert rule["experts"] == [round_robin(rank, world) for rank in range(world)]
    assert sharded.map_file("fsdp", world) is None and sharded.map_file("dtensor_tp", 2) is None
    assert sharded.map_file("expert_parallel", 2) != sharded.map_file("expert_parallel", 4)


# ---- two ranks


@needs_gloo
@pytest.mark.parametrize("case", ["partial_sum", "zigzag_cp", "expert_parallel", "fsdp",
                                  "fsdp_same_batch", "dtensor_tp"])
def test_faithful_port_joined_by_its_layouts_is_the_reference(case, two_ranks, references):
    runs, reference = two_ranks[case], reference_for(references, case)
    rules = rules_of(case, 2)
    # (the DTensor ports' records here: forward and weight gradients. Under fsdp each rank's
    # loss is its part's mean, so its activation gradients are W times the reference's part)
    errors = max_errors(runs, reference, rules)
    assert max(errors.values()) < 2e-6, max(errors.items(), key=lambda item: item[1])
    losses = torch.stack([torch.stack(run["losses"]) for run in runs])
    expected = torch.stack(reference["losses"])
    torch.testing.assert_close(losses.mean(0) if case == "fsdp" else losses[0], expected)
    # the layouts are not decoration: each port's cut records differ across the ranks
    cut = [key for key in reference["records"] if rule_for(rules, key)[0]]
    differ = [key for key in cut
              if not torch.equal(runs[0]["records"][key], runs[1]["records"][key])]
    assert len(differ) >= len(cut) // 2 and (case == "fsdp_same_batch") == (not cut)


@needs_gloo
def test_partial_sum_record_is_a_sum_and_its_gradient_replicated(two_ranks, references):
    runs, reference = two_ranks["partial_sum"], references[("reference", True)]
    output, grad = (0, "blocks.0.mlp.proj", "output", 0), (0, "blocks.0.mlp.proj", "grad_output", 0)
    parts = [run["records"][output] for run in runs]
    assert not torch.allclose(parts[0], reference["records"][output], atol=1e-3)
    torch.testing.assert_close(parts[0] + parts[1], reference["records"][output])
    assert torch.equal(runs[0]["records"][grad], runs[1]["records"][grad])
    torch.testing.assert_close(runs[0]["records"][grad], reference["records"][grad])


@needs_gloo
@pytest.mark.parametrize(("case", "site", "role", "dim"), [
    ("zigzag_cp", "blocks.0.mlp.fc", "output", 1),
    ("expert_parallel", "moe.experts", "w1_grad", 0),
    ("expert_parallel", "moe.experts", "output", 0)])
def test_a_plain_split_would_pair_the_parts_wrongly(case, site, role, dim, two_ranks,
                                                     references):
    runs, reference = two_ranks[case], reference_for(references, case)
    key = (0, site, role, 0)
    plain = torch.cat([run["records"][key] for run in runs], dim)
    assert not torch.allclose(plain, reference["records"][key], atol=1e-3)
    torch.testing.assert_close(join(runs, key, rules_of(case, 2)), reference["records"][key])


def wrong_parts(runs: list[dict], reference: dict, key: tuple, rules: list[dict]) -> list[int]:
    """The ranks whose part of a cut record differs from the reference's matching part."""
    whole, rule, world = reference["records"][key], rule_for(rules, key)[0], len(runs)
    wrong = []
    for rank, run in enumerate(runs):
        layout = rule.get("layout", "split")
        if layout == "zigzag":
            expected = whole.index_select(rule["dim"], zigzag_positions(rank, world))
        elif layout == "experts":
            expected = whole.index_select(rule["dim"], torch.tensor(rule["experts"][rank]))
        else:
            expected = whole.chunk(world, rule["dim"])[rank]
        if not torch.allclose(run["records"][key], expected, atol=1e-5):
            wrong.append(rank)
    return wrong


@needs_gloo
@pytest.mark.parametrize("case", [bug.case for bug in sharded.BUGS if 2 in bug.worlds])
def test_planted_bug_first_shows_at_its_site_in_its_ranks_parts(case, two_ranks, references):
    bug, runs = BUGS[case], two_ranks[case]
    reference, rules = reference_for(references, case), rules_of(case, 2)
    site = bug.site.removesuffix("#0")
    wrong = first_wrong(runs, reference, rules)
    if wrong[1] == site:
        assert wrong == (bug.step, site, bug.role, 0)
    else:
        # the fault is in the container's own code: its children's outputs are right, the
        # input of the child after it is the first record wrong
        assert wrong[1].startswith(f"{site}.") and wrong[2] == "input", wrong
        assert not torch.allclose(join(runs, (0, site, "output", 0), rules),
                                  reference["records"][(0, site, "output", 0)], atol=1e-5)
    for key in forward_keys(reference["records"]):  # what came into the site is right
        if key[1] == site and key[2] == "input":
            torch.testing.assert_close(join(runs, key, rules), reference["records"][key])
    output = (0, site, "output", 0)
    if rule_for(rules, output)[0]:
        assert wrong_parts(runs, reference, output, rules) == bug.wrong_ranks(2)
    else:  # replicated: the ranks whose copy is wrong
        expected = reference["records"][output]
        assert [rank for rank, run in enumerate(runs) if not torch.allclose(
            run["records"][output], expected, atol=1e-5)] == bug.wrong_ranks(2)


# ---- four ranks


@needs_gloo
@pytest.mark.parametrize("case", ["zigzag_cp", "expert_parallel"])
def test_faithful_port_on_four_ranks(case, four_ranks, references):
    runs, reference = four_ranks[case], reference_for(references, case)
    errors = max_errors(runs, reference, rules_of(case, 4))
    assert max(errors.values()) < 2e-6, max(errors.items(), key=lambda item: item[1])


@needs_gloo
def test_zigzag_kv_order_on_four_ranks_is_wrong_on_ranks_one_to_three(four_ranks, references):
    runs, reference = four_ranks["bug_zigzag_kv_order"], references[("reference", True)]
    rules = rules_of("bug_zigzag_kv_order", 4)
    assert first_wrong(runs, reference, rules) == (0, "blocks.0.attn.out", "input", 0)
    output = (0, "blocks.0.attn", "output", 0)
    assert wrong_parts(runs, reference, output, rules) == BUGS["bug_zigzag_kv_order"].wrong_ranks(4)


# ---- captured traces: every record a capture makes, joined by the mapping files


@needs_gloo
@pytest.mark.slow  # a 2-rank capture group (spawned: seconds of imports per rank)
def test_captured_hand_written_ports_join_to_the_reference_trace(tmp_path):
    """The mapping files cover what a capture records (the root's output, the loss, integer
    inputs, weights and their gradients) under the names it gives them."""
    import torch.multiprocessing as mp
    from click.testing import CliRunner

    from layerdiff.cli import main
    from tests.gloo import free_port
    from tests.rank_captures import _capture_each
    from tests.sharded_ranks import trace_errors

    ports = ["partial_sum", "zigzag_cp", "expert_parallel"]
    for name in ("reference", "moe_reference"):
        done = CliRunner().invoke(main, ["capture", f"{MODULE}:{name}", "-o",
                                         str(tmp_path / f"{name}.h5")])
        assert done.exit_code == 0, done.output
    jobs = [(f"{MODULE}:{case}", str(tmp_path / f"{case}.h5"), {}) for case in ports]
    mp.start_processes(_capture_each, args=(2, free_port(), jobs), nprocs=2,
                       start_method="spawn")
    for case in ports:
        errors = trace_errors(tmp_path / f"{REFERENCE_OF[case]}.h5", tmp_path / f"{case}.h5",
                              rules_of(case, 2))
        assert len(errors) > 50 and any(key[2].startswith("<root>") for key in errors)
        assert max(errors.values()) < 2e-6, max(errors.items(), key=lambda item: item[1])


def needs_a_process_group():
    """A case that builds a device mesh, as a sharded port does, outside any launcher."""
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (2,))


def test_a_sharded_case_built_in_one_process_says_how_to_run_it(monkeypatch):
    from layerdiff.case import load_case
    from layerdiff.errors import CaseError

    for name in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(CaseError, match=r"builds a model sharded over torch.distributed ranks: "
                                        r"capture it with --nproc N or under torchrun"):
        load_case("tests.test_sharded_models:needs_a_process_group")
