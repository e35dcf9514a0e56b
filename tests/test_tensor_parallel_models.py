"""The bundled tensor-parallel port (reference_models.tensor_parallel) against its single-process
reference, run on 2 gloo processes: the faithful port computes what the reference computes, the
planted bugs show where the catalog says, and the shard rules say which tensors are cut."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from layerdiff.capture.run import run_case
from layerdiff.errors import CaseError
from reference_models import tensor_parallel as tp
from tests import sharded_ranks
from tests.gloo import needs_gloo

WORLD = 2
CASES = ("port", "bug_bias_before_allreduce", "bug_dropout_per_rank")
RANKS_TIMEOUT = 180  # seconds for the 2 ranks to record every case

# the embeddings' inputs are integers: their full backward hooks see no input gradient
pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing")




# ---- recording a run: every module's input, output and gradients, every parameter gradient


class Recorder(sharded_ranks.Recorder):
    """Every named module's inputs, outputs and gradients, every parameter gradient (the
    sharded ports' recorder), and the model's logits. Keys: (step, module path, role, index),
    in the order the records were made."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__(model)
        self.logits: list[torch.Tensor] = []
        self.handles.append(model.register_forward_hook(
            lambda module, args, output: self.logits.append(output.detach().clone())))

    def run(self, case) -> dict:
        run_case(case, observer=self)
        for handle in self.handles:
            handle.remove()
        return {"records": self.records, "logits": self.logits, "losses": self.losses}


def record(case) -> dict:
    return Recorder(case.model).run(case)


RULES = tp.mapping()


def shard_dim(site: str, role: str) -> int | None:
    """The dim along which the port cuts this record, by the bundled shard rules; None when it
    is replicated. A rule on input / output covers their gradients, on a parameter its grad."""
    if role.endswith("_grad"):  # a parameter's gradient: (module, "bias_grad")
        rule = RULES.shard_rule(site, "weight_grad", role.removesuffix("_grad"))
    else:
        rule = RULES.shard_rule(site, role, "0")
    return rule.dim if rule else None


def gathered(ranks: list[dict], key: tuple) -> torch.Tensor:
    """The whole tensor of a record: the ranks' parts joined along the rule's dim, or rank 0's
    copy of a replicated one."""
    dim = shard_dim(key[1], key[2])
    parts = [run["records"][key] for run in ranks]
    return torch.cat(parts, dim=dim) if dim is not None else parts[0]


# ---- the 2-process run: each rank records every case once, the parent compares


class Extra(nn.Module):
    """A model the zoo lacks, from the port's parallel layers: a column-parallel then a
    row-parallel linear around tanh, on an input that needs its gradient. ``f`` False: the
    column-parallel layer forgets Megatron's ``f``, so its input gradient is a partial sum."""

    def __init__(self, rank: int, world: int, f: bool = True) -> None:
        super().__init__()
        self.up = tp.ColumnParallelLinear(6, 8, rank, world)
        self.down = tp.RowParallelLinear(8, 5, rank, world)
        self.f = f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = (self.up(x) if self.f else F.linear(x, self.up.weight, self.up.bias)).tanh()
        return self.down(hidden)


def extra_reference() -> tuple[nn.Sequential, torch.Tensor]:
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5)), torch.randn(3, 6)


def extra_run(rank: int, world: int, f: bool) -> dict:
    """The extra model on this rank's shards: its output, its input's gradient and the
    gradients of its parameters."""
    full, x = extra_reference()
    model = Extra(rank, world, f)
    with torch.no_grad():
        model.up.weight.copy_(tp.shard_of(full[0].weight, 0, rank, world))
        model.up.bias.copy_(tp.shard_of(full[0].bias, 0, rank, world))
        model.down.weight.copy_(tp.shard_of(full[2].weight, 1, rank, world))
        model.down.bias.copy_(full[2].bias)
    x.requires_grad_(True)
    out = model(x)
    (out * torch.arange(5.0)).sum().backward()
    return {"output": out.detach(), "input_grad": x.grad,
            **{name: p.grad for name, p in model.named_parameters()}}


def _rank_work(rank: int, world: int) -> dict:
    results = {name: record(getattr(tp, name)()) for name in CASES}
    results["extra"] = extra_run(rank, world, f=True)
    results["extra_without_f"] = extra_run(rank, world, f=False)
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> dict[str, list[dict]]:
    """For each case (and the extra model), what each of the 2 ranks recorded."""
    loaded = sharded_ranks.on_ranks(_rank_work, WORLD, tmp_path_factory.mktemp("tp"),
                                    timeout=RANKS_TIMEOUT)
    return {name: [run[name] for run in loaded] for name in loaded[0]}


@pytest.fixture(scope="module")
def reference() -> dict:
    return record(tp.reference())


def forward_keys(run: dict, step: int = 0) -> list[tuple]:
    """The forward records of one step, in the order they were made."""
    return [key for key in run["records"]
            if key[0] == step and key[2] in ("input", "output")]


# ---- one process


def test_port_in_one_process_equals_reference(reference):
    port = record(tp.port())
    assert port["records"].keys() == reference["records"].keys()
    for key, tensor in reference["records"].items():
        torch.testing.assert_close(port["records"][key], tensor, msg=lambda m, k=key: f"{k}: {m}")
    torch.testing.assert_close(port["logits"], reference["logits"])
    torch.testing.assert_close(port["losses"], reference["losses"])


