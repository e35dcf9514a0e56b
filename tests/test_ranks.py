"""``layerdiff ranks``: the replicated records of a multi-rank capture must agree on every rank.

Captured on 2 gloo processes, once per case for the session: the faithful tensor-parallel port
agrees (with its shard rules; without them its sharded tensors are flagged, and the user is
told to add rules); its per-rank dropout is found at the dropout's output; a data-parallel toy
of this file whose first layer's gradients are never all-reduced is found at that layer's
weight gradient, in backward.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from torch import nn
from torch.nn import functional as F

from layerdiff import Case, TraceWriter, seed_everything
from layerdiff.compare.ranks import Reason, check_ranks
from layerdiff.errors import TraceError
from layerdiff.report.findings import render
from reference_models import tensor_parallel as tp
from tests.gloo import gloo_unavailable
from tests.rank_captures import CAPTURES

TP = tp.MODULE
DP = "tests.test_ranks"

# the embeddings' inputs are integers: their full backward hooks see no input gradient
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")


if gloo_unavailable() is not None:
    pytestmark = [pytestmark, pytest.mark.skip(reason=f"2-process gloo: {gloo_unavailable()}")]


# ---- a data-parallel toy (loaded by spec in the spawned rank processes)


class _Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(6, 8)
        self.act = nn.Tanh()
        self.fc2 = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


# Data parallel: every activation, its gradient and the loss are this rank's part of the batch;
# only the parameters and (once averaged) their gradients are replicated.
DP_SHARD_RULES = """
[[shard]]
site = "*"
tensor = "input"
dim = 0