def test_reference_repeats_itself_and_its_dropout_is_on(reference):
    again = record(tp.reference())
    for key, tensor in reference["records"].items():
        assert torch.equal(again["records"][key], tensor), key
    dropped = reference["records"][(0, "blocks.0.mlp.dropout", "output", 0)]
    kept = reference["records"][(0, "blocks.0.mlp.dropout", "input", 0)]
    zeroed = ((dropped == 0) & (kept != 0)).float().mean().item()
    assert 0.05 < zeroed < 0.15  # p = 0.1 of the elements dropped
    # the two steps draw different masks
    step1 = reference["records"][(1, "blocks.0.mlp.dropout", "output", 0)] == 0
    assert not torch.equal(dropped == 0, step1)


def test_a_world_size_that_does_not_divide_the_mlp_is_refused():
    with pytest.raises(CaseError, match=r"128 features, which do not split into 3 equal parts"):
        tp.ParallelMLP(0, 3)


# ---- two gloo processes


@needs_gloo
def test_faithful_port_matches_reference_on_two_ranks(ranks, reference):
    runs = ranks["port"]
    for rank, run in enumerate(runs):
        torch.testing.assert_close(run["logits"], reference["logits"], msg=f"rank {rank} logits")
        torch.testing.assert_close(run["losses"], reference["losses"], msg=f"rank {rank} loss")
    # every record, sharded ones joined along their rule's dim, for both steps and both passes:
    # activations, their gradients, parameters' gradients (fc's along dim 0, proj's along 1)
    assert runs[0]["records"].keys() == reference["records"].keys()
    for key, tensor in reference["records"].items():
        torch.testing.assert_close(gathered(runs, key), tensor, msg=lambda m, k=key: f"{k}: {m}")
    fc_grads = [run["records"][(0, "blocks.0.mlp.fc", "weight_grad", 0)] for run in runs]
    assert [grad.shape for grad in fc_grads] == [(tp.HIDDEN // WORLD, tp.WIDTH)] * WORLD
    torch.testing.assert_close(torch.cat(fc_grads, dim=0),
                               reference["records"][(0, "blocks.0.mlp.fc", "weight_grad", 0)])


@needs_gloo
def test_faithful_port_replicas_agree_bit_for_bit_and_shards_differ(ranks):
    first, second = (run["records"] for run in ranks["port"])
    sharded = [key for key in first if shard_dim(key[1], key[2]) is not None]
    # fc output and its gradient, act input/output and their gradients, proj input and its
    # gradient, fc weight/bias grads and proj weight grad: 2 blocks x 2 steps x 11
    assert len(sharded) == 2 * 2 * 11
    for key, tensor in first.items():
        if key in sharded:
            assert not torch.equal(tensor, second[key]), key
        else:
            assert torch.equal(tensor, second[key]), key


@needs_gloo
def test_bias_before_allreduce_first_shows_at_first_proj_forward(ranks, reference):
    runs = ranks["bug_bias_before_allreduce"]
    keys = forward_keys(reference)
    wrong = [key for key in keys
             if not torch.allclose(gathered(runs, key), reference["records"][key])]
    assert wrong[0] == (0, "blocks.0.mlp.proj", "output", 0)
    # by (W - 1) times the bias, exactly what the extra copies add
    bias = tp.reference().model.blocks[0].mlp.proj.bias.detach()
    torch.testing.assert_close(gathered(runs, wrong[0]) - reference["records"][wrong[0]],
                               (WORLD - 1) * bias.expand(tp.BATCH, tp.LENGTH, -1))
    # not a replica bug: the ranks agree on every replicated record
    for key in keys:
        if shard_dim(key[1], key[2]) is None:
            assert torch.equal(runs[0]["records"][key], runs[1]["records"][key]), key


@needs_gloo
def test_dropout_per_rank_first_replica_disagreement_is_first_dropout_output(ranks, reference):
    first, second = (run["records"] for run in ranks["bug_dropout_per_rank"])
    replicated = [key for key in first if shard_dim(key[1], key[2]) is None]
    disagree = [key for key in replicated if not torch.equal(first[key], second[key])]
    assert disagree[0] == (0, "blocks.0.mlp.dropout", "output", 0)
    assert torch.equal(first[(0, "blocks.0.mlp.dropout", "input", 0)],
                       second[(0, "blocks.0.mlp.dropout", "input", 0)])
    # rank 0 draws the reference's mask; rank 1 another one
    key = (0, "blocks.0.mlp.dropout", "output", 0)
    torch.testing.assert_close(first[key], reference["records"][key])
    assert not torch.equal(second[key] == 0, reference["records"][key] == 0)


@needs_gloo
def test_extra_model_input_gradient_needs_the_f_all_reduce(ranks):
    full, x = extra_reference()
    x.requires_grad_(True)
    out = full(x)
    (out * torch.arange(5.0)).sum().backward()
    runs = ranks["extra"]
    for rank, run in enumerate(runs):
        torch.testing.assert_close(run["output"], out.detach(), msg=f"rank {rank} output")
        torch.testing.assert_close(run["input_grad"], x.grad, msg=f"rank {rank} input grad")
        torch.testing.assert_close(run["down.bias"], full[2].bias.grad)
    torch.testing.assert_close(torch.cat([run["up.weight"] for run in runs]), full[0].weight.grad)
    torch.testing.assert_close(torch.cat([run["down.weight"] for run in runs], dim=1),
                               full[2].weight.grad)
    # without f the forward is right, but each rank's input gradient is its own partial sum:
    # they disagree, and only their sum is the whole gradient
    partial = ranks["extra_without_f"]
    torch.testing.assert_close(partial[0]["output"], out.detach())
    assert not torch.allclose(partial[0]["input_grad"], partial[1]["input_grad"])
    torch.testing.assert_close(partial[0]["input_grad"] + partial[1]["input_grad"], x.grad)