[[shard]]
site = "*"
tensor = "output"
dim = 0
"""


def _data_parallel(name: str, unreduced: tuple[str, ...]) -> Case:
    """Every rank builds the same model and takes its part of one batch of 8;
    a hook on each parameter averages its gradient over the ranks as backward accumulates it
    (DDP's job), except for the parameters named in ``unreduced``."""
    rank, world = tp.rank_and_world()
    seed_everything(0)
    model = _Toy()
    x, y = torch.randn(8, 6), torch.randn(8, 3)
    part = slice(rank * 8 // world, (rank + 1) * 8 // world)

    def average(param: torch.Tensor) -> None:
        dist.all_reduce(param.grad)
        param.grad /= world

    if world > 1:
        for pname, param in model.named_parameters():
            if pname not in unreduced:
                param.register_post_accumulate_grad_hook(average)
    target = y[part]
    return Case(model=model, inputs=(x[part],), loss_fn=lambda out: F.mse_loss(out, target),
                seed=0, steps=2, optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                name=f"{DP}:{name}")


def dp_first_layer_unreduced() -> Case:
    """The data-parallel toy whose fc1 gradients are never averaged (a parameter left out of
    the gradient all-reduce): each rank steps with its own batch's gradient."""
    return _data_parallel("dp_first_layer_unreduced", ("fc1.weight", "fc1.bias"))


# ---- captures, once for the session (tests/rank_captures.py): the faithful port runs both
# steps, so its replicas are also checked after an update from all-reduced gradients; the
# dropout bug shows at step 0, captured for one step


@pytest.fixture(scope="module")
def captured(rank_captures):
    """The manifests of the 2-rank captures this module reads, by name."""
    return {"port": rank_captures["port"], "dropout": rank_captures["dropout_one_step"],
            "dp": rank_captures["dp"]}


@pytest.fixture(scope="module")
def tp_rules():
    """The port's mapping file: its [[shard]] rules."""
    return tp.MAP_FILE


@pytest.fixture
def ranks_cli(monkeypatch):
    """Invoke ``layerdiff ranks`` in-process; with the group's error handling (exit 2)."""
    from layerdiff import cli

    group = cli.main

    def invoke(*args):
        return CliRunner().invoke(group, ["ranks", *(str(a) for a in args)])

    return invoke


# ---- the bundled tensor-parallel port


def test_the_faithful_port_agrees_with_its_shard_rules(captured, tp_rules):
    port = captured["port"]
    for tolerance in (False, True):
        result = check_ranks(port, mapping=tp_rules, tolerance=tolerance)
        assert not result.found and result.verdict == "agree"
        assert result.first is None and result.disagreeing == 0
        # both steps, every replicated record: weights updated from all-reduced gradients too
        assert result.records > 200 and result.sharded > 0 and result.warnings == []
        assert result.read == 0  # equal digests: nothing to read, even with a tolerance


def test_without_shard_rules_sharded_tensors_are_flagged_and_rules_suggested(captured):
    result = check_ranks(captured["port"])
    assert result.found and result.shard_rules == 0
    # the first sharded tensor in execution order: the column-parallel fc's weight
    first = result.first
    assert (first.site, first.role, first.arg, first.step, first.pass_) == (
        "blocks.0.mlp.fc#0", "weight", "weight", 0, "forward")
    assert first.ranks == [1] and first.details[0].reason == Reason.BITS
    text = render(result)
    assert all(len(line) <= 100 for line in text.splitlines())
    text = " ".join(text.split())
    assert 'add a [[shard]] rule for it (site = "blocks.0.mlp.fc", tensor = "weight"' in text
    assert "no [[shard]] rules were given" in text and "--map FILE" in text


def test_a_per_rank_dropout_is_found_at_the_dropouts_output(captured, tp_rules):
    bug = next(b for b in tp.BUGS if b.found_by == "ranks")
    assert bug.spec == CAPTURES["dropout_one_step"][0]
    manifest = captured["dropout"]
    for tolerance in (False, True):
        result = check_ranks(manifest, mapping=tp_rules, tolerance=tolerance)
        first = result.first
        assert result.found and result.verdict == "disagree"
        assert (first.site, first.role, first.arg, first.step, first.pass_) == (
            bug.site, bug.role, "0", 0, bug.pass_)
        assert first.ranks == [1]  # rank 0 is the copy every rank is held to
        # its input agreed: the dropout is where the replicas part
        assert result.per_rank == {1: result.disagreeing}
        assert [d.site for d in result.next][:2] == ["blocks.0.mlp#0", "blocks.0#0"]
    assert first.details[0].reason == Reason.TOLERANCE and result.read > 0
    text = render(check_ranks(manifest, mapping=tp_rules))
    assert ("replicas of a replicated tensor disagree first at blocks.0.mlp.dropout#0 output 0 "
            "(step 0, forward) on rank 1") in " ".join(text.split())
    assert "a per-rank random generator" in " ".join(text.split())


# ---- a model of this file: a gradient left out of the all-reduce


def test_a_gradient_not_all_reduced_is_found_at_its_weight_gradient(captured, tmp_path):
    rules = tmp_path / "dp.toml"
    rules.write_text(DP_SHARD_RULES, encoding="utf-8")
    manifest = captured["dp"]
    result = check_ranks(manifest, mapping=rules)
    first = result.first
    # forward agrees at step 0 (same weights); fc2's averaged gradients agree; fc1's do not
    assert (first.site, first.role, first.arg, first.step, first.pass_) == (
        "fc1#0", "weight_grad", "weight", 0, "backward")
    assert first.ranks == [1] and not first.details[0].norms_close
    text = " ".join(render(result).split())
    assert "a gradient not all-reduced" in text and "--tolerance" not in text
    # and the ranks step apart: step 1's fc1 weights differ next
    assert ("fc1#0", "weight", 1) in {(d.site, d.role, d.step) for d in result.next}


# ---- what a rank can get wrong, on traces written here (no processes)


def _manifest(folder, world: int, record, meta: dict | None = None, *,
              summary: bool = False) -> object:
    """A manifest of ``world`` rank files, each written by ``record(writer, rank)``."""
    from layerdiff.trace.manifest import rank_path, write_manifest

    out = folder / "port.h5"
    for rank in range(world):
        with TraceWriter(rank_path(out, rank), summary=summary,
                         meta={"rank": rank, "world_size": world, **(meta or {})}) as w:
            record(w, rank)
    write_manifest(out, [rank_path(out, rank) for rank in range(world)])
    return out


def _three_ranks(writer: TraceWriter, rank: int) -> None:
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)

    def output(module: str, value) -> None:
        with writer.site(module) as site:
            writer.record(site, "output", value)

    output("same", x)
    output("rounded", x * np.float32(1 + 2e-7) if rank == 1 else x)  # an ulp or so
    output("both", x + rank)                                   # ranks 1 and 2 differ
    output("cut", x[:, :2] if rank == 1 else x)                # another shape on rank 1
    with writer.site("sched") as site:                         # a plain value
        writer.record(site, "input", 0.1 * (1 + (rank == 1)), arg="lr")
    if rank != 1:
        output("skipped", x)                                   # rank 1 skips this call
    output("wide", x.astype(np.float64) if rank == 2 else x)   # another dtype on rank 2
    if rank == 2:
        output("added", x)                                     # only rank 2 calls it


def test_every_way_a_replica_can_differ_is_named_with_its_ranks(tmp_path):
    manifest = _manifest(tmp_path, 3, _three_ranks)
    calls = []
    result = check_ranks(manifest, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (15, 15)  # rank 0's 7 records on ranks 1 and 2, and rank 2's extra
    found = {d.site: {detail.rank: detail.reason for detail in d.details}
             for d in [result.first, *result.next]}
    assert result.first.site == "rounded#0" and result.first.ranks == [1]  # bit for bit
    assert result.first.details[0].norms_close and "check again with --tolerance" in " ".join(
        render(result).split())
    assert found == {"rounded#0": {1: Reason.BITS}, "both#0": {1: Reason.BITS, 2: Reason.BITS},
                     "cut#0": {1: Reason.SHAPE}, "sched#0": {1: Reason.VALUE},
                     "skipped#0": {1: Reason.MISSING}, "wide#0": {2: Reason.DTYPE}}
    assert result.per_rank == {1: 5, 2: 3} and result.records == 8 and result.read == 0
    # within tolerance the ulp passes, and nothing else does
    judged = check_ranks(manifest, tolerance=True)
    assert judged.first.site == "both#0" and judged.first.ranks == [1, 2]
    assert judged.within == 1 and judged.per_rank == {1: 4, 2: 3}
    assert judged.first.details[0].reason == Reason.TOLERANCE
    text = " ".join(render(judged).split())
    assert "disagree first at both#0 output 0 (step 0, forward) on ranks 1, 2: rank 1: out of " \
           "tolerance" in text
    everything = [result.first, *result.next]
    whys = {d.site: d.details[-1].why for d in everything}
    assert whys["cut#0"] == "shape (3,4) on rank 0, (3,2) on rank 1"
    assert whys["wide#0"] == "float32 on rank 0, float64 on rank 2"
    assert whys["skipped#0"] == "rank 1 has no such record"
    assert whys["sched#0"] == "value 0.1 on rank 0, 0.2 on rank 1"


def test_the_mapping_the_capture_recorded_gives_the_shard_rules(tmp_path):
    # capture --weights-from REF --map F records F's text in every rank file
    rules = '[[shard]]\nsite = "fc"\ntensor = "output"\ndim = 0\n'
    recorded = {"weights": {"mapping": {"name": "port.map.toml", "text": rules}}}

    def record(writer: TraceWriter, rank: int) -> None:
        with writer.site("fc") as site:
            writer.record(site, "input", np.ones(4, np.float32))
            writer.record(site, "output", np.full(2, rank, np.float32))  # rank r's part

    manifest = _manifest(tmp_path, 2, record, recorded)
    result = check_ranks(manifest)
    assert not result.found and (result.records, result.sharded) == (1, 1)
    assert "port.map.toml (recorded in port.h5's rank files at capture)" in " ".join(
        render(result).split())
    # a mapping given wins: one without rules takes the sharded output as replicated
    given = tmp_path / "given.toml"
    given.write_text("version = 1\n", encoding="utf-8")
    assert check_ranks(manifest, mapping=given).first.site == "fc#0"


@pytest.mark.parametrize("summary", [False, True], ids=["data", "summary"])
def test_records_without_a_digest_are_compared_by_their_bytes(tmp_path, summary):
    import h5py

    from layerdiff.trace import schema
    from layerdiff.trace.manifest import rank_path, write_manifest

    def record(writer: TraceWriter, rank: int) -> None:
        for module, value in (("kept", np.arange(6.0)), ("changed", np.arange(6.0) + rank)):
            with writer.site(module) as site:
                writer.record(site, "output", value)

    manifest = _manifest(tmp_path, 2, record, summary=summary)
    for rank in range(2):  # as a writer that computes no digests leaves them
        with h5py.File(rank_path(manifest, rank), "r+") as h5:
            column = h5[f"{schema.INDEX_GROUP}/digest"]
            column[...] = np.array([""] * column.shape[0], dtype=object)
            del h5.attrs[schema.ATTR_TABLE_DIGEST.format(table=schema.INDEX_GROUP)]
    write_manifest(manifest, [rank_path(manifest, rank) for rank in range(2)])
    for tolerance in (False, True):
        result = check_ranks(manifest, tolerance=tolerance)
        assert result.first.site == "changed#0" and result.disagreeing == 1
        # no data in a summary trace: the index statistics are what there is to compare
        assert result.first.details[0].reason == (
            Reason.STATISTICS if summary else Reason.TOLERANCE if tolerance else Reason.BITS)
        assert result.read == (0 if summary else 2)


# ---- bad input, and the command line


def test_a_one_process_trace_is_refused_in_one_sentence(tmp_path, captured):
    single = tmp_path / "one.h5"
    with TraceWriter(single) as writer, writer.site("layer") as site:
        writer.record(site, "output", torch.ones(3).numpy())
    with pytest.raises(TraceError) as error:
        check_ranks(single)
    message = str(error.value)
    assert "one-process trace" in message and "manifest" in message
    assert "--nproc N" in message and "torchrun" in message and message.count(". ") == 0
    rank_file = captured["port"].with_name("port.rank1.h5")
    with pytest.raises(TraceError, match=r"rank 1's file of a 2-rank capture, not its "
                                         r"manifest: .* \(.*port\.h5\)"):
        check_ranks(rank_file)


def test_the_command_exits_0_1_2_and_writes_json(captured, tp_rules, ranks_cli, tmp_path):
    good = captured["port"]
    bad = captured["dropout"]
    agree = ranks_cli(good, "--map", tp_rules)
    assert agree.exit_code == 0, agree.output
    assert agree.output.splitlines()[-1].startswith("agree: all ")
    out = tmp_path / "ranks.json"
    disagree = ranks_cli(bad, "--map", tp_rules, "--tolerance", "--json", out)
    assert disagree.exit_code == 1, disagree.output
    report = json.loads(out.read_text())
    assert report["verdict"] == "disagree" and report["mode"] == "tolerance"
    assert {k: report["first"][k] for k in ("site", "step", "pass", "role", "arg", "ranks")} == {
        "site": "blocks.0.mlp.dropout#0", "step": 0, "pass": "forward", "role": "output",
        "arg": "0", "ranks": [1]}
    assert report["per_rank"] == {"1": report["disagreeing"]} and report["next"]
    stdout = ranks_cli(bad, "--map", tp_rules, "--json", "-")
    assert stdout.exit_code == 1 and json.loads(stdout.output)["mode"] == "bitwise"
    refused = ranks_cli(good.with_name("port.rank0.h5"))
    assert refused.exit_code == 2 and refused.output.startswith("error: ")
    assert "Traceback" not in refused.output
